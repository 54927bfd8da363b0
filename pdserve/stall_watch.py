"""A debugging aid: log when a worker's threads could not run, and where they were.

``PDSERVE_STALL_WATCH_MS=50`` (any positive number of ms) in a worker's environment starts one daemon
thread that naps 2 ms in a loop and checks two things:

* **GIL stalls**: a nap that ends much later than asked means no Python thread could run meanwhile --
  some thread held the GIL (a C call that does not release it, or pure Python past the switch
  interval). One WARNING line with the gap, the engine's last step phases (``phases()``: plan + forward
  launch / sampling sync, ms) and the innermost frames of every other thread.
* **A stuck event loop** (``loop_thread``): the loop's thread on one line, outside its selector wait,
  past the threshold -- a blocking call that releases the GIL, which the first check cannot see. One
  line with its stack when it passes the threshold, one with the duration when it moves on. This is
  how the prefill worker's loop was found sitting in NIXL's ``transfer()`` while the GPU's launch
  queue drained (docs/gpu.md, "Session 3").

Off by default: one wake-up every 2 ms.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

from pdserve.settings import stall_watch_ms

log = logging.getLogger("pdserve.stall")
_NAP_S = 0.002


class StallWatch:
    def __init__(self, thread: threading.Thread, stop: threading.Event) -> None:
        self.thread, self._stop = thread, stop

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(1.0)


def start_from_env(phases: Callable[[], dict] | None = None, *,
                   loop_thread: int | None = None) -> StallWatch | None:
    try:
        threshold_ms = stall_watch_ms()
    except ValueError as exc:
        log.warning("PDSERVE_STALL_WATCH_MS is not a number (%s); stall watch off", exc)
        return None
    if threshold_ms <= 0:
        return None
    stop = threading.Event()
    thread = threading.Thread(target=_watch, args=(threshold_ms / 1e3, phases, stop, loop_thread),
                              name="stall-watch", daemon=True)
    thread.start()
    log.info("stall watch on: GIL gaps%s over %.0f ms are logged",
             "" if loop_thread is None else " and event loop stalls", threshold_ms)
    return StallWatch(thread, stop)


def _stack(frame, depth: int = 4) -> str:
    stack = traceback.extract_stack(frame)[-depth:]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack))


def _watch(threshold_s: float, phases: Callable[[], dict] | None, stop: threading.Event,
           loop_thread: int | None) -> None:
    me = threading.get_ident()
    stuck_at, stuck_since, reported = None, 0.0, False
    while not stop.is_set():
        t0 = time.monotonic()
        time.sleep(_NAP_S)
        now = time.monotonic()
        gap = now - t0 - _NAP_S
        frames = sys._current_frames()
        if loop_thread is not None:
            # The event loop's thread sitting on one line (outside its selector wait) past the threshold:
            # a blocking call that released the GIL (so the gap above stays small) froze the loop.
            frame = frames.get(loop_thread)
            key = (id(frame), frame.f_lineno) if frame is not None else None
            idle = frame is not None and os.path.basename(frame.f_code.co_filename) == "selectors.py"
            if key != stuck_at or idle:
                if reported and stuck_at is not None:
                    log.warning("event loop was stuck %.0f ms", (now - stuck_since) * 1e3)
                stuck_at, stuck_since, reported = key, now, False
            elif not reported and now - stuck_since > threshold_s:
                reported = True
                log.warning("event loop stuck over %.0f ms at %s", threshold_s * 1e3, _stack(frame, 6))
        if gap < threshold_s:
            continue
        names = {t.ident: t.name for t in threading.enumerate()}
        where = [f"{names.get(ident, ident)}: {_stack(frame, 3)}" for ident, frame in frames.items()
                 if ident != me]
        extra = ""
        if phases is not None:
            try:
                extra = f" engine step {phases()}"
            except Exception:  # a racing read of a half-written dict: skip it
                extra = ""
        log.warning("GIL stall %.0f ms;%s; threads: %s", gap * 1e3, extra, " | ".join(where))
