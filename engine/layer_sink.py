"""Layer sinks: a prefill request's KV reported layer by layer, so a sender can ship layer i while the
model computes layer i + 1 (layer-wise KV push, docs/kvtransfer.md).

Lifecycle, all calls on the engine thread (a sink must only hand work to another thread, never block
and never raise)::

    add_prefill_request(..., layer_sink=sink)
    ... earlier prompt chunks run in earlier steps: their layers are complete, the sink hears nothing
    step running the FINAL prompt chunk:
        sink.begin(block_table)          every block of the request (allocated at admission)
        sink.layer_ready(0, event) ... sink.layer_ready(L - 1, event)
                                         layer i of those blocks is written once ``event`` (a
                                         torch.cuda.Event recorded on the compute stream) completes;
                                         on CPU event is None: the layer is already computed
    -> the sink is detached; the request is pinned ("prefilled") as without a sink

    preempted (recompute) or removed (abort, release, rejection, engine crash) before that step ended:
        sink.abort(reason)               and the sink is detached: nothing more is reported. A
                                         preempted request is recomputed without streaming.

``begin`` and every ``layer_ready`` of a request happen inside one step, and preemption and aborts
only happen between steps, so a sink that saw ``begin`` always sees all L layers (unless the step
itself crashes, which ends in ``abort``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class LayerSink(Protocol):
    def begin(self, block_table: list[int]) -> None: ...
    def layer_ready(self, layer: int, event: torch.cuda.Event | None) -> None: ...
    def abort(self, reason: str) -> None: ...


def layer_callback(sinks: Sequence[LayerSink], device: torch.device) -> Callable[[int], None]:
    """The ``after_layer`` hook of ``CausalLM.forward`` for one step: tells every sink of the step.

    On CUDA one event per layer (shared by the step's sinks) is recorded on the current stream: the
    engine thread never waits for the GPU; whoever ships the layer waits for the event.
    """
    sinks = tuple(sinks)
    if device.type == "cuda":
        def after_layer(i: int) -> None:
            event = torch.cuda.Event()
            event.record()
            for sink in sinks:
                sink.layer_ready(i, event)
    else:
        def after_layer(i: int) -> None:
            for sink in sinks:
                sink.layer_ready(i, None)
    return after_layer
