"""Several projections of the same input as one matmul: q/k/v of attention, gate/up of the MLP.

``CausalLM.fuse_projections`` (after a load) or ``CausalLM.allocate_fused`` (before loading a
meta-built model) builds one ``FusedLinears`` per group; the Hugging Face-named parameters become views
into its concatenated weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class FusedLinears:
    """One matmul for several bias-compatible projections of the same input (q/k/v, gate/up).

    The Hugging Face-named parameters become views into one concatenated weight, so memory holds
    one copy and in-place loads into the named parameters keep the fused weight current. If a named
    parameter is later replaced (a new dtype or device), ``matches`` turns False and the caller falls
    back to the separate projections.

    ``empty_on=(device, dtype)``: allocate the concatenated weight there, uninitialised, instead of
    concatenating the current ones -- for a model built on the meta device whose weights are about to
    be loaded (``engine.weights.load_weights`` writes each named parameter in place). An 8B model then
    never holds a second copy of these projections (9 GB) and skips ~0.35 s of copies at start.
    """

    def __init__(self, linears: list[nn.Linear], *,
                 empty_on: tuple[torch.device, torch.dtype] | None = None) -> None:
        has_bias = linears[0].bias is not None
        with torch.no_grad():
            if empty_on is None:
                self.weight = torch.cat([lin.weight for lin in linears])
                self.bias = torch.cat([lin.bias for lin in linears]) if has_bias else None
            else:
                device, dtype = empty_on
                rows = sum(lin.weight.shape[0] for lin in linears)
                self.weight = torch.empty(rows, linears[0].weight.shape[1], device=device, dtype=dtype)
                self.bias = torch.empty(rows, device=device, dtype=dtype) if has_bias else None
        self.sizes = [lin.weight.shape[0] for lin in linears]
        start = 0
        for lin, n in zip(linears, self.sizes, strict=True):
            lin.weight = nn.Parameter(self.weight[start:start + n], requires_grad=False)
            if has_bias:
                lin.bias = nn.Parameter(self.bias[start:start + n], requires_grad=False)
            start += n
        self._params = [lin.weight for lin in linears]

    def matches(self, linears: tuple[nn.Linear, ...]) -> bool:
        return all(lin.weight is p for lin, p in zip(linears, self._params, strict=True))

    def matmul(self, x: torch.Tensor, linear: Callable = F.linear) -> torch.Tensor:
        """The concatenated output ``[T, sum(sizes)]`` (through ``F.linear`` or ``engine.gemv.linear``)."""
        return linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor, linear: Callable = F.linear) -> list[torch.Tensor]:
        return self.matmul(x, linear).split(self.sizes, dim=-1)
