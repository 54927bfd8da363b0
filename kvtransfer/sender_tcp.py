"""The TCP half of a send (``SendHandle`` inherits it): BEGIN riding along with the first data, DATA
frames of coalesced block runs, END; device memory staged through page-locked buffers one frame
ahead. See sender.py for the whole lifecycle."""

from __future__ import annotations

import asyncio
import time
import zlib

from .blocks import plan_segments
from .protocol import Msg

_FINISH = ("finish",)  # the op that finish() queues (sender.py imports this one object)


class TcpSend:
    async def _run_tcp(self, peer, begin: dict) -> None:
        # BEGIN is not acknowledged on TCP: the receiver checks it before taking any DATA of the request,
        # so it rides along with the first data (one write for a small one-shot transfer).
        pending = [(Msg.BEGIN, begin, None, 0)]
        while True:
            op = self._ops.get_nowait() if not self._ops.empty() else None
            if op is None:
                if pending:
                    await peer.send_frames(pending)
                    self._tcp_begin_sent(alone=True)
                    pending = []
                op = await self._ops.get()
            # Layers pushed while the previous ones were on the socket go out in one call, so their
            # frames pipeline (next frame's device->host copy during this one's send). One call per
            # layer would wait out each frame's staging: half the socket rate while a prefill streams.
            layers, final = ((), True) if op is _FINISH else self._join_queued(op[1], op[2])
            tail = [(Msg.END, {"rid": self.request_id, "nbytes": self.nbytes}, None, 0)] if final else []
            await self._send_tcp(peer, pending, layers, tail)
            self._tcp_begin_sent(alone=not layers)
            pending = []
            if final:
                self.timeline["sent"] = time.monotonic()
                break
        self.state = "completing"
        await self._done
        self.timeline["acked"] = time.monotonic()

    def _tcp_begin_sent(self, alone: bool) -> None:
        """BEGIN was written: begun() returns. The instant is recorded only when BEGIN went without data
        (with data, the write returns when the data was sent, which says nothing about BEGIN)."""
        if not self._opened.done():
            if alone:
                self.timeline["begin_sent"] = time.monotonic()
            self._mark_opened()

    async def _send_tcp(self, peer, head: list, layers: tuple[int, ...], tail: list) -> None:
        """head frames, DATA frames of these layers' blocks, tail frames, in that order. Host memory: all
        at once, zero-copy. Device memory: frame by frame through page-locked host buffers, the next
        frame's device->host copies running while the current one is on the socket."""
        mem, bb = self.t.memory, self.t.layout.block_bytes
        plan = plan_segments(layers, self.runs, bb, self.t.config.max_frame_bytes) if layers else []
        segs = [[(mem.offset(layer, s), n * bb, layer) for layer, s, _d, n in frame] for frame in plan]
        if not mem.staged or not plan:
            frames = [self._data_frame(f, mem.stage_out(sg)[0]) for f, sg in zip(plan, segs, strict=True)]
            await peer.send_frames(head + frames + tail)
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
                sending = self.t.loop.create_task(peer.send_frames(batch))
                sending.add_done_callback(lambda f: f.cancelled() or f.exception())
                sending.add_done_callback(
                    lambda f, a=issued, b=ready: self.frame_times.append((a, b, time.monotonic())))
                issued = time.monotonic()
                staged = None if last else mem.stage_out(segs[i + 1])
            await sending
        finally:
            if sending is not None and not sending.done():
                # Cancelled meanwhile: let the frame finish (Peer._write keeps the stream in sync).
                await asyncio.wait([sending])

    def _data_frame(self, frame, views: list) -> tuple:
        meta = {"rid": self.request_id, "segs": [[layer, d, n] for layer, _s, d, n in frame]}
        if self.t.config.checksum:
            crc = 0
            for v in views:
                crc = zlib.crc32(v, crc)
            meta["crc"] = crc
        return (Msg.DATA, meta, views, sum(len(v) for v in views))

