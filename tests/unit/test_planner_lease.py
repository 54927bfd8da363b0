"""The planner's leader election (``pdserve/app/planner/lease.py``) step by step on a fake clock, against an
in-memory Lease store that keeps the API server's rules (resourceVersion preconditions, 409 on a stale write
or a second create, 404 for an absent Lease); and ``planner run --actuator kubernetes``'s refusals. The same
code against a real API server, under the chart's RBAC: tests/integration/test_planner_k8s.py."""

from __future__ import annotations

import copy
import json

import pytest
from kubernetes.client.rest import ApiException

from pdserve.app.cli import main
from pdserve.app.planner.lease import LeaderElector, LeaseConfig, micro_time, parse_time
from tests.unit.fake_clock import Clock


class Leases:
    """What ``CoordinationV1Api`` does with one namespace's Leases, in memory. ``cut``: every call fails as
    an unreachable server; ``meddle``: called between a read and the next replace (another writer)."""

    def __init__(self) -> None:
        self.items: dict[str, dict] = {}
        self.version = 0
        self.cut = False
        self.meddle = None

    def _check(self) -> None:
        if self.cut:
            raise ConnectionError("unreachable")

    def _stored(self, body: dict) -> dict:
        self.version += 1
        body = copy.deepcopy(body)
        body.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        self.items[body["metadata"]["name"]] = body
        return body

    def read_namespaced_lease(self, name, namespace, _preload_content=True):
        self._check()
        if name not in self.items:
            raise ApiException(status=404, reason="Not Found")
        if self.meddle is not None:
            meddle, self.meddle = self.meddle, None
            data = json.dumps(self.items[name]).encode()
            meddle(self)
        else:
            data = json.dumps(self.items[name]).encode()
        return type("Response", (), {"data": data})()

    def create_namespaced_lease(self, namespace, body, _preload_content=True):
        self._check()
        if body["metadata"]["name"] in self.items:
            raise ApiException(status=409, reason="AlreadyExists")
        self._stored(body)

    def replace_namespaced_lease(self, name, namespace, body, _preload_content=True):
        self._check()
        if body["metadata"].get("resourceVersion") != self.items[name]["metadata"]["resourceVersion"]:
            raise ApiException(status=409, reason="Conflict")
        self._stored(body)


def elector(store: Leases, clock: Clock, identity: str, **kw) -> LeaderElector:
    cfg = LeaseConfig(namespace="ns", name="pdserve-planner", identity=identity, lease_duration_s=15,
                      renew_deadline_s=10.0, retry_period_s=2.0)
    return LeaderElector(store, cfg, clock=clock, wall=clock, **kw)


def test_one_leads_the_other_takes_over_only_once_the_lease_expired():
    store, clock = Leases(), Clock(1000.0)
    changes: list[tuple[str, bool]] = []
    a = elector(store, clock, "a", on_change=lambda up: changes.append(("a", up)))
    b = elector(store, clock, "b", on_change=lambda up: changes.append(("b", up)))
    assert a.step() and a.leading() and store.items["pdserve-planner"]["spec"]["holderIdentity"] == "a"
    assert not b.step() and b.holder == "a"
    clock.t += 9.0
    assert a.step() and not b.step()  # renewed: b still follows
    clock.t += 9.0  # a went silent 9 s ago: still leading, its lease still live
    assert a.leading() and not b.step()
    clock.t += 1.5  # a's deadline (10 s) passed: it stops acting though its thread never noticed
    assert not a.leading()
    assert not b.step()  # but its lease (15 s) has not expired yet: b waits
    clock.t += 5.0
    assert b.step() and b.leading()
    spec = store.items["pdserve-planner"]["spec"]
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1
    assert not a.step() and not a.leading()  # a comes back: the lease is b's
    assert changes == [("a", True), ("b", True), ("a", False)]


def test_a_conflicting_write_means_someone_else_won():
    store, clock = Leases(), Clock(1000.0)
    a = elector(store, clock, "a")
    assert a.step()

    def another_writer(s: Leases) -> None:  # between a's read and its write, b takes the lease
        s._stored({**s.items["pdserve-planner"], "spec": {**s.items["pdserve-planner"]["spec"],
                                                          "holderIdentity": "b"}})

    store.meddle = another_writer
    assert not a.step() and not a.leading()  # at once, not at its deadline
    assert store.items["pdserve-planner"]["spec"]["holderIdentity"] == "b"
    b = elector(store, clock, "b")
    assert b.step()  # it was b's write: b renews its lease


def test_only_one_of_two_creates_wins():
    store, clock = Leases(), Clock(1000.0)
    a = elector(store, clock, "a")
    assert a.step()
    store.items.clear()  # both see it absent ...
    store.create_namespaced_lease("ns", {"metadata": {"name": "pdserve-planner"},
                                         "spec": {"holderIdentity": "b", "renewTime": micro_time(clock.t),
                                                  "leaseDurationSeconds": 15}})
    assert not a.step() and not a.leading()  # ... b's create came first: a follows


def test_release_hands_over_at_once_and_keeps_the_annotations():
    store, clock = Leases(), Clock(1000.0)
    a = elector(store, clock, "a", annotations=lambda: {"pdserve.io/x": "1"})
    b = elector(store, clock, "b")
    assert a.step()
    a.stop(release=True)
    assert not a.leading()
    lease = store.items["pdserve-planner"]
    assert lease["spec"]["holderIdentity"] is None
    assert lease["metadata"]["annotations"] == {"pdserve.io/x": "1"}
    assert b.step() and b.seen_annotations == {"pdserve.io/x": "1"}  # no wait for the lease to expire


def test_confirm_fails_when_the_server_is_away_and_leading_ends_at_the_deadline():
    store, clock = Leases(), Clock(1000.0)
    a = elector(store, clock, "a")
    assert a.step() and a.confirm()
    store.cut = True
    assert not a.confirm()  # the fence before a resize: nothing is applied
    assert a.step()  # still within its renew deadline: it leads, but acts only where a write succeeds
    clock.t += 10.0
    assert not a.step() and not a.leading()
    store.cut = False
    assert a.step() and a.leading()  # nobody took it meanwhile: renewed


def test_times_and_config():
    assert micro_time(1_800_000_000.0) == "2027-01-15T08:00:00.000000Z"  # six digits even when zero
    assert parse_time(micro_time(1_800_000_000.25)) == 1_800_000_000.25
    assert parse_time("garbage") is None and parse_time(None) is None
    for bad in (dict(lease_duration_s=10, renew_deadline_s=10.0), dict(retry_period_s=0.0),
                dict(lease_duration_s=2.5), dict(identity="")):
        kw = dict(namespace="n", name="l", identity="i", lease_duration_s=15, renew_deadline_s=10.0,
                  retry_period_s=2.0)
        with pytest.raises(ValueError):
            LeaseConfig(**{**kw, **bad})


@pytest.mark.parametrize("argv, says", [
    (["--actuator", "kubernetes"], "needs --release"),
    (["--actuator", "kubernetes", "--release", "r", "--namespace", "n", "--json"], "--json"),
    (["--actuator", "kubernetes", "--release", "r", "--namespace", "n", "--lease-duration", "5",
      "--renew-deadline", "8"], "renew deadline"),
    (["--actuator", "kubernetes", "--release", "r", "--namespace", "n", "--settle-timeout", "-1"],
     "--settle-timeout"),
    (["--actuator", "kubernetes", "--release", "r", "--namespace", "n", "--kubeconfig", "/nonexistent"],
     "nonexistent"),
])
def test_run_kubernetes_refuses_bad_flags_before_touching_a_cluster(argv, says, capsys, monkeypatch,
                                                                     tmp_path):
    monkeypatch.setattr("pdserve.app.planner.k8s.SERVICE_ACCOUNT_NAMESPACE", tmp_path / "not-in-a-pod")
    assert main(["planner", "run", *argv]) == 2
    assert says in capsys.readouterr().err
