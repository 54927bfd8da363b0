"""Session affinity and warm-prefix placement, before vs after, with real workers, in one run:
``python -m pdserve.app.loadgen.affinity`` (``bench/router_affinity.py``).

Starts one set of workers (``--prefill`` x ``--decode``, KV over TCP) and one router process per
policy on those same workers, then runs the same workloads against each, side by side:

* ``prefix_only`` -- *before*: what the default policy did with a session id until it became
  session-aware (ignore it; place every turn by prefix overlap and load alone);
* ``prefix`` -- *after*: the default policy (a turn with a session id goes to its session's pair
  while that pair is usable; everything else by prefix overlap, counting the decode worker's cache);
* ``round_robin`` -- no cache awareness, the floor.

1. **multi-turn chat** -- the ``pdserve bench --sessions K --turns T`` workload (every session starts
   with one shared system prompt; turn t+1 = turn t's prompt + answer + new user tokens). Each policy
   gets its own token content (seed), so no run finds another's KV. Reported: the decode-side
   prefix-cache hit ratio (prompt tokens the decode worker already held, not shipped), KV bytes
   shipped per turn (mean over sessions, by turn), the share of the no-reuse bytes (every prompt
   block shipped on every turn), the prefill side's hit ratio, session moves. Run twice per policy:
   every session starting at once, and sessions arriving as a Poisson stream (``--session-rate``), so
   turns of different sessions overlap as in steady-state chat traffic.
2. **shared system prompt** -- ``--burst`` sessionless requests at once, all starting with one long
   system prompt: requests per decode worker (max / mean) under the load bound vs round robin.

Prints tables and writes JSON (``--json``, default ``bench/results/router-affinity-cpu-DATE.json``).
Nothing here asserts a number; the integration test runs a small version and checks the structural
facts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from pdserve import event_loop
from pdserve.app.launcher.local import QUIET_ENV, LocalCluster
from pdserve.app.launcher.procs import spawn
from pdserve.app.loadgen.dist import parse_dist
from pdserve.app.loadgen.runner import RunConfig, run
from pdserve.app.loadgen.stats import Sample, kv_summary

POLICIES = ("prefix_only", "prefix", "round_robin")
LABELS = {"prefix_only": "before: prefix_only", "prefix": "after: prefix (default)"}


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
    samples, _ = event_loop.run(run(cfg))
    return samples


def burst(router: str, *, n: int, system_len: int, output_len: int, seed: int) -> list[Sample]:
    cfg = RunConfig(router=router, rate=float("inf"), num_requests=n, input_len=parse_dist("16"),
                    output_len=parse_dist(str(output_len)), seed=seed, system_prompt_len=system_len)
    samples, _ = event_loop.run(run(cfg))
    return samples


def chat_report(samples: list[Sample], block_size: int) -> dict:
    ok = [s for s in samples if s.ok]
    out = kv_summary(ok, block_size)
    later = kv_summary([s for s in ok if s.turn >= 1], block_size)
    out["turn2plus"] = {k: later[k] for k in ("kv_blocks_sent", "kv_bytes_sent", "no_reuse_blocks",
                                              "bytes_vs_no_reuse", "decode_hit_ratio", "prefill_hit_ratio",
                                              "session_hits")}
    by_turn: dict[int, list[Sample]] = {}
    for s in ok:
        by_turn.setdefault(s.turn, []).append(s)
    out["per_turn"] = [{"turn": t + 1, "requests": len(ss),
                        "kv_bytes_sent_mean": sum(int(s.final.get("kv_bytes_sent", 0)) for s in ss) / len(ss),
                        "decode_hit_ratio": kv_summary(ss, block_size)["decode_hit_ratio"]}
                       for t, ss in sorted(by_turn.items())]
    out["errors"] = len(samples) - len(ok)
    return out


def format_per_turn(results: dict, key: str = "chat_arriving") -> str:
    """KV bytes shipped per turn and the decode-side hit ratio by turn, one column pair per policy."""
    runs = {p: r[key]["per_turn"] for p, r in results["policies"].items() if key in r}
    if not runs:
        return ""
    turns = max(len(v) for v in runs.values())
    head = ["turn"] + [f"{LABELS.get(p, p)}: KiB/turn, dec hit" for p in runs]
    rows = [head]
    for t in range(turns):
        row = [str(t + 1)]
        for per in runs.values():
            row.append(f"{per[t]['kv_bytes_sent_mean'] / 1024:.1f}, {per[t]['decode_hit_ratio']:.1%}"
                       if t < len(per) else "-")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def format_report(results: dict) -> str:
    rows = [("policy", "req", "KV blocks", "KV MiB", "vs no-reuse", "hit dec", "hit pref", "t>=2 dec",
             "t>=2 bytes", "moves", "burst max/mean")]
    for policy, r in results["policies"].items():
        label = LABELS.get(policy, policy)
        for name, key in ((label, "chat"), (f"{label} (arriving)", "chat_arriving")):
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
    p.add_argument("--sessions", type=int, default=16, help="not a multiple of --decode: round robin "
                   "would otherwise hand each session the same decode worker every turn by accident")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-len", type=int, default=256, help="shared system prompt (tokens)")
    p.add_argument("--user-len", default="uniform:24:72", help="new user tokens per turn")
    p.add_argument("--output-len", default="32")
    p.add_argument("--session-rate", type=float, default=4.0,
                   help="sessions/s for the arriving-sessions chat run (0 = skip it)")
    p.add_argument("--burst", type=int, default=24, help="shared-system-prompt burst size (0 = skip)")
    p.add_argument("--burst-system-len", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--json", default=f"bench/results/router-affinity-cpu-{time.strftime('%Y-%m-%d')}.json")
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
    print("\nby turn, sessions arriving (KV bytes shipped per turn, decode-side prefix-cache hit ratio)")
    print(format_per_turn(results))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2, default=float) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
