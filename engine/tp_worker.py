"""The non-zero ranks of a tensor-parallel worker, and what every rank agrees on at start-up.

A worker at ``tensor_parallel_size = N`` is N processes (or, in tests, N threads) sharing one
``engine.tp_group.TPGroup``. Rank 0 is an ordinary ``LLMEngine(config, tp=group)``: it owns the
requests, the scheduler, the block allocator and the sampler. Ranks 1..N-1 are ``TPFollower``s:
each loads its slice of the checkpoint, allocates a KV cache of its own heads with the same number
of blocks as rank 0 (block ids mean the same on every rank), then runs rank 0's steps until
``LLMEngine.close()`` sends the stop::

    rank 0 (LLMEngine)                         rank r > 0 (TPFollower)
    load slice r=0                             load slice r
    tp_fingerprint  ── all-reduce ──────────── tp_fingerprint
    num_blocks      ── broadcast ────────────▶ num_blocks
    step(): plan    ── broadcast ────────────▶ follow(plan)
            forward ── all-reduce per block ── forward
            logits  ── all-gather ──────────── logits (dropped)
    close()         ── OP_STOP ──────────────▶ run() returns

Collectives happen in the same order on every rank; a rank that raises leaves the others waiting
until the group's timeout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.engine_types import EngineConfig
from engine.kv_layout import KVLayout, dtype_name
from engine.model import CausalLM, build_model, fused_kernels_for
from engine.model_runner import ModelRunner
from engine.tp_group import TPGroup
from engine.tp_plan import receive
from engine.weights import sample_indices

log = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_model(config: EngineConfig, device: torch.device, tp: TPGroup | None):
    """(model, tokenizer) from ``config.model``: this rank's slice only when ``tp`` is given."""
    from engine import readahead
    from engine.attention import prefetch
    from engine.tokenizer import Tokenizer
    from engine.weights import load_weights

    path = Path(config.model)
    model_config = ModelConfig.from_pretrained(path)
    dtype = getattr(torch, config.dtype) if config.dtype else model_config.torch_dtype
    kernels = fused_kernels_for(device, dtype)
    if kernels is not None:  # Triton's key hashes beside the load (ModelRunner waits for it)
        kernels.warm_compile_cache()
    model = build_model(model_config, init="meta", tp=tp)
    model.allocate_fused(device, dtype)  # q/k/v and gate/up load straight into their fused weights
    overlap = prefetch.wanted(config.attention_backend, device=device, dtype=dtype,
                              head_dim=model_config.head_dim, cold=readahead.reading())
    with prefetch.overlapping(overlap):  # from a cold disk, flashinfer's import overlaps the load
        load_weights(model, path, dtype=dtype, device=device, slices=model.tp_slices())
    return model, Tokenizer.from_dir(path)


def rank_layout(layout: KVLayout, model: CausalLM) -> KVLayout:
    """The layout of this rank's cache: the model's layout with only the rank's KV heads."""
    if model.shard is None:
        return layout
    return dataclasses.replace(layout, num_kv_heads=model.shard.local_kv_heads)


def agree_num_blocks(tp: TPGroup, num_blocks: int) -> int:
    """Rank 0's block count on every rank (the others pass anything)."""
    return int(tp.broadcast_cpu(torch.tensor([num_blocks], dtype=torch.int64)).item())


def model_fingerprint(model: CausalLM) -> str:
    """Architecture plus sampled weights: KV is only interchangeable between identical models."""
    from engine.weights import weights_fingerprint

    weights = weights_fingerprint(model) if model.tp is None else tp_fingerprint(model, model.tp)
    return f"{model.config.fingerprint()[:8]}{weights[:8]}"


def tp_fingerprint(model: CausalLM, tp: TPGroup, samples_per_tensor: int = 16) -> str:
    """``engine.weights.weights_fingerprint`` of the whole model, computed from the ranks' slices:
    every rank contributes the sampled entries it owns (zeros elsewhere, replicas and replicated
    tensors counted once) and one all-reduce assembles them, so a TP=N worker of a checkpoint gets
    the fingerprint a TP=1 worker of it gets, and their KV is accepted by each other."""
    slices = model.tp_slices()
    h = hashlib.sha256()
    picks = []
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        sl = slices.get(name)
        full = list(param.shape)
        if sl is not None:
            full[sl.dim] = sl.full
        h.update(f"{name}:{tuple(full)}:{dtype_name(param.dtype)};".encode())
        idx = sample_indices(int(torch.Size(full).numel()), samples_per_tensor)
        flat = param.detach().reshape(-1)
        if sl is None:
            mine = torch.full_like(idx, tp.rank == 0, dtype=torch.bool)
            local = idx
        else:
            inner = int(torch.Size(full[1:]).numel())  # entries per row of the full tensor
            row, col = idx // inner, idx % inner
            along = row if sl.dim == 0 else col
            mine = (along >= sl.start) & (along < sl.stop) & sl.owner
            local = (row - sl.start) * inner + col if sl.dim == 0 else row * sl.length + (col - sl.start)
            local = torch.where(mine, local, 0)
        values = flat.index_select(0, local.to(flat.device)).float()
        picks.append(values * mine.to(values.device))
    total = tp.all_reduce(torch.cat(picks)) if picks else None
    if total is not None:
        h.update(total.cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class TPFollower:
    """Rank ``tp.rank > 0`` of a tensor-parallel worker (see the module docstring)."""

    def __init__(self, config: EngineConfig, tp: TPGroup, *, model: CausalLM | None = None) -> None:
        if tp.rank == 0:
            raise ValueError("rank 0 of a tensor parallel group is the LLMEngine, not a follower")
        self.tp = tp
        self.device = resolve_device(config.device)
        if model is None:
            model, _ = load_model(config, self.device, tp)
        else:
            model = model.to(self.device, dtype=getattr(torch, config.dtype) if config.dtype else None)
        if model.tp is not tp:
            raise ValueError("the follower's model must be built with its TPGroup (build_model(tp=...))")
        self.model = model.eval()
        fingerprint = f"{model.config.fingerprint()[:8]}{tp_fingerprint(model, tp)[:8]}"
        dtype = next(model.parameters()).dtype
        self.kv_layout = KVLayout.for_model(model.config, block_size=config.block_size, dtype=dtype,
                                            memory=self.device.type, model_fingerprint=fingerprint)
        num_blocks = agree_num_blocks(tp, 0)
        self.runner = ModelRunner(model, rank_layout(self.kv_layout, model), num_blocks, device=self.device,
                                  attention_backend=config.attention_backend, seed=config.seed,
                                  launch_ahead_layers=config.launch_ahead_layers,
                                  blocking_wait=config.blocking_wait(overlap_steps=False))  # synchronous
        # the same buckets as rank 0's, captured in the same order (LLMEngine.__init__ does this right after
        # the block count too): each capture's forward carries the all-reduces
        cfg = model.config
        max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if config.cuda_graphs:
            self.runner.enable_cuda_graphs(max_batch=config.max_num_seqs, max_model_len=max_model_len)
        self.steps = 0

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.runner.kv_cache

    def run(self) -> None:
        """Follow rank 0's steps until it sends the stop."""
        while (plan := receive(self.tp)) is not None:
            self.runner.follow(plan)
            self.steps += 1
        log.info("tensor parallel rank %d stopped after %d steps", self.tp.rank, self.steps)
