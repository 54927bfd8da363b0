"""A tensor-parallel worker serving: ``pdserve serve --role colocated --tensor-parallel-size 2`` (rank 0
serves gRPC, rank 1 is a child process following its steps over gloo). Greedy output through the
Router API is token-identical to a single TP-1 engine, every KV block comes back, a graceful drain
exits 0 and takes the follower rank with it. (Prefill and decode workers at TP > 1:
test_cluster_tensor_parallel_kv.py.)"""

from __future__ import annotations

import subprocess

import pytest
from test_cluster_1p1d import MAX_TOKENS, prompts, reference, run_concurrently

from pdserve.app.launcher.local import colocated, get_stats
from pdserve.settings import ServeSettings

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _alive(pid: int) -> bool:
    return subprocess.run(["ps", "-p", str(pid)], capture_output=True).returncode == 0


def test_tp2_colocated_worker_matches_engine(make_checkpoint, tmp_path) -> None:
    model = make_checkpoint("llama")
    proc = colocated(model, log_path=tmp_path / "tp2.log",
                     args=("--num-blocks", "256", "--device", "cpu", "--tensor-parallel-size", "2"))
    ranks = _children(proc.proc.pid)
    assert len(ranks) == 1, f"expected one follower rank process, found {ranks}"
    start_free = get_stats(proc.address, "decode").free_blocks
    ps = prompts()
    got = run_concurrently(proc.address, ps, MAX_TOKENS)
    assert [r.token_ids for r in got] == reference(model, ps, MAX_TOKENS)
    assert get_stats(proc.address, "decode").free_blocks == start_free
    assert proc.stop(60) == 0
    assert not any(_alive(pid) for pid in ranks)
    log = open(tmp_path / "tp2.log").read()
    assert "tensor parallel rank 1 stopped after" in log


def test_worker_roles_take_tensor_parallel_sizes() -> None:
    for role in ("prefill", "decode", "colocated"):
        assert ServeSettings(role=role, model="m", tensor_parallel_size=4).tensor_parallel_size == 4
    assert ServeSettings(role="decode", model="m", kv_source_tp=2).kv_source_tp == 2
    with pytest.raises(ValueError, match="--kv-source-tp"):
        ServeSettings(role="decode", model="m", kv_source_tp=-1)
