"""Which slice of a model one tensor-parallel rank owns: pure arithmetic, no torch.distributed.

Megatron-style split of a decoder layer over ``size`` ranks::

    q/k/v_proj  column-parallel: rank r owns query heads [r*H/N, (r+1)*H/N) and the KV heads they read
    o_proj      row-parallel over the same query heads          -> one all-reduce per attention block
    gate/up     column-parallel: intermediate rows [r*I/N, (r+1)*I/N)
    down_proj   row-parallel over the same rows                 -> one all-reduce per MLP block
    embed/lm_head vocab-parallel: rows [r*V', (r+1)*V') with V' = ceil(V/N), zero-padded past V

KV heads: with ``KV % N == 0`` rank r owns KV heads [r*KV/N, (r+1)*KV/N). With ``N % KV == 0``
(more ranks than KV heads) each rank owns the one KV head its query heads share, so N/KV ranks
hold (replicate) each KV head. ``kv_head_range`` is the one formula for this; ``kvtransfer``
imports it (this file imports nothing of ours) to route heads between pools of different TP.
"""

from __future__ import annotations

from dataclasses import dataclass


def check_tp(*, num_heads: int, num_kv_heads: int, size: int) -> None:
    """Raise ValueError unless ``size`` ranks can split ``num_heads`` / ``num_kv_heads``."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor parallel size must be a positive int, got {size!r}")
    if num_heads % size:
        raise ValueError(f"tensor parallel size {size} does not divide the {num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"tensor parallel size {size} neither divides nor is a multiple of the "
                         f"{num_kv_heads} KV heads")


def kv_head_range(num_kv_heads: int, size: int, rank: int) -> tuple[int, int]:
    """The KV heads ``[start, end)`` rank ``rank`` of ``size`` holds (see the module docstring)."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside a tensor parallel group of {size}")
    if num_kv_heads % size == 0:
        per = num_kv_heads // size
        return rank * per, (rank + 1) * per
    if size % num_kv_heads:
        raise ValueError(f"tensor parallel size {size} neither divides nor is a multiple of the "
                         f"{num_kv_heads} KV heads")
    head = rank // (size // num_kv_heads)
    return head, head + 1


@dataclass(frozen=True, kw_only=True)
class TensorSlice:
    """A rank's part of one checkpoint tensor: ``length`` entries from ``start`` along ``dim`` of a
    tensor whose full size there is ``full``; entries past ``full`` (vocab padding) are zeros.
    ``owner`` is False on a rank that holds a replica of another rank's slice (KV heads when there are
    more ranks than KV heads), so whole-model summaries count each entry once."""

    dim: int
    start: int
    length: int
    full: int
    owner: bool = True

    def __post_init__(self) -> None:
        if self.dim not in (0, 1) or self.length <= 0 or not 0 <= self.start < self.full:
            raise ValueError(f"bad TensorSlice {self}")

    @property
    def stop(self) -> int:
        """End of the stored part (exclusive); ``< start + length`` when padded."""
        return min(self.start + self.length, self.full)


@dataclass(frozen=True, kw_only=True)
class TPShard:
    """Rank ``rank`` of ``size``'s share of a model with these widths."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    def __post_init__(self) -> None:
        check_tp(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, size=self.size)
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside a tensor parallel group of {self.size}")
        if self.intermediate_size % self.size:
            raise ValueError(f"tensor parallel size {self.size} does not divide the intermediate size "
                             f"{self.intermediate_size}")
        if (self.size - 1) * self.vocab_per_rank >= self.vocab_size:
            raise ValueError(f"a vocabulary of {self.vocab_size} is too small for {self.size} ranks")

    @classmethod
    def for_model(cls, config, *, rank: int, size: int) -> TPShard:
        """``config``: an ``engine.config.ModelConfig`` (anything with its width fields)."""
        return cls(rank=rank, size=size, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                   head_dim=config.head_dim, intermediate_size=config.intermediate_size,
                   vocab_size=config.vocab_size)

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def kv_heads(self) -> tuple[int, int]:
        return kv_head_range(self.num_kv_heads, self.size, self.rank)

    @property
    def local_kv_heads(self) -> int:
        start, end = self.kv_heads
        return end - start

    @property
    def kv_owner(self) -> bool:
        """Whether this rank is the first holder of its KV heads (replicas defer to it)."""
        return self.rank == 0 or kv_head_range(self.num_kv_heads, self.size, self.rank - 1) != self.kv_heads

    @property
    def q_size(self) -> int:
        return self.local_heads * self.head_dim

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def slices(self, num_layers: int, *, qkv_bias: bool) -> dict[str, TensorSlice]:
        """Checkpoint name -> this rank's slice, for every split tensor (the rest are replicated)."""
        hd = self.head_dim
        q0 = self.rank * self.local_heads * hd
        k0 = self.kv_heads[0] * hd
        kv_len = self.local_kv_heads * hd
        q_full, kv_full = self.num_heads * hd, self.num_kv_heads * hd
        i0, i_len = self.rank * self.local_intermediate, self.local_intermediate
        out: dict[str, TensorSlice] = {
            name: TensorSlice(dim=0, start=self.vocab_start, length=self.vocab_per_rank, full=self.vocab_size)
            for name in ("model.embed_tokens.weight", "lm_head.weight")}
        for layer in range(num_layers):
            p = f"model.layers.{layer}."
            suffixes = ("weight", "bias") if qkv_bias else ("weight",)
            for s in suffixes:
                out[f"{p}self_attn.q_proj.{s}"] = TensorSlice(dim=0, start=q0, length=self.q_size,
                                                              full=q_full)
                for kv in ("k_proj", "v_proj"):
                    out[f"{p}self_attn.{kv}.{s}"] = TensorSlice(dim=0, start=k0, length=kv_len, full=kv_full,
                                                                owner=self.kv_owner)
            out[f"{p}self_attn.o_proj.weight"] = TensorSlice(dim=1, start=q0, length=self.q_size, full=q_full)
            for name in ("gate_proj", "up_proj"):
                out[f"{p}mlp.{name}.weight"] = TensorSlice(dim=0, start=i0, length=i_len,
                                                           full=self.intermediate_size)
            out[f"{p}mlp.down_proj.weight"] = TensorSlice(dim=1, start=i0, length=i_len,
                                                         full=self.intermediate_size)
        return out

