"""A Triton matrix-vector product for decode at batch 1 (CUDA, fp16/bf16).

At batch 1 every projection of a decode step reads its whole weight to produce one row, so the step's
speed is the products' bandwidth. cuBLAS reaches 2.5-4.4 TB/s on the 8B shape's matrices against
~4.3-4.6 TB/s that a streaming read reaches (``bench/gemv_probe.py``); the small ones (o, qkv) lose most.
``gemv(x, w)`` computes ``x @ w.T`` for ``x [1, K]`` and ``w [N, K]`` (nn.Linear's layout, K
contiguous): each program owns ``BLOCK_N`` output rows and walks K in ``BLOCK_K`` steps, keeping a
``[BLOCK_N, BLOCK_K]`` float32 partial sum that is reduced once at the end, then adds the bias and
rounds once. No atomics and no split of K: the sum's order is fixed, so the result is deterministic
(splitting K into 2-8 float32 partials measured 1-8% slower on the 8B shapes).

``linear`` is what ``engine.model`` calls in place of ``F.linear`` when ``CausalLM.set_fused_ops`` turns
the kernel on: a single row goes through ``gemv``, anything larger through cuBLAS. The result differs
from cuBLAS's in the last bit of some elements (a different summation order), as cuBLAS's own kernels
for different batch sizes do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.settings import env_switch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None

# Two configurations, by row length, from a sweep of 96 on one H200 (bench/gemv_probe.py --triton,
# docs/gpu.md): rows of up to 8k elements take 2 rows per program, K in steps of 1024, 4 warps, 3 stages
# (within 1% of the best for the 8B shape's qkv, o, gate/up and lm_head); longer rows (down, K = 14336)
# 16 rows per program, 8 warps, 4 stages (the best there; the short-row one reached 93% of it). Against
# cuBLAS: qkv 3.73 vs 3.28 TB/s, o 3.24 vs 2.51, gate/up 4.37 vs 4.30, down 4.18 vs 3.77, lm_head 4.55
# vs 4.42. Shapes other than the 8B one's were not swept.
BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 2, 1024, 4, 3
LONG_ROW = 8192
LONG_ROW_CONFIG = {"block_n": 16, "block_k": 1024, "num_warps": 8, "num_stages": 4}
ENV = "PDSERVE_GEMV"


def enabled() -> bool:
    """Whether the fused kernels' models use ``linear`` (triton importable, ``PDSERVE_GEMV`` not 0)."""
    return triton is not None and env_switch(ENV)


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, n, k, w_stride, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN: tl.constexpr, HAS_BIAS: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < n
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * w_stride
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            if EVEN:
                w = tl.load(w_rows + cols[None, :], eviction_policy="evict_first")
                xv = tl.load(x_ptr + cols)
            else:
                cmask = cols < k
                w = tl.load(w_rows + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0,
                            eviction_policy="evict_first")
                xv = tl.load(x_ptr + cols, mask=cmask, other=0.0)
            acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:  # added in float32 before the one rounding, as cuBLAS's epilogue does
            y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, block_n: int = BLOCK_N,
         block_k: int = BLOCK_K, num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for ``x [1, K]``, ``w [N, K]`` -> ``[1, N]`` in ``x``'s dtype."""
    n, k = w.shape
    if x.shape != (1, k) or x.stride(-1) != 1 or w.stride(-1) != 1 or x.dtype != w.dtype:
        raise ValueError(f"gemv: x {tuple(x.shape)} {x.dtype} against w {tuple(w.shape)} {w.dtype}")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"gemv: bias {tuple(bias.shape)} against {n} outputs")
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, w if bias is None else bias, out, n, k, w.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN=n % block_n == 0 and k % block_k == 0, HAS_BIAS=bias is not None, num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` that runs ``gemv`` for a single row (a decode step at batch 1), cuBLAS otherwise."""
    if x.dim() == 2 and x.shape[0] == 1:
        if w.shape[1] > LONG_ROW:
            return gemv(x, w, bias, **LONG_ROW_CONFIG)
        return gemv(x, w, bias)
    return F.linear(x, w, bias)
