"""Colocated engine throughput on CPU next to ``transformers`` ``generate``, measured in the same run.

    python -m bench.engine_bench --json bench/results/engine-cpu.json \
        [--presets tiny small] [--batches 1 8 32]

For each preset a random checkpoint is written once and loaded by both sides (same weights, float32).
For each batch size ``B``, with ``B`` distinct random prompts of ``--prompt-len`` tokens:

* **prefill tok/s**: ``B * prompt_len`` / wall time from submitting the prompts to having every
  first token (engine: ``max_tokens=1``, prefix cache off so nothing is reused; transformers:
  ``generate(max_new_tokens=1)``).
* **decode tok/s**: ``B * decode_len`` / wall time of the next ``decode_len`` tokens of every
  sequence (engine: the steps after all first tokens; transformers: ``generate(1 + decode_len)``
  minus ``generate(1)``), EOS ignored on both sides.

Each number is the best of ``--repeats`` runs. Ratios are engine / transformers (> 1: engine faster).
The table goes to stdout, everything (with the machine and settings) to the JSON file. Timings
never fail anything; they are only reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from engine.checkpoint import preset_config, write_random_checkpoint
from engine.engine import EngineConfig, LLMEngine
from pdserve.sampling import SamplingParams


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


def engine_run(engine: LLMEngine, prompts: list[list[int]], decode_len: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds) for one batch run to completion."""
    params = SamplingParams(max_tokens=decode_len + 1, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    first = set()
    t1 = None
    while engine.has_unfinished():
        for out in engine.step():
            first.add(out.request_id)
        if t1 is None and len(first) == len(prompts):
            t1 = time.perf_counter()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def engine_prefill(engine: LLMEngine, prompts: list[list[int]]) -> float:
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0


def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


def bench_preset(preset: str, batches: list[int], prompt_len: int, decode_len: int, repeats: int,
                 workdir: Path) -> list[dict]:
    from transformers import AutoModelForCausalLM

    cfg = preset_config(preset, dtype="float32")
    path = workdir / preset
    write_random_checkpoint(path, cfg, seed=0)
    max_b = max(batches)
    # Budget for every prompt in one step, like transformers' single prefill forward.
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", max_num_seqs=max_b,
                                    max_num_batched_tokens=max_b * prompt_len, enable_prefix_caching=False,
                                    num_blocks=max_b * (-(-(prompt_len + decode_len + 1) // 16)) + 8))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    for b in batches:
        seed = 1000 * b
        # warm-up (allocator, first-call overheads) on both sides
        engine_run(engine, _prompts(b, prompt_len, cfg.vocab_size, seed), 2)
        hf_generate(hf, _prompts(b, prompt_len, cfg.vocab_size, seed), 2)
        e_pre = e_dec = h_pre = h_dec = float("inf")
        for r in range(repeats):
            prompts = _prompts(b, prompt_len, cfg.vocab_size, seed + r + 1)
            e_pre = min(e_pre, engine_prefill(engine, prompts))
            _, dec = engine_run(engine, prompts, decode_len)
            e_dec = min(e_dec, dec)
            t_one = hf_generate(hf, prompts, 1)
            t_all = hf_generate(hf, prompts, 1 + decode_len)
            h_pre = min(h_pre, t_one)
            h_dec = min(h_dec, max(t_all - t_one, 1e-9))
        assert engine.leak_report() is None, engine.leak_report()
        row = {"preset": preset, "batch": b, "prompt_len": prompt_len, "decode_len": decode_len,
               "engine_prefill_tok_s": b * prompt_len / e_pre, "hf_prefill_tok_s": b * prompt_len / h_pre,
               "engine_decode_tok_s": b * decode_len / e_dec, "hf_decode_tok_s": b * decode_len / h_dec}
        row["prefill_ratio"] = row["engine_prefill_tok_s"] / row["hf_prefill_tok_s"]
        row["decode_ratio"] = row["engine_decode_tok_s"] / row["hf_decode_tok_s"]
        rows.append(row)
        print(_fmt(row), flush=True)
    return rows


_HEADER = (f"{'preset':<7}{'batch':>6} | {'prefill tok/s':>14}{'hf':>10}{'ratio':>7} | "
           f"{'decode tok/s':>13}{'hf':>10}{'ratio':>7}")


def _fmt(r: dict) -> str:
    return (f"{r['preset']:<7}{r['batch']:>6} | "
            f"{r['engine_prefill_tok_s']:>14.0f}{r['hf_prefill_tok_s']:>10.0f}"
            f"{r['prefill_ratio']:>6.2f}x | {r['engine_decode_tok_s']:>13.0f}{r['hf_decode_tok_s']:>10.0f}"
            f"{r['decode_ratio']:>6.2f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    print(f"CPU threads: {torch.get_num_threads()}; prompt {args.prompt_len} tokens, "
          f"{args.decode_len} decode tokens; engine / transformers {_hf_version()}")
    print(_HEADER)
    print("-" * len(_HEADER))
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as tmp:
        for preset in args.presets:
            rows += bench_preset(preset, args.batches, args.prompt_len, args.decode_len, args.repeats,
                                 Path(tmp))
    result = {
        "benchmark": "engine-cpu", "unit": "tokens/s", "ratio": "engine / transformers generate",
        "settings": vars(args) | {"json": str(args.json) if args.json else None},
        "commit": _git_commit(),
        "machine": {"platform": platform.platform(), "processor": _cpu_model(), "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "transformers": _hf_version()},
        "seconds": round(time.perf_counter() - started, 1),
        "rows": rows,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5, cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _hf_version() -> str:
    try:
        import transformers

        return transformers.__version__
    except ImportError:
        return "(not installed)"


if __name__ == "__main__":
    raise SystemExit(main())
