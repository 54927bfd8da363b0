"""Soak: a process-launcher cluster under mixed traffic while workers are killed and restarted.

    python -m bench.soak --model .models/tiny --seconds 1800 --seed 0 --json OUT.json   (make soak)
    python -m bench.soak --model .models/tiny --seconds 300 --colocated                  (colocated pool)

Starts the cluster `pdserve up --launcher process` starts (``Cluster`` + ``ProcessBackend`` + the
launcher's supervisor, through ``LocalCluster``; 2 prefill + 2 decode over TCP by default, or N
colocated workers; every process forked from the launcher's zygote unless ``--zygote off``), with
the router's Prometheus port on. Then, for ``--seconds``:

- ``--clients`` threads send the seeded mix of bench/soak_traffic.py (greedy and seeded streams
  checked token for token against an in-process engine, cancels, deadlines, bad requests, sessions);
- a fault thread (bench/soak_faults.py) SIGKILLs or SIGTERMs one worker at a time at seeded random
  times, picking pids from the run directory's state.json, and waits for the supervisor to bring it
  back;
- a sampler reads every process's RSS.

Afterwards, with traffic stopped and every worker back: every request must have ended as allowed
(soak_traffic.judge: OK and token-exact, or a status from the allowed set for its kind and for the
faults it overlapped), every worker must be idle with all blocks free (GetStats: free == total,
nothing running, queued or leased; an expected KV transfer only exists under a lease), the router's
``pdserve_router_inflight_requests`` must be 0, no process may have exited that the soak did not
signal, and the supervisor must not have given up on any. Prints the tables, writes JSON, exits 1
when any check failed. RSS growth is stated, not judged (a number for the reader, not a threshold).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from bench import soak_traffic as traffic
from bench.soak_faults import FaultInjector, RssSampler, read_state
from pdserve.app.launcher.local import LocalCluster, get_stats
from pdserve.app.launcher.supervisor import RestartPolicy
from pdserve.client import Client
from pdserve.probe import free_port, scrape_metrics

COUNTERS = ("pdserve_router_worker_deaths", "pdserve_router_worker_restarts",
            "pdserve_router_request_retries", "pdserve_router_request_failures")


@dataclass(frozen=True, kw_only=True)
class SoakConfig:
    seconds: float = 1800.0
    seed: int = 0
    prefill: int = 2
    decode: int = 2         # colocated: the number of colocated workers
    colocated: bool = False
    clients: int = 6
    transport: str = "tcp"
    num_blocks: int = 256
    zygote: bool = True     # processes forked from the launcher's zygote, as `pdserve up` does by default
    fault_every_s: tuple[float, float] = (10.0, 30.0)
    first_fault_s: float = 10.0
    min_faults: int = 2     # traffic runs on past ``seconds`` until this many faults were recovered from
    warmup_s: float = 60.0  # RSS growth is measured after this much of each process's life

    def __post_init__(self) -> None:
        if self.seconds <= 0 or self.clients < 1 or self.decode < 1 or self.num_blocks < 1:
            raise ValueError("soak: seconds > 0, clients >= 1, decode >= 1, num_blocks >= 1")
        if (self.prefill < 1) != self.colocated:
            raise ValueError("soak: prefill >= 1 for a disaggregated cluster, 0 with --colocated")
        if not 0 < self.fault_every_s[0] <= self.fault_every_s[1]:
            raise ValueError("soak: fault interval must be 0 < min <= max")


def _counters(port: int) -> dict[str, float]:
    return {k: v for k, v in scrape_metrics(port).items() if k.startswith(COUNTERS) and "_created" not in k}


def _wait_all_back(c: LocalCluster, timeout: float = 120.0) -> list[str]:
    """Until every worker answers GetStats and the router lists every one healthy; the missing ones."""
    deadline = time.monotonic() + timeout
    while True:
        missing = []
        try:
            with Client(c.router, timeout=5) as cl:
                healthy = {w["worker_id"] for w in cl.list_workers() if w.get("healthy")}
        except grpc.RpcError:
            healthy = set()
        for w in read_state(c.cluster.run_dir)["workers"]:
            try:
                get_stats(w["address"], w["role"], timeout=5)
            except grpc.RpcError:
                missing.append(w["worker_id"])
                continue
            if w["worker_id"] not in healthy:
                missing.append(w["worker_id"])
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.5)


def _leak_check(c: LocalCluster, timeout: float = 60.0) -> tuple[dict, dict]:
    """Per worker (free, total, running, queued, leased), and the workers not idle after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        rows, leaks = {}, {}
        for w in read_state(c.cluster.run_dir)["workers"]:
            try:
                s = get_stats(w["address"], w["role"], timeout=5)
            except grpc.RpcError as exc:
                leaks[w["worker_id"]] = f"GetStats failed: {exc.code().name}"
                continue
            rows[w["worker_id"]] = {"free": s.free_blocks, "total": s.total_blocks, "running": s.num_running,
                                    "queued": s.queue_depth, "leased": s.num_leased}
            if s.free_blocks != s.total_blocks or s.num_running or s.queue_depth or s.num_leased:
                leaks[w["worker_id"]] = rows[w["worker_id"]]
        if not leaks or time.monotonic() > deadline:
            return rows, leaks
        time.sleep(0.5)


def _router_inflight(port: int, timeout: float = 30.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        n = scrape_metrics(port).get("pdserve_router_inflight_requests", float("nan"))
        if n == 0 or time.monotonic() > deadline:
            return n
        time.sleep(0.2)


def _tracebacks(run_dir: Path) -> dict[str, int]:
    out = {}
    for log in sorted((run_dir / "logs").glob("*.log")):
        n = log.read_text(errors="replace").count("Traceback (most recent call last)")
        if n:
            out[log.name] = n
    return out


def run_soak(cfg: SoakConfig, model: str | Path, run_dir: str | Path, *, log=print) -> dict:
    run_dir = Path(run_dir)
    model = str(model)
    log(f"soak: seed {cfg.seed}, {cfg.seconds:.0f}s, references from an in-process engine ...")
    pools = traffic.build_pools(model, cfg.seed)
    metrics_port = free_port()
    # Restarts come quickly and often enough never to trip the crash-loop limit for the soak's own
    # faults (one at a time, each waits for the last worker back): a give-up means a real crash loop.
    policy = RestartPolicy(backoff_s=0.5, max_backoff_s=5.0, max_restarts=10, window_s=300.0, poll_s=0.25)
    with LocalCluster(model, prefill=cfg.prefill, decode=cfg.decode, transport=cfg.transport, run_dir=run_dir,
                      worker_args=("--num-blocks", str(cfg.num_blocks)), restart=policy, drain_timeout=10.0,
                      colocated=cfg.colocated, router_args=("--metrics-port", str(metrics_port)),
                      zygote=cfg.zygote) as c:
        state0 = read_state(run_dir)
        before = _counters(metrics_port)
        records: list[traffic.Record] = []
        lock = threading.Lock()
        traffic_stop, fault_stop, rss_stop = threading.Event(), threading.Event(), threading.Event()
        rss = RssSampler(run_dir, rss_stop, interval_s=max(1.0, min(5.0, cfg.seconds / 60)))
        faults = FaultInjector(run_dir, c.router, cfg.seed, fault_stop, every_s=cfg.fault_every_s,
                               first_delay_s=cfg.first_fault_s)
        clients = [traffic.TrafficClient(i, c.router, pools, cfg.seed, traffic_stop, records, lock)
                   for i in range(cfg.clients)]
        t0 = time.monotonic()
        rss.sample()
        for th in [rss.thread, faults.thread, *(cl.thread for cl in clients)]:
            th.start()
        shape = f"{cfg.decode} colocated" if cfg.colocated else f"{cfg.prefill}P{cfg.decode}D"
        log(f"soak: cluster up ({shape}, router {c.router}), {cfg.clients} clients running")
        last_log = t0
        while not traffic_stop.wait(min(60.0, max(1.0, t0 + cfg.seconds - time.monotonic()))):
            recovered = sum(f.back_after_s is not None for f in faults.faults)
            if time.monotonic() >= t0 + cfg.seconds and (recovered >= cfg.min_faults or faults.gave_up
                                                          or not faults.thread.is_alive()):
                break
            if time.monotonic() - last_log >= 59.0:
                last_log = time.monotonic()
                with lock:
                    n = len(records)
                log(f"soak: {last_log - t0:5.0f}s  {n} requests, {len(faults.faults)} faults")
        fault_stop.set()
        traffic_stop.set()
        hung = []
        for cl in clients:
            cl.thread.join(traffic.NORMAL_TIMEOUT_S + 30)
            if cl.thread.is_alive():
                hung.append(cl.thread.name)
        faults.thread.join(faults.back_timeout_s + 30)
        elapsed = time.monotonic() - t0
        missing = _wait_all_back(c)
        workers, leaks = _leak_check(c)
        inflight = _router_inflight(metrics_port)
        rss.sample()
        rss_stop.set()
        rss.thread.join(10)
        after = _counters(metrics_port)
        state = read_state(run_dir)
        windows = faults.windows()
        with lock:
            recs = list(records)
    warmup = min(cfg.warmup_s, cfg.seconds / 2)
    verdicts = [traffic.judge(r, windows) for r in recs]
    outcomes = Counter((r.kind, v.outcome) for r, v in zip(recs, verdicts, strict=True))
    violations = [v.violation for v in verdicts if v.violation]
    restarts = sum(n for wid, n in state.get("restarts", {}).items())
    fault_rows = faults.report(t0)
    restarted = [f for f in fault_rows if f["back_after_s"] is not None and f["action"] != "freeze"]
    unplanned = restarts - len(restarted)
    problems = []
    if violations:
        problems.append(f"{len(violations)} requests ended outside the allowed set")
    if hung:
        problems.append(f"client threads still running after the run: {hung}")
    if faults.gave_up:
        problems.append(faults.gave_up)
    if missing:
        problems.append(f"workers not serving at the end: {missing}")
    if leaks:
        problems.append(f"workers not idle with every block free: {leaks}")
    if inflight != 0:
        problems.append(f"router inflight {inflight} after the run")
    if state.get("router_pid") != state0.get("router_pid"):
        problems.append("the router process changed (it died and was restarted)")
    if unplanned > 0:
        problems.append(f"{unplanned} worker restarts the soak did not cause (a crash)")
    if state.get("gave_up"):
        problems.append(f"the supervisor gave up: {state['gave_up']}")
    return {
        "config": asdict(cfg), "duration_s": round(elapsed, 1), "requests": len(recs),
        "outcomes": [{"kind": k, "outcome": o, "count": n} for (k, o), n in sorted(outcomes.items())],
        "allowed": {"always": sorted(traffic.ALWAYS), "own": {k: sorted(v) for k, v in traffic.OWN.items()},
                    "bad": ["INVALID_ARGUMENT"],
                    "during_fault": {k: sorted(v) for k, v in traffic.IN_FAULT.items()}},
        "violations": violations, "faults": fault_rows, "fault_schedule_ended": faults.gave_up,
        "restarts": state.get("restarts", {}), "unplanned_restarts": max(0, unplanned),
        "workers_at_end": workers, "leaks": leaks, "router_inflight": inflight,
        "router_counters": {k: after[k] - before.get(k, 0.0) for k in sorted(after)},
        "rss": rss.growth(warmup), "rss_warmup_s": warmup,
        "log_tracebacks": _tracebacks(run_dir), "problems": problems, "passed": not problems,
    }


def _table(title: str, header: list[str], rows: list[list]) -> str:
    cells = [[str(x) for x in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title] + ["  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(2, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary(res: dict) -> str:
    cfg = res["config"]
    shape = f"{cfg['decode']} colocated" if cfg["colocated"] else f"{cfg['prefill']}P{cfg['decode']}D"
    out = [f"soak {shape} {cfg['transport']}: seed {cfg['seed']}, {res['duration_s']:.0f}s, "
           f"{res['requests']} requests, {len(res['faults'])} faults -> "
           f"{'PASS' if res['passed'] else 'FAIL'}"]
    out.append(_table("outcomes", ["kind", "outcome", "count"],
                      [[o["kind"], o["outcome"], o["count"]] for o in res["outcomes"]]))
    out.append(_table("faults", ["t (s)", "action", "worker", "pid", "frozen (s)", "back after (s)"],
                      [[f["at"], f["action"], f["worker_id"], f["pid"], f["held_s"] or "", f["back_after_s"]]
                       for f in res["faults"]]))
    out.append(_table("workers at the end", ["worker", "free", "total", "running", "queued", "leased"],
                      [[w, *v.values()] for w, v in res["workers_at_end"].items()]))
    out.append(_table(f"RSS (after {res['rss_warmup_s']:.0f}s warm-up of each process)",
                      ["process", "incarnations", "span (s)", "start MiB", "end MiB", "growth MiB",
                       "max MiB"],
                      [[r["process"], r["incarnations"], r["span_s"], r["rss_start_mib"], r["rss_end_mib"],
                        r["growth_mib"], r["rss_max_mib"]] for r in res["rss"]]))
    out.append(_table("router counters over the run", ["counter", "delta"],
                      [[k, f"{v:g}"] for k, v in res["router_counters"].items()]))
    out.append(f"router inflight at the end: {res['router_inflight']:g}; unplanned restarts: "
               f"{res['unplanned_restarts']}; tracebacks in logs: {res['log_tracebacks'] or 'none'}")
    if res["violations"]:
        out.append("violations (first 10):\n  " + "\n  ".join(res["violations"][:10]))
    if res["problems"]:
        out.append("problems:\n  " + "\n  ".join(res["problems"]))
    return "\n\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model directory (default: a tiny random checkpoint under --run-dir)")
    p.add_argument("--seconds", type=float, default=1800.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--colocated", type=int, default=0, metavar="N", help="N colocated workers instead")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--transport", default="tcp", choices=["tcp", "nixl"])
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--fault-every", default="10:30", metavar="MIN:MAX", help="seconds between faults")
    p.add_argument("--zygote", choices=["on", "off"], default="on",
                   help="fork the processes from the launcher's zygote (default on, as pdserve up)")
    p.add_argument("--run-dir", default=".run/soak")
    p.add_argument("--json", help="write the result here")
    a = p.parse_args(argv)
    lo, hi = (float(x) for x in a.fault_every.split(":"))
    cfg = SoakConfig(seconds=a.seconds, seed=a.seed, prefill=0 if a.colocated else a.prefill,
                     decode=a.colocated or a.decode, colocated=bool(a.colocated), clients=a.clients,
                     transport=a.transport, num_blocks=a.num_blocks, fault_every_s=(lo, hi),
                     zygote=a.zygote == "on")
    run_dir = Path(a.run_dir).resolve()
    model = a.model
    if not model:
        from engine.checkpoint import preset_config, write_random_checkpoint

        model = write_random_checkpoint(run_dir / "model", preset_config("tiny"), seed=0)
    res = run_soak(cfg, model, run_dir / "cluster")
    print(summary(res), flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1))
        print(f"wrote {a.json}")
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
