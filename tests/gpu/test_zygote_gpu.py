"""Workers forked from a zygote on a GPU host (pdserve/app/launcher/zygote.py, engine/fork_preload.py).

The zygote imports torch and pdserve and computes Triton's compiler key, without initialising CUDA (a
probe child checks it); a colocated worker forked from it on the GPU (bf16: flashinfer and the
CUDA graphs) answers greedy requests token-identically to one started as a fresh interpreter, and its
own boot record starts at the fork.
"""

from __future__ import annotations

import os

import grpc
import pytest

from pdserve.app.launcher.procs import spawn
from pdserve.app.launcher.zygote import Zygote, ZygoteUnusable
from pdserve.client import Client
from pdserve.settings import environ
from pdserve.v1 import process_pb2, process_pb2_grpc

ENV = {"PYTEST_CURRENT_TEST": ""}  # pytest changes it per phase: held fixed for zygote and children


def _greedy(address: str) -> list[list[int]]:
    with Client(address) as c:
        return [c.generate(prompt_ids=[3 + i, 7, 11, 13 + i, 17], max_tokens=24, temperature=0.0,
                           ignore_eos=True).token_ids for i in range(3)]


def _boot(address: str):
    with grpc.insecure_channel(address) as ch:
        return process_pb2_grpc.ProcessStub(ch).GetProcessStats(process_pb2.ProcessStatsRequest(), timeout=10)


def test_flashinfer_imported_in_a_zygote_is_refused(tmp_path):
    # Its import initialises CUDA (the probe child finds the fork poisoned): the launcher then starts
    # plain processes rather than workers that fail at their first CUDA call.
    with pytest.raises(ZygoteUnusable, match="CUDA was initialised by an import|an import initialised CUDA"):
        Zygote.start({**environ(), **ENV}, preload=("torch", "flashinfer.jit"))


def test_a_worker_forked_on_the_gpu_serves_like_a_fresh_one(make_checkpoint, tmp_path):
    model = make_checkpoint(preset="small", dtype="bfloat16")
    z = Zygote.start({**environ(), **ENV}, log_path=tmp_path / "zygote.log")
    try:
        assert {"torch", "triton_key"} <= set(z.ready["modules"]), z.ready
        args = ["--model", str(model), "--device", "cuda", "--kv-memory-gb", "2"]
        forked = spawn("colocated", args, tmp_path / "forked.log", env=ENV, zygote=z, timeout=300)
        plain = spawn("colocated", args, tmp_path / "plain.log", env=ENV, timeout=300)
        try:
            assert forked.forked and not plain.forked
            assert _greedy(forked.address) == _greedy(plain.address)
            f, p = _boot(forked.address), _boot(plain.address)
            phases = {b.name for b in f.boot}
            assert {"load_weights", "cuda_graph_capture"} <= phases, phases
            assert 0 < f.serving_after_s and f.uptime_s < time_since_start(z.proc.pid)
            print(f"start -> SERVING: forked {f.serving_after_s:.2f}s, plain {p.serving_after_s:.2f}s; "
                  f"zygote preload {z.ready['modules']}")
        finally:
            assert forked.stop(60) == 0
            plain.stop(60)
    finally:
        z.close()


def time_since_start(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
