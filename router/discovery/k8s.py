"""K8sDiscovery: prefill/decode workers from the EndpointSlices of their Services.

For each role, one watcher thread runs the usual list-then-watch loop of the ``kubernetes``
client (its API is blocking, so it lives off the event loop):

1. LIST EndpointSlices in the namespace by label selector (e.g.
   ``kubernetes.io/service-name=pdserve-decode``); remember the list's ``resourceVersion``. The
   group version is the one the server serves (asked before every list): ``discovery.k8s.io/v1``
   from Kubernetes 1.21, ``v1beta1`` on 1.17-1.20 (removed in 1.25), so one router image runs on both.
2. WATCH from that version: ADDED/MODIFIED replace a slice's endpoints, DELETED drops them;
   every event's (and bookmark's) ``resourceVersion`` moves the resume point forward. The watch
   ends after ``watch_timeout_s`` and resumes from the last version.
3. ``410 Gone`` (the version was compacted away; as an ERROR event or an HTTP status) means
   events were lost: re-LIST (step 1). Any other error: capped exponential backoff with jitter,
   then re-LIST. The last good view keeps serving meanwhile.

After every change the union of both roles' ready endpoints is handed to ``on_update`` on the
event loop. A worker's id is its Pod name (``targetRef``), its incarnation the Pod UID, so a
replaced Pod is a new incarnation. An endpoint that is not ready, or terminating, is not a
worker (Kubernetes' readiness probe is the worker's health check). The KV-layout hash is not in
an EndpointSlice: combine with Redis leases if the router must filter on it (workers refuse a
layout mismatch at the transfer handshake anyway).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass

from router.placement.types import WorkerInfo

log = logging.getLogger(__name__)

GROUP = "discovery.k8s.io"
VERSIONS = ("v1", "v1beta1")  # EndpointSlice versions this reader understands, preferred first


@dataclass(frozen=True, kw_only=True)
class K8sDiscoveryConfig:
    namespace: str = "default"
    prefill_selector: str = ""
    decode_selector: str = ""
    # EndpointSlice port to dial: the chart's pool Services name their gRPC port "grpc" (a slice lists the
    # Service's ports in no fixed order: kv and metrics too). "" = the first port listed.
    port_name: str = "grpc"
    kubeconfig: str = ""  # "" = in-cluster service account, else this kubeconfig file
    watch_timeout_s: int = 60
    backoff_base_s: float = 0.2
    backoff_max_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.prefill_selector or not self.decode_selector:
            raise ValueError("k8s discovery needs --prefill-selector and --decode-selector")
        if self.watch_timeout_s <= 0 or self.backoff_base_s <= 0 or self.backoff_max_s < self.backoff_base_s:
            raise ValueError("need watch_timeout_s > 0 and 0 < backoff_base_s <= backoff_max_s")


def served_version(api_client) -> str:
    """The EndpointSlice version the API server serves (the first of ``VERSIONS`` it lists)."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    try:
        group = client.DiscoveryApi(api_client).get_api_group()
    except ApiException as e:
        if e.status != 404:
            raise
        raise RuntimeError(f"the API server serves no {GROUP} group: EndpointSlices need Kubernetes >= 1.17 "
                           f"(or run the router with --discovery redis)") from None
    served = [v.version for v in group.versions or []]
    for v in VERSIONS:
        if v in served:
            return v
    raise RuntimeError(f"the API server serves {GROUP} {served}, none of {list(VERSIONS)}")


class _VersionedPaths:
    """An ApiClient whose ``discovery.k8s.io/v1`` paths go to another served version. The kubernetes
    package generates only v1's DiscoveryV1Api; v1beta1's list and watch take the same parameters and
    return objects v1's models read (v1beta1's ``topology`` is ignored, its ``ready`` kept)."""

    def __init__(self, inner, version: str) -> None:
        self._inner = inner
        self._prefix = f"/apis/{GROUP}/{version}/"

    def param_serialize(self, *args, **kwargs):
        path = kwargs.get("resource_path")
        if path is not None:
            kwargs["resource_path"] = path.replace(f"/apis/{GROUP}/v1/", self._prefix, 1)
        return self._inner.param_serialize(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def slice_api(api_client, version: str):
    """A DiscoveryV1Api whose EndpointSlice calls use ``version``."""
    from kubernetes import client

    return client.DiscoveryV1Api(api_client if version == "v1" else _VersionedPaths(api_client, version))


def _get(obj, name: str, default=None):
    return getattr(obj, name, default) if obj is not None else default


def slice_workers(role: str, eps, port_name: str = "") -> list[WorkerInfo]:
    """Ready, non-terminating endpoints of one V1EndpointSlice as workers of ``role``."""
    ports = _get(eps, "ports") or []
    port = None
    for p in ports:
        if not port_name or _get(p, "name") == port_name:
            port = _get(p, "port")
            break
    if port is None:
        return []
    out = []
    for ep in _get(eps, "endpoints") or []:
        cond = _get(ep, "conditions")
        # ready=None means "unknown"; the API asks consumers to treat that as ready.
        if _get(cond, "ready") is False or _get(cond, "terminating") is True:
            continue
        addrs = _get(ep, "addresses") or []
        if not addrs:
            continue
        host = addrs[0]
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        ref = _get(ep, "target_ref")
        wid = _get(ref, "name") or f"{role}@{addr}"
        out.append(WorkerInfo(worker_id=wid, role=role, address=addr, incarnation=_get(ref, "uid") or ""))
    return out


class _RoleWatcher:
    def __init__(self, owner: K8sDiscovery, role: str, selector: str) -> None:
        self.owner = owner
        self.role = role
        self.selector = selector
        self.slices: dict[str, list[WorkerInfo]] = {}
        self.lists = 0  # how many times the full list was fetched (1 + re-lists)
        self.gone = 0  # 410s seen
        self.resource_version: str | None = None
        self._watch = None

    def _list(self, api) -> None:
        cfg = self.owner.cfg
        res = api.list_namespaced_endpoint_slice(cfg.namespace, label_selector=self.selector)
        self.lists += 1
        self.slices = {s.metadata.name: slice_workers(self.role, s, cfg.port_name) for s in res.items or []}
        self.resource_version = res.metadata.resource_version
        self.owner._changed()

    def _versioned_api(self):
        version = served_version(self.owner.api_client)
        if version != self.owner.api_version:
            log.info("%s discovery: EndpointSlices through %s/%s", self.role, GROUP, version)
            self.owner.api_version = version
        return slice_api(self.owner.api_client, version)

    def run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.rest import ApiException

        cfg = self.owner.cfg
        failures = 0
        need_list = True
        api = None
        while not self.owner._stop.is_set():
            try:
                if need_list:
                    api = self._versioned_api()
                    self._list(api)
                    need_list = False
                self._watch = w = watch.Watch()
                for ev in w.stream(api.list_namespaced_endpoint_slice, cfg.namespace,
                                   label_selector=self.selector, resource_version=self.resource_version,
                                   timeout_seconds=cfg.watch_timeout_s, allow_watch_bookmarks=True,
                                   _request_timeout=cfg.watch_timeout_s + 5):
                    kind, obj = ev["type"], ev["object"]
                    if kind in ("ADDED", "MODIFIED"):
                        self.slices[obj.metadata.name] = slice_workers(self.role, obj, cfg.port_name)
                    elif kind == "DELETED":
                        self.slices.pop(obj.metadata.name, None)
                    if w.resource_version:
                        self.resource_version = w.resource_version
                    if kind != "BOOKMARK":
                        self.owner._changed()
                    if self.owner._stop.is_set():
                        w.stop()
                failures = 0
            except ApiException as e:
                if e.status == 410:
                    self.gone += 1
                    log.info("%s EndpointSlice watch: 410 Gone at %s, re-listing", self.role,
                             self.resource_version)
                    need_list = True
                    continue
                failures = self._backoff(failures, e)
                need_list = True
            except Exception as e:  # noqa: BLE001 - network errors come in many types; keep serving
                failures = self._backoff(failures, e)
                need_list = True

    def _backoff(self, failures: int, err: Exception) -> int:
        cfg = self.owner.cfg
        failures += 1
        delay = min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** (failures - 1)) * random.uniform(0.5, 1.0)
        log.warning("%s EndpointSlice list/watch failed (%s); retrying in %.2fs", self.role, err, delay)
        self.owner.errors += 1
        if self.owner._on_error is not None:
            self.owner._on_error("k8s")
        self.owner._stop.wait(delay)
        return failures


class K8sDiscovery:
    def __init__(self, cfg: K8sDiscoveryConfig, *, api_client=None,
                 on_error: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        if api_client is None:
            from kubernetes import client, config

            if cfg.kubeconfig:
                api_client = config.new_client_from_config(config_file=cfg.kubeconfig)
            else:
                config.load_incluster_config()
                api_client = client.ApiClient()
        self.api_client = api_client
        self.errors = 0
        self.api_version = ""  # the discovery.k8s.io version in use, once the server was asked
        self._on_error = on_error
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.watchers = [_RoleWatcher(self, "prefill", cfg.prefill_selector),
                         _RoleWatcher(self, "decode", cfg.decode_selector)]
        self._emit: Callable[[list[WorkerInfo]], None] | None = None
        self._last: list[WorkerInfo] | None = None

    def current(self) -> list[WorkerInfo]:
        seen: dict[str, WorkerInfo] = {}
        for wt in self.watchers:
            for name in sorted(wt.slices):
                for w in wt.slices[name]:
                    seen.setdefault(w.worker_id, w)  # a Pod listed by two slices mid-migration
        return sorted(seen.values(), key=lambda w: w.worker_id)

    def _changed(self) -> None:
        with self._lock:
            cur = self.current()
            if cur == self._last:
                return
            self._last = cur
        if self._emit is not None:
            self._emit(cur)

    async def run(self, on_update: Callable[[list[WorkerInfo]], None]) -> None:
        loop = asyncio.get_running_loop()
        self._emit = lambda ws: loop.call_soon_threadsafe(on_update, ws)
        threads = [asyncio.to_thread(wt.run) for wt in self.watchers]
        try:
            await asyncio.gather(*threads)
        finally:
            self.stop()

    def stop(self) -> None:
        """Ask the watcher threads to end (each returns within ``watch_timeout_s``)."""
        self._stop.set()
        for wt in self.watchers:
            if wt._watch is not None:
                wt._watch.stop()
