"""One 1P1D cluster (KV over TCP) with the router's HTTP door and API keys, shared by the
test_openai_*.py modules (session scope: started once), plus small helpers for raw HTTP requests.

The router takes keys from a keys file (``KEY`` is in it); the fixture checks at the end of the
session that every KV block is back on both pools and nothing is running or leased.
"""

from __future__ import annotations

import http.client
import json
import socket

import pytest

from pdserve.app.launcher.local import LocalCluster

KEY = "sk-test-0123456789"
MODEL = "tiny-chat"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def http_cluster(make_checkpoint, tmp_path_factory):
    model = make_checkpoint("llama")
    root = tmp_path_factory.mktemp("openai")
    keys = root / "keys.txt"
    keys.write_text(f"# test keys\n{KEY}\n")
    with LocalCluster(model, prefill=1, decode=1, transport="tcp", run_dir=root / "run",
                      policy="session+prefix", http_port=free_port(), api_keys_file=str(keys),
                      router_args=("--served-model-name", MODEL)) as c:
        c.model = model
        c.keys_file = keys
        c.start_free = c.free_blocks()
        yield c
        stats = c.wait_idle(c.start_free)
        assert {w: s.free_blocks for w, s in stats.items()} == c.start_free
        assert all(s.num_running == 0 and s.num_leased == 0 for s in stats.values())


def openai_client(cluster, key: str = KEY):
    from openai import OpenAI

    return OpenAI(base_url=f"http://{cluster.http}/v1", api_key=key, max_retries=0, timeout=120)


def raw(cluster, method: str, path: str, body: bytes | str | dict | None = None, *, key: str | None = KEY,
        headers: dict | None = None) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of one plain HTTP request."""
    host, port = cluster.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    h = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    if isinstance(body, dict):
        body = json.dumps(body)
    try:
        conn.request(method, path, body=body, headers=h)
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, dict(resp.getheaders()), json.loads(data) if data else {}
    finally:
        conn.close()
