"""``pdserve planner run``'s loop: scrape every process of a cluster each interval, turn the two latest
scrapes into ``Signals``, ask the planner, hand each decision on. Nothing here acts on the cluster: ``planner
run --dry-run`` prints each decision, ``pdserve up --autoscale`` hands it to ``actuator.py``.

Targets come from the run directory's ``prometheus-targets.json`` (re-read each window, so workers
started or drained show), scraped as ``pdserve top`` scrapes them (``pdserve/app/top/scrape.py``); a
target that does not answer is left out of the window (its pool counts one replica fewer).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from pdserve.app.planner.policy import Decision, Planner
from pdserve.app.planner.signals import Signals, from_scrapes
from pdserve.app.top.scrape import scrape
from pdserve.app.top.stats import Scrape, Target

log = logging.getLogger("pdserve.planner")


class SignalSource:
    """``poll()`` scrapes every target and returns the window since the previous poll (None on the first
    poll, or when no target answered both times). ``scrape_fn(target)`` is ``(Scrape | None, error)``."""

    def __init__(self, targets: Callable[[], list[Target]], *, timeout: float = 2.0,
                 scrape_fn: Callable[[Target], tuple[Scrape | None, str | None]] | None = None) -> None:
        self.targets = targets
        self.scrape_fn = scrape_fn or (lambda t: scrape(t, timeout))
        self._prev: dict[str, Scrape] = {}
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="pdserve-planner")

    def poll(self) -> Signals | None:
        targets = self.targets()
        cur, roles = {}, {}
        for target, (s, error) in zip(targets, self._pool.map(self.scrape_fn, targets), strict=True):
            if s is None:
                log.warning("planner: %s (%s) did not answer: %s", target.address, target.process, error)
                continue
            cur[target.address] = s
            if target.role:
                roles[target.address] = target.role
        prev, self._prev = self._prev, cur
        if not prev:
            return None
        try:
            return from_scrapes(prev, cur, roles)
        except ValueError as exc:
            log.warning("planner: no window: %s", exc)
            return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def run(source: SignalSource, planner: Planner, *, interval: float,
        on_window: Callable[[Signals, Decision], None], windows: int | None = None,
        sleep: Callable[[float], None] | None = None, stop: threading.Event | None = None) -> int:
    """Poll every ``interval`` seconds and pass each window and its decision to ``on_window``, for
    ``windows`` polls after the first (None: until interrupted, or until ``stop`` is set: it is checked
    between windows, and the wait ends when it is set). Returns the decisions taken."""
    sleep = sleep or (stop.wait if stop is not None else time.sleep)
    source.poll()  # the first scrape: where the first window starts
    polls = decided = 0
    while windows is None or polls < windows:
        sleep(interval)
        if stop is not None and stop.is_set():
            break
        polls += 1
        s = source.poll()
        if s is None:
            continue
        on_window(s, planner.observe(s))
        decided += 1
    return decided
