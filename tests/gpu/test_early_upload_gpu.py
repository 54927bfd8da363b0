"""The early upload through the real CUDA driver: started before torch is imported (as ``pdserve serve``
does), every tensor's bytes land on the GPU exactly, torch reads them in place, the load from the arena
equals the load from the files, and releasing the arena gives its memory back to the device."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from engine import early_upload
from engine.weights import load_weights

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["mapped", "register", "read"])
def test_started_before_torch_is_imported_the_bytes_are_exact_and_freed(tmp_path, mode):
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(1000, 333, generator=g).to(torch.bfloat16),
               "b.f32": torch.randn(3, 4, 2, generator=g), "i": torch.arange(6).view(2, 3),
               "e": torch.empty(0)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    torch.save(tensors, tmp_path / "want.pt")
    code = f"""
import os, sys
os.environ["PDSERVE_EARLY_UPLOAD"] = {mode!r}
from engine import early_upload
early_upload.CHUNK = 4096  # many pieces, every buffer reused
up = early_upload.start({str(tmp_path)!r}, 0)
assert up is not None and 'torch' not in sys.modules
import torch
assert up.wait(60), up.error
assert up.method == {mode!r}
want = torch.load({str(tmp_path / 'want.pt')!r})
for name, t in want.items():
    got = up.view({str(tmp_path / 'model.safetensors')!r}, name)
    assert got.is_cuda and got.dtype == t.dtype and torch.equal(got.cpu(), t), name
torch.cuda.synchronize()
free = torch.cuda.mem_get_info()[0]
up.release()
assert torch.cuda.mem_get_info()[0] > free and early_upload.current() is None
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr


def test_a_model_loaded_from_the_arena_equals_one_loaded_from_the_files(make_checkpoint, monkeypatch):
    from engine.config import ModelConfig
    from engine.model import build_model

    model_dir = make_checkpoint("qwen2")
    config = ModelConfig.from_pretrained(model_dir)
    dev = torch.device("cuda")
    want = build_model(config, init="meta")
    want.allocate_fused(dev, torch.bfloat16)
    monkeypatch.setattr(early_upload, "_current", None)
    load_weights(want, model_dir, dtype=torch.bfloat16, device=dev)
    up = early_upload.start(model_dir, torch.cuda.current_device())
    assert up is not None and up.wait(60), up.error
    got = build_model(config, init="meta")
    got.allocate_fused(dev, torch.bfloat16)
    load_weights(got, model_dir, dtype=torch.bfloat16, device=dev)
    assert early_upload.current() is None and up._base == 0  # released by the load
    for (name, a), (_, b) in zip(want.state_dict().items(), got.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
