"""Where the TCP path's I/O threads spend a frame: cumulative totals per direction, in counters().

Each large frame is written (lane.py) or read (rx_conn.py) by one worker thread; the thread returns what
it did and the event loop adds it here. ``poll_s`` is time spent waiting for the socket (sender: its
buffer full, the receiver is behind; receiver: nothing to read, the sender is behind) -- it includes
taking the GIL back afterwards; ``thread_s`` the thread's whole time on the frame. Lanes idle between
frames show up as thread_s well below wall time x connections.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class IoStats:
    frames: int = 0
    syscalls: int = 0
    bytes: int = 0
    poll_s: float = 0.0
    thread_s: float = 0.0

    def add(self, syscalls: int, nbytes: int, poll_s: float, thread_s: float) -> None:
        self.frames += 1
        self.syscalls += syscalls
        self.bytes += nbytes
        self.poll_s += poll_s
        self.thread_s += thread_s

    def as_dict(self) -> dict:
        out = asdict(self)
        out["poll_s"], out["thread_s"] = round(self.poll_s, 6), round(self.thread_s, 6)
        return out
