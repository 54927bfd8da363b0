"""Worker deaths and restarts as the router sees them: one log line each, and two counters.

The directory reports every poll: ``answered(handle, stats)`` when a worker replied, ``lost(handle,
why)`` when it did not. A worker that stops answering is logged once as down, with its incarnation
and the number of this router's requests bound to it at that moment (they fail over through
router/migration.py). A worker that answers under a new incarnation id at an address is a restart
(by the launcher's supervisor, the kubelet, or an operator): logged with both incarnations. Nothing
of the old incarnation is reused: the placer's view drops its load, prefix entries and session
bindings on the incarnation change (router/state/workers.py), and the KV plane keys its connections
and NIXL agents by the process's own instance id (kvtransfer/transport.py).

Counters: ``pdserve_router_worker_deaths_total{pool}`` and ``pdserve_router_worker_restarts_total{pool}``.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger(__name__)


class WorkerLifecycle:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        registry = registry if registry is not None else CollectorRegistry()
        self.deaths = Counter("pdserve_router_worker_deaths", "Workers that stopped answering (dead process, "
                              "broken channel)", ["pool"], registry=registry)
        self.restarts = Counter("pdserve_router_worker_restarts", "Workers that came back under a new "
                                "incarnation", ["pool"], registry=registry)
        self._incarnation: dict[str, str] = {}  # address -> incarnation last seen answering
        self._down: set[str] = set()             # addresses logged as down, not answering since

    def answered(self, h, stats) -> None:
        prev = self._incarnation.get(h.address)
        if prev is not None and prev != stats.incarnation:
            if h.address not in self._down:  # came back between two polls: its death went unseen
                self.deaths.labels(pool=h.role).inc()
            log.warning("%s worker %s at %s restarted: incarnation %s -> %s (nothing of the old one is "
                        "reused)", h.role, stats.worker_id, h.address, prev, stats.incarnation)
            self.restarts.labels(pool=h.role).inc()
        elif h.address in self._down:
            log.warning("%s worker %s at %s answers again (incarnation %s)", h.role, stats.worker_id,
                        h.address, stats.incarnation)
        self._incarnation[h.address] = stats.incarnation
        self._down.discard(h.address)

    def lost(self, h, why: str) -> None:
        if h.address in self._down or h.address not in self._incarnation:
            return
        self._down.add(h.address)
        self.deaths.labels(pool=h.role).inc()
        log.warning("%s worker %s (incarnation %s) at %s is down: %s; %d request(s) of this router in "
                    "flight on it", h.role, h.worker_id or "?", self._incarnation[h.address], h.address, why,
                    h.inflight)

    def forget(self, address: str) -> None:
        """A worker removed by discovery (scale-down): its absence is no death."""
        self._incarnation.pop(address, None)
        self._down.discard(address)
