"""Sending side: the cached connections to one remote endpoint (side channel + TCP data), with the handshake.

Lifecycle::

    connect()      lane 0: TCP connect (connect_timeout_s; TLS handshake when configured), then HELLO ->
                   HELLO_OK / ERROR:
                   protocol version and KV layout hash must match (mismatch -> LayoutMismatch naming
                   both sides' values). For NIXL the reply carries the receiver's agent metadata and
                   registered region; we load it and prove the path end to end by sending a NIXL
                   notification whose nonce the receiver must report back (PROBE/PROBE_OK). If any of
                   that fails, "auto" falls back to TCP on the same connection and logs why.
                   HELLO / HELLO_OK also carry each side's capabilities ("caps", protocol.CAPS): frame
                   types newer than version 1's set (WROTE) go only to a receiver that advertised them.
                   A TCP peer then opens tcp_connections - 1 more lanes (each says HELLO, want tcp)
    pick_lanes()   a transfer rides the least loaded lanes: BEGIN and END on the first (the receiver binds
                   it to the connection its BEGIN came on), DATA frames over all of them once the receiver
                   acknowledged a striped BEGIN (CAP_STRIPE); frames are written whole per lane (lane.py)
    reader tasks   one per lane: route BEGIN_OK / DONE / ERROR / ABORT for a request id to its SendHandle
    dead()         EOF, reset or a poisoned stream on any lane: every handle fails with PeerUnavailable,
                   every lane closes, the peer leaves the cache, its NIXL remote agent is forgotten

Peers are reused by every transfer to the same endpoint (host, port, instance).
"""

from __future__ import annotations

import asyncio
import logging
import secrets

from .errors import (
    BackendUnavailable,
    LayoutMismatch,
    PeerUnavailable,
    ProtocolError,
    TransferError,
    error_from_wire,
)
from .lane import Lane
from .protocol import CAPS, PROTOCOL_VERSION, Msg, meta_caps, notif_message

log = logging.getLogger("kvtransfer.tx")


class Peer:
    def __init__(self, transport, endpoint: dict) -> None:
        self.t = transport
        self.endpoint = endpoint
        self.key = (endpoint["host"], endpoint["port"], endpoint["instance"])
        self.name = f"{endpoint['host']}:{endpoint['port']}"
        self.loop = transport.loop
        self.lanes: list[Lane] = []
        self.backend = "tcp"
        self.num_blocks = int(endpoint["num_blocks"])
        self.remote: dict | None = None  # receiver's NIXL info from HELLO_OK
        self.remote_agent: str | None = None
        self.caps: frozenset[str] = frozenset()  # the receiver's (HELLO_OK "caps"; none from older peers)
        self.handles: dict[str, object] = {}
        self.closed = False
        self._waiters: dict[tuple, asyncio.Future] = {}

    # -- setup -------------------------------------------------------------------------------------
    async def connect(self) -> None:
        cfg = self.t.config
        lane = Lane(self, 0)
        self.lanes.append(lane)
        await lane.open()
        try:
            await asyncio.wait_for(self._handshake(), cfg.handshake_timeout_s)
            if self.backend == "tcp" and cfg.tcp_connections > 1:
                await asyncio.wait_for(self._more_lanes(cfg.tcp_connections - 1), cfg.handshake_timeout_s)
        except asyncio.TimeoutError:
            self.close()
            raise PeerUnavailable(f"handshake with KV receiver {self.name} timed out "
                                  f"after {cfg.handshake_timeout_s}s") from None
        except BaseException:
            self.close()
            raise

    async def _more_lanes(self, n: int) -> None:
        """TCP data lanes beside lane 0, each greeted like lane 0 (layout hash checked again)."""
        lanes = [Lane(self, i + 1) for i in range(n)]
        self.lanes.extend(lanes)

        async def open_one(lane: Lane) -> None:
            await lane.open()
            await self._hello("tcp", lane)

        await asyncio.gather(*(open_one(lane) for lane in lanes))

    def pick_lanes(self, nbytes: int, count: int) -> list[Lane]:
        """The lanes a new transfer rides, the least loaded (bytes of transfers on it) first; each is
        charged its share of nbytes. The first carries BEGIN and END."""
        lanes = sorted(self.lanes, key=lambda ln: (ln.load, ln.index))[:max(1, count)]
        for lane in lanes:
            lane.load += nbytes // len(lanes)
        return lanes

    async def _handshake(self) -> None:
        layout = self.t.layout
        want_nixl = self.t.nixl is not None and "nixl" in self.endpoint.get("backends", ())
        reply = await self._hello("nixl" if want_nixl else "tcp")
        self.caps = meta_caps(reply)
        self.num_blocks = int(reply["num_blocks"])
        if reply.get("layout_hash") != layout.compat_hash():
            raise LayoutMismatch(f"KV layout mismatch: receiver {self.name} hash {reply.get('layout_hash')} "
                                 f"vs sender hash {layout.compat_hash()} ({layout.describe()})")
        if not want_nixl:
            self.backend = "tcp"
            if self.t.kind == "auto":
                why = ("NIXL unavailable here: " + self.t.nixl_error) if self.t.nixl is None \
                    else "receiver offers no NIXL"
                log.info("kvtransfer: peer %s uses TCP (%s)", self.name, why)
            return
        try:
            await self._nixl_setup(reply)
            self.backend = "nixl"
            log.info("kvtransfer: peer %s uses NIXL (agent %s, %s)", self.name, self.remote_agent,
                     self.remote["mem"])
        except (TransferError, asyncio.TimeoutError) as exc:
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if self.remote_agent is not None:
                self.t.nixl.remove_remote(self.remote_agent)
                self.remote_agent = None
            if self.t.kind != "auto" or "tcp" not in self.endpoint.get("backends", ()):
                raise BackendUnavailable(f"NIXL handshake with {self.name} failed: {why}") from exc
            log.warning("kvtransfer: peer %s: NIXL handshake failed (%s); falling back to TCP",
                        self.name, why)
            await self._hello("tcp")
            self.backend = "tcp"

    async def _hello(self, want: str, lane: Lane | None = None) -> dict:
        layout = self.t.layout
        lane = lane or self.lanes[0]
        fut = self._waiter(("hello", lane.index))
        await lane.send_frame(Msg.HELLO, {"version": PROTOCOL_VERSION, "layout_hash": layout.compat_hash(),
                                          "layout_desc": layout.describe(), "want": want,
                                          "caps": list(CAPS), "sender": self.t.instance,
                                          "agent": self.t.nixl.name if self.t.nixl else None})
        return await fut

    async def _nixl_setup(self, reply: dict) -> None:
        info = reply.get("nixl")
        if not isinstance(info, dict):
            raise BackendUnavailable("receiver sent no NIXL metadata")
        if info.get("nbytes") != self.num_blocks * self.t.layout.num_layers * self.t.layout.block_bytes:
            raise BackendUnavailable(f"receiver's registered region ({info.get('nbytes')} bytes) does not "
                                     f"match its {self.num_blocks} blocks")
        self.remote = info
        self.remote_agent = self.t.nixl.add_remote(info)
        nonce = secrets.token_hex(8)
        fut = self._waiter(("probe", nonce))
        # The notification may not go out before UCX has wired up; retry briefly until it is accepted.
        for attempt in range(50):
            try:
                self.t.nixl.send_notif(self.remote_agent, notif_message("probe", nonce=nonce))
                break
            except PeerUnavailable:
                if attempt == 49:
                    raise
                await asyncio.sleep(0.02)
        await self.send_frame(Msg.PROBE, {"nonce": nonce})
        # Half the handshake budget, so that a silent NIXL path still leaves time to fall back to TCP.
        # Meanwhile our own agent must make progress too (UCX wire-up replies): hold our poller busy.
        notifs = self.t.receiver.notifs
        notifs.hold()
        try:
            await asyncio.wait_for(fut, self.t.config.handshake_timeout_s / 2)
        finally:
            notifs.unhold()

    # -- I/O ---------------------------------------------------------------------------------------
    def _waiter(self, key: tuple) -> asyncio.Future:
        fut = self._waiters[key] = self.loop.create_future()
        return fut

    async def send_frame(self, msg: Msg, meta: dict) -> None:
        """A control frame on lane 0 (the side channel: handshake, NIXL transfers)."""
        if not self.lanes:
            raise PeerUnavailable(f"connection to KV receiver {self.name} is closed")
        await self.lanes[0].send_frame(msg, meta)

    def dispatch(self, lane: Lane, msg: Msg, meta: dict) -> None:
        """A reply read on one of the lanes."""
        rid = meta.get("rid")
        if msg in (Msg.HELLO_OK, Msg.PROBE_OK) or (msg == Msg.ERROR and rid is None):
            hello = ("hello", lane.index)
            key = ("probe", meta.get("nonce")) if msg == Msg.PROBE_OK else hello
            fut = self._waiters.pop(key, None) or self._waiters.pop(hello, None)
            if fut is None:
                if msg == Msg.ERROR:
                    self.dead(error_from_wire(meta, f"KV receiver {self.name}: "))
                return
            if fut.done():
                return
            if msg == Msg.ERROR:
                fut.set_exception(error_from_wire(meta, f"KV receiver {self.name} refused: "))
            else:
                fut.set_result(meta)
            return
        if not isinstance(rid, str):
            raise ProtocolError(f"{msg.name} frame without a request id")
        handle = self.handles.get(rid)
        if msg == Msg.ABORT:
            if handle is None:
                self.loop.create_task(self._ack_abort(lane, rid))
            else:
                handle._remote_abort(str(meta.get("reason", "")))
        elif handle is None:
            return  # a late reply for a transfer that already ended
        elif msg == Msg.BEGIN_OK:
            handle._on_begin_ok()
        elif msg == Msg.DONE:
            handle._on_done()
        elif msg == Msg.ERROR:
            handle._on_error(error_from_wire(meta, f"KV receiver {self.name} rejected {rid!r}: "))

    async def _ack_abort(self, lane: Lane, rid: str) -> None:
        """On the connection the ABORT came on: the receiver waits for the ack per connection."""
        try:
            await lane.send_frame(Msg.ABORT_ACK, {"rid": rid})
        except TransferError:
            pass

    # -- teardown ----------------------------------------------------------------------------------
    def dead(self, exc: TransferError) -> None:
        if self.closed:
            return
        log.warning("kvtransfer: peer %s lost: %s", self.name, exc)
        self.close(exc)

    def close(self, exc: TransferError | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        exc = exc or PeerUnavailable(f"connection to KV receiver {self.name} closed")
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(exc)
                fut.add_done_callback(lambda f: f.exception())
        self._waiters.clear()
        for handle in list(self.handles.values()):
            handle._on_error(exc)
        for lane in self.lanes:
            lane.close()
        if self.remote_agent is not None and self.t.nixl is not None:
            self.t.nixl.remove_remote(self.remote_agent)
            self.remote_agent = None
        self.t._forget_peer(self)
