"""CPU per relayed token and per request, per process of a 1P1D cluster, paired across source trees.

    python -m bench.relay_cpu --model DIR --trees /tmp/old,/work/main --rounds 3 \
        --rate 20 --num-requests 120 --output-len 128 --json out.json
    python -m bench.relay_cpu --model DIR --variant 1= --variant 4="--stream-interval 4"
    python -m bench.relay_cpu --model DIR --router-variant mux= --router-variant calls="--decode-mux off"
    python -m bench.relay_cpu --model DIR --rounds 1 --output-len 2 --num-requests 300 --rate 40 \
        --py-spy .venv/bin/py-spy   # the per-request part, and where the router's main thread goes

Each round runs every (tree, variant) pair once, alternating: a variant is a name and extra ``pdserve
serve`` flags for the workers (default: one variant, no extra flags), or with ``--router-variant`` for
the router; a name given both ways sets both in one cluster.

Each round starts one cluster per tree (alternating, so both see the same box), runs the same
``pdserve bench`` load against it (same seed: same prompts, greedy), and reads each process's own
CPU seconds (``/proc/PID/stat`` utime+stime, children excluded) before and after the load. The
difference over the load window divided by the output tokens / requests served is the figure the
issue asks for. TTFT p50/p90 and the output token count come from the bench JSON beside it, so a cut
that buys CPU with latency (or drops tokens) shows in the same table.

Why whole processes and not a profiler: the cost a platform pays includes gRPC's C core threads and
the interpreter's overhead, which a Python-level profiler under-counts.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.pyspy_threads import our_frame

CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of ``pid`` by name (the main thread as ``main``; gRPC's C core threads
    are ``event_engine``), summed over threads of one name."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = "main" if tid == str(pid) else f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


_IDLE = ("epoll_wait", "epoll_pwait", "poll (libc", "select (libc")
_SYSCALLS = ("sendmsg (libc", "recvmsg (libc", "write (libc", "read (libc", "send (libc", "recv (libc")


def py_spy_shares(raw: Path) -> dict:
    """Where the router's main thread was busy, from ``py-spy record --native -f raw`` samples: in our
    code's call tree (a frame of router/, pdserve/ or engine/ on the stack, gRPC calls it makes
    included), in socket syscalls outside it, or in gRPC's own callbacks (its Cython completion
    handling, server-side reads and writes) with none of our frames on the stack. Idle samples (the
    loop waiting in epoll) are left out."""
    counts = {"ours": 0, "syscalls": 0, "grpc_callbacks": 0}
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if "MainThread" not in frames[0] or any(i in f for f in frames[-3:] for i in _IDLE):
            continue
        # what the loop is running: the frames below its last callback (above it: main, asyncio.run)
        handled = [i for i, f in enumerate(frames) if f.startswith("Handle._run (asyncio/")]
        frames = frames[handled[-1] + 1:] if handled else frames
        if our_frame(frames) != "-":
            counts["ours"] += int(n)
        elif frames and any(c in frames[-1] for c in _SYSCALLS):
            counts["syscalls"] += int(n)
        else:
            counts["grpc_callbacks"] += int(n)
    total = sum(counts.values()) or 1
    return {"samples": total, **{k: round(v / total, 3) for k, v in counts.items()}}


def one(args: argparse.Namespace) -> dict:
    """One cluster of the tree this interpreter imports from, one load; returns the figures."""
    from pdserve.app.launcher.local import LocalCluster

    with tempfile.TemporaryDirectory(prefix="relaycpu-") as run_dir, \
            LocalCluster(args.model, prefill=1, decode=1, transport="tcp", run_dir=run_dir,
                         worker_args=("--num-blocks", "1024", "--max-num-seqs", "64",
                                      *shlex.split(args.worker_args)),
                         router_args=tuple(shlex.split(args.router_args))) as c:
        pids = {"router": c.cluster.router.pid}
        for h in c.workers:
            pids[h.role] = h.pid
        # warm-up: first-call costs (imports, channel setup) are not per-token costs
        _bench(c.router, args, 8, Path(run_dir) / "warm.json")
        spy = raw = None
        if args.py_spy:
            raw = Path(run_dir) / "router.spy"
            spy = subprocess.Popen([args.py_spy, "record", "-p", str(pids["router"]), "-r", "200", "--native",
                                    "--threads", "-f", "raw", "-o", str(raw)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        before = {r: proc_cpu_s(p) for r, p in pids.items()}
        threads0 = {r: thread_cpu_s(p) for r, p in pids.items()}
        res = _bench(c.router, args, args.num_requests, Path(run_dir) / "load.json")
        after = {r: proc_cpu_s(p) for r, p in pids.items()}
        threads = {r: {name: round(v - threads0[r].get(name, 0.0), 3) for name, v in thread_cpu_s(p).items()
                       if v - threads0[r].get(name, 0.0) > 0} for r, p in pids.items()}
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(60)
            profile = py_spy_shares(raw) if raw.exists() else {"error": "py-spy wrote nothing"}
            if args.py_spy_raw and raw.exists():  # for bench/pyspy_threads.py: what each frame costs
                shutil.copy(raw, args.py_spy_raw)
    toks = res["output_token_throughput"] * res["duration_s"]
    nreq = res["num_ok"]
    cpu = {r: after[r] - before[r] for r in pids}
    return {"output_tokens": round(toks), "requests": nreq, "errors": res["num_errors"],
            "duration_s": res["duration_s"], "ttft_p50_ms": res["ttft_ms"]["p50"],
            "ttft_p90_ms": res["ttft_ms"]["p90"], "itl_p50_ms": res["itl_ms"]["p50"],
            "cpu_s": cpu, "thread_cpu_s": threads,
            **({"router_main_thread": profile} if args.py_spy else {}),
            "us_per_token": {r: v / max(toks, 1) * 1e6 for r, v in cpu.items()},
            "ms_per_request": {r: v / max(nreq, 1) * 1e3 for r, v in cpu.items()}}


def _bench(router: str, args: argparse.Namespace, n: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "pdserve.app.cli", "bench", "--router", router, "--rate", str(args.rate),
           "--num-requests", str(n), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--seed", "7", "--progress", "off", "--json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--trees", default=".", help="comma-separated source trees, run alternately")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--num-requests", type=int, default=120)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--json", help="write every run and the medians here")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="extra worker flags under a name, e.g. 4='--stream-interval 4' (repeatable)")
    ap.add_argument("--router-variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="extra router flags under a name, e.g. calls='--decode-mux off' (repeatable)")
    ap.add_argument("--py-spy-raw", default="", metavar="FILE",
                    help="with --py-spy: keep the router's raw samples here (read by bench/pyspy_threads.py)")
    ap.add_argument("--py-spy", default="", metavar="BIN",
                    help="also sample the router under the load with this py-spy (--native; needs ptrace) "
                         "and report where its main thread was busy (router_main_thread in the JSON)")
    ap.add_argument("--worker-args", default="", help=argparse.SUPPRESS)
    ap.add_argument("--router-args", default="", help=argparse.SUPPRESS)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args)))
        return
    workers = dict(v.split("=", 1) for v in args.variant)
    routers = dict(v.split("=", 1) for v in args.router_variant)
    # a name given to both: those flags for the router and those for the workers, in one cluster
    variants = {name: (routers.get(name, ""), workers.get(name, "")) for name in {**workers, **routers}}
    variants = variants or {"": ("", "")}
    runs: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for tree in [str(Path(t).resolve()) for t in args.trees.split(",")]:
            for name, (router_flags, flags) in variants.items():
                key = f"{tree} {name}".strip()
                env = {**os.environ, "PYTHONPATH": tree}
                cmd = [sys.executable, str(Path(__file__).resolve()), "--one", "--model", args.model,
                       "--rate", str(args.rate), "--num-requests", str(args.num_requests),
                       "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                       f"--worker-args={flags}", f"--router-args={router_flags}",
                       *(["--py-spy", args.py_spy] if args.py_spy else []),
                       *(["--py-spy-raw", args.py_spy_raw] if args.py_spy_raw else [])]
                out = subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, text=True)
                runs.setdefault(key, []).append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"{key}: {runs[key][-1]['us_per_token']}", file=sys.stderr, flush=True)
    summary = {}
    print(f"{'tree variant':<28} {'role':<8} {'us/token':>9} {'ms/req':>7} {'tokens':>7} {'TTFT p50':>9} "
          f"{'p90':>7} {'ITL p50':>8}")
    for tree, rs in runs.items():
        summary[tree] = {}
        for role in rs[0]["cpu_s"]:
            med = {"us_per_token": statistics.median(r["us_per_token"][role] for r in rs),
                   "ms_per_request": statistics.median(r["ms_per_request"][role] for r in rs)}
            summary[tree][role] = med
            print(f"{tree[-28:]:<28} {role:<8} {med['us_per_token']:>9.1f} {med['ms_per_request']:>7.2f} "
                  f"{statistics.median(r['output_tokens'] for r in rs):>7.0f} "
                  f"{statistics.median(r['ttft_p50_ms'] for r in rs):>9.1f} "
                  f"{statistics.median(r['ttft_p90_ms'] for r in rs):>7.1f} "
                  f"{statistics.median(r['itl_p50_ms'] for r in rs):>8.2f}")
    if args.json:
        doc = {"args": vars(args), "runs": runs, "median": summary}
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
