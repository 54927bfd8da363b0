"""Disaggregated vs colocated on the same two GPUs, all behind one router, under ``pdserve bench`` load.

Every mode is a ``pdserve up --launcher process`` cluster (``pdserve.app.launcher.cluster.Cluster``), so
the router, placement and metrics are the same code in each; only the workers differ:

* **disaggregated**: 1 prefill (GPU0) + 1 decode (GPU1), KV over NIXL VRAM to VRAM, policy prefix.
* **conditional**: the same 1P1D with ``--conditional-disagg auto`` (router/conditional.py) at its
  defaults: prompts whose uncached part is <= 256 tokens, whose KV would take longer to move than to
  recompute, or that would queue more than 0.5 s at the prefill worker are prefilled by the decode
  worker, within a budget of 25% of its time (at most 0.25 s at once).
* **colocated**: 2 colocated workers (one per GPU) behind the router (``--mode colocated``, what
  ``pdserve up --colocated 2`` starts) with the engine's default chunked-prefill budget (2048 tokens
  per step); the router places each request on one of them.
* **colocated-chunk512**: the same with a 512-token budget, the latency-tuned colocated setting
  (shorter prefill stalls in more decode steps): the stronger baseline for p99, the weaker for p90.

The prefill pool is compute-tuned (``--prefill-args "--max-num-batched-tokens 8192"``: a 4k prompt in
one step, nothing to protect there); decode and colocated workers keep the engine defaults otherwise.
On 4k prompts the conditional mode differs from 1P1D only by the queue rule: what the one prefill
GPU cannot take within 0.5 s goes to the decode GPU, up to its budget.
Every rate point draws its own prompts (seeded by workload and rate, the same prompts in every mode):
reusing one seed let the prefix cache answer every later point's prompts without any prefill.

Devices come from ``pdserve.app.launcher.devices`` (``--gpu-peers``): each worker computes on its own
GPU and sees the other one after it (``CUDA_VISIBLE_DEVICES=1,0`` for the GPU1 worker) so UCX's
cuda_ipc can map the peer's memory. With one GPU everything shares GPU0 (a functional check only).
Workloads: (a) long prompts (4096 in, 256 out), where prefill interferes with colocated decode, and
(b) a short-prompt control (256 in, 128 out). Metrics from ``pdserve.app.loadgen.stats.summarize``:
TTFT/ITL/TPOT/E2E p50/p90/p99, output tokens/s (per GPU = /2), goodput under TTFT <= 2 s and
TPOT <= 50 ms. ITL samples are kept for the plot. ``python3 bench/gpu_disagg.py --dry-run`` prints
the clusters it would start (roles, devices, router flags) and the rate points, without a GPU.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import shutil
import time
import zlib
from pathlib import Path

import torch

WORKLOADS = {  # name: (input_len, output_len, rates req/s over both GPUs, seconds of arrivals per point)
    # 1P1D's prefill GPU computes a 4k prompt of the 8B shape in ~107 ms: ~9 prompts/s at most. Sessions
    # 2-3 measured 2-9 req/s with 72 requests a point: 8 s of arrivals and a 2 s drain without prefills
    # left the colocated p90 ITL on its knee (8 req/s: 52 ms, 9 req/s: 9 ms). 22 s of arrivals make the
    # steady state most of each point; 7-10 req/s is where colocated decode steps carry a prefill chunk
    # about one time in ten or more (the p90 knee) and the one prefill GPU nears saturation.
    "long_prompt": ("4096", "256", (7.0, 8.5, 10.0), 22.0),
    "short_prompt": ("256", "128", (8.0, 16.0, 32.0), 6.0),
}
SLO = {"ttft_slo_ms": 2000.0, "tpot_slo_ms": 50.0}


def write_checkpoint(out: Path, preset: str) -> Path:
    """A random bf16 checkpoint of ``preset`` in HF layout, weights drawn on the GPU (seconds, not
    minutes, for 8B), 4 GiB shards; config, generation config and tokenizer from engine.checkpoint."""
    from safetensors.torch import save_file

    from engine.checkpoint import _write_json, parameter_shapes, preset_config, write_tokenizer

    if (out / "config.json").exists():
        return out
    cfg = preset_config(preset, dtype="bfloat16")
    out.mkdir(parents=True, exist_ok=True)
    shard, size, idx, weight_map = {}, 0, 0, {}
    g = torch.Generator(device="cuda").manual_seed(0)

    def flush():
        nonlocal shard, size, idx
        if shard:
            idx += 1
            name = f"model-{idx:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    for name, shape in parameter_shapes(cfg):
        t = torch.randn(shape, generator=g, device="cuda", dtype=torch.float32)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * t
        elif len(shape) == 2 and "embed_tokens" not in name:
            t = t / math.sqrt(shape[1])
        shard[name] = t.to(torch.bfloat16).cpu()
        size += shard[name].numel() * 2
        if size > 4 << 30:
            flush()
    flush()
    _write_json(out / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})
    _write_json(out / "config.json", cfg.to_hf_dict())
    _write_json(out / "generation_config.json", {"bos_token_id": cfg.bos_token_id,
                                                 "eos_token_id": list(cfg.eos_token_ids)})
    write_tokenizer(out, max_length=cfg.max_position_embeddings)
    return out


MODES = ("disaggregated", "conditional", "colocated", "colocated-chunk512")
# Diagnostic modes, run only when named (PDSERVE_DISAGG_MODES / --disagg-modes): 1P1D with the KV sent in
# one piece after the prefill instead of layer by layer during it.
EXTRA_MODES = ("disaggregated-oneshot",)
BASELINES = ("colocated", "colocated-chunk512")
MODE_WORKLOADS = {"disaggregated-oneshot": ("long_prompt",)}
PREFILL_POOL_ARGS = ("--max-num-batched-tokens", "8192")
BENCH_ENV = {"OMP_NUM_THREADS": "4", "TOKENIZERS_PARALLELISM": "false"}


def _worker_args(kv_gb: float) -> tuple[str, ...]:
    # Engine defaults otherwise (chunked prefill budget 2048 tokens per step), the same for every role;
    # the launcher adds --model, --transport and --worker-id.
    return ("--device", "cuda", "--dtype", "bfloat16", "--kv-memory-gb", str(kv_gb), "--max-num-seqs", "64")


# This benchmark's mode names -> the shared catalogue's (pdserve/app/loadgen/modes.py).
CATALOGUE = {"disaggregated": "1p1d", "conditional": "conditional", "colocated": "colocated",
             "colocated-chunk512": "colocated-chunk512", "disaggregated-oneshot": "1p1d-oneshot"}


def mode_options(model: str | Path, *, n_gpus: int, kv_gb: float, transport: str = "nixl",
                 router_args: tuple[str, ...] = ()):
    """The GPU runs' options: the same worker flags for every role, a compute-tuned prefill pool, each
    worker on its own GPU (one GPU: all share it), 2 colocated workers on 2 GPUs."""
    from pdserve.app.loadgen.modes import ModeOptions

    return ModeOptions(model=str(model), worker_args=_worker_args(kv_gb), prefill_args=PREFILL_POOL_ARGS,
                       router_args=router_args, gpus=max(n_gpus, 1), colocated_workers=2, transport=transport,
                       drain_timeout=30.0)


def cluster_specs(model: str | Path, *, n_gpus: int, kv_gb: float, transport: str = "nixl",
                  modes: tuple[str, ...] = MODES) -> dict:
    """mode -> ClusterSpec: which workers, on which GPUs, with which router flags (no GPU needed)."""
    from pdserve.app.loadgen.modes import cluster_spec

    opts = mode_options(model, n_gpus=n_gpus, kv_gb=kv_gb, transport=transport)
    return {m: cluster_spec(CATALOGUE[m], opts) for m in modes}


def describe(specs: dict) -> dict:
    """What each mode's cluster runs (``modes.describe``) and which workloads it is measured on."""
    from pdserve.app.loadgen.modes import describe as describe_specs

    out = describe_specs(specs)
    for mode, d in out.items():
        d["workloads"] = list(MODE_WORKLOADS.get(mode, WORKLOADS))
    return out


def _load(address: str, workload: str, rate: float, n: int, seed: int, vocab: int):
    from pdserve.app.loadgen.dist import parse_dist
    from pdserve.app.loadgen.runner import RunConfig, run

    inp, outp = WORKLOADS[workload][:2]
    return run(RunConfig(router=address, rate=rate, num_requests=n, input_len=parse_dist(inp),
                         output_len=parse_dist(outp), vocab_size=vocab, seed=seed, timeout_s=240.0))


def rate_points(workloads: dict, quick: bool = False) -> list[tuple[str, float, int]]:
    """(workload, rate, requests) per point: the rate times the workload's seconds of arrivals."""
    return [(w, r, max(8, round(r * secs))) for w, (_, _, rates, secs) in workloads.items()
            for r in (rates[:1] if quick else rates)]


def point_seed(workload: str, rate: float) -> int:
    """The prompts' seed of one rate point: its own per point (no prefix-cache carry-over between
    points), the same in every mode (each mode is measured on the same prompts)."""
    return zlib.crc32(f"{workload}@{rate:g}".encode()) & 0xFFFFFF


def _sweep(addresses: list[str], points: list[tuple[str, float, int]], deadline: float, vocab: int) -> dict:
    """Run every (workload, rate, n) point against the servers (load split evenly across them)."""
    from pdserve.app.loadgen.stats import summarize

    out = {}
    for workload, rate, n in points:
        if time.monotonic() > deadline:
            out[f"{workload}@{rate:g}"] = {"status": "skipped: time budget"}
            continue
        k = len(addresses)

        async def both(workload=workload, rate=rate, n=n, k=k):
            return await asyncio.gather(*(_load(a, workload, rate / k, max(1, n // k),
                                                point_seed(workload, rate) + i, vocab)
                                          for i, a in enumerate(addresses)))

        t0 = time.perf_counter()
        runs = asyncio.run(both())
        samples = [s for ss, _ in runs for s in ss]
        duration = max(d for _, d in runs)
        summary = summarize(samples, duration, **SLO)
        gaps = [round(g * 1e3, 3) for s in samples if s.ok for g in s.itl_s]
        summary["itl_samples_ms"] = gaps[::-(-len(gaps) // 5000)] if gaps else []  # every k-th: <= 5000
        summary["wall_s"] = time.perf_counter() - t0
        out[f"{workload}@{rate:g}"] = summary
        print(f"    {workload} @ {rate:g} req/s: ttft p90 {summary['ttft_ms']['p90']:.0f} ms, itl p90 "
              f"{summary['itl_ms']['p90']:.1f} ms, goodput {summary['goodput']:.2f} req/s, errors "
              f"{summary['num_errors']}", flush=True)
    return out


def bench_disagg(out: str | Path, *, quick: bool = False, preset: str = "llama3-8b",
                 budget_s: float | None = None, modes: tuple[str, ...] | None = None) -> dict:
    from pdserve.app.launcher.backends import ProcessBackend
    from pdserve.app.launcher.cluster import Cluster

    out = Path(out)
    t_start = time.monotonic()
    budget = budget_s if budget_s is not None else float(os.environ.get("PDSERVE_DISAGG_BUDGET_S", "540"))
    modes = modes or tuple(m for m in os.environ.get("PDSERVE_DISAGG_MODES", ",".join(MODES)).split(",") if m)
    n_gpus = torch.cuda.device_count()
    shm_free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    root = "/dev/shm" if shm_free > (40 << 30) else "/tmp"  # RAM-backed when it has room for 16 GB
    model_dir = os.environ.get("PDSERVE_BENCH_MODEL_DIR", f"{root}/pdserve-{preset}")
    model = write_checkpoint(Path(model_dir), preset)
    ckpt_s = time.monotonic() - t_start
    vocab = 1000
    points = rate_points(WORKLOADS, quick)
    transport = "nixl"
    kv_gb = kv_memory_gb(preset)
    specs = cluster_specs(model, n_gpus=n_gpus, kv_gb=kv_gb, transport=transport, modes=modes)
    res = {"preset": preset, "gpus": n_gpus, "checkpoint_s": ckpt_s, "slo": SLO, "transport": transport,
           "workloads": {k: {"input": v[0], "output": v[1]} for k, v in WORKLOADS.items()},
           "modes": describe(specs),
           "colocated_routing": "one router in front of the colocated workers (--mode colocated)"}
    logs = out / "disagg-logs"
    logs.mkdir(exist_ok=True)
    share = (budget - ckpt_s) / max(len(specs), 1)
    for i, (mode, spec) in enumerate(specs.items()):
        backend = ProcessBackend(logs / mode, dict(BENCH_ENV))
        cluster = Cluster(spec=spec, backend=backend, run_dir=logs / mode)
        try:
            t0 = time.monotonic()
            router = cluster.up()
            res[f"{mode}_startup_s"] = time.monotonic() - t0
            print(f"  {mode} up in {res[f'{mode}_startup_s']:.0f} s", flush=True)
            asyncio.run(_warm(router, vocab))
            mine = [p for p in points if p[0] in MODE_WORKLOADS.get(mode, WORKLOADS)]
            res[mode] = _sweep([router], mine, t_start + ckpt_s + share * (i + 1), vocab)
        except Exception as exc:
            res[f"{mode}_error"] = f"{type(exc).__name__}: {exc}"
            print(f"  {mode} failed: {exc}", flush=True)
        finally:
            cluster.down()
    res["comparison"] = compare(res)
    res["markdown"] = markdown(res)
    try:
        plot_itl(res, out / "itl-disagg-vs-colocated.png")
        res["plot"] = "itl-disagg-vs-colocated.png"
    except Exception as exc:  # the numbers matter more than the picture
        res["plot_error"] = repr(exc)
    return res


def kv_memory_gb(preset: str, workers_per_gpu: int = 1) -> float:
    """KV cache per worker: what the GPU holds beside the 8B weights (16 GB) and ~12 GB of activations,
    CUDA graphs and allocator slack, at most 80 GB (H200: 80, H100: ~44). The same for every role and
    mode. A fixed 30 GB held 56 requests of 4k+256 tokens, which the decode GPU of a 1P1D cluster
    outgrew at 10 req/s (its Allocate refused; colocated workers hold half the load each).
    ``workers_per_gpu`` workers sharing the GPU (1P1D on one GPU) each keep their own weights and
    activations and get an equal share of the rest."""
    if preset != "llama3-8b":
        return 4.0
    total = torch.cuda.get_device_properties(0).total_memory / 1e9
    return float(max(8, min(80, int((total * 0.9 - 28 * workers_per_gpu) / workers_per_gpu))))


async def _warm(address: str, vocab: int) -> None:
    from pdserve.app.loadgen.dist import parse_dist
    from pdserve.app.loadgen.runner import RunConfig, run

    # Both prompt shapes once (cold kernels and allocator growth stay out of the first rate point).
    for n in ("64", WORKLOADS["long_prompt"][0]):
        await run(RunConfig(router=address, rate=float("inf"), num_requests=2, input_len=parse_dist(n),
                            output_len=parse_dist("4"), vocab_size=vocab, seed=random.randrange(1 << 20)))


def compare(res: dict) -> dict:
    """Per matching (workload, rate), each disaggregated mode against each colocated baseline: p90 ITL
    colocated / mode, goodput, tokens/s per GPU, p90 TTFT. Keys: ``workload@rate`` (1P1D vs colocated),
    ``conditional:workload@rate``, and `` vs colocated-chunk512`` appended for the other baseline."""
    out = {}
    for base in BASELINES:
        c = res.get(base) or {}
        suffix = "" if base == "colocated" else f" vs {base}"
        for mode, prefix in (("disaggregated", ""), ("conditional", "conditional:")):
            d = res.get(mode) or {}
            for key in d:
                a, b = d[key], c.get(key)
                if not b or "itl_ms" not in a or "itl_ms" not in b:
                    continue
                out[prefix + key + suffix] = {
                    "baseline": base,
                    "p90_itl_colocated_over_disagg": b["itl_ms"]["p90"] / a["itl_ms"]["p90"],
                    "p99_itl_colocated_over_disagg": b["itl_ms"]["p99"] / a["itl_ms"]["p99"],
                    "goodput_disagg": a["goodput"], "goodput_colocated": b["goodput"],
                    # requests within the SLOs, of num_requests (the same prompts in both)
                    "slo_met_disagg": num_good(a), "slo_met_colocated": num_good(b),
                    "num_requests": a.get("num_requests"),
                    "tokens_per_s_per_gpu_disagg": a["output_token_throughput"] / 2,
                    "tokens_per_s_per_gpu_colocated": b["output_token_throughput"] / 2,
                    "p90_ttft_ms_disagg": a["ttft_ms"]["p90"], "p90_ttft_ms_colocated": b["ttft_ms"]["p90"]}
    return out


def num_good(summary: dict) -> int:
    """Requests within both SLOs (runs before num_good was recorded: goodput x duration)."""
    if "num_good" in summary:
        return int(summary["num_good"])
    return round(summary["goodput"] * summary.get("duration_s", 0.0))


def markdown(res: dict) -> list[str]:
    rows = ["| workload @ rate | mode | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | TPOT p90 ms | E2E p90 s | "
            "tok/s/GPU | within SLO | goodput req/s |", "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for mode in (*MODES, *EXTRA_MODES):
        for key, s in (res.get(mode) or {}).items():
            if "ttft_ms" not in s:
                rows.append(f"| {key} | {mode} | {s.get('status', '?')} | | | | | | |")
                continue
            t, i = s["ttft_ms"], s["itl_ms"]
            rows.append(f"| {key} | {mode} | {t['p50']:.0f}/{t['p90']:.0f}/{t['p99']:.0f} | "
                        f"{i['p50']:.1f}/{i['p90']:.1f}/{i['p99']:.1f} | {s['tpot_ms']['p90']:.1f} | "
                        f"{s['e2e_ms']['p90'] / 1e3:.2f} | {s['output_token_throughput'] / 2:.0f} | "
                        f"{num_good(s)}/{s.get('num_requests', '?')} | {s['goodput']:.2f} |")
    stages = [(mode, key, s["ttft_breakdown_ms"]) for mode in (*MODES, *EXTRA_MODES)
              for key, s in (res.get(mode) or {}).items() if s.get("ttft_breakdown_ms")]
    if stages:
        rows += ["", "Where a remotely prefilled request's first token went (p50/p90 ms, FinalInfo): "
                 "decode Allocate, the Prefill call, and inside it the prefill worker's engine queue, "
                 "compute, KV ack wait:", "",
                 "| workload @ rate | mode | allocate | prefill call | queue | compute | kv wait |",
                 "|---|---|---:|---:|---:|---:|---:|"]
        for mode, key, b in stages:
            cells = " | ".join(f"{b[k]['p50']:.0f}/{b[k]['p90']:.0f}" for k in
                               ("allocate_ms", "prefill_rpc_ms", "prefill_queue_ms", "prefill_compute_ms",
                                "kv_wait_ms"))
            rows.append(f"| {key} | {mode} | {cells} |")
    for key, c in res.get("comparison", {}).items():
        p99 = c.get("p99_itl_colocated_over_disagg", 0.0)
        rows.append(f"\n{key}: p90 ITL {c.get('baseline', 'colocated')}/disaggregated = "
                    f"{c['p90_itl_colocated_over_disagg']:.2f}x (p99 {p99:.2f}x), "
                    f"goodput {c['goodput_disagg']:.2f} vs {c['goodput_colocated']:.2f} req/s"
                    + (f" ({c['slo_met_disagg']} vs {c['slo_met_colocated']} of {c['num_requests']} within "
                       "the SLOs)" if "slo_met_disagg" in c else ""))
    for k in (f"{m}_error" for m in (*MODES, *EXTRA_MODES)):
        if k in res:
            rows.append(f"\n{k}: {res[k]}")
    return rows


def plot_itl(res: dict, path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, workload in zip(axes, WORKLOADS, strict=True):
        for mode, style in (("disaggregated", "-"), ("conditional", ":"), ("colocated", "--"),
                            ("colocated-chunk512", "-.")):
            for key, s in (res.get(mode) or {}).items():
                if key.startswith(workload) and s.get("itl_samples_ms"):
                    x = np.sort(np.asarray(s["itl_samples_ms"]))
                    label = f"{mode} {key.split('@')[1]}/s"
                    ax.plot(x, np.arange(1, len(x) + 1) / len(x), style, label=label)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks([3, 5, 7, 10, 15, 20, 30, 50, 70])
        ax.set_xlabel("inter-token latency (ms)")
        ax.set_ylabel("CDF")
        ax.set_title(f"{workload} ({WORKLOADS[workload][0]} in / {WORKLOADS[workload][1]} out)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":  # a functional run on any GPU machine: python3 bench/gpu_disagg.py OUT [preset]
    import sys

    if "--dry-run" in sys.argv:  # no GPU: what would run
        n = int(os.environ.get("PDSERVE_DRY_RUN_GPUS", "2"))
        plan = {"modes": describe(cluster_specs("MODEL", n_gpus=n, kv_gb=30.0)),
                "points": rate_points(WORKLOADS)}
        print(json.dumps(plan, indent=1))
        raise SystemExit(0)
    preset = sys.argv[2] if len(sys.argv) > 2 else "small"
    if preset == "small":  # 4096-token context: shorter prompts
        WORKLOADS.update(long_prompt=("2048", "128", (2.0,), 6.0), short_prompt=("256", "64", (4.0,), 4.0))
    r = bench_disagg(sys.argv[1], quick=True, preset=preset)
    print("\n".join(r["markdown"]))
    Path(sys.argv[1], "disagg.json").write_text(json.dumps(r, indent=1, default=str))
