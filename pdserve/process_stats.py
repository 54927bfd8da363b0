"""What a process measures about itself: CPU seconds, memory, and the phases of its start.

Every role's gRPC server serves ``pdserve.v1.Process/GetProcessStats`` (``pdserve/server.py``), so
``pdserve bench`` reads each process's own CPU (router, prefill, decode) before and after a load, and
an operator reads where a slow start went. The boot record is process-wide state (one process, one
start), owned here: ``BOOT.phase("load_weights")`` times a phase wherever it runs (the engine's weight
load, CUDA-graph capture, KV transport start), ``BOOT.serving()`` marks health turning SERVING.
Phases may overlap in time (weights streaming while graphs capture): each is timed on its own, and
each finished phase is logged with its seconds as it ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from pdserve.v1 import process_pb2, process_pb2_grpc

log = logging.getLogger(__name__)
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _proc_start_monotonic() -> float:
    """time.monotonic() at this process's start (the kernel's record), so phases count the
    interpreter's own start and imports too, not only what ran after this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.monotonic() - (uptime - start_ticks / _CLK_TCK)
    except (OSError, ValueError, IndexError):
        return time.monotonic()


@dataclass(frozen=True, kw_only=True)
class Phase:
    name: str
    start_s: float
    seconds: float


class BootRecord:
    """The start phases of this process, thread-safe (phases run on the loop and on engine threads)."""

    def __init__(self) -> None:
        self.t0 = _proc_start_monotonic()
        self._lock = threading.Lock()
        self._phases: list[Phase] = []
        self.serving_after_s = 0.0

    def restart(self) -> None:
        """In a forked child (a worker forked by the zygote, launcher/zygote.py): a new process whose start
        is the fork, with nothing of the parent's record."""
        self.__init__()
        self.t0 = time.monotonic()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.add(name, start, time.monotonic())

    def add(self, name: str, start: float, end: float) -> None:
        p = Phase(name=name, start_s=start - self.t0, seconds=end - start)
        with self._lock:
            self._phases.append(p)
        log.info("boot: %s %.3fs (from %.3fs after process start)", name, p.seconds, p.start_s)

    def serving(self) -> None:
        """Health turned SERVING: the first time counts (a drain later does not reset it)."""
        if not self.serving_after_s:
            self.serving_after_s = time.monotonic() - self.t0
            first = min((p.start_s for p in self.phases()), default=self.serving_after_s)
            # interpreter start, imports (torch, grpc), settings, model construction: everything
            # before the first timed phase, so the phases account for the whole start
            self.add("start_to_first_phase", self.t0, self.t0 + first)
            self.mark("serving")
            log.info("boot: SERVING %.3fs after process start; %s", self.serving_after_s, self.summary())

    def mark(self, name: str) -> None:
        now = time.monotonic()
        self.add(name, now, now)

    def phases(self) -> list[Phase]:
        with self._lock:
            return sorted(self._phases, key=lambda p: p.start_s)

    def summary(self) -> str:
        return ", ".join(f"{p.name} {p.seconds:.2f}s" for p in self.phases() if p.seconds > 0)


BOOT = BootRecord()
os.register_at_fork(after_in_child=BOOT.restart)


def cpu_seconds() -> float:
    """user + system CPU of this whole process (every thread, gRPC's C-core threads included)."""
    t = os.times()
    return t.user + t.system


def snapshot() -> process_pb2.ProcessStats:
    rss = threads = 0
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * _PAGE
        threads = threading.active_count()
        with open("/proc/self/stat") as f:
            threads = int(f.read().rsplit(")", 1)[1].split()[17])
    except (OSError, ValueError, IndexError):
        pass
    msg = process_pb2.ProcessStats(pid=os.getpid(), cpu_seconds=cpu_seconds(),
                                   uptime_s=time.monotonic() - BOOT.t0, rss_bytes=rss, num_threads=threads,
                                   serving_after_s=BOOT.serving_after_s)
    for p in BOOT.phases():
        msg.boot.add(name=p.name, start_s=p.start_s, seconds=p.seconds)
    return msg


class ProcessServicer(process_pb2_grpc.ProcessServicer):
    async def GetProcessStats(self, request, context):
        return snapshot()


SERVICE_NAME = process_pb2.DESCRIPTOR.services_by_name["Process"].full_name
