"""``pdserve top``: quantiles from buckets by PromQL's rule, rates from two scrapes, a target that does not
answer, and ``--once --json`` through the command's entry against metrics served on loopback."""

from __future__ import annotations

import io
import json
import math
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from rich.console import Console

from pdserve.app.cli import main
from pdserve.app.top.scrape import Poller, targets_from_list
from pdserve.app.top.stats import (
    RouterRow,
    Target,
    WorkerRow,
    as_json,
    bucket_delta,
    histogram_quantile,
    identify,
    parse,
    rate,
    row,
)
from pdserve.app.top.view import render

INF = math.inf


def hist(name: str, bounds: list[str], counts: list[int], labels: str = "") -> str:
    """Exposition lines of one histogram series: cumulative ``counts`` per ``bounds`` (the last ``+Inf``)."""
    sep = "," if labels else ""
    lines = [f'{name}_bucket{{{labels}{sep}le="{b}"}} {n}' for b, n in zip(bounds, counts, strict=True)]
    lines.append(f"{name}_count{{{labels}}} {counts[-1]}" if labels else f"{name}_count {counts[-1]}")
    return "\n".join(lines)


TTFT = "pdserve_router_time_to_first_token_seconds"
TTFT_BOUNDS = ["0.01", "0.05", "0.1", "0.5", "+Inf"]
TPOT_BOUNDS = ["0.005", "0.01", "0.02", "+Inf"]


def router_text(*, ended: int, failures: int, kv_bytes: int, inflight: int, remote: list[int],
                local: list[int], tpot: list[int]) -> str:
    return "\n".join([
        "# TYPE pdserve_router_inflight_requests gauge",
        f"pdserve_router_inflight_requests {inflight}",
        "# TYPE pdserve_router_kv_bytes_sent counter",
        f"pdserve_router_kv_bytes_sent_total {kv_bytes}",
        "pdserve_router_kv_bytes_sent_created 1.7e9",
        "# TYPE pdserve_router_request_failures counter",
        f"pdserve_router_request_failures_total {failures}",
        "# TYPE pdserve_router_time_to_first_token_seconds histogram",
        hist(TTFT, TTFT_BOUNDS, remote, 'mode="remote",transport="tcp"'),
        hist(TTFT, TTFT_BOUNDS, local, 'mode="local",transport="local"'),
        "# TYPE pdserve_router_time_per_output_token_seconds histogram",
        hist("pdserve_router_time_per_output_token_seconds", TPOT_BOUNDS, tpot, 'mode="remote"'),
        "# TYPE pdserve_router_e2e_request_latency_seconds histogram",
        hist("pdserve_router_e2e_request_latency_seconds", ["1.0", "+Inf"], [ended, ended], 'mode="remote"'),
        ""])


STEP_BOUNDS = ["0.001", "0.002", "0.004", "+Inf"]


def worker_text(*, role: str = "decode", name: str = "decode-0", free: int = 192, total: int = 256,
                running: int = 3, queue: int = 1, prompt: int, generated: int, steps: list[int],
                device_hits: int, host_hits: int | None = None) -> str:
    lab = f'role="{role}",worker="{name}"'
    lines = [f"# TYPE {g} gauge\n{g}{{{lab}}} {v}" for g, v in (
        ("pdserve_worker_free_blocks", free), ("pdserve_worker_total_blocks", total),
        ("pdserve_worker_running", running), ("pdserve_worker_queue_depth", queue))]
    lines += [f"# TYPE {c} counter\n{c}_total{{{lab}}} {v}" for c, v in (
        ("pdserve_worker_prompt_tokens", prompt), ("pdserve_worker_generated_tokens", generated))]
    lines += ["# TYPE pdserve_worker_step_seconds histogram",
              hist("pdserve_worker_step_seconds", STEP_BOUNDS, steps, lab),
              "# TYPE pdserve_worker_prefix_cache_hit_tokens counter",
              f'pdserve_worker_prefix_cache_hit_tokens_total{{{lab},tier="device"}} {device_hits}']
    if host_hits is not None:
        lines.append(f'pdserve_worker_prefix_cache_hit_tokens_total{{{lab},tier="host"}} {host_hits}')
    return "\n".join(lines) + "\n"


# --- quantiles ---------------------------------------------------------------------------------------


def test_quantile_interpolates_inside_the_bucket_like_promql():
    # cumulative: 2 at or below 0.1, 6 at or below 0.2, 8 at or below 0.5, 10 in all
    b = {0.1: 2, 0.2: 6, 0.5: 8, INF: 10}
    assert histogram_quantile(0.1, b) == pytest.approx(0.05)  # rank 1 of 2 in (0, 0.1]
    assert histogram_quantile(0.5, b) == pytest.approx(0.175)  # rank 5: 3rd of 4 in (0.1, 0.2]
    assert histogram_quantile(0.8, b) == pytest.approx(0.5)  # rank 8: the last of (0.2, 0.5]
    assert histogram_quantile(0.9, b) == 0.5  # rank 9 falls in +Inf: the largest finite bound
    assert histogram_quantile(1.0, b) == 0.5
    assert histogram_quantile(0.2, b) == pytest.approx(0.1)  # rank 2 reaches the first bucket's count


def test_quantile_edge_cases_follow_promql():
    assert histogram_quantile(0.5, {0.1: 0, INF: 0}) is None  # no observations: NaN
    assert histogram_quantile(0.5, {0.1: 3, 0.2: 4}) is None  # no +Inf bucket: NaN
    assert histogram_quantile(0.5, {INF: 4}) is None  # one bucket: NaN
    assert histogram_quantile(1.5, {0.1: 1, INF: 1}) == INF
    assert histogram_quantile(-0.5, {0.1: 1, INF: 1}) == -INF
    assert histogram_quantile(0.5, {0.0: 3, 1.0: 4, INF: 4}) == 0.0  # first bound at or below 0
    # counts going down with the bound are raised to the previous count (forced monotonic)
    assert histogram_quantile(0.5, {0.1: 2, 0.2: 1, 0.4: 4, INF: 4}) == histogram_quantile(
        0.5, {0.1: 2, 0.2: 2, 0.4: 4, INF: 4}) == pytest.approx(0.1)


def test_quantiles_sum_series_and_use_the_intervals_delta():
    before = parse(router_text(ended=4, failures=0, kv_bytes=1000, inflight=2, remote=[0, 2, 2, 2, 2],
                               local=[1, 1, 1, 1, 1], tpot=[1, 3, 3, 3]), at=10.0)
    after = parse(router_text(ended=14, failures=1, kv_bytes=5000, inflight=1, remote=[0, 2, 2, 6, 10],
                              local=[1, 1, 1, 5, 5], tpot=[1, 3, 13, 13]), at=12.0)
    # sum by (le) over mode and transport
    assert after.buckets("pdserve_router_time_to_first_token_seconds") == {
        0.01: 1, 0.05: 3, 0.1: 3, 0.5: 11, INF: 15}
    # cumulative since start: rank 7.5 of 15 lies in (0.1, 0.5] (counts 3 -> 11)
    cumulative = after.buckets("pdserve_router_time_to_first_token_seconds")
    assert histogram_quantile(0.5, cumulative) == pytest.approx(0.1 + 0.4 * 4.5 / 8)
    # over the interval: 8 observations in (0.1, 0.5] and 4 above 0.5
    delta = bucket_delta(after, before, "pdserve_router_time_to_first_token_seconds")
    assert delta == {0.01: 0, 0.05: 0, 0.1: 0, 0.5: 8, INF: 12}
    assert histogram_quantile(0.5, delta) == pytest.approx(0.1 + 0.4 * 6 / 8)
    assert histogram_quantile(0.9, delta) == 0.5

    r = row(Target("r:1"), after, before)
    assert isinstance(r, RouterRow) and r.up and r.role == "router" and r.interval_s == 2.0
    assert r.requests == 14 and r.requests_per_s == pytest.approx(5.0)
    assert r.kv_bytes_per_s == pytest.approx(2000.0) and r.inflight == 1 and r.failures == 1
    assert r.ttft_p50_s == pytest.approx(0.4) and r.ttft_p90_s == 0.5
    assert r.tpot_p50_s == pytest.approx(0.01 + 0.01 * 5 / 10)  # all 10 new ones in (0.01, 0.02]
    assert r.tpot_p90_s == pytest.approx(0.01 + 0.01 * 9 / 10)
    # a single scrape: no rates, percentiles over everything since start
    first = row(Target("r:1"), after)
    assert first.requests_per_s is None and first.kv_bytes_per_s is None and first.interval_s is None
    assert first.ttft_p50_s == pytest.approx(0.1 + 0.4 * 4.5 / 8)


# --- rates -------------------------------------------------------------------------------------------


def test_worker_rates_from_two_scrapes():
    before = parse(worker_text(prompt=100, generated=40, steps=[5, 5, 5, 5], device_hits=48, host_hits=0),
                   at=100.0)
    after = parse(worker_text(prompt=300, generated=140, steps=[5, 9, 15, 15], device_hits=80,
                              host_hits=32, free=64), at=104.0)
    assert identify(after) == ("decode", "decode-0")
    assert rate(after, before, "pdserve_worker_generated_tokens_total") == pytest.approx(25.0)
    assert rate(after, None, "pdserve_worker_generated_tokens_total") is None
    w = row(Target("w:1"), after, before)
    assert isinstance(w, WorkerRow) and w.role == "decode" and w.process == "decode-0"
    assert w.prompt_tokens_per_s == pytest.approx(50.0) and w.generated_tokens_per_s == pytest.approx(25.0)
    assert (w.prompt_tokens, w.generated_tokens) == (300, 140)
    assert (w.queue, w.running) == (1, 3)
    assert w.kv_used == pytest.approx(1 - 64 / 256)
    # 10 steps in the interval: 4 in (0.001, 0.002], 6 in (0.002, 0.004]; rank 5 is the 1st of those 6
    assert w.step_p50_s == pytest.approx(0.002 + 0.002 * 1 / 6)
    assert w.prefix_hit_tokens == {"device": 80, "host": 32}
    assert w.prefix_hit_tokens_per_s == pytest.approx({"device": 8.0, "host": 8.0})


def test_a_counter_reset_counts_the_new_value():
    before = parse(worker_text(prompt=1000, generated=900, steps=[5, 9, 15, 15], device_hits=0), at=0.0)
    after = parse(worker_text(prompt=60, generated=20, steps=[1, 2, 2, 2], device_hits=0), at=2.0)
    w = row(Target("w:1", role="decode", process="decode-0"), after, before)
    assert w.prompt_tokens_per_s == pytest.approx(30.0) and w.generated_tokens_per_s == pytest.approx(10.0)
    assert w.step_p50_s == pytest.approx(0.001)  # the new counts: rank 1 of 2 fills the first bucket


def test_roles_come_from_the_targets_file_over_the_metrics():
    text = worker_text(role="colocated", name="colocated-0", prompt=1, generated=1, steps=[0, 0, 0, 0],
                       device_hits=0)
    w = row(Target("w:1", role="colocated", process="colocated-0"), parse(text, 1.0))
    assert (w.role, w.process) == ("colocated", "colocated-0")
    assert identify(parse("# TYPE x gauge\nx 1\n", 1.0)) == (None, None)


# --- targets that do not answer ----------------------------------------------------------------------


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_a_target_that_does_not_answer_is_a_row_marked_down():
    down = f"127.0.0.1:{closed_port()}"
    poller = Poller(lambda: targets_from_list(down), timeout=2.0)
    try:
        rows = poller.poll()
        assert len(rows) == 1 and not rows[0].up and rows[0].address == down and rows[0].error
        rows = poller.poll()  # and again: still a row, no exception
        assert not rows[0].up
    finally:
        poller.close()
    known = row(Target("h:1", role="decode", process="decode-1"), None, error="refused")
    assert isinstance(known, WorkerRow) and not known.up and known.generated_tokens_per_s is None
    out = as_json([known])
    assert out["down"] == 1 and out["targets"][0]["kind"] == "worker"
    console = Console(file=io.StringIO(), width=200)
    console.print(render([known], "test", 2.0))
    text = console.file.getvalue()
    assert "down" in text and "decode-1" in text and "0/1 up" in text


def test_a_target_answering_garbage_is_down(metrics_server):
    bad = metrics_server(["this is { not exposition text\n"])
    poller = Poller(lambda: targets_from_list(bad), timeout=2.0)
    try:
        (r,) = poller.poll()
    finally:
        poller.close()
    assert not r.up and r.error


# --- the command -------------------------------------------------------------------------------------


@pytest.fixture
def metrics_server():
    """``serve(texts) -> "127.0.0.1:PORT"``: /metrics answers ``texts[k]`` at the k-th scrape (the last
    one from then on)."""
    servers = []

    def serve(texts: list[str]) -> str:
        lock, hits = threading.Lock(), [0]

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                with lock:
                    body = texts[min(hits[0], len(texts) - 1)].encode()
                    hits[0] += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"127.0.0.1:{server.server_address[1]}"

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def run_json(capsys, *args) -> tuple[int, dict]:
    code = main(["top", *args, "--once", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1  # one JSON object, nothing else on stdout
    return code, json.loads(out[0])


def test_once_json_through_the_command(capsys, metrics_server):
    router = metrics_server([
        router_text(ended=4, failures=0, kv_bytes=1000, inflight=2, remote=[0, 2, 2, 2, 2],
                    local=[1, 1, 1, 1, 1], tpot=[1, 3, 3, 3]),
        router_text(ended=14, failures=1, kv_bytes=5000, inflight=1, remote=[0, 2, 2, 6, 10],
                    local=[1, 1, 1, 5, 5], tpot=[1, 3, 13, 13])])
    worker = metrics_server([
        worker_text(prompt=100, generated=40, steps=[5, 5, 5, 5], device_hits=48),
        worker_text(prompt=300, generated=140, steps=[5, 9, 15, 15], device_hits=80)])
    down = f"127.0.0.1:{closed_port()}"
    code, out = run_json(capsys, "--targets", f"{worker},{router},{down}", "--interval", "0.2")
    assert code == 0 and (out["up"], out["down"]) == (2, 1)
    r, w, d = out["targets"]  # the router first, then the workers, then what is unknown
    assert (r["kind"], r["role"], r["address"], r["up"]) == ("router", "router", router, True)
    assert r["requests_per_s"] > 0 and r["kv_bytes_per_s"] > 0 and r["interval_s"] > 0
    assert r["inflight"] == 1 and r["failures"] == 1 and r["requests"] == 14
    assert r["ttft_p50_s"] == pytest.approx(0.4)  # the interval's buckets, not the cumulative ones
    assert r["ttft_p90_s"] == 0.5
    assert (w["kind"], w["role"], w["process"], w["up"]) == ("worker", "decode", "decode-0", True)
    assert w["generated_tokens_per_s"] > 0 and w["prompt_tokens_per_s"] > 0
    assert w["prompt_tokens_per_s"] == pytest.approx(2 * w["generated_tokens_per_s"])
    assert w["step_p50_s"] == pytest.approx(0.002 + 0.002 / 6)
    assert w["kv_used"] == pytest.approx(0.25) and w["prefix_hit_tokens"] == {"device": 80}
    assert (d["kind"], d["address"], d["up"]) == ("unknown", down, False) and d["error"]


def test_once_from_a_run_dir(capsys, metrics_server, tmp_path):
    router = metrics_server([router_text(ended=4, failures=0, kv_bytes=1000, inflight=0,
                                         remote=[0, 2, 2, 2, 2], local=[1, 1, 1, 1, 1], tpot=[1, 3, 3, 3])])
    prefill = metrics_server([worker_text(role="prefill", name="prefill-a", prompt=100, generated=4,
                                          steps=[1, 1, 1, 1], device_hits=0)])
    down = f"127.0.0.1:{closed_port()}"
    (tmp_path / "prometheus-targets.json").write_text(json.dumps([
        {"targets": [router], "labels": {"pdserve_role": "router", "pdserve_process": "router"}},
        {"targets": [down], "labels": {"pdserve_role": "decode", "pdserve_process": "decode-0"}},
        {"targets": [prefill], "labels": {"pdserve_role": "prefill", "pdserve_process": "prefill-0"}}]))
    code, out = run_json(capsys, "--run-dir", str(tmp_path), "--interval", "0")
    assert code == 0
    r, p, d = out["targets"]
    assert r["role"] == "router" and r["requests_per_s"] is None and r["interval_s"] is None
    # one scrape, the cumulative buckets: rank 1.5 of 3 is the first half of the 2 in (0.01, 0.05]
    assert r["ttft_p50_s"] == pytest.approx(0.01 + 0.04 * 0.5 / 2)
    assert (p["process"], p["role"], p["up"], p["prompt_tokens"]) == ("prefill-0", "prefill", True, 100)
    assert p["prompt_tokens_per_s"] is None
    assert (d["process"], d["role"], d["kind"], d["up"]) == ("decode-0", "decode", "worker", False)

    assert main(["top", "--run-dir", str(tmp_path), "--interval", "0", "--once"]) == 0
    table = capsys.readouterr().out
    for word in ("router", "prefill-0", "decode-0", "down", "2/3 up"):
        assert word in table


def test_no_targets_and_bad_flags(capsys, tmp_path):
    assert main(["top", "--run-dir", str(tmp_path), "--once"]) == 1
    assert "prometheus-targets.json" in capsys.readouterr().err
    assert main(["top", "--targets", "127.0.0.1:1", "--json"]) == 2
    assert main(["top", "--targets", "127.0.0.1:1", "--interval", "0"]) == 2
    down = f"127.0.0.1:{closed_port()}"
    code, out = run_json(capsys, "--targets", down, "--interval", "0")
    assert code == 1 and out["up"] == 0  # nothing answered: a non-zero exit for scripts


def test_the_table_shows_the_rates():
    before = parse(worker_text(prompt=100, generated=40, steps=[5, 5, 5, 5], device_hits=48, host_hits=0),
                   at=100.0)
    after = parse(worker_text(prompt=300, generated=140, steps=[5, 9, 15, 15], device_hits=80,
                              host_hits=32, free=64), at=104.0)
    r_before = parse(router_text(ended=4, failures=0, kv_bytes=1000, inflight=2, remote=[0, 2, 2, 2, 2],
                                 local=[1, 1, 1, 1, 1], tpot=[1, 3, 3, 3]), at=102.0)
    r_after = parse(router_text(ended=14, failures=1, kv_bytes=3_001_000, inflight=1, remote=[0, 2, 2, 6, 10],
                                local=[1, 1, 1, 5, 5], tpot=[1, 3, 13, 13]), at=104.0)
    rows = [row(Target("w:1"), after, before), row(Target("r:1"), r_after, r_before)]
    console = Console(file=io.StringIO(), width=250)
    console.print(render(rows, "test", 2.0))
    text = console.file.getvalue()
    assert "2/2 up" in text and "rates over the last 4.0 s" in text
    router_line = next(line for line in text.splitlines() if "r:1" in line)
    for cell in ("5", "400.0", "500.0", "15.0", "19.0", "1.5 MB/s"):  # req/s, TTFT, TPOT ms, KV bytes/s
        assert f" {cell} " in router_line, (cell, router_line)
    worker_line = next(line for line in text.splitlines() if "w:1" in line)
    for cell in ("decode-0", "decode", "75%", "50", "25", "2.3", "device 8 host 8"):
        assert f" {cell} " in worker_line, (cell, worker_line)
