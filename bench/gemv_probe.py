"""Decode's matrix products at small batch, per BLAS library: how close each comes to HBM bandwidth.

At batch 1 a decode step of the 8B shape is ~80% matrix-vector products (docs/gpu.md), so their
bandwidth sets the step's fraction of the HBM bound. This times ``F.linear`` for each of the llama3-8b
shape's weight matrices (fused qkv, o, fused gate/up, down, lm_head) in bf16 at batch 1, 4 and 16 with
torch's cuBLAS and with cuBLASLt (``torch.backends.cuda.preferred_blas_library``), beside a device copy
of the same bytes, and prints achieved GB/s per product.

    python -m bench.gemv_probe --out DIR     (bash bench/device_run.sh gemv)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

# (name, out_features, in_features) of the llama3-8b shape's per-layer matrices and its lm_head
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
          ("lm_head", 128256, 4096)]


def _ms(fn, iters: int = 200) -> float:
    for _ in range(20):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--batches", default="1,4,16")
    args = ap.parse_args()
    rows = []
    copy_src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    copy_gbps = 2 * copy_src.numel() / _ms(lambda: copy_dst.copy_(copy_src), 20) / 1e6
    del copy_src, copy_dst
    for name, n_out, n_in in SHAPES:
        w = torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16) / n_in ** 0.5
        for b in (int(x) for x in args.batches.split(",")):
            x = torch.randn(b, n_in, device="cuda", dtype=torch.bfloat16)
            row = {"matrix": name, "out": n_out, "in": n_in, "batch": b, "weight_bytes": w.numel() * 2}
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                ms = _ms(lambda: F.linear(x, w))
                row[f"{lib}_us"] = round(ms * 1e3, 2)
                row[f"{lib}_gbps"] = round(w.numel() * 2 / ms / 1e6, 1)
            rows.append(row)
        del w
    torch.backends.cuda.preferred_blas_library("cublas")
    print(f"device copy {copy_gbps:.0f} GB/s (read + write)")
    print(f"{'matrix':8} {'batch':>5} {'cublas GB/s':>12} {'cublasLt GB/s':>14} {'us':>14}")
    for r in rows:
        print(f"{r['matrix']:8} {r['batch']:>5} {r['cublas_gbps']:>12} {r['cublaslt_gbps']:>14} "
              f"{r['cublas_us']:>7}/{r['cublaslt_us']}")
    Path(args.out, "gemv-probe.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(0), "copy_gbps": round(copy_gbps, 1), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
