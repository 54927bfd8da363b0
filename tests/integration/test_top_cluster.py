"""``pdserve top --once --json`` against a CPU cluster started with ``metrics_port`` (``pdserve up
--metrics-port``): every process in the run directory's targets file answers, the router's requests and
percentiles show, and the workers count the tokens they computed."""

from __future__ import annotations

import json
import time

import pytest

from pdserve.app.cli import main
from pdserve.app.launcher.local import LocalCluster
from pdserve.client import Client
from pdserve.probe import free_port

pytestmark = pytest.mark.slow


def top(capsys, run_dir, *args: str) -> dict:
    assert main(["top", "--run-dir", str(run_dir), "--once", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_top_shows_every_process_of_a_cluster(make_checkpoint, tmp_path, capsys):
    model = make_checkpoint("llama")
    run_dir = tmp_path / "run"
    with LocalCluster(model, run_dir=run_dir, metrics_port=free_port()) as c:
        with Client(c.router, timeout=120) as client:
            for i in range(6):
                r = client.generate(prompt_ids=[5 + (j * 7 + i) % 900 for j in range(20 + 9 * i)],
                                    max_tokens=6, ignore_eos=True)
                assert len(r.token_ids) == 6
        # the router observes a request's end as its last message goes out: wait until all 6 are in
        deadline = time.monotonic() + 60
        while (out := top(capsys, run_dir, "--interval", "0"))["targets"][0].get("requests") != 6:
            assert time.monotonic() < deadline, out
            time.sleep(0.2)
        rows = out["targets"]
        assert out["down"] == 0 and [t["role"] for t in rows] == ["router", "prefill", "decode"]
        assert all(t["up"] and t["error"] is None and t["process"] for t in rows)
        router, prefill, decode = rows
        assert router["failures"] == 0 and router["requests_per_s"] is None  # one scrape: no rates
        # percentiles over every request since the router started
        assert router["ttft_p50_s"] > 0 and router["ttft_p90_s"] >= router["ttft_p50_s"]
        assert router["tpot_p50_s"] > 0 and router["kv_bytes_per_s"] is None
        assert prefill["prompt_tokens"] > 0 and decode["generated_tokens"] > 0
        assert 0 <= prefill["kv_used"] <= 1 and 0 <= decode["kv_used"] <= 1
        assert prefill["step_p50_s"] > 0 and decode["step_p50_s"] > 0

        # two scrapes: rates over the interval between them, for every process
        out = top(capsys, run_dir, "--interval", "0.5")
        assert out["down"] == 0 and len(out["targets"]) == 3
        router, prefill, decode = out["targets"]
        assert router["interval_s"] > 0 and router["requests_per_s"] is not None
        assert prefill["prompt_tokens_per_s"] is not None and decode["generated_tokens_per_s"] is not None
        assert decode["generated_tokens"] > 0
