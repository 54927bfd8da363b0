"""``KVTiers``: the host and disk tiers behind one engine's paged KV cache.

Lifecycle of a block's bytes::

    GPU block (hashed, ref 0, cached) ──evicted by an allocation──▶ offload: copied to a host slot
        (one batched gather per allocation; on CUDA on a side stream, the next forward waits only
        for the gather, the device->host copy runs beside it)
    host slot ──evicted by a newer offload──▶ disk file (queued to the disk writer thread)
    host slot / disk file ──a prefix match wants it and it is cheaper than recomputing──▶ onload:
        copied into fresh GPU blocks by the load thread while the engine keeps stepping; the
        request's prompt chunk runs once the load is done, from the first block that failed to
        load if one did (never half a block)

Without a host tier (``host_bytes`` 0) evicted blocks go straight to the disk tier.

The scheduler asks ``lookup`` which tier holds each of a request's next hashes (stopping at the first
miss), ``plan`` (``engine.kv_tiers.cost``) how many of them to load, then ``start_load``; the handle it
gets says when the blocks are written and how many of them are valid. Everything else here is
bookkeeping for the metrics (``stats``) and the leak checks.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace

import torch

from engine.kv_layout import KVLayout
from engine.kv_tiers.config import TierConfig
from engine.kv_tiers.cost import TierCost
from engine.kv_tiers.disk import DiskTier
from engine.kv_tiers.host import HostTier

log = logging.getLogger(__name__)
# Blocks per host->device piece of a CUDA load: its staging area is this many blocks of device memory
# (128 MiB for the llama3-8b shape), allocated from the cache's headroom for the piece's copies.
LOAD_PIECE = 64


@dataclass
class TierStats:
    offloaded_blocks: dict = field(default_factory=lambda: {"host": 0, "disk": 0})
    offloaded_bytes: dict = field(default_factory=lambda: {"host": 0, "disk": 0})
    hit_blocks: dict = field(default_factory=lambda: {"host": 0, "disk": 0})
    loaded_bytes: dict = field(default_factory=lambda: {"host": 0, "disk": 0})
    load_seconds: dict = field(default_factory=lambda: {"host": 0.0, "disk": 0.0})
    load_failures: int = 0  # blocks that failed to load (recomputed)
    declined_blocks: int = 0  # matched in a tier but cheaper to recompute


class LoadHandle:
    """One request's onload: ``done()`` without blocking, ``result()`` the number of leading blocks
    that are now valid in the GPU blocks given to ``start_load``."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> int:
        return self._future.result()


class KVTiers:
    def __init__(self, config: TierConfig, layout: KVLayout, kv_cache: torch.Tensor) -> None:
        if not config.enabled:
            raise ValueError("KVTiers needs a host or a disk tier")
        self.layout = layout
        self.kv_cache = kv_cache  # [layers, num_blocks, 2, block_size, kv_heads, head_dim]
        self.cuda = kv_cache.device.type == "cuda"
        self.block_bytes = layout.num_layers * layout.block_bytes  # one block, every layer
        self.identity = layout.compat_hash()
        self.disk = (DiskTier(config.disk_dir, self.identity, self.block_bytes, config.disk_bytes)
                     if config.disk_dir is not None else None)
        slots = config.host_bytes // self.block_bytes
        if config.host_bytes and slots == 0:
            raise ValueError(f"--kv-host-gb holds not even one block ({config.host_bytes} bytes < "
                             f"{self.block_bytes})")
        self.host = (HostTier(layout, slots, pin_memory=self.cuda, on_evict=self._host_evicted)
                     if slots else None)
        self.cost = TierCost(block_tokens=layout.block_size, block_bytes=self.block_bytes)
        self.stats = TierStats()
        self._stats_lock = threading.Lock()
        self._offload_stream = torch.cuda.Stream(kv_cache.device) if self.cuda else None
        self._load_stream = torch.cuda.Stream(kv_cache.device) if self.cuda else None
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-onload")
        self._loads: set[Future] = set()
        log.info("KV tiers: host %s, disk %s", f"{slots} blocks" if slots else "off",
                 f"{self.disk.capacity_blocks} blocks in {self.disk.dir}" if self.disk else "off")

    # ---- offload ----------------------------------------------------------------------------------
    def offload(self, evicted: list[tuple[int, int]]) -> None:
        """Copy evicted GPU blocks ``(block id, hash)`` to the first tier before they are reused."""
        if self.host is not None:
            self._offload_to_host(evicted)
        elif self.disk is not None:
            for block, block_hash in evicted:
                if block_hash not in self.disk:
                    self._to_disk(block_hash, self.kv_cache[:, block].contiguous())

    def _offload_to_host(self, evicted: list[tuple[int, int]]) -> None:
        targets, spill = [], []
        for block, block_hash in evicted:
            if block_hash in self.host:
                self.host.touch(block_hash)
            elif (slot := self.host.reserve(block_hash)) is not None:
                targets.append((block, block_hash, slot))
            else:  # every slot is being written (a batch larger than the host tier): straight to disk
                spill.append((block, block_hash))
        if spill and self.disk is not None:
            for block, block_hash in spill:
                if block_hash not in self.disk:
                    self._to_disk(block_hash, self.kv_cache[:, block].contiguous())
        if not targets:
            return
        ids = torch.tensor([b for b, _, _ in targets], dtype=torch.int64)
        slots = [s for _, _, s in targets]
        if not self.cuda:
            gathered = self.kv_cache.index_select(1, ids).transpose(0, 1)  # [n, layers, 2, bs, heads, dim]
            self.host.slots[slots] = gathered
            self.host.written(slots)
        else:
            compute = torch.cuda.current_stream(self.kv_cache.device)
            self._offload_stream.wait_stream(compute)
            with torch.cuda.stream(self._offload_stream):
                gathered = self.kv_cache.index_select(1, ids.to(self.kv_cache.device, non_blocking=True))
                gathered = gathered.transpose(0, 1).contiguous()
                gathered_at = torch.cuda.Event()
                gathered_at.record()
                for i, (_, _, slot) in enumerate(targets):
                    self.host.slots[slot].copy_(gathered[i], non_blocking=True)
                copied = torch.cuda.Event()
                copied.record()
            compute.wait_event(gathered_at)  # the blocks' new owners write only after the gather
            self.host.written(slots, copied)
        with self._stats_lock:
            self.stats.offloaded_blocks["host"] += len(targets)
            self.stats.offloaded_bytes["host"] += len(targets) * self.block_bytes

    def _host_evicted(self, block_hash: int, slot: torch.Tensor) -> None:
        if self.disk is not None and block_hash not in self.disk:
            self._to_disk(block_hash, slot)

    def _to_disk(self, block_hash: int, block: torch.Tensor) -> None:
        payload = block.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
        if self.disk.put(block_hash, payload):
            with self._stats_lock:
                self.stats.offloaded_blocks["disk"] += 1
                self.stats.offloaded_bytes["disk"] += len(payload)

    # ---- lookup and onload ------------------------------------------------------------------------
    def lookup(self, hashes: list[int]) -> list[str]:
        """The tier ("host" or "disk") of each leading hash, up to the first one no tier holds."""
        out = []
        for h in hashes:
            if self.host is not None and h in self.host:
                out.append("host")
            elif self.disk is not None and h in self.disk:
                out.append("disk")
            else:
                break
        return out

    def plan(self, hashes: list[int]) -> int:
        """How many leading ``hashes`` to load: those held in a tier, as far as loading beats computing."""
        tiers = self.lookup(hashes)
        n = self.cost.plan(tiers)
        if n < len(tiers):
            with self._stats_lock:
                self.stats.declined_blocks += len(tiers) - n
        return n

    def start_load(self, hashes: list[int], block_ids: list[int]) -> LoadHandle:
        """Copy the blocks of ``hashes`` into GPU blocks ``block_ids`` on the load thread."""
        if len(hashes) != len(block_ids) or not hashes:
            raise ValueError(f"{len(hashes)} hashes for {len(block_ids)} blocks")
        ready = None
        if self.cuda:  # the fresh blocks may still be read by work queued before this call
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.kv_cache.device))
        future = self._loader.submit(self._load, list(hashes), list(block_ids), ready)
        with self._stats_lock:
            self._loads.add(future)
        future.add_done_callback(self._load_done)
        return LoadHandle(future)

    def _load_done(self, future: Future) -> None:
        with self._stats_lock:
            self._loads.discard(future)

    def _pending_loads(self) -> list[Future]:
        with self._stats_lock:
            return list(self._loads)

    def wait_any(self, timeout: float) -> None:
        """Block until some load finishes or ``timeout`` passes (an engine with nothing else to run)."""
        loads = self._pending_loads()
        if loads:
            wait(loads, timeout=timeout, return_when=FIRST_COMPLETED)

    def _load(self, hashes: list[int], block_ids: list[int], ready) -> int:
        """The load thread: the leading blocks' sources (host slots pinned, disk files read and checked),
        up to the first that no tier can give, then their copies into the device cache."""
        shape = self.kv_cache.shape[:1] + self.kv_cache.shape[2:]  # one block: [layers, 2, bs, heads, dim]
        sources, tiers, pinned = [], [], []
        spent = {"host": [0, 0.0], "disk": [0, 0.0]}
        try:
            for block_hash in hashes:
                start = time.perf_counter()
                slot = self.host.pin([block_hash]) if self.host is not None else []
                if slot:
                    pinned += slot
                    sources.append(self.host.slots[slot[0]])
                    tiers.append("host")
                    continue
                payload = self.disk.read(block_hash) if self.disk is not None else None
                if payload is None:
                    with self._stats_lock:
                        self.stats.load_failures += len(hashes) - len(sources)
                    break
                src = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                if self.cuda:
                    src = src.pin_memory()  # the device copy below then runs without the host waiting
                sources.append(src.view(self.kv_cache.dtype).view(shape))
                tiers.append("disk")
                spent["disk"][1] += time.perf_counter() - start
            if sources:
                start = time.perf_counter()
                self._copy_in(sources, block_ids[:len(sources)], ready)
                copy_s = time.perf_counter() - start
                for tier in tiers:  # the copies' time shared out by block
                    spent[tier][0] += self.block_bytes
                    spent[tier][1] += copy_s / len(sources)
        finally:
            if pinned:
                self.host.unpin(pinned)
        with self._stats_lock:
            for tier, (nbytes, seconds) in spent.items():
                if nbytes:
                    self.stats.hit_blocks[tier] += nbytes // self.block_bytes
                    self.stats.loaded_bytes[tier] += nbytes
                    self.stats.load_seconds[tier] += seconds
                    self.cost.record_load(tier, nbytes, seconds)
        return len(sources)

    def _copy_in(self, sources: list[torch.Tensor], block_ids: list[int], ready) -> None:
        """Write ``sources[i]`` (one block each, host memory) into device block ``block_ids[i]``. On CUDA,
        on the load stream after ``ready``: pieces of ``LOAD_PIECE`` blocks, each one host->device copy
        per block into a contiguous staging area and one scatter into the cache, then a wait for all."""
        if not self.cuda:
            for src, block in zip(sources, block_ids, strict=True):
                self.kv_cache[:, block].copy_(src)
            return
        stream = self._load_stream
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            for at in range(0, len(sources), LOAD_PIECE):
                piece = sources[at:at + LOAD_PIECE]
                staging = torch.empty((len(piece), *piece[0].shape), dtype=self.kv_cache.dtype,
                                      device=self.kv_cache.device)
                for i, n, src in _runs(piece, self.host.slots if self.host is not None else None):
                    staging[i:i + n].copy_(src, non_blocking=True)
                ids = torch.tensor(block_ids[at:at + len(piece)], dtype=torch.int64).to(
                    self.kv_cache.device, non_blocking=True)
                self.kv_cache.index_copy_(1, ids, staging.transpose(0, 1))
        stream.synchronize()

    def attach_events(self, events) -> None:
        """Report the tiers' gains and losses to ``events`` (engine.kv_events.KVEvents)."""
        if self.host is not None:
            self.host.events = events
        if self.disk is not None:
            with self.disk.lock:
                self.disk.events = events

    def hashes(self) -> dict[str, list[int]]:
        """What each tier holds, least recently used first."""
        out = {}
        if self.host is not None:
            out["host"] = self.host.hashes()
        if self.disk is not None:
            out["disk"] = self.disk.hashes()
        return out

    # ---- lifecycle --------------------------------------------------------------------------------
    def flush(self) -> None:
        """Wait for queued loads and disk writes (tests, shutdown)."""
        for future in self._pending_loads():
            future.result()
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        self._loader.shutdown(wait=True)
        if self.disk is not None:
            self.disk.close()

    def occupancy(self) -> dict[str, tuple[int, int]]:
        """(bytes used, bytes of capacity) per tier."""
        out = {}
        if self.host is not None:
            out["host"] = (len(self.host) * self.block_bytes, self.host.nbytes)
        if self.disk is not None:
            out["disk"] = (self.disk.nbytes, self.disk.capacity_blocks * self.disk.file_bytes)
        return out

    def leak_report(self) -> str | None:
        loads = self._pending_loads()
        if loads:
            return f"{len(loads)} KV tier loads still running"
        return self.host.leak_report() if self.host is not None else None



def _runs(sources: list[torch.Tensor], slots: torch.Tensor | None):
    """``(start, count, source)`` copies for ``sources``: consecutive host slots (views of ``slots``, one
    after the other in memory, as an offload batch lays them out) as one view and one copy; any other
    source alone. A 2 MiB copy each leaves a tenth of the link's rate to per-copy overheads."""
    i = 0
    stride = slots[0].numel() * slots.element_size() if slots is not None else 0
    while i < len(sources):
        n = 1
        if slots is not None and _in(sources[i], slots):
            while (i + n < len(sources) and _in(sources[i + n], slots)
                   and sources[i + n].data_ptr() == sources[i].data_ptr() + n * stride):
                n += 1
        if n > 1:
            first = (sources[i].data_ptr() - slots.data_ptr()) // stride
            yield i, n, slots[first:first + n]
        else:
            yield i, 1, sources[i].unsqueeze(0)
        i += n


def _in(t: torch.Tensor, slots: torch.Tensor) -> bool:
    start = slots.data_ptr()
    return start <= t.data_ptr() < start + slots.numel() * slots.element_size()


def attach_tiers(config: TierConfig, engine, *, tp=None) -> KVTiers | None:
    """The tiers of ``config`` behind ``engine``'s cache (an ``LLMEngine`` with its block manager,
    scheduler, runner and ``kv_events``), wired in: evictions offload, admissions load, events are
    reported. None when ``config`` sizes none. A host tier sized from the machine (``host_auto``) is
    left out of tensor-parallel workers; one asked for explicitly there is refused."""
    if config.host_auto and tp is not None:
        config = replace(config, host_auto=False)
    config = config.resolved(device_cache_bytes=engine.rank_kv_layout.cache_bytes(engine.num_total_blocks),
                             device_type=engine.device.type)
    if not config.enabled:
        return None
    if tp is not None:
        raise ValueError("KV tiers (--kv-host-gb, --kv-disk-dir) do not support tensor parallelism yet")
    tiers = KVTiers(config, engine.rank_kv_layout, engine.runner.kv_cache)
    engine.block_manager.on_evict = tiers.offload
    engine.scheduler.tiers = tiers
    tiers.attach_events(engine.kv_events)
    return tiers


def cache_snapshot(engine, limit: int) -> tuple[int, dict[str, list[int]]]:
    """What ``engine``'s cache holds by tier (``device``, and ``host`` / ``disk`` with tiers), at most
    the ``limit`` most recently used hashes of each, and the number of the last cache event before it
    (engine.kv_events: apply the events after it on top). Run on the engine thread."""
    last = engine.kv_events.last
    held = {"device": engine.block_manager.hashes()}
    if engine.tiers is not None:
        held.update(engine.tiers.hashes())
    return last, {tier: hashes[-limit:] for tier, hashes in held.items()}
