"""Tensor-parallel pools on 4 GPUs, side by side under the log-normal mixed workload (run it as soon as a
4-GPU machine exists; ``--cpu-check`` proves it on CPU with gloo):

    python -m bench.gpu_tp4                 # 4 GPUs, llama3-8b shape
    python -m bench.gpu_tp4 --cpu-check     # tiny model on this host's CPU (gloo), a few seconds a point

Modes (``pdserve.app.loadgen.modes``), each its own cluster behind one router, the same prompts at the
same rates (``bench/tp_serving.py``):

    1p1d-tp2       1 prefill at TP 2 (GPUs 0-1) -> 1 decode at TP 2 (GPUs 2-3), KV rank to rank
    1p1d-tp1-tp2   1 prefill at TP 1 (GPU 0) -> 1 decode at TP 2 (GPUs 1-2): heterogeneous TP, each decode
                   rank gets its KV heads gathered on the prefill rank (docs/tensor-parallel.md)
    1p1d           1 prefill -> 1 decode at TP 1 (GPUs 0-1): the 2-GPU reference
    colocated-tp2  one TP-2 colocated worker (GPUs 0-1): the other 2-GPU reference

Per mode: p50/p90/p99 TTFT and ITL per rate, SLO attainment, SLO goodput and goodput per GPU, blocks
back afterwards. Writes ``gpu-tp4-<device>-<date>[-TAG].json`` under ``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

MODES = ("1p1d-tp2", "1p1d-tp1-tp2", "1p1d", "colocated-tp2")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=",".join(MODES), help="the first is the baseline of the ratios")
    ap.add_argument("--rates", default="", help="req/s, e.g. 4,8,12 (default: bench/tp_serving.py's)")
    ap.add_argument("--seconds", type=float, default=0.0, help="seconds of arrivals per rate")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="device seconds for all modes, start-up included (split evenly)")
    ap.add_argument("--models", default="/tmp/pdserve-models")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="")
    ap.add_argument("--cpu-check", action="store_true", help="tiny model on CPU (gloo), scaled-down load")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not args.cpu_check:
        import torch

        need = max({"1p1d-tp2": 4, "1p1d-tp1-tp2": 3}.get(m, 2) for m in modes)
        if torch.cuda.device_count() < need:
            print(f"bench.gpu_tp4: these modes need {need} GPUs, {torch.cuda.device_count()} visible")
            return 2
    from bench.tp_serving import run

    rates = tuple(float(r) for r in args.rates.split(",") if r)
    res = run(modes, name="gpu-tp4", cpu_check=args.cpu_check, out=Path(args.out), models=Path(args.models),
              tag=args.tag, rates=rates, seconds=args.seconds, budget_s=args.budget_s)
    return 0 if all("points" in r for r in res["results"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
