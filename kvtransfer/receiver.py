"""Receiving side: the table of expected transfers and what each incoming frame may do to it.

Lifecycle of one request on the decode side::

    expect(rid, dst_blocks, deadline)   -> Expectation (state "waiting"); a timer fails it at the deadline
    BEGIN from a sender                 checked against the expectation (same destination block set, byte
                                        count = layers x blocks x block_bytes, not already claimed by another
                                        sender); binds the expectation to that connection ("receiving")
    TCP:  DATA frames                   every segment must name (layer, block) pairs of this expectation not
                                        yet written; only then is the payload received in place
          END                           all (layer, block) pairs written exactly once -> "done", DONE sent
          striped (BEGIN {stripe})      BEGIN_OK sent; DATA also on the sender's other connections (same
                                        "sender" in their HELLO); END may come before their last frames:
                                        the last byte completes it then
    NIXL: WROTE frame {rid, n, layers}  on the connection that sent BEGIN (sender's WRITEs DONE), or
          notification {done, rid, n}   from the agent named in BEGIN (polled by rx_nixl.NixlNotifications),
                                        whichever comes first: n = expected bytes (layers = all of them),
                                        xid = BEGIN's when it named one -> "done", DONE sent; the other
                                        one then finds no expectation and is dropped
    abort(rid) / deadline / END early / sender connection lost
                                        -> failed; the sender is told (ABORT) and, for NIXL, abort() waits
                                        for its ABORT_ACK: after that no write of this request can land
    deadline while receiving over TCP   not a failure while the connection it is bound to keeps moving
                                        bytes (its frames may queue behind other transfers' on the same
                                        connection): it fails once that connection moved nothing for
                                        stall_timeout_s (flow control is TCP's; the deadline catches a
                                        sender that never came or stalled)

A terminal expectation leaves the table at once (the handle keeps its result), so the table holding
nothing is the leak check. Everything runs on the transport's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time

from engine.kv_layout import KVLayout

from . import trace
from .blocks import validate_block_ids
from .config import TransportConfig
from .errors import (
    InvalidTransfer,
    LayoutMismatch,
    PeerUnavailable,
    ProtocolError,
    TransferAborted,
    TransferError,
    TransferTimeout,
    UnknownRequest,
    error_to_wire,
)
from .expectation import Expectation
from .iostats import IoStats
from .memory import KVMemory
from .protocol import CAPS, PROTOCOL_VERSION, Msg, meta_int, meta_int_list, meta_str
from .rx_nixl import NixlNotifications
from .rx_tcp import TcpReceiving

log = logging.getLogger("kvtransfer.rx")


class Receiver(TcpReceiving):
    def __init__(self, *, layout: KVLayout, memory: KVMemory, config: TransportConfig, nixl,
                 backends: tuple[str, ...], loop: asyncio.AbstractEventLoop) -> None:
        self.layout = layout
        self.memory = memory
        self.config = config
        self.nixl = nixl
        self.backends = backends
        self.loop = loop
        self.expectations: dict[str, Expectation] = {}
        # Failed expectations whose failure is not told yet (sender to confirm, frames still arriving).
        self.unsettled: dict[str, Expectation] = {}
        self.recv_pool = None  # set by the transport: threads receiving large payloads
        self.io_rx = IoStats()  # what those threads did (counters())
        self.conns: set = set()
        # NIXL notifications (completions, handshake probes), polled in rx_nixl.py.
        self.notifs = NixlNotifications(self) if nixl is not None else None

    # -- local API ---------------------------------------------------------------------------------
    def expect(self, rid: str, dst_block_ids, deadline: float) -> Expectation:
        if not isinstance(rid, str) or not rid or len(rid) > 256:
            raise InvalidTransfer(f"request id must be a non-empty string of <= 256 chars, got {rid!r:.80}")
        if rid in self.expectations:
            raise InvalidTransfer(f"request {rid!r} is already expected")
        dst = validate_block_ids(dst_block_ids, self.memory.num_blocks, "destination")
        exp = Expectation(rid, dst, self.layout.num_layers, self.memory.block_bytes, self.loop)
        self.expectations[rid] = exp
        delay = max(0.0, deadline - time.monotonic())
        exp.timer = self.loop.call_later(delay, self._on_deadline, rid)
        return exp

    async def abort(self, rid: str, reason: str) -> bool:
        """Fail an expectation (or join a failure already under way); returns once no write of it can land
        any more: True when the sender confirmed (or none was bound), False when it did not within
        abort_ack_timeout_s (logged by _settle_failure). Either way no frame of it is still being received
        into its blocks or copied there, so they may be freed."""
        exp = self.expectations.get(rid) or self.unsettled.get(rid)
        if exp is None:
            return True
        if exp.state != "failed":
            self._fail(exp, TransferAborted(f"request {rid!r} aborted by receiver: {reason}"), notify=True)
        # The grace past the ack timeout: a frame stuck mid-payload is cut then (its connection closed),
        # and its receive thread notices within IO_TIMEOUT_S.
        try:
            return bool(await asyncio.wait_for(asyncio.shield(exp.quiet),
                                               self.config.abort_ack_timeout_s + 2.0))
        except asyncio.TimeoutError:
            return False

    def release(self, rid: str) -> None:
        exp = self.expectations.get(rid)
        if exp is not None:
            self._fail(exp, TransferAborted(f"request {rid!r} released by receiver"), notify=True)

    def close(self) -> None:
        for exp in list(self.expectations.values()):
            self._fail(exp, TransferAborted("transport closed"), notify=True)
        if self.notifs is not None:
            self.notifs.close()
        for conn in list(self.conns):
            conn.close()

    # -- state transitions -------------------------------------------------------------------------
    def _fail(self, exp: Expectation, exc: TransferError, notify: bool) -> None:
        self.expectations.pop(exp.request_id, None)
        self.unsettled[exp.request_id] = exp
        if exp.timer is not None:
            exp.timer.cancel()
        exp.state = "failed"
        conn = exp.conn
        if not notify or conn is None or conn.closed:
            self._settle_failure(exp, exc)
            return
        ack = conn.abort_acks.get(exp.request_id)
        if ack is None:
            ack = conn.abort_acks[exp.request_id] = self.loop.create_future()
            ack.add_done_callback(lambda _f, c=conn, r=exp.request_id: c.abort_acks.pop(r, None))
        conn.send(Msg.ABORT, {"rid": exp.request_id, "reason": str(exc)})
        # The waiter hears of the failure once the sender confirmed it stopped writing (or its connection
        # died, or abort_ack_timeout_s passed): from then on the blocks are safe to free or reuse, even
        # with one-sided RDMA writes or a TCP frame that was still arriving.
        timer = self.loop.call_later(self.config.abort_ack_timeout_s, self._settle_failure, exp, exc, True)
        ack.add_done_callback(lambda _f: (timer.cancel(), self._settle_failure(exp, exc)))

    def _settle_failure(self, exp: Expectation, exc: TransferError, unconfirmed: bool = False) -> None:
        """The sender confirmed (or is gone, or abort_ack_timeout_s passed): tell the failure once no frame
        of the request is still arriving into its targets and its last host->device copy has landed (TCP
        frames already written when the sender stopped may still be in the sockets of its other
        connections; their payload must not land in blocks the decode service has freed)."""
        if exp._future.done() or exp.settling is not None:
            return
        exp.settling = (exc, not unconfirmed)
        if unconfirmed:
            log.warning("kvtransfer: sender of %s did not confirm the abort within %.1fs; closing the "
                        "connections still receiving a frame of it", exp.request_id,
                        self.config.abort_ack_timeout_s)
            for conn in list(exp.reading):
                conn.close()
        self._settle_if_quiet(exp)

    def _settle_if_quiet(self, exp: Expectation) -> None:
        if exp.settling is None or exp._future.done() or exp.reading:
            return
        events, exp.flushing = [e for e in exp.flushing if not e.query()], []
        if events:
            self.loop.create_task(self._settle_after(exp, events))
            return
        if self.unsettled.get(exp.request_id) is exp:
            del self.unsettled[exp.request_id]
        exc, confirmed = exp.settling
        exp._future.set_exception(exc)
        exp.quiet.set_result(confirmed)

    async def _settle_after(self, exp: Expectation, events: list) -> None:
        await self.memory.all_ready(events)
        self._settle_if_quiet(exp)

    def _complete(self, exp: Expectation) -> None:
        self.expectations.pop(exp.request_id, None)
        if exp.timer is not None:
            exp.timer.cancel()
        exp.state = "done"
        now = exp.timeline["complete"] = time.monotonic()
        if self.config.trace:
            trace.emit("rx", exp.request_id, exp.timeline)
            if exp.frame_stats:
                trace.emit("rx-frames", exp.request_id, exp.frame_stats)
        exp._future.set_result({"request_id": exp.request_id, "bytes": exp.nbytes, "backend": exp.backend,
                                "seconds": now - exp.started})
        exp.conn.send(Msg.DONE, {"rid": exp.request_id})

    def _on_deadline(self, rid: str) -> None:
        exp = self.expectations.get(rid)
        if exp is None:
            return
        conn, stall = exp.conn, self.config.stall_timeout_s
        if exp.backend == "tcp" and exp.state == "receiving" and conn is not None and not conn.closed:
            seen = max(c.last_progress for c in exp.conns | {conn})
            if time.monotonic() - seen < stall:
                # Making progress (maybe on other transfers' frames queued ahead of its own): look again
                # when the connection would have been idle for stall_timeout_s.
                exp.timer = self.loop.call_later(seen + stall - time.monotonic(), self._on_deadline, rid)
                return
        idle = (f", its connection idle for {time.monotonic() - conn.last_progress:.1f}s"
                if conn is not None and exp.backend == "tcp" else "")
        self._fail(exp, TransferTimeout(f"KV for request {rid!r} incomplete at its deadline "
                                        f"(state {exp.state}, {exp.received}/{exp.nbytes} bytes seen{idle})"),
                   notify=True)

    def on_conn_lost(self, conn, exc) -> None:
        why = f": {exc}" if exc else ""
        for exp in [e for e in self.expectations.values() if e.conn is conn or conn in e.conns]:
            self._fail(exp, PeerUnavailable(f"sender {conn.peer} of request {exp.request_id!r} disconnected "
                                            f"mid-transfer{why}"), notify=False)
        if self.notifs is not None:
            self.notifs.forget_conn(conn)

    # -- frames ------------------------------------------------------------------------------------
    def on_control(self, conn, msg: Msg, meta: dict) -> None:
        try:
            if msg == Msg.HELLO:
                self._on_hello(conn, meta)
            elif msg == Msg.PROBE:
                self._on_probe(conn, meta_str(meta, "nonce"))
            elif msg == Msg.BEGIN:
                self._on_begin(conn, meta)
            elif msg == Msg.END:
                self._on_end(conn, meta)
            elif msg == Msg.WROTE:
                self._on_wrote(conn, meta)
            elif msg == Msg.ABORT:
                rid = meta_str(meta, "rid")
                exp = self.expectations.get(rid)
                if exp is not None and (exp.conn is conn or conn in exp.conns):
                    reason = str(meta.get("reason", ""))[:500]
                    err = TransferAborted(f"request {rid!r} aborted by sender: {reason}")
                    self._fail(exp, err, notify=False)
                conn.send(Msg.ABORT_ACK, {"rid": rid})
            elif msg == Msg.ABORT_ACK:
                fut = conn.abort_acks.get(meta_str(meta, "rid"))
                if fut is not None and not fut.done():
                    fut.set_result(True)
            else:
                raise ProtocolError(f"unexpected {msg.name} frame from a sender")
        except ProtocolError:
            raise
        except TransferError as exc:
            rid = meta.get("rid") if isinstance(meta.get("rid"), str) else None
            conn.send(Msg.ERROR, {**({"rid": rid} if rid else {}), **error_to_wire(exc)})
            if rid is not None and rid in self.expectations and not isinstance(exc, UnknownRequest):
                exp = self.expectations[rid]
                if exp.conn is None or exp.conn is conn or conn in exp.conns:
                    self._fail(exp, exc, notify=False)
            if msg == Msg.HELLO:
                conn.close()

    def _on_hello(self, conn, meta: dict) -> None:
        version = meta.get("version")
        if version != PROTOCOL_VERSION:
            raise LayoutMismatch(f"protocol version mismatch: sender {version!r}, "
                                 f"receiver {PROTOCOL_VERSION}")
        theirs, ours = meta.get("layout_hash"), self.layout.compat_hash()
        if theirs != ours:
            desc = meta.get("layout_desc", "?")
            raise LayoutMismatch(f"KV layout mismatch: sender hash {theirs} ({desc}) vs receiver hash {ours} "
                                 f"({self.layout.describe()})")
        want = meta.get("want")
        if want not in self.backends:
            raise LayoutMismatch(f"sender wants backend {want!r}; receiver offers {list(self.backends)}")
        reply = {"version": PROTOCOL_VERSION, "layout_hash": ours, "num_blocks": self.memory.num_blocks,
                 "backend": want, "caps": list(CAPS)}
        sender = meta.get("sender")
        # Which sender this connection belongs to: a striped transfer's frames are taken on any of them.
        conn.sender = sender if isinstance(sender, str) and 0 < len(sender) <= 64 else None
        if want == "nixl":
            agent = meta.get("agent")
            if not isinstance(agent, str) or not agent or len(agent) > 256:
                raise InvalidTransfer("a NIXL HELLO must name the sender's agent")
            # The only agent this connection may announce transfers from (BEGIN), and so the only one
            # whose completions count for them: with TLS, one authenticated by the cluster CA.
            conn.nixl_agent = agent
            reply["nixl"] = self.nixl.info()
            self.notifs.kick()  # UCX wire-up with the sender follows: progress it promptly
        conn.send(Msg.HELLO_OK, reply)

    def _on_probe(self, conn, nonce: str) -> None:
        if self.notifs is not None:  # else never answered: the sender's probe times out, it falls back
            self.notifs.on_probe(conn, nonce)

    def _on_begin(self, conn, meta: dict) -> None:
        rid = meta_str(meta, "rid", 256)
        exp = self.expectations.get(rid)
        if exp is None:
            raise UnknownRequest(f"request {rid!r} is not expected by this receiver (never, or no longer)")
        if exp.conn is not None:
            raise InvalidTransfer(f"request {rid!r} is already being written by {exp.conn.peer}")
        backend = meta.get("backend")
        if backend not in self.backends:
            raise InvalidTransfer(f"backend {backend!r} not offered by this receiver")
        dst = validate_block_ids(meta_int_list(meta, "dst"), self.memory.num_blocks, "destination")
        if set(dst) != set(exp.dst):
            extra = sorted(set(dst) - set(exp.dst))[:8]
            missing = sorted(set(exp.dst) - set(dst))[:8]
            raise InvalidTransfer(f"request {rid!r}: destination blocks differ from the reserved ones "
                                  f"(not reserved: {extra}, not covered: {missing})")
        nbytes = meta_int(meta, "nbytes")
        if nbytes != exp.nbytes:
            raise InvalidTransfer(f"request {rid!r}: sender announces {nbytes} bytes, receiver expects "
                                  f"{exp.nbytes} ({exp.num_layers} layers x {len(exp.dst)} blocks x "
                                  f"{self.memory.block_bytes} bytes)")
        exp.conn, exp.backend, exp.state = conn, backend, "receiving"
        exp.conns = {conn}
        exp.timeline["begin"] = time.monotonic()
        if backend == "tcp" and meta.get("stripe") is True and conn.sender is not None:
            exp.striped = True
            conn.send(Msg.BEGIN_OK, {"rid": rid})  # the sender's other connections may carry DATA now
        if backend == "nixl":
            exp.sender_agent = meta_str(meta, "agent")
            if exp.sender_agent != conn.nixl_agent:
                raise InvalidTransfer(f"request {rid!r}: NIXL agent {exp.sender_agent!r} was not named in "
                                      f"this connection's HELLO ({conn.nixl_agent!r})")
            exp.xid = meta_str(meta, "xid", 64) if meta.get("xid") is not None else None
            conn.send(Msg.BEGIN_OK, {"rid": rid})
            self.notifs.kick()  # its WRITE and completion notification are about to arrive

    def _on_wrote(self, conn, meta: dict) -> None:
        """The sender's NIXL WRITEs of a request are DONE (its endpoint was flushed: the bytes are here)."""
        rid = meta_str(meta, "rid", 256)
        exp = self.expectations.get(rid)
        if (exp is None or exp.conn is not conn or exp.backend != "nixl"
                or (exp.xid is not None and meta.get("xid") != exp.xid)):
            # Completed by its NIXL notification already (the usual duplicate), or aborted meanwhile.
            log.debug("kvtransfer: WROTE for %r matches no transfer in progress (done already?)", rid)
            return
        self.complete_nixl(exp, meta_int(meta, "n"), meta_int(meta, "layers"), "wrote")

    def complete_nixl(self, exp: Expectation, nbytes: int, layers: int | None, via: str) -> None:
        """A NIXL transfer's completion (WROTE frame or notification): the same checks for both."""
        if nbytes != exp.nbytes or (layers is not None and layers != exp.num_layers):
            self._fail(exp, InvalidTransfer(f"NIXL completion of {exp.request_id!r} ({via}) reports "
                                            f"{nbytes} bytes / {layers} layers, expected {exp.nbytes} / "
                                            f"{exp.num_layers}"), notify=True)
            return
        exp.received = exp.nbytes
        exp.timeline[via] = time.monotonic()
        self._complete(exp)

    def _bound(self, conn, meta: dict, backend: str) -> Expectation:
        rid = meta_str(meta, "rid", 256)
        exp = self.expectations.get(rid)
        if exp is None or exp.conn is None:
            raise UnknownRequest(f"request {rid!r} has no transfer in progress on this connection")
        if exp.conn is not conn and conn not in exp.conns:
            if not (exp.striped and conn.sender is not None and conn.sender == exp.conn.sender):
                raise UnknownRequest(f"request {rid!r} has no transfer in progress on this connection")
            exp.conns.add(conn)
        if exp.backend != backend:
            raise InvalidTransfer(f"request {rid!r} began on {exp.backend}, not {backend}")
        return exp
