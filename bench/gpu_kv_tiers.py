"""KV tiers on one GPU, llama3-8b shape (``bash bench/device_run.sh kv-tiers``): what the host tier buys
and costs.

Engine-level, one process, two engines on the same checkpoint (tiers on / off), rounds alternated:

1. **onload**: a 4k-token prefix (256 blocks) evicted from the device cache and loaded back from the host
   tier by the engine (the tier's own measured seconds for those bytes), against one pinned host->device
   copy of the same number of bytes (the copy engine's rate). Goal: >= 80%.
2. **returning turn**: TTFT of an 8k-token conversation's next turn (64 new tokens) whose KV comes back
   from the host tier, against the same turn recomputed (tiers off; its KV evicted the same way).
   Goal: <= 1/3 of the recompute.
3. **decode while offloading**: TPOT of 16 decoding requests while other prompts churn the cache (their
   admissions evict, so blocks offload), tiers on vs off. Goal: within 5%.

Cluster-level (``--sessions``): ``pdserve bench`` multi-turn sessions, 1P1D on this GPU, tiers off vs on.

Writes ``kv-tiers-<device>-<date>.json`` and a markdown table to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_disagg import write_checkpoint  # noqa: E402

from engine.engine import EngineConfig, LLMEngine  # noqa: E402
from engine.kv_tiers import TierConfig  # noqa: E402
from pdserve.sampling import SamplingParams  # noqa: E402
from pdserve.settings import bench_command, bench_commit  # noqa: E402

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
MODEL = Path("/dev/shm/pdserve-llama3-8b")


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 120000) for _ in range(n)]


BACKEND = {"name": "auto"}  # --backend: auto (flashinfer where installed) or torch (no JIT build)


def engine(tiers: TierConfig | None, num_blocks: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(MODEL), device="cuda", dtype="bfloat16", num_blocks=num_blocks,
                                  max_num_seqs=64, max_num_batched_tokens=8192,
                                  attention_backend=BACKEND["name"],
                                  **({"tiers": tiers} if tiers is not None else {})))


def ttft(eng: LLMEngine, rid: str, prompt: list[int]) -> float:
    """Seconds from add_request to the step that returns the request's first token."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    eng.add_request(rid, prompt, ONE)
    while True:
        for out in eng.step():
            if out.request_id == rid and out.new_token_ids:
                elapsed = time.perf_counter() - start
                while eng.has_unfinished():
                    eng.step()
                return elapsed


def evict(eng: LLMEngine, rng: random.Random, tokens_total: int) -> None:
    """Unrelated prompts, enough to push everything before them out of the device cache."""
    for _ in range(max(1, tokens_total // 8000)):
        eng.generate([tokens(rng, 8000)], ONE)
    if eng.tiers is not None:
        eng.tiers.flush()


def raw_copy_rate(nbytes: int, rounds: int = 5) -> float:
    """Bytes/s of one pinned host->device copy of ``nbytes`` (median of rounds)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rates = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dev.copy_(host, non_blocking=True)
        b.record()
        b.synchronize()
        rates.append(nbytes / (a.elapsed_time(b) / 1e3))
    return statistics.median(rates)


def onload_and_ttft(on: LLMEngine, off: LLMEngine, rounds: int) -> dict:
    per_block = on.kv_layout.num_layers * on.kv_layout.block_bytes
    rng = random.Random(0)
    out: dict = {"block_bytes": per_block, "device_blocks": on.num_total_blocks, "rounds": []}
    for r in range(rounds):
        row: dict = {}
        # 1. onload of a 4k-token prefix: the engine's own load time for those bytes
        prefix = tokens(rng, 4096)
        on.generate([prefix], ONE)
        evict(on, rng, 40000)
        before_b, before_s = on.tiers.stats.loaded_bytes["host"], on.tiers.stats.load_seconds["host"]
        row["onload_ttft_s"] = ttft(on, f"p{r}", prefix + tokens(rng, 16))
        nbytes = on.tiers.stats.loaded_bytes["host"] - before_b
        seconds = on.tiers.stats.load_seconds["host"] - before_s
        row["onload_bytes"] = nbytes
        row["onload_Bps"] = nbytes / seconds if seconds else float("nan")
        row["raw_copy_Bps"] = raw_copy_rate(nbytes or 256 * per_block)
        row["onload_over_raw"] = row["onload_Bps"] / row["raw_copy_Bps"]
        # 2. an 8k-token conversation's next turn: from the host tier vs recomputed, engines alternated
        convo = tokens(rng, 8192)
        turn = convo + tokens(rng, 64)
        pair = (("host", on), ("recompute", off))
        for name, eng in pair if r % 2 == 0 else pair[::-1]:
            eng.generate([convo], ONE)
            evict(eng, rng, 40000)
            row[f"ttft_{name}_s"] = ttft(eng, f"t{r}-{name}", list(turn))
        row["ttft_host_over_recompute"] = row["ttft_host_s"] / row["ttft_recompute_s"]
        out["rounds"].append(row)
        print(json.dumps(row), flush=True)
    for key in ("onload_Bps", "raw_copy_Bps", "onload_over_raw", "ttft_host_s", "ttft_recompute_s",
                "ttft_host_over_recompute"):
        out[key] = statistics.median(x[key] for x in out["rounds"])
    out["tier_stats"] = {k: v for k, v in vars(on.tiers.stats).items()}
    for eng in (on, off):
        assert eng.leak_report() is None, eng.leak_report()
    return out


def decode_while_offloading(on: LLMEngine, off: LLMEngine, rounds: int) -> dict:
    """TPOT of 16 decodes (1k-token prompts, 128 tokens each) while 4k-token prompts churn the cache."""
    rng = random.Random(1)
    out: dict = {"rounds": []}
    engines = {"on": on, "off": off}
    decode = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    for r in range(rounds):
        order = ("on", "off") if r % 2 == 0 else ("off", "on")
        row = {}
        for name in order:
            eng = engines[name]
            prompts = [tokens(rng, 1024) for _ in range(16)]
            times: dict[str, list[float]] = {}
            for i, p in enumerate(prompts):
                eng.add_request(f"d{r}-{i}", p, decode)
            churn = 0
            offloaded = eng.tiers.stats.offloaded_blocks["host"] if eng.tiers else 0
            while eng.has_unfinished():
                if churn < 24 and eng.num_waiting == 0:  # keep one 2k-token prompt waiting
                    eng.add_request(f"c{r}-{churn}", tokens(rng, 4096), ONE)
                    churn += 1
                for o in eng.step():
                    if o.request_id.startswith("d") and o.new_token_ids:
                        times.setdefault(o.request_id, []).append(time.perf_counter())
            tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
            row[f"tpot_{name}_ms"] = statistics.mean(tpots) * 1e3
            if eng.tiers:
                row["offloaded_blocks"] = eng.tiers.stats.offloaded_blocks["host"] - offloaded
        row["tpot_on_over_off"] = row["tpot_on_ms"] / row["tpot_off_ms"]
        out["rounds"].append(row)
        print(json.dumps(row), flush=True)
    out["tpot_on_over_off"] = statistics.median(x["tpot_on_over_off"] for x in out["rounds"])
    for eng in engines.values():
        assert eng.leak_report() is None, eng.leak_report()
    return out


def sessions(out_dir: Path, args: argparse.Namespace) -> dict:
    """``pdserve bench`` multi-turn, 1P1D on this GPU, tiers off vs on (the host tier)."""
    result = out_dir / "kv-tiers-sessions.json"
    cmd = [sys.executable, "-m", "pdserve.app.cli", "bench", "--model", str(MODEL), "--gpus", "1",
           # off: --kv-host-gb 0 (on CUDA a worker keeps a host tier by default, docs/kv-tiers.md)
           "--modes", "conditional@off,conditional@tiers", "--variant", "off=--kv-host-gb 0",
           "--variant", f"tiers=--kv-host-gb {args.host_gb}",
           "--worker-args", f"--dtype bfloat16 --kv-memory-gb {args.kv_gb} --max-num-seqs 32",
           "--sessions", str(args.sessions), "--turns", str(args.turns), "--think-time", str(args.think),
           "--rate", str(args.rate), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--vocab-size", "120000", "--run-dir", "/tmp/kv-tiers-sessions", "--json", str(result)]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=False)
    return json.loads(result.read_text()) if result.exists() else {"error": "no result"}


def table(res: dict) -> str:
    lines = ["| what | tiers on | reference | ratio | goal |", "|---|---|---|---|---|"]
    if "engine" in res:
        e = res["engine"]
        lines.append(f"| onload of a 4k-token prefix from host | {e['onload_Bps'] / 1e9:.1f} GB/s "
                     f"| raw pinned H2D {e['raw_copy_Bps'] / 1e9:.1f} GB/s | {e['onload_over_raw']:.0%} "
                     "| >= 80% |")
        lines.append(f"| TTFT, 8k-token returning turn | {e['ttft_host_s'] * 1e3:.0f} ms (host) | "
                     f"{e['ttft_recompute_s'] * 1e3:.0f} ms (recomputed) "
                     f"| {e['ttft_host_over_recompute']:.2f} | <= 0.33 |")
    if "decode" in res:
        d = res["decode"]
        on = statistics.median(x["tpot_on_ms"] for x in d["rounds"])
        off = statistics.median(x["tpot_off_ms"] for x in d["rounds"])
        lines.append(f"| TPOT, 16 decodes while the cache churns | {on:.2f} ms | {off:.2f} ms (tiers off) | "
                     f"{d['tpot_on_over_off']:.3f} | <= 1.05 |")
    if "sessions" in res and "results" in res["sessions"]:
        for mode, r in res["sessions"]["results"].items():
            t = r.get("returning_turns") or {}
            if t:
                ttft = t["ttft_ms"]
                lines.append(f"| sessions `{mode}`: reuse {t['reuse_share']:.1%} (device only "
                             f"{t['reuse_share_device_only']:.1%}), prefill "
                             f"{t['prefill_tokens_per_turn']:.0f} tok/turn | TTFT p50/p90 "
                             f"{ttft['p50']:.0f}/{ttft['p90']:.0f} ms "
                             f"| TPOT p50 {t['tpot_ms']['p50']:.1f} ms | | |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/out")
    p.add_argument("--parts", default="engine,decode", help="engine,decode,sessions")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--think", type=float, default=1.0)
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--kv-gb", type=float, default=4.0)
    p.add_argument("--host-gb", type=float, default=24.0)
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "flashinfer"))
    args = p.parse_args()
    BACKEND["name"] = args.backend
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    write_checkpoint(MODEL, "llama3-8b")
    print(f"checkpoint ready in {time.perf_counter() - t0:.0f} s", flush=True)
    device = torch.cuda.get_device_name().replace(" ", "-").lower()
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "command": bench_command(), "commit": bench_commit(),
                 "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "args": vars(args)}
    parts = args.parts.split(",")
    if "engine" in parts or "decode" in parts:
        # 2048 blocks: 32k tokens of device cache (4 GiB); an 8k conversation is evicted by 40k of others
        on, off = engine(TierConfig(host_bytes=8 << 30), 2048), engine(None, 2048)
        if "engine" in parts:
            res["engine"] = onload_and_ttft(on, off, args.rounds)
        if "decode" in parts:
            res["decode"] = decode_while_offloading(on, off, args.rounds)
        for eng in (on, off):
            eng.close()
        del on, off
        torch.cuda.empty_cache()
    if "sessions" in parts:
        res["sessions"] = sessions(out_dir, args)
    name = f"kv-tiers-{'-'.join(parts)}-{device}-{time.strftime('%Y-%m-%d')}"
    (out_dir / f"{name}.json").write_text(json.dumps(res, indent=2, default=float) + "\n")
    md = table(res)
    head = f"# KV tiers, {res['device']}\n\n`{res['command']}` at {res['commit']}\n\n"
    (out_dir / f"{name}.md").write_text(head + md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
