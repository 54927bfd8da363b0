"""Host -> device copies of the small per-step tensors (token ids, positions, indices, parameters)."""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a CPU tensor) on ``device`` without blocking the host: on CUDA it is staged in pinned
    memory and copied asynchronously, so building a step never waits for the previous one."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
