"""The registered KV tensor seen as bytes: offsets, zero-copy host views, staging for device memory.

Host (CPU) tensors are read and written in place through a memoryview of their storage, so the TCP
path receives straight into the destination blocks (``recv_into``) and sends straight from the
source blocks (``sendmsg``). Device (CUDA) tensors cannot be handed to a socket; the TCP path stages
them through host buffers (one copy each way). NIXL reads/writes device memory directly (VRAM).

Staging device memory (the TCP fallback between GPUs), per DATA frame (<= max_frame_bytes):

    send   stage_out(segments)   one page-locked buffer for the whole frame, filled by asynchronous
                                 device->host copies of its coalesced runs on a side stream (ordered after
                                 the caller's current stream); await ready(event) before the bytes are
                                 read -- the sender stages frame i+1 while frame i is on the socket
    recv   recv_views(segments)  one page-locked buffer the socket is read into
           flush(segments, buf)  asynchronous host->device copies on the side stream: the next frame is
                                 read while they run; returns the event after them: the receiver completes
                                 a request (END) once every one of its frames' events is done, awaited
                                 off the loop

Any thread may stage (TransportConfig.tcp_lane_staging: each connection's I/O threads stage their own
frames). Frames of one request flushed by different threads reach the side stream in any order, so a
request waits for the events of all its frames, not for the last one it was told of.

A frame's blocks are scattered over the cache (free lists fragment as requests come and go: a 2k-token
prompt's 128 blocks may be dozens of runs). A frame of more than ``_COPY_MAX_SEGMENTS`` runs moves with
a constant number of CUDA calls, however many runs it has: send gathers its rows on the device
(``index_select``) and copies them to the host in one piece; receive copies the payload to the device in
one piece and scatters it (``index_copy_``). A frame of a few runs is copied run by run: as few calls,
and only the copy engines, not the SMs the engine computes on. Every torch call releases the GIL and
takes it back; one call per run cost the event loop a hand-off per run beside a busy engine thread, and
past capacity that made the loop, not the socket, the KV plane's limit (py-spy of a decode worker at
18 req/s: its loop thread 99.5% busy, a third of it waiting on a lock in per-run copies;
bench/overload_profile.sh, docs/kvtransfer.md "Staged frames").

Page-locked buffers come from torch's caching host allocator (pin_memory=True): a buffer is reused
only once the copies recorded on it have finished, so nothing here frees or recycles them by hand.
The device-side gather/scatter buffers come from torch's caching device allocator on the side
stream, where every later use is ordered after the copies that read them.
"""

from __future__ import annotations

import asyncio
import threading

import torch

from engine.kv_layout import KVLayout

from .errors import InvalidTransfer

# A staged frame of at most this many segments is copied segment by segment (copy engines only, no
# kernel on the SMs the engine computes on; as few CUDA calls as a gather takes); more: gather/scatter.
_COPY_MAX_SEGMENTS = 4


class KVMemory:
    def __init__(self, tensor: torch.Tensor, layout: KVLayout, *, force_staging: bool = False,
                 blocking_sync: bool = True, gather: bool = True) -> None:
        if tensor.dim() != 6:
            raise InvalidTransfer(f"KV tensor must be 6-D {layout.cache_shape(0)}, "
                                  f"got shape {tuple(tensor.shape)}")
        num_blocks = int(tensor.shape[1])
        if tuple(tensor.shape) != layout.cache_shape(num_blocks):
            raise InvalidTransfer(f"KV tensor shape {tuple(tensor.shape)} does not match layout "
                                  f"{layout.cache_shape(num_blocks)} ({layout.describe()})")
        if tensor.dtype != layout.torch_dtype:
            raise InvalidTransfer(f"KV tensor dtype {tensor.dtype} but layout says {layout.dtype}")
        if not tensor.is_contiguous():
            raise InvalidTransfer("KV tensor must be contiguous")
        if tensor.device.type != layout.memory:
            raise InvalidTransfer(f"KV tensor on {tensor.device} but layout memory is {layout.memory!r}")
        self.tensor = tensor
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_bytes = layout.block_bytes
        self.nbytes = layout.cache_bytes(num_blocks)
        self.device = tensor.device
        self.is_host = tensor.device.type == "cpu"
        self.staged = force_staging or not self.is_host
        # Same storage, viewed as flat bytes (works for bf16, which numpy cannot represent).
        self._flat = tensor.view(-1).view(torch.uint8)
        self._host = memoryview(self._flat.numpy()) if self.is_host else None
        # The cache as rows of one block of one layer (row = offset // block_bytes) in the widest integer
        # type the block size allows: what a frame's gather and scatter index.
        width = next(w for w in (8, 4, 2, 1) if self.block_bytes % w == 0)
        dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[width]
        self._table = self._flat.view(dtype).view(-1, self.block_bytes // width)
        self._blocking_sync = blocking_sync  # staging events sleep in synchronize() instead of spinning
        self._stream = None  # side stream for staging copies (device memory), made on first use
        self._stream_lock = threading.Lock()  # staging may start on any thread
        self._gather_runs = gather  # False: one copy per segment (TransportConfig.staging_gather)

    @property
    def base_address(self) -> int:
        return self.tensor.data_ptr()

    @property
    def device_id(self) -> int:
        return 0 if self.is_host else (self.device.index or 0)

    @property
    def nixl_mem_type(self) -> str:
        return "DRAM" if self.is_host else "VRAM"

    def offset(self, layer: int, block: int) -> int:
        return (layer * self.num_blocks + block) * self.block_bytes

    def _side_stream(self):
        """The staging copies' stream, at the highest priority, so a gather or scatter kernel takes the
        next free SM slot ahead of the engine's queued blocks. While serving, a default-priority gather
        (of every multi-run frame) staged a frame in 3.9 ms at p50 against 1.3 ms for per-run copies.
        With this priority and per-run copies up to _COPY_MAX_SEGMENTS: 1.7 vs 1.9 ms."""
        with self._stream_lock:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=self.device, priority=-1)
        return self._stream

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=not self.is_host)

    def stage_out(self, segments: list[tuple[int, int, int]]) -> tuple[list[memoryview], object | None]:
        """Views of the segments' bytes and the CUDA event after which they may be read (None: now).
        Host memory: zero-copy views. Staged: one host buffer for all segments (see the module doc)."""
        if not self.staged:
            return [self._host[off:off + n] for off, n, _ in segments], None
        buf = self._host_buffer(sum(n for _, n, _ in segments))
        if self.is_host:  # force_staging on a host tensor (tests the staged path): the same gather
            self._gather(segments, buf)
            return self._split(memoryview(buf.numpy()), segments), None
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))  # after the KV was written
        with torch.cuda.stream(stream):  # (also makes the stream's device current)
            self._gather(segments, buf)
            event = torch.cuda.Event(blocking=self._blocking_sync)
            event.record(stream)
        return self._split(memoryview(buf.numpy()), segments), event

    def _rows(self, segments) -> torch.Tensor:
        """The segments' row numbers of ``_table`` in order (host memory, page-locked when the cache is
        on a device: its copy there is asynchronous)."""
        bb = self.block_bytes
        rows = [r for off, n, _ in segments for r in range(off // bb, (off + n) // bb)]
        return torch.tensor(rows, dtype=torch.int64, pin_memory=not self.is_host)

    def _gather(self, segments, buf: torch.Tensor) -> None:
        """``buf`` (host) <- the segments' bytes in order: a copy per segment for a few of them, else one
        gather of all their rows and one copy (on the current stream when the cache is on a device)."""
        if len(segments) <= _COPY_MAX_SEGMENTS or not self._gather_runs:
            pos = 0
            for off, n, _ in segments:
                buf[pos:pos + n].copy_(self._flat[off:off + n], non_blocking=not self.is_host)
                pos += n
            return
        table, rows = self._table, self._rows(segments)
        if not self.is_host:
            rows = rows.to(self.device, non_blocking=True)
        picked = table.index_select(0, rows)
        buf.view(table.dtype).view(picked.shape).copy_(picked, non_blocking=not self.is_host)

    def _scatter(self, segments, src: torch.Tensor) -> None:
        """The segments' bytes <- ``src`` (host) in order: the mirror of ``_gather``."""
        if len(segments) <= _COPY_MAX_SEGMENTS or not self._gather_runs:
            pos = 0
            for off, n, _ in segments:
                self._flat[off:off + n].copy_(src[pos:pos + n], non_blocking=not self.is_host)
                pos += n
            return
        table, rows = self._table, self._rows(segments)
        src = src.view(table.dtype).view(len(rows), table.shape[1])
        if not self.is_host:
            rows = rows.to(self.device, non_blocking=True)
            src = src.to(self.device, non_blocking=True)
        table.index_copy_(0, rows, src)

    @staticmethod
    async def ready(event) -> None:
        """Wait (off the event loop) for a stage_out or flush event (None: nothing to wait for)."""
        await KVMemory.all_ready([event] if event is not None else [])

    @staticmethod
    async def all_ready(events: list) -> None:
        """Wait (off the event loop) for every one of these events."""
        pending = [e for e in events if not e.query()]
        if pending:
            await asyncio.to_thread(lambda: [e.synchronize() for e in pending])

    @staticmethod
    def _split(view: memoryview, segments) -> list[memoryview]:
        views, pos = [], 0
        for _, n, _ in segments:
            views.append(view[pos:pos + n])
            pos += n
        return views

    def recv_views(self, segments: list[tuple[int, int, int]]) -> tuple[list[memoryview], object | None]:
        """Writable buffers for incoming segments; a staging buffer to flush() afterwards when staged."""
        if not self.staged:
            return [self._host[off:off + n] for off, n, _ in segments], None
        staging = self._host_buffer(sum(n for _, n, _ in segments))
        return self._split(memoryview(staging.numpy()), segments), staging

    def flush(self, segments: list[tuple[int, int, int]], staging):
        """Copy a staged payload into the tensor: device memory asynchronously (returns the CUDA event
        after the copies; stream order: it also follows every earlier flush), a host tensor
        (force_staging) at once (returns None)."""
        src = staging if isinstance(staging, torch.Tensor) else torch.frombuffer(staging, dtype=torch.uint8)
        if self.is_host:
            self._scatter(segments, src)
            return None
        stream = self._side_stream()
        with torch.cuda.stream(stream):  # (also makes the stream's device current)
            self._scatter(segments, src)
            event = torch.cuda.Event(blocking=self._blocking_sync)
            event.record(stream)
        return event
