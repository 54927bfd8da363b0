"""Layer-wise KV push on vs off: prefill-return latency (prefill start -> transfer acknowledged).

    python -m bench.prefill_stream [--model DIR] [--lengths 512,2048] [--iters 5]
        [--transport tcp|nixl] [--device cpu|cuda] [--threads 1,2]
        [--json bench/results/kv-stream-layers-cpu.json]

The real prefill path in this process (AsyncEngine on its own thread + PrefillWorker + KVLink), the
decode side's receiver in a child process (``bench.kv_peer_proc``, as a decode worker would hold
it). Each request is a fresh random prompt (prefix caching off), so every token is computed and every
block is sent; streaming on and off alternate request by request so both see the same background
load. Per row: p50 / min of the prefill-return latency, of the time the first token waited for the
acknowledgement after the prefill finished (``kv_wait_s``), and the on/off ratio. No ``--model``:
a random ``small`` preset checkpoint is written to a temporary directory. Timings are reported, never
asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path


async def run(args: argparse.Namespace, model_dir: str) -> list[dict]:
    import torch

    from bench.kv_peers import PeerClient
    from engine.async_engine import AsyncEngine
    from engine.engine import EngineConfig, LLMEngine
    from kvtransfer.link import KVLink
    from kvtransfer.transport import make_transport
    from pdserve.sampling import SamplingParams
    from prefill_service.worker import PrefillWorker, Target

    longest = max(args.lengths)
    engine = LLMEngine(EngineConfig(model=model_dir, device=args.device, num_blocks=longest // 16 + 8,
                                    max_num_batched_tokens=max(2048, longest), max_num_seqs=4,
                                    enable_prefix_caching=False, attention_backend=args.attention))
    layout = engine.kv_layout
    aengine = AsyncEngine(engine)
    aengine.start()
    # The child inherits UCX_* from this environment; keep this process's import path (carried wheels).
    root = str(Path(__file__).resolve().parent.parent)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH", "")]))}
    if args.receiver_gpu is not None:
        # The decode side on its own GPU, seeing the prefill's after it (cuda_ipc maps the peer), as
        # `pdserve up --gpu-peers` places a decode worker. On one GPU both share it: the receiver's
        # copies then compete with the prefill's kernels, which a real 1P1D pair never sees.
        gpus = [str(i) for i in range(torch.cuda.device_count())]
        own = args.receiver_gpu
        env["CUDA_VISIBLE_DEVICES"] = ",".join([own] + [g for g in gpus if g != own])
    rx = await PeerClient.spawn(env=env)
    r = await rx.call("init", kind=args.transport, layout=layout.to_dict(), num_blocks=longest // 16 + 8)
    tx = await make_transport(args.transport, layout, engine.kv_cache).start()
    worker = PrefillWorker(engine=aengine, kv=KVLink(tx, lease_s=60.0), worker_id="bench", block_size=16)
    endpoint = json.dumps(r["endpoint"]).encode()
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1)
    rows, n = [], 0

    async def one(length: int, stream: bool) -> dict:
        nonlocal n
        n += 1
        rid, blocks = f"b{n}", list(range(-(-length // 16)))
        await rx.call("expect", tid=r["tid"], rid=rid, dst=blocks, timeout=60)
        waiting = asyncio.ensure_future(rx.call("wait", tid=r["tid"], rid=rid))
        worker.stream_layers = stream
        prompt = [rng.randrange(3, 1000) for _ in range(length)]
        target = Target(worker_id="rx", kv_endpoint=endpoint, block_ids=blocks, num_cached_tokens=0,
                        transport="")
        t0 = time.perf_counter()
        res = await worker.prefill(rid, prompt, params, target)
        total = time.perf_counter() - t0
        await waiting
        assert res.kv_streamed is stream
        return {"total_s": total, "wait_s": res.kv_wait_s, "transfer_s": res.kv_transfer_s,
                "bytes": res.kv_bytes_sent, "timeline": res.kv_stream_timeline}

    try:
        for threads, length in [(t, n) for t in args.threads for n in args.lengths]:
            await aengine.call(lambda e, t=threads: torch.set_num_threads(t))
            torch.set_num_threads(threads)
            await one(length, True)  # warm-up: connection, allocator, first-touch pages
            await one(length, False)
            samples: dict[bool, list[dict]] = {True: [], False: []}
            for i in range(args.iters):
                for stream in ((True, False) if i % 2 == 0 else (False, True)):
                    samples[stream].append(await one(length, stream))
            row = {"tokens": length, "torch_threads": threads, "layers": layout.num_layers,
                   "mib": samples[True][0]["bytes"] / 2**20, "transport": args.transport, "iters": args.iters}
            for stream, key in ((True, "on"), (False, "off")):
                totals = [s["total_s"] * 1e3 for s in samples[stream]]
                waits = [s["wait_s"] * 1e3 for s in samples[stream]]
                row[key] = {"total_ms_p50": statistics.median(totals), "total_ms_min": min(totals),
                            "wait_ms_p50": statistics.median(waits), "wait_ms_min": min(waits),
                            "total_ms": totals, "wait_ms": waits}
            row["ratio_p50"] = row["on"]["total_ms_p50"] / row["off"]["total_ms_p50"]
            marks = [s["timeline"] for s in samples[True] if s["timeline"]]
            if marks:  # when the pushes happened against the compute (median ms after prefill() began)
                keys = list(dict.fromkeys(k for m in marks for k in m))
                row["stream_timeline_ms_p50"] = {k: statistics.median(m[k] for m in marks if k in m) * 1e3
                                                 for k in keys}
            rows.append(row)
            print_row(row)
    finally:
        await aengine.stop()
        await tx.close()
        await rx.close()
    return rows


def print_row(row: dict) -> None:
    on, off = row["on"], row["off"]
    print(f"| {row['torch_threads']} | {row['tokens']:>6} | {row['mib']:6.1f} | "
          f"{off['total_ms_p50']:8.1f} ({off['total_ms_min']:.1f}) | "
          f"{on['total_ms_p50']:8.1f} ({on['total_ms_min']:.1f}) | {row['ratio_p50']:.3f} | "
          f"{off['wait_ms_p50']:6.1f} | {on['wait_ms_p50']:6.1f} |", flush=True)
    if row.get("stream_timeline_ms_p50"):
        print("  streamed, ms after prefill() began (p50): " + ", ".join(
            f"{k} {v:.1f}" for k, v in row["stream_timeline_ms_p50"].items()), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: a random `small` preset checkpoint)")
    p.add_argument("--lengths", default="512,2048", help="prompt lengths, comma separated")
    p.add_argument("--iters", type=int, default=5, help="requests per (length, setting)")
    p.add_argument("--transport", default="tcp", choices=("tcp", "nixl"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--attention", default="auto", help="attention backend (auto | torch | flashinfer)")
    p.add_argument("--threads", default="1,2", help="torch intra-op thread counts to run, comma separated "
                   "(1 is how the local launcher runs workers: OMP_NUM_THREADS=1)")
    p.add_argument("--receiver-gpu", help="GPU index of the decode-side receiver process (default: 1 when "
                   "--device cuda and there are 2+ GPUs, else the sender's)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    args.threads = [int(x) for x in args.threads.split(",")]
    args.lengths = [int(x) for x in args.lengths.split(",")]
    if args.receiver_gpu is None and args.device == "cuda":
        import torch

        args.receiver_gpu = "1" if torch.cuda.device_count() > 1 else None
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from engine.checkpoint import preset_config, write_random_checkpoint

            model_dir = str(write_random_checkpoint(Path(tmp) / "small", preset_config("small"), seed=0))
        print("prefill start -> KV acknowledged, ms: p50 (min); wait = after the prefill finished")
        print("| threads | tokens | MiB | stream off | stream on | on/off | wait off | wait on |")
        print("|---|---|---|---|---|---|---|---|")
        rows = asyncio.run(run(args, model_dir))
    if args.json:
        out = {"bench": "kv-stream-layers", "model": args.model or "small (random)", "device": args.device,
               "receiver_gpu": args.receiver_gpu,
               "cpu_count": os.cpu_count(),
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
