"""Shared pieces of the in-process kvtransfer tests: whether NIXL imports, a bounded event-loop run,
the leak checks scenarios end with (no expectations, sends or NIXL transfers left -- or, for TCP, peer
handles and load -- and a closed transport whose every counter is zero), and an exact socket read."""

from __future__ import annotations

import asyncio
import socket

import pytest

from kvtransfer import BackendUnavailable, nixl_backend

try:
    nixl_backend.import_nixl()
    NIXL_ERROR = None
except BackendUnavailable as exc:  # reported, not hidden: TCP-only tests still run
    NIXL_ERROR = str(exc)
needs_nixl = pytest.mark.skipif(NIXL_ERROR is not None, reason=f"NIXL not importable: {NIXL_ERROR}")


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def closed_clean(ts, *, ready, fields: tuple[str, ...], polls: int) -> None:
    """The one leak check: poll (up to ``polls`` x 10 ms) until ``ready(stats)`` holds on every transport,
    assert ``fields`` are zero on each, close it, and assert every counter of the closed one is zero."""
    for _ in range(polls):
        if all(ready(t.stats()) for t in ts):
            break
        await asyncio.sleep(0.01)
    for t in ts:
        s = t.stats()
        assert tuple(s[f] for f in fields) == (0,) * len(fields), s
        await t.close()
        s = t.stats()
        assert s == {k: 0 for k in s}, s


def _idle(s: dict) -> bool:
    return s["expectations"] == 0 and s["unsettled"] == 0 and s["sends"] == 0


async def leak_free(*ts, polls: int = 200) -> None:
    """Wait for both sides to settle, assert nothing is left, close, assert every counter is zero."""
    await closed_clean(ts, ready=_idle, fields=("expectations", "unsettled", "sends", "nixl_xfers"),
                       polls=polls)


async def settled(*transports) -> None:
    """``leak_free`` for TCP transports: also no peer connection handle or load left behind (their
    NIXL counter is always 0)."""
    fields = ("expectations", "unsettled", "sends", "peer_handles", "peer_load", "peer_queued")
    await closed_clean(transports, ready=_idle, fields=fields, polls=300)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = sock.recv(n, socket.MSG_WAITALL)
    if len(data) != n:
        raise ConnectionResetError("peer closed")
    return data
