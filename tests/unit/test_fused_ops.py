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


def test_warm_compile_cache_computes_tritons_key_on_a_thread(monkeypatch):
    """``warm_compile_cache`` runs ``triton.runtime.cache.triton_key`` (memoised by Triton) on a daemon
    thread, the process's one (``engine.compile_key``: the one ``pdserve serve`` may have started);
    a Triton without that function warms nothing. ``fused_kernels_for`` keeps CPU and float32 models
    away from triton entirely."""
    import threading

    import pytest
    import torch

    from engine import compile_key, fused_ops
    from engine.model import fused_kernels_for

    if fused_ops.triton is None:
        pytest.fail("triton is a test dependency (pyproject: triton on Linux)")
    monkeypatch.setattr(compile_key, "_thread", None)
    ran_on = []
    monkeypatch.setattr(fused_ops.triton.runtime.cache, "triton_key",
                        lambda: ran_on.append(threading.current_thread().name))
    thread = fused_ops.warm_compile_cache()
    thread.join(10)
    assert ran_on == ["triton-key"] and thread.daemon
    assert fused_ops.warm_compile_cache() is thread and ran_on == ["triton-key"]
    monkeypatch.setattr(compile_key, "_thread", None)
    monkeypatch.delattr(fused_ops.triton.runtime.cache, "triton_key")
    assert fused_ops.warm_compile_cache() is None
    assert fused_kernels_for(torch.device("cpu"), torch.bfloat16) is None
    assert fused_kernels_for(torch.device("cuda"), torch.float32) is None
