"""The planner's Prometheus metrics (``pdserve planner run --metrics-port``): each decision and its inputs.

* ``pdserve_planner_target_replicas{pool}`` (gauge): the replicas the planner wants;
* ``pdserve_planner_required_replicas{pool}`` (gauge): the replicas the load needs, a real number before
  the hysteresis band, the cool-downs and the bounds;
* ``pdserve_planner_demand_tokens_per_second{pool}`` (gauge): the demand planned for, prompt tokens to
  compute (prefill) or output tokens (decode), backlog not included;
* ``pdserve_planner_capacity_tokens_per_second{pool}`` (gauge): what one worker serves within the SLO,
  as the capacity model has it;
* ``pdserve_planner_decisions_total{pool,direction}`` (counter): decisions taken, ``up``, ``down`` or
  ``hold``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.app.planner.policy import Decision


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = self.registry = registry
        self.target = Gauge("pdserve_planner_target_replicas", "Replicas the planner wants", ["pool"],
                            registry=r)
        self.required = Gauge("pdserve_planner_required_replicas", "Replicas the load needs (before the "
                              "hysteresis band, cool-downs and bounds)", ["pool"], registry=r)
        self.demand = Gauge("pdserve_planner_demand_tokens_per_second", "Token demand planned for: prompt "
                            "tokens to compute (prefill), output tokens (decode)", ["pool"], registry=r)
        self.capacity = Gauge("pdserve_planner_capacity_tokens_per_second", "Tokens per second one worker "
                              "serves within the SLO (the capacity model)", ["pool"], registry=r)
        self.decisions = Counter("pdserve_planner_decisions", "Planner decisions by pool and direction (up, "
                                 "down, hold)", ["pool", "direction"], registry=r)

    def record(self, decision: Decision) -> None:
        for p in decision.pools:
            self.target.labels(p.pool).set(p.target)
            self.required.labels(p.pool).set(p.required)
            for gauge, key in ((self.demand, "demand_tokens_per_s"),
                               (self.capacity, "capacity_tokens_per_s")):
                v = p.inputs.get(key)
                if isinstance(v, (int, float)):
                    gauge.labels(p.pool).set(v)
            self.decisions.labels(p.pool, p.direction).inc()


def planner_registry() -> PlannerMetrics:
    """The planner's metrics on a registry of their own (``.registry`` to serve, ``.record(decision)``)."""
    return PlannerMetrics(CollectorRegistry())
