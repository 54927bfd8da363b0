"""What a zygote (``pdserve/app/launcher/zygote.py``) does for its workers beyond importing torch and
pdserve: the GPU path's own start-up work that needs no GPU, done once before any worker is forked.

- Triton's compiler key (``compile_key``): a SHA-256 of ``libtriton.so`` and its sources, ~0.44-0.65 s
  on an H200 host, memoised by Triton in the process, so every child has it.

Not flashinfer: importing ``flashinfer.jit`` (under the lean import of its attention modules) initialises
CUDA in the importing process, measured on an H200 host (a child forked after it fails "Cannot
re-initialize CUDA in forked subprocess", and ``cuInit`` returns CUDA_ERROR_NOT_INITIALIZED there). Each
worker imports it itself (~1.2 s there). The zygote checks in a probe child that its preloads left CUDA
usable, and refuses to fork otherwise.
Where Triton is not installed, or the host has no NVIDIA device, the step is skipped.
"""

from __future__ import annotations

import importlib.util
import os
import time

from engine import compile_key


def preload() -> dict[str, float]:
    """Run each step whose library is installed; seconds per step."""
    took: dict[str, float] = {}
    # The key is for kernels launched on a GPU: only on a host with an NVIDIA device (the driver itself is
    # not loaded here; the children do that).
    if importlib.util.find_spec("triton") is not None and os.path.exists("/dev/nvidiactl"):
        t = time.monotonic()
        compile_key.compute()
        took["triton_key"] = round(time.monotonic() - t, 3)
    return took
