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
