"""First look on a device machine: flashinfer and nixl import, the attention kernels build, the
engine.fused_ops Triton kernels compile and match the torch ops, NIXL registers VRAM. Prints one line
per check and exits non-zero if any failed (run by bench/device_run.sh smoke)."""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def check(name, fn):
    t0 = time.perf_counter()
    try:
        detail = fn()
        print(f"OK   {name} ({time.perf_counter() - t0:.1f}s) {detail or ''}", flush=True)
        return True
    except Exception:
        print(f"FAIL {name} ({time.perf_counter() - t0:.1f}s)\n{traceback.format_exc()}", flush=True)
        return False


def fi_import():
    import flashinfer

    return flashinfer.__version__


def fi_kernels(head_dim: int, kv_heads: int):
    import torch

    from engine.attention.base import BatchSpec
    from engine.attention.flashinfer_backend import FlashInferAttentionBackend
    from engine.attention.torch_backend import TorchAttentionBackend

    kw = dict(num_heads=32, num_kv_heads=kv_heads, head_dim=head_dim, block_size=16, device="cuda")
    fi, ref = FlashInferAttentionBackend(dtype=torch.bfloat16, **kw), TorchAttentionBackend(**kw)
    spec = BatchSpec(
        query_lens=[1, 1, 50], context_lens=[30, 5, 20], block_tables=[[3, 4], [7], [0, 1, 2, 5, 6]]
    )
    q = torch.randn(52, 32, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(52, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cache = torch.randn(8, 2, 16, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    c2 = cache.clone()
    a = fi.forward(q, k, v, cache, fi.plan(spec))
    b = ref.forward(q.float(), k.float(), v.float(), c2.float(), ref.plan(spec))
    err = float((a.float() - b).norm() / b.norm())
    assert err < 1e-2, err
    return f"rel err vs fp32 torch backend {err:.1e}"


def fused_ops_kernels():
    import torch
    import torch.nn.functional as F
    import triton

    from engine import fused_ops
    from engine.model import apply_rope

    assert fused_ops.available("cuda", torch.bfloat16), "triton missing or PDSERVE_FUSED_OPS=0"
    dt, t = torch.bfloat16, 5
    x, d = torch.randn(t, 4096, device="cuda", dtype=dt), torch.randn(t, 4096, device="cuda", dtype=dt)
    w = torch.rand(4096, device="cuda", dtype=dt)
    ref = F.rms_norm(x.float(), (4096,), eps=1e-5).to(dt).mul_(w)
    norm_err = float((fused_ops.rms_norm(x, w, 1e-5).float() - ref.float()).abs().max())
    res = x.clone()
    fused_ops.add_rms_norm(res, d, w, 1e-5)
    assert torch.equal(res, x + d)
    qkv = torch.randn(t, 6144, device="cuda", dtype=dt)
    q, k = qkv[:, :4096].view(t, 32, 128), qkv[:, 4096:5120].view(t, 8, 128)
    ang = torch.rand(t, 1, 64, device="cuda") * 100
    cos, sin = ang.cos().to(dt), ang.sin().to(dt)
    qo, ko = fused_ops.rope_qk(q, k, cos, sin)
    assert torch.equal(qo, apply_rope(q, cos, sin)) and torch.equal(ko, apply_rope(k, cos, sin))
    gu = torch.randn(t, 2 * 14336, device="cuda", dtype=dt)
    g, u = gu.clone().split(14336, -1)
    silu_err = float((fused_ops.silu_mul(gu).float() - F.silu(g).mul_(u).float()).abs().max())
    return f"triton {triton.__version__}; rope bit-exact; max |diff| norm {norm_err:.1e}, silu {silu_err:.1e}"


def nixl_vram():
    import torch

    from kvtransfer.nixl_backend import import_nixl

    agent_cls, config_cls, mod = import_nixl()
    agent = agent_cls("smoke", config_cls(backends=["UCX"]))
    t = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    reg = agent.register_memory([(t.data_ptr(), t.numel(), 0, "")], "VRAM")
    agent.deregister_memory(reg)
    return f"{mod}: plugins {agent.get_plugin_list()}"


def main() -> int:
    ok = check("import flashinfer", fi_import)
    ok &= check("flashinfer kernels bf16 head_dim 128 (JIT build)", lambda: fi_kernels(128, 8))
    ok &= check("flashinfer kernels bf16 head_dim 64 (JIT build)", lambda: fi_kernels(64, 8))
    ok &= check("engine.fused_ops Triton kernels (compile + vs torch)", fused_ops_kernels)
    ok &= check("nixl agent + VRAM registration", nixl_vram)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
