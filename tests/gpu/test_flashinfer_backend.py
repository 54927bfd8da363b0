"""flashinfer attention against the torch backend on the GPU.

* Kernel level: random q/k/v and random paged caches, every kind of step (pure decode, fresh prompts,
  prompt chunks and prefix hits with cached context, decode + prefill mixed, single-token sequences
  out of order, a sliding window, GQA and MHA, head_dim 64 and 128), in bf16 and fp16. Both backends
  must write identical cache bytes, and their outputs must be within bf16 rounding of a float32
  reference (``||out - ref|| / ||ref||``).
* Model level: the ``small`` preset (head_dim 64) and ``tiny`` with head_dim 64 (flashinfer has no
  head_dim 16 kernels): prompts prefilled together, then decode steps; bf16 logits within bf16
  tolerance of the torch backend's and greedy tokens identical wherever the choice is not a near-tie.

flashinfer has no float32 kernels, so float32 models keep the torch backend (``get_backend("auto")``
checks this); the greedy comparison runs the bf16 model against the float32 reference, teacher-forced.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from engine.attention import backend_geometry
from engine.attention.base import BatchSpec
from engine.attention.flashinfer_backend import FlashInferAttentionBackend, supports
from engine.attention.torch_backend import TorchAttentionBackend
from engine.checkpoint import preset_config
from engine.kv_layout import KVLayout
from engine.model import build_model

DEV = "cuda"
STEPS = {  # (query_lens, context_lens)
    "decode": ([1, 1, 1, 1, 1], [0, 5, 17, 64, 300]),
    "prefill": ([7, 33, 16, 1], [0, 0, 0, 0]),
    "chunks_and_prefix_hits": ([20, 16, 3], [16, 48, 100]),
    "mixed": ([1, 1, 1, 40, 5, 1], [12, 77, 200, 0, 32, 9]),
    "decode_out_of_order": ([9, 1, 1, 30], [4, 50, 3, 0]),
}


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _random_step(name, heads, kv_heads, head_dim, block, dtype, window, seed):
    g = random.Random(seed)
    q_lens, ctx = STEPS[name]
    n_blocks = sum(-(-(c + q) // block) for q, c in zip(q_lens, ctx, strict=True)) + 8
    perm = list(range(n_blocks))
    g.shuffle(perm)
    tables, pos = [], 0
    for q, c in zip(q_lens, ctx, strict=True):
        need = -(-(c + q) // block)
        tables.append(perm[pos : pos + need])
        pos += need
    spec = BatchSpec(query_lens=q_lens, context_lens=ctx, block_tables=tables)
    torch.manual_seed(seed)
    t = sum(q_lens)
    q = torch.randn(t, heads, head_dim, device=DEV)
    k = torch.randn(t, kv_heads, head_dim, device=DEV)
    v = torch.randn(t, kv_heads, head_dim, device=DEV)
    cache = torch.randn(n_blocks, 2, block, kv_heads, head_dim, device=DEV)
    return spec, q, k, v, cache


# Each (dtype, head_dim, window, tensor-core decode) is one JIT-compiled kernel module on the device,
# so the grid is a chosen set rather than a full product.
SHAPES = [  # heads, kv_heads, head_dim, dtype, window
    (32, 8, 128, torch.bfloat16, None),  # the llama3-8b shape
    (8, 4, 64, torch.bfloat16, None),  # the small preset
    (8, 8, 64, torch.bfloat16, None),  # MHA
    (16, 2, 64, torch.bfloat16, None),  # group 8: tensor-core decode
    (32, 8, 128, torch.float16, None),
    (32, 8, 128, torch.bfloat16, 24),  # sliding window (Mistral)
]


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,dtype,window", SHAPES, ids=lambda x: str(x).replace("torch.", "")
)
@pytest.mark.parametrize("name", list(STEPS))
def test_kernels_match_torch_backend(name, heads, kv_heads, head_dim, dtype, window):
    block = 16
    spec, q, k, v, cache = _random_step(
        name,
        heads,
        kv_heads,
        head_dim,
        block,
        dtype,
        window,
        seed=zlib.crc32(f"{name}{heads}{head_dim}{window}".encode()) % 1000,
    )
    kw = dict(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block,
        device=DEV,
        sliding_window=window,
    )
    fi = FlashInferAttentionBackend(dtype=dtype, **kw)
    ref_backend = TorchAttentionBackend(**kw)
    # float32 reference on the same (rounded) inputs
    qd, kd, vd, cd = (x.to(dtype) for x in (q, k, v, cache))
    ref_cache = cd.float().clone()
    ref = ref_backend.forward(qd.float(), kd.float(), vd.float(), ref_cache, ref_backend.plan(spec))
    torch_cache = cd.clone()
    out_torch = ref_backend.forward(qd, kd, vd, torch_cache, ref_backend.plan(spec))
    fi_cache = cd.clone()
    out_fi = fi.forward(qd, kd, vd, fi_cache, fi.plan(spec))
    torch.cuda.synchronize()
    assert out_fi.shape == ref.shape and out_fi.dtype == dtype
    assert torch.isfinite(out_fi).all()
    assert torch.equal(fi_cache, torch_cache), "flashinfer wrote different cache bytes than the torch backend"
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    err_fi, err_torch = _rel(out_fi, ref), _rel(out_torch, ref)
    assert err_fi < tol, f"{name}: flashinfer rel err {err_fi:.2e} (torch backend {err_torch:.2e})"


@pytest.mark.parametrize("tensor_cores", [False, True])
@pytest.mark.parametrize("name", ["decode", "mixed"])
def test_decode_kernel_choice_both_paths(name, tensor_cores):
    """The 8B shape (GQA group 4) decodes on tensor cores by default; the CUDA-core kernel stays right."""
    spec, q, k, v, cache = _random_step(name, 32, 8, 128, 16, torch.bfloat16, None, seed=17)
    kw = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, device=DEV)
    fi = FlashInferAttentionBackend(dtype=torch.bfloat16, decode_tensor_cores=tensor_cores, **kw)
    assert fi.use_tensor_cores is tensor_cores
    assert FlashInferAttentionBackend(dtype=torch.bfloat16, **kw).use_tensor_cores  # the default at group 4
    ref_backend = TorchAttentionBackend(**kw)
    qd, kd, vd, cd = (x.bfloat16() for x in (q, k, v, cache))
    ref = ref_backend.forward(qd.float(), kd.float(), vd.float(), cd.float(), ref_backend.plan(spec))
    out = fi.forward(qd, kd, vd, cd.clone(), fi.plan(spec))
    assert _rel(out, ref) < 1e-2


def test_meta_dtype_learnt_from_first_forward():
    kw = dict(num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, device=DEV)
    fi = FlashInferAttentionBackend(**kw)  # no dtype: plans lazily at the first layer
    spec, q, k, v, cache = _random_step("mixed", 8, 2, 64, 16, torch.bfloat16, None, seed=3)
    out = fi.forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), cache.bfloat16(), fi.plan(spec))
    assert fi.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_supports_rejects_fp32_and_odd_head_dims():
    assert supports(head_dim=128, dtype=torch.bfloat16)
    assert not supports(head_dim=128, dtype=torch.float32)
    assert not supports(head_dim=16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fp16/bf16"):
        FlashInferAttentionBackend(num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, device=DEV)


# ---- model level -------------------------------------------------------------------------------
def teacher_forced(model, backend, prompts: list[list[int]], forced: list[list[int]], block: int = 16):
    """Prefill all prompts in one step, then decode the whole batch feeding ``forced[i][step]`` (the
    reference's own greedy tokens), so both runs see the same inputs at every step and a single near-tie
    cannot send them down different continuations. Returns logits ``[steps + 1, B, vocab]`` float32."""
    cfg = model.config
    dtype = next(model.parameters()).dtype
    steps = len(forced[0]) - 1
    layout = KVLayout(
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        block_size=block,
        dtype=dtype,
    )
    per_seq = -(-(max(map(len, prompts)) + steps + 1) // block)
    cache = layout.allocate(per_seq * len(prompts), device=DEV)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    lens = [len(p) for p in prompts]
    spec = BatchSpec(query_lens=lens, context_lens=[0] * len(prompts), block_tables=tables)
    out = []
    with torch.inference_mode():
        meta = backend.plan(spec)
        hidden = model(torch.tensor([t for p in prompts for t in p], device=DEV), meta.positions, cache, meta)
        out.append(model.compute_logits(hidden[torch.tensor(lens, device=DEV).cumsum(0) - 1]))
        for step in range(steps):
            spec = BatchSpec(
                query_lens=[1] * len(prompts), context_lens=[n + step for n in lens], block_tables=tables
            )
            meta = backend.plan(spec)
            ids = torch.tensor([f[step] for f in forced], device=DEV)
            out.append(model.compute_logits(model(ids, meta.positions, cache, meta)))
    return torch.stack(out)


def greedy_reference(model, prompts, steps):
    """Free-running greedy tokens of ``model`` (float32, torch backend): ``[B, steps + 1]``."""
    cfg = model.config
    kw = dict(backend_geometry(cfg, block_size=16), device=DEV)
    forced = [[0] * (steps + 1) for _ in prompts]
    for step in range(steps + 1):  # O(steps^2) but tiny models: re-run with the tokens known so far
        logits = teacher_forced(model, TorchAttentionBackend(**kw), prompts, forced)
        for i in range(len(prompts)):
            forced[i][step] = int(logits[step, i].argmax())
    return forced, logits


@pytest.mark.parametrize("preset,overrides", [("small", {}), ("tiny", {"head_dim": 64})])
def test_model_logits_and_greedy_tokens_match_torch_backend(preset, overrides):
    """bf16 flashinfer vs bf16 torch backend vs the float32 torch-backend reference (same weights).

    Teacher-forced on the float32 reference's greedy tokens: at every step flashinfer's logits are
    within bf16 rounding of the bf16 torch backend's, its greedy token equals the bf16 torch backend's
    wherever the reference's top-2 margin is clear of bf16 noise, and it agrees with the float32
    reference at least as often as the bf16 torch backend does."""
    cfg = preset_config(preset, dtype="float32", **overrides)
    ref_model = build_model(cfg, device=DEV, dtype=torch.float32)
    g = random.Random(7)
    prompts = [[g.randrange(3, cfg.vocab_size) for _ in range(n)] for n in (5, 37, 64, 130)]
    forced, ref = greedy_reference(ref_model, prompts, steps=16)
    model = build_model(cfg, device=DEV, dtype=torch.bfloat16)
    kw = dict(backend_geometry(cfg, block_size=16), device=DEV)
    log_t = teacher_forced(model, TorchAttentionBackend(**kw), prompts, forced)
    log_f = teacher_forced(model, FlashInferAttentionBackend(dtype=torch.bfloat16, **kw), prompts, forced)
    assert _rel(log_f, log_t) < 2e-2, "flashinfer logits differ from the torch backend's beyond bf16 rounding"
    top2 = ref.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]  # [steps + 1, B]
    noise = (log_t - ref).abs().amax(-1)  # bf16's own error at each step, per sequence
    clear = margin > 2 * noise
    tok_f, tok_t, tok_ref = log_f.argmax(-1), log_t.argmax(-1), ref.argmax(-1)
    assert clear.float().mean() > 0.25, (
        f"test too weak: {clear.float().mean():.0%} of steps have a clear choice"
    )
    assert torch.equal(tok_f[clear], tok_t[clear]), "greedy tokens differ where the choice is clear"
    agree_f = (tok_f == tok_ref).float().mean().item()
    agree_t = (tok_t == tok_ref).float().mean().item()
    assert agree_f >= agree_t - 0.05, (
        f"flashinfer agrees with fp32 on {agree_f:.0%}, torch bf16 on {agree_t:.0%}"
    )
