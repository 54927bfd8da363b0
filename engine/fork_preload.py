"""What a zygote (``pdserve/app/launcher/zygote.py``) does for its workers beyond importing torch and
pdserve: the GPU path's own start-up work that needs no GPU, done once before any worker is forked.

- flashinfer's paged-attention modules (``import_flashinfer``, the lean import): ~1-1.5 s of a GPU
  worker's start on an H200 host (docs/gpu.md "Boot");
- Triton's compiler key (``compile_key``): a SHA-256 of ``libtriton.so`` and its sources, ~0.44 s,
  memoised by Triton in the process, so every child has it.

Neither initialises CUDA (the zygote checks that after this runs, and refuses to fork otherwise).
Where a library is not installed, or (for the key) the host has no NVIDIA device, its step is skipped.
"""

from __future__ import annotations

import importlib.util
import os
import time

from engine import compile_key


def preload() -> dict[str, float]:
    """Run each step whose library is installed; seconds per step."""
    took: dict[str, float] = {}
    if importlib.util.find_spec("flashinfer") is not None:
        from engine.attention.flashinfer_backend import import_flashinfer

        t = time.monotonic()
        import_flashinfer()
        took["flashinfer"] = round(time.monotonic() - t, 3)
    # The key is for kernels launched on a GPU: only on a host with an NVIDIA device (the driver itself is
    # not loaded here; the children do that).
    if importlib.util.find_spec("triton") is not None and os.path.exists("/dev/nvidiactl"):
        t = time.monotonic()
        compile_key.compute()
        took["triton_key"] = round(time.monotonic() - t, 3)
    return took
