"""Checkpoint bytes to the device without a CPU copy of any tensor: memory-mapped views, pinned
staging, several chunks in flight.

``MappedFile(path)`` memory-maps one safetensors file and hands out zero-copy ``torch`` views of its
tensors (the header says where each lives), so nothing is read until it is copied. ``Uploader``
moves such a view to the target device:

* CUDA (``load``): the tensor's bytes are read from the file chunk by chunk (``chunk_bytes``) into one
  of ``num_buffers`` pinned host buffers with ``readers`` parallel ``preadv`` calls per chunk (the
  page-cache / disk read, GIL released), then copied to the GPU with a non-blocking copy on the
  current stream. A buffer is refilled only after the event of its previous copy fired, so while the
  GPU pulls one chunk the host fills the next ones; the dtype conversion runs on the GPU after the
  bytes landed. Reading with ``preadv`` instead of copying from the mapping avoids a page fault per
  4 KiB page (16 GB of an 8B checkpoint: ~4 million), which held the load near one raw read's rate.
  ``to(view)`` does the same from a mapped view (copied by torch's intra-op threads).
* CPU (and any other device): the view is copied once into the destination tensor (dtype converted
  in the same copy): the same path, minus the staging a host target does not need.

Why not ``safe_open(...).get_tensor``: it materialises every tensor in host memory first (a full
CPU copy of the checkpoint over the load) and then ``.to(cuda)`` copies it again from pageable
memory through the driver's own bounce buffer, one synchronous copy at a time.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from engine.errors import ModelLoadError

_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


class MappedFile:
    """One safetensors file, memory-mapped; ``view(name)`` is a zero-copy CPU tensor over its bytes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                self._fd = os.dup(f.fileno())  # for load()'s preadv
            (n,) = struct.unpack("<Q", self._mm[:8])
            header = json.loads(bytes(self._mm[8:8 + n]))
        except (OSError, ValueError, struct.error) as exc:
            raise ModelLoadError(f"cannot read safetensors file {path}: {exc}") from None
        header.pop("__metadata__", None)
        self._base = 8 + n
        self._header = header
        self._buf = memoryview(self._mm)

    def fileno(self) -> int:
        return self._fd

    def span(self, name: str) -> tuple[int, int, torch.dtype, list[int]]:
        """(file offset, bytes, dtype, shape) of a tensor, from the header."""
        meta = self._header[name]
        start, end = meta["data_offsets"]
        if not (0 <= start <= end <= len(self._mm) - self._base):
            raise ModelLoadError(f"{self.path}: tensor {name!r} lies outside the file (truncated?)")
        return self._base + start, end - start, _ST_DTYPES[meta["dtype"]], meta["shape"]

    def view(self, name: str) -> torch.Tensor:
        meta = self._header[name]
        start, end = meta["data_offsets"]
        dtype = _ST_DTYPES[meta["dtype"]]
        raw = self._buf[self._base + start:self._base + end]
        if len(raw) == 0:
            return torch.empty(meta["shape"], dtype=dtype)
        # read-only mapping: torch warns that the tensor is not writable; it is only ever read from
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(raw, dtype=torch.uint8)
        return flat.view(dtype).view(meta["shape"])

    def close(self) -> None:
        self._buf.release()
        self._mm.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> MappedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Uploader:
    """Copies host views to ``device`` (see the module docstring); ``finish()`` waits for the last copy."""

    def __init__(self, device: torch.device, *, chunk_bytes: int = 64 << 20, num_buffers: int = 4,
                 readers: int = 4) -> None:
        self.device = device
        self.staged = device.type == "cuda"
        self.chunk_bytes = chunk_bytes
        self.part_bytes = max(1 << 20, chunk_bytes // max(1, readers))  # one preadv's share of a chunk
        self._buffers: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = []
        self._next = 0
        self._pool = (ThreadPoolExecutor(readers, thread_name_prefix="weights-read")
                      if self.staged and readers > 1 else None)
        if self.staged:
            self._buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True)
                             for _ in range(num_buffers)]
            self._events = [None] * num_buffers

    def load(self, mapped: MappedFile, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor ``name`` of ``mapped`` as a new ``dtype`` tensor on the device: read from the file
        straight into pinned staging (CUDA), or copied from the mapped view (CPU)."""
        if not self.staged:
            return self.to(mapped.view(name), dtype)
        offset, nbytes, src_dtype, shape = mapped.span(name)
        raw = torch.empty(shape, dtype=src_dtype, device=self.device)
        dst_bytes = raw.view(-1).view(torch.uint8)
        for off in range(0, nbytes, self.chunk_bytes):
            n = min(self.chunk_bytes, nbytes - off)
            buf = self._buffer()
            read_into(mapped.fileno(), offset + off, memoryview(buf.numpy())[:n], self._pool,
                      self.part_bytes, mapped.path)
            self._send(dst_bytes[off:off + n], buf[:n])
        return raw if dtype == src_dtype else raw.to(dtype)

    def _buffer(self) -> torch.Tensor:
        """The next pinned buffer, once the GPU has pulled its previous chunk."""
        i = self._next
        if self._events[i] is not None:
            self._events[i].synchronize()
        return self._buffers[i]

    def _send(self, dst: torch.Tensor, buf: torch.Tensor) -> None:
        """Host -> device from the buffer _buffer() returned; records the event that frees it."""
        i = self._next
        self._next = (i + 1) % len(self._buffers)
        dst.copy_(buf, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._events[i] = ev

    def to(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``src`` (a CPU view) as a new ``dtype`` tensor on the device."""
        if not self.staged:
            out = torch.empty(src.shape, dtype=dtype, device=self.device)
            out.copy_(src)
            return out
        raw = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        src_bytes = src.reshape(-1).view(torch.uint8)
        dst_bytes = raw.view(-1).view(torch.uint8)
        for off in range(0, src_bytes.numel(), self.chunk_bytes):
            n = min(self.chunk_bytes, src_bytes.numel() - off)
            buf = self._buffer()[:n]
            buf.copy_(src_bytes[off:off + n])  # the read: page cache / disk -> pinned
            self._send(dst_bytes[off:off + n], buf)
        return raw if dtype == src.dtype else raw.to(dtype)

    def finish(self) -> None:
        for ev in self._events:
            if ev is not None:
                ev.synchronize()
        self._events = [None] * len(self._events)
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def read_into(fd: int, offset: int, dst: memoryview, pool: ThreadPoolExecutor | None, part: int,
              path: Path | str = "?") -> None:
    """Fill ``dst`` with the file's bytes from ``offset``: one ``preadv`` loop per ``part`` bytes, in
    parallel on ``pool`` when there is one (the GIL is released in the syscall)."""

    def one(start: int) -> None:
        view = dst[start:start + part]
        pos = 0
        while pos < len(view):
            got = os.preadv(fd, [view[pos:]], offset + start + pos)
            if got == 0:
                raise ModelLoadError(f"{path}: file ends before its header says (truncated?)")
            pos += got

    starts = range(0, len(dst), part)
    if pool is None or len(starts) < 2:
        for start in starts:
            one(start)
    else:
        for fut in [pool.submit(one, start) for start in starts]:
            fut.result()
