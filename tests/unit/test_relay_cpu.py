"""bench/relay_cpu.py's readers: a process's CPU by thread name, and the split of py-spy samples of the
router's main thread (ours / socket syscalls / gRPC's own callbacks, idle left out)."""

from __future__ import annotations

import os
import threading
import time

from bench.relay_cpu import py_spy_shares, thread_cpu_s


def test_thread_cpu_keeps_the_main_thread_apart_and_counts_a_busy_thread() -> None:
    """Python threads carry the process's name in /proc (CPython does not name OS threads), so a busy
    thread shows as time of that name, beside ``main``."""
    done = threading.Event()

    def spin() -> None:
        x = 0
        while not done.is_set():
            x += 1

    def others() -> float:
        return sum(v for k, v in thread_cpu_s(os.getpid()).items() if k != "main")

    before = grew = others()
    t = threading.Thread(target=spin)
    t.start()
    try:  # read while the thread lives: an ended thread leaves /proc/PID/task with its time
        deadline = time.monotonic() + 20
        while grew - before < 0.05 and time.monotonic() < deadline:
            time.sleep(0.01)
            grew = others()
    finally:
        done.set()
        t.join()
    assert grew - before >= 0.05
    assert thread_cpu_s(os.getpid())["main"] > 0


def test_py_spy_samples_split_into_ours_syscalls_and_grpc(tmp_path) -> None:
    main = ("thread (1): MainThread;main (pdserve/app/cli.py:39);run (asyncio/base_events.py:607);"
            "Handle._run (asyncio/events.py:80)")
    raw = tmp_path / "r.spy"
    raw.write_text("\n".join([
        f"{main};RouterServicer.Generate (router/service.py:108);"
        "UnaryUnaryCall._invoke (grpc/aio/_call.py:595) 5",
        f"{main};0x7f (grpc/_cython/cygrpc.cpython-311-x86_64-linux-gnu.so);sendmsg (libc.so.6) 2",
        f"{main};0x7f (grpc/_cython/cygrpc.cpython-311-x86_64-linux-gnu.so) 3",
        "thread (1): MainThread;run (asyncio/base_events.py:607);EpollSelector.select (selectors.py:468);"
        "epoll_wait (libc.so.6) 40",
        "thread (2): Thread-1 (_poll_wrapper);Thread.run (threading.py:982) 9",
    ]) + "\n")
    assert py_spy_shares(raw) == {"samples": 10, "ours": 0.5, "syscalls": 0.2, "grpc_callbacks": 0.3}
