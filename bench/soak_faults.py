"""The soak's fault thread and memory sampler, both working from the launcher's run directory.

``FaultInjector`` reads the cluster's processes from ``run_dir/state.json`` (what `pdserve up` writes
and rewrites on every restart: each worker's id, address and pid), and at seeded random times sends
one worker ``SIGKILL`` (a crash: no drain) or ``SIGTERM`` (a drain, then exit 0), then waits until the
launcher's supervisor has it serving again: a new pid in state.json, a new ``incarnation`` from its
GetStats, and the router listing it healthy; or freezes one (``SIGSTOP`` for ``FREEZE_S`` seconds,
then ``SIGCONT``: a hung process whose connections stay open, which no supervisor restarts) and waits
until it answers again under the same incarnation and the router lists it healthy. One fault at a
time, so a pool is never emptied by the soak itself; the first three faults are a ``kill -9`` of a
decode worker, a ``SIGTERM`` of a prefill worker and a freeze of a decode worker, so every run (the
2-minute one too) covers them. A worker that is not back within
``back_timeout_s`` ends the fault schedule (the rest of the run would only measure a smaller cluster)
and is reported.

``RssSampler`` reads VmRSS of the router and of every worker pid in state.json from /proc every
``interval_s``; ``growth()`` states each process's growth after warm-up.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from pdserve.app.launcher.local import get_stats
from pdserve.client import Client


def read_state(run_dir: Path) -> dict:
    for _ in range(50):  # written by os.replace: a read never sees half a file, but it may be absent
        try:
            return json.loads((run_dir / "state.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            time.sleep(0.1)
    raise RuntimeError(f"no readable state.json in {run_dir}")


FREEZE_S = (3.0, 10.0)  # how long a frozen worker stays stopped (seeded, uniform)


@dataclass
class Fault:
    at: float             # monotonic time of the signal
    action: str           # kill9 | sigterm | freeze
    worker_id: str
    role: str
    pid: int
    back_after_s: float | None = None  # None: not back within the timeout
    new_pid: int | None = None
    exit_note: str = ""
    held_s: float | None = None  # freeze: seconds between SIGSTOP and SIGCONT

    @property
    def end(self) -> float:
        return self.at + (self.back_after_s if self.back_after_s is not None else 1e9)


class FaultInjector:
    def __init__(self, run_dir: Path, router: str, seed: int, stop: threading.Event, *,
                 every_s: tuple[float, float] = (10.0, 30.0), back_timeout_s: float = 120.0,
                 first_delay_s: float = 10.0) -> None:
        self.run_dir, self.router, self.stop = run_dir, router, stop
        self.rng = random.Random(f"faults/{seed}")
        self.every_s, self.back_timeout_s, self.first_delay_s = every_s, back_timeout_s, first_delay_s
        self.faults: list[Fault] = []
        self.lock = threading.Lock()
        self.gave_up = ""
        self.thread = threading.Thread(target=self._loop, daemon=True, name="soak-faults")

    def windows(self) -> list[tuple[float, float, str]]:
        with self.lock:
            return [(f.at, f.end, f.action) for f in self.faults]

    def _pick(self, n: int) -> tuple[str, dict]:
        workers = read_state(self.run_dir)["workers"]
        if n == 0:
            return "kill9", self.rng.choice([w for w in workers if w["role"] == "decode"])
        if n == 1:
            pool = [w for w in workers if w["role"] == "prefill"] or workers
            return "sigterm", self.rng.choice(pool)
        if n == 2:
            return "freeze", self.rng.choice([w for w in workers if w["role"] == "decode"])
        r = self.rng.random()
        return ("kill9" if r < 0.55 else "sigterm" if r < 0.85 else "freeze"), self.rng.choice(workers)

    def _loop(self) -> None:
        if self.stop.wait(self.first_delay_s):
            return
        n = 0
        while not self.stop.is_set():
            action, w = self._pick(n)
            try:
                incarnation = get_stats(w["address"], w["role"], timeout=5).incarnation
            except grpc.RpcError:
                incarnation = ""  # not answering right now: the fault still tests what follows
            fault = Fault(at=time.monotonic(), action=action, worker_id=w["worker_id"], role=w["role"],
                          pid=w["pid"])
            with self.lock:
                self.faults.append(fault)
            if action == "freeze":
                back = self._freeze(w, fault, incarnation)
            else:
                try:
                    os.kill(w["pid"], signal.SIGKILL if action == "kill9" else signal.SIGTERM)
                except ProcessLookupError:
                    fault.exit_note = "already gone"
                back = self._wait_back(w, incarnation)
            with self.lock:
                fault.back_after_s = None if back is None else back - fault.at
                fault.new_pid = next((x["pid"] for x in read_state(self.run_dir)["workers"]
                                      if x["worker_id"] == w["worker_id"]), None)
            if back is None:
                self.gave_up = (f"{w['worker_id']} not serving again {self.back_timeout_s:.0f}s after "
                                f"{action}; no further faults")
                return
            n += 1
            if self.stop.wait(self.rng.uniform(*self.every_s)):
                return

    def _freeze(self, w: dict, fault: Fault, incarnation: str) -> float | None:
        """SIGSTOP, a seeded hold, SIGCONT (always, even when the soak is stopping); then the time it
        answers again under the same incarnation (a stopped process is never restarted), listed healthy
        by the router."""
        hold = self.rng.uniform(*FREEZE_S)
        try:
            os.kill(w["pid"], signal.SIGSTOP)
        except ProcessLookupError:
            fault.exit_note = "already gone"
            return None
        try:
            self.stop.wait(hold)
        finally:
            os.kill(w["pid"], signal.SIGCONT)
            fault.held_s = round(time.monotonic() - fault.at, 2)
        return self._wait_serving(w, lambda now, inc: inc == incarnation)

    def _wait_back(self, w: dict, old_incarnation: str) -> float | None:
        """The time the supervisor's restart of ``w`` serves: a new pid, a new incarnation."""
        return self._wait_serving(
            w, lambda now, inc: now["pid"] != w["pid"] and bool(inc) and inc != old_incarnation)

    def _wait_serving(self, w: dict, ready) -> float | None:
        """When ``ready(state entry, incarnation)`` holds for ``w`` and the router lists it healthy; None
        after ``back_timeout_s``."""
        deadline = time.monotonic() + self.back_timeout_s
        while time.monotonic() < deadline:
            now = next((x for x in read_state(self.run_dir)["workers"] if x["worker_id"] == w["worker_id"]),
                       None)
            if now is not None:
                try:
                    inc = get_stats(now["address"], now["role"], timeout=5).incarnation
                    with Client(self.router, timeout=5) as c:
                        seen = {x["worker_id"]: x for x in c.list_workers()}
                    if ready(now, inc) and seen.get(w["worker_id"], {}).get("healthy"):
                        return time.monotonic()
                except grpc.RpcError:
                    pass
            time.sleep(0.25)
        return None

    def report(self, t0: float) -> list[dict]:
        with self.lock:
            return [{**asdict(f), "at": round(f.at - t0, 2),
                     "back_after_s": None if f.back_after_s is None else round(f.back_after_s, 2)}
                    for f in self.faults]


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


class RssSampler:
    def __init__(self, run_dir: Path, stop: threading.Event, interval_s: float) -> None:
        self.run_dir, self.stop, self.interval_s = run_dir, stop, interval_s
        self.samples: dict[tuple[str, int], list[tuple[float, int]]] = {}  # (name, pid) -> (t, KiB)
        self.thread = threading.Thread(target=self._loop, daemon=True, name="soak-rss")

    def sample(self) -> None:
        state = read_state(self.run_dir)
        procs = [("router", state["router_pid"])] + [(w["worker_id"], w["pid"]) for w in state["workers"]]
        now = time.monotonic()
        for name, pid in procs:
            kib = rss_kib(pid) if pid else None
            if kib is not None:
                self.samples.setdefault((name, pid), []).append((now, kib))

    def _loop(self) -> None:
        while not self.stop.wait(self.interval_s):
            self.sample()

    def growth(self, warmup_s: float) -> list[dict]:
        """Per process: RSS after warm-up (median of its first 3 samples) and at the end (median of the
        last 3), for each process's longest-lived incarnation (pid) whose samples span past warm-up.
        A restarted worker's warm-up counts from its own first sample."""
        best: dict[str, dict] = {}
        incarnations: dict[str, int] = {}
        for (name, pid), pts in self.samples.items():
            incarnations[name] = incarnations.get(name, 0) + 1
            start = pts[0][0]
            kept = [kib for t, kib in pts if t >= start + warmup_s]
            if len(kept) < 2:
                continue
            span = pts[-1][0] - (start + warmup_s)
            first, last = statistics.median(kept[:3]), statistics.median(kept[-3:])
            row = {"process": name, "pid": pid, "span_s": round(span, 1),
                   "rss_start_mib": round(first / 1024, 1),
                   "rss_end_mib": round(last / 1024, 1), "growth_mib": round((last - first) / 1024, 1),
                   "rss_max_mib": round(max(kept) / 1024, 1)}
            if name not in best or span > best[name]["span_s"]:
                best[name] = row
        rows = [dict(r, incarnations=incarnations[n]) for n, r in best.items()]
        return sorted(rows, key=lambda r: (r["process"] != "router", r["process"]))
