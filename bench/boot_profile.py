"""Where a worker's start goes, before and between its timed boot phases (issue 19's "boot in seconds").

    python -m bench.boot_profile --model DIR [--device cuda] [--top 30] [--json OUT]

In a fresh process, timed one after the other: the interpreter's own start (the kernel's process start
to this module's first line), the imports a worker makes (torch, grpc, the engine, flashinfer, the
tokenizer library), CUDA's initialisation, then ``build_engine`` as ``pdserve serve`` runs it under
cProfile, with its boot phases (``pdserve.process_stats.BOOT``). Prints each step's seconds and the
functions with the most cumulative time inside ``build_engine``, and writes JSON. Run it twice on a
GPU: the first run also pays flashinfer's JIT compilation when its cache is cold.
"""

from __future__ import annotations

import time

T_MODULE = time.monotonic()

import argparse  # noqa: E402
import cProfile  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEPS = ("torch", "grpc", "tokenizers", "safetensors", "flashinfer", "engine.engine",
         "engine.flashinfer_backend", "pdserve.app.roles", "prefill_service.worker", "decode_service.worker",
         "kvtransfer")

# Imported by a worker only if something on its start path pulls them in (each costs ~1-2 s).
HEAVY = ("transformers", "torch._dynamo", "sympy", "torch._inductor", "triton")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--role", default="decode")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from pdserve.process_stats import BOOT  # noqa: PLC0415  (its t0 is the kernel's process start)

    steps = [("interpreter start -> this module", T_MODULE - BOOT.t0)]
    for name in STEPS:
        t = time.monotonic()
        try:
            importlib.import_module(name)
            steps.append((f"import {name}", time.monotonic() - t))
        except ImportError as exc:
            steps.append((f"import {name} (absent: {exc.name})", time.monotonic() - t))
    import torch  # noqa: PLC0415

    if args.device.startswith("cuda"):
        t = time.monotonic()
        torch.cuda.init()
        torch.empty(1, device=args.device)
        torch.cuda.synchronize()
        steps.append(("CUDA init + first allocation", time.monotonic() - t))

    from pdserve.app.roles import build_engine  # noqa: PLC0415
    from pdserve.settings import ServeSettings  # noqa: PLC0415

    settings = ServeSettings(role=args.role, model=args.model, device=args.device, host="127.0.0.1")
    prof = cProfile.Profile()
    t = time.monotonic()
    prof.enable()
    engine = build_engine(settings)
    prof.disable()
    steps.append(("build_engine", time.monotonic() - t))
    steps.append(("process start -> engine built", time.monotonic() - BOOT.t0))
    for label, seconds in steps:
        print(f"{seconds:8.3f} s  {label}", flush=True)
    heavy = [m for m in HEAVY if m in sys.modules]
    print("heavy modules a worker need not import, imported by now:", heavy or "none")
    phases = [{"name": p.name, "start_s": round(p.start_s, 3), "seconds": round(p.seconds, 3)}
              for p in BOOT.phases()]
    print("boot phases:", ", ".join(f"{p['name']} {p['seconds']}s @{p['start_s']}" for p in phases))
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(args.top)
    top = sorted(stats.stats.items(), key=lambda kv: kv[1][3], reverse=True)[:args.top]
    rows = [{"function": f"{f}:{line}({fn})", "cumulative_s": round(ct, 3), "own_s": round(tt, 3),
             "calls": nc} for (f, line, fn), (_cc, nc, tt, ct, _callers) in top]
    if args.json:
        out = {"steps": [{"step": s, "seconds": round(v, 3)} for s, v in steps], "heavy_imported": heavy,
               "phases": phases, "build_engine_top": rows}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    del engine


if __name__ == "__main__":
    main()
