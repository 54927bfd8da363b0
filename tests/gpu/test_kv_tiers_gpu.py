"""KV tiers on the GPU: the CUDA path of engine/kv_tiers (pinned host slots, the offload stream's gather and
device->host copies, the load thread's host->device copies on its own stream, the events between them)
gives the same tokens as tiers off under heavy eviction, bf16 with flashinfer and CUDA graphs, steps
synchronous and launched ahead; blocks come back from host and disk; nothing leaks."""

from __future__ import annotations

import random

import pytest

from engine.engine import EngineConfig, LLMEngine
from engine.kv_tiers import TierConfig
from pdserve.sampling import SamplingParams

ANSWER = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


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
    path = make_checkpoint(preset="small", dtype="bfloat16")
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
