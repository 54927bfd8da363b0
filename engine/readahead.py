"""Read a checkpoint into the page cache while the worker is still importing its libraries.

A worker's start reads nothing from its checkpoint until ``torch``, gRPC and the model code are
imported (3-4 s on an H200 host) and the model is built; the weight load then pulls the files in
through page faults on a memory mapping, in parameter order, a few pages of readahead at a time. From
a cold local disk that read ran at about half the disk's sequential speed (an 8B colocated start:
15.5 s to SERVING against a raw read of the files of 8.1 s, docs/gpu.md "Boot").

``start(model_dir)`` asks the kernel for every ``*.safetensors`` file of the directory, in order, in
``CHUNK`` pieces (``posix_fadvise(POSIX_FADV_WILLNEED)``): the disk then reads sequentially from the
first moment of the process, overlapping the imports, and the load finds its pages cached. It runs on
a daemon thread and needs nothing but the standard library, so ``pdserve serve`` starts it before it
imports torch; the syscalls release the GIL. At most half of ``MemAvailable`` is asked for, so a host
with less memory than the checkpoint never evicts the beginning of the file to read its end before
the load gets there (what is not read ahead is read by the load as before). On a file already in the
page cache, or on tmpfs, it is a cheap no-op. ``PDSERVE_READAHEAD=0`` turns it off.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)
ENV = "PDSERVE_READAHEAD"
CHUNK = 256 << 20


def start(model_dir: str | os.PathLike | None) -> threading.Thread | None:
    """Begin reading ``model_dir``'s safetensors files ahead (see the module docstring); returns the
    thread, or None when off, not a directory, without safetensors files, or without fadvise."""
    if os.environ.get(ENV, "") == "0" or not model_dir or not hasattr(os, "posix_fadvise"):
        return None
    path = Path(model_dir)
    if not path.is_dir():
        return None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    budget = memory_budget()
    thread = threading.Thread(target=_read_ahead, args=(files, budget), name="readahead", daemon=True)
    thread.start()
    return thread


def memory_budget(meminfo: str = "/proc/meminfo") -> int:
    """Half of ``MemAvailable`` in bytes (unbounded when it cannot be read)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 62


def _read_ahead(files: list[Path], budget: int) -> None:
    asked, t0 = 0, time.monotonic()
    for file in files:
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:  # the weight load reports an unreadable file
            continue
        try:
            size = os.fstat(fd).st_size
            for off in range(0, size, CHUNK):
                n = min(CHUNK, size - off, budget - asked)
                if n <= 0:
                    log.info("readahead stopped at half of the available memory (%d bytes)", asked)
                    return
                os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
                asked += n
        except OSError as exc:  # advice only: the load reads the files either way
            log.info("readahead of %s stopped: %s", file, exc)
        finally:
            os.close(fd)
    log.info("readahead asked for %d bytes in %.2fs", asked, time.monotonic() - t0)
