"""The engine thread on the GPU right after start: requests that arrive while the remaining decode CUDA
graphs are being captured in idle moments (``LLMEngine.idle_work``) are answered token-exact, equal to
eager generation, and every block comes back; once idle, every bucket is captured and later requests
replay them without a capture inside a step."""

from __future__ import annotations

import asyncio
import random

from engine.async_engine import AsyncEngine
from engine.engine import EngineConfig, LLMEngine
from pdserve.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def _engine(path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cuda", num_blocks=256, max_num_seqs=8,
                                  max_num_batched_tokens=512))


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    g = random.Random(seed)
    return [[g.randrange(3, vocab) for _ in range(g.randrange(3, 90))] for _ in range(n)]


async def _collect(ae: AsyncEngine, rid: str, prompt: list[int], delay: float) -> list[int]:
    await asyncio.sleep(delay)
    return [t async for out in ae.generate(rid, prompt, PARAMS) for t in out.new_token_ids]


def test_requests_during_idle_captures_equal_eager(make_checkpoint, monkeypatch):
    path = make_checkpoint(preset="small", dtype="bfloat16")
    eng = _engine(path)
    graphs = eng.runner.cuda_graphs
    assert sorted(graphs.graphs) == [1] and eng.has_idle_work()
    vocab = eng.model_config.vocab_size
    early, late = _prompts(vocab, 6, 1), _prompts(vocab, 6, 2)

    async def main():
        ae = AsyncEngine(eng)
        ae.start()
        try:
            # staggered arrivals from the first moment: some land between idle captures
            arrivals = (_collect(ae, f"e{i}", p, 0.04 * i) for i, p in enumerate(early))
            got_early = await asyncio.gather(*arrivals)
            while await ae.call(lambda e: e.has_idle_work()):
                await asyncio.sleep(0.02)
            lazy_before = list(graphs.lazy_captures)
            got_late = await asyncio.gather(*(_collect(ae, f"l{i}", p, 0.0) for i, p in enumerate(late)))
            assert graphs.lazy_captures == lazy_before  # everything was captured by then
            assert await ae.call(lambda e: e.leak_report()) is None
            return got_early, got_late
        finally:
            await ae.stop()

    got_early, got_late = asyncio.run(asyncio.wait_for(main(), 300))
    assert sorted(graphs.graphs) == [1, 2, 4, 8] and graphs.idle_captures
    monkeypatch.setenv("PDSERVE_CUDA_GRAPHS", "0")
    eager = _engine(path)
    assert eager.generate(early, PARAMS) == got_early
    assert eager.generate(late, PARAMS) == got_late
