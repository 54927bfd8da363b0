"""Rank 0's KV link for a worker of N tensor-parallel ranks: the surface ``kvtransfer.link.KVLink`` offers
the prefill and decode workers, fanned out over every rank's ``RankAgent``.

Receiving (decode)::

    endpoint()          the ranked endpoint (shape.build_endpoint): every rank's transport endpoints
    expect(rid, blocks) every rank registers its pieces (all or none: a failure releases the others)
    wait(rid)           KV-complete = every rank's pieces landed and were regrouped; the first failure
                        (or the waiter's cancellation) aborts the request on every rank and returns once
                        no write of it can land anywhere, then raises
    release(rid)        every rank, idempotent

Sending (prefill): ``send`` / ``open_stream`` plan the pieces against the receiver's endpoint
(shape.plan_pieces: refused with both shapes named when it cannot be bridged) and start a
``RankedSend``: per source rank, a driver task opens that rank's sends, forwards the pushed layers in
order (coalescing a backlog into one push) and awaits its acknowledgements. ``wait`` returns once every
rank's receivers acknowledged; a failure on one rank aborts the others first. ``abort`` lets an open
in flight finish, then closes the request on every rank: nothing of it is in flight when it returns.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from engine.kv_layout import KVLayout

from ..errors import InvalidTransfer, UnknownRequest
from .agent import Order, RankAgent
from .shape import WorkerShape, build_endpoint, parse_endpoint, plan_pieces

log = logging.getLogger("kvtransfer.ranks")
MAX_ENDPOINT_BYTES = 1 << 20


async def _maybe(value: Any) -> Any:
    return await value if asyncio.iscoroutine(value) else value


def _error(task: asyncio.Task) -> BaseException | None:
    if not task.done():
        return None
    if task.cancelled():
        return asyncio.CancelledError()
    return task.exception()


class RankedLink:
    def __init__(self, *, ranks: list, layout: KVLayout, shape: WorkerShape, lease_s: float) -> None:
        """``ranks[0]``: this process's ``RankAgent``; ``ranks[r]``: rank r's agent (``RankClient``)."""
        local: RankAgent = ranks[0]
        self.ranks = ranks
        self.layout = layout
        self.shape = shape
        self.lease_s = lease_s
        self.local = local
        self.transports = local.backends
        self.name = self.transports[0] if self.transports else ""
        self.send_timeout_s = local.cache_tx.config.send_timeout_s
        self._endpoint = b""
        self._expected: set[str] = set()
        self.closers: list = []  # awaited by close() (the app's control server of rank 0's agent)

    def set_rank_endpoints(self, endpoints: list[dict], views: list[dict | None]) -> None:
        ranked = build_endpoint(self.layout, self.shape, endpoints, views)
        self._endpoint = json.dumps(ranked, separators=(",", ":")).encode()

    # ---- receiver (decode) ----------------------------------------------------------------------
    def endpoint(self) -> bytes:
        return self._endpoint

    async def expect(self, request_id: str, block_ids: list[int]) -> None:
        results = await asyncio.gather(*(r.expect(request_id, list(block_ids), self.lease_s)
                                         for r in self.ranks), return_exceptions=True)
        failed = next((x for x in results if isinstance(x, BaseException)), None)
        if failed is not None:
            await asyncio.shield(self._release_all(request_id))
            raise failed
        self._expected.add(request_id)

    async def wait(self, request_id: str) -> dict:
        if request_id not in self._expected:
            raise UnknownRequest(f"request {request_id!r} is not expected (never, or already finished)")
        tasks = [asyncio.ensure_future(r.wait_received(request_id, self.lease_s)) for r in self.ranks]
        for t in tasks:  # every outcome read: the ones cut short by another rank's failure too
            t.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            for t in tasks:
                t.cancel()
            await asyncio.shield(self._abort_all(request_id, "KV wait cancelled"))
            raise
        failed = next((e for e in map(_error, tasks) if e is not None), None)
        if failed is not None:
            for t in tasks:
                t.cancel()
            await asyncio.shield(self._abort_all(request_id, f"another rank failed: {failed}"))
            raise failed
        self._expected.discard(request_id)
        infos = [t.result() for t in tasks]
        return {"bytes": sum(i["bytes"] for i in infos), "backend": infos[0]["backend"]}

    async def release(self, request_id: str) -> None:
        """Every rank stops expecting it; returns once none of it can land on any rank (as KVLink.release)."""
        self._expected.discard(request_id)
        if not await self._abort_all(request_id, "released by the decode worker"):
            log.warning("kvtransfer: a rank's sender of %s did not confirm its abort", request_id)

    async def _release_all(self, request_id: str) -> None:
        results = await asyncio.gather(*(_maybe(r.release(request_id)) for r in self.ranks),
                                       return_exceptions=True)
        for r, x in enumerate(results):
            if isinstance(x, BaseException):
                log.warning("kvtransfer: rank %d could not release %s: %s", r, request_id, x)

    async def _abort_all(self, request_id: str, reason: str) -> bool:
        results = await asyncio.gather(*(r.abort(request_id, reason) for r in self.ranks),
                                       return_exceptions=True)
        return all(x is True for x in results)

    # ---- sender (prefill) -----------------------------------------------------------------------
    can_stream_layers = True

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    @property
    def kv_device(self) -> Any:
        return self.local.cache.device

    @property
    def trace(self) -> bool:
        return bool(self.local.cache_tx.config.trace)

    def plan(self, endpoint: bytes, request_id: str, src: list[int],
             dst: list[int]) -> dict[int, list[Order]]:
        """Each source rank's orders for sending ``src`` into the endpoint's ``dst`` blocks."""
        if len(endpoint) > MAX_ENDPOINT_BYTES:
            raise InvalidTransfer("kv_endpoint too large")
        try:
            raw = json.loads(endpoint)
        except (UnicodeDecodeError, ValueError):
            raise InvalidTransfer("kv_endpoint is not a kvtransfer endpoint (bad JSON)") from None
        if len(src) != len(dst):
            raise InvalidTransfer(f"{len(src)} source blocks but {len(dst)} destination blocks")
        dest = parse_endpoint(raw)
        orders: dict[int, list[Order]] = {}
        for p in plan_pieces(self.shape, self.layout, dest):
            target = dest.endpoints[p.dst] if p.j is None else dest.views[p.dst]
            orders.setdefault(p.src, []).append(Order(endpoint=target, key=p.key(request_id),
                                                      dst=p.dst_ids(list(dst), dest.shape.pieces_per_rank),
                                                      heads=p.heads))
        return orders

    async def send(self, endpoint: bytes, request_id: str, src: list[int], dst: list[int]) -> tuple[int, str]:
        orders = self.plan(endpoint, request_id, src, dst)
        handle = RankedSend(self, request_id, orders, list(src), streamed=False)
        return await self.wait_sent(handle, endpoint)

    def open_stream(self, endpoint: bytes, request_id: str, src: list[int], dst: list[int]) -> RankedSend:
        orders = self.plan(endpoint, request_id, src, dst)
        return RankedSend(self, request_id, orders, list(src), streamed=True)

    async def wait_sent(self, handle: RankedSend, endpoint: bytes) -> tuple[int, str]:
        try:
            info = await handle.wait()
        except asyncio.CancelledError:
            await asyncio.shield(handle.abort("prefill cancelled"))
            raise
        return int(info["bytes"]), info["backend"] or self.name

    # ---- introspection / lifecycle --------------------------------------------------------------
    async def rank_stats(self) -> list[dict[str, int]]:
        return [await _maybe(r.stats()) for r in self.ranks]

    async def close(self) -> None:
        for closer in self.closers:
            await closer()
        for r in self.ranks[1:]:
            await r.close()
        await self.local.close()


class RankedSend:
    """One request's sends from every source rank (see the module docstring)."""

    def __init__(self, link: RankedLink, request_id: str, orders: dict[int, list[Order]], src: list[int], *,
                 streamed: bool) -> None:
        loop = asyncio.get_running_loop()
        self.link, self.request_id, self.streamed = link, request_id, streamed
        self._queues = {r: asyncio.Queue() for r in orders}
        self._opened = {r: loop.create_future() for r in orders}
        self._tasks = {r: loop.create_task(self._drive(r, link.ranks[r], orders[r], src),
                                           name=f"kv-rank{r}-send-{request_id}") for r in orders}
        for t in self._tasks.values():
            t.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._aborting: asyncio.Task | None = None

    async def _drive(self, r: int, rank, orders: list[Order], src: list[int]) -> dict:
        timeout = self.link.send_timeout_s
        try:
            await rank.send(self.request_id, src, orders, streamed=self.streamed, timeout_s=timeout)
        except BaseException:
            self._opened[r].set_result(False)
            raise
        self._opened[r].set_result(True)
        if self.streamed:
            queue, final = self._queues[r], False
            while not final:
                layers, final = await queue.get()
                while not final and not queue.empty():  # a backlog goes out as one push
                    more, final = queue.get_nowait()
                    layers += more
                await rank.push(self.request_id, list(layers), final)
        return await rank.wait_sent(self.request_id, timeout)

    def push_layers(self, layers, *, final: bool = False) -> None:
        for queue in self._queues.values():
            queue.put_nowait((tuple(layers), final))

    def done(self) -> bool:
        return all(t.done() for t in self._tasks.values())

    async def wait(self) -> dict:
        tasks = list(self._tasks.values())
        if not tasks:
            return {"bytes": 0, "backend": ""}
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((e for e in map(_error, tasks) if e is not None), None)
        if failed is not None:
            await asyncio.shield(self.abort(f"another rank failed: {failed}"))
            raise failed
        infos = [t.result() for t in tasks]
        return {"bytes": sum(i["bytes"] for i in infos), "backend": infos[0]["backend"] if infos else ""}

    async def abort(self, reason: str = "aborted") -> None:
        """Returns once nothing of the request is in flight on any rank."""
        if self._aborting is None:
            self._aborting = asyncio.get_running_loop().create_task(self._abort(reason))
        await asyncio.shield(self._aborting)

    async def _abort(self, reason: str) -> None:
        if not self._tasks:
            return
        # An open in flight finishes first: a rank must never open a send after its close.
        await asyncio.wait(list(self._opened.values()))
        for t in self._tasks.values():
            t.cancel()
        await asyncio.wait(list(self._tasks.values()))
        ranks = [r for r, f in self._opened.items() if f.result()]
        results = await asyncio.gather(*(self.link.ranks[r].close_send(self.request_id, reason)
                                         for r in ranks), return_exceptions=True)
        for r, x in zip(ranks, results, strict=True):
            if isinstance(x, BaseException):
                log.warning("kvtransfer: rank %d could not close the send of %s: %s", r, self.request_id, x)
