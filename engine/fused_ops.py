"""Triton kernels for the small element-wise ops of a decoder layer (CUDA, fp16/bf16 only).

At batch 1 a decode step is bound by kernel count, not bytes: RMSNorm is four kernels in torch
(``x.float()``, ``rms_norm``, ``.to(dtype)``, ``mul_`` by the weight), RoPE six per tensor, SiLU-and-
gate two, plus the residual add. Here each group is one launch:

* ``rms_norm(x, weight, eps)`` and ``add_rms_norm(x, delta, weight, eps)`` (``x += delta`` in place,
  then the norm of the new ``x``): float32 normalisation, cast to the model dtype, then the product
  with the weight rounded to the dtype, as ``engine.model.RMSNorm`` does. The sum of squares is a
  tree reduction and ``rsqrt`` is the hardware's, so a float32 intermediate can differ from torch's
  by an ulp; after the cast to bf16/fp16 that shows up as a rare 1-ulp (2 after the weight product)
  difference of the output.
* ``rope_qk(q, k, cos, sin)``: both rotations in one launch, out of place into contiguous
  ``[T, heads, head_dim]`` tensors (``k`` may be a strided view of the fused qkv output). The same
  products and sums as ``engine.model.apply_rope``, each rounded to the dtype, so bit-identical.
* ``rope_store_kv(q, k, v, cos, sin, cache, slots, src)``: ``rope_qk`` plus the attention backend's
  store of the rotated keys and the values into the paged cache (``engine.attention``'s
  ``kv_store_target``), one launch instead of four at batch 1.
* ``silu_mul(gate_up)``: ``silu(gate) * up`` from the fused ``[T, 2 * I]`` projection, with silu in
  float32 rounded to the dtype before the product (torch's order). ``exp`` is the hardware's, so a
  rare 1- or 2-ulp difference is possible there too.

Nothing here syncs with the host or allocates outside torch's caching allocator, and the grids
depend only on shapes, so every op can be captured in a CUDA graph. ``engine.model`` decides once,
in ``CausalLM.fuse_projections``, whether to use these (``available(device, dtype)``); the CPU and
float32 paths never touch this module. ``PDSERVE_FUSED_OPS=0`` turns them off. With
``TRITON_INTERPRET=1`` set before this module is imported the kernels run on CPU tensors
(``tests/unit/test_fused_ops.py``).
"""

from __future__ import annotations

import threading

import torch

from engine import compile_key
from pdserve.settings import env_switch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None

ENV = "PDSERVE_FUSED_OPS"
HALF_DTYPES = (torch.float16, torch.bfloat16)


def available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the fused kernels should run for a model on ``device`` in ``dtype``: CUDA, fp16/bf16,
    triton importable, and ``PDSERVE_FUSED_OPS`` not ``0``. Called once per model, not per step."""
    if not env_switch(ENV):
        return False
    return triton is not None and torch.device(device).type == "cuda" and dtype in HALF_DTYPES


def warm_compile_cache() -> threading.Thread | None:
    """The thread computing Triton's compiler fingerprint (``engine.compile_key``), started now unless
    ``pdserve serve`` started it at the process's start; join it before the first kernel launch. None
    where Triton or its ``triton_key`` is missing."""
    if getattr(getattr(getattr(triton, "runtime", None), "cache", None), "triton_key", None) is None:
        return None
    return compile_key.start()


# No FMA contraction: the kernels reproduce torch's rounding of every product and sum, and an fp16
# multiply-then-subtract (LLVM narrows the float32 ops between fp16 casts to fp16 ops) would otherwise
# fuse into one fma and skip the product's rounding (seen on an H100: RoPE off by 1 ulp in fp16). The
# kernels are memory bound; FMAs buy nothing. The interpreter ignores the option.
_EXACT = {"enable_fp_fusion": False}


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


if triton is not None:

    @triton.jit
    def _round(x, BF16: tl.constexpr):
        # float32 -> the model dtype and back: ``x`` rounded to nearest-even like torch's cast. bf16
        # by integer arithmetic: the GPU's cvt.rn gives the same bits, and Triton's interpreter
        # (numpy has no bf16) would truncate. Finite values only (a NaN may become an infinity).
        if BF16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        else:
            return x.to(tl.float16).to(tl.float32)

    @triton.jit
    def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, n_cols, x_stride, delta_stride, out_stride,
                         eps, HAS_DELTA: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_DELTA:
            d = tl.load(delta_ptr + row * delta_stride + cols, mask=mask, other=0.0).to(tl.float32)
            x = _round(x + d, BF16)  # x.add_(delta)
            tl.store(x_ptr + row * x_stride + cols, x.to(x_ptr.dtype.element_ty), mask=mask)
        var = tl.sum(x * x, axis=0) / n_cols
        normed = _round(x * tl.rsqrt(var + eps), BF16)  # rms_norm(x.float()).to(dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = _round(normed * w, BF16)  # .mul_(weight)
        tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotate(src_ptr, dst_ptr, row, dst_row, s_t, s_h, n_heads, c, s, half, HEADS: tl.constexpr,
                HALF: tl.constexpr, BF16: tl.constexpr):
        # Row ``row``'s heads [HEADS, HALF] of both halves; dst is contiguous [rows, n_heads, 2 * half],
        # written at row ``dst_row``.
        heads = tl.arange(0, HEADS)[:, None]
        cols = tl.arange(0, HALF)[None, :]
        mask = (heads < n_heads) & (cols < half)
        src = src_ptr + row * s_t + heads * s_h + cols
        dst = dst_ptr + dst_row * (n_heads * 2 * half) + heads * (2 * half) + cols
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
        # apply_rope: o1 = x1*cos - x2*sin, o2 = x2*cos + x1*sin, every product and sum rounded.
        o1 = _round(_round(x1 * c, BF16) - _round(x2 * s, BF16), BF16)
        o2 = _round(_round(x2 * c, BF16) + _round(x1 * s, BF16), BF16)
        tl.store(dst, o1.to(dst_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + half, o2.to(dst_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _cos_sin(cos_ptr, sin_ptr, row, cs_st, half, HALF: tl.constexpr):
        # Row ``row``'s cos and sin [1, HALF] in float32 (zero past ``half``).
        cols = tl.arange(0, HALF)[None, :]
        cmask = cols < half
        c = tl.load(cos_ptr + row * cs_st + cols, mask=cmask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + row * cs_st + cols, mask=cmask, other=0.0).to(tl.float32)
        return c, s

    @triton.jit
    def _rope_qk_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, q_st, q_sh, k_st, k_sh,
                        cs_st, n_q, n_k, half, QH: tl.constexpr, KH: tl.constexpr, HALF: tl.constexpr,
                        BF16: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c, s = _cos_sin(cos_ptr, sin_ptr, row, cs_st, half, HALF)
        _rotate(q_ptr, qo_ptr, row, row, q_st, q_sh, n_q, c, s, half, QH, HALF, BF16)
        _rotate(k_ptr, ko_ptr, row, row, k_st, k_sh, n_k, c, s, half, KH, HALF, BF16)

    @triton.jit
    def _rope_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, cache_ptr, slots_ptr, src_ptr,
                           t, q_st, q_sh, k_st, k_sh, v_st, v_sh, cs_st, n_q, n_k, d, half,
                           QH: tl.constexpr, KH: tl.constexpr, HALF: tl.constexpr, D: tl.constexpr,
                           HAS_SRC: tl.constexpr, BF16: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c, s = _cos_sin(cos_ptr, sin_ptr, row, cs_st, half, HALF)
        _rotate(q_ptr, qo_ptr, row, row, q_st, q_sh, n_q, c, s, half, QH, HALF, BF16)
        k_slot = tl.load(slots_ptr + row)
        v_slot = tl.load(slots_ptr + t + row)
        k_row = row
        v_row = row
        if HAS_SRC:  # a padding row stores another row's key/value (engine.cuda_graphs)
            k_row = tl.load(src_ptr + row)
            v_row = tl.load(src_ptr + t + row) - t
            c, s = _cos_sin(cos_ptr, sin_ptr, k_row, cs_st, half, HALF)
        _rotate(k_ptr, cache_ptr, k_row, k_slot, k_st, k_sh, n_k, c, s, half, KH, HALF, BF16)
        heads = tl.arange(0, KH)[:, None]
        dims = tl.arange(0, D)[None, :]
        vmask = (heads < n_k) & (dims < d)
        val = tl.load(v_ptr + v_row * v_st + heads * v_sh + dims, mask=vmask, other=0.0)
        tl.store(cache_ptr + v_slot * (n_k * d) + heads * d + dims, val, mask=vmask)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, gu_stride, out_stride, BF16: tl.constexpr,
                         BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * gu_stride + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        act = _round(g / (1.0 + tl.exp(-g)), BF16)  # F.silu, rounded before the gate product
        y = _round(act * u, BF16)
        tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in HALF_DTYPES:  # the kernels round to fp16/bf16: float32 keeps the torch ops
        raise ValueError(f"fused_ops: fp16/bf16 tensors only, got {x.dtype}")
    if x.stride(-1) != 1:
        raise ValueError("fused_ops: the last dimension must be contiguous")
    return x


def _norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _rows(x)
    n = x.shape[-1]
    if x.dim() != 2 or weight.shape != (n,) or not weight.is_contiguous():
        raise ValueError(f"fused_ops: expected x [T, {n}] and a contiguous weight [{n}]")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    block = triton.next_power_of_2(n)
    if delta is not None:
        _rows(delta)
        if delta.shape != x.shape or delta.dtype != x.dtype:
            raise ValueError("fused_ops: delta must have x's shape and dtype")
    _rms_norm_kernel[(x.shape[0],)](
        x, x if delta is None else delta, weight, out, n, x.stride(0),
        0 if delta is None else delta.stride(0), out.stride(0), eps,
        HAS_DELTA=delta is not None, BF16=x.dtype == torch.bfloat16, BLOCK=block, num_warps=_warps(block),
        **_EXACT,
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm`` of ``x [T, hidden]``: ``(rms_norm(x.float()) -> dtype) * weight``, a new tensor."""
    return _norm(x, None, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x.add_(delta)`` (in place: ``x`` is the running residual), then ``rms_norm(x, weight, eps)``."""
    return _norm(x, delta, weight, eps)


def _rope_inputs(op: str, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Checks the RoPE kernels' shared inputs; ``(T, heads, kv_heads, head_dim, head_dim / 2)``."""
    t, n_q, d = q.shape
    n_k = k.shape[1]
    half = d // 2
    if k.shape != (t, n_k, d) or cos.shape != (t, 1, half) or sin.shape != cos.shape or d % 2:
        raise ValueError(f"fused_ops.{op}: shapes q {tuple(q.shape)} k {tuple(k.shape)} "
                         f"cos {tuple(cos.shape)} sin {tuple(sin.shape)}")
    if not (q.dtype == k.dtype == cos.dtype == sin.dtype):
        raise ValueError(f"fused_ops.{op}: q, k, cos and sin must share a dtype")
    if sin.stride() != cos.stride() or cos.stride(-1) != 1:
        raise ValueError(f"fused_ops.{op}: cos and sin must have the same strides, last one 1")
    _rows(q)
    _rows(k)
    return t, n_q, n_k, d, half


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(apply_rope(q, cos, sin), apply_rope(k, cos, sin))`` in one launch.

    ``q [T, heads, head_dim]``, ``k [T, kv_heads, head_dim]`` (any strides with a contiguous last
    dimension, e.g. views of the fused qkv output), ``cos``/``sin [T, 1, head_dim / 2]`` in the same
    dtype. Returns new contiguous tensors.
    """
    t, n_q, n_k, d, half = _rope_inputs("rope_qk", q, k, cos, sin)
    q_out = torch.empty((t, n_q, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, n_k, d), dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    hp = triton.next_power_of_2(half)
    qh, kh = triton.next_power_of_2(n_q), triton.next_power_of_2(n_k)
    _rope_qk_kernel[(t,)](
        q, k, cos, sin, q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        n_q, n_k, half, QH=qh, KH=kh, HALF=hp, BF16=q.dtype == torch.bfloat16, num_warps=_warps(qh * hp),
        **_EXACT,
    )
    return q_out, k_out


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  cache: torch.Tensor, slots: torch.Tensor, src: torch.Tensor | None) -> torch.Tensor:
    """RoPE of ``q`` and ``k``, and the rotated keys and the values written into the paged KV cache, in
    one launch; returns the rotated ``q`` (new, contiguous ``[T, heads, head_dim]``).

    The same bytes as ``rope_qk`` followed by the attention backend's store (``rows = cat([k, v])``,
    ``rows.index_select(0, src)`` when ``src`` is given, ``cache.index_copy_(0, slots, rows)``):
    ``cache [rows, kv_heads, head_dim]`` is the layer's cache flattened to slot rows (contiguous),
    ``slots [2T]`` int64 the rows receiving the keys (first ``T``) then the values, ``src [2T]`` the row
    of ``cat([k, v])`` each slot receives (a CUDA-graph padding row stores row 0's key and value into
    row 0's slot again: identical bytes to one address, never a block outside the batch). Saves the
    concatenation, the gather and the scatter: three kernels a layer at batch 1.
    """
    t, n_q, n_k, d, half = _rope_inputs("rope_store_kv", q, k, cos, sin)
    if (v.shape != k.shape or cache.dim() != 3 or cache.shape[1:] != (n_k, d) or slots.shape != (2 * t,)
            or (src is not None and src.shape != (2 * t,))):
        raise ValueError(f"fused_ops.rope_store_kv: shapes k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"cache {tuple(cache.shape)} slots {tuple(slots.shape)}")
    if v.dtype != q.dtype or cache.dtype != q.dtype or not cache.is_contiguous():
        raise ValueError("fused_ops.rope_store_kv: v and the cache must have q's dtype, the cache contiguous")
    _rows(v)
    q_out = torch.empty((t, n_q, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out
    hp = triton.next_power_of_2(half)
    qh, kh = triton.next_power_of_2(n_q), triton.next_power_of_2(n_k)
    _rope_store_kernel[(t,)](
        q, k, v, cos, sin, q_out, cache, slots, slots if src is None else src, t, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), n_q, n_k, d, half, QH=qh, KH=kh,
        HALF=hp, D=triton.next_power_of_2(d), HAS_SRC=src is not None, BF16=q.dtype == torch.bfloat16,
        num_warps=_warps(qh * hp), **_EXACT,
    )
    return q_out


_SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2 * I]`` (gate first, as the fused gate/up matmul gives)
    -> a new ``[T, I]``."""
    _rows(gate_up)
    t, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError(f"fused_ops.silu_mul: odd last dimension {two_i}")
    n = two_i // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(_SILU_BLOCK, triton.next_power_of_2(n))
    _silu_mul_kernel[(t, triton.cdiv(n, block))](
        gate_up, out, n, gate_up.stride(0), out.stride(0), BF16=gate_up.dtype == torch.bfloat16,
        BLOCK=block, num_warps=_warps(block), **_EXACT,
    )
    return out
