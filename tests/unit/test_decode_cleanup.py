"""A decode worker gives every KV block back on each way a request can end early: an Allocate
cancelled while its reservation waits for the engine thread (a deadline or a client gone while a
forward pass runs), a Decode stream cancelled before its KV arrived, a Release during decode, a lease
that expires. After each: free == total (cached prefix blocks count as free), the engine holds no
request, no receiver registration is left, and ``untracked()`` (what the engine holds that the worker
does not know) is empty.

The engine thread is made busy deterministically: a command that blocks on an event stands in for a
long forward pass, so the reservation is queued behind it."""

import asyncio
import threading

import pytest

from decode_service.worker import DecodeWorker
from engine.async_engine import AsyncEngine
from engine.checkpoint import preset_config
from engine.engine import EngineConfig, LLMEngine
from engine.errors import UnknownRequest
from engine.model import build_model
from pdserve.sampling import SamplingParams

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("torch_single_thread")]
BLOCK = 16
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, ignore_eos=True)
PROMPT = list(range(3, 3 + 2 * BLOCK + 5))  # three blocks, none cached: the receiver expects KV


class FakeKV:
    """The receiver adapter: registrations by request id; KV 'arrives' when a test resolves it."""

    def __init__(self) -> None:
        self.expected: dict[str, asyncio.Future] = {}

    def endpoint(self) -> bytes:
        return b"fake"

    def expect(self, rid: str, blocks: list[int]) -> None:
        self.expected[rid] = asyncio.get_running_loop().create_future()

    async def wait(self, rid: str) -> dict:
        return await asyncio.shield(self.expected[rid])

    def release(self, rid: str) -> None:
        fut = self.expected.pop(rid, None)
        if fut is not None and not fut.done():
            fut.cancel()


class BusyEngineThread:
    """Holds the engine thread in one command (a long forward pass) until ``free()``."""

    def __init__(self, ae: AsyncEngine) -> None:
        self.ae, self.running, self.gate = ae, threading.Event(), threading.Event()

    async def __aenter__(self) -> "BusyEngineThread":
        def hold(engine) -> None:
            self.running.set()
            self.gate.wait()

        self.done = self.ae.post(hold)
        await asyncio.to_thread(self.running.wait)
        return self

    async def queued(self, n: int) -> None:
        """Until ``n`` commands wait behind the busy one."""
        while self.ae._commands.qsize() < n:
            await asyncio.sleep(0.001)

    async def __aexit__(self, *exc) -> None:
        self.gate.set()
        await self.done


def run(scenario) -> None:
    """``scenario(worker)`` against a fresh decode worker over a real engine thread."""
    asyncio.run(_with_worker(scenario))


async def _with_worker(scenario) -> None:
    cfg = EngineConfig(device="cpu", num_blocks=32, block_size=BLOCK, max_num_seqs=4,
                       max_num_batched_tokens=64, attention_backend="torch")
    ae = AsyncEngine(LLMEngine(cfg, model=build_model(preset_config("tiny"), seed=0)))
    ae.start()
    w = DecodeWorker(engine=ae, kv=FakeKV(), worker_id="decode-t", block_size=BLOCK, default_lease_ms=60_000)
    w.start()
    try:
        await scenario(w)
    finally:
        await w.stop()
        await ae.stop()


async def assert_no_leak(w: DecodeWorker) -> None:
    report = await w.engine.call(lambda e: e.leak_report())
    free, total = await w.engine.call(lambda e: (e.num_free_blocks, e.num_total_blocks))
    assert (report, free) == (None, total)
    assert not w.kv.expected and not w.leases and not w.active
    assert await w.untracked() == {}


def test_allocate_cancelled_while_the_reservation_is_queued():
    async def scenario(worker):
        async with BusyEngineThread(worker.engine) as busy:
            task = asyncio.create_task(worker.allocate("r1", PROMPT, PARAMS))
            await busy.queued(1)  # the reservation waits behind the forward pass
            task.cancel()  # the Allocate's deadline passes
            with pytest.raises(asyncio.CancelledError):
                await task
        assert await worker.release("r1") is False  # the router's cleanup: nothing was leased
        await assert_no_leak(worker)
        # the id is usable again: a retry on this worker reserves and frees normally
        await worker.allocate("r1", PROMPT, PARAMS)
        assert await worker.release("r1") is True
        await assert_no_leak(worker)

    run(scenario)


def test_untracked_names_a_reservation_nobody_owns(caplog):
    async def scenario(worker):
        await worker.engine.reserve("orphan", PROMPT, PARAMS)  # behind the worker's back
        assert await worker.untracked() == {"orphan": "reserved"}
        for _ in range(3):  # the reaper's check: logged once it is seen twice, and only once
            await worker._report_untracked()
        lost = [r.getMessage() for r in caplog.records if "does not track" in r.getMessage()]
        assert len(lost) == 1 and "orphan (reserved)" in lost[0]
        await worker.engine.release("orphan")
        await assert_no_leak(worker)

    run(scenario)


def test_decode_cancelled_before_kv_complete():
    async def scenario(worker):
        await worker.allocate("r2", PROMPT, PARAMS)
        gen = worker.decode("r2", 7, kv_wait_s=60)
        step = asyncio.ensure_future(gen.__anext__())
        while "r2" not in worker.active:
            await asyncio.sleep(0.001)
        step.cancel()  # the Decode stream's client went away while the KV was in flight
        with pytest.raises(asyncio.CancelledError):
            await step
        await assert_no_leak(worker)

    run(scenario)


def test_release_during_decode_ends_the_stream():
    async def scenario(worker):
        await worker.allocate("r3", PROMPT, LONG)
        worker.kv.expected["r3"].set_result({"bytes": 0})
        outs = []
        async for batch in worker.decode("r3", 7, kv_wait_s=60):
            if not outs:  # while the engine is far from max_tokens: the abort lands first
                assert await worker.release("r3") is True
            outs.extend(batch)
        assert outs[-1].finish_reason == "abort"
        await assert_no_leak(worker)

    run(scenario)


def test_expired_lease_is_reaped():
    async def scenario(worker):
        await worker.allocate("r4", PROMPT, PARAMS, lease_ms=1)
        while worker.leases:
            await asyncio.sleep(0.01)
        with pytest.raises(UnknownRequest):
            await anext(worker.decode("r4", 7, kv_wait_s=60))
        while await worker.engine.call(lambda e: e.leak_report()) is not None:
            await asyncio.sleep(0.01)  # the reaper's release is queued on the engine thread
        await assert_no_leak(worker)

    run(scenario)


class SettlingKV(FakeKV):
    """A receiver whose release waits, as kvtransfer's does, until nothing of the transfer can land any
    more (the sender's confirmation, frames still arriving on its other connections)."""

    def __init__(self) -> None:
        super().__init__()
        self.settle = asyncio.Event()

    async def release(self, rid: str) -> None:
        super().release(rid)
        await self.settle.wait()


@pytest.mark.parametrize("how", ["release", "kv wait timeout"])
def test_blocks_stay_reserved_until_the_receiver_says_nothing_more_can_land(how):
    """Freed blocks are reused at once; a transfer cut short may still be writing into them (RDMA writes
    in flight, TCP frames already in the sockets), so the worker frees them only after the receiver's
    release returned."""
    async def scenario(worker):
        worker.kv = SettlingKV()
        await worker.allocate("r5", PROMPT, PARAMS)
        total = await worker.engine.call(lambda e: e.num_total_blocks)
        if how == "release":
            ending = asyncio.ensure_future(worker.release("r5"))
        else:
            ending = asyncio.ensure_future(anext(worker.decode("r5", 7, kv_wait_s=0.05)))
        await asyncio.sleep(0.2)
        assert not ending.done()
        assert await worker.engine.call(lambda e: e.num_free_blocks) < total  # still reserved
        worker.kv.settle.set()
        if how == "release":
            assert await ending is True
        else:
            with pytest.raises(asyncio.TimeoutError):
                await ending
        await assert_no_leak(worker)

    run(scenario)
