"""Decode's matrix products at small batch, per BLAS library: how close each comes to HBM bandwidth.

At batch 1 a decode step of the 8B shape is ~80% matrix-vector products (docs/gpu.md), so their
bandwidth sets the step's fraction of the HBM bound. This times ``F.linear`` for each of the llama3-8b
shape's weight matrices (fused qkv, o, fused gate/up, down, lm_head) in bf16 at batch 1, 4 and 16 with
torch's cuBLAS and with cuBLASLt (``torch.backends.cuda.preferred_blas_library``), each in a CUDA graph
over rotating weight copies (``_ms``, ``_rotate``), and prints achieved GB/s per product. The 1 GiB
device copy printed beside them is timed the same way (in a graph of 5), which reads lower than an eager
copy of the same size.

``--triton`` also sweeps ``engine.gemv``'s configurations (rows per program, K step, warps, pipeline
stages) at batch 1 and prints the best of each beside cuBLAS and the configuration ``engine.gemv.linear``
uses for that shape.

    python -m bench.gemv_probe --out DIR [--triton]    (bash bench/device_run.sh gemv [-- --triton])
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


def _ms(fn, iters: int = 64) -> float:
    """GPU time of one call, from a CUDA graph of ``iters`` calls replayed (as a decode step runs them):
    timing eager calls back to back would time the host's launches of the small products."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (10 * iters)


def _copy_gbps() -> float:
    """Device-to-device copy of 1 GiB, read + write bytes per second: the bandwidth the bound uses."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / _ms(lambda: dst.copy_(src), 5) / 1e6


def _rotate(fn, weights: list):
    """A call of ``fn`` on the next of ``weights`` each time (captured in a graph: the same order)."""
    turn = [0]

    def call():
        turn[0] = (turn[0] + 1) % len(weights)
        return fn(weights[turn[0]])
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--layouts", action="store_true",
                    help="also x @ W^T with W^T stored contiguous, (W @ x^T)^T and torch.mv (cuBLAS)")
    ap.add_argument("--triton", action="store_true", help="sweep engine.gemv's configurations at batch 1")
    args = ap.parse_args()
    rows = []
    sweeps = []
    copy_gbps = _copy_gbps()
    for name, n_out, n_in in SHAPES:
        # copies enough to fill 512 MiB, called in turn: each call reads memory the last ones did not, as
        # a decode step's layers do (the small matrices would otherwise sit in the 50 MB L2)
        copies = max(1, (512 << 20) // (n_out * n_in * 2))
        ws = [torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16) / n_in ** 0.5
              for _ in range(copies)]
        w = ws[0]
        for b in (int(x) for x in args.batches.split(",")):
            x = torch.randn(b, n_in, device="cuda", dtype=torch.bfloat16)
            row = {"matrix": name, "out": n_out, "in": n_in, "batch": b, "weight_bytes": w.numel() * 2,
                   "copies": copies}
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                ms = _ms(_rotate(lambda w, x=x: F.linear(x, w), ws))
                row[f"{lib}_us"] = round(ms * 1e3, 2)
                row[f"{lib}_gbps"] = round(w.numel() * 2 / ms / 1e6, 1)
            if args.layouts:  # the same product with the weight laid out or called differently
                torch.backends.cuda.preferred_blas_library("cublas")
                torch.backends.cuda.preferred_blas_library("cublas")
                wts = [m.t().contiguous() for m in ws]
                for lname, fn in (("x_wt", _rotate(lambda wt, x=x: x @ wt, wts)),
                                  ("w_xt", _rotate(lambda w, x=x: (w @ x.t()).t(), ws)),
                                  ("mv", _rotate(lambda w, x=x: torch.mv(w, x[0]), ws) if b == 1 else None)):
                    if fn is not None:
                        ms = _ms(fn)
                        row[f"{lname}_us"] = round(ms * 1e3, 2)
                        row[f"{lname}_gbps"] = round(w.numel() * 2 / ms / 1e6, 1)
                del wts
            rows.append(row)
            if args.triton and b == 1:
                sweeps.append(_sweep(name, x, ws))
                row["triton_best"] = sweeps[-1]["best"]
        del w, ws
    torch.backends.cuda.preferred_blas_library("cublas")
    print(f"device copy {copy_gbps:.0f} GB/s (read + write)")
    print(f"{'matrix':8} {'batch':>5} {'cublas GB/s':>12} {'cublasLt GB/s':>14} {'us':>14}")
    for r in rows:
        print(f"{r['matrix']:8} {r['batch']:>5} {r['cublas_gbps']:>12} {r['cublaslt_gbps']:>14} "
              f"{r['cublas_us']:>7}/{r['cublaslt_us']}"
              + "".join(f"  {k[:-5]} {r[k]}" for k in r
                        if k.endswith("_gbps") and not k.startswith("cublas")))
    for sw in sweeps:
        b = sw["best"]
        d = sw["default"] or {}
        print(f"triton {sw['matrix']:8} best {b['gbps']} GB/s {b['us']} us {b['config']}; "
              f"engine default {d.get('gbps')} GB/s {d.get('us')} us")
    Path(args.out, "gemv-probe.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(0), "copy_gbps": round(copy_gbps, 1), "rows": rows,
         "triton_sweeps": sweeps}, indent=1))


def _configs():
    for bn in (2, 4, 8, 16, 32):
        for bk in (128, 256, 512, 1024):
            if 1024 <= bn * bk <= 16384:
                for warps in (4, 8):
                    for stages in (2, 3, 4):
                        yield {"block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages}


def _sweep(name: str, x: torch.Tensor, ws: list) -> dict:
    """engine.gemv over every configuration of ``_configs`` for one matrix at batch 1, sorted by GB/s,
    and the engine's default configuration."""
    from engine import gemv as gv
    ref = F.linear(x, ws[0]).float()
    nbytes = ws[0].numel() * 2
    results = []
    default = {"block_n": gv.BLOCK_N, "block_k": gv.BLOCK_K, "num_warps": gv.NUM_WARPS,
               "num_stages": gv.NUM_STAGES}
    if ws[0].shape[1] > gv.LONG_ROW:  # the configuration engine.gemv.linear picks for this shape
        default = gv.LONG_ROW_CONFIG
    for cfg in _configs():
        err = (gv.gemv(x, ws[0], **cfg).float() - ref).abs().max().item()
        ms = _ms(_rotate(lambda w, cfg=cfg: gv.gemv(x, w, **cfg), ws))
        results.append({"config": cfg, "us": round(ms * 1e3, 2), "gbps": round(nbytes / ms / 1e6, 1),
                        "max_abs_err_vs_cublas": err, "default": cfg == default})
    results.sort(key=lambda r: -r["gbps"])
    return {"matrix": name, "best": results[0], "default": next((r for r in results if r["default"]), None),
            "results": results}
