"""``engine.readahead``: the safetensors files of a model directory are read in order, in chunks, on a
daemon thread, up to half of the available memory; chunks already in the page cache (the NOWAIT probe
succeeds) are skipped; off, absent or non-directories start nothing; the module imports no torch
(``pdserve serve`` starts it before the heavy imports)."""

from __future__ import annotations

import os
import subprocess
import sys

from engine import readahead


def _model(tmp_path, sizes):
    for i, size in enumerate(sizes):
        data = bytes(range(256)) * (size // 256) + b"\1" * (size % 256)
        (tmp_path / f"model-{i:05d}.safetensors").write_bytes(data)
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def _run(monkeypatch, path, budget=1 << 62, cached=()):
    """Run the readahead with 100-byte chunks; ``cached``: (file, offset) pairs the probe finds cached.
    Returns the thread and the (file, offset, length) of every full read."""
    reads = []
    real = os.preadv
    monkeypatch.setattr(readahead, "CHUNK", 100)
    monkeypatch.setattr(readahead, "memory_budget", lambda: budget)

    def preadv(fd, buffers, off, flags=0):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if flags & os.RWF_NOWAIT:
            if (name, off) in cached:
                return real(fd, buffers, off)
            raise BlockingIOError("not cached")
        n = real(fd, buffers, off)
        reads.append((name, off, n))
        return n

    monkeypatch.setattr(os, "preadv", preadv)
    thread = readahead.start(path)
    if thread is not None:
        thread.join(10)
        assert thread.daemon and not thread.is_alive()
    return thread, reads


def test_every_file_in_order_in_chunks(monkeypatch, tmp_path):
    thread, reads = _run(monkeypatch, _model(tmp_path, [250, 120]))
    assert thread is not None
    assert reads == [("model-00000.safetensors", 0, 100), ("model-00000.safetensors", 100, 100),
                     ("model-00000.safetensors", 200, 50), ("model-00001.safetensors", 0, 100),
                     ("model-00001.safetensors", 100, 20)]


def test_cached_chunks_are_skipped(monkeypatch, tmp_path):
    cached = {("model-00000.safetensors", 0), ("model-00000.safetensors", 200)}
    _, reads = _run(monkeypatch, _model(tmp_path, [250, 120]), cached=cached)
    assert [(f, off) for f, off, _ in reads] == [
        ("model-00000.safetensors", 100), ("model-00001.safetensors", 0), ("model-00001.safetensors", 100)]


def test_stops_at_the_memory_budget(monkeypatch, tmp_path):
    _, reads = _run(monkeypatch, _model(tmp_path, [250, 120]), budget=230)
    assert [off for _, off, _ in reads] == [0, 100, 200]  # 250 bytes read, then the budget is spent


def test_nothing_when_off_or_no_checkpoint(monkeypatch, tmp_path):
    assert _run(monkeypatch, tmp_path / "missing")[0] is None
    assert _run(monkeypatch, None)[0] is None
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _run(monkeypatch, empty)[0] is None  # no safetensors files
    monkeypatch.setenv(readahead.ENV, "0")
    assert _run(monkeypatch, _model(tmp_path, [10]))[0] is None


def test_real_files_are_read_through(tmp_path):
    """Unpatched: whatever this filesystem answers to the probe, the thread ends without an error."""
    path = _model(tmp_path, [1000])
    thread = readahead.start(path)
    assert thread is not None
    thread.join(10)
    assert not thread.is_alive()


def test_memory_budget_takes_the_smaller_of_host_and_cgroup(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal: 100000 kB\nMemAvailable: 64000 kB\n")
    host = 64000 * 1024
    none = tmp_path / "no-cgroup"
    assert readahead.memory_budget(str(info), str(none)) == host // 2
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{8 << 20}\n")  # a pod limited to 8 MiB, 3 MiB in use
    (v2 / "memory.current").write_text(f"{3 << 20}\n")
    assert readahead.memory_budget(str(info), str(v2)) == (5 << 20) // 2
    (v2 / "memory.max").write_text("max\n")  # no limit: the host's figure
    assert readahead.memory_budget(str(info), str(v2)) == host // 2
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{16 << 20}")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{20 << 20}")  # over: nothing to spare
    assert readahead.memory_budget(str(info), str(v1)) == 0
    assert readahead.memory_budget(str(tmp_path / "none"), str(none)) == 1 << 62


def test_imports_no_torch():
    code = "import sys, engine.readahead; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_reading_while_the_thread_reads_from_disk(monkeypatch, tmp_path):
    """``reading()`` tells the weight load whether the disk is still being read (engine.attention.prefetch
    then overlaps flashinfer's import with it): true while the read-ahead thread runs, false once it is
    done, and false where none was started."""
    import threading

    monkeypatch.setattr(readahead, "_thread", None)
    assert not readahead.reading()
    release = threading.Event()
    monkeypatch.setattr(readahead, "_read_ahead", lambda files, budget: release.wait(10))
    thread = readahead.start(_model(tmp_path, [300]))
    assert thread is not None and readahead.reading()
    release.set()
    thread.join(10)
    assert not readahead.reading()
