"""The metrics ports of a local cluster's processes (``pdserve up --metrics-port P``), and the Prometheus
file-based service-discovery file that lists them.

The router serves its metrics on P; each worker gets a free port of its own the first time it starts,
kept across its restarts (its name is the key), so a Prometheus pointed at the run directory's
``prometheus-targets.json`` (``file_sd_configs``) scrapes every process, each labelled with its role
and name, and follows scale-ups and moves without a restart.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from pdserve.probe import free_port

PROMETHEUS_TARGETS = "prometheus-targets.json"


class MetricsPorts:
    def __init__(self, router_port: int) -> None:
        self.router_port = router_port
        self._lock = threading.Lock()
        self._ports: dict[str, int] = {}  # worker name -> its metrics port

    @property
    def enabled(self) -> bool:
        return bool(self.router_port)

    def router_args(self) -> list[str]:
        return ["--metrics-port", str(self.router_port)] if self.router_port else []

    def worker_args(self, name: str) -> list[str]:
        """``--metrics-port N`` of worker ``name``: chosen once, the same on every restart."""
        if not self.router_port:
            return []
        with self._lock:
            port = self._ports.setdefault(name, free_port())
        return ["--metrics-port", str(port)]

    def targets(self, router_address: str | None, workers: list[tuple[str, str, str]]) -> list[dict]:
        """Prometheus target groups: the router (at ``router_address``'s host) and each
        ``(serve role, name, address)`` worker that has a port."""
        if not self.router_port:
            return []
        out = []
        if router_address:
            out.append({"targets": [f"{_host(router_address)}:{self.router_port}"],
                        "labels": {"pdserve_role": "router", "pdserve_process": "router"}})
        with self._lock:
            ports = dict(self._ports)
        for role, name, address in workers:
            if name in ports:
                out.append({"targets": [f"{_host(address)}:{ports[name]}"],
                            "labels": {"pdserve_role": role, "pdserve_process": name}})
        return out

    def write(self, run_dir: Path, router_address: str | None, workers: list[tuple[str, str, str]]) -> None:
        """Replace the run directory's targets file (atomically: Prometheus re-reads it when it changes)."""
        if not self.router_port:
            return
        tmp = run_dir / f"{PROMETHEUS_TARGETS}.tmp"
        tmp.write_text(json.dumps(self.targets(router_address, workers), indent=2))
        os.replace(tmp, run_dir / PROMETHEUS_TARGETS)


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0]
