"""Deferred start-up work (``LLMEngine.idle_work``: the decode CUDA graphs not captured before SERVING)
runs on the engine thread only while the engine has nothing to step, on a block the engine lends and
takes back, and never spins: when it can do nothing (no free block) the thread waits for the next
command. The graph runner is a fake with ``DecodeGraphRunner``'s idle interface (CPU engines have
no graphs); tests/gpu/test_cuda_graphs.py and test_engine_gpu.py run the real captures."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.checkpoint import preset_config
from engine.engine import EngineConfig, LLMEngine
from engine.model import build_model
from pdserve.sampling import SamplingParams

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("torch_single_thread")]


class FakeGraphs:
    """The idle half of ``engine.cuda_graphs.DecodeGraphRunner``; decode steps never replay it."""

    def __init__(self, engine: LLMEngine, missing: list[int], fail: type[BaseException] | None = None):
        self.engine = engine
        self.missing = list(missing)
        self.fail = fail
        self.captured: list[tuple[int, int, bool]] = []  # (bucket, block, engine busy then)
        self.when_idle = True

    def idle_pending(self) -> bool:
        return self.when_idle and bool(self.missing)

    def stop_idle_captures(self) -> None:
        self.when_idle = False

    def capture_idle(self, block: int) -> int | None:
        assert self.engine.block_manager.ref_count(block) == 1  # lent for the call
        if self.fail is not None:
            raise self.fail("capture failed")
        b = self.missing.pop(0)
        self.captured.append((b, block, self.engine.has_unfinished()))
        return b

    def can_run(self, spec) -> bool:
        return False


def engine(num_blocks: int = 32) -> LLMEngine:
    cfg = EngineConfig(device="cpu", num_blocks=num_blocks, block_size=16, max_num_seqs=4,
                       max_num_batched_tokens=64, attention_backend="torch")
    return LLMEngine(cfg, model=build_model(preset_config("tiny"), seed=0))


def test_idle_work_captures_one_bucket_per_call_on_a_lent_block():
    eng = engine()
    fake = eng.runner.cuda_graphs = FakeGraphs(eng, [8, 4, 2])
    free = eng.num_free_blocks
    assert eng.has_idle_work()
    assert [eng.idle_work() for _ in range(4)] == [True, True, True, False]
    assert [b for b, _, _ in fake.captured] == [8, 4, 2]
    assert not eng.has_idle_work()
    assert eng.num_free_blocks == free and eng.leak_report() is None


def test_idle_work_without_a_free_block_does_nothing():
    eng = engine(num_blocks=4)
    fake = eng.runner.cuda_graphs = FakeGraphs(eng, [2])
    held = eng.block_manager.allocate(eng.num_free_blocks)
    assert eng.idle_work() is False and fake.captured == [] and eng.has_idle_work()
    eng.block_manager.release(held)
    assert eng.idle_work() is True and fake.captured[0][0] == 2


def test_out_of_memory_in_a_capture_stops_idle_captures_and_returns_the_block():
    eng = engine()
    eng.runner.cuda_graphs = FakeGraphs(eng, [8, 4], fail=torch.OutOfMemoryError)
    free = eng.num_free_blocks
    assert eng.idle_work() is True
    assert not eng.has_idle_work() and eng.num_free_blocks == free


def test_engine_without_graphs_has_no_idle_work():
    eng = engine()
    assert eng.runner.cuda_graphs is None
    assert not eng.has_idle_work() and eng.idle_work() is False


def test_async_engine_runs_idle_work_only_between_requests_and_never_spins():
    async def main():
        eng = engine(num_blocks=8)
        fake = eng.runner.cuda_graphs = FakeGraphs(eng, [])
        calls = []
        real = eng.idle_work
        eng.idle_work = lambda: (calls.append(time.monotonic()), real())[1]
        ae = AsyncEngine(eng)
        ae.start()
        try:
            params = SamplingParams(max_tokens=12, ignore_eos=True)
            # a request is stepping when the work appears: it is done between steps, never during one
            stream = ae.generate("r", [5, 9, 13, 200, 7], params)
            first = await stream.__anext__()
            await ae.call(lambda e: fake.missing.extend([4, 2]))
            tokens = list(first.new_token_ids) + [t async for out in stream for t in out.new_token_ids]
            assert len(tokens) == 12
            while await ae.call(lambda e: e.has_idle_work()):
                await asyncio.sleep(0.01)
            assert [b for b, _, _ in fake.captured] == [4, 2]
            assert not any(busy for _, _, busy in fake.captured)
            # nothing free to lend: one attempt, then the thread waits for a command instead of spinning
            held = await ae.call(lambda e: e.block_manager.allocate(e.num_free_blocks))
            await ae.call(lambda e: fake.missing.append(1))
            await asyncio.sleep(0.3)
            tried = len(calls)
            await asyncio.sleep(0.3)
            assert len(calls) == tried, "idle work retried without a new command"
            await ae.call(lambda e: e.block_manager.release(held))
            while await ae.call(lambda e: e.has_idle_work()):
                await asyncio.sleep(0.01)
            assert [b for b, _, _ in fake.captured] == [4, 2, 1]
            assert await ae.call(lambda e: e.leak_report()) is None
        finally:
            await ae.stop()

    asyncio.run(main())


def test_idle_work_held_back_until_allowed():
    """A worker starts its engine with idle work held back while it sets up the KV plane (whose CUDA
    calls would invalidate a capture); allow_idle_work() starts it on an engine waiting for commands."""
    async def main():
        eng = engine()
        fake = eng.runner.cuda_graphs = FakeGraphs(eng, [4, 2])
        ae = AsyncEngine(eng, idle_work=False)
        ae.start()
        try:
            await asyncio.sleep(0.2)
            await ae.call(lambda e: None)  # a command passes; the work still waits
            assert fake.captured == []
            ae.allow_idle_work()
            while await ae.call(lambda e: e.has_idle_work()):
                await asyncio.sleep(0.01)
            assert [b for b, _, _ in fake.captured] == [4, 2]
        finally:
            await ae.stop()

    asyncio.run(main())
