"""A checkpoint's bytes on the GPU while the worker is still importing torch (``PDSERVE_EARLY_UPLOAD``,
on by default on CUDA at one GPU per worker; ``pdserve.settings.early_upload_mode``).

Why: a worker's start is ``import torch`` (1.5-2.5 s on an H200 host with bytecode, 4-5 s without:
pdserve/bytecode.py), then the model, then the weight load (0.6-0.9 s for the 8B shape's 16 GB from the
page cache; from a cold disk as long as the read), then flashinfer and the graphs; the load waits for
the imports although it needs none of them. This module needs only the standard library and the CUDA
driver (``libcuda.so.1`` through ``ctypes``), so ``pdserve serve`` starts it before anything else. Its
thread puts every weight file's (``weight_files``) data section into one device arena in one of three
ways, the copies spread over ``threads`` lanes (engine/copy_lanes.py; ``PDSERVE_EARLY_UPLOAD_THREADS``):

* ``read`` (and ``auto``): ``CHUNK`` pieces read into page-locked buffers (``os.preadv``) and copied
  from there, ``NUM_BUFFERS`` in flight a lane. Each call releases the GIL, but each return waits to
  take it back from the imports (up to the 5 ms switch interval), so one lane crawls beside them
  (measured: the upload 5.6-6.4 s for 16 GB, where the files alone read in 2.3-3.1 s); lanes wait for
  the GIL side by side: four lanes put 16 GB from the page cache on the GPU in 2.3-2.5 s beside the
  imports (eight: 2.1 s, but the imports took 0.3-0.6 s longer). ``auto`` reads files not wholly in the
  page cache (``mincore``) in one lane, the way measured from a cold disk; ``read`` reads every file
  in lanes.
* ``mapped``: the file is memory-mapped and its data section handed to the driver as pageable memory,
  ``MAPPED_PIECE`` at a time: the driver stages it through buffers of its own. No page is pinned, but
  the driver's staging does not go faster in lanes: 3.2-3.8 s for 16 GB with one to eight.
* ``register``: the file's pages are pinned where they lie in the page cache (``cuMemHostRegister``,
  read-only) and the data section goes to the device in one copy the GPU pulls from there. Pinning
  16 GB is page-table work under the process's memory-map lock, which every ``mmap`` of ``import
  torch`` waits for (the imports 0.7-1.3 s longer); pinning pages not in memory reads them from the
  disk inside the driver's call (``import torch`` 14-15 s instead of 5).

The weight load (``engine.weights.load_weights``) then finds each tensor's bytes on the device and only
copies them into the parameter there (device to device, the dtype converted on the way), and the arena
is freed before the KV cache is sized.

When it is not used: off (``PDSERVE_EARLY_UPLOAD=0``), the router, a CPU worker, tensor parallel
(each rank loads its slices), a process with torch imported already (a worker forked from the
launcher's zygote, pdserve/app/launcher/zygote.py: there is no import to hide the upload behind, and
measured on an H200 host the upload then stood before the load instead, 2.8-3.5 s from the fork to the
load against ~0.65 s for the plain load), no CUDA driver or device, or too little free device memory for the
arena beside the model (``2 x`` the checkpoint plus ``MARGIN``): the load reads the files as before.
Any error on the way (logged) does the same. The driver's primary context is the one torch's runtime
uses later, so the arena's pointers are valid in torch (``view``).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine import copy_lanes
from engine.cuda_driver import DriverError, _Driver, driver
from engine.cuda_driver import cached as _cached
from engine.cuda_driver import map_file as _map
from engine.cuda_driver import unmap as _unmap
from pdserve.settings import early_upload_mode, early_upload_threads

log = logging.getLogger(__name__)
CHUNK = 64 << 20
NUM_BUFFERS = 2  # page-locked buffers per lane (read)
MAPPED_PIECE = 256 << 20  # bytes per pageable copy (mapped): a GIL round trip and a cancel check each
_READ_ONLY = 0x08  # CU_MEMHOSTREGISTER_READ_ONLY: the mapping is PROT_READ
MARGIN = 4 << 30  # device memory left beside the arena and a second copy of the weights
_ALIGN = 256
_ST_DTYPES = ("F32", "F16", "BF16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL")
_current: EarlyUpload | None = None


@dataclass(frozen=True)
class Placed:
    """One tensor's bytes in the arena: at ``offset`` from its base, ``nbytes`` long."""
    offset: int
    nbytes: int
    dtype: str  # the safetensors name (BF16, F32, ...)
    shape: tuple[int, ...]


@dataclass
class FilePlan:
    path: Path
    data_start: int  # where the file's data section begins (8 + header length)
    size: int  # the data section's bytes
    offset: int  # where it goes in the arena
    tensors: dict[str, Placed] = field(default_factory=dict)


def plan(files: list[Path]) -> tuple[list[FilePlan], int]:
    """Where each file's data section goes in one arena (each at a 256-byte boundary), from the headers
    alone; and the arena's size. Raises ValueError on a file that is not safetensors."""
    plans, total = [], 0
    for path in files:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            size = os.fstat(f.fileno()).st_size - 8 - n
        header.pop("__metadata__", None)
        fp = FilePlan(path=path, data_start=8 + n, size=size, offset=total)
        for name, meta in header.items():
            start, end = meta["data_offsets"]
            if meta["dtype"] not in _ST_DTYPES or not 0 <= start <= end <= size:
                raise ValueError(f"{path}: tensor {name!r} is not one this upload can place")
            fp.tensors[name] = Placed(offset=total + start, nbytes=end - start, dtype=meta["dtype"],
                                      shape=tuple(meta["shape"]))
        plans.append(fp)
        total += -(-size // _ALIGN) * _ALIGN
    return plans, total


class EarlyUpload:
    """The upload of one checkpoint to one device (see the module docstring). ``wait()`` says whether
    the bytes are all there; ``view(file, name)`` is a tensor's bytes as a torch tensor on the device;
    ``release()`` frees the arena (after the last copy out of it completed)."""

    def __init__(self, cuda: _Driver, files: list[Path], device_index: int, mode: str = "auto",
                 threads: int = 1) -> None:
        self.device_index = device_index
        self.threads = threads  # lanes of copies (mapped; read, for the files the page cache holds)
        self.mode = mode  # auto, mapped, register or read (see the module docstring)
        self.method = ""  # the way it went: mapped, register or read, or two of them joined by "+"
        self.files = files
        self.seconds = 0.0
        self.num_bytes = 0
        self.error: str | None = None
        self._cuda = cuda
        self._ctx = ctypes.c_void_p()
        self._base = 0
        self._plans: dict[Path, FilePlan] = {}
        self._done = threading.Event()
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="early-upload", daemon=True)

    def start(self) -> EarlyUpload:
        self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the upload ended (the thread waits in GIL-free calls); True when every byte of
        every file is on the device."""
        self._done.wait(timeout)
        return self._done.is_set() and self.error is None and self._base != 0

    def covers(self, device) -> bool:
        """Whether ``device`` (a torch device) is the one uploaded to."""
        if device.type != "cuda":
            return False
        if device.index is None:
            import torch

            return torch.cuda.current_device() == self.device_index
        return device.index == self.device_index

    def synchronize(self) -> None:
        """Wait for every copy queued on the device (the copies out of the arena among them)."""
        import torch

        torch.cuda.synchronize(self.device_index)

    def placed(self, file: Path, name: str) -> Placed | None:
        fp = self._plans.get(Path(file).resolve())
        return fp.tensors.get(name) if fp is not None else None

    def view(self, file: Path, name: str):
        """The tensor ``name`` of ``file`` as a torch tensor over the arena (valid until ``release``),
        or None when it is not there."""
        import torch

        from engine.weight_upload import _ST_DTYPES as TORCH_DTYPES

        if not self.wait():
            return None
        p = self.placed(file, name)
        if p is None:
            return None
        dtype = TORCH_DTYPES[p.dtype]
        device = f"cuda:{self.device_index}"
        if p.nbytes == 0:
            return torch.empty(p.shape, dtype=dtype, device=device)
        raw = torch.as_tensor(_DeviceBytes(self._base + p.offset, p.nbytes), device=device)
        return raw.view(dtype).view(p.shape)

    def release(self) -> None:
        """Free the arena; the caller has synchronized every copy out of it. Safe to call twice, and
        before the upload ended (it stops at the next piece and frees what it took)."""
        self._cancel.set()
        self._done.wait()
        with self._lock:
            if self._base:
                self._cuda.cuCtxSetCurrent(self._ctx)
                self._cuda.cuMemFree_v2(ctypes.c_uint64(self._base))
                self._base = 0
        global _current
        if _current is self:
            _current = None

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            self._upload()
        except Exception as exc:  # noqa: BLE001 - whatever it was, the load reads the files instead
            self.error = str(exc) or type(exc).__name__
            log.info("early upload not used: %s", exc)
            self._free_arena()
        finally:
            self.seconds = time.monotonic() - t0
            self._done.set()
        if self.error is None and self._base:
            log.info("early upload: %d bytes to cuda:%d in %.2fs (%s)", self.num_bytes, self.device_index,
                     self.seconds, self.method)

    def _upload(self) -> None:
        cuda = self._cuda
        cuda.cuInit(0)
        dev = ctypes.c_int()
        cuda.cuDeviceGet(ctypes.byref(dev), self.device_index)
        cuda.cuDevicePrimaryCtxRetain(ctypes.byref(self._ctx), dev)
        cuda.cuCtxSetCurrent(self._ctx)
        plans, total = plan(self.files)
        free, _total = ctypes.c_size_t(), ctypes.c_size_t()
        cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(_total))
        if free.value < 2 * total + MARGIN:
            raise ValueError(f"{free.value >> 20} MiB free on cuda:{self.device_index}, "
                             f"{(2 * total + MARGIN) >> 20} MiB wanted")
        base = ctypes.c_uint64()
        cuda.cuMemAlloc_v2(ctypes.byref(base), max(total, _ALIGN))
        with self._lock:
            self._base = base.value
        stream = ctypes.c_void_p()
        cuda.cuStreamCreate(ctypes.byref(stream), 1)  # CU_STREAM_NON_BLOCKING
        mapped = plans if self.mode in ("mapped", "register") else []
        pieces = [fp for fp in plans if fp not in mapped]
        # auto: the files the page cache holds in lanes, the others in one lane, the one way measured
        # from a cold disk (docs/gpu.md, "Boot"); read: every file in lanes
        cold = [] if self.mode == "read" else [fp for fp in pieces
                                               if not _cached(fp.path, fp.data_start + fp.size)]
        warm = [fp for fp in pieces if fp not in cold]
        methods = []
        try:
            if mapped and self.mode == "register":
                self._registered(mapped, stream)
                methods.append("register")
            elif mapped:
                self._mapped(mapped, stream)
                methods.append("mapped")
            if warm:
                self._read(warm, stream, self.threads)
                methods.append("read")
            if cold:
                self._read(cold, stream, 1)
                methods.append("read-disk")
            self.method = "+".join(methods)
        finally:
            cuda.cuStreamSynchronize(stream)
            cuda.cuStreamDestroy_v2(stream)
        self._plans = {fp.path: fp for fp in plans}

    def _mapped(self, plans: list[FilePlan], stream: ctypes.c_void_p) -> None:
        """Each file's mapping copied as pageable memory, ``MAPPED_PIECE`` per call, the pieces dealt to
        the lanes; a copy from pageable memory returns once the driver staged its bytes, and every
        lane's stream is synchronized before the mappings go."""
        maps = []
        try:
            for fp in plans:
                length = fp.data_start + fp.size
                maps.append((_map(fp.path, length), length))
            pieces = [(self._base + fp.offset + off, addr + fp.data_start + off,
                       min(MAPPED_PIECE, fp.size - off))
                      for fp, (addr, _length) in zip(plans, maps, strict=True)
                      for off in range(0, fp.size, MAPPED_PIECE)]
            copy_lanes.run(self._cuda, self._ctx, pieces, stream, self._copy_pageable, self.threads,
                           self._cancel, "early-upload")
        finally:
            for addr, length in maps:
                _unmap(addr, length)

    def _copy_pageable(self, pieces: list[tuple[int, int, int]], stream: ctypes.c_void_p, stop) -> None:
        for dst, src, size in pieces:
            if stop():
                raise ValueError("cancelled")
            self._cuda.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(dst), ctypes.c_void_p(src), size, stream)
            with self._lock:
                self.num_bytes += size

    def _registered(self, plans: list[FilePlan], stream: ctypes.c_void_p) -> None:
        """Each file pinned in the page cache and copied in one piece; file k+1 is pinned while file k's
        copy runs, and file k is let go once it is done."""
        cuda, held = self._cuda, []  # (address, length, event) of files pinned, copy queued
        try:
            for fp in plans:
                if self._cancel.is_set():
                    raise ValueError("cancelled")
                length = fp.data_start + fp.size
                addr = _map(fp.path, length)
                ev = ctypes.c_void_p()
                try:
                    cuda.cuMemHostRegister_v2(ctypes.c_void_p(addr), length, _READ_ONLY)
                except BaseException:
                    _unmap(addr, length)
                    raise
                held.append((addr, length, ev))
                cuda.cuEventCreate(ctypes.byref(ev), 2)  # CU_EVENT_DISABLE_TIMING
                if fp.size:
                    cuda.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(self._base + fp.offset),
                                              ctypes.c_void_p(addr + fp.data_start), fp.size, stream)
                cuda.cuEventRecord(ev, stream)
                self.num_bytes += fp.size
                while len(held) > 1:  # the one before is let go once its copy is done
                    self._let_go(*held.pop(0))
            while held:
                self._let_go(*held.pop(0))
        finally:
            if held:  # a failure on the way: nothing may still read those pages
                cuda.cuStreamSynchronize(stream)
                for item in held:
                    self._let_go(*item)

    def _let_go(self, addr: int, length: int, ev: ctypes.c_void_p) -> None:
        if ev.value:
            self._cuda.cuEventSynchronize(ev)
            self._cuda.cuEventDestroy_v2(ev)
        self._cuda.cuMemHostUnregister(ctypes.c_void_p(addr))
        _unmap(addr, length)

    def _read(self, plans: list[FilePlan], stream: ctypes.c_void_p, lanes: int) -> None:
        """Pieces of ``CHUNK`` bytes read (``os.preadv``) into page-locked buffers and copied from there,
        the pieces dealt to ``lanes`` lanes."""
        fds = []
        try:
            for fp in plans:
                fds.append(os.open(fp.path, os.O_RDONLY))
            pieces = [(fd, fp.data_start + off, self._base + fp.offset + off, min(CHUNK, fp.size - off))
                      for fp, fd in zip(plans, fds, strict=True) for off in range(0, fp.size, CHUNK)]
            copy_lanes.run(self._cuda, self._ctx, pieces, stream, self._read_pieces, lanes, self._cancel,
                           "early-upload")
        finally:
            for fd in fds:
                os.close(fd)

    def _read_pieces(self, pieces: list[tuple[int, int, int, int]], stream: ctypes.c_void_p, stop) -> None:
        """One lane's pieces through ``NUM_BUFFERS`` page-locked buffers taken in turn, each reused once
        its last copy is done."""
        cuda, hosts, events = self._cuda, [], []
        try:
            for _ in range(min(NUM_BUFFERS, len(pieces))):
                host, ev = ctypes.c_void_p(), ctypes.c_void_p()
                cuda.cuMemHostAlloc(ctypes.byref(host), CHUNK, 0)
                hosts.append(host)
                cuda.cuEventCreate(ctypes.byref(ev), 2)  # CU_EVENT_DISABLE_TIMING
                events.append(ev)
            views = [memoryview((ctypes.c_char * CHUNK).from_address(h.value)).cast("B") for h in hosts]
            for k, (fd, offset, dst, n) in enumerate(pieces):
                if stop():
                    raise ValueError("cancelled")
                i = k % len(hosts)
                if k >= len(hosts):
                    cuda.cuEventSynchronize(events[i])  # its previous piece has left
                _read_fully(fd, views[i][:n], offset)
                cuda.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(dst), hosts[i], n, stream)
                cuda.cuEventRecord(events[i], stream)
                with self._lock:
                    self.num_bytes += n
            cuda.cuStreamSynchronize(stream)
            for v in views:
                v.release()
        finally:
            cuda.cuStreamSynchronize(stream)
            for ev in events:
                cuda.cuEventDestroy_v2(ev)
            for host in hosts:
                cuda.cuMemFreeHost(host)

    def _free_arena(self) -> None:
        with self._lock:
            if self._base:
                try:
                    self._cuda.cuMemFree_v2(ctypes.c_uint64(self._base))
                except DriverError as exc:
                    log.warning("early upload: freeing its arena failed: %s", exc)
                self._base = 0


class _DeviceBytes:
    """``nbytes`` of device memory at ``ptr`` as a CUDA array (``__cuda_array_interface__``) for torch."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def _read_fully(fd: int, buf: memoryview, offset: int) -> None:
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n <= 0:
            raise OSError(f"short read at offset {offset + got}")
        got += n


def wanted(*, role: str, device: str, tensor_parallel_size: int) -> int | None:
    """The device index to upload to for a worker of these settings, or None (see "When it is not
    used" above; a missing driver or device is found out on the thread)."""
    if early_upload_mode() == "off" or role == "router" or tensor_parallel_size != 1:
        return None
    if "torch" in sys.modules:  # a zygote's child: no import left to hide the upload behind
        return None
    if device in ("auto", "cuda"):
        return 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    return None


def weight_files(model_dir: Path) -> list[Path]:
    """The files the load reads (engine.weights.checkpoint_files): the shards the index names when
    there is one (a directory may hold other ``*.safetensors``, say a consolidated copy, that no
    parameter comes from), else every ``*.safetensors``. Empty on an index it cannot read (the load
    reports that)."""
    index = model_dir / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(model_dir.glob("*.safetensors"))
    try:
        shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        files = sorted(model_dir / str(s) for s in shards)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    return files if all(f.parent == model_dir and f.is_file() for f in files) else []


def start(model_dir: str | os.PathLike | None, device_index: int | None) -> EarlyUpload | None:
    """Begin uploading ``model_dir``'s safetensors files to ``cuda:device_index`` (see the module
    docstring); None when there is nothing to do or no CUDA driver here."""
    global _current
    if device_index is None or not model_dir or not Path(model_dir).is_dir():
        return None
    files = weight_files(Path(model_dir))
    cuda = driver() if files else None
    if cuda is None:
        return None
    _current = EarlyUpload(cuda, [f.resolve() for f in files], device_index, early_upload_mode(),
                           early_upload_threads()).start()
    return _current


def current() -> EarlyUpload | None:
    """This process's upload, while it has not been released."""
    return _current
