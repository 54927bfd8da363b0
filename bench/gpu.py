"""The GPU benchmark: one run, every number a ratio against a ceiling measured in the same run.

    python3 bench/gpu.py --out DIR [--items roofline,transfer,transformers,disagg] [--quick]

(on the device machine: ``bash bench/device_run.sh bench``). Writes ``DIR/gpu-<device>-<date>.json``
with top-level ``device``, ``command``, ``ceilings``, ``roofline``, ``transfer``, ``disagg_vs_colocated``
and ``transformers``, and prints a table per item. Needs nothing from the network: the llama3-8b
shape (Llama-3.1-8B) is built with random bf16 weights directly in GPU memory (writing 16 GB of
safetensors first would only measure the disk).

* **ceilings** — device-to-device copy bandwidth (bytes read + written over time) and the bf16
  8192^3 matmul rate, both on random data, timed with CUDA events (median of repeats).
* **roofline** — decode step time (CUDA-graph replay of the forward, flashinfer attention, lm_head
  and argmax; events) at batch 1/16/64 x context 1k/4k against the HBM bound (weight bytes + KV
  bytes read) / copy bandwidth; prefill of one 4k prompt against the matmul rate (FLOPs: 2 x linear
  params x tokens + causal attention). Also the eager (no graph) step at batch 1 and 64 and the
  host-inclusive step time.
* **transfer** — see ``gpu_transfer.bench_transfer``.
* **transformers** — single-request greedy decode tokens/s of the same weights through
  ``transformers`` ``generate`` against pdserve's decode path (``gpu_hf.py``).
* ``--variants``: tensor-core decode rows; transfer: kvtransfer NIXL configs (sub-ms poll naps, a spin
  window, the progress thread) and a UCX environment for the raw-NIXL rows, each in fresh processes.
* ``--variants`` (or ``--kernel-variants`` alone) also times decode with torch's element-wise ops, with
  ``engine.fused_ops``' Triton kernels, and with those plus ``engine.gemv``'s batch-1 products
  (``decode_fused_ops_variant``: batch x context, freshly captured graphs, alternated rounds).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_kernel_variants import DEFAULT_KERNEL_CONFIGS, KERNEL_CONFIGS, fused_ops_variant  # noqa: E402

from engine.attention import backend_geometry  # noqa: E402
from engine.attention.base import BatchSpec  # noqa: E402
from engine.attention.flashinfer_backend import FlashInferAttentionBackend  # noqa: E402
from engine.checkpoint import preset_config  # noqa: E402
from engine.cuda_graphs import CudaGraphConfig, DecodeGraphRunner  # noqa: E402
from engine.kv_layout import KVLayout  # noqa: E402
from engine.model import CausalLM  # noqa: E402
from pdserve.settings import bench_command  # noqa: E402

BLOCK = 16


def events_ms(fn, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` runs, each between two CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def machine() -> dict:
    smi = (
        subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        .stdout.strip()
        .splitlines()
    )
    name = torch.cuda.get_device_name(0)
    short = name.replace("NVIDIA ", "").split()[0].lower()
    n = torch.cuda.device_count()
    return {
        "name": name,
        "count": n,
        "slug": f"{n}x{short}" if n > 1 else short,
        "nvidia_smi": smi,
        "driver": smi[0].split(", ")[1] if smi else "?",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
    }


def ceilings(quick: bool) -> dict:
    n = (1 << 30) if quick else (2 << 30)  # bytes per buffer: far beyond the 50-60 MB L2
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = events_ms(lambda: dst.copy_(src), 20)
    copy_gbps = 2 * n / ms / 1e6
    src = dst = None  # noqa: F841 - free 2-4 GB before the matmul
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = events_ms(lambda: a @ b, 20)
    return {
        "copy_GBps": copy_gbps,
        "copy_bytes": 2 * n,
        "matmul_bf16_TFLOPs": 2 * 8192**3 / ms / 1e9,
        "matmul_shape": [8192, 8192, 8192],
    }


def random_model(config, seed: int = 0) -> CausalLM:
    """llama3-8b in bf16 on the GPU, weights drawn there (std 1/sqrt(fan_in), norms ~1)."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() == 2 and "embed_tokens" not in name:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
            else:
                p.normal_(0.0, 1.0)
    model.fuse_projections()  # as engine.model_runner does: one q/k/v and one gate/up matmul
    return model.eval()


def weight_bytes_per_step(model: CausalLM, batch: int) -> int:
    """Bytes of weights one decode step reads: every matrix and norm, but only ``batch`` embedding rows."""
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            total += batch * p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


@torch.inference_mode()
def roofline(model: CausalLM, cfg, ceil: dict, quick: bool, *, tensor_cores: bool | None = None,
             with_prefill: bool = True, batches: list[int] | None = None,
             contexts: list[int] | None = None) -> dict:
    """``tensor_cores``: flashinfer's decode kernel choice (None: the backend's rule, CUDA cores at GQA
    group 4); ``with_prefill=False`` times decode only (the variant rows)."""
    if batches is None or contexts is None:
        batches, contexts = ([1, 64], [1024]) if quick else ([1, 16, 64], [1024, 4096])
    max_ctx = max(contexts) + BLOCK
    per_seq = -(-max_ctx // BLOCK)
    num_blocks = max(batches) * per_seq + 1
    layout = KVLayout.for_model(cfg, block_size=BLOCK, dtype="bfloat16", memory="cuda")
    kv = torch.empty(layout.cache_shape(num_blocks), dtype=torch.bfloat16, device="cuda")
    kv.normal_()  # random K/V: timing on zeros can flatter
    kw = dict(backend_geometry(cfg, block_size=BLOCK), device="cuda", dtype=torch.bfloat16)
    backend = FlashInferAttentionBackend(decode_tensor_cores=tensor_cores, **kw)
    runner = DecodeGraphRunner(
        model,
        backend,
        kv,
        CudaGraphConfig(max_batch=max(batches), max_model_len=max_ctx, buckets=tuple(batches)),
    )
    t0 = time.perf_counter()
    runner.capture()
    capture_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(num_blocks - 1, generator=gen).add_(1).tolist()  # block 0: capture's dummy
    kv_bytes_tok = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    rows = []
    eager = FlashInferAttentionBackend(**kw)
    for ctx in contexts:
        for b in batches:
            tables = [perm[i * per_seq : (i + 1) * per_seq] for i in range(b)]
            spec = BatchSpec(query_lens=[1] * b, context_lens=[ctx] * b, block_tables=tables)
            ids = list(range(100, 100 + b))

            def step(ids=ids, spec=spec):
                hidden = runner.run(ids, spec)
                return model.compute_logits(hidden).argmax(-1)

            gpu_ms = events_ms(step, 10 if quick else 30)
            # The graph alone, staged once and replayed: the GPU's time for the step without the host's
            # planning and copies in front of each launch (which the engine overlaps when it launches
            # steps ahead, engine.step_ahead), so step_ms - replay_ms is that host time left exposed.
            staged = runner.stage(ids, spec)

            def replay(g=staged, b=b):
                return model.compute_logits(runner.replay(g, b)).argmax(-1)

            replay_ms = events_ms(replay, 10 if quick else 30)
            t1 = time.perf_counter()
            for _ in range(10):
                step().tolist()  # the engine's one sync per step
            wall_ms = (time.perf_counter() - t1) / 10 * 1e3
            bytes_read = weight_bytes_per_step(model, b) + b * (ctx + 1) * kv_bytes_tok
            bound_ms = bytes_read / (ceil["copy_GBps"] * 1e9) * 1e3
            row = {
                "batch": b,
                "context": ctx,
                "step_ms": gpu_ms,
                "step_wall_ms": wall_ms,
                "bytes_read": bytes_read,
                "hbm_bound_ms": bound_ms,
                "fraction_of_bound": bound_ms / gpu_ms,
                "replay_ms": replay_ms,
                "replay_fraction_of_bound": bound_ms / replay_ms,
                "tokens_per_s": b / wall_ms * 1e3,
            }
            if b in (1, max(batches)) and ctx == contexts[0]:

                def eager_step(ids=ids, spec=spec):
                    meta = eager.plan(spec)
                    hidden = model(torch.tensor(ids, device="cuda"), meta.positions, kv, meta)
                    return model.compute_logits(hidden).argmax(-1)

                row["eager_step_ms"] = events_ms(eager_step, 10)
                row["graph_speedup"] = row["eager_step_ms"] / gpu_ms
            rows.append(row)
            print(
                f"  decode b={b:3d} ctx={ctx:5d}: {gpu_ms:7.2f} ms (bound {bound_ms:6.2f}, "
                f"{bound_ms / gpu_ms:5.1%}); the graph replayed alone {replay_ms:7.2f} ms "
                f"({bound_ms / replay_ms:5.1%})",
                flush=True,
            )
    runner.graphs.clear()
    kv.untyped_storage().resize_(0)  # the 32 GB cache: gone before the prefill allocates its own
    torch.cuda.empty_cache()
    fused = model.model.norm.kernels is not None  # engine.fused_ops' Triton kernels in the graphs
    if not with_prefill:
        return {"decode": rows, "decode_tensor_cores": backend.use_tensor_cores, "graph_capture_s": capture_s,
                "fused_ops": fused}
    pre = prefill_4k(model, cfg, ceil, kw)
    goal_row = max((r for r in rows if r["batch"] == max(batches)), key=lambda r: r["context"])
    return {
        "decode": rows,
        "decode_tensor_cores": backend.use_tensor_cores,
        "fused_ops": fused,
        "prefill": pre,
        "graph_capture_s": capture_s,
        "goals": {
            "decode_fraction_of_hbm_bound_at_max_batch": goal_row["fraction_of_bound"],
            "decode_goal": 0.70,
            "prefill_fraction_of_matmul_peak": pre["fraction_of_matmul_peak"],
            "prefill_goal": 0.55,
        },
    }


@torch.inference_mode()
def prefill_4k(model: CausalLM, cfg, ceil: dict, kw: dict, tokens: int = 4096) -> dict:
    layout = KVLayout.for_model(cfg, block_size=BLOCK, dtype="bfloat16", memory="cuda")
    n_blocks = tokens // BLOCK
    kv = layout.allocate(n_blocks, device="cuda")
    backend = FlashInferAttentionBackend(**kw)
    spec = BatchSpec(query_lens=[tokens], context_lens=[0], block_tables=[list(range(n_blocks))])
    ids = torch.randint(3, cfg.vocab_size, (tokens,), device="cuda")

    def run():
        meta = backend.plan(spec)
        hidden = model(ids, meta.positions, kv, meta)
        return model.compute_logits(hidden[-1:]).argmax(-1)

    ms = events_ms(run, 10)
    linear = sum(
        p.numel()
        for n, p in model.named_parameters()
        if p.dim() == 2 and "embed" not in n and "lm_head" not in n
    )
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * (tokens + 1) / 2  # causal QK^T + PV
    flops = 2 * linear * tokens + attn + 2 * cfg.hidden_size * cfg.vocab_size
    tflops = flops / ms / 1e9
    print(
        f"  prefill {tokens} tokens: {ms:.1f} ms, {tflops:.0f} TFLOP/s "
        f"({tflops / ceil['matmul_bf16_TFLOPs']:.1%} of the measured matmul rate)",
        flush=True,
    )
    return {
        "tokens": tokens,
        "ms": ms,
        "flops": flops,
        "TFLOPs": tflops,
        "fraction_of_matmul_peak": tflops / ceil["matmul_bf16_TFLOPs"],
        "attention": "flashinfer fa2 paged",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--items", default="roofline,transfer,transformers,disagg")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--decode-tensor-cores", choices=("auto", "on", "off"), default="auto",
                    help="roofline: flashinfer's decode kernel (auto: the backend's rule by GQA group)")
    ap.add_argument("--disagg-modes", default="disaggregated,conditional,colocated,colocated-chunk512",
                    help="disagg item: which clusters to run (1P1D, 1P1D + conditional, 2 colocated with "
                    "the default and a 512-token chunk budget), each behind one router, the time budget "
                    "split between them")
    ap.add_argument("--tag", default="", help="suffix of the result file name (gpu-<device>-<date>-TAG.json)")
    ap.add_argument("--variants", action="store_true",
                    help="also time tensor-core decode and the NIXL transfer variants (gpu_transfer.py)")
    ap.add_argument("--kernel-variants", action="store_true",
                    help="time decode with torch ops / fused kernels / fused kernels + batch-1 GEMV (alone)")
    ap.add_argument("--kernel-rounds", type=int, default=2, help="alternated rounds of the kernel variant")
    ap.add_argument("--kernel-configs", default=",".join(DEFAULT_KERNEL_CONFIGS),
                    help=f"the kernel variant's configurations, of {', '.join(KERNEL_CONFIGS)}")
    args = ap.parse_args()
    items = set(args.items.split(","))
    info = machine()
    command = bench_command()
    result = {
        "device": info,
        "command": command,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(),
        "roofline": None,
        "transfer": None,
        "disagg_vs_colocated": None,
        "transformers": None,
    }
    print(f"# {info['name']} x{info['count']}, driver {info['driver']}, torch {info['torch']}", flush=True)
    result["ceilings"] = ceil = ceilings(args.quick)
    print(
        f"  copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['matmul_bf16_TFLOPs']:.0f} TFLOP/s",
        flush=True,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = ((f"-{args.tag}" if args.tag else "") + ("-variants" if args.variants else "")
              + ("-kernels" if args.kernel_variants and not args.variants else ""))
    path = out / f"gpu-{info['slug']}-{dt.date.today().isoformat()}{suffix}.json"

    def save():
        path.write_text(json.dumps(result, indent=1, default=str) + "\n")

    cfg = preset_config("llama3-8b")
    if items & {"roofline", "transformers"} or args.kernel_variants:
        model = random_model(cfg)
        if "roofline" in items:
            tc = {"auto": None, "on": True, "off": False}[args.decode_tensor_cores]
            result["roofline"] = roofline(model, cfg, ceil, args.quick, tensor_cores=tc)
            save()
        if args.variants:
            result["decode_tensor_core_variant"] = roofline(model, cfg, ceil, args.quick, tensor_cores=True,
                                                            with_prefill=False, batches=[16, 64],
                                                            contexts=[1024, 4096])
            save()
        if args.variants or args.kernel_variants:
            result["decode_fused_ops_variant"] = fused_ops_variant(roofline, model, cfg, ceil, args.quick,
                                                                   rounds=args.kernel_rounds,
                                                                   configs=tuple(args.kernel_configs.split(",")))
            save()
        if "transformers" in items:
            from gpu_hf import vs_transformers

            result["transformers"] = vs_transformers(model, cfg)
            save()
        del model
        torch.cuda.empty_cache()
    if "transfer" in items:
        from gpu_transfer import bench_transfer

        result["transfer"] = bench_transfer(out, quick=args.quick, transfer_variants=args.variants)
        save()
    if "disagg" in items:
        try:
            from gpu_disagg import bench_disagg
        except ImportError as exc:
            result["disagg_vs_colocated"] = {"status": "not run", "reason": f"bench/gpu_disagg.py: {exc}"}
        else:
            result["disagg_vs_colocated"] = bench_disagg(out, quick=args.quick,
                                                         modes=tuple(args.disagg_modes.split(",")))
        save()
    save()
    from gpu_tables import print_tables

    path.with_suffix(".md").write_text(print_tables(result) + "\n")
    print(f"wrote {path} and {path.with_suffix('.md').name}")


if __name__ == "__main__":
    main()
