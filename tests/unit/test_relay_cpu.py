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


def test_pyspy_threads_groups_pool_threads_and_names_our_caller(tmp_path) -> None:
    """bench/pyspy_threads.py: pool threads (``name_3``, ``name-7``) are one group; each innermost frame's
    share is of its group's samples, beside the innermost frame of this project's code above it."""
    from bench.pyspy_threads import group_of, summary

    raw = tmp_path / "spy.txt"
    raw.write_text(
        "thread (0x1): MainThread;_serve (pdserve/app/commands/serve.py:37);"
        "KVMemory.flush (kvtransfer/memory.py:147);0x7f (libc.so.6) 3\n"
        "thread (0x1): MainThread;_serve (pdserve/app/commands/serve.py:37);epoll_wait (libc.so.6) 1\n"
        "thread (0x2): kvtransfer-recv_0;_recv_all (kvtransfer/rx_conn.py:64);recvmsg (libc.so.6) 2\n"
        "thread (0x3): kvtransfer-recv_1;Thread.run (threading.py:982);0x7f (libc.so.6) 2\n"
        "not a sample line\n")
    assert group_of("kvtransfer-recv_12") == "kvtransfer-recv"
    assert group_of("engine-decode") == "engine-decode"
    res = summary(raw, top=5)
    assert list(res) == ["MainThread", "kvtransfer-recv"]
    main = res["MainThread"]
    assert (main["threads"], main["samples"]) == (1, 4)
    assert main["top"][0] == {"leaf": "0x7f (libc.so.6)", "ours": "KVMemory.flush (kvtransfer/memory.py:147)",
                              "share": 0.75}
    recv = res["kvtransfer-recv"]
    assert (recv["threads"], recv["samples"]) == (2, 4)
    assert {t["ours"] for t in recv["top"]} == {"_recv_all (kvtransfer/rx_conn.py:64)", "-"}


def test_kv_bench_fragmented_blocks_are_a_permutation_in_runs() -> None:
    from bench.kv_bench import fragmented

    assert fragmented(7, 0, 1) == list(range(7))
    got = fragmented(10, 3, 1)
    assert sorted(got) == list(range(10)) and got != list(range(10))
    for i, b in enumerate(got):  # every run of 3 ids (the last one short) stays whole and in order
        if b % 3 == 0:
            assert got[i:i + min(3, 10 - b)] == list(range(b, min(b + 3, 10)))
    assert fragmented(10, 3, 1) == got and fragmented(10, 3, 2) != got  # seeded: one order per side
