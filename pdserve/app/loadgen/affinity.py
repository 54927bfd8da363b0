"""Session affinity on vs off with real workers, in one run: ``python -m pdserve.app.loadgen.affinity``.

Starts one set of workers (``--prefill`` x ``--decode``, KV over TCP) and one router process per
policy on those same workers (``session+prefix``, ``prefix``, ``round_robin``), then:

1. **multi-turn chat** — the `pdserve bench --sessions K --turns T` workload (every session starts
   with one shared system prompt; turn t+1 = turn t's prompt + answer + new user tokens) against
   each router. Each policy gets its own token content (seed), so no run finds another's KV.
   Reports KV blocks/bytes sent, the share of the no-reuse bytes (every prompt block shipped on
   every turn) and the prompt-cache hit ratio (decode side: blocks not shipped; prefill side:
   tokens not recomputed), overall and for turns >= 2. Run twice per policy: every session starting
   at once (a cold start: no decode worker holds the system prompt yet when the first turns
   arrive) and sessions arriving as a Poisson stream (``--session-rate``), closer to steady-state
   chat traffic where the shared system prompt is already cached when a new session starts.
2. **shared system prompt** — ``--burst`` sessionless requests at once, all starting with one long
   system prompt: requests per decode worker (max / mean) under the load bound vs round robin.

Prints a table and writes JSON (``--json``). Nothing here asserts a number; the integration test
runs a small version and checks the structural facts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from pdserve.app.launcher.local import QUIET_ENV, LocalCluster
from pdserve.app.launcher.procs import spawn
from pdserve.app.loadgen.dist import parse_dist
from pdserve.app.loadgen.runner import RunConfig, run
from pdserve.app.loadgen.stats import Sample, kv_summary

POLICIES = ("session+prefix", "prefix", "round_robin")


@contextlib.contextmanager
def policy_routers(model: str, policies: tuple[str, ...], *, prefill: int, decode: int, run_dir: Path,
                   num_blocks: int = 1024) -> Iterator[tuple[LocalCluster, dict[str, str]]]:
    """One set of workers; a router per policy on all of them. Yields (cluster, {policy: address})."""
    with LocalCluster(model, prefill=prefill, decode=decode, transport="tcp", run_dir=run_dir,
                      policy=policies[0], worker_args=("--num-blocks", str(num_blocks))) as c:
        addrs = {r: ",".join(h.address for h in c.workers if h.role == r) for r in ("prefill", "decode")}
        extra = []
        try:
            routers = {policies[0]: c.router}
            for policy in policies[1:]:
                p = spawn("router", ["--model", str(model), "--policy", policy, "--prefill", addrs["prefill"],
                                     "--decode", addrs["decode"], "--stats-interval", "0.2"],
                          run_dir / f"router-{policy}.log", env=QUIET_ENV)
                extra.append(p)
                routers[policy] = p.address
            _wait_routers(routers.values(), len(c.workers))
            yield c, routers
        finally:
            for p in extra:
                p.stop(10)


def _wait_routers(addresses, n: int) -> None:
    from pdserve.client import Client

    deadline = time.monotonic() + 60
    for address in addresses:
        with Client(address) as c:
            while sum(1 for w in c.list_workers() if w.get("healthy")) < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"router {address} does not see all {n} workers")
                time.sleep(0.2)


def chat(router: str, *, sessions: int, turns: int, system_len: int, user_len: str, output_len: str,
         seed: int, label: str, session_rate: float = float("inf")) -> list[Sample]:
    """``session_rate``: sessions per second, Poisson (inf = every session's first turn at once)."""
    cfg = RunConfig(router=router, rate=session_rate, num_requests=0, input_len=parse_dist(user_len),
                    output_len=parse_dist(output_len), sessions=sessions, turns=turns, seed=seed,
                    system_prompt_len=system_len, session_prefix=label)
    samples, _ = asyncio.run(run(cfg))
    return samples


def burst(router: str, *, n: int, system_len: int, output_len: int, seed: int) -> list[Sample]:
    cfg = RunConfig(router=router, rate=float("inf"), num_requests=n, input_len=parse_dist("16"),
                    output_len=parse_dist(str(output_len)), seed=seed, system_prompt_len=system_len)
    samples, _ = asyncio.run(run(cfg))
    return samples


def chat_report(samples: list[Sample], block_size: int) -> dict:
    ok = [s for s in samples if s.ok]
    out = kv_summary(ok, block_size)
    later = kv_summary([s for s in ok if s.turn >= 1], block_size)
    out["turn2plus"] = {k: later[k] for k in ("kv_blocks_sent", "kv_bytes_sent", "no_reuse_blocks",
                                              "bytes_vs_no_reuse", "decode_hit_ratio", "prefill_hit_ratio",
                                              "session_hits")}
    out["errors"] = len(samples) - len(ok)
    return out


def format_report(results: dict) -> str:
    rows = [("policy", "req", "KV blocks", "KV MiB", "vs no-reuse", "hit dec", "hit pref", "t>=2 dec",
             "t>=2 bytes", "moves", "burst max/mean")]
    for policy, r in results["policies"].items():
        for name, key in ((policy, "chat"), (f"{policy} (arriving)", "chat_arriving")):
            if key not in r:
                continue
            c = r[key]
            b = r.get("burst", {}) if key == "chat" else {}
            burst_cell = (f"{b.get('decode_max_over_mean', float('nan')):.2f} "
                          f"{b.get('requests_per_decode_worker', '')}") if b else "-"
            rows.append((name, str(c["requests"]), str(c["kv_blocks_sent"]),
                         f"{c['kv_bytes_sent'] / 2**20:.2f}", f"{c['bytes_vs_no_reuse']:.1%}",
                         f"{c['decode_hit_ratio']:.1%}", f"{c['prefill_hit_ratio']:.1%}",
                         f"{c['turn2plus']['decode_hit_ratio']:.1%}",
                         f"{c['turn2plus']['bytes_vs_no_reuse']:.1%}", str(c["session_moves"]), burst_cell))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=".models/tiny")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=3)
    p.add_argument("--sessions", type=int, default=10, help="not a multiple of --decode: round robin "
                   "would otherwise hand each session the same decode worker every turn by accident")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-len", type=int, default=256, help="shared system prompt (tokens)")
    p.add_argument("--user-len", default="uniform:24:72", help="new user tokens per turn")
    p.add_argument("--output-len", default="32")
    p.add_argument("--session-rate", type=float, default=2.0,
                   help="sessions/s for the arriving-sessions chat run (0 = skip it)")
    p.add_argument("--burst", type=int, default=24, help="shared-system-prompt burst size (0 = skip)")
    p.add_argument("--burst-system-len", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--json", default="bench/results/router-affinity.json")
    args = p.parse_args(argv)
    policies = tuple(args.policies.split(","))
    results: dict = {"policies": {}}
    with tempfile.TemporaryDirectory(prefix="pdserve-affinity-") as tmp, \
            policy_routers(args.model, policies, prefill=args.prefill, decode=args.decode,
                           run_dir=Path(tmp)) as (_, routers):
        for i, policy in enumerate(policies):
            samples = chat(routers[policy], sessions=args.sessions, turns=args.turns,
                           system_len=args.system_len, user_len=args.user_len,
                           output_len=args.output_len, seed=100 + i, label=policy.replace("+", "-"))
            entry = {"chat": {"requests": len(samples), **chat_report(samples, args.block_size)}}
            if args.session_rate > 0:
                arriving = chat(routers[policy], sessions=args.sessions, turns=args.turns,
                                system_len=args.system_len, user_len=args.user_len,
                                output_len=args.output_len, seed=300 + i,
                                label=policy.replace("+", "-") + "-arr", session_rate=args.session_rate)
                entry["chat_arriving"] = {"requests": len(arriving),
                                          **chat_report(arriving, args.block_size)}
            if args.burst:
                ok = [s for s in burst(routers[policy], n=args.burst, system_len=args.burst_system_len,
                                       output_len=48, seed=200 + i) if s.ok]
                k = kv_summary(ok, args.block_size)
                entry["burst"] = {"requests": len(ok), **{key: k[key] for key in (
                    "requests_per_decode_worker", "decode_max_over_mean", "prefill_hit_ratio")}}
            results["policies"][policy] = entry
    results["args"] = vars(args)
    results["host"] = {"platform": platform.platform(), "python": platform.python_version()}
    results["when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(f"{args.sessions} sessions x {args.turns} turns, system prompt {args.system_len}, user "
          f"{args.user_len}, output {args.output_len}; {args.prefill}P{args.decode}D, KV over TCP")
    print(format_report(results))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2, default=float) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
