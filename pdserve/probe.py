"""Small loopback helpers for launching and watching local clusters (benches and tests).

``free_port`` asks the kernel for an unused TCP port on 127.0.0.1 (it can race with another
process binding it before the caller does, which is acceptable for local runs). ``scrape_metrics``
reads a Prometheus text exposition into ``{"name{labels}": value}``.
"""

from __future__ import annotations

import socket
import urllib.request


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def scrape_metrics(port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> dict[str, float]:
    """Every sample line of ``http://host:port/metrics`` keyed by its name and labels as printed."""
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
