"""Paged attention through flashinfer's batch wrappers (CUDA, fp16/bf16), plan once per step.

Per step ``plan`` builds, with numpy on the host, flashinfer's page tables for the whole batch
(``kv_indptr``, ``kv_indices``, ``kv_last_page_len``; int32) and the cache slots this step's keys and
values go to, copies them to the device in one pinned ``non_blocking`` copy, and calls
``wrapper.plan`` for each group — so no layer and no kernel waits on the host:

* **decode** — the leading run of sequences with one query token (the runner puts them first):
  ``BatchDecodeWithPagedKVCacheWrapper``.
* **prefill** — everything after it (prompts, chunks, prompts behind a prefix-cache hit, and any
  single-token sequence out of order): ``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True``.
  flashinfer aligns the causal mask bottom-right (query ``i`` of ``q`` sees keys ``<= kv_len - q + i``),
  which is exactly "cached context, then this step's tokens", so a chunk or a prefix hit needs no mask.

``forward`` per layer: one ``index_copy_`` writes ``k``/``v`` into the layer's cache (the cache layout
``[num_blocks, 2, block_size, kv_heads, head_dim]`` is flashinfer's paged NHD layout as is; with
``engine.fused_ops`` the model's RoPE kernel has already written them at ``kv_store_target``), then the
wrappers' ``run``. Both wrappers share one float workspace (they run one after the other).

CUDA graphs (``engine.cuda_graphs``): ``graph_state(batch_size, max_blocks_per_seq)`` gives static
device buffers and a ``use_cuda_graph`` decode wrapper for one batch-size bucket; ``plan_graph`` fills
them for a (possibly smaller) decode batch. Padding rows write their K/V to row 0's slot with row
0's own K/V (``kv_src``), so duplicate slots receive identical bytes and no cache block is touched
that the batch does not own.

The model's dtype must be fp16 or bf16 (flashinfer has no fp32 kernels); ``supports`` says whether
a model can use this backend, and ``engine.attention.get_backend("auto")`` falls back to torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from engine.attention.base import AttentionBackend, AttentionMetadata, BatchSpec
from pdserve.settings import env_switch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
WORKSPACE_BYTES = 128 << 20  # flashinfer's recommended split-k scratch size


LEAN_IMPORT_ENV = "PDSERVE_FLASHINFER_LEAN"


_background_lock = threading.Lock()
_background: threading.Thread | None = None  # import_in_background's thread, until load_flashinfer joins it


def import_in_background() -> None:
    """Start ``import_flashinfer`` on a daemon thread (engine.attention.prefetch decides when); the next
    ``load_flashinfer`` waits for it. An import that failed there is tried again, and raises, on the
    caller's thread."""
    global _background
    with _background_lock:
        if _background is None:
            _background = threading.Thread(target=_import_quietly, name="flashinfer-prefetch", daemon=True)
            _background.start()


def _import_quietly() -> None:
    try:
        import_flashinfer()
    except Exception:  # noqa: BLE001 -- absent or broken: load_flashinfer raises it on its caller's thread
        pass


def load_flashinfer() -> SimpleNamespace:
    """flashinfer's two paged-attention wrappers (once a background import, if one runs, is done)."""
    global _background
    with _background_lock:
        thread, _background = _background, None
    if thread is not None and thread is not threading.current_thread():
        thread.join()
    return import_flashinfer()


def import_flashinfer() -> SimpleNamespace:
    """flashinfer's two paged-attention wrappers, importing only the modules they live in.

    ``import flashinfer`` runs the package's ``__init__``, which imports nearly every subpackage (MoE,
    GEMM, quantization, GDN, ...): 2.5-3.5 s of a worker's start on an H200 host, where
    ``flashinfer.decode`` and ``flashinfer.prefill`` alone take ~1.5 s (``bench/import_profile.py``,
    docs/gpu.md "Boot"). So when nothing has imported flashinfer yet, the package module is created
    from its spec without running ``__init__`` and the two submodules are imported under it. The first
    access to any other attribute of the package runs ``__init__`` then (a module ``__getattr__``), so a
    later ``import flashinfer`` anywhere in the process still sees the whole package.
    ``PDSERVE_FLASHINFER_LEAN=0`` imports the whole package up front instead.
    """
    if "flashinfer" not in sys.modules and env_switch(LEAN_IMPORT_ENV):
        spec = importlib.util.find_spec("flashinfer")
        if spec is None:
            raise ImportError("No module named 'flashinfer'")
        package = importlib.util.module_from_spec(spec)

        def complete(name: str):
            del package.__getattr__  # once: afterwards a missing attribute is an AttributeError
            spec.loader.exec_module(package)
            return getattr(package, name)

        package.__getattr__ = complete
        sys.modules["flashinfer"] = package
        try:
            importlib.import_module("flashinfer.decode")
            importlib.import_module("flashinfer.prefill")
        except BaseException:
            for name in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]:
                del sys.modules[name]
            raise
    decode = importlib.import_module("flashinfer.decode")
    prefill = importlib.import_module("flashinfer.prefill")
    return SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=decode.BatchDecodeWithPagedKVCacheWrapper,
                           BatchPrefillWithPagedKVCacheWrapper=prefill.BatchPrefillWithPagedKVCacheWrapper)


def flashinfer_available() -> bool:
    try:
        load_flashinfer()
    except Exception:  # ImportError, or a broken native dependency
        return False
    return torch.cuda.is_available()


def supports(*, head_dim: int, dtype: torch.dtype | None) -> bool:
    return head_dim in SUPPORTED_HEAD_DIMS and (dtype is None or dtype in SUPPORTED_DTYPES)


@dataclass(kw_only=True)
class FlashInferMetadata(AttentionMetadata):
    kv_slots: torch.Tensor  # [2T] rows of the flat cache view receiving k (first T) then v (last T)
    kv_src: torch.Tensor | None = None  # [2T] rows of cat([k, v]) to store (graph padding), None: all
    num_decodes: int = 0
    num_prefill_tokens: int = 0
    decode: object | None = None  # the planned decode wrapper (None: no decode group)
    prefill: object | None = None  # the planned prefill wrapper (None: no prefill group)
    plan_args: dict = field(default_factory=dict)  # wrappers still to plan once the dtype is known


@dataclass
class DecodeGraphState:
    """Static buffers of one CUDA-graph batch-size bucket (captured once, replayed every step)."""

    batch_size: int
    max_blocks: int
    wrapper: object
    host: torch.Tensor  # pinned int64 staging: positions [B] | kv_slots [2B] | kv_src [2B]
    dev: torch.Tensor  # the same on the device
    indices_host: torch.Tensor  # pinned int32 [B * max_blocks]
    indices_dev: torch.Tensor
    meta: FlashInferMetadata


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        device: torch.device | str,
        sliding_window: int | None = None,
        dtype: torch.dtype | None = None,
        workspace_bytes: int = WORKSPACE_BYTES,
        prefill_backend: str = "fa2",
        decode_tensor_cores: bool | None = None,
    ) -> None:
        super().__init__(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            device=device,
            sliding_window=sliding_window,
        )
        if self.device.type != "cuda":
            raise ValueError(f"flashinfer attention needs a CUDA device, got {self.device}")
        if not supports(head_dim=head_dim, dtype=dtype):
            raise ValueError(
                f"flashinfer attention supports head_dim {SUPPORTED_HEAD_DIMS} in fp16/bf16, "
                f"got head_dim={head_dim} dtype={dtype}"
            )
        flashinfer = self._fi = load_flashinfer()
        self.dtype = dtype  # None: learnt from the first forward's q
        # Decode on tensor cores (flashinfer's prefill kernels) from GQA group 4 up. Measured on H200,
        # llama3-8b shape, graph replay (bench/results/gpu-2xh200-2026-11-21-variants.md): batch 64 x 4k
        # context 21.4 -> 15.9 ms (54% -> 73% of the HBM bound), faster at every measured batch/context.
        # None: that rule; True/False force it.
        group = num_heads // num_kv_heads
        self.use_tensor_cores = group >= 4 if decode_tensor_cores is None else decode_tensor_cores
        self.window_left = -1 if sliding_window is None else sliding_window - 1
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores
        )
        # "fa2" by default: its JIT module builds in a fraction of FA3's (CUTLASS) time, and attention
        # is a small share of a prefill's FLOPs next to the projections; "auto" picks FA3 on Hopper.
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=prefill_backend
        )

    # ---- per step ------------------------------------------------------------------------------
    def _tables(self, batch: BatchSpec):
        """Host arrays shared by both paths: kv lengths, per-sequence page counts, flat page ids."""
        bs = self.block_size
        q_lens = np.asarray(batch.query_lens, dtype=np.int64)
        ctx = np.asarray(batch.context_lens, dtype=np.int64)
        if len(q_lens) == 0 or (q_lens <= 0).any() or (ctx < 0).any():
            raise ValueError("a step needs at least one sequence, each with >= 1 query token")
        kv_lens = ctx + q_lens
        n_pages = -(-kv_lens // bs)
        pages = []
        for i, table in enumerate(batch.block_tables):
            need = int(n_pages[i])
            if len(table) < need:
                raise ValueError(f"sequence {i} has {len(table)} blocks but {kv_lens[i]} tokens need {need}")
            pages.append(np.asarray(table[:need], dtype=np.int64))
        return q_lens, ctx, kv_lens, n_pages, pages

    def _slots(self, q_lens, ctx, pages) -> tuple[np.ndarray, np.ndarray]:
        """positions [T] and flat-cache rows [T] of this step's keys (values sit block_size after)."""
        bs = self.block_size
        seq_of = np.repeat(np.arange(len(q_lens)), q_lens)
        starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]])
        positions = ctx[seq_of] + np.arange(int(q_lens.sum())) - starts[seq_of]
        block_ids = _gather_blocks(pages, seq_of, positions, bs)
        return positions, block_ids * 2 * bs + positions % bs

    def plan(self, batch: BatchSpec) -> FlashInferMetadata:
        q_lens, ctx, kv_lens, n_pages, pages = self._tables(batch)
        positions, k_slots = self._slots(q_lens, ctx, pages)
        total = len(positions)
        not_one = np.flatnonzero(q_lens != 1)
        nd = int(not_one[0]) if len(not_one) else len(q_lens)

        kv_indptr = np.zeros(len(q_lens) + 1, dtype=np.int32)
        np.cumsum(n_pages, out=kv_indptr[1:])
        last_len = (kv_lens - (n_pages - 1) * self.block_size).astype(np.int32)
        indices = np.concatenate(pages).astype(np.int32)

        # One host->device copy for everything the kernels index with on the device.
        packed = np.concatenate([positions, k_slots, k_slots + self.block_size, indices.astype(np.int64)])
        dev = torch.from_numpy(packed).pin_memory().to(self.device, non_blocking=True)
        positions_d, slots_d = dev[:total], dev[total : 3 * total]
        indices_d = dev[3 * total :].to(torch.int32)

        args: dict = {}
        if nd:
            d_ptr = kv_indptr[: nd + 1]
            args["decode"] = (_pinned(d_ptr), indices_d[: int(d_ptr[-1])], _pinned(last_len[:nd]))
        if nd < len(q_lens):
            p_ptr = kv_indptr[nd:] - kv_indptr[nd]
            qo = np.zeros(len(q_lens) - nd + 1, dtype=np.int32)
            np.cumsum(q_lens[nd:], out=qo[1:])
            args["prefill"] = (
                _pinned(qo),
                _pinned(p_ptr),
                indices_d[int(kv_indptr[nd]) :],
                _pinned(last_len[nd:]),
            )
        meta = FlashInferMetadata(
            backend=self,
            num_tokens=total,
            positions=positions_d,
            kv_slots=slots_d,
            num_decodes=nd,
            num_prefill_tokens=total - nd,
            plan_args=args,
        )
        if self.dtype is not None:
            self._plan_wrappers(meta, self.dtype)
        return meta

    def _plan_wrappers(self, meta: FlashInferMetadata, dtype: torch.dtype) -> None:
        common = dict(
            q_data_type=dtype, kv_data_type=dtype, sm_scale=self.scale, window_left=self.window_left
        )
        h, kvh, d, bs = self.num_heads, self.num_kv_heads, self.head_dim, self.block_size
        if "decode" in meta.plan_args:
            indptr, indices, last = meta.plan_args["decode"]
            self.decode_wrapper.plan(indptr, indices, last, h, kvh, d, bs, **common)
            meta.decode = self.decode_wrapper
        if "prefill" in meta.plan_args:
            qo, indptr, indices, last = meta.plan_args["prefill"]
            self.prefill_wrapper.plan(qo, indptr, indices, last, h, kvh, d, bs, causal=True, **common)
            meta.prefill = self.prefill_wrapper
        meta.plan_args = {}

    # ---- CUDA graphs ---------------------------------------------------------------------------
    def graph_state(self, batch_size: int, max_blocks: int) -> DecodeGraphState:
        """Static buffers and a fixed-size decode wrapper for one captured batch size."""
        dev = self.device
        wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=torch.zeros(batch_size + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=torch.zeros(batch_size * max_blocks, dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buffer=torch.zeros(batch_size, dtype=torch.int32, device=dev),
        )
        b = batch_size
        static = torch.zeros(5 * b, dtype=torch.int64, device=dev)
        meta = FlashInferMetadata(
            backend=self,
            num_tokens=b,
            positions=static[:b],
            kv_slots=static[b : 3 * b],
            kv_src=static[3 * b :],
            num_decodes=b,
            decode=wrapper,
        )
        return DecodeGraphState(
            batch_size=b,
            max_blocks=max_blocks,
            wrapper=wrapper,
            host=torch.zeros(5 * b, dtype=torch.int64).pin_memory(),
            dev=static,
            indices_host=torch.zeros(b * max_blocks, dtype=torch.int32).pin_memory(),
            indices_dev=torch.zeros(b * max_blocks, dtype=torch.int32, device=dev),
            meta=meta,
        )

    def plan_graph(self, state: DecodeGraphState, batch: BatchSpec | None, dtype: torch.dtype) -> None:
        """Fill ``state``'s buffers for a decode ``batch`` of at most ``state.batch_size`` sequences
        (None: a dummy batch on block 0, used while capturing) and plan its wrapper. Host work and
        ``non_blocking`` copies only. The pinned staging (``state.host``, ``indices_host`` and the
        wrapper's page-locked plan buffer) is written again by the next plan: the caller must know the
        copies queued here have run by then (model_runner waits for an event recorded after them)."""
        b, bs = state.batch_size, self.block_size
        if batch is None:
            batch = BatchSpec(query_lens=[1], context_lens=[0], block_tables=[[0]])
        q_lens, ctx, kv_lens, n_pages, pages = self._tables(batch)
        n = len(q_lens)
        if (q_lens != 1).any() or n > b or int(n_pages.max()) > state.max_blocks:
            raise ValueError(f"not a decode batch for the {b}-sequence graph (max {state.max_blocks} blocks)")
        positions, k_slots = self._slots(q_lens, ctx, pages)
        # Padding rows: position 0, row 0's slots, row 0's K/V; attention over row 0's first page.
        pad = b - n
        pos = np.concatenate([positions, np.zeros(pad, dtype=np.int64)])
        ks = np.concatenate([k_slots, np.full(pad, k_slots[0], dtype=np.int64)])
        src_k = np.concatenate([np.arange(n), np.zeros(pad, dtype=np.int64)])
        host = np.concatenate([pos, ks, ks + bs, src_k, src_k + b])
        state.host.numpy()[:] = host
        state.dev.copy_(state.host, non_blocking=True)

        all_pages = pages + [pages[0][:1]] * pad
        counts = np.concatenate([n_pages, np.ones(pad, dtype=np.int64)])
        indptr = np.zeros(b + 1, dtype=np.int32)
        np.cumsum(counts, out=indptr[1:])
        last = np.concatenate([kv_lens - (n_pages - 1) * bs, np.ones(pad, dtype=np.int64)]).astype(np.int32)
        flat = np.concatenate(all_pages).astype(np.int32)
        state.indices_host.numpy()[: len(flat)] = flat
        state.indices_dev[: len(flat)].copy_(state.indices_host[: len(flat)], non_blocking=True)
        state.wrapper.plan(
            _pinned(indptr),
            state.indices_dev[: len(flat)],
            _pinned(last),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            bs,
            q_data_type=dtype,
            kv_data_type=dtype,
            sm_scale=self.scale,
            window_left=self.window_left,
        )

    # ---- per layer -----------------------------------------------------------------------------
    def kv_store_target(self, kv_layer: torch.Tensor,
                        meta: FlashInferMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        # [blocks * 2 * block_size, kvh, d]: the paged NHD layout's slot rows
        return kv_layer.view(-1, self.num_kv_heads, self.head_dim), meta.kv_slots, meta.kv_src

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        kv_layer: torch.Tensor,
        meta: FlashInferMetadata,
    ) -> torch.Tensor:
        if meta.plan_args:  # first step of a backend built without a dtype
            self.dtype = self.dtype or q.dtype
            self._plan_wrappers(meta, q.dtype)
        if k is not None:
            flat, slots, src_rows = self.kv_store_target(kv_layer, meta)
            src = torch.cat([k, v])  # [2T, kvh, d]
            if src_rows is not None:
                src = src.index_select(0, src_rows)
            flat.index_copy_(0, slots, src)
        nd = meta.num_decodes
        if meta.prefill is None:
            return meta.decode.run(q, kv_layer)
        if meta.decode is None:
            return meta.prefill.run(q, kv_layer)
        out = torch.empty_like(q)  # [T, heads, d]
        meta.decode.run(q[:nd], kv_layer, out=out[:nd])
        meta.prefill.run(q[nd:], kv_layer, out=out[nd:])
        return out


def _pinned(arr: np.ndarray) -> torch.Tensor:
    """A pinned int32 host tensor (flashinfer reads indptr/last_page_len on the host while planning)."""
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int32)).pin_memory()


def _gather_blocks(pages: list[np.ndarray], seq_of: np.ndarray, positions: np.ndarray, bs: int) -> np.ndarray:
    """Block id of each token: pages[seq_of[t]][positions[t] // bs], vectorised over a padded table."""
    width = max(len(p) for p in pages)
    table = np.zeros((len(pages), width), dtype=np.int64)
    for i, p in enumerate(pages):
        table[i, : len(p)] = p
    return table[seq_of, positions // bs]
