"""DecodeMany: many requests' Decode streams on one call (router/decode_mux.py <-> decode_service/mux.py).

Over a real gRPC server on loopback: the streams carry the same messages a Decode call per request
would (token-exact against one engine, several streams' updates in one response), and every way a
stream ends early frees the request on the worker: the router leaving, the deadline, a worker-side
failure, the call breaking, the worker draining. A worker without DecodeMany is served one Decode call
per request. Leak checks: no task left on the worker's session, no queue left on the router's call,
every block, lease and stream back on the engine.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from test_stream_coalesce import PARAMS, PROMPTS, NoKV, engine, reference

from decode_service.mux import DecodeManySession
from decode_service.service import DecodeServicer
from decode_service.worker import DecodeWorker
from engine.async_engine import AsyncEngine
from pdserve.v1 import decode_pb2, decode_pb2_grpc
from pdserve.wire import sampling_to_proto
from router.decode_mux import DecodeStreams

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("torch_single_thread")]


class FakeDecode(decode_pb2_grpc.DecodeServicer):
    """DecodeMany over scripted streams: ``script[rid]`` is a list of token ids to send one per message
    (then finish "length"), an exception to raise after them, or "hang" (never finishes); Allocates
    answer from ``allocs`` (``allocation``)."""

    def __init__(self, script: dict, *, mux: bool = True) -> None:
        self.script = script
        self.draining = asyncio.Event()
        self.running: set[str] = set()
        self.freed: list[str] = []
        self.sessions: list[DecodeManySession] = []
        self.decode_calls = 0
        self.allocate_calls = 0
        self.allocs: dict = {}
        self.allocating: set[str] = set()
        self.leased: set[str] = set()  # answered Allocates whose stream has not started (the lease table)
        self.fail_calls_with: grpc.StatusCode | None = None
        if not mux:
            self.DecodeMany = None  # type: ignore[assignment]

    async def responses(self, request):
        rid = request.request_id
        self.leased.discard(rid)
        self.running.add(rid)
        try:
            steps = self.script[rid]
            for i, tok in enumerate(steps if isinstance(steps, list) else []):
                await asyncio.sleep(0.005)
                last = i == len(steps) - 1
                yield decode_pb2.DecodeResponse(token_ids=[tok], completion_tokens=i + 1,
                                                finish_reason="length" if last else "")
            if steps == "hang":
                await asyncio.Event().wait()
            if isinstance(steps, Exception):
                raise steps
        finally:
            self.running.discard(rid)
            self.freed.append(rid)

    async def allocation(self, request):
        """``allocs[rid]``: block ids to answer with, an exception to raise, or "hang"."""
        rid = request.request_id
        self.allocating.add(rid)
        try:
            got = self.allocs.get(rid, [1, 2])
            if isinstance(got, tuple):  # (seconds, what): answered after a while
                await asyncio.sleep(got[0])
                got = got[1]
            if got == "hang":
                await asyncio.Event().wait()
            if isinstance(got, Exception):
                raise got
            self.leased.add(rid)
            return decode_pb2.AllocateResponse(worker_id="d0", block_ids=got)
        finally:
            self.allocating.discard(rid)

    async def Allocate(self, request, context):
        self.allocate_calls += 1
        return await self.allocation(request)

    async def Decode(self, request, context):
        self.decode_calls += 1
        async for msg in self.responses(request):
            yield msg

    async def DecodeMany(self, request_iterator, context):
        if self.fail_calls_with is not None:  # the call itself fails once something is asked on it
            await anext(aiter(request_iterator))
            await context.abort(self.fail_calls_with, "the call broke")
        session = DecodeManySession(self.responses, self.allocation, self.draining,
                                    leased=self.leased.__contains__)
        self.sessions.append(session)
        await session.serve(request_iterator, context)


@contextlib.asynccontextmanager
async def serving(servicer):
    server = grpc.aio.server()
    if getattr(servicer, "DecodeMany", True) is None:  # an older worker: no DecodeMany handler at all
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pdserve.v1.Decode", {
            "Decode": grpc.unary_stream_rpc_method_handler(
                servicer.Decode, request_deserializer=decode_pb2.DecodeRequest.FromString,
                response_serializer=decode_pb2.DecodeResponse.SerializeToString),
            "Allocate": grpc.unary_unary_rpc_method_handler(
                servicer.Allocate, request_deserializer=decode_pb2.AllocateRequest.FromString,
                response_serializer=decode_pb2.AllocateResponse.SerializeToString)}),))
    else:
        decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    streams = DecodeStreams(decode_pb2_grpc.DecodeStub(channel), f"127.0.0.1:{port}")
    try:
        yield server, streams
    finally:
        streams.close()
        await channel.close()
        await server.stop(0.5)  # the sessions end as the cancelled calls reach them


async def collect(streams: DecodeStreams, rid: str, timeout: float | None = 10.0, **kw) -> list[int]:
    req = decode_pb2.DecodeRequest(request_id=rid, **kw)
    return [t async for msg in streams.stream(req, timeout) for t in msg.token_ids]


async def settled(fake: FakeDecode, streams: DecodeStreams) -> None:
    """The leak check: nothing runs on the worker, nothing waits on the router's call."""
    for _ in range(200):
        call = streams._call
        idle = call is None or not (call.queues or call.allocs)
        if not (fake.running or fake.allocating) and all(not s.busy for s in fake.sessions) and idle:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"left running: {fake.running}, queues: {call and list(call.queues)}")


async def allocate(streams: DecodeStreams, rid: str, timeout: float | None = 10.0):
    return await streams.allocate(decode_pb2.AllocateRequest(request_id=rid, prompt_ids=[1, 2, 3]), timeout)


def status_of(exc_info) -> grpc.StatusCode:
    return exc_info.value.code()


def test_streams_share_one_call_and_end_cleanly():
    script = {f"r{i}": list(range(10 * i, 10 * i + 8)) for i in range(6)}

    async def main():
        fake = FakeDecode(script)
        async with serving(fake) as (_, streams):
            got = await asyncio.gather(*(collect(streams, rid) for rid in script))
            assert got == list(script.values())
            again = await collect(streams, "r0")  # a finished id may stream again
            assert again == script["r0"]
            assert len(fake.sessions) == 1 and fake.decode_calls == 0
            await settled(fake, streams)

    asyncio.run(main())


def test_router_leaving_early_frees_the_request_on_the_worker():
    async def main():
        fake = FakeDecode({"long": list(range(1000)), "hang": "hang", "ok": [1, 2]})
        async with serving(fake) as (_, streams):
            gen = streams.stream(decode_pb2.DecodeRequest(request_id="long"), 10.0)
            assert (await anext(gen)).token_ids == [0]
            await gen.aclose()  # the client went away
            task = asyncio.get_running_loop().create_task(collect(streams, "hang"))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await settled(fake, streams)
            assert {"long", "hang"} <= set(fake.freed)
            assert await collect(streams, "ok") == [1, 2]  # the call still serves others

    asyncio.run(main())


def test_deadline_and_worker_errors_arrive_as_the_status_of_that_stream_only():
    async def main():
        fake = FakeDecode({"hang": "hang", "bad": ValueError("bad sampling"),
                           "boom": ValueError("no such thing"), "ok": [3, 4, 5]})
        async with serving(fake) as (_, streams):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await collect(streams, "hang", timeout=0.2)
            assert status_of(exc) == grpc.StatusCode.DEADLINE_EXCEEDED
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await collect(streams, "boom")
            assert status_of(exc) == grpc.StatusCode.INVALID_ARGUMENT
            assert "no such thing" in exc.value.details()
            results = await asyncio.gather(collect(streams, "ok"), collect(streams, "bad"),
                                           return_exceptions=True)
            assert results[0] == [3, 4, 5]
            assert results[1].code() == grpc.StatusCode.INVALID_ARGUMENT
            await settled(fake, streams)

    asyncio.run(main())


def test_the_worker_ends_a_stream_at_the_deadline_it_was_given():
    """The worker keeps the deadline a start carries (what a Decode call's deadline did), whether or not
    the router is still reading."""
    async def main():
        fake = FakeDecode({"hang": "hang"})
        async with serving(fake) as (_, streams):
            call = streams.stub.DecodeMany()
            await call.write(decode_pb2.DecodeManyRequest(starts=[decode_pb2.DecodeStart(
                request=decode_pb2.DecodeRequest(request_id="hang"), timeout_ms=200)]))
            msg = await call.read()
            assert [(u.request_id, u.code) for u in msg.updates] == [
                ("hang", grpc.StatusCode.DEADLINE_EXCEEDED.value[0])]
            assert "hang" in fake.freed and not fake.running
            call.cancel()

    asyncio.run(main())


def test_a_duplicate_request_id_is_refused_not_run_twice():
    async def main():
        fake = FakeDecode({"r": "hang"})
        async with serving(fake) as (_, streams):
            first = asyncio.get_running_loop().create_task(collect(streams, "r"))
            await asyncio.sleep(0.1)
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await collect(streams, "r")
            assert status_of(exc) == grpc.StatusCode.ALREADY_EXISTS
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await first
            await settled(fake, streams)

    asyncio.run(main())


def test_a_broken_call_fails_every_stream_on_it_and_the_next_stream_opens_a_new_one():
    async def main():
        fake = FakeDecode({"a": "hang", "b": "hang", "c": [9]})
        async with serving(fake) as (server, streams):
            tasks = [asyncio.get_running_loop().create_task(collect(streams, rid)) for rid in ("a", "b")]
            await asyncio.sleep(0.1)
            broken = streams._call
            broken.call.cancel()  # what a dead worker or a cut connection does to the call
            for task in tasks:
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await task
                # both migrate (router/migration.py MIGRATABLE): the worker is gone under them
                assert status_of(exc) in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
            assert await collect(streams, "c") == [9]
            assert streams._call is not broken and len(fake.sessions) == 2
            assert streams.metrics.broken._value.get() == 1 and streams.metrics.calls._value.get() == 2
            await settled(fake, streams)
            assert {"a", "b"} <= set(fake.freed)  # the worker freed what the broken call carried

    asyncio.run(main())


def test_draining_refuses_new_streams_finishes_running_ones_then_ends_the_call():
    async def main():
        fake = FakeDecode({"run": list(range(30)), "late": [1]})
        async with serving(fake) as (_, streams):
            running = asyncio.get_running_loop().create_task(collect(streams, "run"))
            await asyncio.sleep(0.05)
            fake.draining.set()
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await collect(streams, "late")
            assert status_of(exc) == grpc.StatusCode.UNAVAILABLE and "draining" in exc.value.details()
            assert await running == list(range(30))
            for _ in range(100):  # the session ends its call once idle: the server's grace is not needed
                if streams._call.broken is not None:
                    break
                await asyncio.sleep(0.01)
            assert streams._call.broken is not None
            await settled(fake, streams)

    asyncio.run(main())


def test_draining_serves_the_streams_of_requests_leased_before_it_and_ends_when_no_lease_is_left():
    """A request allocated on the call before the SIGTERM (its prefill may be pushing KV right now) is
    served, not refused and prefilled a second time elsewhere; a stream this call did not lease is
    refused. The call stays open while such a lease is held and ends once it starts, or is released or
    expires without a start (nothing is sent for those: the session looks again while draining)."""
    async def main():
        fake = FakeDecode({"kept": [4, 5, 6], "stranger": [1]})
        async with serving(fake) as (_, streams):
            for rid in ("kept", "dropped"):
                assert list((await allocate(streams, rid)).block_ids) == [1, 2]
            fake.draining.set()
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await allocate(streams, "late")
            assert status_of(exc) == grpc.StatusCode.UNAVAILABLE and "draining" in exc.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await collect(streams, "stranger")
            assert status_of(exc) == grpc.StatusCode.UNAVAILABLE and "draining" in exc.value.details()
            await asyncio.sleep(0.3)
            assert streams._call.broken is None  # two leases held: the call stays open
            assert await collect(streams, "kept") == [4, 5, 6]
            await asyncio.sleep(0.3)
            assert streams._call.broken is None  # "dropped" is still leased
            fake.leased.discard("dropped")  # released (or expired) on the worker: no start will come
            for _ in range(100):
                if streams._call.broken is not None:
                    break
                await asyncio.sleep(0.01)
            assert streams._call.broken is not None
            await settled(fake, streams)
            assert len(fake.sessions) == 1 and not fake.sessions[0]._leases

    asyncio.run(main())


def test_a_long_lived_call_forgets_leases_that_ended_without_a_stream():
    async def main():
        fake = FakeDecode({})
        async with serving(fake) as (_, streams):
            for i in range(300):  # each released on the worker (no start ever comes)
                await allocate(streams, f"r{i}")
                fake.leased.discard(f"r{i}")
            assert len(fake.sessions[0]._leases) <= 64 + 1
            await settled(fake, streams)

    asyncio.run(main())


def test_a_worker_without_decode_many_gets_one_call_per_request():
    async def main():
        fake = FakeDecode({"a": [1, 2], "b": [3]}, mux=False)
        async with serving(fake) as (_, streams):
            assert await asyncio.gather(collect(streams, "a"), collect(streams, "b")) == [[1, 2], [3]]
            assert not streams.enabled and fake.decode_calls == 2
            assert await collect(streams, "a") == [1, 2]
            assert fake.decode_calls == 3
            assert list((await allocate(streams, "c")).block_ids) == [1, 2] and fake.allocate_calls == 1
        fake = FakeDecode({}, mux=False)
        async with serving(fake) as (_, streams):  # the first thing asked is an Allocate
            try:
                answer = await allocate(streams, "c")
            except grpc.aio.AioRpcError as exc:
                # grpc may report the worker's UNIMPLEMENTED, racing the Allocate's write, as INTERNAL for
                # the whole call: UNAVAILABLE for the request, which the router then places again
                assert exc.code() == grpc.StatusCode.UNAVAILABLE and "INTERNAL" in exc.details()
                answer = await allocate(streams, "c")
            assert list(answer.block_ids) == [1, 2]
            assert not streams.enabled and fake.allocate_calls == 1

    asyncio.run(main())


def test_decode_many_on_a_real_decode_worker_is_token_exact_and_gives_every_block_back():
    """The real servicer and engine: four local-prefill streams on one call equal one engine's tokens,
    ride shared responses, and leave no lease, stream or block behind."""
    async def main():
        prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0][::-1], PROMPTS[1][3:]]
        want = [await reference(p) for p in prompts]
        ae = AsyncEngine(engine())
        ae.start()
        worker = DecodeWorker(engine=ae, kv=NoKV(), worker_id="d0", block_size=16)
        servicer = DecodeServicer(worker, address="127.0.0.1:0", transports=["tcp"])
        try:
            async with serving(servicer) as (_, streams):
                for i, p in enumerate(prompts):
                    answer = await streams.allocate(decode_pb2.AllocateRequest(
                        request_id=f"r{i}", prompt_ids=p, sampling=sampling_to_proto(PARAMS)), 10.0)
                    assert answer.worker_id == "d0" and answer.block_ids
                got = await asyncio.gather(*(collect(streams, f"r{i}", prefill_locally=True)
                                             for i in range(len(prompts))))
                assert got == want
                m = streams.metrics  # as the router exports them
                assert m.calls._value.get() == 1 and m.broken._value.get() == 0
                stream_updates = m.updates._value.get() - len(prompts)  # less the Allocates' answers
                assert stream_updates > m.messages._value.get()  # several streams per response
                with pytest.raises(grpc.aio.AioRpcError) as exc:  # never allocated: NOT_FOUND, as Decode says
                    await collect(streams, "nobody", first_token_id=5)
                assert status_of(exc) == grpc.StatusCode.NOT_FOUND
            await asyncio.sleep(0.1)
            assert ae.engine.num_free_blocks == ae.engine.num_total_blocks
            assert not worker.leases.ids() and not worker.active
        finally:
            await ae.stop()

    asyncio.run(main())


def test_updates_that_queued_up_behind_a_slow_reader_arrive_as_one_message():
    async def main():
        fake = FakeDecode({"r": list(range(12))})
        async with serving(fake) as (_, streams):
            gen = streams.stream(decode_pb2.DecodeRequest(request_id="r"), 10.0)
            first = await anext(gen)
            await asyncio.sleep(0.3)  # a busy router: the worker's next messages wait in the queue
            rest = [msg async for msg in gen]
            assert list(first.token_ids) + [t for m in rest for t in m.token_ids] == list(range(12))
            assert len(rest) < 11 and rest[-1].finish_reason == "length" and rest[-1].completion_tokens == 12
            await settled(fake, streams)

    asyncio.run(main())
