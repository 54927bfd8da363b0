"""The attention backend interface: plan once per step, run once per layer.

A step's batch is a flat run of ``T`` tokens from ``B`` sequences. Sequence ``i`` contributes
``query_lens[i]`` new tokens (1 for a decode, a whole prompt, or a chunk of one) and already has
``context_lens[i]`` tokens in the paged KV cache (an earlier chunk, a prefix-cache hit, earlier
decode steps). Its block table covers all ``context_lens[i] + query_lens[i]`` tokens.

* ``backend.plan(batch)`` runs once per step on the host. It turns the ``BatchSpec`` into whatever
  index tensors the kernels want (positions, KV slots, gather indices, masks; for flashinfer:
  ``wrapper.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, ...)``) and moves them to the
  device in one go. Shapes depend only on host-side ints, so nothing here waits on the device.
* ``backend.forward(q, k, v, kv_layer, meta)`` runs once per layer: it writes this step's ``k``/``v``
  into the layer's cache slice and returns the attention output for every query token.

By convention the runner puts decode sequences (``query_len == 1``) first; backends may use that to
route them to a decode kernel, but must stay correct for any order.

``kv_layer`` is one layer of the ``engine.kv_layout`` cache, ``[num_blocks, 2, block_size,
num_kv_heads, head_dim]`` (0 = K, 1 = V) — flashinfer's paged "NHD" layout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class BatchSpec:
    """Host-side description of one step's batch, in token order."""

    query_lens: list[int]
    context_lens: list[int]
    block_tables: Sequence[Sequence[int]]  # lists on rank 0; numpy views on a TP follower (engine.tp_plan)

    def __post_init__(self) -> None:
        if not (len(self.query_lens) == len(self.context_lens) == len(self.block_tables)):
            raise ValueError("query_lens, context_lens and block_tables must have one entry per sequence")

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


@dataclass(kw_only=True)
class AttentionMetadata:
    """What ``plan`` produced for one step; subclasses add their backend's tensors."""

    backend: AttentionBackend
    num_tokens: int
    positions: torch.Tensor  # [T] int64 absolute positions, on the device


class AttentionBackend(ABC):
    """Paged attention over one model's KV cache geometry."""

    name: str = "?"

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 device: torch.device | str, sliding_window: int | None = None) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.device = torch.device(device)
        self.sliding_window = sliding_window
        self.scale = head_dim ** -0.5

    @abstractmethod
    def plan(self, batch: BatchSpec) -> AttentionMetadata:
        """Once per step: index tensors for ``batch`` on the device."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_layer: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Once per layer. ``q [T, heads, head_dim]``, ``k``/``v [T, kv_heads, head_dim]`` (RoPE applied;
        ``v`` may be a strided view, last dim contiguous); stores ``k``/``v`` into ``kv_layer`` and
        returns ``[T, heads, head_dim]``. ``k`` and ``v`` are None when the caller has already stored
        them where ``kv_store_target`` said."""

    def kv_store_target(
        self, kv_layer: torch.Tensor, meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """Where this step's keys and values go, for a caller that writes them itself in a kernel of its
        own (``engine.fused_ops.rope_store_kv``): the layer's cache as slot rows ``[rows, kv_heads,
        head_dim]``, the slots ``[2T]`` (keys, then values) and the row of ``cat([k, v])`` each slot
        receives (``[2T]``, or None for row i to slot i). None: ``forward`` stores them."""
        return None
