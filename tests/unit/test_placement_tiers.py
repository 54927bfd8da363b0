"""The router follows the workers' cache events (engine/kv_events.py) by tier: the prefix index holds what
they report, a snapshot replaces what it knew, and placement values a host-tier hit below a device hit
and far above a miss (the load time of the tier, not a recompute). The directory reads the events on its
GetStats poll and starts over with a snapshot when a worker's incarnation changes."""

from __future__ import annotations

import asyncio

from fake_clock import Clock

from bench.placement_fakes import request, workers
from pdserve.v1 import common_pb2
from router.directory import WorkerDirectory, WorkerHandle
from router.placement import Outcome, Placer, PlacerConfig
from router.state.prefix_index import PrefixIndex


def toks(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 32000 for i in range(n)]


def test_index_follows_tier_events():
    idx = PrefixIndex(1000)
    hs = [11, 12, 13, 14]
    idx.apply("w", "device", True, hs[:2])
    idx.apply("w", "host", True, hs[2:])
    assert idx.match(hs) == {"w": 4} and idx.tier_split("w", hs, 4) == (2, 0)
    idx.apply("w", "device", False, hs[:1])  # evicted from the device...
    assert idx.match(hs) == {} and idx.blocks_of("w") == 3  # ...and held nowhere else: the chain breaks
    idx.apply("w", "disk", True, hs[:1])
    assert idx.match(hs) == {"w": 4} and idx.tier_split("w", hs, 4) == (2, 1)
    idx.apply("w", "host", True, hs[1:2])  # offloaded while still on the device: device counts
    assert idx.tier_split("w", hs, 4) == (2, 1)
    idx.apply("w", "host", False, hs)
    assert idx.match(hs) == {"w": 2} and idx.blocks_of("w") == 2  # disk hs[0] + device hs[1]


def test_placement_prefers_device_over_host_over_nothing():
    """On the prefill side a tier hit saves the prompt's compute: host far above nothing, below
    device. On the decode side it saves the transfer and costs its load: device above host."""
    clock = Clock(1000.0)
    pl = Placer(PlacerConfig(policy="prefix_only"), clock=clock, wall=clock)
    pl.update_workers(workers(2, 2))
    req = request("r", toks(4096))  # 256 blocks
    hashes = req.block_hashes
    pl.apply_cache_events("p0", snapshot=True, batches=[("host", True, hashes)])
    first = pl.place(req)
    assert first.prefill.worker_id == "p0" and first.predicted_prefill_cached_blocks == 256
    pl.on_result(req, first, Outcome(success=True))
    pl.apply_cache_events("p0", snapshot=True, batches=[("host", True, hashes)])
    pl.apply_cache_events("p1", snapshot=True, batches=[("device", True, hashes)])
    pl.apply_cache_events("d0", snapshot=True, batches=[("host", True, hashes)])
    pl.apply_cache_events("d1", snapshot=True, batches=[("device", True, hashes)])
    req2 = request("r2", toks(4096))
    second = pl.place(req2)
    assert (second.prefill.worker_id, second.decode.worker_id) == ("p1", "d1")
    pl.on_result(req2, second, Outcome(success=True))
    assert pl.inflight_total == 0


def test_a_snapshot_replaces_what_the_index_knew_and_keeps_device_blocks_longest():
    pl = Placer(PlacerConfig(policy="prefix_only", index_blocks_per_worker=4))
    pl.update_workers(workers(1, 1))
    pl.index.add("d0", [1, 2, 3])  # an optimistic guess
    pl.apply_cache_events("d0", snapshot=True, batches=[
        ("device", True, [10, 11]), ("host", True, [20, 21]), ("disk", True, [30, 31])])
    # capacity 4: the disk blocks, stamped first, are the ones the index let go
    assert pl.index.match([1]) == {} and pl.index.blocks_of("d0") == 4
    assert pl.index.match([10, 11]) == {"d0": 2} and pl.index.match([30]) == {}


class EventStub:
    """A worker's GetStats with cache events, answering what a real worker's log would."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id, self.incarnation, self.log = worker_id, "i1", []  # [(tier, stored, hashes)]
        self.asked: list[tuple[bool, int]] = []

    async def GetStats(self, request, timeout=None):
        self.asked.append((request.cache_events, request.cache_events_after))
        stats = common_pb2.WorkerStats(worker_id=self.worker_id, role="decode", incarnation=self.incarnation,
                                       free_blocks=10, total_blocks=10)
        after = request.cache_events_after
        if after == 0:  # a snapshot: everything held now
            held: dict[str, set] = {"device": set(), "host": set()}
            for tier, stored, hashes in self.log:
                (held[tier].update if stored else held[tier].difference_update)(hashes)
            stats.cache.snapshot = True
            for tier, hs in held.items():
                if hs:
                    stats.cache.batches.add(tier=tier, stored=True, hashes=sorted(hs))
        else:
            for tier, stored, hashes in self.log[after:]:
                stats.cache.batches.add(tier=tier, stored=stored, hashes=hashes)
        stats.cache.last = len(self.log)
        return stats


class FakeChannel:
    async def close(self, grace=None) -> None:
        pass


def test_directory_applies_events_and_starts_over_on_a_new_incarnation():
    async def main():
        placer = Placer(PlacerConfig(policy="prefix_only"))
        d = WorkerDirectory(placer, interval=60)
        stub = EventStub("d0")
        stub.log = [("device", True, [1, 2])]
        d._by_addr["d0:1"] = WorkerHandle(address="d0:1", role="decode", channel=FakeChannel(), stub=stub)
        await d.poll_once()
        assert placer.index.match([1, 2]) == {"d0": 2} and stub.asked == [(True, 0)]
        stub.log += [("host", True, [1]), ("device", False, [1]), ("device", True, [3])]
        await d.poll_once()
        assert stub.asked[-1] == (True, 1)
        assert placer.index.match([1, 2, 3]) == {"d0": 3}
        assert placer.index.tier_split("d0", [1, 2], 2) == (1, 0)
        # the worker restarts: its new log numbers start again; the directory asks for a snapshot
        stub.incarnation, stub.log = "i2", [("device", True, [7]), ("device", True, [8])]
        await d.poll_once()  # answered with events numbered by the new log: not applied, start over
        assert placer.index.match([7]) == {}
        await d.poll_once()
        assert stub.asked[-1] == (True, 0) and placer.index.match([7]) == {"d0": 1}
        assert placer.index.match([1]) == {}  # what the old incarnation held is gone
        await d.close()

    asyncio.run(main())
