"""The planner acting on a real CPU cluster: ``pdserve up --autoscale``'s loop (``Autoscaler`` over the
run directory's Prometheus targets, ``Actuator`` calling ``Cluster.scale``) driven in this process against
a ``LocalCluster`` (the process launcher, the tiny model).

A trickle of short prompts runs throughout; long prompts join it for a while. The planner's capacity is
seeded at 3,000 prompt tokens/s per prefill worker. One client of 8-token prompts asks a few hundred a
second, well under the seed, so nothing is learned and the pool holds. Three clients of 400-token prompts
ask ten thousand and more (the tiny model computes them as fast as they come): a window above ~0.84 of the
estimate scales up even after the model's step toward what it saw (required = X / (0.8 x (0.7 seed +
0.3 X)) > 1.1), so a machine several times slower still scales. The prefill pool grows to its maximum
of 2, the new worker serves long prompts, and once they stop the planner drains it back to 1 while the
trickle goes on. Every request sent succeeds. Cool-downs and the interval are seconds; everything else
waits on events with generous deadlines.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from pdserve.app.launcher.local import LocalCluster
from pdserve.app.planner.actuator import APPLIED, Actuator, Autoscaler
from pdserve.app.planner.capacity import CapacityModel, Seed
from pdserve.app.planner.live import SignalSource
from pdserve.app.planner.policy import Planner, PlannerConfig
from pdserve.app.top.scrape import run_dir_targets
from pdserve.client import Client
from pdserve.probe import free_port

pytestmark = pytest.mark.slow

CONFIG = PlannerConfig(min_prefill=1, max_prefill=2, min_decode=1, max_decode=1, up_cooldown_s=1.0,
                       down_cooldown_s=4.0, demand_half_life_s=1.0, drain_horizon_s=2.0)
SEED = Seed(prefill_tokens_per_s=3000.0, source="test: a fraction of the tiny model's")
SHORT, LONG = (8, 4), (400, 2)  # prompt tokens, output tokens


class Load:
    """Client threads sending prompts of random tokens (no prefix shared: every prompt token is computed)
    until stopped; every result and error kept."""

    def __init__(self, router: str) -> None:
        self.router = router
        self.results: list[tuple[str, dict]] = []  # (kind, final info)
        self.errors: list[BaseException] = []
        self.sent = 0
        self._lock = threading.Lock()
        self._threads: list[tuple[threading.Event, threading.Thread]] = []

    def start(self, kind: str, prompt_tokens: int, max_tokens: int) -> threading.Event:
        stop = threading.Event()
        t = threading.Thread(target=self._run, args=(kind, prompt_tokens, max_tokens, stop), daemon=True)
        self._threads.append((stop, t))
        t.start()
        return stop

    def _run(self, kind: str, prompt_tokens: int, max_tokens: int, stop: threading.Event) -> None:
        rng = random.Random(f"{kind}-{len(self._threads)}")
        with Client(self.router, timeout=120) as client:
            while not stop.is_set():
                with self._lock:
                    self.sent += 1
                try:
                    r = client.generate(prompt_ids=[rng.randrange(3, 1000) for _ in range(prompt_tokens)],
                                        max_tokens=max_tokens, ignore_eos=True)
                    assert len(r.token_ids) == max_tokens, r.token_ids
                    with self._lock:
                        self.results.append((kind, r.final))
                except BaseException as exc:  # noqa: BLE001 - collected and asserted on
                    with self._lock:
                        self.errors.append(exc)

    def count(self, kind: str, prefill_worker: str | None = None) -> int:
        with self._lock:
            return sum(1 for k, f in self.results
                       if k == kind and (prefill_worker is None or f["prefill_worker"] == prefill_worker))

    def stop_all(self) -> None:
        for stop, _ in self._threads:
            stop.set()
        for _, t in self._threads:
            t.join(150)


def wait_for(what: str, ok: Callable[[], bool], load: Load, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert not load.errors, load.errors[:3]
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.2)


def test_the_planner_scales_the_prefill_pool_up_and_drains_it_back(make_checkpoint, tmp_path):
    model = make_checkpoint("llama")
    run_dir = tmp_path / "run"
    with LocalCluster(model, run_dir=run_dir, metrics_port=free_port(), zygote=True, drain_timeout=30) as c:
        start_free = c.free_blocks()
        (original,) = [h.worker_id for h in c.cluster.workers["prefill"]]
        planner = Planner(CONFIG, CapacityModel(seed=SEED), clock=time.monotonic)
        source = SignalSource(run_dir_targets(run_dir))  # what `pdserve up --autoscale` reads
        scaler = Autoscaler(Actuator(c.cluster, planner), source, interval=1.0)
        prefill = c.cluster.workers["prefill"]
        load = Load(c.router)
        try:
            scaler.start()
            trickle = load.start("short", *SHORT)
            # short prompts alone need less than one prefill worker: windows pass and the pool holds
            wait_for("3 windows of short prompts", lambda: scaler.seen >= 3 and load.count("short") > 0, load)
            assert len(prefill) == 1 and list(scaler.actions) == []
            assert scaler.last.pool("prefill").direction == "hold"

            long_stops = [load.start("long", *LONG) for _ in range(3)]
            wait_for("the prefill pool grows", lambda: len(prefill) == 2, load)
            (added,) = [h for h in prefill if h.worker_id != original]
            wait_for(f"{added.worker_id} prefills long prompts",
                     lambda: load.count("long", added.worker_id) >= 3, load)
            for stop in long_stops:
                stop.set()

            # the trickle goes on: the pool shrinks by drain while requests flow, and keeps serving
            wait_for("the prefill pool drains back", lambda: len(prefill) == 1, load)
            served = load.count("short")
            wait_for("short prompts after the drain", lambda: load.count("short") >= served + 5, load)
            trickle.set()
        finally:
            load.stop_all()
            assert scaler.stop(timeout=150)

        assert not load.errors, load.errors[:3]
        assert load.sent == len(load.results)  # every request sent succeeded: none lost
        actions = [(a.pool, a.before, a.target, a.outcome) for a in scaler.actions]
        assert actions == [("prefill", 1, 2, APPLIED), ("prefill", 2, 1, APPLIED)], actions
        up, down = scaler.actions
        assert "up 1 -> 2" in up.reason and "prompt tokens/s" in up.reason
        assert "down 2 -> 1" in down.reason and "drain 1" in down.reason
        assert [h.worker_id for h in prefill] == [original] and not added.alive()  # drained and stopped
        assert len(c.cluster.workers["decode"]) == 1
        assert {w: s.free_blocks for w, s in c.wait_idle(start_free).items()} == start_free


def test_pdserve_up_autoscale_acts_through_cluster_scale(make_checkpoint, tmp_path):
    """The command line: ``pdserve up --autoscale`` without ``--metrics-port`` picks one, reads the
    planner's flags from ``--planner-args``, moves a pool below its minimum to it (the bound rule) through
    ``Cluster.scale``, prints the change, and stops before the cluster does on ``pdserve down``."""
    model = make_checkpoint("llama")
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "pdserve.app.cli"]
    with open(tmp_path / "up.log", "w") as log:
        planner = ("--interval 0.5 --min-prefill 2 --max-prefill 2 --max-decode 1 --up-cooldown 1 "
                   "--down-cooldown 2")
        up = subprocess.Popen([*cli, "--log-level", "INFO", "up", "--model", str(model), "--launcher",
                               "process", "--transport", "tcp", "--num-blocks", "128",
                               "--run-dir", str(run_dir), "--autoscale", "--planner-args", planner],
                              stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        try:
            lines = []
            for line in up.stdout:
                lines.append(line)
                if "autoscale: prefill" in line:
                    break
            assert any(line.startswith("prometheus targets: ") for line in lines), lines
            assert "prefill up 1 -> 2: outside [2, 2]: to the nearest bound [applied in" in lines[-1], lines
            state = json.loads((run_dir / "state.json").read_text())
            assert sorted(w["role"] for w in state["workers"]) == ["decode", "prefill", "prefill"]
            down = subprocess.run([*cli, "down", "--run-dir", str(run_dir)], capture_output=True, text=True,
                                  env=env, timeout=180)
            assert down.returncode == 0, down.stderr
            assert up.wait(60) == 0
        finally:
            if up.poll() is None:
                up.kill()
                up.wait(30)
    logged = (tmp_path / "up.log").read_text()
    assert "autoscale: prefill up 1 -> 2" in logged and '"outcome": "applied"' in logged
