"""What penalties and a logit bias cost a decode step, one engine (engine.penalties).

    bash bench/device_run.sh penalties                  # llama3-8b shape on one GPU, ~2 minutes
    python3 -m bench.penalty_cost --out DIR [--preset P] [--batches 1,16,64] [--context 1024]
    python3 -m bench.penalty_cost --out DIR --cpu-check  # tiny model on CPU, small shapes

``B`` running decodes of ``--context`` tokens of KV each (reserved and committed as a decode worker
receives them), then ``--steps`` decode steps, in the engine's default step mode (launched ahead on a
GPU). Configurations, alternated over ``--rounds`` rounds in the same process:

* ``none``: greedy, no penalties (no penalty state at all: the path every other request takes);
* ``penalized``: every row with frequency 0.5, presence 0.5, repetition 1.1 and a bias on 8 tokens,
  greedy (the statistics are stacked, applied and updated on the device each step);
* ``half``: half the rows penalized as above, half not (the mixed-batch gather and scatter).

ms per step is wall time over the steps; the overhead is against ``none`` in the same round. Writes
``penalty-cost-<device>-<date>.json`` and a markdown table to ``--out``; timings never fail it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.gpu_tp import _prompt, checkpoint
from engine.engine import EngineConfig, LLMEngine
from pdserve.sampling import SamplingParams
from pdserve.settings import bench_command, bench_commit

PENALIZED = dict(frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.1,
                 logit_bias={t: 1.0 for t in range(100, 108)})
# configuration -> (SamplingParams fields of row i, beyond the greedy decode every row runs)
CONFIGS: dict[str, Callable[[int], dict]] = {
    "none": lambda i: {},
    "penalized": lambda i: PENALIZED,
    "half": lambda i: PENALIZED if i % 2 else {},
}


def _sync(engine: LLMEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def decode_ms(engine: LLMEngine, config: str, rows: Callable[[int], dict], batch: int, context: int,
              steps: int, first_token: Callable[[dict], int] = lambda extra: 5) -> float:
    """ms per decode step of ``batch`` committed decodes whose row i samples with ``rows(i)``;
    ``first_token(fields)``: the token each joins the batch with (the prefill worker's)."""
    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    ids = [f"{config}-{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        extra = rows(i)
        engine.reserve(rid, _prompt(rng, context, vocab),
                       SamplingParams(max_tokens=steps + 8, ignore_eos=True, **extra))
        engine.commit_prefilled(rid, first_token(extra))
    for _ in range(3):  # warm-up (a launched-ahead pipeline is full after two)
        engine.step()
    _sync(engine)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(engine)
    elapsed = time.perf_counter() - t0
    if engine.num_running != batch:  # a row that ended early would make the step look cheap
        raise RuntimeError(f"{config}: {engine.num_running} of {batch} rows still decode after the steps")
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return elapsed / steps * 1e3


def run(configs: dict[str, Callable[[int], dict]], *, what: str, name: str, description: str,
        first_token: Callable[[LLMEngine], Callable[[dict], int]] | None = None) -> None:
    """Parse the command line, time every configuration against the first (rounds alternated), print
    the table and write ``<name>-<device>-<date>.json`` / ``.md``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--models", default="/tmp/pdserve-models")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu-check", action="store_true", help="tiny model on CPU, small shapes")
    args = ap.parse_args()
    cpu = args.cpu_check or not torch.cuda.is_available()
    preset = "tiny" if cpu else args.preset
    batches = [1, 8] if args.cpu_check else [int(b) for b in args.batches.split(",")]
    context = 64 if args.cpu_check else args.context
    steps = 16 if args.cpu_check else args.steps
    path = checkpoint(preset, Path(args.models))
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu" if cpu else "cuda",
                                    num_blocks=max(batches) * (context // 16 + 8) + 64,
                                    max_num_seqs=max(batches), enable_prefix_caching=False))
    while engine.has_idle_work():  # every decode graph before timing
        engine.idle_work()
    first = first_token(engine) if first_token is not None else (lambda extra: 5)
    names = list(configs)
    times: dict = {}
    for r in range(args.rounds):
        for batch in batches:
            for config in (names if r % 2 == 0 else names[::-1]):
                times.setdefault(batch, {}).setdefault(config, []).append(
                    decode_ms(engine, config, configs[config], batch, context, steps, first))
    assert engine.leak_report() is None, engine.leak_report()
    device = "cpu" if cpu else torch.cuda.get_device_name(0)
    result = {"what": what, "preset": preset, "device": device, "date": dt.date.today().isoformat(),
              "command": bench_command(), "commit": bench_commit(), "context": context, "steps": steps,
              "rounds": args.rounds, "overlap_steps": engine.overlap_steps, "rows": []}
    base, others = names[0], names[1:]
    lines = [f"| batch x context | {base} ms/step | " + " | ".join(f"{c} ms/step (x)" for c in others) + " |",
             "|---" * (len(names) + 1) + "|"]
    for batch, by in times.items():
        med = {c: statistics.median(v) for c, v in by.items()}
        row = {"batch": batch, **{f"{c}_ms": round(m, 3) for c, m in med.items()},
               **{f"{c}_x": round(med[c] / med[base], 3) for c in others}, "rounds_ms": by}
        result["rows"].append(row)
        lines.append(f"| {batch} x {context} | {med[base]:.2f} | "
                     + " | ".join(f"{med[c]:.2f} ({row[c + '_x']:.2f}x)" for c in others) + " |")
    print("\n".join(lines), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "cpu" if cpu else device.split()[-1].lower()
    stem = out / f"{name}-{tag}-{result['date']}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.json", flush=True)


def main() -> None:
    run(CONFIGS, name="penalty-cost", description=__doc__.split("\n")[0],
        what="decode step with every row / half the rows penalized (frequency, presence, repetition, an "
             "8-token bias) vs none, one engine, rounds alternated")


if __name__ == "__main__":
    main()
