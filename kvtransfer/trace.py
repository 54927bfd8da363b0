"""Per-transfer timelines in the log, for finding where a transfer's time goes in a live cluster.

``TransportConfig.trace`` (``PDSERVE_KV_TRACE=1`` in a worker's environment, read by pdserve/settings.py)
makes the sender log each finished send's steps
(``SendHandle.timeline``: start, begin_sent, begin_ok, prebuilt, posted, xfers_done, wrote_sent, acked)
and the receiver each completed expectation's (``Expectation.timeline``: expect, begin, wrote / notif /
end, complete), as ``time.monotonic()`` instants. Workers on one host share that clock, so the two
sides' lines of one request id line up: e.g. the sender's ``wrote_sent`` against the receiver's
``wrote`` is the side channel's delay, the receiver's ``complete`` against the sender's ``acked`` the
way back. One INFO line per transfer: meant for benchmarks and debugging, off by default. Over TCP the sender
adds a ``kvtrace tx-frames`` line: its DATA frames' summed seconds waiting for their staging copies,
for a free lane of the transfer, and in the lane (its queue and the socket write); the receiver a
``kvtrace rx-frames`` line: its large DATA frames' seconds from dispatch to done, in their read threads
(and of that in poll, waiting for bytes: TLS on the I/O threads only, since a plaintext read waits
inside its whole-frame socket call, iovec.whole_frame_io), and the gaps on each connection since its
previous frame ended.
"""

from __future__ import annotations

import json
import logging

log = logging.getLogger("kvtransfer.trace")


def emit(side: str, request_id: str, timeline: dict) -> None:
    """One line: ``kvtrace <side> <request id> {step: monotonic seconds, ...}``."""
    log.info("kvtrace %s %s %s", side, request_id,
             json.dumps({k: round(v, 6) for k, v in timeline.items()}, separators=(",", ":")))


def frame_summary(frames: list[tuple[float, float, float, float, float]]) -> dict:
    """Sums over a send's DATA frames, each (queued, staging issued, staged, lane picked, written), of
    (issued - queued, staged - issued, picked - staged, written - picked), and the span from the first
    frame queued to the last written. Staged on the event loop a frame is queued when its copies are
    issued; staged by its lane (tcp_lane_staging) it is in its lane when queued, and picked when staged."""
    return {"frames": len(frames), "queue_s": sum(b - a for a, b, *_x in frames),
            "staging_s": sum(c - b for _a, b, c, *_x in frames),
            "lane_wait_s": sum(d - c for *_x, c, d, _e in frames),
            "in_lane_s": sum(e - d for *_x, d, e in frames),
            "span_s": max(e for *_x, e in frames) - min(a for a, *_y in frames)}
