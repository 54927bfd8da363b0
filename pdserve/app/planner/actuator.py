"""The planner's actuators' shared rules, and the local one: ``pdserve up --autoscale`` applies each decision
to the cluster it runs. ``PoolActuator`` holds what every actuator does with a decision (what to apply,
cool-downs, hand-back, logging); a subclass says how many replicas a pool has and how to resize it:
``Actuator`` (here) through ``Cluster.scale``, ``k8s.KubernetesActuator`` through a Deployment's scale
subresource.

Lifecycle::

    Autoscaler.start()  a thread beside ``Cluster.serve()`` runs the planner's loop (``live.run``: the same
                        scrapes of the run directory's ``prometheus-targets.json`` as ``pdserve planner
                        run``); each window's ``Decision`` is logged, recorded, exported and handed to
    Actuator.apply()    which, for each pool whose target changed and differs from the workers the pool
                        has, calls ``cluster.scale(pool, target)``: the in-process call a ``pdserve scale``
                        request ends in. A scale-up returns once the router lists the new workers; a
                        scale-down takes the workers out of discovery first, waits until they are idle,
                        then drains them, so no request is cut. The loop waits while a scale runs.
    Autoscaler.stop()   ends the loop between windows (a scale in progress finishes first).

Cool-downs count from when a change *ended*: after each scale (applied or failed) the actuator tells the
planner when it finished (``Planner.follow(changed_at=)``), so a scale-up that took longer than the up
cool-down does not let the next one follow at once; and the actuator itself never changes a pool within
the planner's cool-down (up or down, by the direction) of its last change of that pool. A changed target
it does not apply (within the cool-down, or ``Cluster.scale`` failed) is handed back to the planner, so the
next window decides from the replicas the pool really has; so is a pool resized by hand (``pdserve
scale``).
Dry run (``--autoscale dry-run``): the same decisions, logged and printed, nothing applied and nothing
handed back (the planner goes on from its own targets, as ``planner run --dry-run`` does).

Every action is logged at INFO on the ``pdserve.planner`` logger with its decision (reason, inputs) and
the window's signals. The local actuator's cluster is anything with ``workers`` (pool -> its workers) and
``scale(pool, n)``: ``launcher.cluster.Cluster`` with either launcher.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import IO, Protocol

from pdserve.app.planner.live import SignalSource, run
from pdserve.app.planner.metrics import PlannerMetrics
from pdserve.app.planner.policy import Decision, Planner, PoolDecision
from pdserve.app.planner.signals import Signals

log = logging.getLogger("pdserve.planner")

APPLIED, DRY_RUN, COOL_DOWN, FAILED = "applied", "dry-run", "cool-down", "failed"
STANDBY = "standby"  # not applied: another replica of the planner is the one acting (k8s.py)


class Scalable(Protocol):
    """What the actuator needs of a cluster (``launcher.cluster.Cluster``)."""

    workers: dict[str, list]

    def scale(self, role: str, n: int) -> None: ...


@dataclass(frozen=True)
class Action:
    """What the actuator did with one pool's changed target: ``outcome`` is ``applied``, ``dry-run``
    (logged only), ``cool-down`` (not applied: within the cool-down of the pool's last change), ``standby``
    (not applied: not the leader) or ``failed`` (``error`` says why); ``started``/``finished`` on the
    actuator's clock; ``note`` what else a person should know of an applied change."""

    pool: str
    before: int
    target: int
    outcome: str
    started: float
    finished: float
    reason: str
    error: str = ""
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        """One line for a person: the planner's reason and what became of it."""
        what = {APPLIED: f"applied in {self.finished - self.started:.1f} s", DRY_RUN: "dry run: not applied",
                COOL_DOWN: f"not applied: {self.error}", FAILED: f"failed: {self.error}",
                STANDBY: f"standby: {self.error}"}[self.outcome]
        if self.note:
            what = f"{what}; {self.note}"
        return f"{self.pool} {self.reason} [{what}]"


class PoolActuator:
    """Applies a ``Decision``'s changed targets (module doc): the rules every actuator keeps. Subclasses give
    ``replicas(pool)`` (what the pool has now, read fresh each window) and ``resize(pool, n)`` (returns once
    the change is done, or raises; a string it returns is noted on the action)."""

    def __init__(self, planner: Planner, *, dry_run: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.planner, self.dry_run, self.clock = planner, dry_run, clock
        self.actions: deque[Action] = deque(maxlen=1000)  # the latest, for tests and a look in a debugger
        self._finished: dict[str, float] = {}  # pool -> when its last change (applied or failed) ended

    @property
    def mode(self) -> str:
        """How this actuator's decisions are logged: ``dry run`` or ``autoscale``."""
        return "dry run" if self.dry_run else "autoscale"

    def replicas(self, pool: str) -> int:
        raise NotImplementedError

    def resize(self, pool: str, n: int) -> str | None:
        raise NotImplementedError

    def apply(self, decision: Decision, signals: Signals | None = None) -> list[Action]:
        """Act on one window's decision; returns what was done (nothing for pools that hold)."""
        out = []
        for p in decision.pools:
            if self.dry_run:
                if p.direction != "hold":
                    now = self.clock()
                    out.append(self._done(Action(p.pool, p.current, p.target, DRY_RUN, now, now, p.reason),
                                          p, signals))
                continue
            have = self.replicas(p.pool)
            if p.direction == "hold" or p.target == have:
                if p.target != have:  # resized by hand, or a worker left for good: start from what is there
                    self.planner.follow(p.pool, have)
                continue
            out.append(self._done(self._scale(p, have), p, signals))
        return out

    def _scale(self, p: PoolDecision, have: int) -> Action:
        c = self.planner.config
        now = self.clock()
        up = p.target > have
        cool = c.up_cooldown_s if up else c.down_cooldown_s
        last = self._finished.get(p.pool)
        if last is not None and now - last < cool:
            self.planner.follow(p.pool, have, changed_at=last)
            why = (f"{now - last:.0f} s since the last change of {p.pool} ended, {'up' if up else 'down'} "
                   f"cool-down {cool:g} s")
            return Action(p.pool, have, p.target, COOL_DOWN, now, now, p.reason, why)
        log.info("autoscale: scaling %s %d -> %d: %s", p.pool, have, p.target, p.reason)
        note = None
        try:
            note = self.resize(p.pool, p.target)
        except Exception as exc:  # noqa: BLE001 - a failed scale must not end autoscaling
            log.exception("autoscale: scaling %s to %d failed", p.pool, p.target)
            outcome, error = FAILED, f"{type(exc).__name__}: {exc}"
        else:
            outcome, error = APPLIED, ""
        self._finished[p.pool] = self.clock()
        self.planner.follow(p.pool, self.replicas(p.pool), changed_at=self._finished[p.pool])
        return Action(p.pool, have, p.target, outcome, now, self._finished[p.pool], p.reason, error,
                      note or "")

    def _done(self, action: Action, p: PoolDecision, signals: Signals | None) -> Action:
        self.actions.append(action)
        log.info("autoscale: %s %s", action.line(), json.dumps(
            {"action": action.to_dict(), "decision": p.to_dict(),
             "signals": signals.to_dict() if signals is not None else None}))
        return action


class Actuator(PoolActuator):
    """The local actuator: a pool's replicas are ``cluster.workers[pool]``, a resize is ``cluster.scale``."""

    def __init__(self, cluster: Scalable, planner: Planner, *, dry_run: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(planner, dry_run=dry_run, clock=clock)
        self.cluster = cluster

    def replicas(self, pool: str) -> int:
        return len(self.cluster.workers.get(pool, ()))

    def resize(self, pool: str, n: int) -> None:
        self.cluster.scale(pool, n)


class Autoscaler:
    """The planner's loop in a thread: every ``interval`` a window from ``source``, a decision from the
    actuator's planner, then ``metrics.record``, a line in ``record`` (the window's signals, a trace for
    ``planner explain``), ``actuator.apply`` and each action's line to ``echo``."""

    def __init__(self, actuator: PoolActuator, source: SignalSource, *, interval: float,
                 windows: int | None = None, metrics: PlannerMetrics | None = None,
                 record: IO[str] | None = None, echo: Callable[[str], None] | None = None) -> None:
        if not interval > 0:
            raise ValueError(f"the interval must be > 0, got {interval}")
        self.actuator, self.source, self.interval, self.windows = actuator, source, interval, windows
        self.metrics, self.record, self.echo = metrics, record, echo
        self.last: Decision | None = None  # the latest window's decision
        self.seen = 0  # windows decided
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def actions(self) -> Sequence[Action]:
        return self.actuator.actions

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="pdserve-autoscale", daemon=True)
        self._thread.start()

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float | None = None) -> bool:
        """End the loop; waits for a scale in progress. True once the thread is gone."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _loop(self) -> None:
        try:
            run(self.source, self.actuator.planner, interval=self.interval, on_window=self._on_window,
                windows=self.windows, stop=self._stop)
        except Exception:  # noqa: BLE001 - the cluster goes on at its current size
            log.exception("autoscale: the planner's loop failed; the pools keep their sizes")
        finally:
            self.source.close()

    def _on_window(self, signals: Signals, decision: Decision) -> None:
        try:
            self.last, self.seen = decision, self.seen + 1
            log.info("planner decision (%s): %s", self.actuator.mode,
                     json.dumps({"signals": signals.to_dict(), "decision": decision.to_dict()}))
            if self.metrics is not None:
                self.metrics.record(decision)
            if self.record is not None:
                self.record.write(json.dumps(signals.to_dict()) + "\n")
                self.record.flush()
            for action in self.actuator.apply(decision, signals):
                if self.echo is not None:
                    self.echo(f"{time.strftime('%H:%M:%S')} autoscale: {action.line()}")
        except Exception:  # noqa: BLE001 - one bad window does not end autoscaling
            log.exception("autoscale: window failed")
