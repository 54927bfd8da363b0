"""CUDA graphs for decode steps: one captured forward per batch-size bucket, replayed every step.

A decode step of an 8B model is ~1,300 small kernels; launched one by one from Python the launch
gaps, not the GPU, bound small batches. Capturing the model's forward once per bucket and replaying
it removes them. Lifecycle::

    runner = DecodeGraphRunner(model, backend, kv_cache, max_batch=64, max_model_len=4096)
    runner.capture()                  # at start-up, before any request: the buckets up to
                                      # capture_at_start (largest first), one memory pool for all
    runner.capture_idle(block)        # while idle: the largest bucket still missing
    if runner.can_run(spec):          # every sequence has one query token, batch <= max_batch
        hidden = runner.run(input_ids, spec)   # [n, hidden]: fill static inputs, plan, replay

Boot time: capturing every bucket of an 8B model takes about 0.2 s each, and a worker serves its
first requests at small batch. So only the buckets up to ``capture_at_start`` (1) are captured
before the worker turns SERVING. The rest are captured while the engine has nothing to step
(``capture_idle``, driven by ``engine.async_engine``), largest first, one per idle moment, their
warm-up writing a dummy token into a scratch block the engine lends for it. A batch that needs a
bucket not captured yet captures it inside that step. That capture's warm-up pass runs the step's
own batch (its real tokens, positions and slots), so it writes exactly the K/V the replay then writes
again -- never block 0 of a live request, which the start-up captures' dummy batch uses.
``capture_when_idle=False`` (tensor parallelism: every rank must capture in the same step, because
the forward's all-reduces are collective) leaves the rest to that first use.

``run`` (``stage`` then ``replay``) does host work and ``non_blocking`` copies from pinned staging
only (token ids, positions, cache slots, page tables into static device buffers, then flashinfer's
``plan``), so nothing inside a decode step waits on the device. The pinned staging is written again by
the next step's ``stage``; with the next step launched before this one's tokens are read, the caller
orders the two (model_runner waits for an event recorded after the copies are queued). A batch of
``n`` sequences runs in the smallest bucket ``>= n``; padding rows are harmless (see
``FlashInferAttentionBackend``).

Only backends with ``graph_state``/``plan_graph`` (flashinfer) can be captured; ``maybe_runner``
returns None for the others, on CPU, or when ``PDSERVE_CUDA_GRAPHS=0``.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend, BatchSpec
from pdserve.process_stats import BOOT
from pdserve.settings import cuda_graphs_at_start, env_switch

log = logging.getLogger(__name__)
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass(frozen=True, kw_only=True)
class CudaGraphConfig:
    max_batch: int = 64
    max_model_len: int = 4096
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    capture_at_start: int = 1  # buckets up to this are captured before serving
    capture_when_idle: bool = True  # the rest: while the engine is idle (else on first use)

    def __post_init__(self) -> None:
        if self.max_batch <= 0 or self.max_model_len <= 0:
            raise ValueError("CudaGraphConfig.max_batch and max_model_len must be positive")
        if self.capture_at_start <= 0:
            raise ValueError(f"CudaGraphConfig.capture_at_start must be positive, got "
                             f"{self.capture_at_start}")
        if any(b <= 0 for b in self.buckets):
            raise ValueError(f"bucket sizes must be positive, got {self.buckets}")

    def sizes(self) -> list[int]:
        """Buckets up to max_batch, always ending with max_batch itself."""
        out = sorted({b for b in self.buckets if b < self.max_batch} | {self.max_batch})
        return out


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    state: object  # the backend's DecodeGraphState
    input_ids: torch.Tensor  # [B] int64, static
    ids_host: torch.Tensor  # [B] int64, pinned staging
    hidden: torch.Tensor  # [B, hidden] output of the captured forward


class DecodeGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        kv_cache: torch.Tensor,
        config: CudaGraphConfig,
    ) -> None:
        if not hasattr(backend, "graph_state"):
            raise ValueError(f"attention backend {backend.name!r} cannot be captured in a CUDA graph")
        self.model = model
        self.backend = backend
        self.kv_cache = kv_cache
        self.config = config
        self.dtype = next(model.parameters()).dtype
        self.max_blocks = -(-config.max_model_len // backend.block_size)
        self.graphs: dict[int, _Graph] = {}
        self.sizes = config.sizes()
        self.lazy_captures: list[int] = []  # buckets captured on first use, in order
        self.idle_captures: list[int] = []  # buckets captured while idle, in order
        self._when_idle = config.capture_when_idle
        self._pool = None
        self._stream: torch.cuda.Stream | None = None

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture the buckets up to ``capture_at_start`` (at least the smallest), largest first, into
        one shared memory pool. Run before serving: the warm-up pass writes K/V of a dummy token
        into block 0."""
        # The garbage collector must not run inside a capture: collecting an earlier engine's graphs
        # (they sit in reference cycles) destroys a CUDA graph mid-capture and invalidates this one
        # (seen on an H100 when a second engine captured in the same process). torch no longer
        # collects on entering torch.cuda.graph, so collect once here and keep it off until done.
        gc.collect()
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            with BOOT.phase("cuda_graph_capture"):
                first = [b for b in self.sizes if b <= self.config.capture_at_start] or self.sizes[:1]
                for b in reversed(first):
                    self._capture_one(b, None, None)
        finally:
            if gc_was_enabled:
                gc.enable()
        later = "while idle or on first use" if self.config.capture_when_idle else "on first use"
        log.info("captured decode CUDA graphs for batch sizes %s at start; %s %s", sorted(self.graphs),
                 self.missing(), later)

    def missing(self) -> list[int]:
        """Buckets not captured yet, largest first."""
        return [b for b in reversed(self.sizes) if b not in self.graphs]

    def idle_pending(self) -> bool:
        """Whether ``capture_idle`` has a bucket left to capture."""
        return self._when_idle and len(self.graphs) < len(self.sizes)

    def stop_idle_captures(self) -> None:
        self._when_idle = False

    @torch.inference_mode()
    def capture_idle(self, scratch_block: int) -> int | None:
        """Capture the largest bucket still missing (None when there is none), its warm-up pass writing
        a dummy token into ``scratch_block``: a block the caller owns for the call, so the pass writes
        into no request's K/V -- a decode worker's idle engine may hold blocks a KV transfer is
        filling, or cached prefixes. Run only when no step is in flight (the engine's own thread)."""
        if not self.idle_pending():
            return None
        b = self.missing()[0]
        t0 = time.monotonic()
        spec = BatchSpec(query_lens=[1], context_lens=[0], block_tables=[[scratch_block]])
        with BOOT.phase("cuda_graph_idle_capture"):  # after SERVING: GetProcessStats shows when all were done
            self._capture_guarded(b, spec, [0])
        self.idle_captures.append(b)
        log.info("captured the decode CUDA graph for batch size %d while idle in %.3fs", b,
                 time.monotonic() - t0)
        return b

    def _capture_one(self, b: int, spec: BatchSpec | None, input_ids: list[int] | None, patch=None) -> None:
        """Capture bucket ``b``; ``spec``/``input_ids``: the batch of the step that needs it (a lazy
        capture), whose own slots the warm-up writes (``patch``: its rows whose ids are on the device,
        see ``stage``); None: the dummy batch on block 0 (start-up)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.backend.device)
        stream = self._stream
        state = self.backend.graph_state(b, self.max_blocks)
        ids_host = torch.zeros(b, dtype=torch.int64).pin_memory()
        if input_ids is not None:
            ids_host.numpy()[:len(input_ids)] = input_ids
        ids = ids_host.to(self.backend.device)
        if patch is not None:
            patch(ids)
        self.backend.plan_graph(state, spec, self.dtype)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (lazy inits, autotuning)
            self._forward(ids, state)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call another thread of this process makes meanwhile (an engine of a
        # worker's other role, NIXL's progress, a test's leftover engine thread) must not
        # invalidate this capture; the default "global" mode fails the capture on any of them.
        with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
            hidden = self._forward(ids, state)
        torch.cuda.synchronize(self.backend.device)
        self.graphs[b] = _Graph(graph=graph, state=state, input_ids=ids, ids_host=ids_host, hidden=hidden)

    def _capture_guarded(self, b: int, spec: BatchSpec, input_ids: list[int], patch=None) -> None:
        """``_capture_one`` with the garbage collector off (see ``capture``)."""
        gc.collect()
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._capture_one(b, spec, input_ids, patch)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _capture_lazily(self, b: int, input_ids: list[int], spec: BatchSpec, patch=None) -> None:
        t0 = time.monotonic()
        self._capture_guarded(b, spec, input_ids, patch)
        self.lazy_captures.append(b)
        log.info("captured the decode CUDA graph for batch size %d on first use in %.3fs", b,
                 time.monotonic() - t0)

    def _forward(self, ids: torch.Tensor, state) -> torch.Tensor:
        meta = state.meta
        return self.model(ids, meta.positions, self.kv_cache, meta)

    def bucket(self, n: int) -> int | None:
        for b in self.sizes:
            if b >= n:
                return b
        return None

    def can_run(self, spec: BatchSpec) -> bool:
        if not self.graphs or spec.num_seqs > self.sizes[-1] or any(q != 1 for q in spec.query_lens):
            return False
        bs = self.backend.block_size
        return max(c + 1 for c in spec.context_lens) <= self.max_blocks * bs

    @torch.inference_mode()
    def run(self, input_ids: list[int], spec: BatchSpec) -> torch.Tensor:
        """Replay the bucket's graph for a decode batch; returns ``hidden [n, hidden]`` (a view of
        the graph's static output, valid until the next ``run``)."""
        return self.replay(self.stage(input_ids, spec), spec.num_seqs)

    @torch.inference_mode()
    def stage(self, input_ids: list[int], spec: BatchSpec, patch=None) -> _Graph:
        """Fill the bucket's static inputs for ``spec`` (plan, token ids; ``patch(ids)`` then writes the
        rows whose ids are still on the device, model_runner.PrevTokens) and return its graph."""
        n = spec.num_seqs
        b = self.bucket(n)
        if b not in self.graphs:
            self._capture_lazily(b, input_ids, spec, patch)
        g = self.graphs[b]
        self.backend.plan_graph(g.state, spec, self.dtype)
        host = g.ids_host.numpy()
        host[:n] = input_ids
        host[n:] = 0
        g.input_ids.copy_(g.ids_host, non_blocking=True)
        if patch is not None:
            patch(g.input_ids)
        return g

    @staticmethod
    def replay(g: _Graph, n: int) -> torch.Tensor:
        g.graph.replay()
        return g.hidden[:n]


def maybe_runner(
    model: torch.nn.Module,
    backend: AttentionBackend,
    kv_cache: torch.Tensor,
    *,
    max_batch: int,
    max_model_len: int,
    capture: bool = True,
    when_idle: bool = True,
) -> DecodeGraphRunner | None:
    """A captured runner when the backend supports graphs on CUDA and ``PDSERVE_CUDA_GRAPHS`` is not
    ``0``; None otherwise (the caller runs eagerly). ``when_idle=False``: no idle captures, and the
    buckets up to 8 are captured at start instead of 1 (``PDSERVE_CUDA_GRAPHS_AT_START`` overrides
    either)."""
    if not env_switch("PDSERVE_CUDA_GRAPHS"):
        return None
    if backend.device.type != "cuda" or not hasattr(backend, "graph_state"):
        return None
    at_start = cuda_graphs_at_start(1 if when_idle else 8)
    config = CudaGraphConfig(max_batch=max_batch, max_model_len=max_model_len, capture_at_start=at_start,
                             capture_when_idle=when_idle)
    runner = DecodeGraphRunner(model, backend, kv_cache, config)
    if capture:
        runner.capture()
    return runner


def capture_next_idle(graphs, block_manager) -> bool:
    """One piece of start-up work deferred past SERVING: the largest decode CUDA graph not captured yet
    (~0.2 s on an 8B model), on a block borrowed from ``block_manager`` for the capture's dummy token
    and given back. False when it did nothing (no graphs or none pending, or no free block): the driver
    then waits for its next command before asking again. A capture that runs out of GPU memory ends idle
    captures (logged); those buckets are then captured on first use, as without idle work."""
    from engine.errors import KVCacheFull

    if graphs is None or not graphs.idle_pending():
        return False
    try:
        (block,) = block_manager.allocate(1)
    except KVCacheFull:
        return False
    try:
        graphs.capture_idle(block)
    except torch.OutOfMemoryError:
        log.warning("no GPU memory for the next decode CUDA graph; idle captures stop", exc_info=True)
        graphs.stop_idle_captures()
    finally:
        block_manager.release([block])
    return True
