"""The services' view of ``kvtransfer``: one started transport per worker process, bytes on the wire.

The decode worker publishes ``endpoint()`` (JSON bytes, carried opaquely in Allocate / GetStats and
PrefillRequest.target), registers the blocks it expects, and awaits KV-complete; the prefill worker
pushes blocks into such an endpoint and awaits the receiver's acknowledgement. Cancelling a send
aborts the transfer before returning, so a cancelled prefill never leaves writes in flight. A
layer-wise send (``open_stream``) is pushed layer by layer as the prefill computes them
(prefill_service/layer_stream.py).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from typing import Any

log = logging.getLogger(__name__)
MAX_ENDPOINT_BYTES = 64 * 1024


class KVLink:
    def __init__(self, transport: Any, *, lease_s: float) -> None:
        self.transport = transport
        self.lease_s = lease_s
        self.transports = list(transport.backends)
        self.name = self.transports[0] if self.transports else ""
        self._endpoint: bytes | None = None
        self._expected: dict[str, Any] = {}

    def endpoint(self) -> bytes:
        if self._endpoint is None:
            self._endpoint = json.dumps(self.transport.endpoint(), separators=(",", ":")).encode()
        return self._endpoint

    # ---- receiver (decode) ----------------------------------------------------------------------
    def expect(self, request_id: str, block_ids: list[int]) -> None:
        # Keep the handle: a completed expectation leaves the transport's table at once.
        self._expected[request_id] = self.transport.expect(request_id, block_ids, timeout=self.lease_s)

    async def wait(self, request_id: str) -> dict:
        exp = self._expected.get(request_id)
        if exp is None:
            return await self.transport.wait_complete(request_id)
        return await exp.wait()

    async def release(self, request_id: str) -> None:
        """Stop expecting a request's KV; returns once none of it can land any more, so its blocks may be
        freed (a transfer still under way is aborted and its sender's confirmation awaited, at most
        abort_ack_timeout_s; without it the frames still arriving are cut off). Immediate when the KV
        is in or was never sent."""
        self._expected.pop(request_id, None)
        if not await self.transport.abort(request_id, "released by the decode worker"):
            log.warning("kvtransfer: the sender of %s did not confirm its abort; freeing its blocks after "
                        "cutting off what was still arriving", request_id)

    @property
    def trace(self) -> bool:
        """Log per-transfer timelines (kvtransfer/trace.py); the prefill worker logs its side too."""
        config = getattr(self.transport, "config", None)
        return bool(getattr(config, "trace", False))

    # ---- sender (prefill) -----------------------------------------------------------------------
    @property
    def can_stream_layers(self) -> bool:
        """The transport takes layer ranges into an open send (kvtransfer's ``start_send(layers=)``)."""
        try:
            return "layers" in inspect.signature(self.transport.start_send).parameters
        except (AttributeError, TypeError, ValueError):
            return False

    @property
    def num_layers(self) -> int:
        return int(self.transport.layout.num_layers)

    @property
    def kv_device(self) -> Any:
        """The torch.device of the registered KV tensor (None when the transport does not say)."""
        memory = getattr(self.transport, "memory", None)
        return getattr(memory, "device", None)

    async def send(self, endpoint: bytes, request_id: str, src: list[int], dst: list[int]) -> tuple[int, str]:
        """Push ``src`` blocks into the endpoint's ``dst`` blocks; returns (bytes sent, backend used)."""
        ep = _parse_endpoint(endpoint)
        return await self.wait_sent(self.transport.start_send(request_id, ep, src, dst), endpoint)

    def open_stream(self, endpoint: bytes, request_id: str, src: list[int], dst: list[int]) -> Any:
        """Open a layer-wise send with no layer yet (BEGIN goes out now); the caller pushes every layer
        (``handle.push_layers((i,), final=...)``, on this loop) and then ``wait_sent``s it."""
        return self.transport.start_send(request_id, _parse_endpoint(endpoint), src, dst, layers=())

    async def wait_sent(self, handle: Any, endpoint: bytes) -> tuple[int, str]:
        """Await the receiver's acknowledgement; cancelled -> the send is aborted before returning."""
        try:
            info = await handle.wait()
        except asyncio.CancelledError:
            await asyncio.shield(handle.abort("prefill cancelled"))
            raise
        nbytes = int(info.get("bytes", 0)) if isinstance(info, dict) else 0
        backend = str(info.get("backend", "")) if isinstance(info, dict) else ""
        return nbytes, backend or self.transport.peer_backend(_parse_endpoint(endpoint)) or self.name

    async def close(self) -> None:
        await self.transport.close()


def _parse_endpoint(endpoint: bytes) -> dict:
    if len(endpoint) > MAX_ENDPOINT_BYTES:
        raise ValueError("kv_endpoint too large")
    try:
        return json.loads(endpoint)
    except (UnicodeDecodeError, ValueError):
        raise ValueError("kv_endpoint is not a kvtransfer endpoint (bad JSON)") from None

