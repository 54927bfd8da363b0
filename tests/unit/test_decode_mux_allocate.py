"""DecodeMany's Allocates (router/decode_mux.py <-> decode_service/mux.py): a decode worker's block
reservation rides the same call as its streams. Each Allocate is answered, or fails, as its own
Allocate call would; one leaving early frees its reservation; a broken call fails every Allocate
waiting on it with UNAVAILABLE, so the router places the request elsewhere. Helpers and the fake
worker are test_decode_mux's.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from test_decode_mux import FakeDecode, allocate, collect, serving, settled, status_of

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("torch_single_thread")]


def test_allocates_ride_the_call_answer_or_fail_as_their_own_calls_would_and_free_on_leaving():
    async def main():
        fake = FakeDecode({"a": [5, 6]})
        full = type("Full", (Exception,), {"code": "RESOURCE_EXHAUSTED"})("no blocks")
        fake.allocs = {"a": [7, 8, 9], "full": full, "bad": ValueError("empty prompt"), "hang": "hang",
                       "slow": "hang"}
        async with serving(fake) as (_, streams):
            answers = await asyncio.gather(*(allocate(streams, rid) for rid in ("a", "full", "bad")),
                                           return_exceptions=True)
            assert list(answers[0].block_ids) == [7, 8, 9] and answers[0].worker_id == "d0"
            assert answers[1].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "no blocks" in answers[1].details()
            assert answers[2].code() == grpc.StatusCode.INVALID_ARGUMENT
            assert await collect(streams, "a") == [5, 6]  # then its stream, on the same call
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await allocate(streams, "hang", timeout=0.2)
            assert status_of(exc) == grpc.StatusCode.DEADLINE_EXCEEDED
            task = asyncio.get_running_loop().create_task(allocate(streams, "slow"))
            await asyncio.sleep(0.1)
            task.cancel()  # the client went away while its Allocate waited
            with pytest.raises(asyncio.CancelledError):
                await task
            await settled(fake, streams)  # both were cancelled on the worker: nothing allocating
            assert len(fake.sessions) == 1 and fake.allocate_calls == 0
            fake.draining.set()  # refused ("draining"), or the idle call has ended already: UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await allocate(streams, "late")
            assert status_of(exc) == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())


def test_a_broken_call_fails_the_allocates_waiting_on_it():
    async def main():
        fake = FakeDecode({})
        fake.allocs = {"a": "hang"}
        async with serving(fake) as (_, streams):
            task = asyncio.get_running_loop().create_task(allocate(streams, "a"))
            await asyncio.sleep(0.1)
            streams._call.call.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await task
            assert status_of(exc) in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
            assert list((await allocate(streams, "b")).block_ids) == [1, 2]  # on a new call
            await settled(fake, streams)

    asyncio.run(main())


def test_every_allocate_is_answered_whenever_it_finishes_beside_the_others():
    """Answers and failures finishing at staggered times, between and during the writer's sends, all
    reach their callers (each rides the response after it finished)."""
    async def main():
        fake = FakeDecode({})
        full = type("Full", (Exception,), {"code": "RESOURCE_EXHAUSTED"})("no blocks")
        fake.allocs = {f"r{i}": (0.002 * (i % 7), full if i % 2 else [i]) for i in range(60)}
        async with serving(fake) as (_, streams):
            got = await asyncio.wait_for(asyncio.gather(*(allocate(streams, f"r{i}") for i in range(60)),
                                                        return_exceptions=True), 20)
            for i, answer in enumerate(got):
                if i % 2:
                    assert answer.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                else:
                    assert list(answer.block_ids) == [i]
            await settled(fake, streams)

    asyncio.run(main())


def test_a_call_failing_as_a_whole_reads_unavailable_so_the_router_places_and_migrates_elsewhere():
    """grpc turns a write that races the end of a call (a drained worker closing it) into INTERNAL for
    the whole call: that says the worker's call is unusable, not that the request was bad."""
    async def main():
        fake = FakeDecode({"s": "hang"})
        fake.fail_calls_with = grpc.StatusCode.INTERNAL
        async with serving(fake) as (_, streams):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await allocate(streams, "a")
            assert status_of(exc) == grpc.StatusCode.UNAVAILABLE and "INTERNAL" in exc.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await collect(streams, "s")
            assert status_of(exc) == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())
