"""Where ``pdserve top`` finds its targets, and fetching their ``/metrics`` (urllib; no terminal code).

Targets come from a run directory's ``prometheus-targets.json`` (``pdserve up --metrics-port P``:
Prometheus file_sd target groups labelled ``pdserve_role`` and ``pdserve_process``), re-read at every
refresh so scale-ups show, or from a ``HOST:PORT,...`` list (each role then read from its metrics).
A target that does not answer, or answers with something that is not exposition text, is a row marked
down: never an exception out of ``Poller.poll``.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pdserve.app.launcher.metrics_ports import PROMETHEUS_TARGETS
from pdserve.app.top.stats import Row, Scrape, Target, parse, row, sort_rows


def targets_from_file(path: Path) -> list[Target]:
    """The targets of a Prometheus file_sd JSON file (a list of ``{"targets": [...], "labels": {...}}``)."""
    groups = json.loads(path.read_text())
    out = []
    for group in groups:
        labels = group.get("labels") or {}
        for address in group.get("targets") or ():
            out.append(Target(address=address, role=labels.get("pdserve_role"),
                              process=labels.get("pdserve_process")))
    return out


def targets_from_list(spec: str) -> list[Target]:
    """``HOST:PORT,HOST:PORT`` (an ``http://`` prefix or ``/metrics`` suffix is allowed)."""
    out = []
    for item in spec.split(","):
        item = item.strip()
        if item:
            item = item.removeprefix("http://").removesuffix("/metrics").rstrip("/")
            out.append(Target(address=item))
    return out


def run_dir_targets(run_dir: Path) -> Callable[[], list[Target]]:
    """A source of the run directory's targets: re-read each call; the last good list while the file is
    missing or being replaced."""
    path = Path(run_dir) / PROMETHEUS_TARGETS
    last: list[Target] = []

    def read() -> list[Target]:
        nonlocal last
        try:
            last = targets_from_file(path)
        except (OSError, ValueError):
            pass
        return last

    return read


# Straight to the target, as Prometheus scrapes: never through an http_proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def fetch(address: str, timeout: float) -> str:
    with _OPENER.open(f"http://{address}/metrics", timeout=timeout) as response:
        return response.read().decode("utf-8")


def scrape(target: Target, timeout: float,
           clock: Callable[[], float] = time.monotonic) -> tuple[Scrape | None, str | None]:
    """``(scrape, None)``, or ``(None, why)`` when the target does not answer with exposition text."""
    try:
        text = fetch(target.address, timeout)
        return parse(text, clock()), None
    except Exception as e:  # noqa: BLE001 - whatever a target does, it is a row marked down
        return None, f"{type(e).__name__}: {e}"


class Poller:
    """Scrapes every target (concurrently) per ``poll``; rates and percentiles against the previous poll."""

    def __init__(self, targets: Callable[[], list[Target]], timeout: float = 2.0) -> None:
        self.targets, self.timeout = targets, timeout
        self._prev: dict[str, Scrape] = {}
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="pdserve-top")

    def poll(self) -> list[Row]:
        targets = self.targets()
        results = list(self._pool.map(lambda t: scrape(t, self.timeout), targets))
        rows, seen = [], {}
        for target, (cur, error) in zip(targets, results, strict=True):
            rows.append(row(target, cur, self._prev.get(target.address), error))
            if cur is not None:
                seen[target.address] = cur
        self._prev = seen  # a target down this time starts over (its counters may have been reset)
        return sort_rows(rows)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
