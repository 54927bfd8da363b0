"""The TCP path of a send (``SendPath`` for a TCP peer): BEGIN riding along with the first data, DATA
frames of coalesced block runs, END, on one lane of the peer (the least loaded when the send began);
device memory staged through page-locked buffers one frame ahead. See sender.py for the lifecycle."""

from __future__ import annotations

import asyncio
import time
import zlib

from .blocks import plan_segments
from .protocol import Msg
from .send_ops import FINISH


class TcpPath:
    def __init__(self, handle, peer) -> None:
        self.h = handle
        self.t = handle.t
        self.lane = peer.pick_lane(handle.nbytes)
        self._opened = False

    def begin_fields(self, meta: dict) -> None:
        pass

    def last_progress(self) -> float:
        return self.lane.last_progress

    def end(self) -> None:
        self.lane.load -= self.h.nbytes

    async def settle(self) -> None:
        pass  # a frame is never cut (Lane._write lets it finish or closes the connection)

    async def run(self, begin: dict) -> None:
        h = self.h
        # BEGIN is not acknowledged on TCP: the receiver checks it before taking any DATA of the request,
        # so it rides along with the first data (one write for a small one-shot transfer).
        pending = [(Msg.BEGIN, begin, None, 0)]
        while True:
            op = h.ops.get_nowait() if not h.ops.empty() else None
            if op is None:
                if pending:
                    await self.lane.send_frames(pending)
                    self._begin_sent(alone=True)
                    pending = []
                op = await h.ops.get()
            # Layers pushed while the previous ones were on the socket go out in one call, so their
            # frames pipeline (next frame's device->host copy during this one's send). One call per
            # layer would wait out each frame's staging: half the socket rate while a prefill streams.
            layers, final = ((), True) if op is FINISH else h.join_queued(op[1], op[2])
            tail = [(Msg.END, {"rid": h.request_id, "nbytes": h.nbytes}, None, 0)] if final else []
            await self._send(pending, layers, tail)
            self._begin_sent(alone=not layers)
            pending = []
            if final:
                h.timeline["sent"] = time.monotonic()
                break
        await h.wait_acked()

    def _begin_sent(self, alone: bool) -> None:
        """BEGIN was written: begun() returns. The instant is recorded only when BEGIN went without data
        (with data, the write returns when the data was sent, which says nothing about BEGIN)."""
        if not self._opened:
            self._opened = True
            if alone:
                self.h.timeline["begin_sent"] = time.monotonic()
            self.h.mark_opened()

    async def _send(self, head: list, layers: tuple[int, ...], tail: list) -> None:
        """head frames, DATA frames of these layers' blocks, tail frames, in that order. Host memory: all
        at once, zero-copy. Device memory: frame by frame through page-locked host buffers, the next
        frame's device->host copies running while the current one is on the socket."""
        h, mem, bb = self.h, self.t.memory, self.t.layout.block_bytes
        plan = plan_segments(layers, h.runs, bb, self.t.config.max_frame_bytes) if layers else []
        segs = [[(mem.offset(layer, s), n * bb, layer) for layer, s, _d, n in frame] for frame in plan]
        if not mem.staged or not plan:
            frames = [self._data_frame(f, mem.stage_out(sg)[0]) for f, sg in zip(plan, segs, strict=True)]
            await self.lane.send_frames(head + frames + tail)
            return
        issued, staged, sending = time.monotonic(), mem.stage_out(segs[0]), None
        try:
            for i, frame in enumerate(plan):
                views, event = staged
                await mem.ready(event)
                ready = time.monotonic()
                if sending is not None:
                    await sending  # frames stay in order
                last = i == len(plan) - 1
                batch = (head if i == 0 else []) + [self._data_frame(frame, views)] + (tail if last else [])
                sending = self.t.loop.create_task(self.lane.send_frames(batch))
                sending.add_done_callback(lambda f: f.cancelled() or f.exception())
                sending.add_done_callback(
                    lambda f, a=issued, b=ready: h.frame_times.append((a, b, time.monotonic())))
                issued = time.monotonic()
                staged = None if last else mem.stage_out(segs[i + 1])
            await sending
        finally:
            if sending is not None and not sending.done():
                # Cancelled meanwhile: let the frame finish (Lane._write keeps the stream in sync).
                await asyncio.wait([sending])

    def _data_frame(self, frame, views: list) -> tuple:
        meta = {"rid": self.h.request_id, "segs": [[layer, d, n] for layer, _s, d, n in frame]}
        if self.t.config.checksum:
            crc = 0
            for v in views:
                crc = zlib.crc32(v, crc)
            meta["crc"] = crc
        return (Msg.DATA, meta, views, sum(len(v) for v in views))
