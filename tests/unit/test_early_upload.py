"""``engine.early_upload``: a checkpoint's bytes go to the device while torch is still being imported.

Without a GPU the driver is a fake whose "device memory" is host memory (``FakeDriver``): the thread's
chunking, its page-locked buffers taken in turn (each reused only after its event), the files' data
sections placed at 256-byte boundaries, the memory gate, a failing driver call and ``release`` before
the end all run for real, and every tensor's bytes in the arena are compared with the file's. The
load (``load_weights``) takes its tensors from the arena where the upload covers the device and gives
the same parameters as reading the files; the arena is freed after the load whatever happened. The
module imports no torch (``pdserve serve`` starts it first). The real driver path is in
``tests/gpu/test_early_upload_gpu.py``.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading

import pytest
import torch

from engine import early_upload
from engine.weights import iter_tensors, load_weights


class FakeDriver:
    """The driver calls the upload makes, over host memory; ``fail``: the name of a call that fails."""

    def __init__(self, free: int = 1 << 40, fail: str = "") -> None:
        self.free, self.fail = free, fail
        self.blocks: dict[int, ctypes.Array] = {}  # address -> the buffer behind a device or host allocation
        self.freed: list[int] = []
        self.pending: dict[int, list] = {}  # event -> copies recorded behind it, not yet "done"
        self.queue: list = []  # copies on the stream since the last record
        self.calls: list[str] = []
        self.lock = threading.Lock()  # the mapped way's lanes call from several threads

    def _check(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail:
            raise early_upload.DriverError(f"{name} failed: CUresult 2")

    def _alloc(self, ref, size: int) -> None:
        buf = (ctypes.c_char * size)()
        addr = ctypes.addressof(buf)
        self.blocks[addr] = buf
        ref._obj.value = addr

    def __getattr__(self, name: str):
        def call(*args):
            with self.lock:
                self._call(name, args)
        return call

    def _call(self, name: str, args: tuple) -> None:
        self._check(name)
        if name == "cuMemGetInfo_v2":
            args[0]._obj.value, args[1]._obj.value = self.free, self.free
        elif name in ("cuMemAlloc_v2", "cuMemHostAlloc"):
            self._alloc(args[0], args[1])
        elif name in ("cuStreamCreate", "cuEventCreate", "cuDevicePrimaryCtxRetain"):
            args[0]._obj.value = 0x1000 + len(self.calls)
        elif name == "cuMemcpyHtoDAsync_v2":
            dst, src, n = args[0].value, args[1].value, args[2]
            self.queue.append((dst, bytes((ctypes.c_char * n).from_address(src))))
        elif name == "cuEventRecord":
            self.pending[args[0].value] = self.queue
            self.queue = []
        elif name == "cuEventSynchronize":
            self._land(self.pending.pop(args[0].value, []))
        elif name == "cuStreamSynchronize":  # every copy on the stream, recorded behind an event or not
            for copies in [*self.pending.values(), self.queue]:
                self._land(copies)
            self.pending, self.queue = {}, []
        elif name in ("cuMemFree_v2", "cuMemFreeHost"):
            addr = args[0].value if hasattr(args[0], "value") else args[0]
            self.freed.append(addr)

    def _land(self, copies) -> None:
        for dst, data in copies:
            ctypes.memmove(dst, data, len(data))


def _upload(model, fake, monkeypatch, chunk=4096, mode="auto", threads=1) -> early_upload.EarlyUpload:
    monkeypatch.setattr(early_upload, "CHUNK", chunk)
    monkeypatch.setattr(early_upload, "MAPPED_PIECE", 2 * chunk)
    files = sorted(p.resolve() for p in model.glob("*.safetensors"))
    up = early_upload.EarlyUpload(fake, files, 0, mode, threads).start()
    up.wait(30)
    return up


def _arena_bytes(up: early_upload.EarlyUpload, file, name) -> bytes:
    p = up.placed(file, name)
    return bytes((ctypes.c_char * p.nbytes).from_address(up._base + p.offset)) if p.nbytes else b""


@pytest.mark.parametrize("mode", ["read", "register", "mapped", "auto"])
def test_every_tensor_lands_in_the_arena_byte_exact(make_checkpoint, monkeypatch, mode):
    """read (and auto): many pieces through the page-locked buffers in turn; register: each file pinned
    and copied in one piece, the one before let go once its copy is done; mapped: each file's mapping
    copied in pieces, nothing pinned, nothing page-locked."""
    model = make_checkpoint("llama", max_shard_bytes=200_000)  # several files
    files = sorted(model.glob("*.safetensors"))
    assert len(files) > 1
    fake = FakeDriver()
    # wholly in the page cache, so auto reads them in lanes (said here: the kernel may have reclaimed
    # pages of a checkpoint written minutes ago; the choice itself: the auto test below)
    monkeypatch.setattr(early_upload, "_cached", lambda path, length: True)
    up = _upload(model, fake, monkeypatch, chunk=8192, mode=mode)
    want = "read" if mode == "auto" else mode
    assert up.wait() and up.error is None and up.method == want
    plans, total = early_upload.plan([f.resolve() for f in files])
    assert up.num_bytes == sum(fp.size for fp in plans)
    assert all(fp.offset % 256 == 0 for fp in plans) and total >= up.num_bytes
    copies = fake.calls.count("cuMemcpyHtoDAsync_v2")
    if up.method == "read":
        assert copies > 2 * early_upload.NUM_BUFFERS  # buffers reused
        assert fake.calls.count("cuEventSynchronize") > 0  # each reuse waited for the buffer's last piece
    elif up.method == "register":
        assert copies == len(files) and fake.calls.count("cuMemHostUnregister") == len(files)
    else:
        piece = early_upload.MAPPED_PIECE
        assert copies == sum(-(-fp.size // piece) for fp in plans) > len(files)
        assert "cuMemHostRegister_v2" not in fake.calls and "cuMemHostAlloc" not in fake.calls
    for file in files:
        for name, tensor in iter_tensors_of(file):
            want = tensor.contiguous().view(torch.uint8).numpy().tobytes()
            assert _arena_bytes(up, file, name) == want, name
    hosts = [a for a in fake.blocks if a != up._base]
    assert sorted(fake.freed) == sorted(hosts)  # the page-locked buffers are freed once it is done
    up.release()
    assert up._base == 0 and len(fake.freed) == len(fake.blocks)
    up.release()  # twice is harmless


def test_mapped_lanes_copy_side_by_side_and_one_failing_stops_them_all(make_checkpoint, monkeypatch):
    """The mapped way with 3 lanes: every byte lands, each helper lane had a stream of its own, made
    and destroyed on its thread, and no lane thread outlives the upload; a copy failing in one lane
    ends the upload with that error, every stream destroyed and the arena given back."""
    model = make_checkpoint("llama", max_shard_bytes=200_000)
    files = sorted(model.glob("*.safetensors"))
    fake = FakeDriver()
    up = _upload(model, fake, monkeypatch, chunk=8192, mode="mapped", threads=3)
    assert up.wait() and up.error is None and up.method == "mapped"
    plans, _total = early_upload.plan([f.resolve() for f in files])
    assert up.num_bytes == sum(fp.size for fp in plans)
    assert fake.calls.count("cuMemcpyHtoDAsync_v2") > 3
    assert fake.calls.count("cuStreamCreate") == 3 == fake.calls.count("cuStreamDestroy_v2")
    assert fake.calls.count("cuCtxSetCurrent") >= 3  # each helper made the context current on its thread
    assert not [t for t in threading.enumerate() if t.name.startswith("early-upload-")]
    for file in files:
        for name, tensor in iter_tensors_of(file):
            want = tensor.contiguous().view(torch.uint8).numpy().tobytes()
            assert _arena_bytes(up, file, name) == want, name
    up.release()

    class FailsLater(FakeDriver):
        def _call(self, name: str, args: tuple) -> None:
            if name == "cuMemcpyHtoDAsync_v2" and self.calls.count(name) == 4:
                self.calls.append(name)
                raise early_upload.DriverError("cuMemcpyHtoDAsync_v2 failed: CUresult 700")
            super()._call(name, args)

    fake = FailsLater()
    up = _upload(model, fake, monkeypatch, chunk=8192, mode="mapped", threads=3)
    assert not up.wait() and "CUresult 700" in up.error
    assert up._base == 0 and set(fake.freed) == set(fake.blocks)
    assert fake.calls.count("cuStreamCreate") == fake.calls.count("cuStreamDestroy_v2")
    pieces = sum(-(-fp.size // (2 * 8192)) for fp in plans)
    assert fake.calls.count("cuMemcpyHtoDAsync_v2") < pieces  # the other lanes stopped
    assert not [t for t in threading.enumerate() if t.name.startswith("early-upload-")]


def iter_tensors_of(file):
    from safetensors.torch import load_file

    return load_file(str(file)).items()


def test_too_little_free_memory_or_a_failing_driver_leaves_the_load_to_the_files(make_checkpoint,
                                                                                 monkeypatch):
    model = make_checkpoint("llama")
    small = FakeDriver(free=1 << 20)
    up = _upload(model, small, monkeypatch)
    assert not up.wait() and "MiB wanted" in up.error and "cuMemAlloc_v2" not in small.calls
    assert up.view(next(model.glob("*.safetensors")), "model.norm.weight") is None
    for mode, fail in (("auto", "cuInit"), ("read", "cuMemHostAlloc"), ("read", "cuMemcpyHtoDAsync_v2"),
                       ("register", "cuMemHostRegister_v2"), ("register", "cuMemcpyHtoDAsync_v2"),
                       ("mapped", "cuMemcpyHtoDAsync_v2"), ("auto", "cuMemcpyHtoDAsync_v2")):
        fake = FakeDriver(fail=fail)
        up = _upload(model, fake, monkeypatch, mode=mode)
        assert not up.wait() and fail in up.error
        assert up._base == 0 and set(fake.freed) == set(fake.blocks)  # whatever it took is given back
        assert fake.calls.count("cuMemHostRegister_v2") - (fail == "cuMemHostRegister_v2") \
            == fake.calls.count("cuMemHostUnregister")  # no file left pinned


def test_auto_reads_the_files_the_disk_must_give_in_one_lane(make_checkpoint, monkeypatch):
    model = make_checkpoint("llama", max_shard_bytes=200_000)
    files = sorted(p.resolve() for p in model.glob("*.safetensors"))
    cached = early_upload._cached
    files[0].read_bytes()  # in the page cache now, whatever the kernel reclaimed since it was written
    assert cached(files[0], files[0].stat().st_size) and not cached(files[0].with_name("absent"), 10)
    monkeypatch.setattr(early_upload, "_cached", lambda path, length: path != files[0])
    fake = FakeDriver()
    up = _upload(model, fake, monkeypatch, chunk=8192, mode="auto", threads=3)
    assert up.wait() and up.method == "read+read-disk"
    assert "cuMemHostRegister_v2" not in fake.calls
    assert fake.calls.count("cuStreamCreate") == 3  # the upload's stream and 2 helper lanes (cached files)
    for name, tensor in iter_tensors_of(files[0]):
        assert _arena_bytes(up, files[0], name) == tensor.contiguous().view(torch.uint8).numpy().tobytes()
    up.release()
    fake = FakeDriver()  # read: every file in lanes, the cold one too
    up = _upload(model, fake, monkeypatch, chunk=8192, mode="read", threads=3)
    assert up.wait() and up.method == "read" and fake.calls.count("cuStreamCreate") == 3
    for name, tensor in iter_tensors_of(files[0]):
        assert _arena_bytes(up, files[0], name) == tensor.contiguous().view(torch.uint8).numpy().tobytes()
    up.release()


def test_release_before_the_end_stops_the_upload_and_frees_the_arena(make_checkpoint, monkeypatch):
    model = make_checkpoint("llama")
    fake = FakeDriver()
    gate = threading.Event()
    real = early_upload._read_fully

    def slow_read(fd, buf, offset):
        gate.wait(10)
        real(fd, buf, offset)

    monkeypatch.setattr(early_upload, "_read_fully", slow_read)
    monkeypatch.setattr(early_upload, "CHUNK", 4096)
    up = early_upload.EarlyUpload(fake, sorted(p.resolve() for p in model.glob("*.safetensors")), 0,
                                  "read").start()
    threading.Timer(0.1, gate.set).start()
    up.release()
    assert up._done.is_set() and not up.wait() and up._base == 0
    assert set(fake.freed) == set(fake.blocks)


class CpuUpload:
    """An upload that "covers" the CPU: load_weights' device-copy branch without a GPU."""

    def __init__(self, up: early_upload.EarlyUpload) -> None:
        self.up, self.released, self.synced, self.views = up, False, False, 0

    def covers(self, device) -> bool:
        return device.type == "cpu"

    def view(self, file, name):
        p = self.up.placed(file, name)
        if p is None:
            return None
        self.views += 1
        from engine.weight_upload import _ST_DTYPES

        raw = torch.frombuffer(bytearray(_arena_bytes(self.up, file, name)), dtype=torch.uint8) \
            if p.nbytes else torch.empty(0, dtype=torch.uint8)
        return raw.view(_ST_DTYPES[p.dtype]).view(p.shape)

    def synchronize(self) -> None:
        self.synced = True

    def release(self) -> None:
        self.released = True
        self.up.release()


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_the_load_takes_its_tensors_from_the_arena_and_equals_reading_the_files(make_checkpoint, monkeypatch,
                                                                               dtype):
    from engine.config import ModelConfig
    from engine.model import build_model

    model_dir = make_checkpoint("qwen2")
    config = ModelConfig.from_pretrained(model_dir)
    want = build_model(config, init="meta")
    load_weights(want, model_dir, dtype=dtype, device="cpu")
    fake = CpuUpload(_upload(model_dir, FakeDriver(), monkeypatch))
    monkeypatch.setattr(early_upload, "_current", fake)
    got = build_model(config, init="meta")
    got.allocate_fused(torch.device("cpu"), dtype or config.torch_dtype)  # in place into fused views too
    load_weights(got, model_dir, dtype=dtype, device="cpu")
    assert fake.views == len(list(iter_tensors(model_dir))) - _ignored(model_dir, got)
    assert fake.synced and fake.released
    for (name, a), (_, b) in zip(want.state_dict().items(), got.state_dict().items(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def _ignored(model_dir, module) -> int:
    params = dict(module.named_parameters())
    return sum(1 for name, _ in iter_tensors(model_dir) if name not in params)


def test_wanted_only_for_a_one_gpu_worker_and_no_torch_imported():
    # Before torch is imported (as `pdserve serve` asks), in a fresh interpreter:
    code = ("import os, sys\n"
            "from engine import early_upload as e\n"
            "w = e.wanted\n"
            "assert w(role='decode', device='auto', tensor_parallel_size=1) == 0\n"
            "assert w(role='prefill', device='cuda:3', tensor_parallel_size=1) == 3\n"
            "assert w(role='router', device='auto', tensor_parallel_size=1) is None\n"
            "assert w(role='decode', device='cpu', tensor_parallel_size=1) is None\n"
            "assert w(role='decode', device='auto', tensor_parallel_size=2) is None\n"
            "os.environ['PDSERVE_EARLY_UPLOAD'] = 'off'\n"
            "assert w(role='decode', device='auto', tensor_parallel_size=1) is None\n"
            "assert 'torch' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
    # With torch imported already (this process; a worker forked from the zygote) there is no import
    # for the upload to hide behind: not wanted.
    assert "torch" in sys.modules
    assert early_upload.wanted(role="decode", device="auto", tensor_parallel_size=1) is None


def test_only_the_files_the_index_names_are_uploaded(tmp_path):
    import json

    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "consolidated.safetensors"):
        (tmp_path / name).write_bytes(b"")
    assert len(early_upload.weight_files(tmp_path)) == 3  # no index: every file
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                "b": "model-00002-of-00002.safetensors"}}))
    assert [f.name for f in early_upload.weight_files(tmp_path)] == ["model-00001-of-00002.safetensors",
                                                                    "model-00002-of-00002.safetensors"]
    index.write_text(json.dumps({"weight_map": {"a": "missing.safetensors"}}))
    assert early_upload.weight_files(tmp_path) == []
    index.write_text("not json")
    assert early_upload.weight_files(tmp_path) == []


def test_start_is_none_without_a_driver_or_a_model(tmp_path, monkeypatch):
    monkeypatch.setattr(early_upload, "driver", lambda: None)
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert early_upload.start(tmp_path, 0) is None
    assert early_upload.start(tmp_path / "absent", 0) is None
    assert early_upload.start(tmp_path, None) is None
    assert early_upload.current() is None
