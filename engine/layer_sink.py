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


def layer_callback(sinks: Sequence[LayerSink], device: torch.device,
                   blocking: bool = False) -> Callable[[int], None]:
    """The ``after_layer`` hook of ``CausalLM.forward`` for one step: tells every sink of the step.

    On CUDA one event per layer (shared by the step's sinks) is recorded on the current stream: the
    engine thread never waits for the GPU; whoever ships the layer waits for the event (``blocking``:
    that wait sleeps instead of spinning a core for the whole prompt; EngineConfig.gpu_wait).
    """
    sinks = tuple(sinks)
    if device.type == "cuda":
        def after_layer(i: int) -> None:
            event = torch.cuda.Event(blocking=blocking)
            event.record()
            for sink in sinks:
                sink.layer_ready(i, event)
    else:
        def after_layer(i: int) -> None:
            for sink in sinks:
                sink.layer_ready(i, None)
    return after_layer


# Eager CUDA steps with at least this many tokens are launch-throttled (EngineConfig.launch_ahead_layers):
# below it a layer's kernels are short, the whole forward is short, and the host would only add waits.
LAUNCH_THROTTLE_MIN_TOKENS = 512
_THROTTLE_NAP_S = 5e-5


def launch_throttle(ahead: int) -> Callable[[int], None]:
    """An ``after_layer`` hook that keeps the host at most ``ahead`` layers in front of the GPU.

    Each layer records an event; once more than ``ahead`` are outstanding the engine thread polls the
    oldest (``query`` plus a short ``time.sleep``: the GIL is free meanwhile) until it completed. The
    GPU keeps ``ahead`` layers of work queued, so it never idles on the host, while the device's launch
    queue never fills: other threads' CUDA calls (NIXL/UCX posting a KV copy) go through at once
    instead of waiting for the whole forward to drain."""
    import collections
    import time

    pending: collections.deque = collections.deque()

    def after_layer(_i: int) -> None:
        event = torch.cuda.Event()
        event.record()
        pending.append(event)
        while len(pending) > ahead:
            oldest = pending.popleft()
            while not oldest.query():
                time.sleep(_THROTTLE_NAP_S)

    return after_layer


def chain(*hooks: Callable[[int], None] | None) -> Callable[[int], None] | None:
    """One ``after_layer`` calling each given hook in order; None when none is given."""
    live = tuple(h for h in hooks if h is not None)
    if not live:
        return None
    if len(live) == 1:
        return live[0]

    def after_layer(i: int) -> None:
        for hook in live:
            hook(i)

    return after_layer
