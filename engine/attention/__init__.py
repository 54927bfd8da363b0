"""Attention backends over the paged KV cache. ``get_backend(name, ...)`` picks one by name."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata, BatchSpec
from engine.attention.torch_backend import TorchAttentionBackend

BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttentionBackend}


def get_backend(name: str, *, device: torch.device | str, **kwargs) -> AttentionBackend:
    """``name``: ``"torch"`` or ``"auto"`` (the best registered backend for ``device``)."""
    if name == "auto":
        name = "torch"  # flashinfer registers here when present, for CUDA devices
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} "
                         f"(available: auto, {', '.join(sorted(BACKENDS))})")
    return BACKENDS[name](device=device, **kwargs)


__all__ = ["AttentionBackend", "AttentionMetadata", "BatchSpec", "TorchAttentionBackend", "get_backend",
           "BACKENDS"]
