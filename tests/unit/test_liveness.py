"""LivenessWatch against a fake cluster: rounds are driven by hand (no threads, no clock)."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.app.launcher.liveness import LivenessWatch, answers
from pdserve.app.launcher.supervisor import RestartPolicy


class FakeHandle:
    def __init__(self, worker_id: str, pid: int) -> None:
        self.role, self.worker_id, self.pid = "decode", worker_id, pid
        self.live = True

    def alive(self) -> bool:
        return self.live


class FakeCluster:
    def __init__(self, *handles: FakeHandle) -> None:
        self.handles = list(handles)
        self.silent: set[str] = set()  # worker ids whose checks go unanswered
        self.killed: list[tuple[str, int]] = []
        self.probed: list[str] = []

    def supervised(self):
        return list(self.handles)

    def answers(self, h, timeout: float) -> bool:
        self.probed.append(h.worker_id)
        return h.worker_id not in self.silent

    def kill_unresponsive(self, h) -> None:
        self.killed.append((h.worker_id, h.pid))
        h.live = False


def watch(cluster, failures: int = 3) -> LivenessWatch:
    return LivenessWatch(cluster, period_s=1.0, timeout_s=0.5, failures=failures)


def test_a_silent_process_is_killed_after_the_limit_and_only_then() -> None:
    a, b = FakeHandle("decode-1", 100), FakeHandle("decode-2", 200)
    c = FakeCluster(a, b)
    w = watch(c)
    c.silent = {"decode-1"}
    w.check()
    w.check()
    assert c.killed == []
    w.check()
    assert c.killed == [("decode-1", 100)]
    assert "did not answer 3 health checks in a row" in w.killed["decode-1"]
    w.check()  # dead now: not probed again, not killed again
    assert c.killed == [("decode-1", 100)]
    assert c.probed[-1] == "decode-2"


def test_one_answer_resets_the_count() -> None:
    a = FakeHandle("prefill-1", 100)
    c = FakeCluster(a)
    w = watch(c)
    for silent in (True, True, False, True, True):
        c.silent = {"prefill-1"} if silent else set()
        w.check()
    assert c.killed == []
    w.check()
    assert c.killed == [("prefill-1", 100)]


def test_a_restarted_process_starts_its_count_again() -> None:
    a = FakeHandle("decode-1", 100)
    c = FakeCluster(a)
    w = watch(c)
    c.silent = {"decode-1"}
    w.check()
    w.check()
    a.pid = 101  # restarted by the supervisor under the same worker id
    w.check()
    w.check()
    assert c.killed == []
    w.check()
    assert c.killed == [("decode-1", 101)]


def test_a_probe_that_cannot_be_made_counts_as_an_answer() -> None:
    a = FakeHandle("decode-1", 100)
    c = FakeCluster(a)

    def broken(h, timeout):
        raise OSError("no such certificate")

    c.answers = broken
    w = watch(c, failures=1)
    w.check()
    assert c.killed == []


def test_processes_not_alive_are_not_probed() -> None:
    a = FakeHandle("decode-1", 100)
    a.live = False  # exited: the supervisor's, not the watch's
    c = FakeCluster(a)
    watch(c).check()
    assert c.probed == []


def test_zero_failures_never_starts() -> None:
    w = watch(FakeCluster(), failures=0)
    w.start()
    assert w._thread is None
    w.stop()


def test_policy_refuses_bad_liveness_values() -> None:
    with pytest.raises(ValueError, match="liveness"):
        RestartPolicy(liveness_failures=-1)
    with pytest.raises(ValueError, match="liveness"):
        RestartPolicy(liveness_period_s=0)


def test_answers_counts_only_silence() -> None:
    """A real server: SERVING and NOT_SERVING are answers, so is an unknown service (NOT_FOUND) and a
    refused connection; a server whose handler never returns is silence."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert answers(ch, timeout=5)
    finally:
        server.stop(0)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:  # nothing listens now: refused, not silent
        assert answers(ch, timeout=5)

    release = threading.Event()

    class Hung(health_pb2_grpc.HealthServicer):
        def Check(self, request, context):
            release.wait(10)
            return health_pb2.HealthCheckResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(Hung(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert not answers(ch, timeout=0.3)
    finally:
        release.set()
        server.stop(0)
