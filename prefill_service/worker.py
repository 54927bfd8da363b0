"""The prefill worker's logic: compute a prompt's KV, push what the decode worker lacks, return token 1.

Lifecycle of one request on this worker::

    prefill()  engine.add_prefill_request (batched and chunked with the other prompts; reuses this
               worker's prefix cache) → "prefilled" StepOutput with the first sampled token
               → block_table → push blocks[skip:] into the decode worker's blocks[skip:], where
               skip = the decode worker's cached prefix (in blocks) → await the transfer's ack
               → return token 1; engine release queued (full blocks stay in the prefix cache for the
               next prompt). The block table comes with the "prefilled" output and the release is not
               awaited: either round trip to the engine thread would wait out the next forward pass.

With layer-wise push (``stream_layers``, default on when the transport supports it) the send is
opened when the final prompt chunk starts computing and each layer is pushed as soon as it is
written (``prefill_service.layer_stream``), so by the time the first token is sampled most of the KV
is already on its way; the worker then awaits the same acknowledgement. A request that could not
stream (preempted, nothing to send) is sent in one piece as above.

Cancellation (the router gave up) aborts the engine request and the transfer; the transfer is
settled (nothing in flight) before the blocks are released, so this worker never keeps KV beyond
its prefix cache and never frees blocks a send still reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from engine.async_engine import AsyncEngine
from kvtransfer import trace as kvtrace
from prefill_service.layer_stream import EventWaiter, LayerStream

log = logging.getLogger(__name__)


class PrefillAborted(RuntimeError):
    """The request was aborted (Abort RPC) while it was prefilled here."""

    code = "ABORTED"  # the gRPC status pdserve.server.status_for maps it to


@dataclass(frozen=True, kw_only=True)
class Target:
    worker_id: str
    kv_endpoint: bytes
    block_ids: list[int]
    num_cached_tokens: int
    transport: str


@dataclass(frozen=True, kw_only=True)
class PrefillResult:
    first_token_id: int
    first_logprob: float | None
    first_top: tuple[tuple[int, float], ...] = ()  # token 1's alternatives (token_id, logprob)
    num_prompt_tokens: int
    num_cached_tokens: int
    kv_blocks_sent: int
    num_tier_tokens: int = 0  # of num_cached_tokens, loaded back from the host or disk tier
    kv_bytes_sent: int
    transport: str
    # From the send's start (one piece: after the prefill; streamed: when its final chunk began) to
    # the receiver's acknowledgement.
    kv_transfer_s: float = 0.0
    kv_streamed: bool = False  # pushed layer by layer while the final chunk computed
    kv_wait_s: float = 0.0  # how long the first token waited for the acknowledgement after prefill
    # streamed sends: seconds after prefill() was called of open / first push / last push / prefill
    # done / acked, to see how much of the push overlapped the compute (benchmarks, debug logs)
    kv_stream_timeline: dict | None = None
    # prefill() called -> the engine's first step with this prompt; that step -> the "prefilled" output
    queue_s: float = 0.0
    compute_s: float = 0.0


class PrefillWorker:
    def __init__(self, *, engine: AsyncEngine, kv: Any, worker_id: str, block_size: int,
                 stream_layers: bool = True) -> None:
        self.engine = engine
        self.kv = kv  # kvtransfer.link.KVLink: send / open_stream + wait_sent / can_stream_layers
        self.worker_id = worker_id
        self.incarnation = uuid.uuid4().hex[:12]
        self.block_size = block_size
        self.in_flight: set[str] = set()
        self.stream_layers = bool(stream_layers) and bool(getattr(kv, "can_stream_layers", False))
        self._streams: dict[str, LayerStream] = {}
        self._aborted: set[str] = set()  # in flight, aborted by Abort: must not start a send any more
        self._waiter: EventWaiter | None = None
        self._releasing: set[asyncio.Future] = set()  # block releases queued on the engine thread
        log.info("prefill %s: layer-wise KV push %s", worker_id, "on" if self.stream_layers else
                 "off" + ("" if stream_layers else " (--kv-stream-layers off)"))

    async def prefill(self, request_id: str, prompt_ids: list[int], params: Any,
                      target: Target) -> PrefillResult:
        from pdserve.wire import first_logprob

        n_blocks = -(-len(prompt_ids) // self.block_size)
        if len(target.block_ids) != n_blocks:
            raise ValueError(f"target has {len(target.block_ids)} blocks, the prompt needs {n_blocks}")
        if target.num_cached_tokens % self.block_size or target.num_cached_tokens > len(prompt_ids):
            raise ValueError(f"bad num_cached_tokens {target.num_cached_tokens}")
        if request_id in self.in_flight:
            raise ValueError(f"request {request_id!r} is already being prefilled here")
        self.in_flight.add(request_id)
        t_in, mono_in = time.perf_counter(), time.monotonic()
        skip = target.num_cached_tokens // self.block_size
        stream = self._open_stream(request_id, target, skip) if self.stream_layers else None
        try:
            try:
                out, table = await self.engine.prefill(request_id, prompt_ids, params, layer_sink=stream,
                                                       release_on_error=False)
            except Exception as exc:  # e.g. the block table of a request Abort already dropped
                if request_id in self._aborted:
                    raise PrefillAborted(f"prefill of {request_id} was aborted") from exc
                raise
            t_out, mono_out = time.perf_counter(), time.monotonic()
            started = out_started(out, mono_in)
            # Abort may also race the end of the prefill: its blocks are going, nothing may be sent.
            if request_id in self._aborted:
                raise PrefillAborted(f"prefill of {request_id} was aborted")
            if out.finish_reason != "prefilled" or not out.new_token_ids:
                raise RuntimeError(f"prefill of {request_id} ended with {out.finish_reason}: "
                                   f"{getattr(out, 'error', None) or 'no first token'}")
            src, dst = table[skip:], list(target.block_ids[skip:])
            if len(src) != len(dst):
                raise RuntimeError(f"block table has {len(table)} blocks, target {len(target.block_ids)}")
            nbytes, backend, t_send = 0, target.transport or self.kv.name, t_out
            streamed = stream is not None and stream.streaming
            if streamed:
                t_send = stream.opened_at
                nbytes, backend = await stream.wait()
            elif src:
                nbytes, backend = await self.kv.send(target.kv_endpoint, request_id, src, dst)
            t_ack = time.perf_counter()
            if self.kv.trace:  # the prefill's side of the send's timeline (kvtransfer/trace.py)
                kvtrace.emit("prefill", request_id, {"called": mono_in, "first_step": started,
                                                     "prefill_done": mono_out,
                                                     "acked": mono_out + (t_ack - t_out)})
            # The router learns the pair's link bandwidth from bytes / kv_transfer_s. A streamed send's
            # open -> ack time is mostly the overlapped prefill compute (it would make a 150 GB/s link
            # look like 5 GB/s and push conditional disaggregation to local prefill), so it is no
            # sample: 0 (the router skips it). One-piece sends (streaming off, fallbacks) keep teaching it.
            transfer_s = t_ack - t_send if src and not streamed else 0.0
            how = "by layer" if streamed else f"one piece ({stream.reason if stream else 'streaming off'})"
            log.debug("%s: %d blocks, %d bytes over %s %s, open -> ack %.1f ms, first token waited %.1f ms",
                      request_id, len(src), nbytes, backend, how, (t_ack - t_send) * 1e3,
                      (t_ack - t_out) * 1e3)
            timeline = None
            if streamed and stream.push_at:
                timeline = {"open": stream.opened_at - t_in, "first_push": stream.push_at[0] - t_in,
                            "last_push": stream.push_at[-1] - t_in, "prefill_done": t_out - t_in,
                            "acked": t_ack - t_in}
                frames = getattr(stream.handle, "frame_times", None)
                if frames:  # TCP from device memory: when the staged copies were ready / on the socket
                    timeline.update(first_frame_ready=frames[0][1] - mono_in,
                                    last_frame_ready=frames[-1][1] - mono_in,
                                    first_frame_sent=frames[0][2] - mono_in,
                                    last_frame_sent=frames[-1][2] - mono_in,
                                    max_stage_wait=max(b - a for a, b, _ in frames))
            return PrefillResult(
                first_token_id=int(out.new_token_ids[0]), first_logprob=first_logprob(out),
                first_top=tuple(getattr(out.new_logprobs[0], "top", ())) if out.new_logprobs else (),
                num_prompt_tokens=len(prompt_ids), num_cached_tokens=int(out.num_cached_tokens or 0),
                num_tier_tokens=int(getattr(out, "num_tier_tokens", 0) or 0),
                kv_blocks_sent=len(src), kv_bytes_sent=int(nbytes), transport=backend,
                kv_transfer_s=transfer_s, kv_streamed=streamed, kv_wait_s=t_ack - t_out if src else 0.0,
                kv_stream_timeline=timeline, queue_s=max(0.0, started - mono_in),
                compute_s=max(0.0, mono_out - started))
        finally:
            await asyncio.shield(self._settle(request_id, stream))

    async def _settle(self, request_id: str, stream: LayerStream | None) -> None:
        """Stop the send (nothing in flight) BEFORE the blocks go back: nothing may read them after.

        The release is queued, not awaited: on a busy worker it runs after the forward pass in flight
        (~100 ms for a 4k prompt of an 8B model), and the first token must not wait for that. Commands
        run in order, so a later request with the same id is queued behind it. ``idle()`` awaits them."""
        try:
            if stream is not None:
                await stream.close()
                self._streams.pop(request_id, None)
            fut = self.engine.release_soon(request_id)
            self._releasing.add(fut)
            fut.add_done_callback(self._released)
        finally:
            self.in_flight.discard(request_id)
            self._aborted.discard(request_id)

    def _released(self, fut: asyncio.Future) -> None:
        self._releasing.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            log.warning("releasing a prefilled request's blocks failed: %r", fut.exception())

    async def idle(self) -> None:
        """Return once every queued block release has run (tests). On shutdown nothing needs it: the
        engine thread runs every command queued before its stop."""
        while self._releasing:
            await asyncio.wait(list(self._releasing))

    def _open_stream(self, request_id: str, target: Target, skip: int) -> LayerStream:
        stream = LayerStream(kv=self.kv, loop=asyncio.get_running_loop(), request_id=request_id,
                             endpoint=target.kv_endpoint, dst=list(target.block_ids[skip:]), skip=skip,
                             num_layers=self.kv.num_layers, waiter=self._event_waiter)
        self._streams[request_id] = stream
        return stream

    def _event_waiter(self) -> EventWaiter:
        if self._waiter is None:  # engine thread, first CUDA layer event: one thread per worker
            self._waiter = EventWaiter()
        return self._waiter

    async def abort(self, request_id: str) -> bool:
        found = request_id in self.in_flight
        if found:
            self._aborted.add(request_id)
        stream = self._streams.get(request_id)
        if stream is not None:  # stop reading the blocks before the engine frees them
            await stream.close("prefill aborted")
        await self.engine.abort(request_id)
        return found


def out_started(out: Any, default: float) -> float:
    """When the engine first scheduled the prompt (time.monotonic()), from its "prefilled" output."""
    return getattr(out, "first_scheduled_at", None) or default
