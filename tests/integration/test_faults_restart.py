"""Supervision with clusters of their own: a crash loop, a frozen worker killed by the liveness watch,
and both under the Ray launcher. Helpers are test_faults_migration's.

- crash loop (1P1D): a decode worker that cannot start any more is restarted at most ``max_restarts``
  times, then left down with the reason in state.json, and a request that needs it fails with
  UNAVAILABLE saying what was tried;
- liveness (1P1D): the only decode worker frozen under streams is killed by the launcher's liveness
  watch and restarted, and the streams complete on the restarted process token-exact;
- Ray (``pdserve up --launcher ray``, 1P2D): kill -9 under 16 greedy streams (token-exact, back under a
  new incarnation), then a freeze killed through the worker's actor; blocks back.
"""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest
from test_faults_migration import (
    MAX_TOKENS,
    joined,
    leak_check,
    prompt,
    reference,
    stream_all,
    streams_on_the_busiest,
    wait_back,
)

from pdserve.app.launcher.local import LocalCluster, get_stats
from pdserve.app.launcher.supervisor import RestartPolicy
from pdserve.client import Client
from pdserve.probe import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_crash_looping_worker_is_left_down_and_says_why(make_checkpoint, tmp_path) -> None:
    model = make_checkpoint("llama")
    policy = RestartPolicy(backoff_s=0.2, max_backoff_s=0.5, max_restarts=2, window_s=120.0, poll_s=0.2)
    with LocalCluster(model, prefill=1, decode=1, transport="tcp", run_dir=tmp_path, restart=policy,
                      router_args=("--retry-wait-s", "2")) as c:
        victim = next(h for h in c.workers if h.role == "decode")
        real = c.cluster._worker_args
        # From now on the worker cannot start: every restart exits at once with a usage error.
        c.cluster._worker_args = lambda role, name: [*real(role, name), "--num-blocks", "0"]
        c.kill(victim)
        deadline = time.monotonic() + 90
        while victim.worker_id not in c.cluster.gave_up:
            assert time.monotonic() < deadline, "the supervisor never gave up"
            time.sleep(0.2)
        why = c.cluster.gave_up[victim.worker_id]
        assert "crash loop: 3 exits" in why and "exit status 2" in why
        state = json.loads((tmp_path / "state.json").read_text())
        assert state["gave_up"] == {victim.worker_id: why}
        assert victim not in c.workers
        time.sleep(1.0)
        assert not victim.alive()  # not restarted again
        with Client(c.router, timeout=60) as cl:
            with pytest.raises(grpc.RpcError) as info:
                cl.generate(prompt_ids=[5, 6, 7], max_tokens=4)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "gave up after 2s of waiting" in info.value.details()
        prefill = next(h for h in c.workers if h.role == "prefill")
        s = get_stats(prefill.address, "prefill")
        assert s.num_running == 0 and s.queue_depth == 0


def test_frozen_only_decode_worker_is_restarted_and_streams_complete(make_checkpoint, tmp_path) -> None:
    """SIGSTOP of the only decode worker under 4 greedy streams: the launcher's liveness watch finds it
    silent, kills it, the supervisor restarts it, and the streams (waiting in the router for a decode
    worker to migrate to) complete on the restarted one, token-exact; nothing is leaked."""
    import os
    import signal

    model = make_checkpoint("llama")
    policy = RestartPolicy(backoff_s=0.2, max_backoff_s=1.0, max_restarts=5, window_s=120.0, poll_s=0.2,
                           liveness_failures=3, liveness_period_s=1.0, liveness_timeout_s=1.0)
    port = free_port()
    with LocalCluster(model, prefill=1, decode=1, transport="tcp", run_dir=tmp_path, restart=policy,
                      worker_args=("--num-blocks", "512"),
                      router_args=("--metrics-port", str(port), "--retry-wait-s", "180")) as c:
        c.model, c.metrics_port = model, port
        c.start_free = c.free_blocks()
        prompts = [prompt(400 + i) for i in range(4)]
        params = [dict(max_tokens=MAX_TOKENS, ignore_eos=True) for _ in prompts]
        want = reference(model, prompts, params)
        threads, results, victim = streams_on_the_busiest(c, prompts, params)
        old_inc, old_pid = get_stats(victim.address, "decode").incarnation, victim.pid
        os.kill(victim.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        assert [ids for ids, _ in joined(threads, results, 240)] == want
        assert victim.pid != old_pid and victim.restarts >= 1
        assert get_stats(victim.address, "decode").incarnation != old_inc
        with pytest.raises(ProcessLookupError):
            os.kill(old_pid, 0)  # the frozen process is gone, not left stopped beside its successor
        print(f"\nstreams done {time.monotonic() - frozen_at:.1f}s after the freeze")
        leak_check(c)


def test_ray_launcher_restarts_killed_and_frozen_workers(make_checkpoint, tmp_path) -> None:
    """The same supervision under ``pdserve up --launcher ray`` (each serve process in a Ray actor):
    ``kill -9`` of the busiest of two decode workers under 16 greedy streams -> every stream completes
    token-exact and the worker is back under a new incarnation; then the other decode worker is
    frozen (SIGSTOP) -> the liveness watch kills it through its actor and it is restarted; a request is
    served after; every block is back."""
    import os
    import signal
    import subprocess
    import sys
    from types import SimpleNamespace

    model = make_checkpoint("llama")
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "up.log", "w")  # noqa: SIM115 - closed in finally
    cmd = [sys.executable, "-m", "pdserve.app.cli", "up", "--model", str(model), "--prefill", "1",
           "--decode", "2", "--transport", "tcp", "--num-blocks", "512", "--run-dir", str(run_dir),
           "--launcher", "ray", "--ray-num-cpus", "2", "--drain-timeout", "10",
           "--liveness-period-s", "1", "--liveness-failures", "3"]
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        router = None
        for line in up.stdout:
            if line.startswith("router: "):
                router = line.split()[1]
                break
        assert router, (tmp_path / "up.log").read_text()[-3000:]
        c = SimpleNamespace(router=router)

        def workers() -> dict[str, SimpleNamespace]:
            state = json.loads((run_dir / "state.json").read_text())
            return {w["worker_id"]: SimpleNamespace(**w) for w in state["workers"]}

        start = {wid: get_stats(w.address, w.role).free_blocks for wid, w in workers().items()}
        prompts = [prompt(500 + i) for i in range(16)]
        params = [dict(max_tokens=MAX_TOKENS, ignore_eos=True) for _ in prompts]
        want = reference(model, prompts, params)
        started = threading.Event()
        threads, results = stream_all(router, prompts, params, started, min_tokens=1)
        assert started.wait(240)
        decode = [w for w in workers().values() if w.role == "decode"]
        victim = max(decode, key=lambda w: get_stats(w.address, "decode").num_running)
        old_inc = get_stats(victim.address, "decode").incarnation
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        assert [ids for ids, _ in joined(threads, results, 240)] == want
        wait_back(c, victim, old_inc)
        print(f"\nRay: {victim.worker_id} back {time.monotonic() - killed_at:.1f}s after the kill")

        other = next(w for w in decode if w.worker_id != victim.worker_id)
        os.kill(other.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        while workers()[other.worker_id].pid == other.pid:
            assert time.monotonic() - frozen_at < 240, "the frozen worker was never restarted"
            time.sleep(0.2)
        with pytest.raises(ProcessLookupError):
            os.kill(other.pid, 0)  # killed, not left stopped
        print(f"Ray: frozen {other.worker_id} restarted {time.monotonic() - frozen_at:.1f}s after the freeze")
        with Client(router, timeout=120) as cl:
            assert cl.generate(prompt_ids=prompts[0], **params[0]).token_ids == want[0]
        deadline = time.monotonic() + 60
        while True:
            now = {wid: get_stats(w.address, w.role) for wid, w in workers().items()}
            idle = all(s.num_running == 0 and s.num_leased == 0 for s in now.values())
            if (idle and {w: s.free_blocks for w, s in now.items()} == start) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert {w: s.free_blocks for w, s in now.items()} == start
        down = subprocess.run([sys.executable, "-m", "pdserve.app.cli", "down", "--run-dir", str(run_dir)],
                              capture_output=True, text=True, env=env, timeout=180)
        assert down.returncode == 0, down.stderr
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(30)
        log.close()


def test_router_killed_streams_fail_fast_it_comes_back_and_nothing_leaks(make_checkpoint, tmp_path) -> None:
    """kill -9 of the router under 8 streams (some still in prefill, most decoding): every client gets a
    status at once (UNAVAILABLE: its stream's server is gone), the supervisor brings the router back at
    the same address, a request is served token-exact, and every block of both pools comes back (the
    workers free what the dead router's calls held when those calls break)."""
    model = make_checkpoint("llama")
    policy = RestartPolicy(backoff_s=0.2, max_backoff_s=1.0, max_restarts=3, window_s=120.0, poll_s=0.2)
    with LocalCluster(model, prefill=1, decode=1, transport="tcp", run_dir=tmp_path, restart=policy) as c:
        start = c.free_blocks()
        prompts = [prompt(i) for i in range(8)]
        params = [dict(max_tokens=MAX_TOKENS, ignore_eos=True) for _ in prompts]
        started = threading.Event()
        threads, results = stream_all(c.router, prompts, params, started, min_tokens=1)
        assert started.wait(240)
        router = c.cluster.router
        old_pid = router.pid
        router.ref.kill()
        killed = time.monotonic()
        for t in threads:
            t.join(60)
        assert all(isinstance(r, grpc.RpcError) for r in results), results
        assert {r.code() for r in results} <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
        failed_in = time.monotonic() - killed
        want = reference(model, [prompts[0]], [dict(max_tokens=12)])[0]
        deadline = time.monotonic() + 120
        while True:
            try:
                with Client(c.router, timeout=10) as cl:
                    got = cl.generate(prompt_ids=prompts[0], max_tokens=12)
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "the router did not come back"
                time.sleep(0.2)
        back = time.monotonic() - killed
        print(f"\nstreams failed within {failed_in:.2f}s of the kill; router serving again after {back:.1f}s")
        assert got.token_ids == want
        assert c.cluster.router.pid != old_pid and c.cluster.router.restarts >= 1
        stats = c.wait_idle(start, timeout=60)
        assert {w: s.free_blocks for w, s in stats.items()} == start
        assert all(s.num_leased == 0 and s.num_running == 0 and s.queue_depth == 0 for s in stats.values())
