"""Failover time under ``pdserve up --launcher process``: a worker killed -9 until it serves again, with
its processes forked from the zygote (``--zygote on``, the default) and started as fresh interpreters
(``--zygote off``), side by side in one run.

    python -m bench.restart_time --model DIR [--role decode] [--rounds 3] [--up-args "..."] [--json OUT]

Both clusters run at once (the same ``--up-args``); the rounds alternate between them, and begin once the
``on`` cluster's zygote is ready (its first processes start plain beside it). Each round kills the first
worker of ``--role`` (-9) and records:

- ``kill_to_healthy_s``: from the kill until the router lists that worker healthy under a new
  incarnation (what a client sees: new requests can go there again);
- ``serving_after_s``: the new process's own start -> SERVING (its boot record, GetProcessStats),
  and its ``phases``;
- the supervisor's wait before the restart is ``--restart-backoff-s`` (0.1 here unless ``--up-args``
  says otherwise), the same for both: it is in ``kill_to_healthy_s``.

Deaths within 5 minutes double the wait and count towards the crash-loop limit, so ``--rounds`` stays
below ``--max-restarts`` (raised to rounds + 1 here). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.client import Client  # noqa: E402
from pdserve.v1 import process_pb2, process_pb2_grpc  # noqa: E402


class UpCluster:
    def __init__(self, label: str, model: str, up_args: list[str], run_dir: Path) -> None:
        self.label, self.run_dir = label, run_dir
        log = open(run_dir.with_suffix(".up.log"), "w")  # noqa: SIM115 - lives as long as the cluster
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.app.cli", "up", "--model", model,
                                      "--launcher", "process", "--run-dir", str(run_dir), *up_args],
                                     stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
        t = time.monotonic()
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("router: "):
                self.router = line.split()[1]
                break
        else:
            raise RuntimeError(f"{label}: pdserve up exited with {self.proc.wait()}; see {log.name}")
        self.up_s = time.monotonic() - t
        if label == "on":  # --zygote on: its first processes start plain beside it
            self.zygote_ready_s = wait_zygote(run_dir) - t

    def state(self) -> dict:
        return json.loads((self.run_dir / "state.json").read_text())

    def worker(self, role: str) -> dict:
        return next(w for w in self.state()["workers"] if w["role"] == role)

    def entries(self) -> dict[str, dict]:
        with Client(self.router) as c:
            return {w["worker_id"]: w for w in c.list_workers()}

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def wait_zygote(run_dir: Path, timeout: float = 180.0) -> float:
    """time.monotonic() once the cluster's zygote has written its ready line."""
    deadline = time.monotonic() + timeout
    log = run_dir / "logs" / "zygote.log"
    while not (log.exists() and any(ln.startswith("zygote ") for ln in log.read_text().splitlines())):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no zygote ready within {timeout:.0f}s ({log})")
        time.sleep(0.05)
    return time.monotonic()


def boot_record(address: str) -> dict:
    with grpc.insecure_channel(address) as ch:
        r = process_pb2_grpc.ProcessStub(ch).GetProcessStats(process_pb2.ProcessStatsRequest(), timeout=10)
    return {"serving_after_s": round(r.serving_after_s, 3),
            "phases": [{"name": p.name, "seconds": round(p.seconds, 3)} for p in r.boot]}


def one_round(cluster: UpCluster, role: str, timeout: float) -> dict:
    w = cluster.worker(role)
    before = cluster.entries()[w["worker_id"]]["stats"].get("incarnation", "")
    t = time.monotonic()
    os.kill(w["pid"], signal.SIGKILL)
    while True:
        try:
            e = cluster.entries().get(w["worker_id"], {})
        except grpc.RpcError:
            e = {}
        if e.get("healthy") and e.get("stats", {}).get("incarnation", before) != before:
            break
        if time.monotonic() - t > timeout:
            return {"error": f"not back within {timeout:.0f}s"}
        time.sleep(0.02)
    healthy = time.monotonic() - t
    now = cluster.worker(role)
    return {"kill_to_healthy_s": round(healthy, 3), "pid": now["pid"], **boot_record(now["address"])}


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--role", default="decode", help="the pool whose first worker is killed")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--up-args", default="--prefill 1 --decode 1 --transport tcp",
                    help="pdserve up flags for both clusters")
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--run-dir", default=".run/restart-bench")
    ap.add_argument("--json")
    args = ap.parse_args()
    up_args = ["--restart-backoff-s", "0.1", "--max-restarts", str(args.rounds + 1),
               *shlex.split(args.up_args)]
    base = Path(args.run_dir).resolve()
    base.mkdir(parents=True, exist_ok=True)
    clusters: dict[str, UpCluster] = {}
    result: dict = {"command": shlex.join([sys.executable, *sys.argv]), "up_args": up_args, "role": args.role,
                    "modes": {}}
    try:
        for mode in ("on", "off"):
            clusters[mode] = UpCluster(mode, args.model, [*up_args, "--zygote", mode],
                                       base / f"zygote-{mode}")
            result["modes"][mode] = {"up_s": round(clusters[mode].up_s, 3), "rounds": [],
                                     "zygote_ready_s": round(getattr(clusters[mode], "zygote_ready_s", 0), 3)}
            print(f"zygote {mode}: cluster up in {clusters[mode].up_s:.2f}s", flush=True)
        for r in range(args.rounds):
            for mode, c in clusters.items():
                row = one_round(c, args.role, args.timeout)
                result["modes"][mode]["rounds"].append(row)
                print(f"round {r + 1} zygote {mode:<3} " + (row.get("error") or
                      f"kill -> healthy {row['kill_to_healthy_s']:.2f}s, start -> SERVING "
                      f"{row['serving_after_s']:.2f}s"), flush=True)
    finally:
        for c in clusters.values():
            c.stop()
    print("\n| zygote | cluster up (s) | kill -> healthy (s), median | start -> SERVING (s), median "
          "| rounds |")
    print("|---|---:|---:|---:|---:|")
    for mode, m in result["modes"].items():
        ok = [x for x in m["rounds"] if "error" not in x]
        m["median_kill_to_healthy_s"] = _median([x["kill_to_healthy_s"] for x in ok])
        m["median_start_to_serving_s"] = _median([x["serving_after_s"] for x in ok])
        print(f"| {mode} | {m['up_s']:.2f} | {m['median_kill_to_healthy_s']:.2f} | "
              f"{m['median_start_to_serving_s']:.2f} | {len(ok)}/{len(m['rounds'])} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
