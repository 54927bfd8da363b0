"""The staged CUDA upload (pinned buffers reused many times within one tensor) lands the same bytes as
a direct copy, dtype converted on the GPU."""

import pytest
import torch
from safetensors.torch import save_file

from engine.weight_upload import MappedFile, Uploader

pytestmark = pytest.mark.gpu


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"a.bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16),
            "b.f32": torch.randn(3, 4, 2, generator=g), "d.i64": torch.arange(6).view(2, 3)}


def test_staged_upload_many_chunks_equal_direct_copy(tmp_path):
    file = tmp_path / "m.safetensors"
    big = {"w": torch.randn(1000, 333).to(torch.bfloat16), **_tensors()}
    save_file(big, str(file))
    # tiny chunks and two buffers: every buffer is reused many times within one tensor
    up = Uploader(torch.device("cuda"), chunk_bytes=4096, num_buffers=2)
    with MappedFile(file) as mapped:
        outs = {n: up.to(mapped.view(n), torch.float32 if t.is_floating_point() else t.dtype)
                for n, t in big.items()}
    up.finish()
    for n, t in big.items():
        assert torch.equal(outs[n].cpu(), t.to(outs[n].dtype))
