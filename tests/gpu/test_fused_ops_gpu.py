"""``engine.fused_ops`` (Triton) on the GPU.

* Kernel level, bf16 and fp16, decode and prefill sizes of the llama3-8b shape: RoPE bit-exact against
  ``apply_rope`` (q and k as strided views of the fused qkv output), and with the KV cache write
  bit-exact against the backend's store (graph padding rows included), the residual add bit-exact,
  ``engine.gemv`` within one rounding of the float32 product on every 8B matrix,
  RMSNorm and silu*up equal to the torch ops except for rare 1-2 ulp flips (their float32 sum of
  squares / ``exp`` is not torch's); the same kernels captured in a CUDA graph and replayed on new
  inputs give the eager kernels' bits.
* Model level (``small`` preset, flashinfer): ``fuse_projections()`` turns the kernels on by itself on
  CUDA bf16 (off with ``PDSERVE_FUSED_OPS=0``); teacher-forced prefill + decode logits with the kernels
  within bf16 rounding of the torch ops', greedy tokens identical where the choice is clear; CUDA-graph
  decode with the kernels equal to eager decode with the kernels.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F

from engine import fused_ops
from engine.attention import backend_geometry
from engine.attention.base import BatchSpec
from engine.attention.flashinfer_backend import FlashInferAttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.checkpoint import preset_config
from engine.cuda_graphs import CudaGraphConfig, DecodeGraphRunner
from engine.kv_layout import KVLayout
from engine.model import MLP, Attention, RMSNorm, apply_rope, build_model

DEV = "cuda"
EPS = 1e-5
DTYPES = [torch.bfloat16, torch.float16]
TOKENS = [1, 7, 512, 4096]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _ulps(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    """(elements that differ, largest difference in units of the last place) by bit patterns."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    d = (ia - ib).abs()
    return int((d > 0).sum()), int(d.max())


def _close_ulp(out, ref, what):
    """Bit-exact except for rare flips: a float32 intermediate that is not torch's (the sum of squares,
    rsqrt, exp) rounds the other way in a few elements, and the product with the weight / up that
    follows can turn that 1 ulp into 2. A wrong kernel differs almost everywhere."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    n, worst = _ulps(out, ref)
    assert worst <= 2, f"{what}: {n} elements differ, up to {worst} ulp"
    assert n <= max(8, out.numel() // 200), f"{what}: {n} of {out.numel()} elements differ"


def _norm_ref(x, weight):
    return F.rms_norm(x.float(), (x.shape[-1],), eps=EPS).to(x.dtype).mul_(weight)


def _cos_sin(positions, half, dtype):
    inv = 1.0 / (500000.0 ** (torch.arange(0, 2 * half, 2, device=DEV).float() / (2 * half)))
    freqs = (positions[:, None].float() * inv)[:, None, :]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t", TOKENS)
def test_norms(dtype, t):
    g = torch.Generator(DEV).manual_seed(t)
    x = (torch.randn(t, 4096, device=DEV, generator=g) * 3).to(dtype)
    delta = torch.randn(t, 4096, device=DEV, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(4096, device=DEV, generator=g)).to(dtype)
    _close_ulp(fused_ops.rms_norm(x, w, EPS), _norm_ref(x, w), "rms_norm")
    res, ref = x.clone(), x.clone()
    out = fused_ops.add_rms_norm(res, delta, w, EPS)
    ref.add_(delta)
    assert torch.equal(res, ref), "residual add in place must be x + delta, bit for bit"
    _close_ulp(out, _norm_ref(ref, w), "add_rms_norm")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (12, 4, 64), (8, 8, 64)])
def test_rope_bit_exact(dtype, t, heads, kv_heads, head_dim):
    g = torch.Generator(DEV).manual_seed(t + heads)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, device=DEV, generator=g).to(dtype)
    q = qkv[:, : heads * head_dim].view(t, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    positions = torch.randint(0, 131072, (t,), device=DEV, generator=g)
    cos, sin = _cos_sin(positions, head_dim // 2, dtype)
    q_out, k_out = fused_ops.rope_qk(q, k, cos, sin)
    assert torch.equal(q_out, apply_rope(q, cos, sin))
    assert torch.equal(k_out, apply_rope(k, cos, sin))
    q2, k2 = fused_ops.rope_qk(q.contiguous(), k.contiguous(), cos, sin)  # the unfused projections' case
    assert torch.equal(q2, q_out) and torch.equal(k2, k_out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t", [1, 7, 512])
@pytest.mark.parametrize("padded", [False, True], ids=["exact", "graph-padding"])
def test_rope_store_kv_bit_exact(dtype, t, padded):
    """RoPE plus the cache write in one kernel: the bytes of rope_qk then the flashinfer backend's store
    (cat, gather of graph padding rows, scatter into the paged cache's slot rows)."""
    heads, kv_heads, d = 32, 8, 128
    g = torch.Generator(DEV).manual_seed(t)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, device=DEV, generator=g).to(dtype)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1))
    cos, sin = _cos_sin(torch.randint(0, 131072, (t,), device=DEV, generator=g), d // 2, dtype)
    rows = 4 * t + 64
    k_slots = torch.randperm(rows // 2, device=DEV, generator=g)[:t] * 2
    real = max(1, t // 2) if padded else t
    pad = torch.arange(t, device=DEV) >= real
    k_slots = torch.where(pad, k_slots[0], k_slots)
    slots = torch.cat([k_slots, k_slots + 1])
    ar = torch.arange(t, device=DEV)
    src = torch.cat([torch.where(pad, 0, ar), torch.where(pad, t, ar + t)]) if padded else None
    cache_ref = torch.randn(rows, kv_heads, d, device=DEV, generator=g).to(dtype)
    cache = cache_ref.clone()
    q_ref, k_ref = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    kv = torch.cat([k_ref, v])
    cache_ref.index_copy_(0, slots, kv if src is None else kv.index_select(0, src))
    assert torch.equal(fused_ops.rope_store_kv(q, k, v, cos, sin, cache, slots, src), q_ref)
    assert torch.equal(cache, cache_ref)


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
                                 (1000, 100), (37, 4096)])
def test_gemv_against_cublas(n, k):
    """The batch-1 product on the 8B shapes (and masked ones): within one rounding of the float32
    product, as cuBLAS is, and deterministic."""
    from engine.gemv import gemv

    g = torch.Generator(DEV).manual_seed(n + k)
    x = torch.randn(1, k, device=DEV, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device=DEV, generator=g) / k ** 0.5).to(torch.bfloat16)
    exact = F.linear(x.float(), w.float())
    out = gemv(x, w)
    tol = 2 ** -8 * exact.abs() + 1e-3
    assert bool(((out.float() - exact).abs() <= tol).all())
    cublas_err = float((F.linear(x, w).float() - exact).norm() / exact.norm())
    assert _rel(out, exact) <= 1.5 * cublas_err + 1e-4
    assert torch.equal(gemv(x, w), out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t", TOKENS)
def test_silu_mul(dtype, t):
    g = torch.Generator(DEV).manual_seed(t)
    inter = 14336
    gate_up = (torch.randn(t, 2 * inter, device=DEV, generator=g) * 4).to(dtype)
    gate, up = gate_up.clone().split(inter, dim=-1)
    _close_ulp(fused_ops.silu_mul(gate_up), F.silu(gate, inplace=True).mul_(up), "silu_mul")


def test_kernels_in_a_cuda_graph():
    """Captured once, replayed on new inputs: the eager kernels' bits."""
    t, h, dt = 24, 4096, torch.bfloat16
    x, delta = torch.randn(t, h, device=DEV, dtype=dt), torch.randn(t, h, device=DEV, dtype=dt)
    w = torch.rand(h, device=DEV, dtype=dt)
    qkv = torch.randn(t, 48 * 128, device=DEV, dtype=dt)
    cos, sin = _cos_sin(torch.arange(t, device=DEV), 64, dt)
    gate_up = torch.randn(t, 2 * 1024, device=DEV, dtype=dt)
    cache = torch.zeros(4 * t, 8, 128, device=DEV, dtype=dt)
    slots = torch.cat([torch.arange(t, device=DEV) * 2, torch.arange(t, device=DEV) * 2 + 1])
    weight = torch.randn(4096, h, device=DEV, dtype=dt)

    def step():
        from engine.gemv import gemv

        a = fused_ops.rms_norm(x, w, EPS)
        b = fused_ops.add_rms_norm(x, delta, w, EPS)
        q, k = fused_ops.rope_qk(qkv[:, :4096].view(t, 32, 128), qkv[:, 4096:5120].view(t, 8, 128), cos, sin)
        q2 = fused_ops.rope_store_kv(qkv[:, :4096].view(t, 32, 128), qkv[:, 4096:5120].view(t, 8, 128),
                                     qkv[:, 5120:].view(t, 8, 128), cos, sin, cache, slots, None)
        return a, b, q, k, fused_ops.silu_mul(gate_up), q2, cache.clone(), gemv(b[:1], weight)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in (1, 2):
        g = torch.Generator(DEV).manual_seed(seed)
        for buf in (x, delta, qkv, gate_up):
            buf.copy_(torch.randn(buf.shape, device=DEV, generator=g))
        x0 = x.clone()
        graph.replay()
        torch.cuda.synchronize()
        x_graph = x.clone()
        x.copy_(x0)
        ref = step()
        assert torch.equal(x_graph, x)
        for a, b in zip(outs, ref, strict=True):
            assert torch.equal(a, b)


# ---- model level -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small():
    cfg = preset_config("small", dtype="bfloat16")
    model = build_model(cfg, device=DEV, dtype=torch.bfloat16)
    model.fuse_projections()  # as ModelRunner does
    return model


def _kernels(model):
    return {m.kernels for m in model.modules() if isinstance(m, (RMSNorm, Attention, MLP))}


def test_fuse_projections_picks_the_kernels_on_cuda(small, monkeypatch):
    assert _kernels(small) == {fused_ops}
    monkeypatch.setenv("PDSERVE_FUSED_OPS", "0")
    assert small.set_fused_ops() is False and _kernels(small) == {None}
    monkeypatch.delenv("PDSERVE_FUSED_OPS")
    assert small.set_fused_ops() is True and _kernels(small) == {fused_ops}
    fp32 = build_model(preset_config("tiny"), device=DEV, dtype=torch.float32)
    fp32.fuse_projections()
    assert _kernels(fp32) == {None}, "float32 keeps the torch ops"


def _teacher_forced(model, backend, prompts, forced, block=16, dtype=torch.bfloat16):
    """Prefill all prompts in one step, then decode the batch feeding ``forced[i][step]``; logits
    ``[steps + 1, B, vocab]``."""
    cfg = model.config
    steps = len(forced[0]) - 1
    layout = KVLayout.for_model(cfg, block_size=block, dtype=dtype)
    per_seq = -(-(max(map(len, prompts)) + steps + 1) // block)
    cache = layout.allocate(per_seq * len(prompts), device=DEV)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    lens = [len(p) for p in prompts]
    out = []
    with torch.inference_mode():
        meta = backend.plan(BatchSpec(query_lens=lens, context_lens=[0] * len(prompts), block_tables=tables))
        hidden = model(torch.tensor([t for p in prompts for t in p], device=DEV), meta.positions, cache, meta)
        out.append(model.compute_logits(hidden[torch.tensor(lens, device=DEV).cumsum(0) - 1]))
        for step in range(steps):
            spec = BatchSpec(query_lens=[1] * len(prompts), context_lens=[n + step for n in lens],
                             block_tables=tables)
            meta = backend.plan(spec)
            ids = torch.tensor([f[step] for f in forced], device=DEV)
            out.append(model.compute_logits(model(ids, meta.positions, cache, meta)))
    return torch.stack(out)


@pytest.mark.parametrize("lens", [(5, 37, 64, 300), (300,)], ids=["batch4", "batch1-gemv"])
def test_model_logits_with_and_without_fused_ops(small, lens):
    """With the kernels (and at batch 1 engine.gemv's products) against the torch ops and cuBLAS.

    At batch 4 every product is cuBLAS's either way, so the logits agree within bf16 rounding. At batch
    1 the decode steps' products are engine.gemv's, whose float32 sums round differently from cuBLAS's
    in some elements; through 8 random layers that alone moves bf16 logits by ~1%, so there both are
    held against the float32 model instead: the kernels' error no larger than the torch ops' (within
    50%), and the same greedy tokens wherever the choice is clear."""
    cfg = small.config
    kw = dict(backend_geometry(cfg, block_size=16), device=DEV, dtype=torch.bfloat16)
    g = random.Random(5)
    prompts = [[g.randrange(3, cfg.vocab_size) for _ in range(n)] for n in lens]
    forced = [[g.randrange(3, cfg.vocab_size) for _ in range(13)] for _ in prompts]
    try:
        assert small.set_fused_ops(False) is False
        ref = _teacher_forced(small, FlashInferAttentionBackend(**kw), prompts, forced)
        assert small.set_fused_ops(True) is True
        out = _teacher_forced(small, FlashInferAttentionBackend(**kw), prompts, forced)
    finally:
        small.set_fused_ops()
    if len(lens) > 1:
        assert _rel(out, ref) < 1e-2, "fused-op logits differ from the torch ops' beyond bf16 rounding"
    else:
        small.set_fused_ops(False)  # a module reference (the kernels) does not deep-copy
        try:  # the same bf16 weights, float32 arithmetic, torch backend
            exact = copy.deepcopy(small).float()
        finally:
            small.set_fused_ops()
        geometry = {k: v for k, v in kw.items() if k != "dtype"}
        ref32 = _teacher_forced(exact, TorchAttentionBackend(**geometry), prompts, forced,
                                dtype=torch.float32)
        errs = [_rel(x.float(), ref32) for x in (ref, out)]
        assert errs[1] < 1.5 * errs[0] + 1e-3, f"float32 error: torch ops + cuBLAS, kernels + gemv {errs}"
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * (out - ref).abs().amax(-1)
    assert clear.float().mean() > 0.25, "test too weak: few steps with a clear greedy choice"
    assert torch.equal(out.argmax(-1)[clear], ref.argmax(-1)[clear])


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_graph_decode_with_fused_ops_equals_eager(small, batch):
    cfg = small.config
    assert _kernels(small) == {fused_ops}
    kw = dict(backend_geometry(cfg, block_size=16), device=DEV, dtype=torch.bfloat16)
    eager, graphed = FlashInferAttentionBackend(**kw), FlashInferAttentionBackend(**kw)
    layout = KVLayout.for_model(cfg, block_size=16, dtype=torch.bfloat16)
    steps, per_seq = 12, 16
    cache_e = layout.allocate(per_seq * batch + 1, device=DEV)
    g = random.Random(batch)
    blocks = list(range(1, per_seq * batch + 1))  # block 0: the capture's dummy token
    g.shuffle(blocks)
    tables = [blocks[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    lens = [g.randrange(1, 150) for _ in range(batch)]
    prompts = [[g.randrange(3, cfg.vocab_size) for _ in range(n)] for n in lens]
    runner = DecodeGraphRunner(small, graphed, None,
                               CudaGraphConfig(max_batch=8, max_model_len=per_seq * 16, buckets=(1, 2, 4, 8)))
    with torch.inference_mode():
        meta = eager.plan(BatchSpec(query_lens=lens, context_lens=[0] * batch, block_tables=tables))
        ids = torch.tensor([t for p in prompts for t in p], device=DEV)
        hidden = small(ids, meta.positions, cache_e, meta)
        first = small.compute_logits(hidden[torch.tensor(lens, device=DEV).cumsum(0) - 1]).argmax(-1)
        cache_g = cache_e.clone()
        runner.kv_cache = cache_g
        runner.capture()
        cache_g[:, 1:] = cache_e[:, 1:]
        tok_e, tok_g = first.clone(), first.clone()
        for step in range(steps):
            spec = BatchSpec(query_lens=[1] * batch, context_lens=[n + step for n in lens],
                             block_tables=tables)
            assert runner.can_run(spec)
            meta = eager.plan(spec)
            logits_e = small.compute_logits(small(tok_e, meta.positions, cache_e, meta))
            logits_g = small.compute_logits(runner.run(tok_g.tolist(), spec))
            assert _rel(logits_g, logits_e) < 1e-2, f"step {step}: graph logits differ from eager"
            tok_e, tok_g = logits_e.argmax(-1), logits_g.argmax(-1)
            assert torch.equal(tok_e, tok_g), f"step {step}: greedy tokens differ"
    torch.cuda.synchronize()
    assert _rel(cache_g[:, 1:].float(), cache_e[:, 1:].float()) < 1e-2
