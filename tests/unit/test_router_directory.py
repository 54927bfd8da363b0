"""WorkerDirectory membership in-process (fake channels and stubs): a removed worker drains.

A removed handle leaves the placer's view at once, is never handed to a new request, keeps its
channel while requests bound to it run, and is closed when the last one releases it — or after
the drain timeout if one never does. The multi-process regression (remove between Allocate and
Decode on real workers) is in tests/integration/test_router_cluster.py.
"""

from __future__ import annotations

import asyncio

from pdserve.v1 import common_pb2
from router.directory import WorkerDirectory, WorkerHandle
from router.placement import Placer, PlacerConfig


class FakeChannel:
    def __init__(self) -> None:
        self.closed = 0

    async def close(self, grace=None) -> None:
        self.closed += 1


class FakeStub:
    def __init__(self, worker_id: str, role: str) -> None:
        self.stats = common_pb2.WorkerStats(worker_id=worker_id, role=role, incarnation="i1", free_blocks=10,
                                            total_blocks=10)

    async def GetStats(self, request, timeout=None):
        return self.stats


def directory(drain_timeout_s: float = 60.0) -> tuple[WorkerDirectory, Placer, dict[str, FakeChannel]]:
    placer = Placer(PlacerConfig(policy="round_robin"))
    d = WorkerDirectory(placer, interval=60, drain_timeout_s=drain_timeout_s)
    channels = {}
    for wid, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode")):
        channels[wid] = FakeChannel()
        d._by_addr[f"{wid}:1"] = WorkerHandle(address=f"{wid}:1", role=role, channel=channels[wid],
                                               stub=FakeStub(wid, role))
    return d, placer, channels


def decode_ids(placer: Placer) -> set[str]:
    return {w.worker_id for w in placer.view.pool("decode", frozenset())}


def test_removed_idle_worker_closes_at_once() -> None:
    async def main():
        d, placer, ch = directory()
        await d.poll_once()
        assert decode_ids(placer) == {"d0", "d1"}
        await d.set_addresses("decode", ["d1:1"])
        await asyncio.sleep(0)
        assert decode_ids(placer) == {"d1"} and ch["d0"].closed == 1 and d.draining == []
        assert d.acquire("d0") is None

    asyncio.run(main())


def test_removed_busy_worker_drains_until_last_release() -> None:
    async def main():
        d, placer, ch = directory()
        await d.poll_once()
        a, b = d.acquire("d0"), d.acquire("d0")
        assert a is b and a.inflight == 2
        await d.set_addresses("decode", ["d1:1"])
        await asyncio.sleep(0)
        # out of placement and of every listing, but the bound requests keep the channel
        assert decode_ids(placer) == {"d1"} and [h.worker_id for h in d.handles("decode")] == ["d1"]
        assert d.acquire("d0") is None and ch["d0"].closed == 0 and d.draining == [a]
        d.release(a)
        await asyncio.sleep(0)
        assert ch["d0"].closed == 0
        d.release(b)
        await asyncio.sleep(0)
        assert ch["d0"].closed == 1 and a.closed and d.draining == []
        await d.close()
        assert ch["d0"].closed == 1  # never closed twice

    asyncio.run(main())


def test_drain_timeout_closes_a_handle_that_is_never_released() -> None:
    async def main():
        d, _, ch = directory(drain_timeout_s=0.05)
        await d.poll_once()
        h = d.acquire("d0")
        await d.set_addresses("decode", [])
        # The timeout's close runs as its own task: wait for it (a loaded machine can run both
        # timers in one loop iteration, so a fixed sleep longer than the timeout proves nothing).
        deadline = asyncio.get_running_loop().time() + 30
        while ch["d0"].closed == 0 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert ch["d0"].closed == 1 and h.closed and d.draining == []
        d.release(h)  # a late release is harmless
        await asyncio.sleep(0)
        assert ch["d0"].closed == 1 and ch["d1"].closed == 1

    asyncio.run(main())
