"""Checkpoint bytes to the device without a CPU copy of any tensor: memory-mapped views, pinned
staging, several chunks in flight.

``MappedFile(path)`` memory-maps one safetensors file and hands out zero-copy ``torch`` views of its
tensors (the header says where each lives), so nothing is read until it is copied. ``Uploader``
moves such a view to the target device:

* CUDA: the view is copied chunk by chunk (``chunk_bytes``) into one of ``num_buffers`` pinned host
  buffers -- this copy is the page-cache / disk read, parallel over torch's intra-op threads -- and
  from there to the GPU with a non-blocking copy on the current stream. A buffer is refilled only
  after the event of its previous copy fired, so while the GPU pulls one chunk the host fills the
  next ones; the dtype conversion runs on the GPU after the bytes landed.
* CPU (and any other device): the view is copied once into the destination tensor (dtype converted
  in the same copy): the same path, minus the staging a host target does not need.

Why not ``safe_open(...).get_tensor``: it materialises every tensor in host memory first (a full
CPU copy of the checkpoint over the load) and then ``.to(cuda)`` copies it again from pageable
memory through the driver's own bounce buffer, one synchronous copy at a time.
"""

from __future__ import annotations

import json
import logging
import mmap
import struct
import threading
from pathlib import Path

import torch

from engine.errors import ModelLoadError

_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


log = logging.getLogger(__name__)


class MappedFile:
    """One safetensors file, memory-mapped; ``view(name)`` is a zero-copy CPU tensor over its bytes."""

    def __init__(self, path: Path, *, close_in_background: bool = False) -> None:
        self.path = path
        self.close_in_background = close_in_background  # how ``with`` closes it (``close``)
        try:
            with open(path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            (n,) = struct.unpack("<Q", self._mm[:8])
            header = json.loads(bytes(self._mm[8:8 + n]))
        except (OSError, ValueError, struct.error) as exc:
            raise ModelLoadError(f"cannot read safetensors file {path}: {exc}") from None
        header.pop("__metadata__", None)
        self._base = 8 + n
        self._header = header
        self._buf = memoryview(self._mm)

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

    def close(self, *, background: bool = False) -> None:
        """Unmap the file. ``background``: on a daemon thread -- tearing down the mapping of a 16 GB
        checkpoint takes ~0.3 s of page-table work (an 8B boot, bench/boot_profile.py), and
        ``mmap.close`` releases the GIL meanwhile, so the caller goes on. Every view must be gone: a
        live one makes ``close`` raise BufferError, or the background unmap log a warning and leave
        the mapping in place."""
        self._buf.release()
        if background:
            threading.Thread(target=self._unmap, name="munmap", daemon=True).start()
        else:
            self._mm.close()

    def _unmap(self) -> None:
        try:
            self._mm.close()
        except BufferError:  # a view outlived the load: the mapping stays until the view is gone
            log.warning("%s is still in use: left mapped", self.path)

    def __enter__(self) -> MappedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(background=self.close_in_background)


class Uploader:
    """Copies host views to ``device`` (see the module docstring); ``finish()`` waits for the last copy."""

    def __init__(self, device: torch.device, *, chunk_bytes: int = 64 << 20, num_buffers: int = 4) -> None:
        self.device = device
        self.staged = device.type == "cuda"
        self.chunk_bytes = chunk_bytes
        self._buffers: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = []
        self._next = 0
        if self.staged:
            self._buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True)
                             for _ in range(num_buffers)]
            self._events = [None] * num_buffers

    def to(self, src: torch.Tensor, dtype: torch.dtype, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """``src`` (a CPU view) as a new ``dtype`` tensor on the device, or written into ``out`` (a
        contiguous tensor of ``src``'s shape on the device, in ``dtype``), which is returned."""
        if out is not None and (out.shape != src.shape or out.dtype != dtype or not out.is_contiguous()):
            raise ValueError(f"cannot upload {tuple(src.shape)} {src.dtype} into {tuple(out.shape)} "
                             f"{out.dtype} (contiguous: {out.is_contiguous()})")
        if not self.staged:
            out = torch.empty(src.shape, dtype=dtype, device=self.device) if out is None else out
            out.copy_(src)
            return out
        if out is not None and dtype == src.dtype:
            raw = out  # the bytes land in place
        else:
            raw = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        src_bytes = src.reshape(-1).view(torch.uint8)
        dst_bytes = raw.view(-1).view(torch.uint8)
        for off in range(0, src_bytes.numel(), self.chunk_bytes):
            n = min(self.chunk_bytes, src_bytes.numel() - off)
            i = self._next
            self._next = (i + 1) % len(self._buffers)
            if self._events[i] is not None:
                self._events[i].synchronize()  # the GPU has pulled this buffer's previous chunk
            buf = self._buffers[i][:n]
            buf.copy_(src_bytes[off:off + n])  # the read: page cache / disk -> pinned
            dst_bytes[off:off + n].copy_(buf, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self._events[i] = ev
        if raw is out:
            return out
        if out is not None:
            return out.copy_(raw)  # converted on the device
        return raw if dtype == src.dtype else raw.to(dtype)

    def finish(self) -> None:
        for ev in self._events:
            if ev is not None:
                ev.synchronize()
        self._events = [None] * len(self._events)
