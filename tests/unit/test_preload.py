"""engine.preload: a worker's background imports of the GPU kernels' libraries (flashinfer, triton)
happen only where CUDA is, and never on --device cpu."""

import subprocess
import sys

import torch

PROBE = """
import sys
from engine import preload
assert preload.start("cpu") is None
thread = preload.start("auto")
thread.join(120)
assert not thread.is_alive()
print("torch" in sys.modules, "triton" in sys.modules)
"""


def test_background_imports_follow_the_device():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=180,
                         check=True)
    torch_seen, triton_seen = out.stdout.split()
    assert torch_seen == "True"
    # triton only where CUDA is (CPU hosts under --device auto use neither flashinfer nor triton)
    assert triton_seen == str(torch.cuda.is_available() and _importable("triton"))


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
