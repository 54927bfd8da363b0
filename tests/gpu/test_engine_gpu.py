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
    run = graphed.runner.cuda_graphs.run
    graphed.runner.cuda_graphs.run = lambda ids, spec: (replays.append(len(ids)), run(ids, spec))[1]
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
