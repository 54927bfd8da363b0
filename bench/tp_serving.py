"""Tensor-parallel serving modes side by side under the log-normal mixed workload, behind one router each.

Shared by ``bench/gpu_tp.py --serving`` (2 GPUs: 1P(TP1) -> 1D(TP1) vs one TP-2 colocated worker) and
``bench/gpu_tp4.py`` (4 GPUs: 1P(TP2) -> 1D(TP2), 1P(TP1) -> 1D(TP2), with the 2-GPU modes beside them).
Every mode is a cluster of the shared catalogue (``pdserve.app.loadgen.modes``), swept over the same
rates with the same prompts by ``pdserve.app.loadgen.compare.run_modes``; the workload, SLOs and router
flags are ``bench/gpu_frontier.py``'s (prompts log-normal, median 2048, sigma 0.8, 256..8192; outputs
uniform 64..384; TTFT <= 2 s, TPOT <= 25 ms; ``--max-queue-wait-s 1.5``). The table adds each mode's
GPU count and SLO goodput per GPU, the fair comparison between clusters of different sizes.

``cpu_check=True`` runs the same modes on this host's CPU (gloo between ranks, KV over NIXL with UCX on
TCP) with the tiny model and a scaled-down workload: it proves the scripts and the clusters, not speed.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

CPU_WORKLOAD = ("lognormal:48:0.6:8:160", "uniform:4:16")
CPU_RATES, CPU_SECONDS = (1.0, 2.0), 4.0
GPU_RATES, GPU_SECONDS = (4.0, 7.0, 10.0, 13.0, 16.0), 12.0
MODE_GPUS = {"1p1d": 2, "colocated-tp2": 2, "1p1d-tp2": 4, "1p1d-tp1-tp2": 3, "colocated": 2}


def _options(cpu_check: bool, model: str, n_gpus: int):
    from gpu_disagg import kv_memory_gb, mode_options

    from pdserve.app.loadgen.modes import ModeOptions

    router = ("--max-queue-wait-s", "1.5")
    if cpu_check:
        return ModeOptions(model=model, worker_args=("--device", "cpu", "--num-blocks", "512"), gpus=0,
                           transport="nixl", router_args=router, colocated_workers=2, drain_timeout=10.0)
    return mode_options(model, n_gpus=n_gpus, kv_gb=kv_memory_gb("llama3-8b"), transport="nixl",
                        router_args=router)


def _model(cpu_check: bool, models: Path) -> str:
    if cpu_check:
        from engine.checkpoint import preset_config, write_random_checkpoint

        path = models / "tiny"
        if not (path / "config.json").is_file():
            write_random_checkpoint(path, preset_config("tiny"), seed=0)
        return str(path)
    from gpu_disagg import write_checkpoint

    return str(write_checkpoint(models / "llama3-8b", "llama3-8b"))


def table(results: dict[str, dict], summary: dict) -> str:
    from pdserve.app.loadgen.sweep import table as sweep_table

    lines = [sweep_table(results), "", f"{'mode':<16}{'GPUs':>5}{'SLO goodput req/s':>19}{'per GPU':>9}"
             f"{'vs ' + summary['baseline']:>16}{'blocks back':>13}"]
    for mode, row in summary["modes"].items():
        gpus = MODE_GPUS.get(mode, 0)
        ratio = row.get("slo_goodput_over_baseline")
        per_gpu = row["slo_goodput_rps"] / gpus if gpus else float("nan")
        lines.append(f"{mode:<16}{gpus:>5}{row['slo_goodput_rps']:>19.2f}{per_gpu:>9.2f}"
                     f"{'-' if ratio is None else f'{ratio:.2f}x':>16}{str(row['blocks_back']):>13}")
    for mode, r in results.items():
        if "error" in r:
            lines.append(f"{mode}: {r['error']}")
    return "\n".join(lines)


def run(modes: list[str], *, name: str, cpu_check: bool, out: Path, models: Path, tag: str = "",
        rates: tuple[float, ...] = (), seconds: float = 0.0, budget_s: float = 480.0) -> dict:
    """Sweep ``modes`` (the first is the baseline); prints the table and writes
    ``<name>-<device>-<date>.json``. ``budget_s`` (split evenly between the modes, start-up included)
    keeps one device command under its 10-minute limit: a mode past its share sweeps no further rate."""
    from gpu_frontier import INPUT_LEN, OUTPUT_LEN, SLO

    from pdserve.app.launcher.local import ucx_tcp_env
    from pdserve.app.loadgen.compare import frontier_summary, run_modes
    from pdserve.app.loadgen.dist import parse_dist
    from pdserve.app.loadgen.runner import RunConfig
    from pdserve.app.loadgen.sweep import SweepConfig
    from pdserve.settings import bench_command

    t0 = time.monotonic()
    import torch

    n_gpus = torch.cuda.device_count() if not cpu_check else 0
    model = _model(cpu_check, models)
    input_len, output_len = CPU_WORKLOAD if cpu_check else (INPUT_LEN, OUTPUT_LEN)
    rates = rates or (CPU_RATES if cpu_check else GPU_RATES)
    seconds = seconds or (CPU_SECONDS if cpu_check else GPU_SECONDS)
    cfg = SweepConfig(rates=tuple(rates), seconds_per_rate=seconds, min_requests=4 if cpu_check else 16,
                      target=0.95, stop_below=0.0 if cpu_check else 0.5, label="tp-lognormal",
                      ttft_slo_ms=60_000.0 if cpu_check else SLO["ttft_slo_ms"],
                      tpot_slo_ms=5_000.0 if cpu_check else SLO["tpot_slo_ms"])
    base = RunConfig(router="", rate=1.0, num_requests=1, input_len=parse_dist(input_len),
                     output_len=parse_dist(output_len), vocab_size=1000, timeout_s=300.0)
    env = {"OMP_NUM_THREADS": "1" if cpu_check else "4", "TOKENIZERS_PARALLELISM": "false",
           **(ucx_tcp_env() if cpu_check else {})}
    out.mkdir(parents=True, exist_ok=True)
    device = "cpu-check" if cpu_check else torch.cuda.get_device_name(0).replace(" ", "-").lower()
    path = out / f"{name}-{device}-{dt.date.today().isoformat()}{'-' + tag if tag else ''}.json"
    res = {"benchmark": name, "device": device, "gpus": n_gpus, "modes": modes,
           "command": bench_command(),
           "date": dt.datetime.now(dt.timezone.utc).isoformat(), "model": model,
           "workload": {"input_len": input_len, "output_len": output_len}, "rates": list(rates),
           "seconds_per_rate": seconds, "slo": {"ttft_ms": cfg.ttft_slo_ms, "tpot_ms": cfg.tpot_slo_ms},
           "results": {}}

    def save(mode: str | None = None, r: dict | None = None) -> None:
        if mode is not None:
            res["results"][mode] = r
        res["summary"] = frontier_summary(res["results"], modes[0])
        path.write_text(json.dumps(res, indent=1, default=float) + "\n")

    opts = _options(cpu_check, model, n_gpus)
    run_modes(modes, opts, base, cfg, run_dir=out / f"{name}-logs", env=env, progress=False,
              warm_input_lens=(16,) if cpu_check else (64, 2048, 8000), on_mode=save,
              budget_s=float("inf") if cpu_check else budget_s)
    save()
    print(table(res["results"], res["summary"]))
    print(f"wrote {path} in {time.monotonic() - t0:.0f} s")
    return res
