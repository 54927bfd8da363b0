"""One expected incoming transfer: its destination blocks, what has arrived, its state and timeline
(receiver.py keeps the table of them and drives their lifecycle)."""

from __future__ import annotations

import asyncio
import time

from .future_result import FutureResult


class Expectation(FutureResult):
    """Handle for one expected transfer; ``await wait()`` returns when its KV is complete, or raises once
    nothing of the request can be written any more (sender confirmed or gone, or abort_ack_timeout_s)."""

    def __init__(self, rid: str, dst: tuple[int, ...], num_layers: int, block_bytes: int,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = rid
        self.dst = tuple(dst)
        self.index = {b: i for i, b in enumerate(dst)}
        self.num_layers = num_layers
        self.nbytes = num_layers * len(dst) * block_bytes
        self.written = bytearray(num_layers * len(dst))
        self.received = 0
        self.state = "waiting"
        self.conn = None  # the connection its BEGIN came on (DONE, ABORT go there)
        self.conns: set = set()  # every connection its frames came on (striped: the sender's others too)
        self.striped = False  # BEGIN {stripe}: DATA on any connection of the same sender, END maybe early
        self.end_seen = False  # striped: END came before all bytes (they complete it)
        self.backend: str | None = None
        self.sender_agent: str | None = None
        self.xid: str | None = None  # the sender's transfer id (BEGIN "xid"; None from older senders)
        self.started = time.monotonic()
        # Monotonic instants of its steps (expect, begin, notif / end, complete): diagnostics for benches.
        self.timeline = {"expect": self.started}
        self.frame_stats: dict = {}  # trace, TCP: sums over its large DATA frames (rx_conn._trace_frame)
        self.timer: asyncio.TimerHandle | None = None
        # Device memory: the CUDA events after this request's host->device copies not known done yet (one
        # per staged frame; frames flushed on different threads reach the stream in any order).
        self.flushing: list = []
        # Connections whose current DATA frame's payload is being received into this request's targets (its
        # blocks, or a staging buffer flushed into them): a failure is told only once none is (receiver.py).
        self.reading: set = set()
        self.settling: tuple | None = None  # (error, confirmed) of a failure waiting for those frames
        # True once nothing of it can land any more after a failure with the sender's confirmation, False
        # without it (abort_ack_timeout_s passed); what Receiver.abort returns.
        self.quiet: asyncio.Future = loop.create_future()
        self._future = loop.create_future()
        # Nobody awaiting a failed expectation must not produce "exception never retrieved" noise.
        self._future.add_done_callback(lambda f: f.cancelled() or f.exception())
