"""Import the GPU kernels' libraries on a background thread while a worker starts.

A worker on a GPU imports ``flashinfer`` (~2.5-2.8 s on an H200 host, bench/boot_profile.py) and
``triton`` (the fused norm kernels, engine/fused_ops.py) only once its model is built and its weights
are loaded, one after the other. Started first thing in ``pdserve serve``, this thread imports them
(and torch, which they need) while the main thread imports gRPC and the services, starts the server and
loads the weights (I/O and copies, mostly without the GIL); the engine's own imports then find the
modules done, or wait for this thread to finish them. Nothing here is required: an import that fails
is left for the engine to raise (or to fall back from) where it always did.

Only third-party modules are imported here, never ours, so the two threads cannot wait on each other's
half-imported modules in a cycle (Python's per-module import locks).
"""

from __future__ import annotations

import importlib
import threading

MODULES = ("torch", "flashinfer", "triton")


def start(device: str) -> threading.Thread | None:
    """Begin the imports (not on ``device="cpu"``, which uses neither library); returns the thread."""
    if device == "cpu":
        return None
    thread = threading.Thread(target=_run, name="preload-imports", daemon=True)
    thread.start()
    return thread


def _run() -> None:
    try:
        torch = importlib.import_module("torch")
        if not torch.cuda.is_available():  # a CPU host under --device auto: neither library is used
            return
    except Exception:  # noqa: BLE001 (the engine reports a broken torch where it always did)
        return
    for name in MODULES[1:]:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 (absent or broken: the engine reports it, or falls back)
            continue
