"""One outgoing transfer: a SendHandle the prefill side can poll, await or abort.

Lifecycle::

    start_send(...)        validates ids against the endpoint (range, duplicates, equal counts) and the
                           layout hash synchronously -> InvalidTransfer / LayoutMismatch, nothing sent
    worker task            peer (cached handshake) -> the peer's backend picks the path (one protocol,
                           ``SendPath``): TcpPath (sender_tcp.py) or NixlPath (sender_nixl.py), which
                           sends BEGIN, one step per pushed layer range, the end of the transfer
    DONE from receiver     -> state "done"; wait() returns {request_id, bytes, seconds, backend}
    error/abort/timeout    -> "failed"/"aborted": the path leaves nothing in flight (NIXL writes are
                           cancelled or waited out, so the source blocks may be reused), the receiver is
                           told (ABORT), a receiver-initiated abort is acknowledged
    deadline               start_send's timeout covers connect, handshake, data and the acknowledgement;
                           past it a TCP transfer whose connection still moves bytes (others' frames
                           ahead of it) carries on, and fails once the connection moved nothing for
                           stall_timeout_s (see TransportConfig)

Layer-wise streaming: start_send(..., layers=range(0, 4)) sends those layers and leaves the handle
open; push_layers(range(4, 8)) as layers are computed; finish() once all were pushed. await begun()
returns once the send is open at the receiver (NIXL: BEGIN_OK; TCP: BEGIN written), e.g. to push every
layer of a send opened with layers=() with nothing of the handshake left.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Protocol

import numpy as np

from .blocks import pair_runs, validate_layers
from .errors import InvalidTransfer, TransferAborted, TransferError, TransferTimeout
from .future_result import FutureResult
from .protocol import Msg
from .send_ops import FINISH
from .sender_nixl import NixlPath
from .sender_tcp import TcpPath
from .trace import emit, frame_summary

log = logging.getLogger("kvtransfer.tx")


class SendPath(Protocol):
    """How one backend moves a SendHandle's blocks (chosen once the peer's backend is known)."""

    lane: object  # the connection its control frames (and TCP data) go on: kvtransfer.lane.Lane

    def begin_fields(self, meta: dict) -> None: ...  # add backend-specific fields to BEGIN
    async def run(self, begin: dict) -> None: ...  # BEGIN .. the receiver's DONE
    async def settle(self) -> None: ...  # leave nothing of this transfer in flight
    def last_progress(self) -> float | None: ...  # last instant its connection moved bytes; None: n/a
    def end(self) -> None: ...  # the transfer is over (bookkeeping only)


class SendHandle(FutureResult):
    def __init__(self, transport, rid: str, endpoint: dict, src: tuple[int, ...], dst: tuple[int, ...],
                 timeout: float) -> None:
        self.t = transport
        self.request_id = rid
        self.endpoint = endpoint
        self.src, self.dst = src, dst
        self.runs = pair_runs(src, dst)
        self.src_np = np.asarray(src, dtype=np.int64)
        self.dst_np = np.asarray(dst, dtype=np.int64)
        self.nbytes = transport.layout.num_layers * len(dst) * transport.layout.block_bytes
        self.state = "connecting"
        self.backend: str | None = None
        self.started = time.monotonic()
        # Monotonic instants of its steps (start, begin_sent, begin_ok, posted, xfers_done, sent, acked):
        # diagnostics for benches (bench/gpu_transfer.py breaks a NIXL transfer's time down with them).
        self.timeline = {"start": self.started}
        # TCP with trace on: per DATA frame (queued, staging issued, staged, lane picked, written),
        # time.monotonic(); shows whether a send waits on the GPU copies, its lanes or the socket
        self.frame_times: list[tuple[float, float, float, float, float]] = []
        self.deadline = self.started + timeout
        self._pushed: set[int] = set()
        self._finished = False
        self.ops: asyncio.Queue = asyncio.Queue()
        self.peer = None
        self.path: SendPath | None = None
        # Names this transfer in BEGIN, WROTE and the NIXL notification, so a late completion of an earlier
        # transfer with the same request id can never complete this one.
        self.xid = secrets.token_hex(6)
        self.begin_ok: asyncio.Future = transport.loop.create_future()
        self._opened: asyncio.Future = transport.loop.create_future()  # see begun()
        self.acked: asyncio.Future = transport.loop.create_future()
        self._future: asyncio.Future = transport.loop.create_future()
        for fut in (self.begin_ok, self.acked, self._future):
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._cancel_exc: TransferError | None = None
        self._ack_remote_abort = False
        self._settling = False
        self._task = transport.loop.create_task(self._run(), name=f"kvtransfer-send-{rid}")
        self._task.add_done_callback(self._task_ended)
        self._watchdog = transport.loop.call_at(self._loop_time(self.deadline), self._on_deadline)

    # -- public ------------------------------------------------------------------------------------
    def push_layers(self, layers, *, final: bool = False) -> None:
        """Queue these layers' blocks for sending (layer-wise streaming)."""
        if self._future.done() and self._future.exception() is not None:
            raise self._future.exception()
        if self._finished:
            raise InvalidTransfer(f"transfer {self.request_id!r} already finished")
        todo = validate_layers(layers, self.t.layout.num_layers)
        again = sorted(self._pushed.intersection(todo))
        if again:
            raise InvalidTransfer(f"layers {again[:8]} of {self.request_id!r} were already pushed")
        self._pushed.update(todo)
        if final:
            self._check_all_pushed()
            self._finished = True
        self.ops.put_nowait(("layers", todo, final))

    def finish(self) -> None:
        """All layers were pushed: signal completion to the receiver."""
        if self._finished:
            return
        self._check_all_pushed()
        self._finished = True
        self.ops.put_nowait(FINISH)

    async def begun(self) -> None:
        """Return once the send is open at the receiver: NIXL -- its BEGIN_OK arrived (it accepted the
        request; a pushed layer's WRITE is posted at once); TCP -- BEGIN was written to the socket (it is not
        acknowledged, and rides along with the first pushed layers' data, if any). Raises the TransferError
        that ended the send if it ended first. Cancelling the waiter never cancels the transfer."""
        await asyncio.wait([self._opened, self._future], return_when=asyncio.FIRST_COMPLETED)
        if not self._opened.done() and self._future.exception() is not None:
            raise self._future.exception()

    async def abort(self, reason: str = "aborted by sender") -> None:
        """Stop; returns once nothing of this transfer is in flight any more."""
        if not self._task.done():
            self._cancel(TransferAborted(f"transfer {self.request_id!r} {reason}"))
        await asyncio.wait([self._task])

    # -- for the paths -----------------------------------------------------------------------------
    def mark_opened(self) -> None:
        if not self._opened.done():
            self._opened.set_result(None)

    def join_queued(self, layers: tuple[int, ...], final: bool) -> tuple[tuple[int, ...], bool]:
        """These layers plus those of every push already queued behind them (and a queued finish())."""
        while not final and not self.ops.empty():
            nxt = self.ops.get_nowait()
            if nxt is FINISH:
                return layers, True
            layers, final = layers + nxt[1], nxt[2]
        return layers, final

    async def wait_acked(self) -> None:
        self.state = "completing"
        await self.acked
        self.timeline["acked"] = time.monotonic()

    # -- callbacks from the peer's readers ---------------------------------------------------------
    def _on_begin_ok(self) -> None:
        if not self.begin_ok.done():
            self.begin_ok.set_result(None)

    def _on_done(self) -> None:
        if not self.acked.done():
            self.acked.set_result(None)

    def _on_error(self, exc: TransferError) -> None:
        self._cancel(exc)

    def _remote_abort(self, reason: str) -> None:
        self._ack_remote_abort = True
        self._cancel(TransferAborted(f"transfer {self.request_id!r} aborted by receiver: {reason}"))

    def _cancel(self, exc: TransferError) -> None:
        if self._cancel_exc is None and not self._settling and not self._task.done():
            self._cancel_exc = exc
            self._task.cancel()

    def _check_all_pushed(self) -> None:
        missing = sorted(set(range(self.t.layout.num_layers)) - self._pushed)
        if missing:
            raise InvalidTransfer(f"finish() of {self.request_id!r} with layers {missing[:8]} never pushed")

    def _loop_time(self, instant: float) -> float:
        """A time.monotonic() instant on the loop's clock (the same clock on Linux; kept explicit)."""
        return self.t.loop.time() + (instant - time.monotonic())

    def _on_deadline(self) -> None:
        """Past the deadline: fail, unless the transfer's connection moved bytes within stall_timeout_s
        (then look again when that window would end)."""
        if self._task.done():
            return
        stall = self.t.config.stall_timeout_s
        seen = self.path.last_progress() if self.path is not None else None
        now = time.monotonic()
        if seen is not None and self.state in ("sending", "completing") and now - seen < stall:
            self._watchdog = self.t.loop.call_at(self._loop_time(seen + stall), self._on_deadline)
            return
        moved = f", connection idle {now - seen:.1f}s" if seen is not None else ""
        self._cancel(TransferTimeout(f"transfer {self.request_id!r} to {self.endpoint['host']}:"
                                     f"{self.endpoint['port']} not acknowledged before its deadline "
                                     f"(state {self.state}{moved})"))

    def _task_ended(self, task: asyncio.Task) -> None:
        """A task cancelled before its first step never ran ``_run`` (an abort or a peer error right
        after start_send): nothing was sent or registered with a peer, so failing the handle here is
        all the settling there is. Without it ``wait()`` would never return."""
        self._watchdog.cancel()
        if task.cancelled() and not self._future.done():
            exc = self._cancel_exc or TransferAborted(f"transfer {self.request_id!r} cancelled")
            self.state = "aborted" if isinstance(exc, TransferAborted) else "failed"
            self._future.set_exception(exc)
            self.t._sends.pop(self.request_id, None)

    # -- worker ------------------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            await self._body()
            self.state = "done"
            if self.t.config.trace:
                emit("tx", self.request_id, self.timeline)
                if self.frame_times:
                    emit("tx-frames", self.request_id, frame_summary(self.frame_times))
            self._future.set_result({"request_id": self.request_id, "bytes": self.nbytes,
                                     "backend": self.backend, "seconds": time.monotonic() - self.started})
        except asyncio.CancelledError:
            exc = self._cancel_exc or TransferAborted(f"transfer {self.request_id!r} cancelled")
            await self._settle(exc, self.path is not None)
        except TransferError as exc:
            await self._settle(exc, self.path is not None)
        except Exception as exc:  # a bug: still settle so nothing leaks, then surface it
            log.exception("kvtransfer: send %s crashed", self.request_id)
            await self._settle(TransferError(f"internal error: {exc!r}"), self.path is not None)
        finally:
            if self.peer is not None and self.peer.handles.get(self.request_id) is self:
                del self.peer.handles[self.request_id]
            if self.path is not None:
                self.path.end()
            self.t._sends.pop(self.request_id, None)

    async def _body(self) -> None:
        peer = self.peer = await self.t._peer_for(self.endpoint)
        if self.request_id in peer.handles:
            raise InvalidTransfer(f"request {self.request_id!r} is already being sent to {peer.name}")
        peer.handles[self.request_id] = self
        self.backend, self.state = peer.backend, "sending"
        meta = {"rid": self.request_id, "dst": list(self.dst), "nbytes": self.nbytes, "backend": peer.backend}
        self.path = TcpPath(self, peer) if peer.backend == "tcp" else NixlPath(self, peer)
        self.path.begin_fields(meta)
        await self.path.run(meta)

    async def _settle(self, exc: TransferError, began: bool) -> None:
        """Leave nothing in flight (the path's part), tell the receiver, then fail the handle."""
        self._settling = True  # a peer failing now must not cancel this cleanup
        self.state = "aborted" if isinstance(exc, TransferAborted) else "failed"
        if self.path is not None:
            await self.path.settle()
        lane = self.path.lane if self.path is not None else None
        if began and lane is not None and not lane.closed:
            msg = Msg.ABORT_ACK if self._ack_remote_abort else Msg.ABORT
            try:
                frame = lane.send_frame(msg, {"rid": self.request_id, "reason": str(exc)})
                await asyncio.wait_for(frame, 2.0)
            except (TransferError, asyncio.TimeoutError, asyncio.CancelledError):
                pass
        if not self._future.done():
            self._future.set_exception(exc)
