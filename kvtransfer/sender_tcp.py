"""The TCP path of a send (``SendPath`` for a TCP peer): BEGIN riding along with the first data, DATA
frames of coalesced block runs, END; device memory staged through page-locked buffers ahead of the
socket. See sender.py for the lifecycle.

Striping: one connection moves a few GB/s (its I/O threads wait between frames), so a transfer of more
than one frame to a receiver that advertises CAP_STRIPE spreads its frames over up to all of the peer's
connections. BEGIN {stripe: true} and the first frame go on the transfer's home lane; the receiver
answers BEGIN_OK, after which every frame goes to whichever of the transfer's lanes is free (one frame
in flight per lane, so frames of transfers sharing a lane still interleave). END follows on the home
lane once every frame is written; the receiver completes when END and all bytes are in, in either
order. To a receiver without the capability, everything rides the home lane in order, as before.

Device memory: frames are staged here, on the event loop, and handed to a free lane one at a time. With
TransportConfig.tcp_lane_staging (off by default: measured slower, docs/kvtransfer.md) a step instead
queues all its DATA frames at once as StagedFrames (tx_frame.py), each on a lane of the transfer chosen by
the bytes already queued there; the lanes' writer threads stage and write them (lane.py), and the step
awaits their completions.

Frame size: max_frame_bytes, times TransportConfig.tcp_busy_frame_factor for a transfer that starts
while others to the same receiver are in flight."""

from __future__ import annotations

import asyncio
import time
from collections import deque

from .blocks import plan_segments
from .errors import PeerUnavailable
from .iovec import crc32_of
from .protocol import CAP_STRIPE, Msg
from .send_ops import FINISH
from .tx_frame import StagedFrame


class TcpPath:
    def __init__(self, handle, peer) -> None:
        self.h = handle
        self.t = handle.t
        cfg = self.t.config
        # larger frames when others to this receiver are in flight (TransportConfig.tcp_busy_frame_factor)
        busy = any(lane.load for lane in peer.lanes)
        frame = self.frame_bytes = cfg.max_frame_bytes * (cfg.tcp_busy_frame_factor if busy else 1)
        self.stripe = (self.t.config.tcp_stripe and CAP_STRIPE in peer.caps and len(peer.lanes) > 1
                       and handle.nbytes > frame)
        frames = -(-handle.nbytes // frame)
        self.lanes = peer.pick_lanes(handle.nbytes, min(len(peer.lanes), frames) if self.stripe else 1)
        self.lane = self.lanes[0]  # home: BEGIN, END and the control frames of this transfer
        self._busy: dict = {}  # lane -> the task writing this transfer's frame on it
        self._staged: list = []  # lane staging: (lane, StagedFrame, future) of every frame queued
        self._opened = False

    def begin_fields(self, meta: dict) -> None:
        if self.stripe:
            meta["stripe"] = True

    def last_progress(self) -> float:
        return max(lane.last_progress for lane in self.lanes)

    def end(self) -> None:
        for lane in self.lanes:
            lane.load -= self.h.nbytes // len(self.lanes)

    async def settle(self) -> None:
        """Let frames already on their way finish (Lane._write lets a frame finish or closes the
        connection: a frame is never cut)."""
        tasks = [t for t in self._busy.values() if not t.done()]
        if tasks:
            await asyncio.wait(tasks)
        # Lane staging: frames whose copies have not begun are never written; the rest are let finish
        # (or the peer is cut if one is stuck, as Lane._write does).
        writes = [fut for _lane, frame, fut in self._staged if not fut.done() and not frame.cancel()]
        if writes:
            _done, stuck = await asyncio.wait(writes, timeout=2.0)
            if stuck:
                self.h.peer.dead(PeerUnavailable(f"frame to {self.lane.name} cut short"))
                await asyncio.wait(stuck)

    async def run(self, begin: dict) -> None:
        h = self.h
        # BEGIN is not acknowledged on TCP unless striped: the receiver checks it before taking any DATA
        # of the request, so it rides along with the first data (one write for a small one-shot transfer).
        pending = [(Msg.BEGIN, begin, None, 0)]
        while True:
            op = h.ops.get_nowait() if not h.ops.empty() else None
            if op is None:
                if pending:
                    await self._on_home(pending)
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

    async def _on_home(self, frames: list) -> None:
        """Frames on the home lane, after this transfer's frame in flight there."""
        await self._lane_free([self.lane])
        self._busy[self.lane] = task = self.t.loop.create_task(self.lane.send_frames(frames))
        await task

    async def _drain(self) -> None:
        """Every frame of this transfer written (raises what a lane's write raised)."""
        for task in list(self._busy.values()):
            await task

    async def _lane_free(self, lanes: list, also=None):
        """One of these lanes with no frame of this transfer in flight (or None when ``also``, a future,
        completed first); raises the error of a write that failed."""
        while True:
            for lane in lanes:
                task = self._busy.get(lane)
                if task is None or task.done():
                    if task is not None:
                        task.result()
                    return lane
            if also is not None and also.done():
                return None
            waits = [self._busy[lane] for lane in lanes] + ([also] if also is not None else [])
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)

    async def _pick(self, first: bool):
        """The lane for the next frame: the home lane for the one carrying BEGIN and, while the receiver
        has not acknowledged a striped BEGIN yet, for the rest; then any free lane of the transfer."""
        if first or not self.stripe:
            return await self._lane_free([self.lane])
        while not self.h.begin_ok.done():
            lane = await self._lane_free([self.lane], self.h.begin_ok)
            if lane is not None:
                return lane
        if self.h.begin_ok.exception() is not None:
            raise self.h.begin_ok.exception()
        return await self._lane_free(self.lanes)

    async def _send(self, head: list, layers: tuple[int, ...], tail: list) -> None:
        """head frames (BEGIN), DATA frames of these layers' blocks, each on a lane (see _pick), then tail
        frames (END) once every frame is written; returns when all are written. Unstriped, the tail rides
        with the last frame (a small one-shot transfer is one write: BEGIN + DATA + END). Host memory:
        zero-copy views. Device memory: page-locked staging, the next frames' device->host copies (up to
        TransportConfig.tcp_stage_ahead) queued while frames are on the socket."""
        h, mem, bb = self.h, self.t.memory, self.t.layout.block_bytes
        plan = plan_segments(layers, h.runs, bb, self.frame_bytes) if layers else []
        if not plan:
            if head or tail:
                await self._on_home(head + tail)
            return
        segs = [[(mem.offset(layer, s), n * bb, layer) for layer, s, _d, n in frame] for frame in plan]
        if mem.staged and self.t.config.tcp_lane_staging:
            await self._send_lane_staged(head, plan, segs, tail)
            return
        ahead = self.t.config.tcp_stage_ahead if mem.staged else 1
        staged: deque = deque()  # (issued, (views, event)) of the next frames, copies queued in order
        for i, frame in enumerate(plan):
            while len(staged) < ahead and i + len(staged) < len(plan):
                staged.append((time.monotonic(), mem.stage_out(segs[i + len(staged)])))
            issued, (views, event) = staged.popleft()
            await mem.ready(event)
            ready = time.monotonic()
            last = i == len(plan) - 1
            lane = await self._pick(first=bool(head) and i == 0)
            picked = time.monotonic()
            batch = (head if i == 0 else []) + [self._data_frame(frame, views)]
            if last and tail and not self.stripe:
                batch, tail = batch + tail, []  # in order on the one lane
            task = self.t.loop.create_task(lane.send_frames(batch))
            task.add_done_callback(lambda f: f.cancelled() or f.exception())
            if self.t.config.trace:  # staged, waited for a lane, written (lane queue + socket)
                task.add_done_callback(lambda f, a=issued, b=ready, c=picked:
                                       h.frame_times.append((a, a, b, c, time.monotonic())))
            self._busy[lane] = task
        await self._drain()
        if tail:
            await self._on_home(tail)

    async def _send_lane_staged(self, head: list, plan: list, segs: list, tail: list) -> None:
        """_send with the lanes' writer threads staging the frames (module doc). BEGIN rides the first
        frame on the home lane; striped, the rest go to the home lane one at a time until the receiver
        acknowledged BEGIN, then each to the transfer's lane with the fewest bytes queued."""
        h, cfg = self.h, self.t.config
        frames = []
        for i, frame in enumerate(plan):
            last = i == len(plan) - 1
            rides = last and tail and not self.stripe  # END in order behind the last frame, on the one lane
            meta = {"rid": h.request_id, "segs": [[layer, d, n] for layer, _s, d, n in frame]}
            frames.append(StagedFrame(self.t.memory, segs[i], meta, checksum=cfg.checksum,
                                      head=[(m, x) for m, x, *_ in head] if i == 0 else [],
                                      tail=[(m, x) for m, x, *_ in tail] if rides else []))
        if frames[-1].tail:
            tail = []
        start = len(self._staged)
        rest = deque(frames)
        if head or not self.stripe:
            self._queue(self.lane, rest.popleft())
        while rest and self.stripe and not h.begin_ok.done():
            home = next((f for ln, _fr, f in reversed(self._staged) if ln is self.lane), None)
            if home is None or home.done():
                if home is not None and home.exception() is not None:
                    await self.lane.wait_written(home)  # raises what broke the lane
                self._queue(self.lane, rest.popleft())
                continue
            await asyncio.wait([h.begin_ok, home], return_when=asyncio.FIRST_COMPLETED)
        if rest and self.stripe and h.begin_ok.done() and h.begin_ok.exception() is not None:
            raise h.begin_ok.exception()
        lanes = self.lanes if self.stripe else [self.lane]
        for frame in rest:
            self._queue(min(lanes, key=lambda ln: (ln.queued_bytes, ln.index)), frame)
        for lane, frame, fut in self._staged[start:]:
            await lane.wait_written(fut)
            if cfg.trace:
                q, issued, ready, written = frame.times
                h.frame_times.append((q, issued, ready, ready, written))
        if tail:
            await self._on_home(tail)

    def _queue(self, lane, frame: StagedFrame) -> None:
        fut = lane.queue_staged(frame)
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # raised where awaited
        self._staged.append((lane, frame, fut))

    def _data_frame(self, frame, views: list) -> tuple:
        meta = {"rid": self.h.request_id, "segs": [[layer, d, n] for layer, _s, d, n in frame]}
        if self.t.config.checksum:
            meta["crc"] = crc32_of(views)
        return (Msg.DATA, meta, views, sum(len(v) for v in views))
