"""The planner's policy, on a fake clock, against recorded and simulated traces of windows.

The four behaviours issue 48 asks to show: a shift from short to long prompts moves the prefill:decode
ratio toward prefill and back; a burst with a backlog scales up before TTFT breaks (and a backlog counts
where the rate alone would not); a square-wave load does not oscillate (at most one change per
cool-down); an idle cluster goes to the minimums. ``FakeCluster`` is a closed loop: each window it
serves the load with the replicas the planner last asked for, at true per-worker capacities equal to the
model's seed, and reports the ``Signals`` the metrics would show.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from pdserve.app.planner.capacity import CapacityModel, Seed
from pdserve.app.planner.policy import Decision, Planner, PlannerConfig
from pdserve.app.planner.signals import Signals
from tests.unit.fake_clock import Clock

WINDOW = 10.0
PREFILL_CAP, DECODE_CAP, SEQS_CAP = 8000.0, 1000.0, 64.0  # per worker: tokens/s, tokens/s, sequences
CONFIG = PlannerConfig(ttft_s=2.0, tpot_s=0.025, min_prefill=1, max_prefill=8, min_decode=1, max_decode=8)


@dataclass(frozen=True)
class Load:
    rate: float  # requests per second
    prompt: float  # tokens per prompt
    output: float  # tokens per answer


IDLE = Load(0.0, 0.0, 0.0)


class FakeCluster:
    """Prefill: arrivals join a backlog that the pool computes at ``PREFILL_CAP`` per worker; TTFT p90 is
    a prompt's compute plus the backlog's wait. Decode: each sequence lives ``output x TPOT``; beyond what
    the pool holds, sequences wait and TPOT stretches with the overload. Replicas follow the planner's
    targets from the next window on (``apply``)."""

    def __init__(self, *, prefill: int, decode: int, blocks_per_worker: float = 32768.0) -> None:
        self.prefill, self.decode, self.blocks = prefill, decode, blocks_per_worker
        self.t, self.backlog = 0.0, 0.0

    def step(self, load: Load) -> Signals:
        self.t += WINDOW
        requests = load.rate * WINDOW
        arrived = requests * load.prompt
        capacity = self.prefill * PREFILL_CAP * WINDOW
        computed = min(self.backlog + arrived, capacity)
        self.backlog = self.backlog + arrived - computed
        ttft = load.prompt / PREFILL_CAP + self.backlog / (self.prefill * PREFILL_CAP) if requests else None
        tokens_per_s = load.rate * load.output
        over = max(tokens_per_s / (self.decode * DECODE_CAP), 1.0)
        alive = tokens_per_s * CONFIG.tpot_s * over
        running = min(alive, self.decode * SEQS_CAP)
        return Signals(at=self.t, window_s=WINDOW, prompt_tokens=arrived, requests=requests,
                       prefill_computed_tokens=computed,
                       output_tokens=min(tokens_per_s, self.decode * DECODE_CAP) * WINDOW,
                       backlog_prompt_tokens=self.backlog,
                       prefill_waiting=self.backlog / load.prompt if load.prompt else 0.0,
                       decode_running=running, decode_waiting=alive - running,
                       kv_blocks_used=running * (load.prompt + load.output) / 16,
                       kv_blocks_total=self.decode * self.blocks, ttft_p90_s=ttft,
                       tpot_p90_s=CONFIG.tpot_s * (0.8 if over == 1.0 else over) if requests else None,
                       prefill_replicas=self.prefill, decode_replicas=self.decode)

    def apply(self, d: Decision) -> None:
        self.prefill, self.decode = d.pool("prefill").target, d.pool("decode").target


def planner(config: PlannerConfig = CONFIG) -> tuple[Planner, Clock]:
    clock = Clock(0.0)
    seed = Seed(prefill_tokens_per_s=PREFILL_CAP, decode_tokens_per_s=DECODE_CAP, decode_sequences=SEQS_CAP)
    return Planner(config, CapacityModel(seed=seed), clock=clock), clock


def simulate(cluster: FakeCluster, schedule: list[tuple[float, Load]], config: PlannerConfig = CONFIG):
    """Run ``schedule`` (seconds of each load, in order) a window at a time; the windows and decisions."""
    p, clock = planner(config)
    out: list[tuple[Signals, Decision]] = []
    for seconds, load in schedule:
        for _ in range(round(seconds / WINDOW)):
            s = cluster.step(load)
            clock.t = s.at
            d = p.observe(s)
            cluster.apply(d)
            out.append((s, d))
    return out


def replay(trace: list[Signals], config: PlannerConfig = CONFIG) -> list[Decision]:
    p, clock = planner(config)
    decisions = []
    for s in trace:
        clock.t = s.at
        decisions.append(p.observe(s))
    return decisions


def changes(run, pool: str) -> list[tuple[float, str, int, int]]:
    return [(d.at, d.pool(pool).direction, d.pool(pool).current, d.pool(pool).target)
            for _, d in run if d.pool(pool).direction != "hold"]


def assert_cooldowns_kept(run, config: PlannerConfig = CONFIG) -> None:
    """No two changes of one pool within its cool-down: an up at least ``up_cooldown_s`` after the
    previous change, a down at least ``down_cooldown_s`` after it."""
    for pool in ("prefill", "decode"):
        moves = changes(run, pool)
        for (t0, _, _, _), (t1, direction, _, _) in zip(moves, moves[1:], strict=False):
            gap = config.up_cooldown_s if direction == "up" else config.down_cooldown_s
            assert t1 - t0 >= gap, (pool, moves)


# --- the four behaviours ---------------------------------------------------------------------------


def test_short_to_long_prompts_moves_the_ratio_toward_prefill_and_back():
    short, long = Load(4.0, 500.0, 400.0), Load(4.0, 6000.0, 400.0)
    run = simulate(FakeCluster(prefill=1, decode=2), [(600, short), (900, long), (2400, short)])
    ratio = [d.pool("prefill").target / d.pool("decode").target for _, d in run]
    assert ratio[59] == 0.5  # short prompts: 1 prefill to 2 decode
    first_long = run[60][1].pool("prefill")
    assert first_long.direction == "up" and first_long.target >= 4  # at the first long window
    assert "backlog" in first_long.reason and "prompt tokens/s" in first_long.reason
    assert max(ratio[60:150]) >= 2.0
    assert ratio[-1] == 0.5  # and back, one drained step per down cool-down
    downs = [c for c in changes(run, "prefill") if c[1] == "down"]
    assert len(downs) == first_long.target - 1 and all(cur - tgt == 1 for _, _, cur, tgt in downs)
    assert changes(run, "decode") == []  # the decode load never moved
    assert_cooldowns_kept(run)


def test_a_burst_with_a_backlog_scales_up_before_ttft_breaks():
    steady, burst = Load(6.0, 2000.0, 100.0), Load(9.0, 2000.0, 100.0)
    run = simulate(FakeCluster(prefill=2, decode=1), [(300, steady), (300, burst), (300, steady)])
    assert changes(run[:30], "prefill") == []  # 12k of 16k tokens/s: inside the band at 2
    s, d = run[30]  # the burst's first window: 18k tokens/s arrive, 20k tokens wait
    assert s.backlog_prompt_tokens > 0 and s.ttft_p90_s < CONFIG.ttft_s  # not broken yet
    up = d.pool("prefill")
    assert up.direction == "up" and up.target >= 4 and up.inputs["backlog_tokens"] == s.backlog_prompt_tokens
    assert max(s.ttft_p90_s for s, _ in run if s.ttft_p90_s is not None) < CONFIG.ttft_s  # never broke
    assert_cooldowns_kept(run)


def test_a_backlog_counts_where_the_rate_alone_would_not():
    """A recorded window: 13k prompt tokens/s (inside the band of 2 workers) while 20 long prompts landed
    at once and wait; TTFT p90 still 1.2 s. The same window without the queue holds."""
    calm = [Signals(at=10.0 * i, window_s=10.0, prompt_tokens=130_000, requests=65,
                    prefill_computed_tokens=130_000, output_tokens=6_500, decode_running=2,
                    ttft_p90_s=0.4, tpot_p90_s=0.02, prefill_replicas=2, decode_replicas=1)
            for i in range(1, 7)]
    queued = Signals(**{**calm[-1].to_dict(), "at": 70.0, "backlog_prompt_tokens": 40_000.0,
                        "prefill_waiting": 20.0, "ttft_p90_s": 1.2})
    with_queue = replay([*calm, queued])[-1].pool("prefill")
    assert with_queue.direction == "up" and with_queue.target == 6  # (13k + 40k / 2 s) / 6.4k = 5.2
    assert with_queue.inputs["backlog_tokens_per_s"] == 20_000
    no_queue = Signals(**{**queued.to_dict(), "backlog_prompt_tokens": 0.0, "prefill_waiting": 0.0})
    assert replay([*calm, no_queue])[-1].pool("prefill").direction == "hold"


def test_a_square_wave_shorter_than_the_cooldown_does_not_oscillate():
    high, low = Load(12.0, 2000.0, 300.0), Load(4.0, 2000.0, 300.0)
    run = simulate(FakeCluster(prefill=2, decode=2), [(60, high), (60, low)] * 30)  # an hour
    for pool in ("prefill", "decode"):
        moves = changes(run, pool)
        assert moves and moves[0][1] == "up"  # the first high half-period scales up ...
        assert all(t <= 900 for t, *_ in moves), moves  # ... it settles, and never moves again
        assert len(moves) <= 3 and [m[1] for m in moves] != ["up", "down", "up"]
    assert_cooldowns_kept(run)
    assert run[-1][1].pool("prefill").target >= 4  # sized for the high half, not flapping


def test_a_slow_square_wave_moves_at_most_once_per_cooldown():
    high, low = Load(12.0, 2000.0, 300.0), Load(3.0, 2000.0, 300.0)
    run = simulate(FakeCluster(prefill=2, decode=2), [(1800, high), (1800, low)] * 3)  # 3 hours
    directions = [m[1] for m in changes(run, "prefill")]
    assert "up" in directions and "down" in directions  # it does follow a slow wave
    assert_cooldowns_kept(run)


def test_idle_goes_to_the_minimums_after_the_cooldown():
    busy = Load(12.0, 2000.0, 250.0)
    run = simulate(FakeCluster(prefill=4, decode=4), [(600, busy), (1200, IDLE)])
    assert [d.targets() for _, d in run[:60]] == [{"prefill": 4, "decode": 4}] * 60
    first_idle = run[60][1].at
    for pool in ("prefill", "decode"):
        moves = changes(run, pool)
        assert moves == [(first_idle + CONFIG.down_cooldown_s, "down", 4, 1)]  # straight to the minimum
    moved = next(d for _, d in run if d.changed()).pool("prefill")
    assert moved.reason.startswith("down 4 -> 1: idle for 300 s")
    waiting = run[61][1].pool("decode")
    assert waiting.direction == "hold" and "to the minimum 1 after 300 s" in waiting.reason


# --- the rules around them -------------------------------------------------------------------------


def test_up_waits_for_its_cooldown_and_stays_within_the_step_and_the_maximum():
    config = PlannerConfig(max_prefill=6, max_step_up=2, up_cooldown_s=60.0)
    base = dict(window_s=10.0, requests=100, output_tokens=1000, decode_running=1, prefill_replicas=1,
                decode_replicas=1)
    trace = [Signals(at=10.0 * i, prompt_tokens=1_000_000, **base) for i in range(1, 20)]  # 100k tokens/s
    decisions = replay(trace, config)
    ups = [(d.at, d.pool("prefill").current, d.pool("prefill").target) for d in decisions
           if d.pool("prefill").direction == "up"]
    assert ups == [(10.0, 1, 3), (70.0, 3, 5), (130.0, 5, 6)]  # step 2, cool-down 60 s, maximum 6
    held = decisions[1].pool("prefill")
    assert held.direction == "hold" and "up cool-down 60 s" in held.reason
    assert "at the maximum 6" in decisions[-1].pool("prefill").reason


def test_a_pool_outside_its_bounds_moves_at_once():
    config = PlannerConfig(min_prefill=2, max_decode=3)
    d = replay([Signals(at=1.0, window_s=1.0, prefill_replicas=0, decode_replicas=5)], config)[0]
    assert d.targets() == {"prefill": 2, "decode": 3}
    assert "outside [2, 8]" in d.pool("prefill").reason and d.pool("decode").direction == "down"


def test_decode_needs_the_largest_of_tokens_sequences_and_kv():
    s = Signals(at=10.0, window_s=10.0, output_tokens=4_000, decode_running=100, decode_waiting=30,
                kv_blocks_used=10_000, kv_blocks_total=8_192, prefill_replicas=1, decode_replicas=2)
    d = replay([s])[0].pool("decode")
    # tokens 400 / 800 = 0.5; sequences 130 / 51.2 = 2.54; KV 10,000 / (4,096 x 0.8) = 3.05
    assert d.inputs["binding"] == "KV blocks" and d.required == pytest.approx(10_000 / (4096 * 0.8))
    assert d.inputs["required_by_sequences"] == pytest.approx(130 / (64 * 0.8))
    assert d.target == 4 and "KV blocks used" in d.reason


def test_demand_takes_a_burst_at_once_and_lets_a_lull_fade():
    config = PlannerConfig(demand_half_life_s=60.0)
    trace = [Signals(at=60.0 * i, window_s=60.0, prompt_tokens=(6000 if i == 2 else 600) * 60.0,
                     requests=60, prefill_replicas=1, decode_replicas=1) for i in range(1, 4)]
    d = [x.pool("prefill").inputs for x in replay(trace, config)]
    assert d[1]["demand_tokens_per_s"] == 6000  # the window itself, above the mean
    assert d[2]["demand_tokens_per_s"] == pytest.approx(600 + (3300 - 600) / 2)  # mean 3,300 halves back


def test_decisions_log_as_json_with_their_inputs():
    run = simulate(FakeCluster(prefill=1, decode=1), [(30, Load(4.0, 500.0, 100.0))])
    d = run[-1][1].to_dict()
    again = json.loads(json.dumps(d))
    assert again["targets"] == {"prefill": 1, "decode": 1}
    assert {"demand_tokens_per_s", "backlog_tokens", "capacity_tokens_per_s", "ttft_p90_s", "up_above",
            "observed_replicas"} <= set(again["prefill"]["inputs"])
    assert again["decode"]["direction"] == "hold" and again["decode"]["reason"].startswith("hold at 1")


@pytest.mark.parametrize("kw, match", [
    ({"ttft_s": 0.0}, "ttft_s"), ({"tpot_s": float("nan")}, "tpot_s"),
    ({"min_prefill": 3, "max_prefill": 2}, "prefill: need whole numbers"),
    ({"min_decode": -1}, "decode: need whole numbers"), ({"max_decode": 0, "min_decode": 0}, "max >= 1"),
    ({"min_prefill": 1.5}, "prefill"), ({"utilisation": 1.2}, "utilisation"), ({"band": 1.0}, "band"),
    ({"up_cooldown_s": 600.0}, "0 <= up <= down"), ({"down_cooldown_s": float("inf")}, "finite"),
    ({"drain_horizon_s": 0.0}, "drain_horizon_s"), ({"max_step_down": 0}, "step limits"),
    ({"demand_half_life_s": -1.0}, "demand_half_life_s")])
def test_config_is_validated(kw, match):
    with pytest.raises(ValueError, match=match):
        PlannerConfig(**kw)


def test_the_drain_horizon_defaults_to_the_ttft_target():
    assert PlannerConfig(ttft_s=1.5).drain_horizon == 1.5
    assert PlannerConfig(ttft_s=1.5, drain_horizon_s=4.0).drain_horizon == 4.0
