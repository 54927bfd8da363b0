"""A real Prometheus for the integration tests (Debian's ``prometheus`` package; ``make tools`` installs
it): started on a free port, scraping a local cluster through the run directory's file-based service
discovery (``prometheus-targets.json``), 1 s scrape and evaluation intervals, stopped at the end."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import yaml

from pdserve.probe import free_port


@contextlib.contextmanager
def running_prometheus(tmp_path: Path, targets_file: Path,
                       rule_files: tuple[Path, ...] = ()) -> Iterator[int]:
    """Yield the port of a Prometheus that scrapes ``targets_file``'s targets (and evaluates
    ``rule_files``), ready to answer queries."""
    prometheus = shutil.which("prometheus")
    assert prometheus, "Debian's prometheus package is needed: `make tools` installs it (root)"
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        **({"rule_files": [str(f) for f in rule_files]} if rule_files else {}),
        "scrape_configs": [{"job_name": "pdserve", "file_sd_configs": [
            {"files": [str(targets_file)], "refresh_interval": "1s"}]}]}))
    port = free_port()
    with open(tmp_path / "prometheus.log", "w") as log:
        proc = subprocess.Popen([prometheus, f"--config.file={config}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for("Prometheus ready", lambda: _ready(port))
            yield port
        finally:
            proc.terminate()
            proc.wait(30)


def query(port: int, promql: str) -> dict:
    """The API's answer to an instant query (a query that did not parse: its 400 answer)."""
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        return json.loads(urllib.request.urlopen(url, timeout=10).read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


def scalar(port: int, promql: str) -> float | None:
    """The first sample of an instant query's answer, or None."""
    body = query(port, promql)
    result = body.get("data", {}).get("result") if body.get("status") == "success" else None
    return float(result[0]["value"][1]) if result else None


def wait_for(what: str, check, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (got := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)
    return got


def _ready(port: int) -> bool:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2).status == 200
    except OSError:
        return False
