"""The planner's local actuator (``pdserve/app/planner/actuator.py``) against a fake cluster on a fake clock:
it applies changed targets only, through ``scale(pool, n)``; never within the planner's cool-down of its
last change of that pool (counted from when the change ended); hands what it did not apply back to the
planner; does nothing in dry-run; logs each action with its decision. Then ``pdserve up --autoscale``'s
wiring (``--planner-args`` read by ``planner run``'s own parser) over canned scrapes."""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time

import pytest

from pdserve.app.cli import build_parser
from pdserve.app.commands import up
from pdserve.app.planner import live
from pdserve.app.planner.actuator import APPLIED, COOL_DOWN, DRY_RUN, FAILED, Actuator, Autoscaler
from pdserve.app.planner.policy import Decision, Planner, PlannerConfig, PoolDecision
from tests.unit.fake_clock import Clock
from tests.unit.test_planner import IDLE, WINDOW, FakeCluster, Load, assert_cooldowns_kept, planner
from tests.unit.test_planner_cli import CannedCluster, targets_file, two_windows

CONFIG = PlannerConfig(min_prefill=1, max_prefill=4, min_decode=1, max_decode=4, up_cooldown_s=60.0,
                       down_cooldown_s=300.0)


class ScalableCluster:
    """What the actuator sees of ``launcher.cluster.Cluster``: ``workers`` per pool and ``scale(pool, n)``,
    which records the call and takes ``delay`` seconds of the clock (starting or draining workers)."""

    def __init__(self, clock: Clock, *, prefill: int = 1, decode: int = 1, delay: float = 0.0,
                 fail: int = 0) -> None:
        self.clock, self.delay, self.fail = clock, delay, fail
        self.workers: dict[str, list] = {"prefill": [object()] * prefill, "decode": [object()] * decode}
        self.calls: list[tuple[str, int, float, float]] = []  # pool, n, started, finished

    def scale(self, role: str, n: int) -> None:
        start = self.clock.t
        self.clock.t += self.delay
        if self.fail:
            self.fail -= 1
            raise TimeoutError("router sees [], expected ['127.0.0.1:1']")
        self.workers[role] = [object()] * n
        self.calls.append((role, n, start, self.clock.t))


def decision(at: float, **pools: tuple[int, int]) -> Decision:
    """A decision by hand: ``prefill=(current, target)``; the pools not named hold at 1."""
    out = []
    for pool in ("prefill", "decode"):
        cur, target = pools.get(pool, (1, 1))
        direction = "up" if target > cur else "down" if target < cur else "hold"
        word = f"{direction} {cur} -> {target}" if direction != "hold" else f"hold at {cur}"
        out.append(PoolDecision(pool=pool, current=cur, target=target, required=float(target),
                                direction=direction, reason=f"{word}: needs {target:.2f}",
                                inputs={"demand_tokens_per_s": 123.0}))
    return Decision(at=at, pools=tuple(out))


def actuator(config: PlannerConfig = CONFIG, **cluster_kw) -> tuple[Actuator, ScalableCluster, Clock]:
    clock = Clock(0.0)
    cluster = ScalableCluster(clock, **cluster_kw)
    return Actuator(cluster, Planner(config, clock=clock), clock=clock), cluster, clock


def test_applies_changed_targets_only_through_scale():
    act, cluster, clock = actuator()
    assert act.apply(decision(0.0)) == [] and cluster.calls == []  # both hold
    actions = act.apply(decision(0.0, prefill=(1, 3)))
    assert [(a.pool, a.before, a.target, a.outcome) for a in actions] == [("prefill", 1, 3, APPLIED)]
    assert cluster.calls == [("prefill", 3, 0.0, 0.0)] and len(cluster.workers["prefill"]) == 3
    clock.t = 400.0
    act.apply(decision(400.0, prefill=(3, 2), decode=(1, 2)))  # a drained step down, and decode up
    assert cluster.calls[1:] == [("prefill", 2, 400.0, 400.0), ("decode", 2, 400.0, 400.0)]
    # a target the pool already has (resized meanwhile) is no call
    assert act.apply(decision(800.0, prefill=(1, 2))) == [] and len(cluster.calls) == 3


def test_never_within_the_cool_down_of_the_last_change():
    act, cluster, clock = actuator(delay=45.0)  # every scale takes 45 s
    act.apply(decision(0.0, prefill=(1, 2)))
    assert cluster.calls == [("prefill", 2, 0.0, 45.0)]
    assert act.planner._state["prefill"].changed_at == 45.0  # the planner's cool-downs count from the end
    # the planner's up cool-down (60 s) has passed since its decision, but not since the scale ended
    clock.t = 61.0
    (held,) = act.apply(decision(61.0, prefill=(2, 3)))
    assert held.outcome == COOL_DOWN and "16 s since the last change of prefill ended" in held.error
    assert len(cluster.calls) == 1 and act.planner._state["prefill"].target == 2  # handed back
    clock.t = 105.0  # 60 s after the scale ended
    (done,) = act.apply(decision(105.0, prefill=(2, 3)))
    assert done.outcome == APPLIED and cluster.calls[-1] == ("prefill", 3, 105.0, 150.0)
    clock.t = 400.0  # a step down waits for the down cool-down (300 s) from the end of the last change
    assert act.apply(decision(400.0, prefill=(3, 2)))[0].outcome == COOL_DOWN
    clock.t = 450.0
    assert act.apply(decision(450.0, prefill=(3, 2)))[0].outcome == APPLIED
    # the other pool has cool-downs of its own
    assert act.apply(decision(495.0, decode=(1, 2)))[0].outcome == APPLIED


def test_closed_loop_keeps_every_cool_down():
    """The real planner, a fake cluster that serves the load with the replicas it was scaled to: a shift
    to long prompts and back, then idle; one replica per step; every scale takes 30 s of the clock, and
    the planner's cool-downs count from each scale's end, as the actuator's do."""
    config = PlannerConfig(min_prefill=1, max_prefill=8, min_decode=1, max_decode=8, max_step_up=1)
    p, clock = planner(config)
    sim = FakeCluster(prefill=1, decode=2)
    cluster = ScalableCluster(clock, prefill=1, decode=2, delay=30.0)
    act = Actuator(cluster, p, clock=clock)
    decisions = []
    short, long = Load(4.0, 1000, 200), Load(4.0, 8000, 200)
    for seconds, load in ((120, short), (600, long), (1500, short), (900, IDLE)):
        for _ in range(round(seconds / WINDOW)):
            sim.t = clock.t  # a window starts where the last one (and its scale) ended
            s = sim.step(load)
            clock.t = s.at
            d = p.observe(s)
            decisions.append((s, d))
            act.apply(d, s)
            sim.prefill, sim.decode = (len(cluster.workers[k]) for k in ("prefill", "decode"))
    prefill = [n for pool, n, _, _ in cluster.calls if pool == "prefill"]
    top = prefill.index(max(prefill))  # up a step at a time under the long prompts, down a drained step
    assert prefill[:top + 1] == list(range(2, max(prefill) + 1)) and max(prefill) >= 4, cluster.calls
    assert prefill[top:] == list(range(max(prefill), 0, -1)), cluster.calls
    assert all(a.outcome == APPLIED for a in act.actions)  # the planner waited as long as the actuator
    assert_cooldowns_kept(decisions, config)
    for pool in ("prefill", "decode"):  # and the actuator's own calls, counted from each scale's end
        calls = [c for c in cluster.calls if c[0] == pool]
        for (_, n0, _, end0), (_, n1, start1, _) in zip(calls, calls[1:], strict=False):
            gap = config.up_cooldown_s if n1 > n0 else config.down_cooldown_s
            assert start1 - end0 >= gap, calls
            assert n1 != n0


def test_dry_run_does_nothing():
    clock = Clock(0.0)
    cluster = ScalableCluster(clock)
    p = Planner(CONFIG, clock=clock)
    act = Actuator(cluster, p, dry_run=True, clock=clock)
    (a,) = act.apply(decision(0.0, prefill=(1, 3)))
    assert a.outcome == DRY_RUN and "dry run: not applied" in a.line()
    assert cluster.calls == [] and len(cluster.workers["prefill"]) == 1
    p._state["prefill"].target = 3
    act.apply(decision(10.0, prefill=(3, 3)))  # holds at its own target: nothing handed back either
    assert p._state["prefill"].target == 3 and cluster.calls == []


def test_a_failed_scale_is_handed_back_and_retried_after_the_cool_down():
    act, cluster, clock = actuator(fail=1)
    (a,) = act.apply(decision(0.0, prefill=(1, 3)))
    assert a.outcome == FAILED and "TimeoutError" in a.error and cluster.calls == []
    assert act.planner._state["prefill"].target == 1  # the next window starts from what is there
    clock.t = 10.0
    assert act.apply(decision(10.0, prefill=(1, 3)))[0].outcome == COOL_DOWN
    clock.t = 60.0
    assert act.apply(decision(60.0, prefill=(1, 3)))[0].outcome == APPLIED
    assert len(cluster.workers["prefill"]) == 3


def test_a_pool_resized_by_hand_is_followed():
    act, cluster, clock = actuator()
    cluster.workers["decode"] = [object()] * 3  # `pdserve scale decode 3`
    act.planner._state["decode"].target = 1
    assert act.apply(decision(0.0)) == [] and cluster.calls == []
    assert act.planner._state["decode"].target == 3  # its next decision starts from 3


def test_every_action_is_logged_with_its_decision(caplog):
    act, _, _ = actuator()
    with caplog.at_level(logging.INFO, logger="pdserve.planner"):
        act.apply(decision(0.0, prefill=(1, 2)))
    (record,) = [r for r in caplog.records if "[applied" in r.getMessage()]
    assert record.levelno == logging.INFO
    message = record.getMessage()
    assert "prefill up 1 -> 2: needs 2.00 [applied in 0.0 s]" in message
    logged = json.loads(message[message.index("{"):])
    assert logged["decision"]["reason"] == "up 1 -> 2: needs 2.00"
    assert logged["decision"]["inputs"] == {"demand_tokens_per_s": 123.0}
    assert logged["action"]["outcome"] == APPLIED and logged["action"]["target"] == 2


def test_the_loop_stops_between_windows():
    clock = Clock(0.0)
    polls = []

    class Source:
        def poll(self):
            polls.append(clock.t)
            return None

        def close(self) -> None:
            pass

    stop = threading.Event()

    def sleep(seconds: float) -> None:
        clock.t += seconds
        if len(polls) == 3:
            stop.set()

    assert live.run(Source(), Planner(CONFIG, clock=clock), interval=5.0, on_window=lambda s, d: None,
                    sleep=sleep, stop=stop) == 0
    assert polls == [0.0, 5.0, 10.0]


# --- pdserve up --autoscale ------------------------------------------------------------------------------


def up_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", "--model", "m", "--launcher", "process", *argv])


def test_up_reads_the_planner_flags_with_planner_runs_parser():
    opts = up._planner_options(up_args("--autoscale", "--planner-args",
                                       "--min-prefill 2 --max-prefill 3 --up-cooldown 5 --down-cooldown 9 "
                                       "--interval 2 --ttft-slo-ms 500"))
    c = opts.config
    assert (c.min_prefill, c.max_prefill, c.up_cooldown_s, c.down_cooldown_s, c.ttft_s) == (2, 3, 5, 9, 0.5)
    assert opts.interval == 2 and not opts.dry_run
    assert up._planner_options(up_args("--autoscale", "dry-run")).dry_run
    assert up._planner_options(up_args("--autoscale", "--planner-args", "--dry-run --interval 1")).dry_run


@pytest.mark.parametrize("argv, says", [
    (["--planner-args", "--min-prefill 2"], "needs --autoscale"),
    (["--autoscale", "--colocated", "2"], "colocated"),
    (["--autoscale", "--planner-args", "--bogus 1"], "not `pdserve planner run` flags"),
    (["--autoscale", "--planner-args", "--min-decode 0 --max-decode 2"], "at least one worker"),
    (["--autoscale", "--planner-args", "--up-cooldown 10 --down-cooldown 5"], "cool-downs"),
    (["--autoscale", "--planner-args", "--run-dir /tmp/x --json"], "--run-dir"),
    (["--autoscale", "--planner-args", "--interval 0 --windows 1"], "--interval must be > 0"),
    (["--autoscale", "--planner-args", "--actuator kubernetes --release r"], "acts on the local cluster"),
])
def test_up_refuses_what_the_planner_would_refuse(argv, says, capsys):
    assert up._run(up_args(*argv)) == 2
    assert says in capsys.readouterr().err


def test_up_autoscale_runs_the_planner_run_loop_and_scales(tmp_path, monkeypatch, capsys):
    """``_start_autoscaler``, what ``pdserve up --autoscale`` starts beside ``cluster.serve()``, over the
    canned scrapes of ``test_planner_cli``: the burst window scales the prefill pool 1 -> 5."""
    canned = CannedCluster(two_windows(), Clock(0.0))
    monkeypatch.setattr(live, "scrape", lambda target, timeout: canned.scrape(target))
    targets_file(tmp_path)
    record = tmp_path / "rec.jsonl"
    opts = up._planner_options(up_args("--autoscale", "--planner-args",
                                       f"--interval 0.01 --windows 2 --record {record}"))
    cluster = ScalableCluster(Clock(0.0))
    scaler: Autoscaler = up._start_autoscaler(opts, cluster, tmp_path)
    deadline = time.monotonic() + 30
    while scaler.seen < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert scaler.stop(timeout=30)
    opts.record_file.close()
    assert [c[:2] for c in cluster.calls] == [("prefill", 5)]
    out = capsys.readouterr().out
    assert "autoscale: a window every 0.01 s; prefill 1..8, decode 1..8" in out
    assert "autoscale: prefill up 1 -> 5: needs" in out and "[applied in" in out
    assert len(record.read_text().splitlines()) == 2  # the windows, a trace for `planner explain`

