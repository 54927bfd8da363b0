"""The planner's Kubernetes actuator: ``pdserve planner run --actuator kubernetes`` sizes a release's prefill
and decode Deployments through their ``scale`` subresource, the path ``kubectl scale`` and an HPA take.

Lifecycle::

    KubernetesActuator.start()   campaigns for the release's Lease (``lease.py``) in a thread
    apply(decision)              each window (``actuator.Autoscaler``'s loop, fed by ``endpoint_targets``):
        leader                   ``PoolActuator``'s rules (actuator.py): a pool's replicas are read fresh
                                 from its scale subresource (``spec.replicas``); a changed target is applied
                                 unless within the pool's cool-down; what was not applied, and a pool resized
                                 by hand (``kubectl scale``), is handed back to the planner
        follower                 decides all the same (its capacity model and demand stay warm) but applies
                                 nothing: every pool's real replicas and last change go back to its planner,
                                 so the window it takes over in starts from the pools as they are
    close()                      stops campaigning and releases the Lease (after the loop has stopped:
                                 ``interrupt()`` first ends a wait for a pool to settle)

A resize (``resize``), by the leader only:

1. records the change's time in the Lease's annotations and renews it (``LeaderElector.confirm``): the
   write fails unless the Lease is still ours, so a replica that lost it never scales, and a successor
   reads when each pool last changed and keeps the cool-downs across the hand-over;
2. PATCHes ``spec.replicas`` of the Deployment's scale subresource with the ``resourceVersion`` read
   this window: a pool resized by hand since is not overwritten (the change is handed back); a 409 that
   was only the controller updating the Deployment's status is retried with the new version;
3. waits, up to ``settle_timeout_s``, until the Deployment has the new replicas ready (scale-up) or the
   removed pods out of its count (scale-down): cool-downs count from there, as the local actuator's
   count from the end of ``Cluster.scale``. A pool that does not settle in time stays at its new size
   (Kubernetes goes on converging) and the action says how far it got.

Scale-down guarantees: Kubernetes picks the pods to remove (not-ready and newest first); each gets the
chart's drain (``_pool.tpl``): the pod leaves its Service's endpoints, hence the router's discovery and
the planner's targets, at once; its preStop hook sleeps ``drain.preStopSleepSeconds`` so every router has
seen that; then SIGTERM: the worker reports NOT_SERVING, takes nothing new and finishes what it holds for
up to ``drain.timeoutSeconds``, inside ``terminationGracePeriodSeconds``. A request still running when that
ends is cut (the router's migration resumes a decode stream elsewhere); nothing waits for a long decode
beyond the drain timeout. The planner removes at most ``max_step_down`` pods per down cool-down.

Signals come from the pods' own metrics, as for ``planner run`` on a local cluster: ``endpoint_targets``
reads the ready addresses of the release's Services (core/v1 Endpoints: on every Kubernetes version,
and ``get`` of three named objects is all the Role needs), re-read each window.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pdserve.app.planner.actuator import STANDBY, Action, PoolActuator
from pdserve.app.planner.lease import LeaderElector, LeaseConfig, micro_time, parse_time
from pdserve.app.planner.policy import Decision, Planner
from pdserve.app.planner.signals import POOLS, Signals
from pdserve.app.top.stats import Target

log = logging.getLogger("pdserve.planner")

LAST_CHANGES = "pdserve.io/planner-last-changes"  # Lease annotation: {pool: when it last changed}
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@dataclass(frozen=True, kw_only=True)
class Release:
    """A chart release's objects, by the chart's names: ``fullname`` is the chart's full name (the release
    name when it contains "pdserve", else "<release>-pdserve"; ``fullnameOverride`` where set)."""

    namespace: str
    fullname: str

    def __post_init__(self) -> None:
        if not self.namespace or not self.fullname:
            raise ValueError("a release needs a namespace and the chart's full name")

    def deployment(self, pool: str) -> str:
        return f"{self.fullname}-{pool}"

    def services(self) -> dict[str, str]:
        return {role: f"{self.fullname}-{role}" for role in ("router", *POOLS)}

    @property
    def lease(self) -> str:
        return f"{self.fullname}-planner"


def in_cluster_namespace() -> str | None:
    """The pod's own namespace, where it runs under a service account."""
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or None
    except OSError:
        return None


def api_client(kubeconfig: str | None = None, context: str | None = None):
    """A ``kubernetes`` ApiClient: a kubeconfig where one is named, else the pod's service account, else the
    default kubeconfig (``~/.kube/config``)."""
    from kubernetes import client, config

    if kubeconfig or context:
        return config.new_client_from_config(config_file=kubeconfig, context=context, persist_config=False)
    try:
        cfg = client.Configuration()
        config.load_incluster_config(client_configuration=cfg)
        return client.ApiClient(cfg)
    except config.ConfigException:
        return config.new_client_from_config(persist_config=False)


def endpoint_targets(api, namespace: str, services: Mapping[str, str],
                     port_name: str = "metrics") -> Callable[[], list[Target]]:
    """A source of metrics targets (``live.SignalSource``): each call reads the Endpoints of ``services``
    (role -> Service name) through ``api`` (``CoreV1Api``) and returns every ready address on the port
    named ``port_name``, with its role. A Service that cannot be read keeps its last good list."""
    last: dict[str, list[Target]] = {}

    def read() -> list[Target]:
        out: list[Target] = []
        for role, name in services.items():
            try:
                ep = api.read_namespaced_endpoints(name, namespace)
            except Exception as exc:  # noqa: BLE001 - keep planning from what was last seen
                log.warning("planner: endpoints %s/%s: %s: %s", namespace, name, type(exc).__name__, exc)
                out += last.get(role, [])
                continue
            found = []
            for subset in ep.subsets or ():
                port = next((p.port for p in subset.ports or () if p.name == port_name), None)
                if port is None:
                    continue
                for a in subset.addresses or ():  # ready only: notReadyAddresses are not serving
                    host = f"[{a.ip}]" if ":" in a.ip else a.ip
                    pod = a.target_ref.name if a.target_ref is not None else a.ip
                    found.append(Target(address=f"{host}:{port}", role=role, process=pod))
            last[role] = found
            out += found
        return out

    return read


class NotLeading(RuntimeError):
    """The Lease was not ours when a resize was about to be applied: nothing was changed."""


class ResizedMeanwhile(RuntimeError):
    """The Deployment changed between this window's read and the PATCH: nothing was overwritten."""


class KubernetesActuator(PoolActuator):
    """Applies the planner's targets to ``release``'s pool Deployments (module doc). ``lease``: campaign
    for it and act only while leading (None: act alone, no election); ``settle_timeout_s`` 0: a resize ends
    with its PATCH."""

    def __init__(self, api, release: Release, planner: Planner, *, lease: LeaseConfig | None = None,
                 dry_run: bool = False, settle_timeout_s: float = 600.0, settle_poll_s: float = 1.0,
                 on_leader_change: Callable[[bool], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        from kubernetes import client

        super().__init__(planner, dry_run=dry_run, clock=clock)
        if settle_timeout_s < 0 or settle_poll_s <= 0:
            raise ValueError("need settle_timeout_s >= 0 and settle_poll_s > 0")
        self.apps = client.AppsV1Api(api)
        self.release, self.wall = release, wall
        self.settle_timeout_s, self.settle_poll_s = settle_timeout_s, settle_poll_s
        self.elector = None
        if lease is not None and not dry_run:
            self.elector = LeaderElector(client.CoordinationV1Api(api), lease, on_change=on_leader_change,
                                         annotations=self.record, clock=clock, wall=wall)
        self._seen: dict[str, tuple[str, int]] = {}  # pool -> (resourceVersion, replicas) as last read
        self._changed_wall: dict[str, float] = {}  # pool -> when it last changed, wall clock (the record)
        self._merged: dict[str, float] = {}  # pool -> the latest stamp of the Lease's record taken in
        self._closing = threading.Event()

    # ---------------------------------------------------------------- leadership
    def start(self) -> None:
        if self.elector is not None:
            self.elector.start()

    def interrupt(self) -> None:
        """End a wait for a pool to settle at once (a stop is coming: the loop must not block it)."""
        self._closing.set()

    def close(self, *, release: bool = True) -> None:
        """Stop campaigning and (``release``) hand the Lease over; call it once the loop has stopped, so
        nothing acts after the Lease is released."""
        self._closing.set()
        if self.elector is not None:
            self.elector.stop(release=release)

    def leading(self) -> bool:
        return self.elector is None or self.elector.leading()

    @property
    def mode(self) -> str:
        return "dry run" if self.dry_run else "autoscale" if self.leading() else "standby"

    def record(self) -> dict[str, str]:
        """The Lease annotations the leader writes: when each pool last changed (wall clock), ours merged
        with what the Lease already says, so a record outlives the leaders that wrote it."""
        changes = self._lease_record()
        for pool, t in dict(self._changed_wall).items():  # a copy: the elector's thread calls this
            changes[pool] = max(changes.get(pool, t), t)
        return {LAST_CHANGES: json.dumps({p: micro_time(t) for p, t in sorted(changes.items())})}

    def _lease_record(self) -> dict[str, float]:
        raw = self.elector.seen_annotations.get(LAST_CHANGES) if self.elector is not None else None
        try:
            changes = json.loads(raw) if raw else {}
        except ValueError:
            return {}
        out = {}
        for pool, stamp in (changes.items() if isinstance(changes, dict) else ()):
            t = parse_time(stamp) if isinstance(stamp, str) else None
            if pool in POOLS and t is not None:
                out[pool] = t
        return out

    def _merge_record(self) -> None:
        """Cool-downs from the Lease: the latest change of each pool any leader recorded, on our clock."""
        now_wall, now = self.wall(), self.clock()
        for pool, stamp in self._lease_record().items():
            if stamp <= self._merged.get(pool, float("-inf")):
                continue  # seen already (our own, or merged in an earlier window)
            self._merged[pool] = stamp
            t = min(stamp, now_wall)  # a stamp from a clock ahead of ours counts as now, once
            self._changed_wall[pool] = max(self._changed_wall.get(pool, t), t)
            self._finished[pool] = max(self._finished.get(pool, float("-inf")), now - (now_wall - t))

    # ---------------------------------------------------------------- the pools
    def replicas(self, pool: str) -> int:
        rel = self.release
        scale = self.apps.read_namespaced_deployment_scale(rel.deployment(pool), rel.namespace)
        n = int(scale.spec.replicas or 0)
        self._seen[pool] = (scale.metadata.resource_version, n)
        return n

    def apply(self, decision: Decision, signals: Signals | None = None) -> list[Action]:
        if self.dry_run:
            return super().apply(decision, signals)
        self._merge_record()
        if self.leading():
            return super().apply(decision, signals)
        return self._standby(decision, signals)

    def _standby(self, decision: Decision, signals: Signals | None) -> list[Action]:
        out = []
        holder = (self.elector.holder if self.elector is not None else None) or "nobody yet"
        for p in decision.pools:
            have = self.replicas(p.pool)
            self.planner.follow(p.pool, have, changed_at=self._finished.get(p.pool))
            if p.direction != "hold":
                now = self.clock()
                out.append(self._done(Action(p.pool, have, p.target, STANDBY, now, now, p.reason,
                                             f"not the leader ({holder} is)"), p, signals))
        return out

    def resize(self, pool: str, n: int) -> str | None:
        name = self.release.deployment(pool)
        self._changed_wall[pool] = self.wall()  # written ahead: a successor counts the cool-down from here
        if self.elector is not None and not self.elector.confirm():
            holder = self.elector.holder or "nobody"
            raise NotLeading(f"the lease {self.elector.config.name} is not ours ({holder} holds it): nothing "
                             "scaled")
        self._patch(pool, name, n)
        note = self._settle(name, n)
        self._changed_wall[pool] = self.wall()
        return note

    def _patch(self, pool: str, name: str, n: int, attempts: int = 5) -> None:
        """PATCH spec.replicas, on the condition that the pool still has the replicas this window read.
        The condition is the Deployment's resourceVersion, which the controller also moves with every status
        update (pods starting, becoming ready): a 409 whose re-read still shows the same replicas is only
        that, and is tried again with the new version; other replicas mean a hand change, not overwritten."""
        from kubernetes.client.rest import ApiException

        ns = self.release.namespace
        rv, read = self._seen.get(pool) or (None, None)
        for _ in range(attempts):
            body: dict = {"spec": {"replicas": n}}
            if rv:
                body["metadata"] = {"resourceVersion": rv}
            try:
                self.apps.patch_namespaced_deployment_scale(name, ns, body,
                                                            _content_type="application/merge-patch+json")
                return
            except ApiException as exc:
                if exc.status != 409:
                    raise
            have = self.replicas(pool)
            if read is not None and have != read:
                raise ResizedMeanwhile(f"{name} went from {read} to {have} replicas since this window read "
                                       "it (resized by hand?): not overwritten")
            rv, read = self._seen[pool]
        raise ResizedMeanwhile(f"{name} kept changing: {attempts} conflicting writes, not scaled")

    def _settle(self, name: str, n: int) -> str | None:
        """Wait until the Deployment has ``n`` replicas, all ready, and no others; a note if it did not."""
        if self.settle_timeout_s <= 0:
            return None
        deadline = self.clock() + self.settle_timeout_s
        ready = have = None
        while True:
            try:
                d = self.apps.read_namespaced_deployment(name, self.release.namespace)
                st = d.status
                ready, have = st.ready_replicas or 0, st.replicas or 0
                if (st.observed_generation or 0) >= (d.metadata.generation or 0) and have == n and ready >= n:
                    return None
            except Exception as exc:  # noqa: BLE001 - the PATCH is done; only the wait is blind
                log.warning("autoscale: reading %s: %s: %s", name, type(exc).__name__, exc)
            if self.clock() >= deadline:
                return (f"not settled after {self.settle_timeout_s:g} s ({ready} ready of {have} pods, "
                        f"{n} asked): Kubernetes goes on")
            if self._closing.wait(self.settle_poll_s):
                return "stopped before the pool settled"
