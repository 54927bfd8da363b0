"""The asyncio event loop a serving process runs on (``--event-loop``, ``PDSERVE_EVENT_LOOP``).

``auto`` (the default) runs every role on uvloop where it is installed (a dependency of the package
on Linux) and on asyncio's own loop otherwise; ``uvloop`` insists on it, ``asyncio`` keeps the
standard loop. uvloop implements the loop's callbacks, timers, futures' wake-ups and socket I/O in C
(libuv), and a router spends most of its CPU on exactly those: per relayed message, gRPC's asyncio
layer wakes the loop, resolves a future and resumes a coroutine (docs/cluster.md, "CPU cost"). gRPC's
asyncio stack drives its completion queue from a poller thread that wakes the loop through a socket,
which works on any loop implementation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory ``asyncio.Runner`` takes for ``choice`` (None: asyncio's own loop). Raises ValueError
    for ``uvloop`` when it is not installed."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ValueError("--event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return None
    return uvloop.new_event_loop


def run(coro, choice: str = "auto"):
    """``coro`` run to completion on a new loop of ``choice`` (``asyncio.run`` on uvloop where it is
    installed): the load generator's client side, whose CPU shares the box with what it measures."""
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(coro)
