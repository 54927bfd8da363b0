"""Workers forked from a zygote (pdserve/app/launcher/zygote.py), real processes on CPU.

- a forked decode worker serves, token-identical to one started the plain way, and its boot record
  starts at the fork (its uptime is shorter than the zygote's age), in a session of its own;
- exit statuses come back (kill -9: -9; SIGTERM: a drain, 0), a group kill reaches it;
- an environment the zygote cannot give (a variable read at library load) starts a plain process;
- a zygote that cannot fork safely (a Python thread left running by a preload, a preload that leaves
  CUDA unusable in a child) is refused at start, and the process backend then starts plain processes;
- the zygote killed: its children run on, a child's exit is still seen (with no status), and the
  backend starts a new zygote for the next process;
- ``pdserve up --launcher process`` starts its first processes plain while the zygote starts beside
  them, and a worker killed -9 comes back forked from it, token-identical.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from pdserve.app.launcher.backends import ProcessBackend
from pdserve.app.launcher.local import get_stats
from pdserve.app.launcher.procs import spawn
from pdserve.app.launcher.zygote import UNKNOWN_STATUS, Zygote, ZygoteUnusable, env_difference
from pdserve.client import Client
from pdserve.settings import environ
from pdserve.v1 import process_pb2, process_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ARGS = ["--num-blocks", "64", "--transport", "tcp", "--device", "cpu"]
# pytest sets PYTEST_CURRENT_TEST anew at each phase of each test: held fixed here, or every child's
# environment would differ from the zygote's in it (and be started the plain way).
QUIET = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
         "PYTEST_CURRENT_TEST": ""}


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    z = Zygote.start({**environ(), **QUIET}, log_path=tmp_path_factory.mktemp("zygote") / "zygote.log")
    yield z
    z.close()


def _uptime(address: str) -> float:
    with grpc.insecure_channel(address) as ch:
        return process_pb2_grpc.ProcessStub(ch).GetProcessStats(process_pb2.ProcessStatsRequest(),
                                                                  timeout=10).uptime_s


def _greedy(address: str) -> list[int]:
    with Client(address) as c:
        r = c.generate(prompt_ids=[5, 6, 7, 8, 9], max_tokens=12, temperature=0.0, ignore_eos=True)
    return r.token_ids


def test_environment_differences_the_zygote_cannot_give() -> None:
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    assert env_difference(base, {**base, "CUDA_VISIBLE_DEVICES": "1", "PDSERVE_X": "y", "UCX_TLS": "tcp",
                                 "NCCL_DEBUG": "INFO"}) == []
    assert env_difference(base, {**base, "OMP_NUM_THREADS": "4"}) == ["OMP_NUM_THREADS"]
    assert env_difference(base, {"PATH": "/bin"}) == ["OMP_NUM_THREADS"]
    assert env_difference(base, {**base, "LD_PRELOAD": "x.so"}) == ["LD_PRELOAD"]


def test_forked_worker_serves_like_a_plain_one(zygote, tiny_llama_dir, tmp_path) -> None:
    args = ["--model", str(tiny_llama_dir), *ARGS]
    assert zygote.ready["modules"]["torch"] >= 0 and zygote.alive()
    forked = spawn("colocated", args, tmp_path / "forked.log", env=QUIET, zygote=zygote)
    plain = spawn("colocated", args, tmp_path / "plain.log", env=QUIET)
    try:
        assert forked.forked and not plain.forked
        assert os.getpgid(forked.pid) == forked.pid  # a session of its own: killpg reaches what it starts
        assert _greedy(forked.address) == _greedy(plain.address)
        # The boot clock starts at the fork, not at the zygote's start.
        zygote_age = time.monotonic() - _start_of(zygote.proc.pid)
        assert _uptime(forked.address) < zygote_age
        assert get_stats(forked.address, "colocated").free_blocks == 64
    finally:
        assert forked.stop(30) == 0  # SIGTERM: drained, exit 0, reported by the zygote
        plain.stop(30)
    assert forked.exit_status() == 0


def _start_of(pid: int) -> float:
    """time.monotonic() at the start of process ``pid`` (as process_stats computes its own)."""
    with open(f"/proc/{pid}/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.monotonic() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def test_exit_statuses_and_group_kill(zygote, tiny_llama_dir, tmp_path) -> None:
    args = ["--model", str(tiny_llama_dir), *ARGS]
    p = spawn("decode", args, tmp_path / "a.log", env=QUIET, zygote=zygote)
    os.kill(p.pid, signal.SIGKILL)
    assert p.proc.wait(20) == -signal.SIGKILL and not p.alive()
    q = spawn("decode", args, tmp_path / "b.log", env=QUIET, zygote=zygote)
    q.kill(group=True)
    assert q.exit_status() == -signal.SIGKILL


def test_an_environment_read_at_load_gets_a_plain_process(zygote, tiny_llama_dir, tmp_path, caplog) -> None:
    p = spawn("decode", ["--model", str(tiny_llama_dir), *ARGS], tmp_path / "w.log",
              env={**QUIET, "OMP_NUM_THREADS": "2"}, zygote=zygote)
    try:
        assert not p.forked and "OMP_NUM_THREADS" in caplog.text
        assert get_stats(p.address, "decode").free_blocks == 64
    finally:
        p.stop(30)


def test_a_preload_that_leaves_a_thread_is_refused(tmp_path) -> None:
    (tmp_path / "threaded_preload.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    env = {**environ(), **QUIET, "PYTHONPATH": str(tmp_path)}
    with pytest.raises(ZygoteUnusable, match="Python threads"):
        Zygote.start(env, preload=("threaded_preload",))
    with pytest.raises(ZygoteUnusable, match="preload failed"):
        Zygote.start(env, preload=("no_such_module_here",))
    # What an import that initialises CUDA leaves behind (flashinfer's does, on a GPU host: the GPU test
    # shows it for real): torch marks every later fork bad. The probe child finds it.
    (tmp_path / "poisoned_fork.py").write_text("import torch\ntorch.cuda._is_in_bad_fork = lambda: True\n")
    with pytest.raises(ZygoteUnusable, match="initialised CUDA.*torch: bad fork"):
        Zygote.start(env, preload=("torch", "poisoned_fork"))


def test_backend_without_a_usable_zygote_starts_plain_processes(tiny_llama_dir, tmp_path,
                                                                 monkeypatch) -> None:
    def refuse(*a, **k):
        raise ZygoteUnusable("CUDA was initialised by an import")

    monkeypatch.setattr(Zygote, "start", refuse)
    backend = ProcessBackend(tmp_path, env=QUIET, zygote=True)
    assert backend.zygotes.wait(10) is None and "CUDA" in backend.zygotes.disabled
    h = backend.start("decode", ["--model", str(tiny_llama_dir), *ARGS], "decode-1")
    try:
        assert not h.ref.forked
    finally:
        h.stop(30)
        backend.close()


def test_children_outlive_a_killed_zygote_and_a_new_one_is_started(tiny_llama_dir, tmp_path) -> None:
    backend = ProcessBackend(tmp_path, env=QUIET, zygote=True)
    args = ["--model", str(tiny_llama_dir), *ARGS]
    first = backend.zygotes.wait(120)
    h = backend.start("decode", args, "decode-1")
    try:
        assert h.ref.forked and first is not None
        first.proc.kill()
        first.proc.wait(10)
        assert h.alive() and get_stats(h.address, "decode").free_blocks == 64  # serves on
        os.kill(h.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while h.alive():  # seen through its pidfd: nobody is left to report the status
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert h.exit_status() == UNKNOWN_STATUS
        plain = backend.start("decode", args, "decode-2")  # started plain while a new zygote starts
        second = backend.zygotes.wait(120)
        again = backend.start("decode", args, "decode-3")
        assert not plain.ref.forked and again.ref.forked and second is not None and second is not first
        plain.stop(30)
        again.stop(30)
    finally:
        backend.close()


def test_pdserve_up_restarts_a_killed_worker_forked_from_its_zygote(tiny_llama_dir,
                                                                              tmp_path) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, **QUIET}
    up = subprocess.Popen([sys.executable, "-m", "pdserve.app.cli", "up", "--model", str(tiny_llama_dir),
                           "--prefill", "1", "--decode", "1", "--launcher", "process", "--transport", "tcp",
                           "--num-blocks", "64", "--device", "cpu", "--run-dir", str(run_dir)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        router = _router_line(up)
        zygote_pid = _zygote_pid(run_dir)
        state = json.loads((run_dir / "state.json").read_text())
        pids = [w["pid"] for w in state["workers"]] + [state["router_pid"]]
        # Started before the zygote was ready: plain (children of the launcher); after: forked.
        assert {_parent(pid) for pid in pids} <= {up.pid, zygote_pid}
        before = _greedy(router)
        decode = next(w for w in state["workers"] if w["role"] == "decode")
        os.kill(decode["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            state = json.loads((run_dir / "state.json").read_text())
            now = next(w for w in state["workers"] if w["role"] == "decode")
            if now["pid"] != decode["pid"]:
                break
            assert time.monotonic() < deadline, "the decode worker was not restarted"
            time.sleep(0.2)
        assert _parent(now["pid"]) == zygote_pid
        deadline = time.monotonic() + 60
        while True:
            try:
                assert _greedy(router) == before
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)


def _router_line(up: subprocess.Popen) -> str:
    assert up.stdout is not None
    for line in up.stdout:
        if line.startswith("router: "):
            return line.split()[1]
    raise AssertionError(f"pdserve up exited with {up.wait()} before its router line")


def _zygote_pid(run_dir: Path, timeout: float = 120.0) -> int:
    """The zygote's pid once its ready line is in its log."""
    deadline = time.monotonic() + timeout
    while True:
        log = run_dir / "logs" / "zygote.log"
        text = log.read_text() if log.exists() else ""
        lines = [ln for ln in text.splitlines() if ln.startswith("zygote ")]
        if lines:
            return int(lines[0].split()[1])
        assert time.monotonic() < deadline, "the zygote did not become ready"
        time.sleep(0.1)


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])
