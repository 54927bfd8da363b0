"""Disaggregated 1P1D vs colocated on the same two GPUs, under ``pdserve bench``'s Poisson load.

* **disaggregated**: a prefill worker on GPU0, a decode worker on GPU1 (KV over NIXL, VRAM to VRAM),
  one router (static discovery, prefix policy) — the ``pdserve serve`` processes ``pdserve up`` runs.
* **colocated**: one colocated server per GPU. The router cannot front colocated workers yet, so the
  load generator splits the arrivals itself: two Poisson streams at half the rate, one per server
  (what a perfect round-robin router would do), merged into one set of samples.

Each process sees both GPUs, its own first (``CUDA_VISIBLE_DEVICES=1,0`` for the GPU1 worker), so
``--device cuda`` lands on its GPU and UCX's cuda_ipc can still map the peer GPU's memory. With one
GPU everything shares GPU0 (a functional check only). Workloads: (a) long prompts (4096 in, 256
out), where prefill interferes with colocated decode, and (b) a short-prompt control (256 in, 128
out). Metrics from ``pdserve.loadgen.stats.summarize``: TTFT/ITL/TPOT/E2E p50/p90/p99, output tokens/s
(per GPU = /2), goodput under TTFT <= 2 s and TPOT <= 50 ms. ITL samples are kept for the plot.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import torch

WORKLOADS = {  # name: (input_len, output_len, rates req/s over both GPUs, requests per rate point)
    "long_prompt": ("4096", "256", (2.0, 4.0, 6.0), 30),
    "short_prompt": ("256", "128", (8.0, 16.0, 32.0), 64),
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


def _env(gpu: int, n_gpus: int) -> dict:
    order = [gpu] + [i for i in range(n_gpus) if i != gpu]
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, order)), "OMP_NUM_THREADS": "4",
            "TOKENIZERS_PARALLELISM": "false"}


def _worker_args(model: Path, kv_gb: float, transport: str) -> list[str]:
    # Engine defaults otherwise (chunked prefill budget 2048 tokens per step), the same for every role.
    return ["--model", str(model), "--device", "cuda", "--dtype", "bfloat16", "--kv-memory-gb", str(kv_gb),
            "--max-num-seqs", "64", "--transport", transport]


def _load(address: str, workload: str, rate: float, n: int, seed: int, vocab: int):
    from pdserve.loadgen.dist import parse_dist
    from pdserve.loadgen.runner import RunConfig, run

    inp, outp = WORKLOADS[workload][:2]
    return run(RunConfig(router=address, rate=rate, num_requests=n, input_len=parse_dist(inp),
                         output_len=parse_dist(outp), vocab_size=vocab, seed=seed, timeout_s=240.0))


def _sweep(addresses: list[str], points: list[tuple[str, float, int]], deadline: float, vocab: int) -> dict:
    """Run every (workload, rate, n) point against the servers (load split evenly across them)."""
    from pdserve.loadgen.stats import summarize

    out = {}
    for workload, rate, n in points:
        if time.monotonic() > deadline:
            out[f"{workload}@{rate:g}"] = {"status": "skipped: time budget"}
            continue
        k = len(addresses)

        async def both(workload=workload, rate=rate, n=n, k=k):
            return await asyncio.gather(*(_load(a, workload, rate / k, max(1, n // k), 100 + i, vocab)
                                          for i, a in enumerate(addresses)))

        t0 = time.perf_counter()
        runs = asyncio.run(both())
        samples = [s for ss, _ in runs for s in ss]
        duration = max(d for _, d in runs)
        summary = summarize(samples, duration, **SLO)
        summary["itl_samples_ms"] = [round(g * 1e3, 3) for s in samples if s.ok for g in s.itl_s][:5000]
        summary["wall_s"] = time.perf_counter() - t0
        out[f"{workload}@{rate:g}"] = summary
        print(f"    {workload} @ {rate:g} req/s: ttft p90 {summary['ttft_ms']['p90']:.0f} ms, itl p90 "
              f"{summary['itl_ms']['p90']:.1f} ms, goodput {summary['goodput']:.2f} req/s, errors "
              f"{summary['num_errors']}", flush=True)
    return out


def bench_disagg(out: str | Path, *, quick: bool = False, preset: str = "llama3-8b",
                 budget_s: float | None = None) -> dict:
    from pdserve.launcher.procs import spawn

    out = Path(out)
    t_start = time.monotonic()
    budget = budget_s if budget_s is not None else float(os.environ.get("PDSERVE_DISAGG_BUDGET_S", "420"))
    n_gpus = torch.cuda.device_count()
    shm_free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    root = "/dev/shm" if shm_free > (40 << 30) else "/tmp"  # RAM-backed when it has room for 16 GB
    model_dir = os.environ.get("PDSERVE_BENCH_MODEL_DIR", f"{root}/pdserve-{preset}")
    model = write_checkpoint(Path(model_dir), preset)
    ckpt_s = time.monotonic() - t_start
    vocab = 1000
    points = [(w, r, n) for w, (_, _, rates, n) in WORKLOADS.items() for r in (rates[:1] if quick else rates)]
    transport = "nixl"
    kv_gb = 30.0 if preset == "llama3-8b" else 4.0
    res = {"preset": preset, "gpus": n_gpus, "checkpoint_s": ckpt_s, "slo": SLO, "transport": transport,
           "workloads": {k: {"input": v[0], "output": v[1]} for k, v in WORKLOADS.items()},
           "colocated_routing": "client splits Poisson arrivals evenly across the two colocated servers"}
    logs = out / "disagg-logs"
    logs.mkdir(exist_ok=True)
    half = t_start + ckpt_s + (budget - ckpt_s) / 2
    # --- disaggregated 1P1D ---
    procs = []
    try:
        t0 = time.monotonic()
        pre = spawn("prefill", _worker_args(model, kv_gb, transport), logs / "prefill.log",
                    env=_env(0, n_gpus), timeout=300)
        procs.append(pre)
        dec = spawn("decode", _worker_args(model, kv_gb, transport), logs / "decode.log",
                    env=_env(1 % n_gpus, n_gpus), timeout=300)
        procs.append(dec)
        router = spawn("router", ["--model", str(model), "--prefill", pre.address, "--decode", dec.address,
                                  "--policy", "prefix"], logs / "router.log", timeout=120)
        procs.append(router)
        res["disaggregated_startup_s"] = time.monotonic() - t0
        print(f"  disaggregated up in {res['disaggregated_startup_s']:.0f} s", flush=True)
        asyncio.run(_warm(router.address, vocab))
        res["disaggregated"] = _sweep([router.address], points, half, vocab)
    except Exception as exc:
        res["disaggregated_error"] = f"{type(exc).__name__}: {exc}"
        print(f"  disaggregated failed: {exc}", flush=True)
    finally:
        for p in reversed(procs):
            p.stop(30)
    # --- colocated, one server per GPU ---
    procs = []
    try:
        t0 = time.monotonic()
        for gpu in range(max(n_gpus, 1))[:2]:
            procs.append(spawn("colocated", _worker_args(model, kv_gb, "tcp"), logs / f"colocated{gpu}.log",
                               env=_env(gpu, n_gpus), timeout=300))
        res["colocated_servers"] = len(procs)
        res["colocated_startup_s"] = time.monotonic() - t0
        for p in procs:
            asyncio.run(_warm(p.address, vocab))
        res["colocated"] = _sweep([p.address for p in procs], points, t_start + budget, vocab)
    except Exception as exc:
        res["colocated_error"] = f"{type(exc).__name__}: {exc}"
        print(f"  colocated failed: {exc}", flush=True)
    finally:
        for p in procs:
            p.stop(30)
    res["comparison"] = compare(res)
    res["markdown"] = markdown(res)
    try:
        plot_itl(res, out / "itl-disagg-vs-colocated.png")
        res["plot"] = "itl-disagg-vs-colocated.png"
    except Exception as exc:  # the numbers matter more than the picture
        res["plot_error"] = repr(exc)
    return res


async def _warm(address: str, vocab: int) -> None:
    from pdserve.loadgen.dist import parse_dist
    from pdserve.loadgen.runner import RunConfig, run

    # Both prompt shapes once (cold kernels and allocator growth stay out of the first rate point).
    for n in ("64", WORKLOADS["long_prompt"][0]):
        await run(RunConfig(router=address, rate=float("inf"), num_requests=2, input_len=parse_dist(n),
                            output_len=parse_dist("4"), vocab_size=vocab, seed=random.randrange(1 << 20)))


def compare(res: dict) -> dict:
    """Per matching (workload, rate): p90 ITL colocated / disaggregated, goodput and tokens/s per GPU."""
    d, c = res.get("disaggregated") or {}, res.get("colocated") or {}
    out = {}
    for key in d:
        a, b = d[key], c.get(key)
        if not b or "itl_ms" not in a or "itl_ms" not in b:
            continue
        out[key] = {"p90_itl_colocated_over_disagg": b["itl_ms"]["p90"] / a["itl_ms"]["p90"],
                    "goodput_disagg": a["goodput"], "goodput_colocated": b["goodput"],
                    "tokens_per_s_per_gpu_disagg": a["output_token_throughput"] / 2,
                    "tokens_per_s_per_gpu_colocated": b["output_token_throughput"] / 2,
                    "p90_ttft_ms_disagg": a["ttft_ms"]["p90"], "p90_ttft_ms_colocated": b["ttft_ms"]["p90"]}
    return out


def markdown(res: dict) -> list[str]:
    rows = ["| workload @ rate | mode | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | TPOT p90 ms | E2E p90 s | "
            "tok/s/GPU | goodput req/s |", "|---|---|---|---|---:|---:|---:|---:|"]
    for mode in ("disaggregated", "colocated"):
        for key, s in (res.get(mode) or {}).items():
            if "ttft_ms" not in s:
                rows.append(f"| {key} | {mode} | {s.get('status', '?')} | | | | | |")
                continue
            t, i = s["ttft_ms"], s["itl_ms"]
            rows.append(f"| {key} | {mode} | {t['p50']:.0f}/{t['p90']:.0f}/{t['p99']:.0f} | "
                        f"{i['p50']:.1f}/{i['p90']:.1f}/{i['p99']:.1f} | {s['tpot_ms']['p90']:.1f} | "
                        f"{s['e2e_ms']['p90'] / 1e3:.2f} | {s['output_token_throughput'] / 2:.0f} | "
                        f"{s['goodput']:.2f} |")
    for key, c in res.get("comparison", {}).items():
        rows.append(f"\n{key}: p90 ITL colocated/disaggregated = {c['p90_itl_colocated_over_disagg']:.2f}x, "
                    f"goodput {c['goodput_disagg']:.2f} vs {c['goodput_colocated']:.2f} req/s")
    for k in ("disaggregated_error", "colocated_error"):
        if k in res:
            rows.append(f"\n{k}: {res[k]}")
    return rows


def plot_itl(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, workload in zip(axes, WORKLOADS, strict=True):
        for mode, style in (("disaggregated", "-"), ("colocated", "--")):
            for key, s in (res.get(mode) or {}).items():
                if key.startswith(workload) and s.get("itl_samples_ms"):
                    x = np.sort(np.asarray(s["itl_samples_ms"]))
                    label = f"{mode} {key.split('@')[1]}/s"
                    ax.plot(x, np.arange(1, len(x) + 1) / len(x), style, label=label)
        ax.set_xscale("log")
        ax.set_xlabel("inter-token latency (ms)")
        ax.set_ylabel("CDF")
        ax.set_title(f"{workload} ({WORKLOADS[workload][0]} in / {WORKLOADS[workload][1]} out)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":  # a functional run on any GPU machine: python3 bench/gpu_disagg.py OUT [preset]
    import sys

    preset = sys.argv[2] if len(sys.argv) > 2 else "small"
    if preset == "small":  # 4096-token context: shorter prompts
        WORKLOADS.update(long_prompt=("2048", "128", (2.0,), 12), short_prompt=("256", "64", (4.0,), 16))
    r = bench_disagg(sys.argv[1], quick=True, preset=preset)
    print("\n".join(r["markdown"]))
    Path(sys.argv[1], "disagg.json").write_text(json.dumps(r, indent=1, default=str))
