"""A day of traffic against fixed pools and the planner: GPU-hours and SLO attainment side by side.

    python -m bench.planner_day --out bench/results [--seed 1 --seed 2 --seed 3] [--hours 24] [--jobs 2]

Issue #48's last "must show": a seeded day-long trace (``planner_day_model.day_trace``: a diurnal rate
with noise and bursts, a mix of chat, documents and long answers that changes with the hour) served by a
simulated disaggregated cluster (``planner_day_sim.Cluster``) whose per-GPU capacities come from the
repo's H200 measurements (``planner_day_model.Capacity``). Policies, over the same trace:

* **fixed 1:1**: ``n`` prefill + ``n`` decode all day, the smallest ``n`` reaching the attainment target
  (and the attainment one size smaller);
* **best fixed**: the ``P:D`` with the fewest GPUs reaching the target, found in hindsight (the smallest
  ``P`` and ``D`` that reach it with the other pool unbounded, then every split of each total upward);
* **planner**: the project's own ``Planner`` (policy.py, capacity.py) and local ``Actuator`` (actuator.py)
  on the simulated clock, fed a ``Signals`` per 10 s window, scaling through a Kubernetes-like
  ``scale`` (workers ready after 60-120 s, removed ones drained). Three capacity models (``PLANNERS``):
  seeded from the sweep profile ``planner --profile`` would be given (``capacity.load_sweep`` of the
  1p1d-nixl frontier); seeded with the simulator's own per-GPU numbers at that sweep's request shape
  (what a better profile would say); the latter with learning off, to tell the policy's decisions from
  what the model learns.

SLOs: the planner's defaults (TTFT 2 s, TPOT 25 ms); a request attains when it meets both. The planner's
bounds are 1..16 per pool, wider than any fixed allocation needs (a planner that reaches 16 was asking for
more than the day needs: a low estimate or a burst's overshoot). GPU-hours count a worker from its request
to its release within the day; the trace starts with 30 minutes of warm-up that count for nothing. The
planner is judged against the goal of issue #48: attainment >= 99% with <= 80% of the GPU-hours of the best
fixed allocation reaching the same attainment (the table also gives the ratio to the best fixed allocation
at 99%). Writes ``<out>/<date>-cpu-planner-day.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
from concurrent.futures import ProcessPoolExecutor
from functools import lru_cache
from pathlib import Path

import numpy as np

from bench.planner_day_model import KINDS, SWEEP, SWEEP_MODE, Capacity, day_trace
from bench.planner_day_sim import Cluster, Result
from pdserve.app.planner.actuator import Actuator
from pdserve.app.planner.capacity import CapacityModel, Seed, load_sweep
from pdserve.app.planner.policy import Planner, PlannerConfig
from pdserve.settings import bench_command, bench_commit

TARGET = 0.99
BIG = 16  # "unbounded" for the other pool while one is searched; also the planner's maxima
CONFIG = PlannerConfig(max_prefill=BIG, max_decode=BIG)


@lru_cache(maxsize=4)
def _trace(seed: int, hours: float):
    return day_trace(seed, hours=hours)


@lru_cache(maxsize=1)
def _capacity() -> Capacity:
    return Capacity.measured()


def summarize(name: str, r: Result, at: np.ndarray, ttft_s: float, tpot_s: float, **extra) -> dict:
    day = at >= 0
    ttft, tpot = r.ttft[day], r.tpot[day]
    ok = (ttft <= ttft_s) & (tpot <= tpot_s)
    pct = lambda x, q: float(np.percentile(x, q))
    return {"policy": name, "gpu_hours": round(r.gpu_hours, 2), "attainment": float(ok.mean()),
            "ttft_attainment": float((ttft <= ttft_s).mean()),
            "tpot_attainment": float((tpot <= tpot_s).mean()),
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "tpot_p50_ms": pct(tpot, 50) * 1e3,
            "tpot_p99_ms": pct(tpot, 99) * 1e3, "requests": int(day.sum()), "scale_actions": r.actions,
            **extra}


def fixed(seed: int, hours: float, p: int, d: int) -> dict:
    trace = _trace(seed, hours)
    r = Cluster(_capacity(), trace, prefill=p, decode=d, seed=seed).run()
    return summarize(f"fixed {p}:{d}", r, trace.at, CONFIG.ttft_s, CONFIG.tpot_s, prefill=p, decode=d)


def planner_seeds() -> dict[str, Seed]:
    """The two capacity seeds (module doc); the second at the sweep's mean prompt and answer."""
    cap = _capacity()
    sweep = json.loads((Path(__file__).resolve().parent / "results" / SWEEP).read_text())
    points = sweep["results"][SWEEP_MODE]["points"]
    prompt = float(np.mean([p["kv"]["prompt_tokens"] / p["num_ok"] for p in points]))
    answer = float(np.mean([p["output_token_throughput"] / p["request_throughput"] for p in points]))
    seqs = cap.max_seqs
    step = cap.tpot_s(seqs, seqs * (prompt + answer / 2))
    engine = Seed(prefill_tokens_per_s=prompt / cap.prefill_s(prompt), decode_tokens_per_s=seqs / step,
                  decode_sequences=float(seqs),
                  source=f"simulated H200 at the sweep's mean request ({prompt:.0f} in, {answer:.0f} out)")
    return {"profile": load_sweep(Path(__file__).resolve().parent / "results" / SWEEP, mode=SWEEP_MODE),
            "engine": engine}


PLANNERS = {"profile seed": ("profile", 0.3), "engine seed": ("engine", 0.3),
            "engine seed, learning off": ("engine", 1e-9)}


def drive(cluster: Cluster, planner: Planner, on_signals=None) -> tuple[Result, list[dict]]:
    """Run ``cluster`` with ``planner`` deciding each window through the local ``Actuator`` (on the
    simulated clock); returns the result and every action the actuator took."""
    actuator = Actuator(cluster, planner, clock=lambda: cluster.now)
    changes: list[dict] = []

    def on_window(c: Cluster, s) -> None:
        if on_signals is not None:
            on_signals(s)
        for a in actuator.apply(planner.observe(s), s):
            changes.append({"t": round(a.started, 1), "pool": a.pool, "from": a.before, "to": a.target,
                            "outcome": a.outcome, "reason": a.reason})

    return cluster.run(on_window), changes


def planned(seed: int, hours: float, which: str) -> dict:
    """The planner over the day; ``which`` names its capacity seed and learning weight (``PLANNERS``:
    the last holds the seed all day, to tell the policy's decisions from what the model learns)."""
    trace = _trace(seed, hours)
    name, alpha = PLANNERS[which]
    cap_seed = planner_seeds()[name]
    cluster = Cluster(_capacity(), trace, prefill=CONFIG.min_prefill, decode=CONFIG.min_decode, seed=seed)
    planner = Planner(CONFIG, CapacityModel(seed=cap_seed, alpha=alpha), clock=lambda: cluster.now)
    hourly_capacity: list[tuple[float, float, float]] = []  # the model's estimates as each hour began

    def snapshot(s) -> None:
        if s.at >= 3600.0 * len(hourly_capacity):
            m = planner.capacity
            hourly_capacity.append((round(m.prefill.value), round(m.decode_tokens.value),
                                    round(m.decode_sequences.value, 1)))

    r, changes = drive(cluster, planner, on_signals=snapshot)
    out = summarize(f"planner ({which})", r, trace.at, CONFIG.ttft_s, CONFIG.tpot_s,
                    seed_capacity=dict(vars(cap_seed)), learned=planner.capacity.to_dict(), changes=changes,
                    timeline=[(round(t, 1), p, d) for t, p, d in r.timeline])
    out["misses"] = misses(r, trace, out["timeline"])
    out["hourly_replicas"] = hourly_replicas(out["timeline"], trace.end)
    out["hourly_capacity"] = hourly_capacity
    return out


def hourly_replicas(timeline: list, end: float) -> list[tuple[float, float]]:
    """Mean (prefill, decode) replicas the actuator held in each hour (provisioning included)."""
    out = []
    for hour in range(int(end // 3600)):
        lo, hi = hour * 3600.0, (hour + 1) * 3600.0
        acc = [0.0, 0.0]
        for (t, p, d), nxt in zip(timeline, [*timeline[1:], (end, 0, 0)], strict=True):
            span = max(min(nxt[0], hi) - max(t, lo), 0.0)
            acc[0] += p * span
            acc[1] += d * span
        out.append((round(acc[0] / 3600, 1), round(acc[1] / 3600, 1)))
    return out


def misses(r: Result, trace, timeline: list, bin_s: float = 600.0) -> list[dict]:
    """The 10-minute bins of the day with the most requests out of the SLOs, worst first (five)."""
    day = trace.at >= 0
    at = trace.at[day]
    bad = ~((r.ttft[day] <= CONFIG.ttft_s) & (r.tpot[day] <= CONFIG.tpot_s))
    bins = (at // bin_s).astype(int)
    n = np.bincount(bins)
    missed = np.bincount(bins, weights=bad.astype(float), minlength=len(n))
    out = []
    for b in np.argsort(-missed)[:5]:
        if missed[b] == 0:
            break
        t = b * bin_s
        m = (bins == b)
        ttft_bad = float((r.ttft[day][m] > CONFIG.ttft_s).mean())
        p, d = next(((p, d) for x, p, d in reversed(timeline) if x <= t), timeline[0][1:])
        out.append({"from": _hhmm(t), "requests": int(n[b]), "missed": int(missed[b]),
                    "ttft_missed_share": round(ttft_bad, 3), "tpot_missed_share":
                    round(float((r.tpot[day][m] > CONFIG.tpot_s).mean()), 3),
                    "replicas_at_start": f"{p}:{d}"})
    return out


def _hhmm(t: float) -> str:
    return f"{int(t // 3600):02d}:{int(t % 3600 // 60):02d}"


class Search:
    """Fixed allocations evaluated once each (in the pool's processes), searched for the fewest GPUs. In
    the model a prompt's TTFT does not depend on the decode pool, so the prefill pool's lower bound comes
    from prefill-only runs (``P:0``, TTFT alone); the decode pool's from runs with ``BIG`` prefill."""

    def __init__(self, seed: int, hours: float, pool: ProcessPoolExecutor) -> None:
        self.seed, self.hours, self.pool = seed, hours, pool
        self.done: dict[tuple[int, int], dict] = {}

    def eval(self, pairs) -> None:
        todo = sorted({pd for pd in pairs if pd not in self.done})
        futs = {pd: self.pool.submit(fixed, self.seed, self.hours, *pd) for pd in todo}
        for pd, f in futs.items():
            self.done[pd] = f.result()

    def ok(self, pd: tuple[int, int], target: float) -> bool:
        return self.done[pd]["attainment"] >= target

    def bounds(self, target: float) -> tuple[int | None, int | None]:
        """The smallest P (TTFT alone) and the smallest D (prefill unbounded) reaching ``target``: no
        fixed allocation below either does. Both bisections run in lockstep."""
        key = {"p": lambda x: (x, 0), "d": lambda x: (BIG, x)}
        spans = {k: [1, BIG] for k in key}
        self.eval(key[k](BIG) for k in key)
        if not all(self.ok(key[k](BIG), target) for k in key):
            return None, None
        while any(lo < hi for lo, hi in spans.values()):
            mids = {k: (lo + hi) // 2 for k, (lo, hi) in spans.items() if lo < hi}
            self.eval(key[k](m) for k, m in mids.items())
            for k, m in mids.items():
                spans[k] = [spans[k][0], m] if self.ok(key[k](m), target) else [m + 1, spans[k][1]]
        return spans["p"][1], spans["d"][1]

    def one_to_one(self, target: float) -> int | None:
        p_min, d_min = self.bounds(target)
        if p_min is None or d_min is None:
            return None
        for n in range(max(p_min, d_min), BIG + 1):
            self.eval([(n, n)])
            if self.ok((n, n), target):
                return n
        return None

    def best(self, target: float) -> dict | None:
        p_min, d_min = self.bounds(target)
        if p_min is None or d_min is None:
            return None
        for total in range(p_min + d_min, 2 * BIG + 1):
            splits = [(p, total - p) for p in range(p_min, total - d_min + 1)]
            self.eval(splits)
            good = [self.done[s] for s in splits if self.ok(s, target)]
            if good:
                return max(good, key=lambda r: r["attainment"])
        return None


def run_seed(seed: int, hours: float, pool: ProcessPoolExecutor) -> dict:
    plans = {w: pool.submit(planned, seed, hours, w) for w in PLANNERS}
    search = Search(seed, hours, pool)
    n = search.one_to_one(TARGET)
    rows: list[dict] = []
    if n is not None:
        search.eval([(n - 1, n - 1)] if n > 1 else [])
        rows += [dict(search.done[(m, m)], policy=f"fixed 1:1 ({m}:{m})") for m in (n - 1, n) if m >= 1]
    best = search.best(TARGET)
    if best is not None:
        rows.append(dict(best, policy=f"best fixed ({best['prefill']}:{best['decode']})"))
    for f in plans.values():
        r = f.result()
        same = search.best(r["attainment"]) if best is not None and r["attainment"] > TARGET else best
        r["vs_best_fixed"] = round(r["gpu_hours"] / best["gpu_hours"], 3) if best else None
        if same is not None:
            r["best_fixed_at_same_attainment"] = {k: same[k] for k in ("prefill", "decode", "gpu_hours",
                                                                       "attainment")}
            r["vs_best_fixed_at_same_attainment"] = round(r["gpu_hours"] / same["gpu_hours"], 3)
        ratio = r.get("vs_best_fixed_at_same_attainment")
        r["goal_met"] = bool(r["attainment"] >= TARGET and ratio is not None and ratio <= 0.8)
        rows.append(r)
    trace = _trace(seed, hours)
    return {"seed": seed, "requests": int((trace.at >= 0).sum()), "bursts": [
        {"at": _hhmm(t), "minutes": round(m, 1), "factor": round(f, 2)} for t, m, f in trace.bursts],
        "hourly": hourly(trace), "rows": rows, "evaluated_fixed": sorted(
            ({"prefill": p, "decode": d, "attainment": r["attainment"]} for (p, d), r in search.done.items()),
            key=lambda x: (x["prefill"], x["decode"]))}


def hourly(trace) -> list[dict]:
    """Per hour of the day: requests/s, mean prompt and answer, the kinds' shares."""
    out = []
    day = trace.at >= 0
    h = (trace.at[day] // 3600).astype(int)
    for hour in range(int(h.max()) + 1 if len(h) else 0):
        m = h == hour
        kinds = np.bincount(trace.kind[day][m], minlength=len(KINDS)) / max(m.sum(), 1)
        out.append({"hour": hour, "rps": round(float(m.sum()) / 3600, 2),
                    "prompt": round(float(trace.prompt[day][m].mean()), 0),
                    "answer": round(float(trace.answer[day][m].mean()), 0),
                    **{k: round(float(s), 2) for k, s in zip(KINDS, kinds, strict=True)}})
    return out


def table(seeds: list[dict]) -> list[str]:
    """One row per policy and seed; the last two columns are the goal's: GPU-hours over the best fixed
    allocation reaching 99%, and over the best fixed one reaching the planner's own attainment."""
    lines = ["| seed | policy | GPU-hours | attainment | TTFT p50 / p99 s | TPOT p50 / p99 ms | scale "
             "actions | / best fixed | / best fixed at same attainment |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for s in seeds:
        best = next((r for r in s["rows"] if r["policy"].startswith("best")), None)
        for r in s["rows"]:
            ratio = f"{r['gpu_hours'] / best['gpu_hours']:.2f}" if best else "-"
            same = r.get("best_fixed_at_same_attainment")
            goal = "-" if same is None else (
                f"{r['vs_best_fixed_at_same_attainment']:.2f} (vs {same['prefill']}:{same['decode']}, "
                f"{same['attainment']:.2%}): goal {'met' if r['goal_met'] else 'NOT met'}")
            lines.append(f"| {s['seed']} | {r['policy']} | {r['gpu_hours']:.0f} | {r['attainment']:.2%} | "
                         f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | {r['tpot_p50_ms']:.1f} / "
                         f"{r['tpot_p99_ms']:.1f} | {r['scale_actions']} | {ratio} | {goal} |")
    return lines


def commit() -> str:
    """The commit the tree is at, noting when this simulation's own files differ from it (the result
    then comes from the working tree, not from the commit alone)."""
    if bench_commit():
        return bench_commit()
    here = Path(__file__).resolve().parent
    git = lambda *a: subprocess.run(["git", "-C", str(here), *a], capture_output=True,
                                    text=True).stdout.strip()
    dirty = git("status", "--porcelain", "--", "planner_day.py", "planner_day_model.py", "planner_day_sim.py")
    return git("rev-parse", "--short", "HEAD") + (" + uncommitted bench/planner_day*.py" if dirty else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--seed", type=int, action="append", help="repeat for several (default 1, 2, 3)")
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--jobs", type=int, default=2, help="processes running simulations side by side")
    args = ap.parse_args()
    seeds = args.seed or [1, 2, 3]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = []
        for s in seeds:
            results.append(run_seed(s, args.hours, pool))
            print("\n".join(table(results[-1:])), flush=True)
    lines = table(results)
    res = {"what": "day-long simulation: fixed 1:1, best fixed in hindsight, the planner", "date":
           dt.date.today().isoformat(), "command": bench_command(), "commit": commit(), "hours": args.hours,
           "target": TARGET, "slo": {"ttft_s": CONFIG.ttft_s, "tpot_s": CONFIG.tpot_s},
           "planner_config": vars(CONFIG), "capacity": _capacity().to_dict(),
           "planner_seeds": {k: vars(v) for k, v in planner_seeds().items()}, "seeds": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{res['date']}-cpu-planner-day"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(res))
    print("\n".join(lines))
    print(f"wrote {stem}.json and .md")


def markdown(res: dict) -> str:
    """The result's page: the command and commit, what drove it, the table."""
    c, seeds, slo = res["planner_config"], res["seeds"], res["slo"]
    names = ", ".join(str(s["seed"]) for s in seeds)
    bounds = f"{c['min_prefill']}..{c['max_prefill']} prefill, {c['min_decode']}..{c['max_decode']} decode"
    return "\n".join([
        f"# Day-long planner simulation ({res['hours']:g} h, seeds {names})", "",
        f"`{res['command']}` at commit {res['commit']}", "",
        f"SLOs TTFT {slo['ttft_s']:g} s, TPOT {slo['tpot_s'] * 1e3:g} ms (a request attains when it meets "
        f"both); target {res['target']:.0%}; planner bounds {bounds}, its other knobs at their defaults; "
        "workers ready 60-120 s after a scale-up, drained on a scale-down. Per-GPU capacity (one H200, "
        f"llama3-8b shape) from {', '.join(res['capacity']['sources'])}.", "",
        *table(seeds), ""])


if __name__ == "__main__":
    main()
