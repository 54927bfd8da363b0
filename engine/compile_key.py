"""Triton's compiler key, computed on a thread from a GPU worker's first moment (no torch needed).

The first kernel a process launches looks its binary up in Triton's cache under a key that includes
``triton.runtime.cache.triton_key()``: a SHA-256 of Triton's compiler sources and of ``libtriton.so``
(~500 MB), computed once per process and memoised by Triton. That is ~0.44 s on an H200 host, on
the critical path of the first CUDA-graph capture unless it ran earlier. Begun just before the
weight load (``engine.fused_ops.warm_compile_cache``), it hid behind the load's ~1 s; with the
early upload (``engine/early_upload.py``) the load from the page cache takes ~0.05 s, so the key
would stand between the load and the KV cache again.

So ``pdserve serve`` starts it beside the early upload, before torch is imported: the key needs
only ``triton`` (which does not import torch), and its file reads and hashing release the GIL, so it
runs beside ``import torch`` (3-4 s there) at the cost of the ~0.1 s of Triton's own imports.
``start()`` returns the one thread of this process that computes it, whoever started it first;
``ModelRunner`` waits for it (``join``) before any step can launch, since a launch that finds the key
still being computed computes it a second time (Triton's memo has no lock).
"""

from __future__ import annotations

import importlib.util
import logging
import threading

log = logging.getLogger(__name__)

_lock = threading.Lock()
_thread: threading.Thread | None = None


def compute() -> None:
    """The key, on this thread (memoised by Triton: later calls in this process, or in a child forked
    after it, return at once)."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # a Triton without it: the first launch computes what it needs
        return
    try:
        triton_key()
    except Exception as exc:  # noqa: BLE001 - the first launch computes it again and reports
        log.debug("Triton's compiler key not computed ahead: %s", exc)


def start() -> threading.Thread | None:
    """This process's key thread, started now unless it already was; None without Triton."""
    global _thread
    with _lock:
        if _thread is None:
            if importlib.util.find_spec("triton") is None:
                return None
            _thread = threading.Thread(target=compute, name="triton-key", daemon=True)
            _thread.start()
        return _thread


def wanted(*, role: str, device: str) -> bool:
    """Whether a ``pdserve serve`` of these settings will launch Triton kernels on a GPU: a worker role
    on a CUDA device (``auto`` counts when this host has a CUDA driver). A CPU worker never does, and
    would only pay the key's seconds of hashing."""
    if role == "router" or not (device in ("auto", "cuda") or device.startswith("cuda:")):
        return False
    from engine.cuda_driver import driver

    return driver() is not None


def join() -> None:
    """Wait for the key thread if one was started (at once when it is done or none was)."""
    thread = _thread
    if thread is not None:
        thread.join()
