"""A DATA frame that its lane's writer thread stages itself (TransportConfig.tcp_lane_staging).

Over TCP from device memory a frame's bytes must first be copied to page-locked host memory. Staged on
the event loop, every frame cost the loop a CUDA call, a thread hop to wait for the copy and another to
hand the frame to its lane, each waiting for the GIL beside the other lanes' threads: with 16 transfers
in flight each connection's threads were busy only 27-48% of the time (docs/kvtransfer.md). A
``StagedFrame`` instead carries what to copy; the writer thread issues the copies (``start``), waits for
them and writes the frame (``buffers``), and starts the copies of the frames queued behind it meanwhile.

States: queued -> started (copies issued; the frame will be written) or queued -> cancelled (its
transfer ended before the copies began: nothing of it is written, the stream stays in sync).
"""

from __future__ import annotations

import threading
import time

from .iovec import crc32_of
from .protocol import Msg, encode


class StagedFrame:
    def __init__(self, memory, segments: list[tuple[int, int, int]], meta: dict, *, head: list,
                 tail: list, checksum: bool) -> None:
        self.memory = memory
        self.segments = segments
        self.meta = meta  # the DATA frame's metadata ("crc" added once the bytes are staged)
        self.head = head  # payload-less frames written before it (BEGIN) and after it (END): (msg, meta)
        self.tail = tail
        self.checksum = checksum
        self.nbytes = sum(n for _, n, _ in segments)
        # time.monotonic() instants: queued, copies issued, copies done, written (kvtrace tx-frames)
        self.times = [time.monotonic(), 0.0, 0.0, 0.0]
        self._lock = threading.Lock()
        self._state = "queued"
        self._views: list[memoryview] = []
        self._event = None

    def cancel(self) -> bool:
        """Event loop: True when the frame will not be written (its copies had not been issued)."""
        with self._lock:
            if self._state == "queued":
                self._state = "cancelled"
            return self._state == "cancelled"

    def start(self) -> None:
        """Writer thread: issue the device->host copies, once (never after cancel)."""
        with self._lock:
            if self._state != "queued":
                return
            self._state = "started"
        self.times[1] = time.monotonic()
        self._views, self._event = self.memory.stage_out(self.segments)

    def buffers(self) -> list[memoryview] | None:
        """Writer thread: the frames' bytes once the copies are done (waits for them, GIL released); None
        when the frame was cancelled."""
        self.start()
        if self._state == "cancelled":
            return None
        if self._event is not None:
            self._event.synchronize()
        self.times[2] = time.monotonic()
        meta = self.meta
        if self.checksum:
            meta = {**meta, "crc": crc32_of(self._views)}
        bufs = [encode(msg, m) for msg, m in self.head]
        bufs.append(encode(Msg.DATA, meta, self.nbytes))
        bufs.extend(self._views)
        bufs.extend(encode(msg, m) for msg, m in self.tail)
        return [memoryview(b).cast("B") for b in bufs if len(b)]
