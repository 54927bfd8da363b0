"""The NIXL path of a send (``SendPath`` for a NIXL peer). See sender.py for the lifecycle.

    BEGIN {.., agent, xid} -> wait BEGIN_OK (a one-sided write cannot be taken back)
    WRITEs                 one per layer, made while BEGIN_OK travels and posted when the layer is pushed
                           (nixl_prebuild; otherwise one WRITE per pushed layer range, ranges queued
                           meanwhile joining it, a one-shot send ONE WRITE for all layers), by index into
                           descriptor lists prepared once per (agent, remote agent)
    finish                 wait for every WRITE to be DONE (a fast, GIL-releasing poll for about the expected
                           duration: nixl_fast_wait_s), then tell the receiver: a WROTE frame on the side
                           channel (receivers advertising CAP_WROTE; nixl_tx_done_frame) and/or a NIXL
                           notification {done, rid, n, xid} (attached to the last WRITE when finish() was
                           already known, always for a one-shot send; sent after the WRITEs otherwise,
                           unless WROTE was sent). The receiver completes on the first of the two.
    settle                 unposted WRITEs released, posted ones cancelled or waited out
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from .blocks import merge_regions
from .errors import PeerUnavailable
from .protocol import CAP_WROTE, Msg, notif_message
from .rx_nixl import poll_pause
from .send_ops import FINISH

log = logging.getLogger("kvtransfer.tx")
# Fixed part of the fast-wait budget (post, completion, a few polls), on top of bytes / nixl_fast_wait_gbps.
_FAST_WAIT_BASE_S = 0.002


def fast_wait_s(config, mem_type: str, nbytes: int) -> float:
    """How long the finish may poll fast: about the transfer's duration on a slow link, capped."""
    if not config.nixl_fast_wait_s or mem_type not in config.nixl_fast_wait_mem:
        return 0.0
    return min(config.nixl_fast_wait_s, _FAST_WAIT_BASE_S + nbytes / (config.nixl_fast_wait_gbps * 1e9))


class NixlPath:
    def __init__(self, handle, peer) -> None:
        self.h = handle
        self.t = handle.t
        self.peer = peer
        self.lane = peer.lanes[0]
        self.xfers: list = []  # posted NIXL WRITEs not yet DONE and released
        self.ready: dict[int, tuple] = {}  # layer -> (WRITE made but not posted, its descriptors)
        self._notif_attached = False

    def begin_fields(self, meta: dict) -> None:
        meta["agent"] = self.t.nixl.name
        meta["xid"] = self.h.xid

    def last_progress(self) -> None:
        return None  # one-sided WRITEs: no progress is seen here; the deadline is final

    def end(self) -> None:
        pass

    async def run(self, begin: dict) -> None:
        # UCX progress for this process's side of the WRITEs and the notification, also between our
        # own state polls and after the last one (see rx_nixl.NixlNotifications.hold).
        notifs = self.t.receiver.notifs
        notifs.hold()
        try:
            await self._run(begin)
        finally:
            notifs.unhold()

    async def _run(self, begin: dict) -> None:
        h = self.h
        await self.lane.send_frame(Msg.BEGIN, begin)
        h.timeline["begin_sent"] = time.monotonic()
        self._prebuild()
        await h.begin_ok
        h.timeline["begin_ok"] = time.monotonic()
        h.mark_opened()
        while True:
            op = await self._next_op()
            if op is FINISH:
                await self._finish(notified=False)
                break
            # Layer ranges pushed while the previous WRITE was being posted go out as one WRITE; a
            # finish() already queued behind them lets that WRITE carry the completion notification.
            layers, final = h.join_queued(op[1], op[2])
            self._send_layers(layers, final)
            if final:
                await self._finish(notified=True)
                break
        await h.wait_acked()

    async def _next_op(self):
        """The next pushed op; meanwhile keep UCX progressing the WRITEs already posted (without NIXL's
        progress thread, bytes move only inside our NIXL calls: an unpolled WRITE stalls)."""
        ops = self.h.ops
        while ops.empty() and self.xfers:
            self._reap()
            await poll_pause(self.t.config)
        return await ops.get()

    def _reap(self) -> None:
        nixl = self.t.nixl
        for handle in list(self.xfers):
            state = nixl.state(handle)
            if state == "DONE":
                nixl.release(handle)
                self.xfers.remove(handle)
            elif state != "PROC":
                raise PeerUnavailable(f"NIXL WRITE of {self.h.request_id!r} failed ({state})")

    def _prebuild(self) -> None:
        """One WRITE per layer, made (not posted) while BEGIN_OK travels (TransportConfig.nixl_prebuild).
        A push then posts each layer's WRITE with one call: the first layer's bytes move after
        microseconds instead of after one make_prepped_xfer over every index of the push. All layers are
        built, in order, before BEGIN_OK is awaited; unposted ones are released on settle."""
        nixl, h, peer = self.t.nixl, self.h, self.peer
        if not (self.t.config.nixl_prebuild and h.src and nixl.can_post_blocks(peer.remote_agent)):
            return
        nb, rnb = self.t.memory.num_blocks, peer.num_blocks
        for layer in range(self.t.layout.num_layers):
            local = (layer * nb + h.src_np).astype(np.int32)
            remote = (layer * rnb + h.dst_np).astype(np.int32)
            self.ready[layer] = nixl.make_blocks_xfer(peer.remote_agent, local, remote)
        h.timeline["prebuilt"] = time.monotonic()

    def _send_layers(self, layers: tuple[int, ...], final: bool) -> None:
        """ONE NIXL WRITE for all these layers' blocks (a one-shot send: every layer, one post), or with
        prebuilt WRITEs one post per layer (the completion notification then goes after them)."""
        h, peer, nixl = self.h, self.peer, self.t.nixl
        if not layers or not h.src:
            return
        if self.ready:
            self._notif_attached = False
            for layer in layers:
                handle, ndescs = self.ready.pop(layer)
                nixl.post(handle, peer.remote_agent, ndescs)  # a failed post released the handle
                self.xfers.append(handle)
            h.timeline["posted"] = time.monotonic()
            return
        notif = self._notif() if final else b""
        self._notif_attached = final
        if nixl.can_post_blocks(peer.remote_agent):
            # Indices into the prepared (layer, block) lists: layer-major, pairs in request order, so
            # runs consecutive on both sides (also across a layer boundary) are merged by NIXL.
            lay = np.asarray(layers, dtype=np.int64)[:, None]
            local = (lay * self.t.memory.num_blocks + h.src_np).ravel().astype(np.int32)
            remote = (lay * peer.num_blocks + h.dst_np).ravel().astype(np.int32)
            handle, _state = nixl.post_blocks(peer.remote_agent, local, remote, notif)
        else:
            bb, mem, rnb = self.t.layout.block_bytes, self.t.memory, peer.num_blocks
            regions = merge_regions((mem.offset(layer, s), (layer * rnb + d) * bb, n * bb)
                                    for layer in layers for s, d, n in h.runs)
            info = peer.remote
            handle, _state = nixl.post_write(peer.remote_agent, info["base"], info["dev"], info["mem"],
                                             regions, notif)
        self.xfers.append(handle)
        h.timeline["posted"] = time.monotonic()

    def _notif(self) -> bytes:
        return notif_message("done", rid=self.h.request_id, n=self.h.nbytes, xid=self.h.xid)

    async def _finish(self, notified: bool) -> None:
        h, peer, nixl, cfg = self.h, self.peer, self.t.nixl, self.t.config
        # Fast phase (see TransportConfig.nixl_fast_wait_s): a state poll (= a UCX progress call) every
        # nixl_fast_wait_nap_s. time.sleep releases the GIL (the engine thread runs meanwhile); the bare
        # yield lets this loop's other tasks run (the selector is polled without a timeout). Then, or
        # without it: no sleep for nixl_spin_s, then every nixl_poll_interval_s (>= ~1 ms with asyncio).
        now = time.monotonic()
        fast_until = now + fast_wait_s(cfg, self.t.memory.nixl_mem_type, h.nbytes)
        spin_until = now + cfg.nixl_spin_s
        nap = cfg.nixl_fast_wait_nap_s
        for handle in list(self.xfers):
            while (state := nixl.state(handle)) == "PROC":
                now = time.monotonic()
                if now < fast_until:
                    time.sleep(nap)
                    await asyncio.sleep(0)
                else:
                    await poll_pause(cfg, spinning=now < spin_until)
            if state != "DONE":
                raise PeerUnavailable(f"NIXL WRITE of {h.request_id!r} to {peer.name} failed ({state})")
            nixl.release(handle)
            self.xfers.remove(handle)
        h.timeline["xfers_done"] = time.monotonic()
        if cfg.nixl_tx_done_frame and CAP_WROTE in peer.caps:
            # DONE of a WRITE means NIXL's endpoint flush completed: the bytes are in the receiver's memory.
            await self.lane.send_frame(Msg.WROTE, {"rid": h.request_id, "n": h.nbytes,
                                                   "layers": self.t.layout.num_layers, "xid": h.xid})
            h.timeline["wrote_sent"] = time.monotonic()
        elif not (notified and self._notif_attached):
            nixl.send_notif(peer.remote_agent, self._notif())

    async def settle(self) -> None:
        """Unposted WRITEs released; posted ones cancelled (release) or, if in flight, waited out."""
        nixl = self.t.nixl
        for handle, _n in self.ready.values():  # made, never posted: nothing to wait for
            nixl.release(handle)
        self.ready.clear()
        deadline = time.monotonic() + self.t.config.abort_ack_timeout_s
        for handle in list(self.xfers):
            while not nixl.release(handle):  # release cancels a WRITE still in flight, if it can
                if time.monotonic() > deadline:
                    log.error("kvtransfer: NIXL WRITE of %s still in flight after abort", self.h.request_id)
                    break
                await asyncio.sleep(0.001)
            else:
                self.xfers.remove(handle)
