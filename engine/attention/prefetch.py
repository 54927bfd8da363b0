"""flashinfer imported on a thread while a worker's weights load from a cold disk
(``PDSERVE_BOOT_PREFETCH``, on by default; only then).

Why only from a cold disk: a load from the page cache is many short stretches of Python between
GIL-free copies, and an import beside it holds the GIL in long stretches; measured on an H200 host, the
~1 s import moved into the load (1.7-1.9 s against 0.8-1.0) and nothing was saved to SERVING
(``boot-variants-h200-2026-11-29-29dfd53-idle.json``). From a cold local disk the load is the disk's
pace instead (~7 s for the 8B shape's 16 GB after the read-ahead's head start): its thread mostly
waits in page faults and copies, with the GIL free, and the import fits into those waits. The worker
knows which case it is in: its read-ahead (``engine.readahead.reading()``) is still reading the
checkpoint from disk when the load starts, or it finished long ago because every chunk was cached.

While the body runs the interpreter's switch interval is 0.1 ms instead of 5 ms, so a stretch of the
load's Python waits at most that long behind the import. The thread is flashinfer_backend's
(``import_in_background``): ``load_flashinfer`` waits for it; an import that failed there is tried
again, and raises, on the caller's thread.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch

from pdserve.settings import env_switch

ENV = "PDSERVE_BOOT_PREFETCH"
_SWITCH_INTERVAL_S = 1e-4


def wanted(name: str, *, device: torch.device | str, dtype: torch.dtype | None, head_dim: int,
           cold: bool) -> bool:
    """Whether to import flashinfer during the load: the disk is being read (``cold``), the switch is on,
    it is not imported yet, and ``get_backend(name, ...)`` would import it (asked for by name, or
    ``auto`` on CUDA for a model it supports)."""
    if not cold or not env_switch(ENV) or "flashinfer" in sys.modules:
        return False
    if name == "flashinfer":
        return True
    from engine.attention import flashinfer_backend as fib

    return (name == "auto" and torch.device(device).type == "cuda" and dtype is not None
            and fib.supports(head_dim=head_dim, dtype=dtype))


@contextlib.contextmanager
def overlapping(on: bool) -> Iterator[None]:
    """With ``on``, import flashinfer on a background thread while the body runs (``wanted`` decides)."""
    if not on:
        yield
        return
    from engine.attention import flashinfer_backend as fib

    fib.import_in_background()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(_SWITCH_INTERVAL_S)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
