"""The planner's window of signals: built from two literal Prometheus scrapes of a router, a prefill and a
decode worker; from the real registries' exposition (the names stay those the code exports); recorded
traces as JSON lines."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from pdserve.app.planner.signals import Signals, from_scrapes, load_trace
from pdserve.app.top.stats import parse

TTFT = "pdserve_router_time_to_first_token_seconds"
TPOT = "pdserve_router_time_per_output_token_seconds"


def hist(name: str, bounds: list[str], counts: list[int], labels: str) -> str:
    lines = [f"# TYPE {name} histogram"]
    lines += [f'{name}_bucket{{{labels},le="{b}"}} {n}' for b, n in zip(bounds, counts, strict=True)]
    lines.append(f"{name}_count{{{labels}}} {counts[-1]}")
    return "\n".join(lines)


def router_text(*, prompt: int, cached: int, placed: int, refused: int, waiting: int, ttft: list[int],
                tpot: list[int]) -> str:
    return "\n".join([
        "# TYPE pdserve_router_prompt_tokens counter", f"pdserve_router_prompt_tokens_total {prompt}",
        "# TYPE pdserve_router_cache_hit_tokens counter",
        f'pdserve_router_cache_hit_tokens_total{{pool="prefill"}} {cached}',
        'pdserve_router_cache_hit_tokens_total{pool="decode"} 999999',  # decode-side hits: not prefill's
        "# TYPE pdserve_router_placements counter",
        f'pdserve_router_placements_total{{policy="prefix",pool="decode",worker="d0"}} {placed}',
        f'pdserve_router_placements_total{{policy="prefix",pool="prefill",worker="p0"}} {placed}',
        "# TYPE pdserve_router_admission_refused counter",
        f'pdserve_router_admission_refused_total{{reason="wait"}} {refused}',
        "# TYPE pdserve_router_allocate_queue_waiting gauge",
        f"pdserve_router_allocate_queue_waiting {waiting}",
        hist(TTFT, ["0.5", "1.0", "2.0", "+Inf"], ttft, 'mode="remote",transport="tcp"'),
        hist(TPOT, ["0.01", "0.02", "0.05", "+Inf"], tpot, 'mode="remote"'), ""])


def worker_text(role: str, name: str, *, prompt: int, generated: int, queue: int, running: int,
                free: int = 0, total: int = 0) -> str:
    lab = f'role="{role}",worker="{name}"'
    return "\n".join([
        "# TYPE pdserve_worker_prompt_tokens counter",
        f"pdserve_worker_prompt_tokens_total{{{lab}}} {prompt}",
        "# TYPE pdserve_worker_generated_tokens counter",
        f"pdserve_worker_generated_tokens_total{{{lab}}} {generated}",
        "# TYPE pdserve_worker_queue_depth gauge", f"pdserve_worker_queue_depth{{{lab}}} {queue}",
        "# TYPE pdserve_worker_running gauge", f"pdserve_worker_running{{{lab}}} {running}",
        "# TYPE pdserve_worker_free_blocks gauge", f"pdserve_worker_free_blocks{{{lab}}} {free}",
        "# TYPE pdserve_worker_total_blocks gauge", f"pdserve_worker_total_blocks{{{lab}}} {total}", ""])


def test_a_window_from_two_literal_scrapes():
    prev = {"r:1": parse(router_text(prompt=10_000, cached=1_000, placed=20, refused=1, waiting=0,
                                     ttft=[5, 5, 5, 5], tpot=[10, 10, 10, 10]), at=100.0),
            "p:1": parse(worker_text("prefill", "prefill-1", prompt=9_000, generated=20, queue=0, running=1),
                         at=100.1),
            "d:1": parse(worker_text("decode", "decode-2", prompt=0, generated=5_000, queue=0, running=3,
                                     free=900, total=1000), at=100.1)}
    # 10 s later: 40 requests placed with 50,000 prompt tokens (5,000 of them prefix hits); 3 refused;
    # 30 new TTFTs: 10 under 0.5 s, 10 in (0.5, 1], 10 in (1, 2]; 20 new TPOTs, all in (0.01, 0.02]
    cur = {"r:1": parse(router_text(prompt=60_000, cached=6_000, placed=60, refused=4, waiting=2,
                                    ttft=[15, 25, 35, 35], tpot=[10, 30, 30, 30]), at=110.0),
           "p:1": parse(worker_text("prefill", "prefill-1", prompt=49_000, generated=60, queue=4, running=1),
                        at=110.1),
           "d:1": parse(worker_text("decode", "decode-2", prompt=0, generated=9_000, queue=1, running=7,
                                    free=600, total=1000), at=110.1)}
    s = from_scrapes(prev, cur)
    assert s.at == 110.1 and s.window_s == pytest.approx(10.0)  # the router's interval
    assert (s.prompt_tokens, s.cached_prompt_tokens, s.requests, s.refused_requests) == (50_000, 5_000, 40, 3)
    # the prefill worker's first tokens are not the decode pool's output
    assert s.prefill_computed_tokens == 40_000 and s.output_tokens == 4_000
    assert s.prefill_waiting == 4 and s.backlog_prompt_tokens == pytest.approx(4 * 50_000 / 40)
    assert s.decode_running == 7 and s.decode_waiting == 1 + 2  # the decode queue and the router's Allocates
    assert (s.kv_blocks_used, s.kv_blocks_total) == (400, 1000)
    assert s.ttft_p90_s == pytest.approx(1.0 + 1.0 * 7 / 10)  # rank 27 of 30: 7th of 10 in (1, 2]
    assert s.tpot_p90_s == pytest.approx(0.01 + 0.01 * 18 / 20)
    assert (s.prefill_replicas, s.decode_replicas) == (1, 1)
    assert Signals.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_new_targets_count_as_replicas_not_as_work_and_resets_count_from_zero():
    prev = {"r:1": parse(router_text(prompt=500, cached=0, placed=5, refused=0, waiting=0, ttft=[5] * 4,
                                     tpot=[5] * 4), at=0.0),
            "d:1": parse(worker_text("decode", "d1", prompt=0, generated=10_000, queue=0, running=1,
                                     free=10, total=10), at=0.0)}
    cur = {"r:1": parse(router_text(prompt=700, cached=0, placed=7, refused=0, waiting=0, ttft=[5] * 4,
                                    tpot=[5] * 4), at=5.0),
           # d1 restarted: its counter went down, the new value is the window's work
           "d:1": parse(worker_text("decode", "d1", prompt=0, generated=300, queue=0, running=1,
                                    free=10, total=10), at=5.0),
           # d2 just started: a replica, but its tokens since start are not this window's
           "d:2": parse(worker_text("decode", "d2", prompt=0, generated=50_000, queue=0, running=2,
                                    free=10, total=10), at=5.0)}
    s = from_scrapes(prev, cur, roles={"d:2": "decode"})
    assert s.output_tokens == 300 and s.decode_replicas == 2 and s.decode_running == 3
    assert s.ttft_p90_s is None and s.tpot_p90_s is None  # no request ended in the window
    with pytest.raises(ValueError, match="scraped twice"):
        from_scrapes({}, cur)


def test_the_real_registries_exposition_reads_back():
    """The names come from router/metrics.py and pdserve/app/worker_metrics.py, not from this file."""
    from pdserve.app.worker_metrics import worker_registry
    from router.metrics import RouterMetrics
    from router.shedding import _Metrics

    router = RouterMetrics()
    shed = _Metrics(router.registry)
    stats = SimpleNamespace(steps=0, steps_ahead=0, prompt_tokens=0, generated_tokens=0, preemptions=0,
                            finish_reasons={})
    snap = SimpleNamespace(free_blocks=100, total_blocks=100, num_running=0, queue_depth=0)
    prefill = worker_registry(role="prefill", worker_id="p0", engine=SimpleNamespace(stats=stats),
                              aengine=SimpleNamespace(snapshot=snap))
    dstats = SimpleNamespace(**{**vars(stats)})
    dsnap = SimpleNamespace(free_blocks=80, total_blocks=100, num_running=2, queue_depth=1)
    decode = worker_registry(role="decode", worker_id="d0", engine=SimpleNamespace(stats=dstats),
                             aengine=SimpleNamespace(snapshot=dsnap))

    def scrapes(at: float) -> dict:
        return {a: parse(generate_latest(r).decode(), at=at)
                for a, r in (("r", router.registry), ("p", prefill), ("d", decode))}

    before = scrapes(0.0)
    for _ in range(4):
        router.placed("prefix", "decode", "d0").inc()
        router.prompt_tokens.inc(250)
        router.latency.ttft.labels("remote", "tcp").observe(0.3)
        router.latency.tpot.labels("remote").observe(0.012)
    router.cache_hit_tokens.labels(pool="prefill").inc(100)
    shed.refused.labels(reason="wait").inc()
    shed.waiting.set(1)
    stats.prompt_tokens, dstats.generated_tokens = 900, 640
    snap.queue_depth = 2
    s = from_scrapes(before, scrapes(4.0))
    assert (s.prompt_tokens, s.cached_prompt_tokens, s.requests, s.refused_requests) == (1000, 100, 4, 1)
    assert (s.prefill_computed_tokens, s.output_tokens, s.prefill_waiting) == (900, 640, 2)
    assert s.backlog_prompt_tokens == 2 * 250 and s.decode_waiting == 1 + 1 and s.decode_running == 2
    assert (s.kv_blocks_used, s.kv_blocks_total) == (20, 100)
    assert 0.25 < s.ttft_p90_s <= 0.3 and 0.01 < s.tpot_p90_s <= 0.0125
    assert (s.prefill_replicas, s.decode_replicas, s.window_s) == (1, 1, 4.0)


def test_signals_refuse_nonsense():
    with pytest.raises(ValueError, match="length > 0"):
        Signals(at=1.0, window_s=0.0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        Signals(at=1.0, window_s=1.0, prompt_tokens=-5)
    with pytest.raises(ValueError, match="whole number"):
        Signals(at=1.0, window_s=1.0, decode_replicas=1.5)
    with pytest.raises(ValueError, match="unknown signal fields \\['prompt_tokenz'\\]"):
        Signals.from_dict({"at": 1.0, "window_s": 1.0, "prompt_tokenz": 3})


def test_a_trace_is_json_lines_in_time_order(tmp_path):
    rows = [Signals(at=10.0 * i, window_s=10.0, prompt_tokens=100.0 * i, prefill_replicas=1,
                    decode_replicas=1) for i in range(1, 4)]
    path = tmp_path / "trace.jsonl"
    path.write_text("# recorded by a test\n" + "\n".join(json.dumps(r.to_dict()) for r in rows) + "\n\n")
    assert load_trace(path) == rows
    path.write_text(json.dumps(rows[1].to_dict()) + "\n" + json.dumps(rows[0].to_dict()) + "\n")
    with pytest.raises(ValueError, match=":2: windows must go forward"):
        load_trace(path)
    path.write_text('{"at": 1, "window_s": 1}\n{"at": 2}\n')
    with pytest.raises(ValueError, match=":2: a window needs"):
        load_trace(path)
