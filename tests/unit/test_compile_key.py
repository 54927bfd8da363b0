"""engine/compile_key.py: Triton's compiler key computed once per process on a thread, started by
``pdserve serve`` before torch is imported (GPU workers only) or by the fused ops before the load."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from engine import compile_key


@pytest.fixture
def fresh(monkeypatch):
    """No key thread yet, and a fake ``triton_key`` that records the thread it ran on."""
    import triton.runtime.cache

    monkeypatch.setattr(compile_key, "_thread", None)
    calls: list[str] = []
    release = threading.Event()

    def key() -> str:
        calls.append(threading.current_thread().name)
        release.wait(10)
        return "key"

    monkeypatch.setattr(triton.runtime.cache, "triton_key", key)
    return calls, release


def test_one_thread_per_process_whoever_starts_it(fresh):
    calls, release = fresh
    first = compile_key.start()
    assert first is not None and first.daemon and first.name == "triton-key"
    assert compile_key.start() is first  # a second start (say, the load's) joins the first one's work
    from engine import fused_ops

    assert fused_ops.warm_compile_cache() is first
    time.sleep(0.05)
    assert first.is_alive()  # still hashing: join() waits for it
    release.set()
    compile_key.join()
    assert not first.is_alive() and calls == ["triton-key"]


def test_join_without_a_thread_returns_at_once(monkeypatch):
    monkeypatch.setattr(compile_key, "_thread", None)
    compile_key.join()


def test_a_failing_key_ends_the_thread_quietly(monkeypatch):
    import triton.runtime.cache

    monkeypatch.setattr(compile_key, "_thread", None)

    def broken() -> str:
        raise OSError("libtriton.so unreadable")

    monkeypatch.setattr(triton.runtime.cache, "triton_key", broken)
    thread = compile_key.start()
    thread.join(10)
    assert not thread.is_alive()


def test_no_triton_no_thread(monkeypatch):
    monkeypatch.setattr(compile_key, "_thread", None)
    monkeypatch.setattr(compile_key.importlib.util, "find_spec", lambda name: None)
    assert compile_key.start() is None
    compile_key.join()


def test_wanted_only_for_gpu_workers(monkeypatch):
    from engine import cuda_driver

    monkeypatch.setattr(cuda_driver, "driver", lambda: object())
    assert compile_key.wanted(role="decode", device="auto")
    assert compile_key.wanted(role="prefill", device="cuda:1")
    assert compile_key.wanted(role="colocated", device="cuda")
    assert not compile_key.wanted(role="router", device="cuda")
    assert not compile_key.wanted(role="decode", device="cpu")
    monkeypatch.setattr(cuda_driver, "driver", lambda: None)  # no CUDA driver on this host
    assert not compile_key.wanted(role="decode", device="auto")


def test_imports_no_torch():
    """It runs before torch is imported (pdserve serve), so it must not import it itself."""
    code = ("import sys; from engine import compile_key; compile_key.wanted(role='decode', device='auto'); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
