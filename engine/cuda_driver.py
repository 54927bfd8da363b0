"""The CUDA driver through ``ctypes`` and file pages mapped for it, with no torch: what
``engine.early_upload`` needs before torch is imported.

``driver()`` wraps the few ``libcuda.so.1`` calls the upload makes, each checked (``DriverError``);
``map_file`` / ``unmap`` map a file read-only and shared (its page-cache pages, to pin with
``cuMemHostRegister``); ``cached`` says whether the page cache holds (nearly) every page of it.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path


class DriverError(RuntimeError):
    pass


class _Driver:
    """The few CUDA driver calls the upload makes, each checked (a non-zero CUresult raises)."""

    _SIGS = {
        "cuInit": (ctypes.c_uint,),
        "cuDeviceGet": (ctypes.POINTER(ctypes.c_int), ctypes.c_int),
        "cuDeviceGetCount": (ctypes.POINTER(ctypes.c_int),),
        "cuDevicePrimaryCtxRetain": (ctypes.POINTER(ctypes.c_void_p), ctypes.c_int),
        "cuDevicePrimaryCtxRelease_v2": (ctypes.c_int,),
        "cuCtxSetCurrent": (ctypes.c_void_p,),
        "cuMemGetInfo_v2": (ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)),
        "cuMemAlloc_v2": (ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t),
        "cuMemFree_v2": (ctypes.c_uint64,),
        "cuMemHostAlloc": (ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint),
        "cuMemFreeHost": (ctypes.c_void_p,),
        "cuStreamCreate": (ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint),
        "cuStreamSynchronize": (ctypes.c_void_p,),
        "cuStreamDestroy_v2": (ctypes.c_void_p,),
        "cuEventCreate": (ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint),
        "cuEventRecord": (ctypes.c_void_p, ctypes.c_void_p),
        "cuEventSynchronize": (ctypes.c_void_p,),
        "cuEventDestroy_v2": (ctypes.c_void_p,),
        "cuMemcpyHtoDAsync_v2": (ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p),
        "cuMemHostRegister_v2": (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint),
        "cuMemHostUnregister": (ctypes.c_void_p,),
    }

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        for name, args in self._SIGS.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int

    def __getattr__(self, name: str):
        fn = getattr(self._lib, name)

        def call(*args):
            rc = fn(*args)
            if rc != 0:
                raise DriverError(f"{name} failed: CUresult {rc}")
        return call


def driver() -> _Driver | None:
    """The CUDA driver, or None where it cannot be loaded (no GPU stack on this host)."""
    try:
        return _Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None


_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                             ctypes.c_long)
        lib.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        _libc = lib
    return _libc


def map_file(path: Path, length: int) -> int:
    """``length`` bytes of ``path`` mapped read-only and shared (its page-cache pages): the address."""
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _c().mmap(None, length, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
    finally:
        os.close(fd)
    if addr in (None, ctypes.c_void_p(-1).value):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {path}: {os.strerror(err)}")
    return addr


def unmap(addr: int, length: int) -> None:
    _c().munmap(ctypes.c_void_p(addr), length)


def cached(path: Path, length: int, page: int = 4096) -> bool:
    """Whether (nearly) every page of the file's first ``length`` bytes is in the page cache."""
    try:
        addr = map_file(path, length)
    except OSError:
        return False
    try:
        pages = -(-length // page)
        vec = (ctypes.c_ubyte * pages)()
        lib = _c()
        lib.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        if lib.mincore(ctypes.c_void_p(addr), length, vec) != 0:
            return False
        resident = sum(b & 1 for b in bytes(vec))
        return resident >= 0.99 * pages
    finally:
        unmap(addr, length)
