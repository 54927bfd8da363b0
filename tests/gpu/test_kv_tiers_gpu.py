"""KV tiers on the GPU: the CUDA path of engine/kv_tiers (pinned host slots, the offload stream's gather and
device->host copies, the load thread's host->device copies and scatter on its own stream, the events
between them) moves every byte exactly, and an engine gives the same tokens with tiers on as off under
heavy eviction, steps synchronous and launched ahead; blocks come back from host and disk; nothing leaks.

The engine test runs the model in float32: in bf16 a recomputed prefix (tiers off) rounds differently
from the bytes that were computed once and kept (tiers on), and near-tied greedy choices then flip
between the two runs whatever the tiers do; the byte test checks the bf16 path exactly.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.kv_layout import KVLayout
from engine.kv_tiers import KVTiers, TierConfig
from pdserve.sampling import SamplingParams

ANSWER = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_every_byte_comes_back_through_host_and_disk(tmp_path):
    layout = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16",
                      memory="cuda", model_fingerprint="bytes-test")
    cache = torch.randn(layout.cache_shape(64), dtype=torch.bfloat16, device="cuda")
    original = cache.clone()
    per_block = layout.num_layers * layout.block_bytes
    config = TierConfig(host_bytes=8 * per_block, disk_dir=str(tmp_path), disk_bytes=64 * (per_block + 64))
    tiers = KVTiers(config, layout, cache)
    try:
        assert tiers.host.slots.is_pinned()
        hashes = [1000 + b for b in range(40)]
        for at in range(0, 40, 10):  # batches of 10 through an 8-slot host tier: spills and evictions
            tiers.offload([(b, hashes[b]) for b in range(at, at + 10)])
            cache[:, at:at + 10].zero_()  # the blocks' new owners overwrite them
        tiers.flush()
        assert tiers.lookup(hashes) == ["host" if h in tiers.host else "disk" for h in hashes]
        assert {"host", "disk"} <= set(tiers.lookup(hashes))
        targets = list(range(63, 23, -1))  # other blocks, in another order
        assert tiers.start_load(hashes, targets).result() == 40
        torch.cuda.synchronize()
        for b, t in zip(range(40), targets, strict=True):
            assert torch.equal(cache[:, t], original[:, b]), b
        assert tiers.stats.hit_blocks["host"] > 0 and tiers.stats.hit_blocks["disk"] > 0
        assert tiers.leak_report() is None
    finally:
        tiers.close()


def _engine(path, overlap: bool, tiers: TierConfig | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cuda", num_blocks=48, block_size=16,
                                  max_num_seqs=4, max_num_batched_tokens=512, overlap_steps=overlap,
                                  **({"tiers": tiers} if tiers is not None else {})))


def _conversations(engine: LLMEngine, vocab: int, sessions: int = 8, turns: int = 4) -> list[list[int]]:
    rng = random.Random(3)
    history = [[rng.randrange(3, vocab) for _ in range(70)] for _ in range(sessions)]
    out = []
    for _ in range(turns):
        for s in range(sessions):
            tokens = engine.generate([history[s]], ANSWER)[0]
            out.append(tokens)
            history[s] = history[s] + tokens + [rng.randrange(3, vocab) for _ in range(20)]
    return out


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "ahead"])
def test_tiers_on_equal_tiers_off_under_eviction(make_checkpoint, tmp_path, overlap):
    path = make_checkpoint(preset="small")  # float32 (the module docstring says why)
    off = _engine(path, overlap)
    expected = _conversations(off, off.model_config.vocab_size)
    per_block = off.kv_layout.num_layers * off.kv_layout.block_bytes
    tiers = TierConfig(host_bytes=24 * per_block, disk_dir=str(tmp_path), disk_bytes=400 * (per_block + 64))
    on = _engine(path, overlap, tiers)
    assert on.tiers.host.slots.is_pinned()
    assert _conversations(on, on.model_config.vocab_size) == expected
    stats = on.tiers.stats
    assert stats.hit_blocks["host"] > 0 and stats.hit_blocks["disk"] > 0 and stats.load_failures == 0
    on.tiers.flush()
    assert on.leak_report() is None and off.leak_report() is None
    on.close()
