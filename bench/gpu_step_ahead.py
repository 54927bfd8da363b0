"""Decode steps launched ahead (engine.step_ahead) against synchronous steps, one engine, one GPU.

    bash bench/device_run.sh step-ahead                       # llama3-8b shape, ~4 minutes of device time
    python3 -m bench.gpu_step_ahead --out DIR [--preset P] [--rounds N] [--serve-rates 2,4,6]
    python3 -m bench.gpu_step_ahead --out DIR --cpu-check     # the same path on CPU, tiny model

Both configurations run in the same process on the same engine (``LLMEngine.overlap_steps`` switched
between them), rounds alternated, so host and GPU drift hit both alike:

* **decode**: ``B`` sequences of ``C`` tokens of KV each (reserved and committed as a decode worker
  receives them), then ``--steps`` decode steps; ms per step is wall time over the steps (a step
  launched ahead returns before its tokens are read, so one ``step()`` alone is not a step's time),
  tokens/s and the speed-up of launching ahead. Every CUDA graph is captured before timing.
* **identity**: greedy and seeded runs of a few prompts stopping by length (the same batches either
  way) must give the same tokens.
* **serving** (``--serve-rates``): the engine behind its ``AsyncEngine`` thread (a worker's threading),
  Poisson arrivals of a mixed workload for ``--serve-seconds`` per rate: prompts log-normal (median
  2048, 256..8192), outputs uniform 64..384, the same arrivals and prompts for both configurations,
  ``--serve-rounds`` rounds whose order alternates (and starts the other way at the next rate); TTFT
  and ITL percentiles per rate, configuration and round. The prefix cache is off throughout.

Writes ``step-ahead-<device>-<date>.json`` and a markdown table to ``--out``; timings never fail it.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import random
import statistics
import time
from pathlib import Path

import torch

from bench.gpu_tp import checkpoint, start_decodes, stop_decodes
from engine.async_engine import AsyncEngine
from engine.engine import EngineConfig, LLMEngine
from pdserve.app.loadgen.dist import parse_dist
from pdserve.app.loadgen.stats import percentile
from pdserve.sampling import SamplingParams
from pdserve.settings import bench_command

MODES = ("sync", "ahead")


def decode_ms(engine: LLMEngine, batch: int, context: int, steps: int) -> float:
    ids = start_decodes(engine, batch, context, max_tokens=steps + 8)
    for _ in range(3):  # warm-up (a launched-ahead pipeline is full after two)
        engine.step()
    sync_device(engine)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    engine.sync()
    sync_device(engine)
    elapsed = time.perf_counter() - t0
    stop_decodes(engine, ids)
    return elapsed / steps * 1e3


def sync_device(engine: LLMEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def identity(engine: LLMEngine) -> dict:
    rng = random.Random(5)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (17, 130, 600, 41)]
    params = [SamplingParams(max_tokens=24 + 6 * i, ignore_eos=True) for i in range(2)]
    params += [SamplingParams(max_tokens=30, temperature=0.8, top_k=50, seed=i, ignore_eos=True)
               for i in range(2)]
    outs = {}
    for mode in MODES:
        engine.overlap_steps = mode == "ahead"
        outs[mode] = engine.generate(prompts, params)
    same = [a == b for a, b in zip(outs["sync"], outs["ahead"], strict=True)]
    return {"sequences": len(same), "identical": sum(same)}


async def _serve(engine: LLMEngine, rate: float, seconds: float, seed: int) -> dict:
    driver = AsyncEngine(engine)
    driver.start()
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    inp, out = parse_dist("lognormal:2048:0.8:256:8192"), parse_dist("uniform:64:384")
    ttft, itl, errors = [], [], 0

    async def one(i: int, prompt: list[int], n_out: int) -> None:
        nonlocal errors
        t0 = time.perf_counter()
        last = None
        try:
            async for step in driver.generate(f"s{seed}-{i}", prompt, SamplingParams(max_tokens=n_out,
                                                                                      ignore_eos=True)):
                now = time.perf_counter()
                if step.new_token_ids:
                    if last is None:
                        ttft.append((now - t0) * 1e3)
                    else:
                        itl.append((now - last) * 1e3)
                    last = now
        except Exception:  # noqa: BLE001 - counted, reported
            errors += 1

    tasks, t_next, i = [], 0.0, 0
    start = time.perf_counter()
    while t_next < seconds:
        await asyncio.sleep(max(0.0, start + t_next - time.perf_counter()))
        n_in, n_out = inp.sample(rng), out.sample(rng)
        n_in = min(n_in, engine.max_model_len - n_out - 1)  # the tiny CPU model's context is short
        prompt = [rng.randrange(3, vocab) for _ in range(n_in)]
        tasks.append(asyncio.create_task(one(i, prompt, n_out)))
        i += 1
        t_next += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    await driver.stop()
    return {"rate": rate, "requests": i, "errors": errors, "wall_s": round(wall, 2),
            **{f"ttft_p{q}_ms": round(percentile(ttft, q), 1) for q in (50, 90, 99)},
            **{f"itl_p{q}_ms": round(percentile(itl, q), 2) for q in (50, 90, 99)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--models", default="/tmp/pdserve-models")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve-rates", default="", help="req/s points of the serving comparison, e.g. 2,4,6,8")
    ap.add_argument("--serve-seconds", type=float, default=15.0)
    ap.add_argument("--serve-rounds", type=int, default=2,
                    help="serving rounds per rate, the configurations' order alternating between rounds")
    ap.add_argument("--cpu-check", action="store_true", help="tiny model on CPU, small shapes")
    ap.add_argument("--waits", default="blocking",
                    help="the engine's GPU waits to time (EngineConfig.gpu_wait), e.g. blocking,spin: every "
                         "decode row then runs each mode with each, alternated")
    args = ap.parse_args()
    waits = [w for w in args.waits.split(",") if w]
    cpu = args.cpu_check or not torch.cuda.is_available()
    preset = "tiny" if cpu else args.preset
    batches = [1, 4] if cpu else [int(b) for b in args.batches.split(",")]
    contexts = [64] if cpu else [int(c) for c in args.contexts.split(",")]
    steps = 8 if cpu else args.steps
    path = checkpoint(preset, Path(args.models))
    blocks = max(batches) * (max(contexts) // 16 + 4) + 512
    # No prefix cache: both configurations run the same prompts, and the second must not find the first's
    # KV (its prefill would then compute less, and in other chunks: other bf16 roundings, other tokens).
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu" if cpu else "cuda", num_blocks=blocks,
                                    max_num_seqs=max(batches), overlap_steps=True,
                                    enable_prefix_caching=False))
    while engine.has_idle_work():  # every decode graph before timing
        engine.idle_work()
    result: dict = {"preset": preset, "waits": waits,
                    "device": "cpu" if cpu else torch.cuda.get_device_name(0),
                    "date": dt.date.today().isoformat(),
                    "command": bench_command(),
                    "steps": steps, "rounds": args.rounds,
                    "identity": identity(engine), "decode": [], "serving": []}
    print(f"identity (greedy + seeded, stopping by length): {result['identity']}", flush=True)
    times: dict = {}
    # (mode, wait) pairs; a wait other than the first is named in the key ("ahead/spin")
    configs = [(m, w, m if w == waits[0] else f"{m}/{w}") for w in waits for m in MODES]
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        for context in contexts:
            for batch in batches:
                for mode, wait, key in order:
                    engine.overlap_steps = mode == "ahead"
                    engine.runner.blocking_wait = wait == "blocking"
                    ms = decode_ms(engine, batch, context, steps)
                    times.setdefault((batch, context), {}).setdefault(key, []).append(ms)
    engine.runner.blocking_wait = waits[0] == "blocking"
    others = [key for _, _, key in configs[2:]]
    print("\n| batch x context | sync ms/step | ahead ms/step | speed-up | ahead tok/s |"
          + "".join(f" {k} ms/step |" for k in others))
    print("|---|---|---|---|---|" + "---|" * len(others))
    for (batch, context), by in times.items():
        s, a = statistics.median(by["sync"]), statistics.median(by["ahead"])
        row = {"batch": batch, "context": context, "sync_ms": round(s, 3), "ahead_ms": round(a, 3),
               "speedup": round(s / a, 3), "ahead_tok_s": round(batch / a * 1e3), "rounds_ms": by,
               **{f"{k}_ms": round(statistics.median(by[k]), 3) for k in others}}
        result["decode"].append(row)
        print(f"| {batch} x {context} | {s:.2f} | {a:.2f} | {s / a:.3f}x | {row['ahead_tok_s']} |"
              + "".join(f" {row[k + '_ms']:.2f} |" for k in others), flush=True)
    for k, rate in enumerate(float(x) for x in args.serve_rates.split(",") if x):
        for r in range(args.serve_rounds):  # the order alternates between rounds and between rates
            for mode in (MODES if (r + k) % 2 == 0 else MODES[::-1]):
                engine.overlap_steps = mode == "ahead"
                point = asyncio.run(_serve(engine, rate, args.serve_seconds, seed=int(rate * 100)))
                point.update(mode=mode, round=r)
                result["serving"].append(point)
                print(f"serving {rate:g} req/s {mode} (round {r}): {point}", flush=True)
    assert engine.leak_report() is None, engine.leak_report()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"step-ahead-{'cpu' if cpu else 'gpu'}-{result['date']}.json"
    (out / name).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
