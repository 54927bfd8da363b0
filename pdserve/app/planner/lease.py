"""Leader election on a ``coordination.k8s.io/v1`` Lease: of several planner replicas, one acts at a time.

Why a Lease and not "run one replica": a Deployment of one still runs two pods for a while (a rollout's
surge, a node that stops answering while its pod is replaced), and two planners each scaling a pool from
its own window make a pool move twice. The Lease is the one place the API server serialises them.

Lifecycle (``LeaderElector.start()``: a thread; one ``step()`` every ``retry_period_s``)::

    step()   GET the Lease (absent: CREATE it naming us; a 409 AlreadyExists means another created it
             first). Named us: RENEW (renewTime = now). Empty holder, or expired (renewTime +
             leaseDurationSeconds < now, by the wall clock): TAKE it (holder = us, acquireTime = now,
             leaseTransitions + 1). Held by another and not expired: follow. Every write is a PUT of the
             object just read, carrying its metadata.resourceVersion, so the API server applies it only
             if nobody wrote in between: a 409 Conflict means someone else won, and we are not leading.
    stop()   ends the thread; ``release=True`` (a clean stop) then clears holderIdentity, so a follower
             takes over at its next step instead of waiting for the lease to expire.

``leading()`` is True only while the last successful renewal is younger than ``renew_deadline_s``, on our
monotonic clock, counted from *before* that renewal's request was sent. Another replica takes over only once
``renewTime + leaseDurationSeconds`` has passed, and ``renewTime`` is set before the same request, so a
leader that can no longer renew (partitioned from the API server, its thread stuck) stops acting
``lease_duration_s - renew_deadline_s`` before anyone else may start: no two replicas act at once, as long
as the nodes' wall clocks agree to within that margin. ``confirm()`` renews at once, for an actuator to call
just before it acts: the write both proves the lease is still ours (resourceVersion) and records, in the
Lease's annotations (``annotations`` callback), what a successor must know (the planner's last changes).

Identity: ``default_identity()``, the host name (a pod's name) and a random suffix, so a restarted pod with
the same name is a new candidate and never mistakes the old holder for itself.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

log = logging.getLogger("pdserve.planner")


def default_identity() -> str:
    return f"{socket.gethostname()}-{secrets.token_hex(4)}"


def micro_time(t: float) -> str:
    """A Lease's MicroTime (RFC 3339, always six fraction digits: the API server refuses fewer)."""
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(s: str | None) -> float | None:
    if not s:
        return None
    try:
        return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True, kw_only=True)
class LeaseConfig:
    namespace: str
    name: str
    identity: str
    lease_duration_s: int = 15  # leaseDurationSeconds: how long a silent holder keeps the lease
    renew_deadline_s: float = 10.0  # a leader that has not renewed for this long stops acting
    retry_period_s: float = 2.0  # between steps (renewals, or a follower's checks)

    def __post_init__(self) -> None:
        if not (self.namespace and self.name and self.identity):
            raise ValueError("a lease needs a namespace, a name and an identity")
        if not (isinstance(self.lease_duration_s, int) and self.lease_duration_s >= 1):
            raise ValueError(f"lease_duration_s must be a whole number >= 1, got {self.lease_duration_s!r}")
        if not 0 < self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError("need 0 < retry period < renew deadline < lease duration, got "
                             f"{self.retry_period_s}, {self.renew_deadline_s}, {self.lease_duration_s}")


class LeaderElector:
    """Campaigns for one Lease through ``api`` (``kubernetes.client.CoordinationV1Api``); module doc.
    ``on_change(leading)`` is called from the elector's thread when leadership is won or lost;
    ``annotations()`` gives annotations to write on the Lease with every write while we hold it."""

    def __init__(self, api, config: LeaseConfig, *, on_change: Callable[[bool], None] | None = None,
                 annotations: Callable[[], dict[str, str]] | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.api, self.config, self.on_change, self.annotations = api, config, on_change, annotations
        self.clock, self.wall = clock, wall
        self.holder: str | None = None  # the holder the last read saw
        self.seen_annotations: dict[str, str] = {}  # the Lease's annotations as last read or written
        self._leading = False
        self._renewed_at = -float("inf")  # our clock, before the last successful write's request
        self._lock = threading.Lock()  # one write at a time: our own writes never conflict
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- state
    def leading(self) -> bool:
        return self._leading and self.clock() - self._renewed_at < self.config.renew_deadline_s

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="pdserve-planner-lease", daemon=True)
        self._thread.start()

    def stop(self, *, release: bool = True, timeout: float | None = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if release:
            self.release()
        else:
            self._set_leading(False)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.step()
            self._stop.wait(self.config.retry_period_s)

    def step(self) -> bool:
        """One campaign step: acquire or renew if we can; True while leading after it."""
        with self._lock:
            self._step(renew_only=False)
            return self.leading()

    def confirm(self) -> bool:
        """Renew now (the actuator's fence before it acts): True only if this write made the lease ours."""
        with self._lock:
            return bool(self._step(renew_only=True)) and self.leading()

    # ---------------------------------------------------------------- the steps
    def _step(self, *, renew_only: bool) -> bool | None:
        """True: the lease is ours after this step; False: another's; None: the API did not answer."""
        before = self.clock()
        try:
            held = self._try(renew_only)
        except Exception as exc:  # noqa: BLE001 - the API server may be away for a while: try again
            log.warning("planner lease %s: %s: %s", self.config.name, type(exc).__name__, exc)
            held = None
        if held:
            self._renewed_at = before
            self._set_leading(True)
        elif held is False or (self._leading and not self.leading()):
            self._set_leading(False)  # lost: someone else holds it, or our deadline passed
        return held

    def _try(self, renew_only: bool) -> bool:
        """True: the lease is ours after this step; False: someone else's (or our write lost a race)."""
        from kubernetes.client.rest import ApiException

        c = self.config
        now = self.wall()
        try:
            lease = self._read()
        except ApiException as exc:
            if exc.status != 404 or renew_only:
                raise
            return self._create(now)
        spec = lease.setdefault("spec", {})
        self.holder = spec.get("holderIdentity") or None
        self.seen_annotations = dict(lease.get("metadata", {}).get("annotations") or {})
        if self.holder != c.identity:
            renewed = parse_time(spec.get("renewTime")) or 0.0
            expired = renewed + float(spec.get("leaseDurationSeconds") or c.lease_duration_s) < now
            if renew_only or (self.holder and not expired):
                return False
            spec["acquireTime"] = micro_time(now)
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
            log.info("planner lease %s: taking it over from %s", c.name, self.holder or "nobody")
        spec.update(holderIdentity=c.identity, leaseDurationSeconds=c.lease_duration_s,
                    renewTime=micro_time(now))
        return self._write(lease)

    def _read(self) -> dict:
        c = self.config
        resp = self.api.read_namespaced_lease(c.name, c.namespace, _preload_content=False)
        return json.loads(resp.data)

    def _create(self, now: float) -> bool:
        from kubernetes.client.rest import ApiException

        c = self.config
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": c.name, "namespace": c.namespace, "annotations": self._ours()},
                "spec": {"holderIdentity": c.identity, "leaseDurationSeconds": c.lease_duration_s,
                         "acquireTime": micro_time(now), "renewTime": micro_time(now), "leaseTransitions": 0}}
        try:
            self.api.create_namespaced_lease(c.namespace, body, _preload_content=False)
        except ApiException as exc:
            if exc.status == 409:  # AlreadyExists: another candidate created it first
                return False
            raise
        self.holder, self.seen_annotations = c.identity, dict(body["metadata"]["annotations"])
        log.info("planner lease %s: created, held by %s", c.name, c.identity)
        return True

    def _write(self, lease: dict) -> bool:
        """PUT the lease as read (its resourceVersion: a 409 means someone wrote it since)."""
        from kubernetes.client.rest import ApiException

        c = self.config
        meta = lease.setdefault("metadata", {})
        meta["annotations"] = {**(meta.get("annotations") or {}), **self._ours()}
        try:
            self.api.replace_namespaced_lease(c.name, c.namespace, lease, _preload_content=False)
        except ApiException as exc:
            if exc.status == 409:
                log.info("planner lease %s: another replica wrote it first (409 Conflict)", c.name)
                return False
            raise
        self.holder = lease["spec"].get("holderIdentity") or None
        self.seen_annotations = dict(meta["annotations"])
        return True

    def _ours(self) -> dict[str, str]:
        return dict(self.annotations()) if self.annotations is not None else {}

    def release(self) -> None:
        """Clear holderIdentity if the lease is still ours (a clean stop): followers need not wait it out."""
        c = self.config
        with self._lock:
            try:
                lease = self._read()
                if (lease.get("spec") or {}).get("holderIdentity") != c.identity:
                    return
                lease["spec"]["holderIdentity"] = None
                lease["spec"]["renewTime"] = micro_time(self.wall())
                if self._write(lease):
                    log.info("planner lease %s: released by %s", c.name, c.identity)
            except Exception as exc:  # noqa: BLE001 - it expires on its own
                log.warning("planner lease %s: release failed (%s); it expires in %d s", c.name, exc,
                            c.lease_duration_s)
            finally:
                self._set_leading(False)

    def _set_leading(self, leading: bool) -> None:
        was, self._leading = self._leading, leading
        if was != leading:
            log.info("planner lease %s: %s is %s", self.config.name, self.config.identity,
                     "the leader" if leading else "no longer the leader")
            if self.on_change is not None:
                self.on_change(leading)
