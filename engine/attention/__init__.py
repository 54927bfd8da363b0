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
        fits = _may_use_flashinfer(name, device=device, dtype=dtype, head_dim=kwargs.get("head_dim", 0))
        name = "flashinfer" if fits and fib.flashinfer_available() else "torch"
    if name == "flashinfer":
        return fib.FlashInferAttentionBackend(device=device, dtype=dtype, **kwargs)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} "
                         f"(available: auto, flashinfer, {', '.join(sorted(BACKENDS))})")
    return BACKENDS[name](device=device, **kwargs)


def prefetching(name: str, *, device: torch.device | str, dtype: torch.dtype | None, head_dim: int):
    """A context manager that imports, in the background while its body runs, what ``get_backend``
    with these arguments will import (flashinfer, ``flashinfer_backend.prefetching``); a no-op where
    the torch backend will be used."""
    import contextlib

    if not _may_use_flashinfer(name, device=device, dtype=dtype, head_dim=head_dim):
        return contextlib.nullcontext()
    from engine.attention import flashinfer_backend as fib

    return fib.prefetching()


def _may_use_flashinfer(name: str, *, device: torch.device | str, dtype: torch.dtype | None,
                        head_dim: int) -> bool:
    """flashinfer asked for, or ``auto`` on CUDA for a model it supports (if it imports)."""
    if name == "flashinfer":
        return True
    if name != "auto" or torch.device(device).type != "cuda" or dtype is None:
        return False
    from engine.attention import flashinfer_backend as fib

    return fib.supports(head_dim=head_dim, dtype=dtype)


__all__ = ["AttentionBackend", "AttentionMetadata", "BatchSpec", "TorchAttentionBackend", "get_backend",
           "backend_geometry", "BACKENDS"]
