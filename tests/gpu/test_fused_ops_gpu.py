"""``engine.fused_ops`` (Triton) on the GPU.

* Kernel level, bf16 and fp16, decode and prefill sizes of the llama3-8b shape: RoPE bit-exact against
  ``apply_rope`` (q and k as strided views of the fused qkv output), the residual add bit-exact,
  RMSNorm and silu*up equal to the torch ops except for rare 1-2 ulp flips (their float32 sum of
  squares / ``exp`` is not torch's); the same kernels captured in a CUDA graph and replayed on new
  inputs give the eager kernels' bits.
* Model level (``small`` preset, flashinfer): ``fuse_projections()`` turns the kernels on by itself on
  CUDA bf16 (off with ``PDSERVE_FUSED_OPS=0``); teacher-forced prefill + decode logits with the kernels
  within bf16 rounding of the torch ops', greedy tokens identical where the choice is clear; CUDA-graph
  decode with the kernels equal to eager decode with the kernels.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from engine import fused_ops
from engine.attention import backend_geometry
from engine.attention.base import BatchSpec
from engine.attention.flashinfer_backend import FlashInferAttentionBackend
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

    def step():
        a = fused_ops.rms_norm(x, w, EPS)
        b = fused_ops.add_rms_norm(x, delta, w, EPS)
        q, k = fused_ops.rope_qk(qkv[:, :4096].view(t, 32, 128), qkv[:, 4096:5120].view(t, 8, 128), cos, sin)
        return a, b, q, k, fused_ops.silu_mul(gate_up)

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


def _teacher_forced(model, backend, prompts, forced, block=16):
    """Prefill all prompts in one step, then decode the batch feeding ``forced[i][step]``; logits
    ``[steps + 1, B, vocab]``."""
    cfg = model.config
    steps = len(forced[0]) - 1
    layout = KVLayout.for_model(cfg, block_size=block, dtype=torch.bfloat16)
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


def test_model_logits_with_and_without_fused_ops(small):
    cfg = small.config
    kw = dict(backend_geometry(cfg, block_size=16), device=DEV, dtype=torch.bfloat16)
    g = random.Random(5)
    prompts = [[g.randrange(3, cfg.vocab_size) for _ in range(n)] for n in (5, 37, 64, 300)]
    forced = [[g.randrange(3, cfg.vocab_size) for _ in range(13)] for _ in prompts]
    try:
        assert small.set_fused_ops(False) is False
        ref = _teacher_forced(small, FlashInferAttentionBackend(**kw), prompts, forced)
        assert small.set_fused_ops(True) is True
        out = _teacher_forced(small, FlashInferAttentionBackend(**kw), prompts, forced)
    finally:
        small.set_fused_ops()
    assert _rel(out, ref) < 1e-2, "fused-op logits differ from the torch ops' beyond bf16 rounding"
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
