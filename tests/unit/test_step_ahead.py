"""Decode steps launched ahead (engine.step_ahead) give exactly a synchronous engine's outputs.

On CPU a launch computes the step at once, so nothing overlaps here, but every rule the GPU relies on
runs: placeholders filled from the previous step's sampled ids on the device, stops read one step late
(the extra token dropped), blocks of a finished or aborted request held until the step that writes them
is read, prefix-cache blocks registered only over real tokens, prompt chunks and admissions going ahead
beside the decodes, and the fall-back to synchronous steps where a step would preempt. Every test ends
with a leak check; tests/unit/test_engine.py also runs its whole module with steps launched ahead.
tests/gpu/test_engine_gpu.py checks the same on CUDA, where the steps do overlap.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from engine import step_ahead
from engine.async_engine import AsyncEngine
from engine.checkpoint import preset_config
from engine.engine import EngineConfig, LLMEngine
from engine.model import build_model
from engine.model_runner import PrevTokens
from engine.step_ahead import PLACEHOLDER
from pdserve.sampling import SamplingParams

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("torch_single_thread")]


@pytest.fixture(scope="module")
def model():
    return build_model(preset_config("tiny"), seed=0)


@pytest.fixture
def make(model, engine_factory):
    def make_engine(ahead: bool, **overrides) -> LLMEngine:
        cfg = dict(device="cpu", num_blocks=256, block_size=4, max_num_seqs=16, max_num_batched_tokens=64,
                   attention_backend="torch", overlap_steps=ahead)
        return engine_factory(model, **{**cfg, **overrides})

    return make_engine


class Launches:
    """Counts the runner's launches, and those fed by the step before (PrevTokens), on one engine;
    ``mixed`` counts launched steps that feed the next (``feeds_next``) with prompt tokens and samples
    in one batch. No launched step may hold a prefill-only request."""

    def __init__(self, engine: LLMEngine) -> None:
        self.total = self.ahead = self.identity = self.mixed = 0
        launch = engine.runner.launch

        def counted(batch, prev=None, **kw):
            self.total += 1
            if kw.get("feeds_next"):
                assert not any(s.seq.prefill_only for s in batch)
                self.mixed += any(s.num_tokens > 1 for s in batch) and any(s.samples for s in batch)
            if prev is not None:
                self.ahead += 1
                self.identity += prev.dst == prev.src == list(range(len(prev.dst)))
                for row, s in enumerate(batch):  # every placeholder row is fed from the device
                    if s.seq.tokens[s.context_len] == PLACEHOLDER:
                        assert row in prev.dst
            else:
                assert all(PLACEHOLDER not in s.seq.tokens for s in batch)
            return launch(batch, prev, **kw)

        engine.runner.launch = counted


def prompts(lengths, seed=0, vocab=1024):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def drive(engine: LLMEngine, requests, *, arrivals: dict[int, list[str]] | None = None,
          aborts: dict[int, list[str]] | None = None, calls: dict[int, object] | None = None,
          ) -> dict[str, list]:
    """Add ``requests`` (id -> (prompt, params)), those in ``arrivals`` only at that step number, abort
    those in ``aborts`` at theirs, call ``calls[n](engine)`` before step n; step to the end. id -> its
    StepOutputs (requests added by a call included)."""
    arrivals, aborts, calls = arrivals or {}, aborts or {}, calls or {}
    later = {rid for ids in arrivals.values() for rid in ids}
    for rid, (prompt, params) in requests.items():
        if rid not in later:
            engine.add_request(rid, prompt, params)
    outs: dict[str, list] = {rid: [] for rid in requests}
    n = 0
    while engine.has_unfinished() or n <= max([*arrivals, *aborts, *calls, 0]):
        for rid in arrivals.get(n, []):
            engine.add_request(rid, *requests[rid])
        for rid in aborts.get(n, []):
            engine.abort(rid)
        if n in calls:
            calls[n](engine)
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        n += 1
    return outs


def summary(outs):
    return {rid: ([t for o in seq for t in o.new_token_ids], seq[-1].finish_reason if seq else None,
                  [lp for o in seq for lp in (o.new_logprobs or [])], seq[-1].text if seq else None)
            for rid, seq in outs.items()}


def both(make, requests, **kw):
    """Run ``requests`` synchronously and ahead; returns (sync summary, ahead summary, Launches)."""
    sync = summary(drive(make(False), requests, **kw))
    engine = make(True)
    launches = Launches(engine)
    ahead = summary(drive(engine, requests, **kw))
    return sync, ahead, launches, engine


def stops_of(make, lengths, max_tokens=24):
    """Stop tokens that end several of these prompts' greedy runs part-way (found from a sync run)."""
    engine = make(False)
    outs = engine.generate(prompts(lengths), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [out[len(out) // 2] for out in outs[:3]]


def test_greedy_outputs_stops_and_lengths_match_synchronous_steps(make):
    lengths = [5, 9, 13, 3, 17, 7]
    stop = stops_of(make, lengths)
    requests = {f"r{i}": (p, SamplingParams(max_tokens=8 + 3 * i, stop_token_ids=stop))
                for i, p in enumerate(prompts(lengths))}
    sync, ahead, launches, engine = both(make, requests)
    assert ahead == sync
    assert {reason for _, reason, _, _ in sync.values()} == {"stop", "length"}
    assert launches.ahead > 10 and launches.identity > 0  # the steps really went ahead
    assert launches.identity < launches.ahead  # and some batches changed under a step in flight


def test_seeded_sampling_and_logprobs_match(make):
    requests = {f"s{i}": (p, SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7 + i,
                                            logprobs=3, ignore_eos=True))
                for i, p in enumerate(prompts([6, 11, 4]))}
    requests["u"] = (prompts([8], seed=3)[0], SamplingParams(max_tokens=10, logprobs=0, ignore_eos=True))
    sync, ahead, launches, _ = both(make, requests)
    assert ahead == sync
    assert launches.ahead > 5


def test_stop_strings_match(tiny_llama_dir):
    outs = []
    for ahead in (False, True):
        engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", num_blocks=64, block_size=4,
                                        overlap_steps=ahead))
        tok = engine.tokenizer
        prompt = tok.encode("The quick brown fox")
        free = engine.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0]
        text = tok.decode(free)
        stop = next(text[i:i + 2] for i in range(3, len(text) - 2)
                    if text[i:i + 2].strip() == text[i:i + 2] and "\ufffd" not in text[:i + 2])
        got = summary(drive(engine, {"t": (prompt, SamplingParams(max_tokens=30, stop=(stop,),
                                                                  ignore_eos=True))}))
        assert got["t"][1] == "stop" and got["t"][3] == text[:text.index(stop)]
        assert engine.leak_report() is None
        outs.append((free, got))
    assert outs[0] == outs[1]


def test_arrivals_and_aborts_under_a_step_in_flight(make):
    lengths = [5, 9, 13, 3, 17, 7, 6, 10]
    requests = {f"r{i}": (p, SamplingParams(max_tokens=20, ignore_eos=True))
                for i, p in enumerate(prompts(lengths))}
    kw = dict(arrivals={4: ["r5", "r6"], 9: ["r7"]}, aborts={6: ["r1"], 11: ["r6", "r3"]})
    sync, ahead, launches, _ = both(make, requests, **kw)
    aborted = ("r1", "r6", "r3")
    for rid in aborted:  # aborted at the same step; the launched-ahead engine had read one token fewer
        assert ahead[rid][1] == sync[rid][1] == "abort"
        assert sync[rid][0][:len(ahead[rid][0])] == ahead[rid][0]
    assert {rid: r for rid, r in ahead.items() if rid not in aborted} == \
           {rid: r for rid, r in sync.items() if rid not in aborted}
    assert launches.ahead > 10


def test_aborted_blocks_wait_for_the_step_in_flight(make):
    engine = make(True)
    engine.add_request("a", prompts([6])[0], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request("b", prompts([9], seed=1)[0], SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine._inflight is not None
    table = engine.block_table("a")
    engine.abort("a")
    assert all(engine.block_manager.ref_count(b) == 1 for b in table)  # the step in flight writes them
    assert "in flight" in engine.leak_report()
    engine.step()  # reads that step: the blocks come back
    assert all(engine.block_manager.ref_count(b) == 0 for b in table)
    engine.abort("b")
    while engine.has_unfinished():
        engine.step()


def test_prefix_cache_holds_the_same_blocks(make):
    shared = prompts([12])[0]
    requests = {f"p{i}": (shared + p, SamplingParams(max_tokens=9 + i, ignore_eos=True))
                for i, p in enumerate(prompts([3, 5, 2], seed=4))}
    hashes = []
    for ahead in (False, True):
        engine = make(ahead)
        drive(engine, requests)
        bm = engine.block_manager
        hashes.append(sorted(h for h in (bm._hash_of[b] for b in range(bm.num_blocks)) if h is not None))
        second = drive(engine, {"again": (shared + prompts([3], seed=4)[0],
                                          SamplingParams(max_tokens=9, ignore_eos=True))})
        assert second["again"][-1].num_cached_tokens >= 12
    assert hashes[0] == hashes[1]


def test_kv_pressure_falls_back_to_synchronous_steps_and_still_matches(make):
    requests = {f"k{i}": (p, SamplingParams(max_tokens=24, ignore_eos=True))
                for i, p in enumerate(prompts([9, 11, 7, 13]))}
    sync, ahead, launches, engine = both(make, requests)  # the ample cache first
    assert ahead == sync
    tight = summary(drive(make(True, num_blocks=18, max_num_batched_tokens=16), requests))
    assert tight == sync


def test_decode_worker_commits_join_a_step_in_flight(make):
    """The disaggregated path: a prefill engine computes each prompt's KV, which is copied into the
    decode engine's reservation; commits arrive one by one while the decode engine's steps are in flight.
    The same tokens as a synchronous decode engine."""
    ps = prompts([7, 12, 5, 9])
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    results = []
    for ahead in (False, True):
        prefill, decode = make(False, num_blocks=64), make(ahead, num_blocks=64)
        launches = Launches(decode)
        outs = {f"c{i}": [] for i in range(len(ps))}
        for i, p in enumerate(ps):
            rid = f"c{i}"
            prefill.add_prefill_request(rid, p, params)
            (first,) = [o for _ in range(8) if prefill.has_unfinished() for o in prefill.step()]
            res = decode.reserve(rid, p, params)
            with torch.no_grad():
                decode.kv_cache[:, res.block_ids] = prefill.kv_cache[:, first.block_ids]
            prefill.release(rid)
            outs[rid].append(first)
            decode.commit_prefilled(rid, first.new_token_ids[0])
            for _ in range(2):
                for out in decode.step():
                    outs[out.request_id].append(out)
        while decode.has_unfinished():
            for out in decode.step():
                outs[out.request_id].append(out)
        results.append(summary(outs))
        assert not ahead or launches.ahead > 10
    assert results[0] == results[1]


def test_async_engine_stop_reads_the_step_in_flight(model):
    engine = LLMEngine(EngineConfig(device="cpu", num_blocks=64, block_size=4, overlap_steps=True,
                                    attention_backend="torch"), model=model)

    async def main():
        driver = AsyncEngine(engine)
        driver.start()
        got = []
        async for out in driver.generate("x", prompts([6])[0], SamplingParams(max_tokens=200,
                                                                             ignore_eos=True)):
            got.append(out)
            if len(got) == 5:
                break
        await driver.stop()
        return got

    assert len(asyncio.run(main())) == 5
    assert engine.leak_report() is None


def test_prev_tokens_patch_rows():
    prev = torch.tensor([11, 12, 13, 14])
    ids = torch.zeros(4, dtype=torch.int64)
    PrevTokens(tokens=prev, dst=[0, 1, 2], src=[0, 1, 2]).patch(ids)
    assert ids.tolist() == [11, 12, 13, 0]
    ids = torch.tensor([7, 0, 8, 0])
    PrevTokens(tokens=prev, dst=[1, 3], src=[3, 0]).patch(ids)
    assert ids.tolist() == [7, 14, 8, 11]


def test_prompt_chunks_and_admissions_go_ahead_and_match(make):
    """Long prompts in chunks, admissions while steps are in flight and a prefill-only request arriving
    among them (no step that holds it goes ahead), under a small step budget: the same outputs as
    synchronous steps, and mixed prefill/decode steps really went ahead."""
    lengths = [40, 9, 70, 5, 33, 12]
    requests = {f"m{i}": (p, SamplingParams(max_tokens=10 + i, ignore_eos=True))
                for i, p in enumerate(prompts(lengths, seed=6))}
    pre = prompts([20], seed=9)[0]
    kw = dict(arrivals={3: ["m3", "m4"], 7: ["m5"]},
              calls={5: lambda e: e.add_prefill_request("pre", pre, SamplingParams(max_tokens=1))})
    results = []
    for ahead in (False, True):
        engine = make(ahead, max_num_batched_tokens=24)
        launches = Launches(engine)
        results.append(summary(drive(engine, requests, **kw)))
        engine.release("pre")
    assert results[0] == results[1]
    assert results[0]["pre"][1] == "prefilled"
    assert launches.mixed >= 3


def test_a_throttled_step_is_not_launched_before_the_one_in_flight_is_read(make, monkeypatch):
    """A step the runner launches at the GPU's pace (CUDA, >= 512 tokens: ModelRunner.throttles) would hold
    the tokens of the step in flight back until it is nearly done; such a step is launched only after the
    step in flight is read. Here the runner throttles from 16 tokens; outputs still equal synchronous ones."""
    requests = {f"t{i}": (p, SamplingParams(max_tokens=12, ignore_eos=True))
                for i, p in enumerate(prompts([30, 4, 25, 6], seed=8))}
    late = {2: ["t2"], 5: ["t3"]}
    sync = summary(drive(make(False), requests, arrivals=late))
    engine = make(True)
    ahead_batch = step_ahead.ahead_batch
    monkeypatch.setattr(step_ahead, "ahead_batch",
                        lambda scheduler, continuing, throttles: ahead_batch(scheduler, continuing,
                                                                             lambda n: n >= 16))
    big_ahead, small_ahead = [], []
    launch_ahead = engine._launch_ahead

    def watched(flight):
        launch = engine.runner.launch

        def counted(batch, prev=None, **kw):
            size = sum(s.num_tokens for s in batch)
            (big_ahead if size >= 16 else small_ahead).append(size)
            return launch(batch, prev, **kw)

        engine.runner.launch = counted
        try:
            return launch_ahead(flight)
        finally:
            engine.runner.launch = launch

    engine._launch_ahead = watched
    assert summary(drive(engine, requests, arrivals=late)) == sync
    assert not big_ahead and len(small_ahead) > 10


def test_gpu_wait_auto_sleeps_only_where_steps_go_ahead(make):
    """auto: a blocking wait where decode steps are launched ahead (the wake-up hides behind the next
    step), a spinning one on synchronous steps; blocking and spin are taken as given."""
    assert make(True).runner.blocking_wait is True
    assert make(False).runner.blocking_wait is False
    assert make(False, gpu_wait="blocking").runner.blocking_wait is True
    assert make(True, gpu_wait="spin").runner.blocking_wait is False
    with pytest.raises(ValueError, match="gpu_wait"):
        EngineConfig(model="m", gpu_wait="sometimes")
