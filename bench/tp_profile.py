"""Where a decode step's time goes, at any TP size: host phases on rank 0 beside the GPU's kernels.

    python -m bench.gpu_tp --profile --runs llama3-8b:1,llama3-8b:2 --batches 1,64

For each batch the step is run ``steps`` times under ``torch.profiler`` (rank 0 only; a follower's
delay shows up on rank 0 as time inside the NCCL all-reduce kernels, which wait for their partner).
Reported per step (milliseconds): the wall time; the host's parts (scheduling, the step plan sent to
the other ranks, planning and launching the forward, sampling up to the first host read, the rest);
the GPU's busy time (the union of kernel intervals) and the kernels by name, grouped (GEMMs,
attention, all-reduce, norms and the rest), so a step that is not GPU-bound says where it waits.
The profiler's trace goes to ``trace_path`` (gzip'd Chrome JSON) when one is given.
"""

from __future__ import annotations

import gzip
import shutil
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

GROUPS = (("allreduce", ("allreduce", "all_reduce", "nccl")),
          ("attention", ("decode", "attention", "flashinfer", "prefill", "paged")),
          ("gemm", ("gemm", "sm90", "cutlass", "nvjet", "matmul", "xmma", "ampere", "cublas")),
          ("norm_rope_act", ("norm", "rope", "rotary", "silu", "act_and_mul")))


def _group(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other"


def _busy_ms(intervals: list[tuple[float, float]]) -> float:
    """The union of [start, end) kernel intervals (microseconds) in ms: time the GPU ran anything."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total, end = total + e - s, e
        elif e > end:
            total, end = total + e - end, e
    return total / 1e3


class _Timed:
    """Wraps a callable and sums its seconds (host phases of the step)."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *a, **kw):
        t = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.seconds += time.perf_counter() - t


def profile_steps(engine, steps: int, trace_path: Path | None = None) -> dict:
    """Profile ``steps`` calls of ``engine.step()`` (a decode batch already running in ``engine``)."""
    import engine.model_runner as mr

    runner = engine.runner
    sched = _Timed(engine.scheduler.schedule)
    send = _Timed(mr.send_step)
    engine.scheduler.schedule, mr.send_step = sched, send
    walls, launch, sync = [], [], []
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                walls.append((time.perf_counter() - t0) * 1e3)
                launch.append(runner.last_phases.get("launch_ms", 0.0))
                sync.append(runner.last_phases.get("sync_ms", 0.0))
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    finally:
        engine.scheduler.schedule, mr.send_step = sched.fn, send.fn
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    intervals = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        dur = ev.time_range.elapsed_us()
        intervals.append((ev.time_range.start, ev.time_range.end))
        k = kernels[ev.name]
        k[0] += dur / 1e3
        k[1] += 1
    if trace_path is not None:
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        raw = trace_path.with_suffix("")
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(trace_path, "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
    host_top = _host_functions(engine, steps)
    groups: dict[str, float] = defaultdict(float)
    for name, (ms, _n) in kernels.items():
        groups[_group(name)] += ms / steps
    wall = statistics.median(walls)
    host = {"schedule_ms": sched.seconds * 1e3 / steps, "send_plan_ms": send.seconds * 1e3 / steps,
            "launch_ms": statistics.median(launch), "sync_ms": statistics.median(sync)}
    host["other_ms"] = wall - sum(host.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:12]
    return {"steps": steps, "wall_ms": wall, "host": {k: round(v, 3) for k, v in host.items()},
            "gpu_busy_ms": round(_busy_ms(intervals) / steps, 3), "host_functions": host_top,
            "kernel_groups_ms": {k: round(v, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"name": n[:120], "ms_per_step": round(ms / steps, 3),
                             "calls_per_step": c / steps} for n, (ms, c) in top]}


def _host_functions(engine, steps: int, top: int = 25) -> list[dict]:
    """rank 0's Python functions by own time over ``steps`` more steps under cProfile (which slows
    Python-heavy code: the shares matter, not the absolute milliseconds)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{Path(f).name}:{line}:{name}", "calls_per_step": nc / steps,
             "own_ms_per_step": round(tt * 1e3 / steps, 3), "cum_ms_per_step": round(ct * 1e3 / steps, 3)}
            for (f, line, name), (_cc, nc, tt, ct, _callers) in rows]


def describe(prof: dict) -> str:
    h = prof["host"]
    g = "  ".join(f"{k} {v:.2f}" for k, v in prof["kernel_groups_ms"].items())
    fns = "".join(f"\n      {f['own_ms_per_step']:7.3f} own {f['cum_ms_per_step']:7.3f} cum  {f['function']}"
                  for f in prof.get("host_functions", [])[:12])
    return (f"wall {prof['wall_ms']:.2f} ms | host: schedule {h['schedule_ms']:.2f} send-plan "
            f"{h['send_plan_ms']:.2f} launch {h['launch_ms']:.2f} sync {h['sync_ms']:.2f} other "
            f"{h['other_ms']:.2f} | GPU busy {prof['gpu_busy_ms']:.2f}: {g}{fns}")
