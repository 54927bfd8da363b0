"""``pdserve planner explain`` and ``planner run --dry-run`` through the command line's entry (in this
process: scrapes are canned, sleeps are no-ops), and the planner's metrics."""

from __future__ import annotations

import json
import time

import pytest
from prometheus_client import generate_latest

from pdserve.app.cli import main
from pdserve.app.planner import live
from pdserve.app.planner.live import SignalSource, run
from pdserve.app.planner.metrics import planner_registry
from pdserve.app.planner.policy import Planner, PlannerConfig
from pdserve.app.planner.signals import Signals
from pdserve.app.top.stats import Target, parse
from tests.unit.fake_clock import Clock
from tests.unit.test_planner_capacity import point, sweep_file
from tests.unit.test_planner_signals import router_text, worker_text


def profile(tmp_path):
    path = tmp_path / "sweep.json"
    pts = [point(2, 1.0, prompt_tokens=200_000, out_tok_s=400, req_s=2, e2e_mean_ms=5300, ttft_mean_ms=300),
           point(4, 0.5, prompt_tokens=400_000, out_tok_s=600, req_s=3, e2e_mean_ms=9000, ttft_mean_ms=4000)]
    path.write_text(json.dumps(sweep_file(**{"1p1d-tcp": pts})))
    return path  # at 2 req/s: 10,000 prompt tokens/s, 400 output tokens/s, 10 sequences per worker


def trace_file(tmp_path):
    quiet = dict(window_s=10.0, prompt_tokens=20_000, requests=10, output_tokens=1_000, decode_running=2,
                 prefill_replicas=1, decode_replicas=1, ttft_p90_s=0.3, tpot_p90_s=0.02)
    rows = [Signals(at=10.0 * i, **quiet) for i in range(1, 4)]
    rows.append(Signals(at=40.0, **{**quiet, "prompt_tokens": 300_000, "requests": 100,
                                    "backlog_prompt_tokens": 50_000, "prefill_waiting": 17}))
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in rows))
    return path


def test_explain_prints_the_model_and_why_each_decision(tmp_path, capsys):
    rc = main(["planner", "explain", "--profile", str(profile(tmp_path)),
               "--trace", str(trace_file(tmp_path)), "--load", "2:3000:200"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "TTFT 1500 ms" in out and "TPOT 30 ms" in out  # the profile's SLOs, none given
    assert "10,000.0" in out and "sweep.json: 1p1d-tcp @ 2 req/s" in out  # the seeded prefill capacity
    assert "steady loads" in out and "decisions" in out
    assert "up 1 -> 5" in out and "backlog 50,000" in out  # the burst window, with its reason
    assert "4 windows; prefill: 1 up, 0 down, ends at 5" in out


def test_explain_as_json(tmp_path, capsys):
    rc = main(["planner", "explain", "--profile", str(profile(tmp_path)),
               "--trace", str(trace_file(tmp_path)), "--ttft-slo-ms", "500", "--load", "1:1000:100",
               "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["config"]["ttft_s"] == 0.5 and data["config"]["tpot_s"] == 0.03
    assert data["capacity"]["prefill_tokens_per_s"]["value"] == 10_000.0
    assert data["steady"][0]["prefill"]["replicas"] == 1 and data["steady"][0]["decode"]["binding"]
    steps = data["trace"]
    assert len(steps) == 4 and steps[-1]["decision"]["prefill"]["direction"] == "up"
    assert steps[0]["signals"]["prompt_tokens"] == 20_000


def test_explain_refuses_what_it_cannot_read(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(sweep_file(colocated=[point(1, 1.0, prompt_tokens=1, out_tok_s=1, req_s=1,
                                                          e2e_mean_ms=1, ttft_mean_ms=0)])))
    assert main(["planner", "explain", "--profile", str(bad)]) == 2
    assert "colocated mode has no prefill pool" in capsys.readouterr().err
    assert main(["planner", "explain", "--load", "fast"]) == 2
    assert "RATE:PROMPT_TOKENS:OUTPUT_TOKENS" in capsys.readouterr().err
    assert main(["planner", "explain", "--band", "2"]) == 2
    assert "band" in capsys.readouterr().err


def test_run_is_dry_run_only_and_needs_targets(tmp_path, capsys):
    assert main(["planner", "run", "--run-dir", str(tmp_path)]) == 2
    assert "pdserve up --autoscale" in capsys.readouterr().err
    assert main(["planner", "run", "--run-dir", str(tmp_path), "--dry-run"]) == 1
    assert "prometheus-targets.json" in capsys.readouterr().err


class CannedCluster:
    """Each scrape of a target answers its next canned exposition, stamped by a fake clock (plus ``step``
    seconds per scrape, where nothing moves the clock)."""

    def __init__(self, texts: dict[str, list[str]], clock: Clock, step: float = 10.0) -> None:
        self.texts, self.clock, self.step = texts, clock, step
        self.seen: dict[str, int] = {}

    def scrape(self, target: Target, timeout: float = 0.0):
        i = self.seen.get(target.address, 0)
        self.seen[target.address] = i + 1
        if target.address not in self.texts:
            return None, "ConnectionRefusedError: gone"
        return parse(self.texts[target.address][i], at=self.clock.t + i * self.step), None


def two_windows() -> dict[str, list[str]]:
    ttft, tpot = [0, 0, 0, 0], [0, 0, 0, 0]
    return {
        "127.0.0.1:9400": [router_text(prompt=p, cached=0, placed=n, refused=0, waiting=0, ttft=t, tpot=u)
                           for p, n, t, u in ((0, 0, ttft, tpot), (20_000, 10, [10, 10, 10, 10], [10] * 4),
                                              (420_000, 110, [10, 40, 60, 60], [10, 60, 60, 60]))],
        "127.0.0.1:9401": [worker_text("prefill", "prefill-1", prompt=p, generated=0, queue=q, running=1)
                           for p, q in ((0, 0), (20_000, 0), (180_000, 60))],
        "127.0.0.1:9402": [worker_text("decode", "decode-2", prompt=0, generated=g, queue=0, running=2,
                                       free=900, total=1000) for g in (0, 1_000, 2_000)]}


def targets_file(run_dir) -> None:
    groups = [{"targets": [a], "labels": {"pdserve_role": role, "pdserve_process": name}}
              for a, role, name in (("127.0.0.1:9400", "router", "router"),
                                    ("127.0.0.1:9401", "prefill", "prefill-1"),
                                    ("127.0.0.1:9402", "decode", "decode-2"))]
    (run_dir / "prometheus-targets.json").write_text(json.dumps(groups))


def test_the_loop_turns_scrapes_into_decisions_and_metrics():
    clock = Clock(1000.0)
    cluster = CannedCluster(two_windows(), clock, step=0.0)  # the loop's sleeps move the clock
    targets = [Target("127.0.0.1:9400", "router", "router"), Target("127.0.0.1:9401", "prefill", "p"),
               Target("127.0.0.1:9402", "decode", "d"), Target("127.0.0.1:9499", "decode", "gone")]
    source = SignalSource(lambda: targets, scrape_fn=cluster.scrape)
    planner = Planner(PlannerConfig(), clock=clock)
    metrics = planner_registry()
    seen: list = []

    def on_window(s, d) -> None:
        metrics.record(d)
        seen.append((s, d))

    def sleep(seconds: float) -> None:
        clock.t += seconds

    try:
        assert run(source, planner, interval=10.0, on_window=on_window, windows=2, sleep=sleep) == 2
    finally:
        source.close()
    (s1, d1), (s2, d2) = seen
    assert (s1.prompt_tokens, s1.prefill_computed_tokens, s1.output_tokens) == (20_000, 20_000, 1_000)
    assert s1.decode_replicas == 1  # the target that did not answer is no replica
    assert d1.targets() == {"prefill": 1, "decode": 1}
    # 40k prompt tokens/s arrive and 60 prompts of 4,000 tokens wait: up at once, TTFT not yet broken
    assert s2.backlog_prompt_tokens == 60 * 4_000 and s2.ttft_p90_s < 2.0
    assert d2.pool("prefill").direction == "up" and d2.pool("prefill").target == 5
    text = generate_latest(metrics.registry).decode()
    assert 'pdserve_planner_target_replicas{pool="prefill"} 5.0' in text
    assert 'pdserve_planner_decisions_total{direction="up",pool="prefill"} 1.0' in text
    assert 'pdserve_planner_decisions_total{direction="hold",pool="decode"} 2.0' in text
    assert 'pdserve_planner_demand_tokens_per_second{pool="prefill"} 40000.0' in text
    assert 'pdserve_planner_capacity_tokens_per_second{pool="decode"} 800.0' in text
    assert "pdserve_planner_required_replicas" in text


def test_run_dry_run_prints_records_and_replays(tmp_path, capsys, monkeypatch):
    clock = Clock(0.0)
    cluster = CannedCluster(two_windows(), clock)
    monkeypatch.setattr(live, "scrape", lambda target, timeout: cluster.scrape(target))
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    targets_file(tmp_path)
    record = tmp_path / "rec.jsonl"
    rc = main(["planner", "run", "--run-dir", str(tmp_path), "--dry-run", "--windows", "2", "--json",
               "--record", str(record)])
    captured = capsys.readouterr()
    assert rc == 0 and "nothing is scaled" in captured.err
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert [x["dry_run"] for x in lines] == [True, True]
    assert lines[1]["decision"]["targets"] == {"prefill": 5, "decode": 1}
    assert main(["planner", "explain", "--trace", str(record), "--changes"]) == 0
    out = capsys.readouterr().out
    assert "up 1 -> 5" in out and "2 windows" in out


def test_run_dry_run_prints_a_line_per_pool(tmp_path, capsys, monkeypatch):
    clock = Clock(0.0)
    cluster = CannedCluster(two_windows(), clock)
    monkeypatch.setattr(live, "scrape", lambda target, timeout: cluster.scrape(target))
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    targets_file(tmp_path)
    assert main(["planner", "run", "--run-dir", str(tmp_path), "--dry-run", "--windows", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and all("[dry run]" in line for line in out)
    assert "prefill up 1 -> 5" in out[2] and "decode  hold at 1" in out[3]


@pytest.mark.parametrize("argv", [["--interval", "0"], ["--windows", "0"]])
def test_run_refuses_bad_timing(tmp_path, capsys, argv):
    assert main(["planner", "run", "--run-dir", str(tmp_path), "--dry-run", *argv]) == 2
    assert "--interval must be > 0" in capsys.readouterr().err
