"""``engine.readahead``: every safetensors file of a model directory is advised WILLNEED in order, in
chunks, on a daemon thread, up to half of the available memory; off, absent or non-directories
start nothing; the module imports no torch (``pdserve serve`` starts it before the heavy imports)."""

from __future__ import annotations

import os
import subprocess
import sys

from engine import readahead


def _model(tmp_path, sizes):
    for i, size in enumerate(sizes):
        (tmp_path / f"model-{i:05d}.safetensors").write_bytes(b"\0" * size)
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def _run(monkeypatch, path, budget=1 << 62):
    calls = []
    monkeypatch.setattr(readahead, "CHUNK", 100)
    monkeypatch.setattr(readahead, "memory_budget", lambda: budget)
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: calls.append(
        (os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), off, n, advice)))
    thread = readahead.start(path)
    if thread is not None:
        thread.join(10)
        assert thread.daemon and not thread.is_alive()
    return thread, calls


def test_every_file_in_order_in_chunks(monkeypatch, tmp_path):
    path = _model(tmp_path, [250, 120])
    thread, calls = _run(monkeypatch, path)
    assert thread is not None
    assert [(f, off, n) for f, off, n, _ in calls] == [
        ("model-00000.safetensors", 0, 100), ("model-00000.safetensors", 100, 100),
        ("model-00000.safetensors", 200, 50), ("model-00001.safetensors", 0, 100),
        ("model-00001.safetensors", 100, 20)]
    assert {a for *_, a in calls} == {os.POSIX_FADV_WILLNEED}


def test_stops_at_the_memory_budget(monkeypatch, tmp_path):
    _, calls = _run(monkeypatch, _model(tmp_path, [250, 120]), budget=230)
    assert sum(n for _, _, n, _ in calls) == 230 and calls[-1][1:3] == (200, 30)


def test_nothing_when_off_or_no_checkpoint(monkeypatch, tmp_path):
    assert _run(monkeypatch, tmp_path / "missing")[0] is None
    assert _run(monkeypatch, None)[0] is None
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _run(monkeypatch, empty)[0] is None  # no safetensors files
    monkeypatch.setenv(readahead.ENV, "0")
    assert _run(monkeypatch, _model(tmp_path, [10]))[0] is None


def test_memory_budget_reads_meminfo(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal: 100 kB\nMemAvailable: 64 kB\n")
    assert readahead.memory_budget(str(info)) == 32 * 1024
    assert readahead.memory_budget(str(tmp_path / "none")) == 1 << 62


def test_imports_no_torch():
    code = "import sys, engine.readahead; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
