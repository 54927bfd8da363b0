"""``engine.attention.flashinfer_backend.load_flashinfer`` on a stand-in ``flashinfer`` package (CPU).

The real package's ``__init__`` imports nearly all of flashinfer; the backend needs two submodules. The
stand-in records whether its ``__init__`` ran and has a heavy sibling module that only ``__init__``
imports, so the tests see what a lean import skips, that the rest of the package still appears on first
use, and that ``PDSERVE_FLASHINFER_LEAN=0`` or an earlier ``import flashinfer`` keep the whole package.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from engine.attention import flashinfer_backend as fib

INIT = """
import builtins
builtins.FLASHINFER_INIT_RUNS = getattr(builtins, "FLASHINFER_INIT_RUNS", 0) + 1
from . import heavy
from .decode import BatchDecodeWithPagedKVCacheWrapper
from .prefill import BatchPrefillWithPagedKVCacheWrapper
__version__ = "0.0-test"
"""


@pytest.fixture
def fake_flashinfer(tmp_path, monkeypatch):
    pkg = tmp_path / "flashinfer"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(INIT))
    (pkg / "heavy.py").write_text("LOADED = True\n")
    (pkg / "utils.py").write_text("def helper():\n    return 'utils'\n")
    (pkg / "decode.py").write_text("from .utils import helper\nclass BatchDecodeWithPagedKVCacheWrapper:\n"
                                   "    pass\n")
    (pkg / "prefill.py").write_text("from .utils import helper\nclass BatchPrefillWithPagedKVCacheWrapper:\n"
                                    "    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]:
        monkeypatch.delitem(sys.modules, name)
    import builtins

    monkeypatch.setattr(builtins, "FLASHINFER_INIT_RUNS", 0, raising=False)
    yield builtins
    for name in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]:
        del sys.modules[name]


def test_lean_import_skips_the_package_init_until_something_else_is_used(fake_flashinfer):
    fi = fib.load_flashinfer()
    assert fi.BatchDecodeWithPagedKVCacheWrapper.__module__ == "flashinfer.decode"
    assert fi.BatchPrefillWithPagedKVCacheWrapper.__module__ == "flashinfer.prefill"
    assert fake_flashinfer.FLASHINFER_INIT_RUNS == 0
    assert "flashinfer.heavy" not in sys.modules, "what only __init__ imports stays unloaded"
    import flashinfer

    assert flashinfer.__version__ == "0.0-test", "any other attribute runs __init__ then"
    assert fake_flashinfer.FLASHINFER_INIT_RUNS == 1 and flashinfer.heavy.LOADED
    assert flashinfer.BatchDecodeWithPagedKVCacheWrapper is fi.BatchDecodeWithPagedKVCacheWrapper
    with pytest.raises(AttributeError):
        getattr(flashinfer, "no_such_thing")  # noqa: B009
    assert fake_flashinfer.FLASHINFER_INIT_RUNS == 1, "__init__ runs once"
    fib.load_flashinfer()
    assert fake_flashinfer.FLASHINFER_INIT_RUNS == 1


def test_whole_package_when_switched_off_or_already_imported(fake_flashinfer, monkeypatch):
    monkeypatch.setenv(fib.LEAN_IMPORT_ENV, "0")
    fib.load_flashinfer()
    assert fake_flashinfer.FLASHINFER_INIT_RUNS == 1 and "flashinfer.heavy" in sys.modules
    monkeypatch.delenv(fib.LEAN_IMPORT_ENV)
    fib.load_flashinfer()  # already imported whole: used as it is
    assert fake_flashinfer.FLASHINFER_INIT_RUNS == 1


def test_a_failed_lean_import_leaves_nothing_half_imported(fake_flashinfer, tmp_path):
    (tmp_path / "flashinfer" / "prefill.py").write_text("raise ImportError('libcuda.so.1: not found')\n")
    with pytest.raises(ImportError, match="libcuda"):
        fib.load_flashinfer()
    assert not [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]
    assert fib.flashinfer_available() is False


def test_prefetch_is_wanted_only_while_the_disk_is_read_and_flashinfer_would_be_used(monkeypatch):
    from engine.attention import prefetch

    bf16, cuda = torch.bfloat16, torch.device("cuda")
    monkeypatch.delenv(prefetch.ENV, raising=False)
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    assert prefetch.wanted("auto", device=cuda, dtype=bf16, head_dim=128, cold=True)
    assert prefetch.wanted("flashinfer", device="cpu", dtype=None, head_dim=0, cold=True)
    assert not prefetch.wanted("auto", device=cuda, dtype=bf16, head_dim=128, cold=False)  # a warm load
    assert not prefetch.wanted("auto", device="cpu", dtype=bf16, head_dim=128, cold=True)
    assert not prefetch.wanted("auto", device=cuda, dtype=torch.float32, head_dim=128, cold=True)
    assert not prefetch.wanted("torch", device=cuda, dtype=bf16, head_dim=128, cold=True)
    monkeypatch.setenv(prefetch.ENV, "0")
    assert not prefetch.wanted("auto", device=cuda, dtype=bf16, head_dim=128, cold=True)


def test_prefetch_imports_during_the_body_and_load_flashinfer_waits_for_it(fake_flashinfer, monkeypatch):
    """The import runs on its own thread while the body (the weight load) runs, with a short switch
    interval restored afterwards; load_flashinfer waits for that thread instead of importing twice."""
    import threading

    from engine.attention import prefetch

    started, finish, calls = threading.Event(), threading.Event(), []
    real = fib.import_flashinfer

    def slow_import():
        calls.append(threading.current_thread().name)
        started.set()
        finish.wait(10)
        return real()

    monkeypatch.setattr(fib, "import_flashinfer", slow_import)
    interval = sys.getswitchinterval()
    with prefetch.overlapping(True):
        assert started.wait(10) and calls == ["flashinfer-prefetch"]
        assert sys.getswitchinterval() < interval
        finish.set()  # the load's body ends; the import may still be running
    assert sys.getswitchinterval() == interval
    fi = fib.load_flashinfer()  # waits for the prefetch thread, then finds the modules imported
    assert fi.BatchDecodeWithPagedKVCacheWrapper.__module__ == "flashinfer.decode"
    assert calls == ["flashinfer-prefetch", "MainThread"] and fake_flashinfer.FLASHINFER_INIT_RUNS == 0
    with prefetch.overlapping(False):  # off: no thread
        pass
    assert calls == ["flashinfer-prefetch", "MainThread"]
