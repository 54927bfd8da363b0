"""Restart a cluster process that exits unexpectedly, with backoff, until it crash-loops.

``Supervisor(cluster, policy).start()`` runs one thread that looks at every process of the cluster
(the router and each pool's workers) every ``poll_s``. A process that is not alive and that the
cluster did not stop on purpose (``down``, a scale-down: those leave the cluster's lists first) is
restarted through the cluster's backend, under the same worker id and at the same address (its
port is asked for again: a restarted Kubernetes container keeps its pod IP and port too, so the
router sees the same address answer with a new ``incarnation`` and drops everything it knew about
the old one: sessions, prefix entries, KV-plane connections and metadata). Only if that port is
taken does the process come back at a new one, and the members file (the router's discovery) is
rewritten.

Backoff: the n-th death within ``window_s`` waits ``backoff_s * 2**(n-1)`` (at most
``max_backoff_s``) before the restart. Crash loop: a process that dies more than ``max_restarts``
times within ``window_s`` (a failed start counts as a death) is left down, removed from the
members, and the reason is logged and written to state.json (``gave_up``).

Every death and restart is logged with the worker id, the restart number (the launcher's
incarnation count; the process also draws its own incarnation id, which the router logs), the exit
status and the log file.

A process that stays alive but stops answering is killed by ``LivenessWatch`` (``launcher/liveness.py``,
``liveness_*`` below; 0 failures = off), and then restarted here like any other death.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.app.launcher.backends import WorkerHandle
from pdserve.app.launcher.liveness import LivenessWatch

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RestartPolicy:
    enabled: bool = True
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    max_restarts: int = 5
    window_s: float = 300.0
    poll_s: float = 0.25
    # a live process silent on this many health checks in a row is killed (and so restarted); 0 = never
    liveness_failures: int = 6
    liveness_period_s: float = 10.0
    liveness_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 < self.backoff_s <= self.max_backoff_s or self.max_restarts < 0 or self.window_s <= 0:
            raise ValueError("restart policy: 0 < backoff_s <= max_backoff_s, max_restarts >= 0 and "
                             "window_s > 0")
        if self.poll_s <= 0:
            raise ValueError(f"restart policy: poll_s must be > 0, got {self.poll_s}")
        if self.liveness_failures < 0 or self.liveness_period_s <= 0 or self.liveness_timeout_s <= 0:
            raise ValueError("restart policy: liveness_failures >= 0, liveness_period_s > 0 and "
                             "liveness_timeout_s > 0")


@dataclass
class _History:
    deaths: deque = field(default_factory=deque)  # monotonic times of recent deaths
    restart_at: float = 0.0                      # when the pending restart may run
    exit_status: int | None = None


class Supervisor:
    def __init__(self, cluster, policy: RestartPolicy) -> None:
        self.cluster = cluster
        self.policy = policy
        self._history: dict[str, _History] = {}
        self.gave_up: dict[str, str] = {}  # worker id -> why it is left down
        self.restarts = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.liveness = LivenessWatch(cluster, period_s=policy.liveness_period_s,
                                      timeout_s=policy.liveness_timeout_s, failures=policy.liveness_failures)

    def start(self) -> None:
        if not self.policy.enabled or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, daemon=True, name="pdserve-supervisor")
        self._thread.start()
        self.liveness.start()

    def stop(self) -> None:
        self._stop.set()
        self.liveness.stop()
        if self._thread is not None:
            self._thread.join(30)

    def _loop(self) -> None:
        while not self._stop.wait(self._next_wait()):
            try:
                self.check()
            except Exception:  # the supervisor must outlive whatever one restart does
                log.exception("supervisor check failed")

    def _next_wait(self) -> float:
        """Until the next pass: ``poll_s``, or sooner when a pending restart's backoff ends before that (a
        0.1 s backoff is not rounded up to the poll)."""
        due = [h.restart_at for h in self._history.values() if h.restart_at]
        if not due:
            return self.policy.poll_s
        return min(self.policy.poll_s, max(0.0, min(due) - time.monotonic()))

    def check(self) -> None:
        """One pass: note new deaths, run the restarts whose backoff has passed."""
        for h in self.cluster.supervised():
            if self._stop.is_set():
                return
            if h.worker_id in self.gave_up or h.alive():
                continue
            hist = self._history.setdefault(h.worker_id, _History())
            if not hist.restart_at:
                self._died(h, hist, h.exit_status())
            if hist.restart_at and time.monotonic() >= hist.restart_at:
                self._restart(h, hist)

    def _died(self, h: WorkerHandle, hist: _History, status: int | None) -> None:
        """Count a death (an exit, or a restart that never became ready) and schedule the restart."""
        now = time.monotonic()
        hist.exit_status = status
        hist.restart_at = 0.0
        hist.deaths.append(now)
        while hist.deaths and now - hist.deaths[0] > self.policy.window_s:
            hist.deaths.popleft()
        n = len(hist.deaths)
        logfile = self.cluster.log_path(h)
        if n > self.policy.max_restarts:
            why = (f"crash loop: {n} exits within {self.policy.window_s:.0f}s (last exit status "
                   f"{hist.exit_status}); not restarting it, see {logfile}")
            log.error("%s %s (restart %d) exited: %s", h.role, h.worker_id, h.restarts, why)
            self.gave_up[h.worker_id] = why
            self.cluster.give_up(h, why)
            return
        delay = min(self.policy.backoff_s * 2 ** (n - 1), self.policy.max_backoff_s)
        hist.restart_at = now + delay
        killed = self.liveness.killed.pop(h.worker_id, "")
        how = f"was killed ({killed})" if killed else "exited unexpectedly"
        log.warning("%s %s (restart %d, pid %d) %s with status %s; restarting in %.1fs (death %d of at "
                    "most %d within %.0fs; log %s)", h.role, h.worker_id, h.restarts, h.pid, how,
                    hist.exit_status, delay, n, self.policy.max_restarts + 1, self.policy.window_s, logfile)

    def _restart(self, h: WorkerHandle, hist: _History) -> None:
        try:
            self.cluster.restart(h)
        except Exception as exc:  # a failed start is one more death of the same worker
            log.warning("restarting %s %s failed: %s", h.role, h.worker_id, str(exc).splitlines()[0])
            self._died(h, hist, getattr(exc, "exit_status", None))
            return
        hist.restart_at = 0.0
        self.restarts += 1
        log.warning("%s %s restarted (restart %d, pid %d) at %s", h.role, h.worker_id, h.restarts, h.pid,
                    h.address)
