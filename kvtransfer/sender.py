"""One outgoing transfer: a SendHandle the prefill side can poll, await or abort.

Lifecycle::

    start_send(...)        validates ids against the endpoint (range, duplicates, equal counts) and the
                           layout hash synchronously -> InvalidTransfer / LayoutMismatch, nothing sent
    worker task            peer (cached handshake) -> BEGIN (NIXL: wait BEGIN_OK, since a one-sided
                           write cannot be taken back; TCP: pipelined, the receiver checks BEGIN before
                           any DATA of the request) -> one step per pushed layer range -> finish
        TCP                DATA frames (segments of coalesced block runs, <= max_frame_bytes), then END;
                           device memory goes through page-locked buffers, one frame staged ahead
                           (sender_tcp.py)
        NIXL               one WRITE per layer, made while BEGIN_OK travels and posted when the layer is
                           pushed (nixl_prebuild; otherwise one WRITE per pushed layer range, ranges
                           queued meanwhile joining it, a one-shot send ONE WRITE for all layers), by
                           index into descriptor lists prepared once per (agent, remote agent); finish
                           waits for all to be DONE (a fast, GIL-releasing poll for about the expected
                           duration: nixl_fast_wait_s), then
                           tells the receiver: a WROTE frame on the side channel (receivers advertising
                           CAP_WROTE; nixl_tx_done_frame) and/or a NIXL notification {done, rid, n,
                           xid} (attached to the last WRITE when finish() was already known, always for
                           a one-shot send; sent after the WRITEs otherwise, unless WROTE was sent).
                           The receiver completes on the first of the two.
    DONE from receiver     -> state "done"; wait() returns {request_id, bytes, seconds, backend}
    error/abort/timeout    -> "failed"/"aborted": in-flight NIXL writes are cancelled or waited out
                           before the handle settles (so the source blocks may be reused), the
                           receiver is told (ABORT), a receiver-initiated abort is acknowledged

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

import numpy as np

from .blocks import merge_regions, pair_runs, validate_layers
from .errors import InvalidTransfer, PeerUnavailable, TransferAborted, TransferError, TransferTimeout
from .future_result import FutureResult
from .protocol import CAP_WROTE, Msg, notif_message
from .rx_nixl import poll_pause
from .sender_tcp import _FINISH, TcpSend
from .trace import emit, enabled

log = logging.getLogger("kvtransfer.tx")
# Fixed part of the fast-wait budget (post, completion, a few polls), on top of bytes / nixl_fast_wait_gbps.
_FAST_WAIT_BASE_S = 0.002


class SendHandle(TcpSend, FutureResult):
    def __init__(self, transport, rid: str, endpoint: dict, src: tuple[int, ...], dst: tuple[int, ...],
                 timeout: float) -> None:
        self.t = transport
        self.request_id = rid
        self.endpoint = endpoint
        self.src, self.dst = src, dst
        self.runs = pair_runs(src, dst)
        self._src_np = np.asarray(src, dtype=np.int64)
        self._dst_np = np.asarray(dst, dtype=np.int64)
        self.nbytes = transport.layout.num_layers * len(dst) * transport.layout.block_bytes
        self.state = "connecting"
        self.backend: str | None = None
        self.started = time.monotonic()
        # Monotonic instants of its steps (start, begin_sent, begin_ok, posted, xfers_done, sent, acked):
        # diagnostics for benches (bench/gpu_transfer.py breaks a NIXL transfer's time down with them).
        self.timeline = {"start": self.started}
        # device memory over TCP: (staging issued, staged bytes ready, frame on the socket) per DATA frame,
        # time.monotonic(); shows whether a streamed send waits on the GPU copies or on the socket
        self.frame_times: list[tuple[float, float, float]] = []
        self._deadline = self.started + timeout
        self._pushed: set[int] = set()
        self._finished = False
        self._ops: asyncio.Queue = asyncio.Queue()
        self._peer = None
        self._xfers: list = []  # posted NIXL WRITEs not yet DONE and released
        self._ready: dict[int, tuple] = {}  # layer -> (WRITE made but not posted, its descriptors)
        self._notif_attached = False
        self._began = False
        self._settling = False
        # Names this transfer in BEGIN, WROTE and the NIXL notification, so a late completion of an earlier
        # transfer with the same request id can never complete this one.
        self.xid = secrets.token_hex(6)
        self._begin_ok: asyncio.Future = transport.loop.create_future()
        self._opened: asyncio.Future = transport.loop.create_future()  # see begun()
        self._done: asyncio.Future = transport.loop.create_future()
        self._future: asyncio.Future = transport.loop.create_future()
        for fut in (self._begin_ok, self._done, self._future):
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._cancel_exc: TransferError | None = None
        self._ack_remote_abort = False
        self._task = transport.loop.create_task(self._run(), name=f"kvtransfer-send-{rid}")
        self._task.add_done_callback(self._task_ended)

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
        self._ops.put_nowait(("layers", todo, final))

    def finish(self) -> None:
        """All layers were pushed: signal completion to the receiver."""
        if self._finished:
            return
        self._check_all_pushed()
        self._finished = True
        self._ops.put_nowait(_FINISH)

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

    # -- callbacks from the peer's reader ----------------------------------------------------------
    def _on_begin_ok(self) -> None:
        if not self._begin_ok.done():
            self._begin_ok.set_result(None)

    def _mark_opened(self) -> None:
        if not self._opened.done():
            self._opened.set_result(None)

    def _on_done(self) -> None:
        if not self._done.done():
            self._done.set_result(None)

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

    def _task_ended(self, task: asyncio.Task) -> None:
        """A task cancelled before its first step never ran ``_run`` (an abort or a peer error right
        after start_send): nothing was sent or registered with a peer, so failing the handle here is
        all the settling there is. Without it ``wait()`` would never return."""
        if task.cancelled() and not self._future.done():
            exc = self._cancel_exc or TransferAborted(f"transfer {self.request_id!r} cancelled")
            self.state = "aborted" if isinstance(exc, TransferAborted) else "failed"
            self._future.set_exception(exc)
            self.t._sends.pop(self.request_id, None)

    # -- worker ------------------------------------------------------------------------------------
    async def _run(self) -> None:
        self._began = False
        try:
            await asyncio.wait_for(self._body(), max(0.0, self._deadline - time.monotonic()))
            self.state = "done"
            if enabled():
                emit("tx", self.request_id, self.timeline)
            self._future.set_result({"request_id": self.request_id, "bytes": self.nbytes,
                                     "backend": self.backend, "seconds": time.monotonic() - self.started})
        except asyncio.CancelledError:
            exc = self._cancel_exc or TransferAborted(f"transfer {self.request_id!r} cancelled")
            await self._settle(exc, self._began)
        except asyncio.TimeoutError:
            exc = TransferTimeout(f"transfer {self.request_id!r} to {self.endpoint['host']}:"
                                  f"{self.endpoint['port']} not acknowledged before its deadline "
                                  f"(state {self.state})")
            await self._settle(exc, self._began)
        except TransferError as exc:
            await self._settle(exc, self._began)
        except Exception as exc:  # a bug: still settle so nothing leaks, then surface it
            log.exception("kvtransfer: send %s crashed", self.request_id)
            await self._settle(TransferError(f"internal error: {exc!r}"), self._began)
        finally:
            if self._peer is not None and self._peer.handles.get(self.request_id) is self:
                del self._peer.handles[self.request_id]
            self.t._sends.pop(self.request_id, None)

    async def _body(self) -> None:
        peer = self._peer = await self.t._peer_for(self.endpoint)
        if self.request_id in peer.handles:
            raise InvalidTransfer(f"request {self.request_id!r} is already being sent to {peer.name}")
        peer.handles[self.request_id] = self
        self.backend, self.state = peer.backend, "sending"
        meta = {"rid": self.request_id, "dst": list(self.dst), "nbytes": self.nbytes,
                "backend": peer.backend}
        if peer.backend == "nixl":
            meta["agent"] = self.t.nixl.name
            meta["xid"] = self.xid
        self._began = True
        if peer.backend == "tcp":
            await self._run_tcp(peer, meta)
            return
        # UCX progress for this process's side of the WRITEs and the notification, also between our
        # own state polls and after the last one (see rx_nixl.NixlNotifications.hold).
        notifs = self.t.receiver.notifs
        notifs.hold()
        try:
            await self._run_nixl(peer, meta)
        finally:
            notifs.unhold()

    async def _run_nixl(self, peer, meta: dict) -> None:
        await peer.send_frame(Msg.BEGIN, meta)
        self.timeline["begin_sent"] = time.monotonic()
        self._prebuild(peer)
        await self._begin_ok
        self.timeline["begin_ok"] = time.monotonic()
        self._mark_opened()
        while True:
            op = await self._next_op()
            if op is _FINISH:
                await self._finish(peer, notified=False)
                break
            # Layer ranges pushed while the previous WRITE was being posted go out as one WRITE; a
            # finish() already queued behind them lets that WRITE carry the completion notification.
            layers, final = self._join_queued(op[1], op[2])
            await self._send_layers(peer, layers, final)
            if final:
                await self._finish(peer, notified=True)
                break
        self.state = "completing"
        await self._done
        self.timeline["acked"] = time.monotonic()

    def _join_queued(self, layers: tuple[int, ...], final: bool) -> tuple[tuple[int, ...], bool]:
        """These layers plus those of every push already queued behind them (and a queued finish())."""
        while not final and not self._ops.empty():
            nxt = self._ops.get_nowait()
            if nxt is _FINISH:
                return layers, True
            layers, final = layers + nxt[1], nxt[2]
        return layers, final

    async def _next_op(self):
        """The next pushed op; meanwhile keep UCX progressing the WRITEs already posted (without NIXL's
        progress thread, bytes move only inside our NIXL calls: an unpolled WRITE stalls)."""
        while self._ops.empty() and self._xfers:
            self._reap()
            await poll_pause(self.t.config)
        return await self._ops.get()

    def _reap(self) -> None:
        nixl = self.t.nixl
        for handle in list(self._xfers):
            state = nixl.state(handle)
            if state == "DONE":
                nixl.release(handle)
                self._xfers.remove(handle)
            elif state != "PROC":
                raise PeerUnavailable(f"NIXL WRITE of {self.request_id!r} failed ({state})")

    def _prebuild(self, peer) -> None:
        """One WRITE per layer, made (not posted) while BEGIN_OK travels (TransportConfig.nixl_prebuild).
        A push then posts each layer's WRITE with one call: the first layer's bytes move after
        microseconds instead of after one make_prepped_xfer over every index of the push. All layers are
        built, in order, before BEGIN_OK is awaited; unposted ones are released on settle."""
        nixl = self.t.nixl
        if not (self.t.config.nixl_prebuild and self.src and nixl.can_post_blocks(peer.remote_agent)):
            return
        nb, rnb = self.t.memory.num_blocks, peer.num_blocks
        for layer in range(self.t.layout.num_layers):
            local = (layer * nb + self._src_np).astype(np.int32)
            remote = (layer * rnb + self._dst_np).astype(np.int32)
            self._ready[layer] = nixl.make_blocks_xfer(peer.remote_agent, local, remote)
        self.timeline["prebuilt"] = time.monotonic()

    async def _send_layers(self, peer, layers: tuple[int, ...], final: bool) -> None:
        """ONE NIXL WRITE for all these layers' blocks (a one-shot send: every layer, one post), or with
        prebuilt WRITEs one post per layer (the completion notification then goes after them)."""
        if not layers or not self.src:
            return
        nixl = self.t.nixl
        if self._ready:
            self._notif_attached = False
            for layer in layers:
                handle, ndescs = self._ready.pop(layer)
                nixl.post(handle, peer.remote_agent, ndescs)  # a failed post released the handle
                self._xfers.append(handle)
            self.timeline["posted"] = time.monotonic()
            return
        notif = self._notif() if final else b""
        self._notif_attached = final
        if nixl.can_post_blocks(peer.remote_agent):
            # Indices into the prepared (layer, block) lists: layer-major, pairs in request order, so
            # runs consecutive on both sides (also across a layer boundary) are merged by NIXL.
            lay = np.asarray(layers, dtype=np.int64)[:, None]
            local = (lay * self.t.memory.num_blocks + self._src_np).ravel().astype(np.int32)
            remote = (lay * peer.num_blocks + self._dst_np).ravel().astype(np.int32)
            handle, _state = nixl.post_blocks(peer.remote_agent, local, remote, notif)
        else:
            bb, mem, rnb = self.t.layout.block_bytes, self.t.memory, peer.num_blocks
            regions = merge_regions((mem.offset(layer, s), (layer * rnb + d) * bb, n * bb)
                                    for layer in layers for s, d, n in self.runs)
            info = peer.remote
            handle, _state = nixl.post_write(peer.remote_agent, info["base"], info["dev"], info["mem"],
                                             regions, notif)
        self._xfers.append(handle)
        self.timeline["posted"] = time.monotonic()

    def _notif(self) -> bytes:
        return notif_message("done", rid=self.request_id, n=self.nbytes, xid=self.xid)

    def _fast_wait_s(self) -> float:
        """How long _finish may poll fast: about the transfer's duration on a slow link, capped."""
        cfg = self.t.config
        if not cfg.nixl_fast_wait_s or self.t.memory.nixl_mem_type not in cfg.nixl_fast_wait_mem:
            return 0.0
        return min(cfg.nixl_fast_wait_s, _FAST_WAIT_BASE_S + self.nbytes / (cfg.nixl_fast_wait_gbps * 1e9))

    async def _finish(self, peer, notified: bool) -> None:
        nixl, cfg = self.t.nixl, self.t.config
        # Fast phase (see TransportConfig.nixl_fast_wait_s): a state poll (= a UCX progress call) every
        # nixl_fast_wait_nap_s. time.sleep releases the GIL (the engine thread runs meanwhile); the bare
        # yield lets this loop's other tasks run (the selector is polled without a timeout). Then, or
        # without it: no sleep for nixl_spin_s, then every nixl_poll_interval_s (>= ~1 ms with asyncio).
        now = time.monotonic()
        fast_until = now + self._fast_wait_s()
        spin_until = now + cfg.nixl_spin_s
        nap = cfg.nixl_fast_wait_nap_s
        for handle in list(self._xfers):
            while (state := nixl.state(handle)) == "PROC":
                now = time.monotonic()
                if now < fast_until:
                    time.sleep(nap)
                    await asyncio.sleep(0)
                else:
                    await poll_pause(cfg, spinning=now < spin_until)
            if state != "DONE":
                raise PeerUnavailable(f"NIXL WRITE of {self.request_id!r} to {peer.name} failed ({state})")
            nixl.release(handle)
            self._xfers.remove(handle)
        self.timeline["xfers_done"] = time.monotonic()
        wrote = cfg.nixl_tx_done_frame and CAP_WROTE in peer.caps
        if wrote:
            # DONE of a WRITE means NIXL's endpoint flush completed: the bytes are in the receiver's memory.
            await peer.send_frame(Msg.WROTE, {"rid": self.request_id, "n": self.nbytes,
                                              "layers": self.t.layout.num_layers, "xid": self.xid})
            self.timeline["wrote_sent"] = time.monotonic()
        elif not (notified and self._notif_attached):
            nixl.send_notif(peer.remote_agent, self._notif())

    async def _settle(self, exc: TransferError, began: bool) -> None:
        """Leave nothing in flight: cancel/wait out NIXL writes, tell the receiver, then fail the handle."""
        self._settling = True  # a peer failing now must not cancel this cleanup
        self.state = "aborted" if isinstance(exc, TransferAborted) else "failed"
        nixl = self.t.nixl
        for handle, _n in self._ready.values():  # made, never posted: nothing to wait for
            nixl.release(handle)
        self._ready.clear()
        deadline = time.monotonic() + self.t.config.abort_ack_timeout_s
        for handle in list(self._xfers):
            while not nixl.release(handle):  # release cancels a WRITE still in flight, if it can
                if time.monotonic() > deadline:
                    log.error("kvtransfer: NIXL WRITE of %s still in flight after abort", self.request_id)
                    break
                await asyncio.sleep(0.001)
            else:
                self._xfers.remove(handle)
        peer = self._peer
        if began and peer is not None and not peer.closed:
            msg = Msg.ABORT_ACK if self._ack_remote_abort else Msg.ABORT
            try:
                frame = peer.send_frame(msg, {"rid": self.request_id, "reason": str(exc)})
                await asyncio.wait_for(frame, 2.0)
            except (TransferError, asyncio.TimeoutError, asyncio.CancelledError):
                pass
        if not self._future.done():
            self._future.set_exception(exc)
