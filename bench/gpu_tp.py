"""Tensor parallelism on GPUs: one worker at TP 2 vs TP 1, side by side in one run.

    python -m bench.gpu_tp                       # 2 GPUs: llama3-8b at TP 1 and 2, llama3-70b-short at TP 2
    python -m bench.gpu_tp --cpu-check           # the same path on CPU (gloo), tiny model, small shapes
    python -m bench.gpu_tp --ahead               # each decode row synchronous and launched ahead
    python -m bench.gpu_tp --serving             # 2 GPUs: 1P(TP1) -> 1D(TP1) vs one TP-2 colocated worker
    python -m bench.gpu_tp --serving --cpu-check # the serving comparison on CPU (bench/tp_serving.py)

For each (preset, TP size) one engine (rank 0 in this process, ranks 1.. as child processes, exactly
as ``pdserve serve --tensor-parallel-size N`` runs them) is timed through the engine API:

* ``decode_b{B}``: median ms of one decode step of B sequences, each holding ``--context`` tokens of
  KV (reserved and committed, as a decode worker receives them, so no prefill is needed to fill them);
* ``prefill``: median ms of one ``--prefill`` token prompt in one step;
* ``decode_b{B}_profile`` (``--profile``): the step's host phases and GPU kernels (bench/tp_profile.py);
* ``greedy``: 16 greedy tokens of 4 prompts, compared with TP 1's (bf16 sums in another order may
  legitimately flip a near tie; the table reports how many sequences match exactly);
* ``--runs llama3-8b:2,llama3-8b:2:symm``: the same TP size again with another all-reduce
  (``PDSERVE_TP_ALLREDUCE``, engine.tp_allreduce): ``decode_*_vs_first`` (speed-up over the first run of
  that preset and size) and ``greedy_same_as_first``;
* ``--ahead``: each decode row twice, with synchronous steps (``decode_b{B}_ms``) and with steps launched
  ahead (``decode_b{B}_ahead_ms``, engine.step_ahead; under TP every rank then receives rank 0's sampled
  ids), and ``greedy_ahead_same``: the greedy tokens launched ahead equal the synchronous ones. Without it
  each run uses the engine's default (launched ahead on CUDA at TP 1 only).

Each time is reported next to its bound on this rank's share of the work (decode: weight + KV bytes
over the measured copy bandwidth; prefill: linear-layer FLOPs over the measured bf16 matmul rate)
and, for TP > 1, as the speed-up over TP 1 of the same preset. Checkpoints are random, written once
under ``--models`` (the 70B-wide short preset is ~32 GB in bf16). Writes JSON under ``--out``.

``--serving`` instead runs both 2-GPU serving configurations of the llama3-8b shape under the log-normal
mixed workload, side by side behind one router each (``bench/tp_serving.py``: the mode catalogue of
``pdserve.app.loadgen.modes``, ``1p1d`` over NIXL vs ``colocated-tp2``; SLO goodput, TTFT / ITL
percentiles per rate, goodput per GPU). The runs that need 4 GPUs are ``bench/gpu_tp4.py``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import statistics
import time
from pathlib import Path

import torch

from engine.checkpoint import preset_config, write_random_checkpoint
from engine.engine import EngineConfig, LLMEngine
from pdserve.app.tp_ranks import rank_device, start_ranks
from pdserve.sampling import SamplingParams
from pdserve.settings import environment

GREEDY_PROMPTS, GREEDY_TOKENS = 4, 16


def checkpoint(preset: str, root: Path) -> Path:
    path = root / preset
    if not (path / "config.json").is_file():
        print(f"  writing a random {preset} checkpoint to {path}", flush=True)
        write_random_checkpoint(path, preset_config(preset), seed=0, max_shard_bytes=4 << 30)
    return path


def open_engine(path: Path, size: int, device: str, *, num_blocks: int, max_tokens: int,
                dtype: str | None = None):
    config = EngineConfig(model=str(path), device=rank_device(device, 0), num_blocks=num_blocks,
                          max_num_seqs=128, max_num_batched_tokens=max_tokens, block_size=16, dtype=dtype,
                          enable_prefix_caching=False)  # each run repeats its prompts: none may hit
    if size == 1:
        return LLMEngine(config), None
    ranks = start_ranks(config, size)
    return LLMEngine(config, tp=ranks.group), ranks


def close_engine(engine: LLMEngine, ranks) -> None:
    assert engine.leak_report() is None, engine.leak_report()
    if ranks is not None:
        engine.close()
        ranks.stop()


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def decode_ms(engine: LLMEngine, batch: int, context: int, steps: int,
              profile: dict | None = None, trace: Path | None = None) -> float:
    """Median ms of a decode step of ``batch`` sequences of ``context`` tokens; with ``profile`` (a
    dict), also where the step's time goes (bench/tp_profile.py), stored in it."""
    ids = start_decodes(engine, batch, context, max_tokens=steps + 24)  # the profile's steps run after
    engine.step()  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    if profile is not None:
        from bench.tp_profile import profile_steps

        profile.update(profile_steps(engine, 8, trace))
    stop_decodes(engine, ids)
    return statistics.median(times)


def start_decodes(engine: LLMEngine, batch: int, context: int, *, max_tokens: int) -> list[str]:
    """``batch`` running decodes of ``context`` tokens of KV each, reserved and committed as a decode
    worker receives them (no prefill computes their KV); their request ids."""
    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [f"d{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.reserve(rid, _prompt(rng, context, vocab), params)
        engine.commit_prefilled(rid, 5)
    return ids


def stop_decodes(engine: LLMEngine, ids: list[str]) -> None:
    """Abort ``ids`` and step until the engine holds nothing (a step in flight is read too)."""
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()


def prefill_ms(engine: LLMEngine, tokens: int, repeats: int = 3) -> float:
    rng = random.Random(tokens)
    times = []
    for i in range(repeats + 1):
        engine.add_request(f"p{i}", _prompt(rng, tokens, engine.model_config.vocab_size),
                           SamplingParams(max_tokens=1))
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        if i:  # the first one warms up
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def ceilings(device: str) -> dict:
    if device == "cpu":
        return {}
    from bench.gpu import ceilings as measure

    return measure(quick=True)


def bounds(cfg, size: int, ceil: dict, *, batch: int, context: int, prefill: int) -> dict:
    if not ceil:
        return {}
    itemsize = 2
    weights = (cfg.num_parameters() - cfg.vocab_size * cfg.hidden_size) * itemsize / size
    kv_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize / min(size, cfg.num_kv_heads)
    linear_flops = 2 * (cfg.num_parameters() - cfg.vocab_size * cfg.hidden_size) * prefill / size
    return {"decode_ms": (weights + batch * context * kv_token) / ceil["copy_GBps"] / 1e6,
            "prefill_ms": linear_flops / ceil["matmul_bf16_TFLOPs"] / 1e9}


def run_one(preset: str, size: int, args, ceil: dict, reference: dict) -> dict:
    path = checkpoint(preset, Path(args.models))
    cfg = preset_config(preset) if not args.cpu_check else preset_config(preset, dtype="float32")
    batches = [int(b) for b in args.batches.split(",")]
    blocks = max(batches) * -(-(args.context + args.steps + 8) // 16) + 64
    t0 = time.perf_counter()
    engine, ranks = open_engine(path, size, args.device, num_blocks=blocks,
                                max_tokens=max(args.prefill, 128), dtype=args.dtype or None)
    dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
    row = {"preset": preset, "tp": size, "dtype": dtype,
           "allreduce": ranks.group.allreduce_mode if ranks is not None else "-",
           "load_s": round(time.perf_counter() - t0, 1)}
    try:
        rng = random.Random(0)
        prompts = [_prompt(rng, 24 + 8 * i, cfg.vocab_size) for i in range(GREEDY_PROMPTS)]
        greedy = SamplingParams(max_tokens=GREEDY_TOKENS, ignore_eos=True)
        modes = (False, True) if args.ahead else (engine.overlap_steps,)
        engine.overlap_steps = modes[0]
        row["greedy"] = engine.generate(prompts, greedy)
        row["overlap_steps"] = list(modes)
        if args.ahead:  # the same batches either way: the tokens must be the same
            engine.overlap_steps = True
            row["greedy_ahead_same"] = engine.generate(prompts, greedy) == row["greedy"]
        for b in batches:
            for ahead in modes:  # alternated per batch size, synchronous first
                engine.overlap_steps = ahead
                key = f"decode_b{b}" + ("_ahead" if args.ahead and ahead else "")
                prof = {} if args.profile else None
                trace = Path(args.out) / f"trace-{preset}-tp{size}-{key}.json.gz" if args.profile else None
                row[f"{key}_ms"] = decode_ms(engine, b, args.context, args.steps, prof, trace)
                if prof:
                    from bench.tp_profile import describe

                    row[f"{key}_profile"] = prof
                    print(f"  {key}: {describe(prof)}", flush=True)
            row[f"decode_b{b}_bound_ms"] = bounds(cfg, size, ceil, batch=b, context=args.context,
                                                  prefill=args.prefill).get("decode_ms")
        row["prefill_ms"] = prefill_ms(engine, args.prefill)
        row["prefill_bound_ms"] = bounds(cfg, size, ceil, batch=1, context=args.context,
                                         prefill=args.prefill).get("prefill_ms")
    finally:
        close_engine(engine, ranks)
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    base = reference.get(preset)
    if base is None:
        reference[preset] = row
    else:
        row["greedy_match"] = sum(a == b for a, b in zip(row["greedy"], base["greedy"], strict=True))
        # Where each prompt's tokens first part from the reference's (None: identical): in bf16 a
        # reduction in another order may flip a near tie, and everything after it differs.
        row["greedy_first_diff"] = [
            next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
            for a, b in zip(row["greedy"], base["greedy"], strict=True)]
        for key in [k for k in row if k.endswith("_ms") and "bound" not in k]:
            row[key.replace("_ms", "_speedup")] = base[key] / row[key]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="llama3-8b:1,llama3-8b:2,llama3-70b-short:2",
                    help="preset:tp[:allreduce] in order; a preset's first run is its reference; allreduce "
                         "is a PDSERVE_TP_ALLREDUCE value for that run (e.g. llama3-8b:2:symm beside "
                         "llama3-8b:2: *_vs_first and greedy_same_as_first compare the two)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="", help="override the checkpoint's dtype (float32: exact TP checks)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="--serving: device seconds for both modes")
    ap.add_argument("--models", default="/tmp/pdserve-models")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="")
    ap.add_argument("--cpu-check", action="store_true", help="tiny model on CPU (gloo), small shapes")
    ap.add_argument("--profile", action="store_true",
                    help="profile each decode batch too: host phases, kernels by group (bench/tp_profile.py)")
    ap.add_argument("--ahead", action="store_true",
                    help="decode with steps launched ahead (engine.step_ahead) beside synchronous steps, "
                         "every run: decode_b{B}_ahead_ms next to decode_b{B}_ms, and greedy_ahead_same")
    ap.add_argument("--serving", action="store_true",
                    help="1P(TP1) -> 1D(TP1) vs one TP-2 colocated worker under the log-normal workload")
    args = ap.parse_args()
    if args.serving:
        from bench.tp_serving import run as run_serving

        run_serving(["1p1d", "colocated-tp2"], name="gpu-tp-serving", cpu_check=args.cpu_check,
                    out=Path(args.out), models=Path(args.models), tag=args.tag, budget_s=args.budget_s)
        return
    if args.cpu_check:
        args.runs, args.batches, args.context, args.prefill, args.steps, args.device = \
            "tiny:1,tiny:2,tiny:4", "1,4", 64, 64, 3, "cpu"
        torch.set_num_threads(1)
    ceil = ceilings(args.device)
    reference: dict = {}
    rows = []
    first: dict = {}  # (preset, TP size) -> that pair's first row: runs of it with another all-reduce
    for item in args.runs.split(","):
        preset, size, allreduce = (item.split(":", 2) + [""])[:3]
        print(f"# {preset} TP {size}" + (f" PDSERVE_TP_ALLREDUCE={allreduce}" if allreduce else ""),
              flush=True)
        # read by every rank's TPGroup (the ranks inherit this environment)
        with environment({"PDSERVE_TP_ALLREDUCE": allreduce} if allreduce else {}):
            rows.append(run_one(preset, int(size), args, ceil, reference))
        r = rows[-1]
        same = first.setdefault((preset, size), r)
        if same is not r:  # the same model and ranks summing another way: tokens and time side by side
            r["greedy_same_as_first"] = r["greedy"] == same["greedy"]
            for key in [k for k in r if k.startswith("decode_") and k.endswith("_ms") and "bound" not in k]:
                r[key.replace("_ms", "_vs_first")] = same[key] / r[key]
        cells = [f"{k}={v:.2f}" for k, v in r.items() if isinstance(v, float)]
        match = f"  greedy {r['greedy_match']}/{GREEDY_PROMPTS} same" if "greedy_match" in r else ""
        print(f"  load {r['load_s']} s  " + "  ".join(cells) + match, flush=True)
    from engine.model_runner import tp_graphs

    result = {"benchmark": "gpu-tp", "date": dt.datetime.now(dt.timezone.utc).isoformat(),
              "settings": {k: v for k, v in vars(args).items()}, "tp_cuda_graphs": tp_graphs(),
              "ceilings": ceil,
              "devices": torch.cuda.device_count() if torch.cuda.is_available() else 0, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"gpu-tp-{'cpu-check' if args.cpu_check else 'cuda'}-{dt.date.today().isoformat()}"
    path = out / f"{name}{'-' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
