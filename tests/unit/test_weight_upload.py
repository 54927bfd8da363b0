"""Zero-copy views of a memory-mapped safetensors file equal what safetensors reads, for every dtype
the engine loads; the uploader converts dtypes on the target; a bad file is a ModelLoadError."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.errors import ModelLoadError
from engine.weight_upload import MappedFile, Uploader


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"a.bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16),
            "b.f32": torch.randn(3, 4, 2, generator=g), "c.f16": torch.randn(11, generator=g).half(),
            "d.i64": torch.arange(6).view(2, 3), "e.empty": torch.empty(0, 4)}


def test_views_equal_safetensors_and_upload_converts(tmp_path):
    file = tmp_path / "m.safetensors"
    save_file(_tensors(), str(file))
    up = Uploader(torch.device("cpu"))
    with MappedFile(file) as mapped, safe_open(str(file), framework="pt") as f:
        for name in f.keys():
            want = f.get_tensor(name)
            view = mapped.view(name)
            assert view.dtype == want.dtype and view.shape == want.shape and torch.equal(view, want)
            out = up.to(view, torch.float32) if want.is_floating_point() else up.to(view, want.dtype)
            assert torch.equal(out, want.to(out.dtype))
            assert want.numel() == 0 or out.data_ptr() != view.data_ptr()  # a copy: the mapping may close
    up.finish()


def test_truncated_file_is_model_load_error(tmp_path):
    file = tmp_path / "bad.safetensors"
    file.write_bytes(b"\x10\x00")
    with pytest.raises(ModelLoadError, match="bad.safetensors"):
        MappedFile(file)


def test_close_in_background_unmaps_on_a_thread(tmp_path, caplog):
    import threading

    file = tmp_path / "m.safetensors"
    save_file(_tensors(), str(file))
    with MappedFile(file, close_in_background=True) as mapped:
        copy = mapped.view("b.f32").clone()
    for t in [t for t in threading.enumerate() if t.name == "munmap"]:
        t.join(10)
    assert mapped._mm.closed
    assert torch.equal(copy, _tensors()["b.f32"])
    held = MappedFile(file)
    view = held.view("a.bf16")
    with caplog.at_level("WARNING", logger="engine.weight_upload"):
        held.close(background=True)  # a live view: the unmap is refused, logged, the mapping kept
        for t in [t for t in threading.enumerate() if t.name == "munmap"]:
            t.join(10)
    assert not held._mm.closed and "still in use" in caplog.text
    assert torch.equal(view, _tensors()["a.bf16"])
    del view
    held._mm.close()
