"""Router placement: choose the (prefill, decode) pair for each request.

The router servicer builds one ``Placer(PlacerConfig(...), store)`` and calls ``place`` (sync,
cheap) or ``await aplace`` (consults the shared store for the session binding first), feeds every
outcome back through ``on_result`` and keeps the worker view fresh with ``update_workers`` /
``update_load`` / ``mark_unhealthy``. See docs/router.md.
"""

from router.placement.config import PlacerConfig
from router.placement.placer import Placer
from router.placement.types import (
    POLICIES,
    NoWorkersAvailable,
    Outcome,
    Placement,
    PlacementRequest,
    WorkerInfo,
    WorkerLoad,
)

__all__ = [
    "POLICIES",
    "NoWorkersAvailable",
    "Outcome",
    "Placement",
    "PlacementRequest",
    "Placer",
    "PlacerConfig",
    "WorkerInfo",
    "WorkerLoad",
]
