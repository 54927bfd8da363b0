"""Kill a cluster process that stays alive but stops answering, so the supervisor restarts it.

A process that exits is the supervisor's (``launcher/supervisor.py``). One that hangs without
exiting (SIGSTOP, a hung driver call, a deadlocked event loop) keeps its pid, its TCP connections and
its GPU: the router stops placing on it and moves its requests within seconds (docs/faults.md, "A
frozen worker is a dead one"), but nothing gives the pool its capacity back. On Kubernetes the
chart's liveness probe restarts such a pod; this is the same probe for ``pdserve up``.

Every ``period_s`` each supervised process that is alive gets a gRPC health check (overall service
"") on a fresh channel, bounded by ``timeout_s``. Only silence counts against it: any answer
(SERVING, NOT_SERVING while it loads or drains, even an error status) says the process runs. A refused
connection does not count either: a frozen process's port still accepts connections at the kernel,
so what is refused is a process not listening (a restart in progress, a drain that closed the port),
which the supervisor's exit check covers. After ``failures`` silent checks in a row -- of the same
process: a restart (a new pid) starts the count again -- its whole process group is sent SIGKILL and
the supervisor restarts it like any other death (backoff, crash-loop limit). The defaults mirror the
chart's liveness probe: every 10 s, 5 s timeout, 6 failures (a minute of silence).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.app.launcher.backends import WorkerHandle

log = logging.getLogger(__name__)


def answers(channel: grpc.Channel, timeout: float) -> bool:
    """False only if the health check got no answer within ``timeout`` (see the module docstring)."""
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.RpcError as exc:
        return exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED
    return True


class LivenessWatch:
    """Counts each process's silent health checks; kills one that reaches the limit."""

    def __init__(self, cluster, *, period_s: float, timeout_s: float, failures: int) -> None:
        self.cluster = cluster
        self.period_s, self.timeout_s, self.failures = period_s, timeout_s, failures
        self._silent: dict[tuple[str, int], int] = {}  # (worker id, pid) -> silent checks in a row
        self.killed: dict[str, str] = {}  # worker id -> why it was last killed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="pdserve-liveness")

    def start(self) -> None:
        if self.failures <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, daemon=True, name="pdserve-liveness")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.check()
            except Exception:  # the watch must outlive whatever one probe does
                log.exception("liveness check failed")

    def check(self) -> None:
        """One round: probe every live process at once, count the silent ones, kill those at the limit."""
        live = [h for h in self.cluster.supervised() if h.alive()]
        replies = list(self._pool.map(self._probe, live))
        seen = set()
        for h, ok in zip(live, replies, strict=True):
            key = (h.worker_id, h.pid)
            seen.add(key)
            n = 0 if ok else self._silent.get(key, 0) + 1
            self._silent[key] = n
            if n and n < self.failures:
                log.warning("%s %s (pid %d) did not answer its health check within %.1fs (%d of %d)",
                            h.role, h.worker_id, h.pid, self.timeout_s, n, self.failures)
            elif n >= self.failures and not self._stop.is_set():
                self._kill(h, n)
        self._silent = {k: v for k, v in self._silent.items() if k in seen}

    def _probe(self, h: WorkerHandle) -> bool:
        """One check; a probe that could not be made (a channel refused locally) counts as an answer:
        only a process seen silent is ever killed."""
        try:
            return self.cluster.answers(h, self.timeout_s)
        except Exception:
            log.warning("liveness check of %s could not be made", h.worker_id, exc_info=True)
            return True

    def _kill(self, h: WorkerHandle, n: int) -> None:
        why = (f"did not answer {n} health checks in a row ({self.period_s:g}s apart, {self.timeout_s:g}s "
               f"timeout): alive but not serving")
        log.error("%s %s (pid %d) %s; killing it (SIGKILL) so that it is restarted", h.role, h.worker_id,
                  h.pid, why)
        self.killed[h.worker_id] = why
        self._silent.pop((h.worker_id, h.pid), None)
        self.cluster.kill_unresponsive(h)
