"""The router's worker directory: one gRPC channel per worker address, and its last GetStats.

Lifecycle: ``set_addresses(role, addrs)`` (from static flags, or from a discovery source on every
change) opens channels for new addresses and retires removed ones. ``poll_forever()`` calls
``GetStats`` on every worker each ``interval`` seconds; a worker that answers is a member and its
``WorkerInfo`` + ``WorkerLoad`` go to the Placer's worker view (``router/state/workers.py``, the one
owner of liveness, load and pending work); one that fails (dead process, deadline) is dropped from
that view at once, so no new request is placed on it. A restarted worker comes back with a new
``incarnation``. What this module keeps per worker is transport plumbing only: the channel, the
stub, the last raw stats (transports, KV endpoint; ``ListWorkers``), the count of requests bound
to the handle, for draining, and how far it has read the worker's cache events.

Cache events (engine/kv_events.py) ride on the same poll: each GetStats asks for the events after the
last one applied, or a snapshot (a new worker, a new incarnation, a router that just started, or
events no longer kept), and they go to the placer's prefix index once the view knows the worker.

Removal drains, it does not cut: a request holds its two handles from placement to its last
cleanup RPC (``acquire`` / ``release``, an in-flight count). A removed handle leaves the placer's
view at once (no new placement picks it) but keeps its channel open for the requests already
bound to it; it is closed when the last of them releases it, or after ``drain_timeout_s``. A
request between Allocate and Decode on a worker that a scale-down (or a pod in preStop leaving the
EndpointSlice) just removed still finishes there, and its Release still reaches the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc

from pdserve.server import CHANNEL_OPTIONS
from pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from router.decode_mux import DecodeStreams, MuxMetrics
from router.lifecycle import WorkerLifecycle
from router.placement import Placer, WorkerInfo, WorkerLoad

log = logging.getLogger(__name__)
STATS_TIMEOUT_S = 2.0
REMOVED_GRACE_S = 120.0  # a removed worker's channel closes at the latest this long after removal


@dataclass(kw_only=True, eq=False)  # identity semantics: a handle is one channel, kept in sets
class WorkerHandle:
    address: str
    role: str
    channel: grpc.aio.Channel
    stub: object
    stats: common_pb2.WorkerStats | None = None
    decode: DecodeStreams | None = None  # a decode worker's Allocates and streams (router/decode_mux.py)
    answering: bool = False  # answered its last poll: a member of the placer's view
    inflight: int = 0      # requests bound to this handle (acquire .. release)
    removed: bool = False  # gone from discovery: never placed on again, closed once drained
    closed: bool = False
    cache_after: int = 0  # the worker's last cache event applied (0: ask for a snapshot)
    cache_incarnation: str = ""  # the incarnation those events came from
    # cache events read, applied once the placer's view has this poll's membership: (snapshot, batches)
    cache_pending: list = field(default_factory=list)

    @property
    def worker_id(self) -> str:
        return self.stats.worker_id if self.stats else ""

    def info(self) -> WorkerInfo:
        assert self.stats is not None
        s = self.stats
        return WorkerInfo(worker_id=s.worker_id, role=self.role, address=self.address,
                          incarnation=s.incarnation, layout_hash=s.layout_hash,
                          kv_bytes_per_block=s.kv_bytes_per_block, block_size=s.block_size,
                          max_num_seqs=s.max_num_seqs)


class WorkerDirectory:
    def __init__(self, placer: Placer, *, interval: float = 0.5,
                 drain_timeout_s: float = REMOVED_GRACE_S, decode_mux: bool = True) -> None:
        self.placer = placer
        self.decode_mux = decode_mux
        self.interval = interval
        self.drain_timeout_s = drain_timeout_s
        self._by_addr: dict[str, WorkerHandle] = {}
        self._draining: set[WorkerHandle] = set()  # removed, still serving requests bound to them
        self._tasks: set[asyncio.Task] = set()
        self.lifecycle = WorkerLifecycle()  # deaths and restarts: logs, counters (bootstrap's registry)
        self.mux_metrics = MuxMetrics()  # every decode worker's DecodeMany call (bootstrap's registry)

    # ---- membership -------------------------------------------------------------------------------
    async def set_addresses(self, role: str, addresses: Iterable[str]) -> None:
        wanted = set(addresses)
        removed = False
        for addr, h in list(self._by_addr.items()):
            if h.role == role and addr not in wanted:
                del self._by_addr[addr]
                self._retire(h)
                removed = True
        if removed:
            self._publish()  # out of the placer's view before anything else can place on it
        for addr in wanted:
            if addr not in self._by_addr:
                channel = self.open_channel(addr, role)
                stub = (prefill_pb2_grpc.PrefillStub(channel) if role == "prefill"
                        else decode_pb2_grpc.DecodeStub(channel))
                decode = None if role == "prefill" else DecodeStreams(stub, addr, enabled=self.decode_mux,
                                                                      metrics=self.mux_metrics)
                self._by_addr[addr] = WorkerHandle(address=addr, role=role, channel=channel, stub=stub,
                                                   decode=decode)
        await self.poll_once()

    def open_channel(self, address: str, role: str) -> grpc.aio.Channel:
        """Plaintext; under --tls-dir bootstrap replaces it with mutual TLS (pdserve/tls.py)."""
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)

    def _retire(self, h: WorkerHandle) -> None:
        self.lifecycle.forget(h.address)
        h.removed, h.answering = True, False
        if h.inflight == 0:
            self._close_later(h, grace=None)
            return
        self._draining.add(h)
        # A request that never releases (a bug, a hung RPC) must not keep the channel forever.
        self._spawn(self._close_after_timeout(h))

    async def _close_after_timeout(self, h: WorkerHandle) -> None:
        await asyncio.sleep(self.drain_timeout_s)
        if not h.closed:
            log.warning("closing removed worker %s (%s) with %d request(s) still bound after %.0fs",
                        h.worker_id or "?", h.address, h.inflight, self.drain_timeout_s)
            self._close_later(h, grace=None)

    def _close_later(self, h: WorkerHandle, grace: float | None) -> None:
        if h.closed:
            return
        h.closed = True
        self._draining.discard(h)
        if h.decode is not None:
            h.decode.close()
        self._spawn(h.channel.close(grace=grace))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- requests bound to a worker ---------------------------------------------------------------
    def acquire(self, worker_id: str) -> WorkerHandle | None:
        """The live handle of ``worker_id`` for one request (``release`` it when the request is done).

        Only current members are handed out: a removed worker serves only what it already has."""
        h = self.by_id(worker_id)
        if h is not None:
            h.inflight += 1
        return h

    def release(self, h: WorkerHandle) -> None:
        h.inflight -= 1
        if h.removed and h.inflight <= 0:
            self._close_later(h, grace=None)

    @property
    def draining(self) -> list[WorkerHandle]:
        return list(self._draining)

    def handles(self, role: str | None = None) -> list[WorkerHandle]:
        return [h for h in self._by_addr.values() if role is None or h.role == role]

    def by_id(self, worker_id: str) -> WorkerHandle | None:
        for h in self._by_addr.values():
            if h.worker_id == worker_id:
                return h
        return None

    def is_healthy(self, h: WorkerHandle) -> bool:
        """Placeable: answering and, in the placer's view, not cooling down after a failure."""
        return h.answering and not h.removed and self.placer.view.healthy(h.worker_id)

    def healthy(self, role: str) -> list[WorkerHandle]:
        return [h for h in self.handles(role) if self.is_healthy(h)]

    # ---- polling ----------------------------------------------------------------------------------
    async def poll_once(self) -> None:
        handles = list(self._by_addr.values())
        await asyncio.gather(*(self._poll(h) for h in handles))
        self._publish()

    async def _poll(self, h: WorkerHandle) -> None:
        try:
            stats = await h.stub.GetStats(common_pb2.StatsRequest(
                cache_events=True, cache_events_after=h.cache_after), timeout=STATS_TIMEOUT_S)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
            why = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else "timeout"
            if h.answering:
                log.warning("worker %s (%s) stopped answering: %s", h.worker_id or "?", h.address, why)
            self.lifecycle.lost(h, why)
            self.mark_failed(h)
            if h.decode is not None:  # frozen, not dead: its streams move on (decode_mux.UNRESPONSIVE_S)
                h.decode.unresponsive(f"GetStats {why}")
            return
        if stats.role != h.role and not (h.role == "decode" and stats.role == "colocated"):
            log.error("worker at %s says role %r, expected %r; ignoring it", h.address, stats.role, h.role)
            self.mark_failed(h)
            return
        self._take_cache_events(h, stats)
        h.stats, h.answering = stats, True
        self.lifecycle.answered(h, stats)
        with contextlib.suppress(ValueError):
            self.placer.update_load(stats.worker_id, WorkerLoad(
                queue_depth=stats.queue_depth, num_running=stats.num_running, free_blocks=stats.free_blocks,
                total_blocks=stats.total_blocks, incarnation=stats.incarnation, reported_at=time.time()))

    def _take_cache_events(self, h: WorkerHandle, stats: common_pb2.WorkerStats) -> None:
        """Keep the answer's cache events for ``_publish``; drop them from the stats kept."""
        if not stats.HasField("cache"):
            return
        cache = stats.cache
        if cache.snapshot:
            h.cache_pending = [(True, [(b.tier, True, list(b.hashes)) for b in cache.batches])]
        elif stats.incarnation != h.cache_incarnation:
            h.cache_pending, h.cache_after = [], 0  # numbered by another incarnation's log: start over
            stats.ClearField("cache")
            return
        else:
            h.cache_pending.append((False, [(b.tier, b.stored, list(b.hashes)) for b in cache.batches]))
        h.cache_after, h.cache_incarnation = cache.last, stats.incarnation
        stats.ClearField("cache")

    def _apply_cache_events(self) -> None:
        for h in self._by_addr.values():
            if h.cache_pending and h.answering and h.stats is not None:
                pending, h.cache_pending = h.cache_pending, []
                for snapshot, batches in pending:
                    self.placer.apply_cache_events(h.stats.worker_id, snapshot=snapshot, batches=batches)

    def mark_failed(self, h: WorkerHandle) -> None:
        was_healthy = h.answering
        h.answering = False
        if h.stats is not None:
            self.placer.mark_unhealthy(h.stats.worker_id)
        if was_healthy:
            self._publish()

    def mark_failed_id(self, worker_id: str) -> None:
        h = self.by_id(worker_id)
        if h is not None:
            self.mark_failed(h)

    def _publish(self) -> None:
        infos = [h.info() for h in self._by_addr.values() if h.answering]
        self.placer.update_workers(infos)
        self._apply_cache_events()

    async def poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.poll_once()
            except Exception:
                log.exception("worker poll failed")

    async def close(self) -> None:
        for h in [*self._by_addr.values(), *self._draining]:
            h.closed = True
            if h.decode is not None:
                h.decode.close()
            await h.channel.close()
        self._by_addr.clear()
        self._draining.clear()
        for task in list(self._tasks):
            task.cancel()
