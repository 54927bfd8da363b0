"""Read a checkpoint into the page cache while the worker is still importing its libraries.

A worker's start reads nothing from its checkpoint until ``torch``, gRPC and the model code are
imported and the model is built (3.4-4.2 s on an H200 host); from a cold local disk the weight load
then takes about as long as reading the files (9.0-10.4 s for the 8B shape against raw reads of
8.3-9.7 s), so the imports and the read add up. Read ahead from the process start, a cold 8B start
took 13.0-13.3 s against 15.5-16.5 s without, rounds alternated in one run (1.57-1.60x the raw cold
read against 1.86-1.98x; docs/gpu.md "Boot").

``start(model_dir)`` reads every ``*.safetensors`` file of the directory, in order, in ``CHUNK``
pieces into one scratch buffer on a daemon thread, from the first moment of ``pdserve serve`` (this
module needs nothing but the standard library, so it starts before torch is imported; reads release
the GIL). The disk then works during the imports, and the load finds what was read in the page cache.
A chunk whose first page is already cached is skipped without a copy (a 4 KiB ``preadv`` with
``RWF_NOWAIT`` probes it), so a warm page cache costs next to nothing; where that probe is not
supported (tmpfs, say) nothing is read ahead. At most half of the memory the page cache can take here
is read (``memory_budget``: the host's ``MemAvailable`` and the container's cgroup limit), so the
beginning of the file is never evicted to read its end before the load gets there.
``PDSERVE_READAHEAD=0`` turns it off. (Asking the kernel with ``posix_fadvise(WILLNEED)`` instead was
measured and did not shorten the cold load.)
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from pdserve.settings import env_switch

log = logging.getLogger(__name__)
ENV = "PDSERVE_READAHEAD"
CHUNK = 16 << 20
_PROBE = 4096
_thread: threading.Thread | None = None  # this process's read-ahead (start)


def start(model_dir: str | os.PathLike | None) -> threading.Thread | None:
    """Begin reading ``model_dir``'s safetensors files ahead (see the module docstring); returns the
    thread, or None when off, not a directory, without safetensors files, or off Linux."""
    if not env_switch(ENV) or not model_dir or not hasattr(os, "RWF_NOWAIT"):
        return None
    path = Path(model_dir)
    if not path.is_dir():
        return None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    global _thread
    budget = memory_budget()
    thread = threading.Thread(target=_read_ahead, args=(files, budget), name="readahead", daemon=True)
    thread.start()
    _thread = thread
    return thread


def reading() -> bool:
    """Whether this process's read-ahead is still reading its checkpoint from disk: the load that
    follows will wait on the disk (engine.attention.prefetch overlaps an import with it). False on a
    warm page cache (every chunk's probe hits at once, so the thread is done within milliseconds), on
    tmpfs, and where nothing was started."""
    return _thread is not None and _thread.is_alive()


def memory_budget(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int:
    """Half of the memory this process can fill with page cache without evicting it again: the host's
    ``MemAvailable``, and the headroom under the container's cgroup memory limit (v2 ``memory.max`` -
    ``memory.current``, or v1 ``memory/memory.limit_in_bytes`` - ``usage_in_bytes``), whichever is
    smaller -- a pod's page cache is charged to its limit (the chart's default for a worker is 8 GiB),
    so reading a 16 GB checkpoint ahead there would evict its own beginning and the load would read
    it twice. Unbounded when neither can be read."""
    room = [_meminfo_available(meminfo)]
    for limit, usage in (("memory.max", "memory.current"),
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        cap, used = _read_int(f"{cgroup}/{limit}"), _read_int(f"{cgroup}/{usage}")
        if cap is not None and used is not None:
            room.append(max(0, cap - used))
            break
    known = [r for r in room if r is not None]
    return min(known) // 2 if known else 1 << 62


def _meminfo_available(path: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: str) -> int | None:
    """An integer file of the cgroup filesystem; None when absent or ``max`` (no limit)."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _read_ahead(files: list[Path], budget: int) -> None:
    done, t0 = 0, time.monotonic()
    buf = bytearray(CHUNK)
    probe = bytearray(_PROBE)
    for file in files:
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:  # the weight load reports an unreadable file
            continue
        try:
            size = os.fstat(fd).st_size
            for off in range(0, size, CHUNK):
                if done >= budget:
                    log.info("readahead stopped at half of the available memory (%d bytes read)", done)
                    return
                try:
                    os.preadv(fd, [probe], off, os.RWF_NOWAIT)
                    continue  # cached already
                except BlockingIOError:
                    pass
                done += os.preadv(fd, [memoryview(buf)[:min(CHUNK, size - off)]], off)
        except OSError as exc:  # no NOWAIT probe here (tmpfs), or a read error the load will report
            log.info("readahead of %s stopped: %s", file, exc)
        finally:
            os.close(fd)
    log.info("readahead read %d bytes in %.2fs", done, time.monotonic() - t0)
