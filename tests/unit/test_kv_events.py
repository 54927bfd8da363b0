"""KV cache events (engine/kv_events.py): a reader that applies them in order on top of a snapshot has
the worker's picture, by tier, at every point; trimmed history sends it back to a snapshot."""

from __future__ import annotations

import random

import pytest

from engine.checkpoint import preset_config
from engine.kv_events import KVEvents
from engine.kv_layout import KVLayout
from engine.model import build_model
from pdserve.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def test_since_returns_events_in_order_in_pieces_and_none_once_trimmed():
    log = KVEvents(capacity=6)
    assert log.since(0, 10) == (0, [])
    log.stored("device", [1, 2, 3])
    log.stored("device", [4])  # joins the batch
    log.removed("device", [1])
    assert log.since(0, 10) == (5, [("device", True, [1, 2, 3, 4]), ("device", False, [1])])
    assert log.since(2, 2) == (4, [("device", True, [3, 4])])
    assert log.since(4, 10) == (5, [("device", False, [1])])
    assert log.since(5, 10) == (5, [])
    log.stored("host", [7, 8, 9])  # 8 events held > 6: the first batch goes
    assert log.since(0, 10) is None and log.since(3, 10) is None
    assert log.since(4, 10) == (8, [("device", False, [1]), ("host", True, [7, 8, 9])])
    assert log.since(99, 10) is None  # a number this log never gave


def _apply(picture, events):
    for tier, stored, hashes in events:
        (picture[tier].update if stored else picture[tier].difference_update)(hashes)


@pytest.mark.parametrize("with_tiers", [False, True], ids=["device", "tiers"])
def test_events_on_a_snapshot_give_the_cache(engine_factory, tmp_path, with_tiers):
    from engine.kv_tiers import TierConfig

    layout = KVLayout.for_model(preset_config("tiny"), block_size=4)
    per_block = layout.num_layers * layout.block_bytes
    tiers = TierConfig(host_bytes=6 * per_block, disk_dir=str(tmp_path), disk_bytes=30 * (per_block + 64))
    engine = engine_factory(build_model(preset_config("tiny"), seed=0), device="cpu", num_blocks=24,
                            block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                            **({"tiers": tiers} if with_tiers else {}))
    last, held = engine.cache_snapshot(limit=10_000)
    picture = {t: set(held.get(t, ())) for t in ("device", "host", "disk")}
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(5, 40))] for _ in range(12)]
    for i in range(30):
        engine.generate([prompts[rng.randrange(len(prompts))]], SamplingParams(max_tokens=3, ignore_eos=True))
        if engine.tiers is not None:
            engine.tiers.flush()
        if i % 3 == 0:  # read in small pieces
            while True:
                got = engine.kv_events.since(last, 7)
                assert got is not None
                last, events = got
                _apply(picture, events)
                if not events:
                    break
            now = engine.cache_snapshot(limit=10_000)[1]
            assert {t: picture[t] for t in now} == {t: set(h) for t, h in now.items()}
    assert picture["device"]
    if with_tiers:
        assert picture["host"] and picture["disk"]
