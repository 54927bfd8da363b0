"""A worker's Prometheus metrics (pdserve/app/worker_metrics.py): the engine's counters as a scrape sees
them, equal to ``LLMEngine.stats``, with steps launched ahead counted apart."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.async_engine import EngineSnapshot
from engine.checkpoint import preset_config
from engine.model import build_model
from pdserve.app.worker_metrics import worker_registry
from pdserve.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _samples(registry) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("role", "worker")))
            out[(s.name, labels)] = s.value
    return out


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "ahead"])
def test_scrape_reports_the_engine_counters(engine_factory, ahead):
    engine = engine_factory(build_model(preset_config("tiny"), seed=0), device="cpu", num_blocks=64,
                            block_size=4, max_num_seqs=8, max_num_batched_tokens=32, overlap_steps=ahead)
    snapshot = EngineSnapshot()
    registry = worker_registry(role="decode", worker_id="d0", engine=engine,
                               aengine=SimpleNamespace(snapshot=snapshot))
    before = _samples(registry)
    assert before[("pdserve_worker_steps_total", ())] == 0
    assert before[("pdserve_worker_free_blocks", ())] == snapshot.free_blocks

    rng = random.Random(0)
    for i in range(5):
        prompt = [rng.randrange(3, 1000) for _ in range(9 + 3 * i)]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=6 + i, ignore_eos=True))
    engine.add_request("aborted", [5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.abort("aborted")
    while engine.has_unfinished():
        engine.step()
    engine.sync()

    got = _samples(registry)
    stats = engine.stats
    assert stats.steps > 0 and stats.generated_tokens >= sum(6 + i for i in range(5))
    assert got[("pdserve_worker_steps_total", ())] == stats.steps
    assert got[("pdserve_worker_steps_ahead_total", ())] == stats.steps_ahead
    assert (stats.steps_ahead > 0) == ahead  # only an engine launching ahead counts any
    assert got[("pdserve_worker_prompt_tokens_total", ())] == stats.prompt_tokens
    assert got[("pdserve_worker_generated_tokens_total", ())] == stats.generated_tokens
    assert got[("pdserve_worker_preemptions_total", ())] == stats.preemptions
    reasons = {dict(labels)["reason"]: v for (name, labels), v in got.items()
               if name == "pdserve_worker_finished_requests_total"}
    assert reasons == stats.finish_reasons and reasons.get("length") == 5


def test_scrape_reports_prefix_hits_by_tier_and_the_tiers_traffic(engine_factory, tmp_path):
    from engine.kv_layout import KVLayout
    from engine.kv_tiers import TierConfig

    layout = KVLayout.for_model(preset_config("tiny"), block_size=4)
    per_block = layout.num_layers * layout.block_bytes
    engine = engine_factory(build_model(preset_config("tiny"), seed=0), device="cpu", num_blocks=24,
                            block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                            tiers=TierConfig(host_bytes=4 * per_block, disk_dir=str(tmp_path),
                                             disk_bytes=100 * (per_block + 64)))
    registry = worker_registry(role="decode", worker_id="d0", engine=engine,
                               aengine=SimpleNamespace(snapshot=EngineSnapshot()))
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 1000) for _ in range(33)] for _ in range(4)]
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for _ in range(2):  # the second round finds its blocks in the tiers (4 x 9 blocks > 24 in the cache)
        for p in prompts:
            engine.generate([p], params)
    engine.generate([prompts[-1]], params)  # the last one still in the device cache
    engine.tiers.flush()

    got = _samples(registry)
    stats = engine.tiers.stats
    hit = {t: got[("pdserve_worker_prefix_cache_hit_tokens_total", (("tier", t),))]
           for t in ("device", "host", "disk")}
    assert hit["device"] == engine.block_manager.hits * 4 and hit["device"] > 0
    assert hit["host"] == stats.hit_blocks["host"] * 4 and hit["disk"] == stats.hit_blocks["disk"] * 4
    assert hit["host"] + hit["disk"] > 0
    for tier in ("host", "disk"):
        label = (("tier", tier),)
        assert got[("pdserve_worker_kv_tier_offload_bytes_total", label)] == stats.offloaded_bytes[tier]
        assert got[("pdserve_worker_kv_tier_onload_bytes_total", label)] == stats.loaded_bytes[tier]
        used, cap = engine.tiers.occupancy()[tier]
        assert got[("pdserve_worker_kv_tier_used_bytes", (("tier", tier),))] == used <= cap
        assert got[("pdserve_worker_kv_tier_capacity_bytes", (("tier", tier),))] == cap
    assert got[("pdserve_worker_kv_tier_load_failures_total", ())] == 0


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "ahead"])
def test_step_histograms_count_every_step(engine_factory, ahead):
    engine = engine_factory(build_model(preset_config("tiny"), seed=0), device="cpu", num_blocks=64,
                            block_size=4, max_num_seqs=8, max_num_batched_tokens=32, overlap_steps=ahead)
    registry = worker_registry(role="decode", worker_id="d0", engine=engine,
                               aengine=SimpleNamespace(snapshot=EngineSnapshot()))
    rng = random.Random(5)
    engine.generate([[rng.randrange(3, 1000) for _ in range(20)] for _ in range(3)],
                    SamplingParams(max_tokens=5, ignore_eos=True))
    engine.sync()
    got = _samples(registry)
    steps = engine.stats.steps
    assert steps > 0
    for what in ("seconds", "batch_size", "tokens"):
        name = f"pdserve_worker_step_{what}"
        assert got[(f"{name}_count", ())] == steps
        assert got[(f"{name}_bucket", (("le", "+Inf"),))] == steps
    assert got[("pdserve_worker_step_tokens_sum", ())] == 3 * 20 + 3 * 4  # prompts, then 4 decodes each
    assert got[("pdserve_worker_step_batch_size_bucket", (("le", "1.0"),))] <= steps
