"""``engine.fused_ops`` under Triton's interpreter (CPU tensors) against the torch ops it replaces.

Not collected by itself: ``test_fused_ops.py`` runs this file in a pytest subprocess with
``TRITON_INTERPRET=1`` (triton reads it when it imports and again when it launches, so it cannot be
switched on for a part of one process without leaving triton interpreted for the rest of it).
bf16 is rounded in the kernels by integer arithmetic, exactly what the GPU's ``cvt.rn`` does; the
interpreter's own float->bf16 cast would truncate.

RoPE and the residual add are bit-exact by construction (the same float32 products and sums, each
rounded like torch). RMSNorm's sum of squares and silu's ``exp`` are computed differently from
torch's (order, library), so those may differ by an ulp or two in a rare element; the tests allow that and
nothing more. The GPU versions of these checks are ``tests/gpu/test_fused_ops_gpu.py``.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from engine.checkpoint import preset_config
from engine.model import MLP, Attention, RMSNorm, apply_rope, build_model

DTYPES = [torch.bfloat16, torch.float16]
BF16 = [torch.bfloat16]
EPS = 1e-5
# The interpreter runs each program in Python (~10 ms each): prefill-sized T=1000 cases in bf16, the
# production dtype, only.


assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/unit/test_fused_ops.py"


@pytest.fixture(scope="module")
def fo():
    from engine import fused_ops

    return fused_ops


def ulp_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    """(elements that differ, largest difference in units of the last place) of two same-sign-ish
    fp16/bf16 tensors, by their bit patterns."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    # sign-magnitude -> a monotonic integer line
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    d = (ia - ib).abs()
    return int((d > 0).sum()), int(d.max()) if d.numel() else 0


def assert_close_ulp(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Bit-exact except for rare flips: a float32 intermediate that is not torch's (the sum of squares,
    rsqrt, exp) rounds the other way in a few elements, and the product with the weight / up that
    follows can turn that 1 ulp into 2. A wrong kernel differs almost everywhere."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    n, worst = ulp_diff(out, ref)
    assert worst <= 2, f"{what}: {n} elements differ, up to {worst} ulp"
    assert n <= max(8, out.numel() // 200), f"{what}: {n} of {out.numel()} elements differ"


def _norm_ref(x, weight):
    norm = RMSNorm(x.shape[-1], EPS)
    norm.weight = torch.nn.Parameter(weight, requires_grad=False)
    return norm(x)


@pytest.mark.parametrize(
    "dtype,t,hidden",
    [(d, t, h) for d in DTYPES for t, h in [(1, 64), (5, 96), (3, 4096)]] + [(torch.bfloat16, 1000, 32)],
)
def test_rms_norm_and_add_rms_norm(fo, dtype, t, hidden):
    g = torch.Generator().manual_seed(t * hidden)
    x = (torch.randn(t, hidden, generator=g) * 3).to(dtype)
    delta = torch.randn(t, hidden, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)

    assert_close_ulp(fo.rms_norm(x, weight, EPS), _norm_ref(x, weight), "rms_norm")

    res, ref_res = x.clone(), x.clone()
    out = fo.add_rms_norm(res, delta, weight, EPS)
    ref_res.add_(delta)
    assert torch.equal(res, ref_res), "the residual must become x + delta, bit for bit, in place"
    assert_close_ulp(out, _norm_ref(ref_res, weight), "add_rms_norm")


def _cos_sin(positions: torch.Tensor, half: int, dtype):
    inv = 1.0 / (500000.0 ** (torch.arange(0, 2 * half, 2).float() / (2 * half)))
    freqs = (positions[:, None].float() * inv)[:, None, :]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


ROPE_SHAPES = {  # t, heads, kv_heads, head_dim, q/k as views of a fused qkv output
    "decode-gqa-strided": (1, 4, 2, 16, True),
    "batch-gqa-strided": (5, 32, 8, 128, True),  # the llama3-8b head layout
    "mha-contiguous": (37, 8, 8, 64, False),
    "hd128-strided-odd-heads": (9, 6, 3, 128, True),
}


@pytest.mark.parametrize(
    "dtype,t,heads,kv_heads,head_dim,fused",
    [(d, *shape) for d in DTYPES for shape in ROPE_SHAPES.values()] + [(torch.bfloat16, 1000, 2, 1, 8, True)],
    ids=[f"{name}-{d}" for d in ("bf16", "fp16") for name in ROPE_SHAPES] + ["long-strided-bf16"],
)
def test_rope_qk_bit_exact(fo, dtype, t, heads, kv_heads, head_dim, fused):
    g = torch.Generator().manual_seed(t + heads)
    if fused:  # q and k as views of one [T, q + k + v] matmul output, as Attention.forward has them
        qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
        q = qkv[:, : heads * head_dim].view(t, heads, head_dim)
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
        assert t == 1 or k.stride(0) == qkv.shape[1], "k is a strided view"
    else:
        q = torch.randn(t, heads, head_dim, generator=g).to(dtype)
        k = torch.randn(t, kv_heads, head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 131072, (t,), generator=g)
    cos, sin = _cos_sin(positions, head_dim // 2, dtype)
    q_before, k_before = q.clone(), k.clone()
    q_out, k_out = fo.rope_qk(q, k, cos, sin)
    assert torch.equal(q_out, apply_rope(q, cos, sin))
    assert torch.equal(k_out, apply_rope(k, cos, sin))
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert torch.equal(q, q_before) and torch.equal(k, k_before), "inputs must be left alone"


def _store_reference(q, k, v, cos, sin, cache, slots, src):
    """What Attention.forward does without the fused store: RoPE of q and k, then the flashinfer
    backend's store (cat, gather for graph padding, scatter into the slot rows)."""
    q_ref, k_ref = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    rows = torch.cat([k_ref, v])
    if src is not None:
        rows = rows.index_select(0, src)
    cache.index_copy_(0, slots, rows)
    return q_ref


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["decode-gqa-strided", "batch-gqa-strided", "hd128-strided-odd-heads"])
@pytest.mark.parametrize("padded", [False, True], ids=["exact", "graph-padding"])
def test_rope_store_kv_bit_exact(fo, dtype, name, padded):
    t, heads, kv_heads, head_dim, _ = ROPE_SHAPES[name]
    g = torch.Generator().manual_seed(t * 7 + heads)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = (part.view(t, -1, head_dim) for part in qkv.split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
    cos, sin = _cos_sin(torch.randint(0, 131072, (t,), generator=g), head_dim // 2, dtype)
    slot_rows = 4 * t + 8
    k_slots = torch.randperm(slot_rows // 2, generator=g)[:t] * 2  # distinct; v one row after (any layout)
    slots = torch.cat([k_slots, k_slots + 1])
    src = None
    if padded:  # the last rows are graph padding: row 0's slots again, row 0's key and value
        real = max(1, t // 2)
        pad = torch.arange(t) >= real
        k_slots = torch.where(pad, k_slots[0], k_slots)
        slots = torch.cat([k_slots, k_slots + 1])
        src = torch.cat([torch.where(pad, 0, torch.arange(t)), torch.where(pad, t, torch.arange(t) + t)])
    cache_ref = torch.randn(slot_rows, kv_heads, head_dim, generator=g).to(dtype)
    cache = cache_ref.clone()
    q_ref = _store_reference(q, k, v, cos, sin, cache_ref, slots, src)
    before = qkv.clone()
    q_out = fo.rope_store_kv(q, k, v, cos, sin, cache, slots, src)
    assert torch.equal(q_out, q_ref) and q_out.is_contiguous()
    assert torch.equal(cache, cache_ref), "the cache rows written (and only those) must match"
    assert torch.equal(qkv, before), "inputs must be left alone"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k,bias", [(48, 2048, False), (30, 100, True), (7, 1030, False), (64, 64, True),
                                    (20, 9000, True)])
def test_gemv_against_linear(dtype, n, k, bias):
    """engine.gemv: x @ w.T (+ b) for one row, even shapes and masked ones (N not a multiple of the rows
    per program, K not of the K step), within the rounding of one bf16/fp16 result of a float32 sum."""
    from engine import gemv as gv

    g = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    out = gv.gemv(x, w, b, **(gv.LONG_ROW_CONFIG if k > gv.LONG_ROW else {}))  # as linear picks it
    assert out.shape == (1, n) and out.dtype == dtype
    tol = (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10) * (ref.abs() + 1e-3)
    assert bool(((out.float() - ref).abs() <= tol).all()), float((out.float() - ref).abs().max())
    # linear: a single row through the kernel, more rows through F.linear unchanged
    assert torch.equal(gv.linear(x, w, b), out)
    x3 = torch.randn(3, k, generator=g).to(dtype)
    assert torch.equal(gv.linear(x3, w, b), F.linear(x3, w, b))
    with pytest.raises(ValueError):
        gv.gemv(x3, w)


@pytest.mark.parametrize(
    "dtype,t,inter",
    [(d, t, i) for d in DTYPES for t, i in [(1, 100), (3, 1500), (2, 14336)]] + [(torch.bfloat16, 1000, 48)],
)
def test_silu_mul(fo, dtype, t, inter):
    g = torch.Generator().manual_seed(t * inter)
    gate_up = (torch.randn(t, 2 * inter, generator=g) * 4).to(dtype)
    gate, up = gate_up.clone().split(inter, dim=-1)
    ref = F.silu(gate, inplace=True).mul_(up)  # MLP.forward's torch path
    out = fo.silu_mul(gate_up)
    assert out.is_contiguous()
    assert_close_ulp(out, ref, "silu_mul")


def test_shape_errors(fo):
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        fo.rms_norm(x, torch.ones(4, dtype=torch.bfloat16), EPS)
    with pytest.raises(ValueError):
        fo.add_rms_norm(x, torch.zeros(2, 4, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16), EPS)
    with pytest.raises(ValueError):
        fo.silu_mul(torch.zeros(2, 7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="fp16/bf16"):
        fo.silu_mul(torch.zeros(2, 8))
    with pytest.raises(ValueError, match="fp16/bf16"):
        fo.rms_norm(torch.zeros(2, 8), torch.ones(8), EPS)
    q = torch.zeros(2, 4, 8, dtype=torch.bfloat16)
    cos = torch.zeros(2, 1, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        fo.rope_qk(q, q[:1], cos, cos)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_model_forward_with_fused_ops(fo, dtype, torch_single_thread):
    """The tiny model (GQA, fused projections) with the interpreted kernels against its torch ops."""
    from engine.attention import backend_geometry, get_backend
    from engine.attention.base import BatchSpec
    from engine.kv_layout import KVLayout

    cfg = preset_config("tiny")
    model = build_model(cfg, dtype=dtype)
    exact = copy.deepcopy(model).float()  # the float32 reference on the same (rounded) weights
    model.fuse_projections()
    assert all(m.kernels is None for m in model.modules() if isinstance(m, RMSNorm)), "CPU: torch ops"
    layout = KVLayout.for_model(cfg, block_size=16, dtype=dtype)
    backend = get_backend("torch", device="cpu", **backend_geometry(cfg, block_size=16))
    spec = BatchSpec(query_lens=[7, 1, 12], context_lens=[0, 0, 0], block_tables=[[0], [1], [2]])
    ids = torch.randint(3, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    # then one decode step at batch 1: the projections and lm_head go through engine.gemv
    step = BatchSpec(query_lens=[1], context_lens=[7], block_tables=[[0]])
    outs, steps, caches = [], [], []
    with torch.inference_mode():
        kv = KVLayout.for_model(cfg, block_size=16, dtype=torch.float32).allocate(4, device="cpu")
        exact(ids, backend.plan(spec).positions, kv, backend.plan(spec))
        meta = backend.plan(step)
        exact_step = exact.compute_logits(exact(ids[:1], meta.positions, kv, meta))
        for on in (False, True):
            assert model.set_fused_ops(on) is on
            assert (model.linear is not F.linear) is on, "the batch-1 product comes with the kernels"
            kv = layout.allocate(4, device="cpu")
            meta = backend.plan(spec)
            outs.append(model.compute_logits(model(ids, meta.positions, kv, meta)))
            meta = backend.plan(step)
            steps.append(model.compute_logits(model(ids[:1], meta.positions, kv, meta)))
            caches.append(kv)
    rel = float((outs[1] - outs[0]).norm() / outs[0].norm())
    assert rel < 1e-2, rel
    # At batch 1 the products are engine.gemv's, whose float32 sums round differently from the CPU's
    # matmul in some elements: as close to the float32 model as the torch ops are, not equal to them.
    errs = [float((out - exact_step).norm() / exact_step.norm()) for out in steps]
    assert errs[1] < 1.5 * errs[0] + 1e-3, errs
    # RoPE is bit-exact and the norms rarely differ by an ulp, so keys are (nearly) identical; the
    # fused store wrote this step's keys and values where the backend's own store would have.
    k_rel = float((caches[1].float() - caches[0].float()).norm() / caches[0].float().norm())
    assert k_rel < 1e-2, k_rel
    assert bool(caches[1][:, 0, :, 7].abs().sum(-1).sum(-1).gt(0).all()), "the decode step's slot is written"


def test_set_fused_ops_choice(monkeypatch):
    model = build_model(preset_config("tiny"), dtype=torch.bfloat16)
    model.fuse_projections()
    assert model.set_fused_ops() is False, "CPU weights never use the kernels"
    assert model.set_fused_ops(True) is True
    assert all(m.kernels is not None for m in model.modules() if isinstance(m, (RMSNorm, Attention, MLP)))
    model.to(torch.float32)  # .to() drops the choice with the fused projections
    assert all(m.kernels is None for m in model.modules() if isinstance(m, (RMSNorm, Attention, MLP)))

    from engine import fused_ops

    assert fused_ops.available("cuda", torch.bfloat16) and fused_ops.available("cuda", torch.float16)
    assert not fused_ops.available("cuda", torch.float32)
    assert not fused_ops.available("cpu", torch.bfloat16)
    monkeypatch.setenv("PDSERVE_FUSED_OPS", "0")
    assert not fused_ops.available("cuda", torch.bfloat16)
