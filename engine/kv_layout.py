"""The KV cache layout: the one description both the engine and the transfer layer agree on.

Physical layout (fixed, and part of the compatibility hash through ``order``)::

    kv_cache: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
                            │         │
                            │         └─ 0 = K, 1 = V
                            └─ a block of one layer is one contiguous run of bytes

So the bytes of (layer ``l``, block ``b``) start at
``(l * num_blocks + b) * block_bytes`` from the start of the cache tensor, and a run of
consecutive block ids within a layer is one contiguous region (which is what lets the
transfer layer coalesce descriptors). A single layer slice ``kv_cache[l]`` is exactly
flashinfer's paged "NHD" layout ``(num_pages, 2, page_size, num_kv_heads, head_dim)``.

``num_blocks`` is deliberately *not* part of the layout: a memory-tuned decode worker holds
more blocks than a compute-tuned prefill worker, yet they exchange blocks just fine. It travels
in the transfer endpoint instead.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_MEMORY_KINDS = ("cpu", "cuda")
LAYOUT_ORDER = "layer,block,kv,token,head,dim"


def dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical name ("float32", "bfloat16", "float16") for a torch dtype or a name."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        aliases = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                   "half": "float16"}
        name = aliases.get(name, name)
        if name not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
        return name
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}; expected one of {sorted(_DTYPES)}")


@dataclass(frozen=True, kw_only=True)
class KVLayout:
    """Shape, dtype and placement of a paged KV cache, minus the number of blocks."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: str = "float32"
    memory: str = "cpu"
    # Identifies the model the KV belongs to (e.g. a hash of its config and weights' names);
    # KV from another model must never be accepted even if the shapes happen to match.
    model_fingerprint: str = ""
    order: str = LAYOUT_ORDER

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{field} must be a positive int, got {value!r}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.memory not in _MEMORY_KINDS:
            raise ValueError(f"KVLayout.memory must be one of {_MEMORY_KINDS}, got {self.memory!r}")
        if self.order != LAYOUT_ORDER:
            raise ValueError(f"KVLayout.order {self.order!r} is not supported (only {LAYOUT_ORDER!r})")

    @classmethod
    def for_model(cls, model_config, *, block_size: int = 16, dtype: torch.dtype | str = "float32",
                  memory: str = "cpu", model_fingerprint: str = "") -> KVLayout:
        """The layout of a model's KV cache; ``model_config`` is anything with ``num_layers``,
        ``num_kv_heads`` and ``head_dim`` (an ``engine.config.ModelConfig``), so this file needs
        no engine import and stays the one thing ``kvtransfer`` may depend on."""
        return cls(num_layers=model_config.num_layers, num_kv_heads=model_config.num_kv_heads,
                   head_dim=model_config.head_dim, block_size=block_size, dtype=dtype_name(dtype),
                   memory=memory, model_fingerprint=model_fingerprint)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def block_numel(self) -> int:
        """Elements in one block of one layer (K and V together)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def block_bytes(self) -> int:
        """Bytes in one block of one layer (K and V together)."""
        return self.block_numel * self.itemsize

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def cache_bytes(self, num_blocks: int) -> int:
        return self.num_layers * num_blocks * self.block_bytes

    def block_offset(self, layer: int, block: int, num_blocks: int) -> int:
        """Byte offset of (layer, block) from the start of a cache of ``num_blocks`` blocks."""
        if not (0 <= layer < self.num_layers and 0 <= block < num_blocks):
            raise IndexError(f"(layer={layer}, block={block}) outside {self.num_layers}x{num_blocks}")
        return (layer * num_blocks + block) * self.block_bytes

    def allocate(self, num_blocks: int, device: torch.device | str | None = None) -> torch.Tensor:
        """A zeroed cache tensor in this layout."""
        device = device if device is not None else self.memory
        return torch.zeros(self.cache_shape(num_blocks), dtype=self.torch_dtype, device=device)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> KVLayout:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown KVLayout fields {sorted(unknown)}")
        return cls(**data)

    def compat_hash(self) -> str:
        """Stable hash of everything that must match for KV bytes to be interchangeable."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def describe(self) -> str:
        return (f"layers={self.num_layers} kv_heads={self.num_kv_heads} head_dim={self.head_dim} "
                f"block_size={self.block_size} dtype={self.dtype} memory={self.memory} "
                f"model={self.model_fingerprint or '-'}")
