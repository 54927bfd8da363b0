"""One tensor-parallel rank's KV transfers: its transports, its pieces of every request.

Every rank of a worker runs one ``RankAgent`` on an event loop of its process (rank 0: the gRPC
loop; ranks 1..N-1: a thread next to ``TPFollower``). It owns, over the rank's own KV cache
(``[L, B, 2, block_size, H_rank, head_dim]``, block ids shared by all ranks):

    cache transport   whole blocks of the rank's heads, in and out
    piece transport   (receivers taking pieces, ``WorkerShape.piece_heads < H_rank``) the same memory
                      viewed as ``[L, B * k, 2, block_size, g, head_dim]``: piece j of block b is view
                      block ``b * k + j``, so a sender rank holding g heads writes it with one
                      descriptor per block run, and the rank regroups the block in place once every
                      piece landed (``staging.regroup``)
    staging areas     (senders whose receiver rank holds fewer heads, made on first use) one per
                      piece size: heads gathered into contiguous blocks (``staging.StagingArea``)

Receiving (decode)::

    expect(rid, blocks, timeout)   one kvtransfer expectation per piece of this rank, key
                                   ``<rid>/<rank>[.<j>]`` (shape.piece_key)
    wait_received(rid)             every piece complete -> regroup -> (bytes, backend); a failed piece
                                   aborts the others (returns once none can be written) and raises
    release(rid) / abort(rid)      every piece, idempotent

Sending (prefill), pieces planned by rank 0 (shape.plan_pieces)::

    send(rid, src, orders, streamed)   one kvtransfer send per piece (gathering into staging first
                                       when the piece is a subset of this rank's heads)
    push(rid, layers, final)           streamed: gather those layers (staged pieces), push them
    wait_sent(rid)                     every receiver acknowledged -> (bytes, backend), staging freed
    close_send(rid, reason)            abort what is in flight (returns once nothing is), free staging
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

import torch

from engine.kv_layout import KVLayout

from ..errors import InvalidTransfer, TransferError
from ..transport import make_transport
from .shape import WorkerShape, piece_key, rank_layout
from .staging import StagingArea, regroup

log = logging.getLogger("kvtransfer.ranks")


@dataclass(frozen=True, kw_only=True)
class Order:
    """One piece this rank sends: its heads ``heads`` (absolute) into ``endpoint`` under ``key``."""

    endpoint: dict
    key: str
    dst: list[int]
    heads: tuple[int, int]


@dataclass
class _Sending:
    src: list[int]
    streamed: bool
    entries: list = field(default_factory=list)  # (order, handle, staging area | None, staging ids)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass
class _Expecting:
    blocks: list[int]
    pieces: list = field(default_factory=list)  # (transport, key, expectation)


class RankAgent:
    def __init__(self, *, layout: KVLayout, shape: WorkerShape, rank: int, cache: torch.Tensor,
                 kind: str = "auto", options: dict | None = None, staging_blocks: int = 0,
                 piece_port: int = 0) -> None:
        """``layout``: the model's whole KV layout; ``shape``: the worker's (receiving) shape;
        ``cache``: this rank's KV tensor; ``options``: TransportConfig fields (kvtransfer.make_transport);
        ``staging_blocks``: a staging area's size, in cache blocks' worth of memory (0: a quarter of
        the cache); ``piece_port``: the piece transport's port (0: any free one)."""
        self.layout, self.shape, self.rank = layout, shape, rank
        self.heads = shape.heads(rank)
        self.cache = cache
        self.kind = kind
        self.options = dict(options or {})
        self.staging_blocks = staging_blocks or max(1, int(cache.shape[1]) // 4)
        self.k = shape.pieces_per_rank
        self.cache_tx = make_transport(kind, rank_layout(layout, shape.rank_heads), cache, **self.options)
        self.view_tx = None
        if self.k > 1:
            view = cache.view(cache.shape[0], cache.shape[1] * self.k, *cache.shape[2:4], shape.piece_heads,
                              cache.shape[5])
            self.view_tx = make_transport(kind, rank_layout(layout, shape.piece_heads), view,
                                          **{**self.options, "listen_port": piece_port})
        self.stream = torch.cuda.Stream(cache.device) if cache.is_cuda else None
        self._staging: dict[int, StagingArea] = {}
        self._staging_lock = asyncio.Lock()
        self._expecting: dict[str, _Expecting] = {}
        self._sending: dict[str, _Sending] = {}

    def _extra_options(self) -> dict:
        """Staging transports only send (peers never dial them): any free port."""
        return {**self.options, "listen_port": 0}

    async def start(self) -> RankAgent:
        await self.cache_tx.start()
        if self.view_tx is not None:
            await self.view_tx.start()
        return self

    @property
    def backends(self) -> list[str]:
        return list(self.cache_tx.backends)

    def endpoints(self) -> tuple[dict, dict | None]:
        """(cache endpoint, piece endpoint or None) for the worker's ranked endpoint."""
        return self.cache_tx.endpoint(), self.view_tx.endpoint() if self.view_tx is not None else None

    # ---- receiving ------------------------------------------------------------------------------
    async def expect(self, request_id: str, block_ids: list[int], timeout_s: float) -> None:
        if request_id in self._expecting:
            raise InvalidTransfer(f"request {request_id!r} is already expected on rank {self.rank}")
        group = _Expecting(blocks=list(block_ids))
        try:
            for j, _, _ in self.shape.pieces(self.rank):
                if self.k == 1:
                    tx, key, ids = self.cache_tx, piece_key(request_id, self.rank, None), group.blocks
                else:
                    tx, key = self.view_tx, piece_key(request_id, self.rank, j)
                    ids = [b * self.k + j for b in group.blocks]
                group.pieces.append((tx, key, tx.expect(key, ids, timeout=timeout_s)))
        except BaseException:
            for tx, key, _ in group.pieces:
                tx.release(key)
            raise
        self._expecting[request_id] = group

    async def wait_received(self, request_id: str, timeout_s: float | None = None) -> dict:
        group = self._expecting.get(request_id)
        if group is None:
            from ..errors import UnknownRequest

            raise UnknownRequest(f"request {request_id!r} is not expected on rank {self.rank}")
        infos, failed = await _wait_all([exp for _, _, exp in group.pieces])
        if failed is not None:
            await self.abort(request_id, f"rank {self.rank}: another piece failed: {failed}")
            raise failed
        if self.k > 1:
            event = regroup(self.cache, group.blocks, self.k, self.stream)
            if event is not None:
                await asyncio.get_running_loop().run_in_executor(None, event.synchronize)
        self.release(request_id)
        return {"bytes": sum(int(i.get("bytes", 0)) for i in infos),
                "backend": str(infos[0].get("backend", "")) if infos else ""}

    def release(self, request_id: str) -> None:
        group = self._expecting.pop(request_id, None)
        if group is not None:
            for tx, key, _ in group.pieces:
                tx.release(key)

    async def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Both roles: True once no write of the request can land on this rank any more."""
        safe = True
        group = self._expecting.pop(request_id, None)
        if group is not None:
            results = await asyncio.gather(*(tx.abort(key, reason) for tx, key, _ in group.pieces))
            safe = all(results)
            for tx, key, _ in group.pieces:
                tx.release(key)
        await self.close_send(request_id, reason)
        return safe

    # ---- sending --------------------------------------------------------------------------------
    async def _area(self, g: int) -> StagingArea:
        async with self._staging_lock:
            area = self._staging.get(g)
            if area is None:
                def make(layout: KVLayout, tensor: torch.Tensor):
                    return make_transport(self.kind, layout, tensor, **self._extra_options())

                # a staging block of g heads is g / H of a cache block: the same bytes hold H / g as many
                blocks = self.staging_blocks * (self.shape.rank_heads // g)
                area = await StagingArea(rank_layout(self.layout, g), blocks, self.cache.device, make).start()
                log.info("kvtransfer: rank %d staging area of %d blocks for %d-head pieces", self.rank,
                         blocks, g)
                self._staging[g] = area
            return area

    async def send(self, request_id: str, src: list[int], orders: list[Order], *, streamed: bool,
                   timeout_s: float) -> None:
        if request_id in self._sending:
            raise InvalidTransfer(f"request {request_id!r} is already being sent from rank {self.rank}")
        group = _Sending(src=list(src), streamed=streamed)
        self._sending[request_id] = group
        deadline = time.monotonic() + timeout_s
        try:
            for order in orders:
                h0, h1 = order.heads
                if not (self.heads[0] <= h0 < h1 <= self.heads[1]):
                    raise InvalidTransfer(f"rank {self.rank} holds KV heads {list(self.heads)}, "
                                          f"not [{h0},{h1})")
                area, ids = None, group.src
                if (h0, h1) != self.heads:
                    area = await self._area(h1 - h0)
                    ids = await area.reserve(len(group.src), deadline)
                    group.entries.append([order, None, area, ids])
                    if not streamed:
                        await area.gather(self.cache, group.src, ids, h0 - self.heads[0],
                                          range(self.layout.num_layers))
                else:
                    group.entries.append([order, None, None, None])
                tx = area.transport if area is not None else self.cache_tx
                group.entries[-1][1] = tx.start_send(order.key, order.endpoint, ids, order.dst,
                                                     layers=() if streamed else None,
                                                     timeout=max(0.001, deadline - time.monotonic()))
        except BaseException:
            await asyncio.shield(self.close_send(request_id, "could not open every piece"))
            raise

    async def push(self, request_id: str, layers: list[int], final: bool) -> None:
        group = self._sending.get(request_id)
        if group is None or not group.streamed:
            raise InvalidTransfer(f"no streamed send of {request_id!r} on rank {self.rank}")
        async with group.lock:  # pushes of one request are applied in order
            for order, handle, area, ids in group.entries:
                if handle.done():
                    continue  # failed or aborted: wait_sent reports it
                if area is not None:
                    await area.gather(self.cache, group.src, ids, order.heads[0] - self.heads[0], layers)
                try:
                    handle.push_layers(tuple(layers), final=final)
                except TransferError as exc:
                    log.debug("push of %s refused: %s", order.key, exc)

    async def wait_sent(self, request_id: str, timeout_s: float | None = None) -> dict:
        group = self._sending.get(request_id)
        if group is None:
            from ..errors import UnknownRequest

            raise UnknownRequest(f"request {request_id!r} is not being sent from rank {self.rank}")
        infos, failed = await _wait_all([e[1] for e in group.entries])
        if failed is not None:
            await self.close_send(request_id, f"another piece failed: {failed}")
            raise failed
        await self.close_send(request_id, "sent")
        return {"bytes": sum(int(i.get("bytes", 0)) for i in infos),
                "backend": str(infos[0].get("backend", "")) if infos else ""}

    async def close_send(self, request_id: str, reason: str = "closed") -> None:
        group = self._sending.pop(request_id, None)
        if group is None:
            return
        live = [e[1] for e in group.entries if e[1] is not None and not e[1].done()]
        await asyncio.gather(*(handle.abort(reason) for handle in live))
        for _, _, area, ids in group.entries:
            if area is not None:
                area.free(ids)

    # ---- introspection / lifecycle --------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Counts that must all be 0 when the worker is idle."""
        txs = [self.cache_tx, *([self.view_tx] if self.view_tx else []),
               *(a.transport for a in self._staging.values())]
        per = [tx.stats() for tx in txs]
        return {"expecting": len(self._expecting), "sending": len(self._sending),
                "staging_in_use": sum(a.in_use for a in self._staging.values()),
                "expectations": sum(s["expectations"] for s in per),
                "unsettled": sum(s["unsettled"] for s in per), "sends": sum(s["sends"] for s in per),
                "peer_handles": sum(s["peer_handles"] for s in per),
                "nixl_xfers": sum(s["nixl_xfers"] for s in per)}

    async def close(self) -> None:
        for rid in list(self._sending):
            await self.close_send(rid, "transport closing")
        for rid in list(self._expecting):
            self.release(rid)
        for area in self._staging.values():
            await area.close()
        if self.view_tx is not None:
            await self.view_tx.close()
        await self.cache_tx.close()


async def _wait_all(handles: list) -> tuple[list[dict], BaseException | None]:
    """Every transfer handle's result, or ([], the first failure). Each ``wait()`` runs as a task;
    whichever way this ends (a failure, or the caller cancelled: an aborted send cancels its rank's
    wait), the unfinished waits are cancelled and every outcome is read where the task is made, so
    no task is left holding an exception nobody retrieves. ``wait()`` shields the transfer itself:
    cancelling a wait never cancels a transfer."""
    waits = [asyncio.ensure_future(h.wait()) for h in handles]
    for w in waits:
        w.add_done_callback(_retrieve)
    try:
        if waits:
            await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for w in waits:
            w.cancel()  # no-op for the finished ones
    failed = next((w.exception() for w in waits if w.done() and not w.cancelled()
                   and w.exception() is not None), None)
    return ([], failed) if failed is not None else ([w.result() for w in waits], None)


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


def order_from_wire(endpoint: bytes, key: str, dst: list[int], heads: tuple[int, int]) -> Order:
    try:
        ep = json.loads(endpoint)
    except (UnicodeDecodeError, ValueError):
        raise InvalidTransfer("piece endpoint is not JSON") from None
    return Order(endpoint=ep, key=key, dst=list(dst), heads=heads)
