"""Layer-wise KV push: one request's ``engine.layer_sink.LayerSink`` feeding a kvtransfer send.

Lifecycle (``begin`` / ``layer_ready`` / ``abort`` run on the engine thread and only post work; all
state lives on the event loop that owns the transport, as kvtransfer requires)::

    begin(table)        -> loop: open the send (start_send(layers=()); BEGIN goes out while the model
                           computes), src = table[skip:], dst = target blocks[skip:]; nothing to send,
                           or the send cannot be opened -> "off" (the worker sends the usual way,
                           which reports the same error)
    layer_ready(i, ev)  CPU (ev None): -> loop: push_layers((i,)); the last layer with final=True
                        CUDA: the EventWaiter thread waits for ev, then -> loop: the same
    abort(reason)       preempted or removed before the final chunk ran: nothing was opened -> "off"
                        (a preempted request is recomputed without a sink and sent in one piece);
                        should a send be open, it is aborted (the receiver is told, the request fails)
    close(reason)       the worker's exit path: aborts a send still in flight and returns once nothing
                        of it is in flight, BEFORE the engine releases the source blocks; terminal
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class EventWaiter:
    """One daemon thread that waits for CUDA events in submission order and then runs a callback.

    Layers complete in order on one stream, so FIFO waiting loses nothing, and it keeps
    ``cudaEventSynchronize`` off both the engine thread and the event loop.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kv-layer-events", daemon=True)
        self._thread.start()

    def submit(self, event: Any, fn: Callable[..., None], *args: Any) -> None:
        self._queue.put((event, fn, args))

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            event, fn, args = item
            try:
                event.synchronize()
                fn(*args)
            except Exception:  # a failed layer must not stop the others' notifications
                log.exception("layer event callback failed")


class LayerStream:
    def __init__(self, *, kv: Any, loop: asyncio.AbstractEventLoop, request_id: str, endpoint: bytes,
                 dst: list[int], skip: int, num_layers: int, waiter: Callable[[], EventWaiter]) -> None:
        self.kv = kv
        self.loop = loop
        self.request_id = request_id
        self.endpoint = endpoint
        self.dst = list(dst)
        self.skip = skip
        self.num_layers = num_layers
        self._waiter = waiter
        self.handle: Any = None
        self.state = "idle"  # idle -> open | off; any -> closed
        self.reason = ""  # why it did not stream (state "off")
        self.opened_at = 0.0  # time.perf_counter() when the send was opened
        self._pushed = 0
        self.push_at: list[float] = []  # time.perf_counter() of each layer's push, in order
        self._aborting: asyncio.Task | None = None

    # ---- LayerSink (engine thread) --------------------------------------------------------------
    def begin(self, block_table: list[int]) -> None:
        self._post(self._open, list(block_table))

    def layer_ready(self, layer: int, event: Any) -> None:
        if event is None:
            self._post(self._push, layer)
        else:
            self._waiter().submit(event, self._post, self._push_computed, layer)

    def abort(self, reason: str) -> None:
        self._post(self._abort, reason)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the process is going away
            pass

    # ---- event loop -------------------------------------------------------------------------------
    @property
    def streaming(self) -> bool:
        """A send was opened (it may since have failed: ``wait`` then raises its error)."""
        return self.handle is not None

    def _open(self, table: list[int]) -> None:
        if self.state != "idle":
            return
        src = table[self.skip:]
        if not src or len(src) != len(self.dst):
            self.state, self.reason = "off", "nothing to send" if not src else "block count mismatch"
            return
        try:
            self.handle = self.kv.open_stream(self.endpoint, self.request_id, src, self.dst)
        except Exception as exc:  # bad endpoint, layout mismatch...: the one-piece send raises it again
            self.state, self.reason = "off", f"cannot open: {exc}"
            return
        self.state, self.opened_at = "open", time.perf_counter()

    def _push_computed(self, layer: int) -> None:
        """A CUDA layer whose event completed. kvtransfer orders its device->host staging copies (TCP)
        after the caller's current stream; on this thread that is the default stream, where the engine
        keeps issuing later layers, so the copy of layer i would wait for the whole forward. The layer
        is complete (its event was waited for, and a one-piece send starts after the step synced), so
        this thread gets a stream of its own with nothing on it."""
        device = getattr(self.kv, "kv_device", None)
        if device is not None and device.type == "cuda":
            import torch  # noqa: PLC0415  (CUDA-only path)

            if torch.cuda.current_stream(device) == torch.cuda.default_stream(device):
                torch.cuda.set_stream(torch.cuda.Stream(device))
        self._push(layer)

    def _push(self, layer: int) -> None:
        if self.state != "open":
            return
        self._pushed += 1
        self.push_at.append(time.perf_counter())
        try:
            self.handle.push_layers((layer,), final=self._pushed == self.num_layers)
        except Exception as exc:  # the send already failed or was aborted: wait() raises why
            log.debug("push of layer %d of %s refused: %s", layer, self.request_id, exc)

    def _abort(self, reason: str) -> None:
        if self.state == "idle":
            self.state, self.reason = "off", reason
        elif self.state == "open" and self._aborting is None:
            self._aborting = self.loop.create_task(self.handle.abort(f"prefill {reason}"))

    async def wait(self) -> tuple[int, str]:
        """(bytes, backend) once the receiver acknowledged every layer; cancelled -> aborted first."""
        return await self.kv.wait_sent(self.handle, self.endpoint)

    async def close(self, reason: str = "prefill ended") -> None:
        """Terminal; returns once nothing of the send is in flight (the source blocks may be freed)."""
        self.state = "closed"
        if self.handle is not None and not self.handle.done():
            await self.handle.abort(reason)
        if self._aborting is not None:
            await asyncio.wait([self._aborting])
