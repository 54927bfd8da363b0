"""router/decode_mux.py: a DecodeMany call to a worker that stopped answering is given up.

A frozen worker (SIGSTOP, a hung driver call) keeps its TCP connection, so its call would stay open
until gRPC's keepalive ends it. When the directory's health poll fails, ``DecodeStreams.unresponsive``
gives up the call if requests wait on it and it has carried nothing for ``UNRESPONSIVE_S``: every
stream and Allocate on it gets UNAVAILABLE (streams migrate, Allocates are placed again), the next
request opens a new call, and the worker frees what it held once it sees the call cancelled. A call
whose streams flow, and an idle call that a request has just started waiting on, are kept.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from test_decode_mux import FakeDecode, allocate, collect, serving, settled

from pdserve.v1 import decode_pb2
from router import decode_mux

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("torch_single_thread")]


def rewind(streams, seconds: float = 10.0) -> None:
    """As if the open call last carried something ``seconds`` ago (no sleeping: no timing in the test)."""
    streams._call.heard_at -= seconds


def test_a_silent_call_is_given_up_its_requests_read_unavailable_and_the_next_opens_a_new_call(monkeypatch):
    monkeypatch.setattr(decode_mux, "UNRESPONSIVE_S", 5.0)

    async def main():
        fake = FakeDecode({"a": "hang", "b": "hang", "ok": [7, 8, 9]})
        fake.allocs["c"] = "hang"
        async with serving(fake) as (_, streams):
            tasks = [asyncio.create_task(collect(streams, rid, timeout=60)) for rid in ("a", "b")]
            tasks.append(asyncio.create_task(allocate(streams, "c", timeout=60)))
            while len(fake.running) < 2 or not fake.allocating:
                await asyncio.sleep(0.01)
            assert not streams.unresponsive("GetStats DEADLINE_EXCEEDED")  # not silent long enough
            first = streams._call
            rewind(streams)
            assert streams.unresponsive("GetStats DEADLINE_EXCEEDED")
            assert not streams.unresponsive("again")  # once
            for task in tasks:
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await task
                assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "stopped answering" in exc.value.details()
            assert streams.metrics.abandoned._value.get() == 1
            assert await collect(streams, "ok") == [7, 8, 9]  # on a new call
            assert streams._call is not first and len(fake.sessions) == 2
            await settled(fake, streams)  # the worker freed what the given-up call carried
            assert {"a", "b"} <= set(fake.freed)

    asyncio.run(main())


def test_every_message_on_the_call_restarts_its_silence(monkeypatch):
    """A worker that misses a poll while its streams flow keeps them: each response refreshes the call."""
    monkeypatch.setattr(decode_mux, "UNRESPONSIVE_S", 5.0)

    async def main():
        fake = FakeDecode({"long": list(range(400))})  # a token every ~5 ms
        async with serving(fake) as (_, streams):
            gen = streams.stream(decode_pb2.DecodeRequest(request_id="long"), 60)
            got = list((await anext(gen)).token_ids)
            rewind(streams)
            while streams._call.silent_for() >= 5.0:  # until the next response arrives
                got += (await anext(gen)).token_ids
            assert not streams.unresponsive("a slow poll")
            got += [t async for msg in gen for t in msg.token_ids]
            assert got == list(range(400)) and streams.metrics.abandoned._value.get() == 0
            await settled(fake, streams)

    asyncio.run(main())


def test_an_idle_calls_silence_starts_when_a_request_begins_to_wait(monkeypatch):
    monkeypatch.setattr(decode_mux, "UNRESPONSIVE_S", 5.0)

    async def main():
        fake = FakeDecode({"first": [1], "late": "hang"})
        async with serving(fake) as (_, streams):
            assert await collect(streams, "first") == [1]
            rewind(streams)  # idle for long: nothing waits, nothing to give up
            assert not streams.unresponsive("idle")
            task = asyncio.create_task(collect(streams, "late", timeout=60))
            while not fake.running:
                await asyncio.sleep(0.01)
            assert not streams.unresponsive("a poll right after")  # silent since the request began to wait
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await settled(fake, streams)

    asyncio.run(main())


def test_cleanup_of_a_worker_not_answering_does_not_hold_the_request():
    """The pipeline's Release / Abort: awaited for a worker that answers its polls, sent in the
    background for one that does not (a frozen worker would hold a migration for the RPC's timeout)."""
    from types import SimpleNamespace

    from router.pipeline import _Cleanup

    async def main():
        frozen = asyncio.Event()
        calls = []

        async def release(request, timeout):  # a frozen worker: answers only once let go
            calls.append(("release", request.request_id))
            await frozen.wait()

        async def abort(request, timeout):
            calls.append(("abort", request.request_id))

        d = SimpleNamespace(answering=False, stub=SimpleNamespace(Release=release))
        p = SimpleNamespace(answering=True, stub=SimpleNamespace(Abort=abort))
        await _Cleanup(p, d, "r1").run(decode_reserved=True, prefill_running=True)
        assert ("abort", "r1") in calls  # awaited: done by now
        await asyncio.sleep(0)
        assert ("release", "r1") in calls and _Cleanup._background  # sent, still waiting on the worker
        frozen.set()
        while _Cleanup._background:
            await asyncio.sleep(0.01)

    asyncio.run(main())


def test_a_request_held_while_it_prefills_elsewhere_learns_when_the_call_is_given_up(monkeypatch):
    """``hold``: an Allocate answered, the prompt on a prefill worker pushing KV here. The hold counts as
    waiting (silence is measured for it), and when the call is given up its ``lost`` future gets the
    call's UNAVAILABLE; a released hold is left alone, and a hold on a broken call is lost at once."""
    monkeypatch.setattr(decode_mux, "UNRESPONSIVE_S", 5.0)

    async def main():
        fake = FakeDecode({"ok": [1]})
        async with serving(fake) as (_, streams):
            await allocate(streams, "p1")
            await allocate(streams, "p2")
            h1, h2 = streams.hold("p1"), streams.hold("p2")
            h2.release()
            rewind(streams)
            assert streams.unresponsive("GetStats DEADLINE_EXCEEDED")  # h1 waits on a silent call
            err = await asyncio.wait_for(h1.lost, 5)
            assert err.code() == grpc.StatusCode.UNAVAILABLE and "stopped answering" in err.details()
            assert not h2.lost.done()
            late = streams._call.hold("p3").lost  # the broken call itself: lost at once
            assert late.done() and late.result().code() == grpc.StatusCode.UNAVAILABLE
            assert await collect(streams, "ok") == [1]  # a new call
            fresh = streams.hold("p4")  # on the new call
            assert fresh is not None and not fresh.lost.done()
            fresh.release()
            assert not streams._call.held

    asyncio.run(main())


class FakePrefillCall:
    """A Prefill call: ``await`` gives ``answer`` once ``go`` is set; ``cancel()`` is recorded."""

    def __init__(self, go: asyncio.Event, answer="first token") -> None:
        self.go, self.answer, self.cancelled = go, answer, False

    def __await__(self):
        return self._wait().__await__()

    async def _wait(self):
        await self.go.wait()
        return self.answer

    def cancel(self) -> None:
        self.cancelled = True


def test_the_prefill_is_cancelled_when_its_decode_worker_is_lost_first():
    from router.pipeline import _DecodeLost, _unless_lost

    async def main():
        from router.decode_mux import rpc_error

        go, lost = asyncio.Event(), asyncio.get_running_loop().create_future()
        call = FakePrefillCall(go)
        task = asyncio.create_task(_unless_lost(call, lost))
        await asyncio.sleep(0.01)
        lost.set_result(rpc_error(grpc.StatusCode.UNAVAILABLE, "decode worker d stopped answering"))
        with pytest.raises(_DecodeLost) as exc:
            await task
        assert call.cancelled and exc.value.error.code() == grpc.StatusCode.UNAVAILABLE

        go, lost = asyncio.Event(), asyncio.get_running_loop().create_future()
        call = FakePrefillCall(go)
        go.set()
        assert await _unless_lost(call, lost) == "first token" and not call.cancelled  # answered first

        go, lost = asyncio.Event(), asyncio.get_running_loop().create_future()
        call = FakePrefillCall(go)
        task = asyncio.create_task(_unless_lost(call, lost))
        await asyncio.sleep(0.01)
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        assert call.cancelled

    asyncio.run(main())


class FailingPrefillCall(FakePrefillCall):
    async def _wait(self):
        await self.go.wait()
        raise RuntimeError("DEADLINE_EXCEEDED")


def test_a_call_failing_as_its_request_is_cancelled_leaves_no_unread_error():
    # The call fails and the request is cancelled in the same turn of the loop: the call's error must
    # not surface as asyncio's "Task exception was never retrieved" (seen in a soak's router log).
    import gc

    from router.pipeline import _unless_lost

    unread: list[dict] = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unread.append(ctx))
        go, lost = asyncio.Event(), asyncio.get_running_loop().create_future()
        task = asyncio.create_task(_unless_lost(FailingPrefillCall(go), lost))
        await asyncio.sleep(0.01)
        go.set()      # the call's task runs first in the next turn and fails ...
        task.cancel()  # ... then the request's cancellation reaches _unless_lost
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(main())
    gc.collect()
    assert not [c for c in unread if "never retrieved" in c.get("message", "")], unread


def test_without_a_call_a_hold_is_given_up_once_old_and_the_worker_fails_a_poll(monkeypatch):
    """``--decode-mux off`` (or an older worker): no call whose silence would tell, so a hold counts as
    lost when the worker fails a health poll while the hold is UNRESPONSIVE_S old; a young hold and a
    released one are left alone."""
    monkeypatch.setattr(decode_mux, "UNRESPONSIVE_S", 5.0)

    async def main():
        streams = decode_mux.DecodeStreams(None, "d1", enabled=False)
        old, young, done = streams.hold("old"), streams.hold("young"), streams.hold("done")
        old.since -= 10.0  # as if its prefill had pushed here for 10 s (no sleeping)
        done.since -= 10.0
        done.release()
        assert streams.unresponsive("GetStats DEADLINE_EXCEEDED")
        err = old.lost.result()
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "stopped answering" in err.details()
        assert not young.lost.done() and not done.lost.done()
        assert not streams.unresponsive("again")  # given up once, the young one still too young
        young.release()
        assert streams._holds == {} and streams.metrics.abandoned._value.get() == 1

    asyncio.run(main())
