"""The supervisor's restart timing with a fake cluster (no processes): a death is restarted once its
backoff ends, not at the next poll after it; the backoff doubles per death in the window; more deaths
than ``max_restarts`` leave the process down with the reason."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.app.launcher.supervisor import RestartPolicy, Supervisor


@dataclass
class FakeHandle:
    worker_id: str = "decode-1"
    role: str = "decode"
    pid: int = 100
    restarts: int = 0
    address: str = "127.0.0.1:1"
    up: bool = True

    def alive(self) -> bool:
        return self.up

    def exit_status(self) -> int:
        return -9


@dataclass
class FakeCluster:
    h: FakeHandle = field(default_factory=FakeHandle)
    restarted: int = 0
    given_up: list = field(default_factory=list)

    def supervised(self):
        return [self.h]

    def log_path(self, h):
        return "decode-1.log"

    def restart(self, h):
        self.restarted += 1
        h.up, h.pid, h.restarts = True, h.pid + 1, h.restarts + 1

    def give_up(self, h, why):
        self.given_up.append(why)


def test_a_pending_restart_is_waited_for_not_the_poll(monkeypatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("pdserve.app.launcher.supervisor.time.monotonic", lambda: now[0])
    cluster = FakeCluster()
    sup = Supervisor(cluster, RestartPolicy(backoff_s=0.1, max_backoff_s=1.0, poll_s=5.0,
                                            liveness_failures=0))
    assert sup._next_wait() == 5.0
    cluster.h.up = False
    sup.check()  # the death is noted; its restart is due in 0.1 s
    assert cluster.restarted == 0 and abs(sup._next_wait() - 0.1) < 1e-9
    now[0] += 0.1
    assert sup._next_wait() == 0.0
    sup.check()
    assert cluster.restarted == 1 and sup._next_wait() == 5.0
    cluster.h.up = False  # a second death within the window: twice the backoff
    sup.check()
    assert abs(sup._next_wait() - 0.2) < 1e-9


def test_more_deaths_than_the_limit_leave_it_down(monkeypatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("pdserve.app.launcher.supervisor.time.monotonic", lambda: now[0])
    cluster = FakeCluster()
    sup = Supervisor(cluster, RestartPolicy(backoff_s=0.1, max_backoff_s=1.0, max_restarts=2, poll_s=5.0,
                                            liveness_failures=0))
    for _ in range(3):
        cluster.h.up = False
        sup.check()
        now[0] += 1.0
        sup.check()
    assert cluster.restarted == 2 and len(cluster.given_up) == 1
    assert "crash loop: 3 exits" in cluster.given_up[0] and "decode-1" in sup.gave_up
