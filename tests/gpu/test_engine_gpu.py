"""LLMEngine on the GPU: "auto" picks flashinfer for bf16 models (torch for float32), decode steps run
through captured CUDA graphs, and generation through graphs equals generation without them."""

from __future__ import annotations

import random

import pytest

from engine.engine import EngineConfig, LLMEngine
from pdserve.sampling import SamplingParams


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(path), device="cuda", num_blocks=256, max_num_seqs=8, max_num_batched_tokens=512, **kw
        )
    )


def _prompts(vocab: int) -> list[list[int]]:
    g = random.Random(11)
    return [[g.randrange(3, vocab) for _ in range(n)] for n in (3, 17, 40, 64, 100, 9)]


def test_auto_backend_choice(make_checkpoint):
    bf16 = _engine(make_checkpoint(preset="small", dtype="bfloat16"))
    assert bf16.runner.backend.name == "flashinfer"
    assert bf16.runner.cuda_graphs is not None and bf16.runner.cuda_graphs.graphs
    fp32 = _engine(make_checkpoint(preset="small"))
    assert fp32.runner.backend.name == "torch" and fp32.runner.cuda_graphs is None


def test_generate_with_cuda_graphs_equals_eager(make_checkpoint, monkeypatch):
    path = make_checkpoint(preset="small", dtype="bfloat16")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    graphed = _engine(path)
    replays = []
    replay = graphed.runner.cuda_graphs.replay
    graphed.runner.cuda_graphs.replay = lambda g, n: (replays.append(n), replay(g, n))[1]
    prompts = _prompts(graphed.model_config.vocab_size)
    out_graph = graphed.generate(prompts, params)
    assert replays, "no decode step went through a CUDA graph"
    monkeypatch.setenv("PDSERVE_CUDA_GRAPHS", "0")
    eager = _engine(path)
    assert eager.runner.cuda_graphs is None
    out_eager = eager.generate(prompts, params)
    assert out_graph == out_eager
    assert all(len(o) == 24 for o in out_graph)


def test_idle_work_captures_the_rest_and_lends_a_block_back(make_checkpoint, monkeypatch):
    """At start only bucket 1 is captured; ``idle_work`` captures the others, largest first, each on a
    block it borrows and gives back; generation afterwards replays them and equals eager generation.
    A prefill worker's engine (``cuda_graphs=False``) captures nothing."""
    path = make_checkpoint(preset="small", dtype="bfloat16")
    eng = _engine(path)
    graphs = eng.runner.cuda_graphs
    assert sorted(graphs.graphs) == [1] and eng.has_idle_work()
    free = eng.num_free_blocks
    done = 0
    while eng.idle_work():
        done += 1
        assert eng.num_free_blocks == free
    assert done == 3 and graphs.idle_captures == [8, 4, 2] and not eng.has_idle_work()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = _prompts(eng.model_config.vocab_size)
    out = eng.generate(prompts, params)
    assert graphs.lazy_captures == []
    assert eng.num_free_blocks == free
    monkeypatch.setenv("PDSERVE_CUDA_GRAPHS", "0")
    assert _engine(path).generate(prompts, params) == out
    monkeypatch.delenv("PDSERVE_CUDA_GRAPHS")
    prefill = _engine(path, cuda_graphs=False)
    assert prefill.runner.cuda_graphs is None and not prefill.has_idle_work()


def test_graphs_at_start_setting(make_checkpoint, monkeypatch):
    monkeypatch.setenv("PDSERVE_CUDA_GRAPHS_AT_START", "8")
    eng = _engine(make_checkpoint(preset="small", dtype="bfloat16"))
    assert sorted(eng.runner.cuda_graphs.graphs) == [1, 2, 4, 8] and not eng.has_idle_work()


@pytest.mark.parametrize("backend", ["flashinfer", "torch"])
def test_explicit_backends_generate(make_checkpoint, backend):
    eng = _engine(make_checkpoint(preset="small", dtype="bfloat16"), attention_backend=backend)
    assert eng.runner.backend.name == backend
    out = eng.generate(
        _prompts(eng.model_config.vocab_size)[:3], SamplingParams(max_tokens=8, ignore_eos=True)
    )
    assert [len(o) for o in out] == [8, 8, 8]


def test_launch_throttle_keeps_tokens_and_bounds_the_host_lead(make_checkpoint, monkeypatch):
    """Steps of >= 512 tokens launch at most launch_ahead_layers layers ahead of the GPU; greedy output
    equals the unthrottled engine's, and the throttle's hook ran on those steps only."""
    from engine import layer_sink

    path = make_checkpoint(preset="small", dtype="bfloat16")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    g = random.Random(5)
    prompts = [[g.randrange(3, 500) for _ in range(n)] for n in (700, 530, 20)]
    made = []
    real = layer_sink.launch_throttle
    monkeypatch.setattr("engine.model_runner.launch_throttle",
                        lambda ahead: (made.append(ahead), real(ahead))[1])
    throttled = _engine(path, launch_ahead_layers=1)
    out = throttled.generate(prompts, params)
    assert made and set(made) == {1}  # the 512-token chunks of the two long prompts
    free = _engine(path, launch_ahead_layers=0)
    assert free.generate(prompts, params) == out


def _drive(eng: LLMEngine, requests: dict, *, late: set[str] = frozenset(), abort: str | None = None) -> dict:
    """Start ``requests`` (``late`` ones at step 3, ``abort`` aborted at step 5); id -> (tokens, finish
    reason, (token, logprob) pairs)."""
    for rid, (p, params) in requests.items():
        if rid not in late:
            eng.add_request(rid, p, params)
    outs = {rid: [] for rid in requests}
    n = 0
    while eng.has_unfinished() or n < 6:
        if n == 3:
            for rid in sorted(late):
                eng.add_request(rid, *requests[rid])
        if n == 5 and abort:
            eng.abort(abort)
        for out in eng.step():
            outs[out.request_id].append(out)
        n += 1
    assert eng.leak_report() is None, eng.leak_report()
    return {rid: ([t for o in seq for t in o.new_token_ids], seq[-1].finish_reason,
                  [(lp.token_id, lp.logprob) for o in seq for lp in (o.new_logprobs or [])])
            for rid, seq in outs.items()}


def _counting(launch, fed: list[bool]):
    """``ModelRunner.launch`` noting whether each step took input ids from the step before (PrevTokens)."""
    def counted(batch, prev=None, **kw):
        fed.append(prev is not None)
        return launch(batch, prev, **kw)
    return counted


@pytest.mark.parametrize("graphs", ["1", "0"])
def test_steps_launched_ahead_equal_synchronous_steps(make_checkpoint, monkeypatch, graphs):
    """On CUDA decode steps are launched before the previous step's tokens are read (engine.step_ahead):
    the next step's input ids come from the previous step's sampled ids on the device and its staging is
    written while that step runs. Requests that stop by length run the same batches either way, so greedy
    and seeded tokens (penalized ones too) and their logprobs must be bitwise the same, with and without
    CUDA graphs."""
    monkeypatch.setenv("PDSERVE_CUDA_GRAPHS", graphs)
    path = make_checkpoint(preset="small", dtype="bfloat16")
    results, launched = [], []
    for ahead in (False, True):
        eng = _engine(path, overlap_steps=ahead)
        assert eng.overlap_steps is ahead
        fed: list[bool] = []
        eng.runner.launch = _counting(eng.runner.launch, fed)
        ps = _prompts(eng.model_config.vocab_size)
        requests = {f"g{i}": (p, SamplingParams(max_tokens=12 + 5 * i, logprobs=1, ignore_eos=True))
                    for i, p in enumerate(ps)}
        requests.update({f"s{i}": (p, SamplingParams(max_tokens=20, temperature=0.8, top_k=50, seed=i,
                                                     logprobs=2, ignore_eos=True))
                         for i, p in enumerate(ps[:2])})
        # one greedy and one seeded request with penalties: their statistics are updated on the device as
        # tokens are picked (engine.penalties), so a step launched ahead sees the previous step's token.
        # (In place of two others: more requests than max_num_seqs would queue, and a finish read one
        # step late would then admit them in other batches.)
        penalties = dict(frequency_penalty=0.9, presence_penalty=0.3, repetition_penalty=1.2,
                         logit_bias={5: 2.0})
        requests["g4"] = (ps[4], SamplingParams(max_tokens=32, logprobs=1, ignore_eos=True, **penalties))
        requests["s1"] = (ps[1], SamplingParams(max_tokens=20, temperature=0.8, top_k=50, seed=1, logprobs=2,
                                                ignore_eos=True, **penalties))
        results.append(_drive(eng, requests))
        launched.append(sum(fed))
    assert results[0] == results[1]
    assert launched[0] == 0 and launched[1] > 20


def test_stops_arrivals_and_aborts_under_a_step_in_flight(make_checkpoint):
    """Stops read one step late (the extra token dropped), requests arriving and aborted while a step is in
    flight: the same tokens as synchronous steps. Float32 (torch attention, eager steps), where a batch's
    makeup cannot flip a greedy choice as bf16 rounding can."""
    path = make_checkpoint(preset="small")
    results = []
    for ahead in (False, True):
        eng = _engine(path, overlap_steps=ahead)
        ps = _prompts(eng.model_config.vocab_size)
        stop = [out[7] for out in eng.generate(ps[:3], SamplingParams(max_tokens=20, ignore_eos=True))]
        requests = {f"g{i}": (p, SamplingParams(max_tokens=12 + 2 * i, stop_token_ids=stop))
                    for i, p in enumerate(ps)}
        requests["s"] = (ps[1], SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True))
        results.append(_drive(eng, requests, late={"g4", "g5", "s"}, abort="g3"))
    sync, ahead = results
    aborted_sync, aborted_ahead = sync.pop("g3"), ahead.pop("g3")
    assert aborted_sync[1] == aborted_ahead[1] == "abort"
    shorter = min(len(aborted_sync[0]), len(aborted_ahead[0]))
    assert aborted_sync[0][:shorter] == aborted_ahead[0][:shorter]
    assert {rid: r[:2] for rid, r in ahead.items()} == {rid: r[:2] for rid, r in sync.items()}
    assert {reason for _, reason, _ in sync.values()} == {"stop", "length"}
