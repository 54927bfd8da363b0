"""Redis outages under a real 1 prefill + 2 decode cluster (router state and worker leases in a
redis-server this module starts on a free port, with an append-only file in a directory of its own).

While Redis is down the router serves from its own state: existing sessions keep their decode
worker, new sessions are placed, and a decode worker killed meanwhile (the launcher restarts it
under a new incarnation) moves its sessions instead of being followed. When Redis returns, empty
(its files deleted) or with the data it had (a clean shutdown, then a restart from the file, so it
still holds bindings to the dead incarnation), the workers' leases come back under their live
incarnations, every session turn re-binds in Redis, and no binding or lease names the dead
incarnation. Leak checks at the end: every KV block back, no placement open.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest
import redis
from test_router_cluster import check_leaks, converse, total

from pdserve.app.launcher.local import LocalCluster
from pdserve.client import Client
from pdserve.probe import free_port
from pdserve.probe import scrape_metrics as scrape

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class PersistentRedis:
    def __init__(self, data_dir) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.fail("redis-server binary not found (apt-get install redis-server)")
        self.port, self.dir, self.proc = free_port(), data_dir, None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, decode_responses=True)

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", ""],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                self.client().ping()
                return
            except redis.exceptions.ConnectionError:
                assert time.monotonic() < deadline and self.proc.poll() is None, "redis-server did not start"
                time.sleep(0.05)

    def stop(self, *, wipe: bool) -> None:
        """SIGTERM (Redis writes its data out and exits); ``wipe`` then deletes its files."""
        self.proc.terminate()
        self.proc.wait(20)
        self.proc = None
        if wipe:
            for p in self.dir.iterdir():
                shutil.rmtree(p) if p.is_dir() else p.unlink()


def _decode_incarnations(router: str) -> dict[str, str]:
    with Client(router) as c:
        return {w["worker_id"]: w.get("stats", {}).get("incarnation", "") for w in c.list_workers()
                if w.get("role") == "decode" and w.get("healthy")}


def _wait(pred, what: str, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _leases(srv: PersistentRedis) -> dict[str, str]:
    c = srv.client()
    return {json.loads(v)["worker_id"]: json.loads(v)["incarnation"]
            for k in c.scan_iter("pdserve:worker:*") if (v := c.get(k))}


def _binding(srv: PersistentRedis, session: str) -> dict | None:
    raw = srv.client().get(f"pdserve:session:{session}")
    return json.loads(raw) if raw else None


@pytest.mark.parametrize("wipe", [True, False], ids=["returns-empty", "returns-with-old-data"])
def test_router_serves_through_a_redis_outage_and_resyncs(make_checkpoint, tmp_path, wipe: bool) -> None:
    model = make_checkpoint("llama")
    (tmp_path / "redis").mkdir()
    srv = PersistentRedis(tmp_path / "redis")
    srv.start()
    port = free_port()
    common = ("--redis", srv.url, "--store-timeout", "2.0")
    try:
        with LocalCluster(model, prefill=1, decode=2, transport="tcp", run_dir=tmp_path / "run",
                          policy="session+prefix", worker_args=("--num-blocks", "256", *common),
                          router_args=(*common, "--metrics-port", str(port))) as cluster:
            cluster.metrics_ports = (port,)
            cluster.start_free = cluster.free_blocks()
            router = cluster.router
            _wait(lambda: len(_leases(srv)) == 3, "every worker holds a lease")
            sessions = [f"s{i}" for i in range(4)]
            hist, bound = {}, {}
            for i, s in enumerate(sessions):
                prompts, res = converse([router], s, 1, seed=40 + i)
                hist[s] = prompts[-1] + res[-1].token_ids
                bound[s] = res[-1].final["decode_worker"]
                assert _binding(srv, s)["decode_id"] == bound[s]
            before = _decode_incarnations(router)
            dead_lease = _leases(srv)[bound[sessions[0]]]  # the lease's incarnation is the registration's own

            srv.stop(wipe=wipe)
            # Redis down: existing sessions keep their worker, a new session is placed
            for i, s in enumerate(sessions):
                prompts, res = converse([router], s, 1, seed=50 + i, history=hist[s])
                assert res[-1].final["decode_worker"] == bound[s] and res[-1].final["session_hit"]
                hist[s] = prompts[-1] + res[-1].token_ids
            _, res = converse([router], "new-while-down", 2, seed=60)
            assert res[0].final["decode_worker"] == res[1].final["decode_worker"]
            # ... and a decode worker dies (the launcher restarts it under a new incarnation)
            victim_id = bound[sessions[0]]
            dead_inc = before[victim_id]
            cluster.kill(next(h for h in cluster.workers if h.worker_id == victim_id))
            prompts, res = converse([router], sessions[0], 1, seed=70, history=hist[sessions[0]])
            assert res[-1].final["session_moved"] and res[-1].final["decode_worker"] != victim_id
            hist[sessions[0]] = prompts[-1] + res[-1].token_ids
            bound[sessions[0]] = res[-1].final["decode_worker"]
            back = _wait(lambda: (inc := _decode_incarnations(router)).get(victim_id, dead_inc) != dead_inc
                         and len(inc) == 2 and inc, "the killed decode worker is back, new incarnation")
            assert total(scrape(port), "pdserve_router_redis_errors_total") >= 1

            srv.start()
            if not wipe:  # the old data is back, including the binding to the dead incarnation
                old = _binding(srv, sessions[0])["decode_incarnation"]
                assert old in (dead_inc, back[bound[sessions[0]]])
            # leases: every worker re-registers itself, the dead incarnation never comes back
            leases = _wait(lambda: len(ls := _leases(srv)) == 3 and ls.get(victim_id) != dead_lease and ls,
                           "every worker re-registers its lease; the dead process's lease stays gone")
            assert dead_lease not in leases.values()
            # sessions: every turn re-binds in Redis, to a live incarnation; no one follows the dead one
            for i, s in enumerate([*sessions, "new-while-down"]):
                prompts, res = converse([router], s, 1, seed=80 + i, history=hist.get(s, []))
                w = res[-1].final["decode_worker"]
                if s in bound and bound[s] != victim_id:
                    assert w == bound[s]  # its worker lived through it all: the session stays
                elif s in bound:
                    # bound to the killed worker's old incarnation: its KV is gone, so this turn is a move,
                    # and the scorer may pick either worker (the restarted one holds nothing)
                    assert res[-1].final["session_moved"]
                # the router writes the binding behind the reply; with the old data back, the key may
                # still hold the pre-outage binding until that write lands
                b = _wait(lambda s=s, w=w: (b := _binding(srv, s)) and b["decode_id"] == w and b,
                          f"session {s} re-bound in Redis to {w}", timeout=30)
                assert b["decode_incarnation"] == back[w] != dead_inc
            check_leaks(cluster)
    finally:
        if srv.proc is not None:
            srv.proc.kill()
            srv.proc.wait(10)
