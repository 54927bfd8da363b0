"""Decode through captured CUDA graphs equals eager decode (flashinfer backend, bf16 ``small`` model).

Both sides start from the same prefilled cache and decode greedily, step by step, for batch sizes
that fill a bucket exactly and that need padding; the graph side must produce the same tokens, logits
within bf16 rounding, and a cache that holds the same K/V (padding rows wrote nothing of their own).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import backend_geometry
from engine.attention.base import BatchSpec
from engine.attention.flashinfer_backend import FlashInferAttentionBackend
from engine.checkpoint import preset_config
from engine.cuda_graphs import CudaGraphConfig, DecodeGraphRunner
from engine.kv_layout import KVLayout
from engine.model import build_model

DEV = "cuda"
BLOCK = 16


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module", params=[{}, {"num_kv_heads": 2, "head_dim": 128}],
                ids=["small-group2-cudacore", "small-group4-hd128-tensorcore"])
def model(request):
    cfg = preset_config("small", dtype="bfloat16", **request.param)
    return build_model(cfg, device=DEV, dtype=torch.bfloat16)


@pytest.mark.parametrize("mode", ["all-at-start", "lazy", "idle"])
@pytest.mark.parametrize("batch", [3, 8, 1])
def test_graph_decode_equals_eager(model, batch, mode):
    """all-at-start: every bucket before the first step. lazy: only bucket 1 at start; a larger batch's
    bucket is captured in the first step that needs it (its warm-up on the live cache). idle: bucket 1
    at start, the rest by ``capture_idle`` on a scratch block (block 0 here) before the first step.
    Each is then replayed token-exact."""
    at_start = 8 if mode == "all-at-start" else 1
    cfg = model.config
    kw = dict(backend_geometry(cfg, block_size=BLOCK), device=DEV, dtype=torch.bfloat16)
    eager, graphed = FlashInferAttentionBackend(**kw), FlashInferAttentionBackend(**kw)
    layout = KVLayout.for_model(cfg, block_size=BLOCK, dtype="bfloat16")
    steps, per_seq = 20, 16
    cache_e = layout.allocate(per_seq * batch + 1, device=DEV)
    g = random.Random(batch)
    blocks = list(range(1, per_seq * batch + 1))  # block 0 is left to the capture's dummy token
    g.shuffle(blocks)
    tables = [blocks[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    lens = [g.randrange(1, 150) for _ in range(batch)]
    prompts = [[g.randrange(3, cfg.vocab_size) for _ in range(n)] for n in lens]

    runner = DecodeGraphRunner(
        model,
        graphed,
        None,
        CudaGraphConfig(max_batch=8, max_model_len=per_seq * BLOCK, buckets=(1, 2, 4, 8),
                        capture_at_start=at_start, capture_when_idle=mode == "idle"),
    )
    with torch.inference_mode():
        spec = BatchSpec(query_lens=lens, context_lens=[0] * batch, block_tables=tables)
        meta = eager.plan(spec)
        hidden = model(
            torch.tensor([t for p in prompts for t in p], device=DEV), meta.positions, cache_e, meta
        )
        first = model.compute_logits(hidden[torch.tensor(lens, device=DEV).cumsum(0) - 1]).argmax(-1)
        cache_g = cache_e.clone()
        runner.kv_cache = cache_g
        runner.capture()
        assert sorted(runner.graphs) == [b for b in (1, 2, 4, 8) if b <= at_start]
        while runner.capture_idle(0) is not None:  # "idle": the rest, largest first
            pass
        assert runner.idle_captures == ([8, 4, 2] if mode == "idle" else [])
        assert not runner.idle_pending()
        torch.cuda.synchronize()
        assert torch.equal(cache_g[:, 1:], cache_e[:, 1:])  # the captures wrote into block 0 only
        assert runner.bucket(batch) >= batch
        tok_e, tok_g = first.clone(), first.clone()
        for step in range(steps):
            spec = BatchSpec(
                query_lens=[1] * batch, context_lens=[n + step for n in lens], block_tables=tables
            )
            assert runner.can_run(spec)
            meta = eager.plan(spec)
            logits_e = model.compute_logits(model(tok_e, meta.positions, cache_e, meta))
            logits_g = model.compute_logits(runner.run(tok_g.tolist(), spec))
            assert logits_g.shape == logits_e.shape
            assert _rel(logits_g, logits_e) < 1e-2, f"step {step}: graph logits differ from eager"
            tok_e, tok_g = logits_e.argmax(-1), logits_g.argmax(-1)
            assert torch.equal(tok_e, tok_g), f"step {step}: greedy tokens differ"
    torch.cuda.synchronize()
    assert _rel(cache_g[:, 1:].float(), cache_e[:, 1:].float()) < 1e-2
    lazy = [runner.bucket(batch)] if mode == "lazy" and runner.bucket(batch) > at_start else []
    assert runner.lazy_captures == lazy


def test_can_run_only_decode_batches_within_limits(model):
    cfg = model.config
    backend = FlashInferAttentionBackend(**backend_geometry(cfg, block_size=BLOCK), device=DEV,
                                         dtype=torch.bfloat16)
    layout = KVLayout.for_model(cfg, block_size=BLOCK, dtype="bfloat16")
    runner = DecodeGraphRunner(
        model,
        backend,
        layout.allocate(8, device=DEV),
        CudaGraphConfig(max_batch=2, max_model_len=64, buckets=(1, 2)),
    )
    runner.capture()
    ok = BatchSpec(query_lens=[1, 1], context_lens=[3, 60], block_tables=[[1], [2, 3, 4, 5]])
    assert runner.can_run(ok)
    assert not runner.can_run(BatchSpec(query_lens=[2], context_lens=[0], block_tables=[[1]]))
    assert not runner.can_run(BatchSpec(query_lens=[1] * 3, context_lens=[0] * 3, block_tables=[[1]] * 3))
    assert not runner.can_run(BatchSpec(query_lens=[1], context_lens=[64], block_tables=[[1, 2, 3, 4, 5]]))
