"""The Triton kernels of ``engine.fused_ops`` on CPU, through Triton's interpreter.

``fused_ops_interpreted.py`` holds the checks (each kernel against the torch ops it replaces, bf16
and fp16, decode and prefill-sized shapes, strided k, the tiny model with and without the kernels);
it runs in its own pytest process with ``TRITON_INTERPRET=1``, so no other test sees an interpreted
triton. The same checks on a GPU are ``tests/gpu/test_fused_ops_gpu.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_fused_ops_under_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         str(HERE / "fused_ops_interpreted.py")],
        cwd=HERE.parents[1], env=env, capture_output=True, text=True,
        timeout=540,  # inside pytest-timeout's 600 s, so a hang reports the subprocess's output
    )
    assert proc.returncode == 0, f"{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
