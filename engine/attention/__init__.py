"""Attention backends over the paged KV cache. ``get_backend(name, ...)`` picks one by name."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata, BatchSpec
from engine.attention.torch_backend import TorchAttentionBackend

BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttentionBackend}


def backend_geometry(model_config, *, block_size: int) -> dict:
    """A backend's model-shaped constructor arguments from an ``engine.config.ModelConfig``;
    callers add ``device`` (and ``dtype`` for flashinfer)."""
    return dict(num_heads=model_config.num_heads, num_kv_heads=model_config.num_kv_heads,
                head_dim=model_config.head_dim, block_size=block_size,
                sliding_window=model_config.sliding_window)


def get_backend(name: str, *, device: torch.device | str, dtype: torch.dtype | None = None,
                **kwargs) -> AttentionBackend:
    """``name``: ``"torch"``, ``"flashinfer"`` or ``"auto"`` (the best backend for ``device``: flashinfer
    on CUDA when it imports and supports the model's ``dtype``/head_dim, else torch)."""
    from engine.attention import flashinfer_backend as fib  # imports flashinfer lazily

    if name == "auto":
        fits = dtype is not None and fib.supports(head_dim=kwargs.get("head_dim", 0), dtype=dtype)
        name = "flashinfer" if torch.device(device).type == "cuda" and fits and fib.flashinfer_available() \
            else "torch"
    if name == "flashinfer":
        return fib.FlashInferAttentionBackend(device=device, dtype=dtype, **kwargs)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} "
                         f"(available: auto, flashinfer, {', '.join(sorted(BACKENDS))})")
    return BACKENDS[name](device=device, **kwargs)


__all__ = ["AttentionBackend", "AttentionMetadata", "BatchSpec", "TorchAttentionBackend", "get_backend",
           "backend_geometry", "BACKENDS"]
