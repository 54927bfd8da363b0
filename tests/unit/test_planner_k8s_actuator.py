"""The Kubernetes actuator's own rules (``pdserve/app/planner/k8s.py``) on a fake clock, with the API server's
part played in memory: a follower applies nothing and follows the pools and the leader's record; cool-downs
recorded on the Lease by an earlier leader hold for the next; a stamp from a clock ahead counts as now, once.
Everything against a real API server: tests/integration/test_planner_k8s.py."""

from __future__ import annotations

from types import SimpleNamespace

from pdserve.app.planner.actuator import APPLIED, COOL_DOWN, STANDBY
from pdserve.app.planner.k8s import LAST_CHANGES, KubernetesActuator, Release
from pdserve.app.planner.lease import micro_time
from pdserve.app.planner.policy import Decision, Planner, PlannerConfig, PoolDecision
from tests.unit.fake_clock import Clock

CONFIG = PlannerConfig(up_cooldown_s=60.0, down_cooldown_s=300.0)
WALL = 1_800_000_000.0  # the wall clock when the fake monotonic clock reads 0


class Apps:
    """The scale subresource of the two pools, as ``AppsV1Api`` reads and patches it."""

    def __init__(self) -> None:
        self.replicas = {"pdserve-prefill": 1, "pdserve-decode": 1}
        self.patches: list[tuple[str, int]] = []

    def read_namespaced_deployment_scale(self, name, namespace):
        return SimpleNamespace(spec=SimpleNamespace(replicas=self.replicas[name]),
                               metadata=SimpleNamespace(resource_version=str(len(self.patches))))

    def patch_namespaced_deployment_scale(self, name, namespace, body, _content_type=None):
        self.replicas[name] = body["spec"]["replicas"]
        self.patches.append((name, body["spec"]["replicas"]))


class Elector:
    """The elector as the actuator sees it: whether it leads, who holds the Lease, its annotations."""

    def __init__(self, leading: bool, annotations: dict[str, str] | None = None) -> None:
        self.is_leading, self.holder = leading, "other"
        self.seen_annotations = annotations or {}

    def leading(self) -> bool:
        return self.is_leading

    def confirm(self) -> bool:
        return self.is_leading


def actuator(elector: Elector) -> tuple[KubernetesActuator, Apps, Clock]:
    clock = Clock(0.0)
    act = KubernetesActuator(None, Release(namespace="ns", fullname="pdserve"), Planner(CONFIG, clock=clock),
                             settle_timeout_s=0.0, clock=clock, wall=lambda: WALL + clock.t)
    act.apps, act.elector = Apps(), elector
    return act, act.apps, clock


def up(cur: int, target: int) -> Decision:
    return Decision(at=0.0, pools=(
        PoolDecision("prefill", cur, target, float(target), "up", f"up {cur} -> {target}"),
        PoolDecision("decode", 1, 1, 1.0, "hold", "hold at 1")))


def lease_record(**changed_at: float) -> dict[str, str]:
    return {LAST_CHANGES: '{' + ", ".join(f'"{p}": "{micro_time(t)}"' for p, t in changed_at.items()) + '}'}


def test_a_follower_applies_nothing_and_follows_the_pools_and_the_leaders_record():
    act, apps, clock = actuator(Elector(False, lease_record(prefill=WALL - 20.0)))
    apps.replicas["pdserve-prefill"] = 3  # the leader (or a person) made it 3
    clock.t = 30.0
    (a,) = act.apply(up(1, 2))
    assert a.outcome == STANDBY and "not the leader (other is)" in a.line() and apps.patches == []
    state = act.planner._state["prefill"]
    assert state.target == 3 and state.changed_at == -20.0  # the leader's change, on this clock
    assert act.mode == "standby"


def test_a_new_leader_keeps_the_cool_down_its_predecessor_recorded():
    act, apps, clock = actuator(Elector(True, lease_record(prefill=WALL - 20.0)))
    clock.t = 30.0  # 50 s after the predecessor's change: within the 60 s up cool-down
    (a,) = act.apply(up(1, 2))
    assert a.outcome == COOL_DOWN and apps.patches == []
    clock.t = 41.0
    (a,) = act.apply(up(1, 2))
    assert a.outcome == APPLIED and apps.patches == [("pdserve-prefill", 2)]
    record = act.record()[LAST_CHANGES]
    assert micro_time(WALL + 41.0) in record  # its own change, for the next leader


def test_a_stamp_from_a_clock_ahead_counts_as_now_once():
    act, apps, clock = actuator(Elector(True, lease_record(prefill=WALL + 3600.0)))
    clock.t = 10.0
    assert act.apply(up(1, 2))[0].outcome == COOL_DOWN  # "now": a cool-down from here
    clock.t = 71.0
    assert act.apply(up(1, 2))[0].outcome == APPLIED  # not an hour's wait
