"""Receiving side, NIXL half: polling the agent for notifications (completions and handshake probes).

Without NIXL's progress thread, UCX makes progress -- wires up a new sender, lands the bytes of a WRITE
that travels over UCX's TCP transport, delivers notifications -- only inside our calls into the agent.
So this task's schedule is the receiver's NIXL latency::

    idle (no NIXL transfer bound, no probe waiting,   wait for a kick, at most 10 ms between polls
      no hold from this process's sending side)
    kick() (HELLO wanting NIXL, PROBE, BEGIN on NIXL) poll at once, then without sleeping for
      or a notification with more NIXL work pending   nixl_spin_s: a small transfer completes inside it
    a notification leaving nothing pending            back to idle at once (no spinning for nobody)
    busy after the spin window                        poll every nixl_poll_interval_s (asyncio.sleep:
                                                      really >= ~1 ms; nixl_poll_nap: a nap, see poll_pause)

Before, an idle receiver slept 10 ms between polls and only switched to the short interval on its next
wake-up, so a transfer announced right after a poll waited up to 10 ms for its completion to be seen.

Notifications: {"t": "probe", nonce} answers a PROBE on the side channel (either order: notification or
PROBE frame first); {"t": "done", rid, n, xid?} from the agent named in BEGIN with n = the expected bytes
(and BEGIN's xid, if it named one) completes that expectation (Receiver.complete_nixl, which also takes
the sender's WROTE frame: whichever comes first, the other finds nothing); anything else is logged and
dropped. With WROTE-capable senders the notification is the fallback, so this poller's ~1 ms asyncio
floor no longer sits on the completion path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from .protocol import Msg, parse_notif

log = logging.getLogger("kvtransfer.rx")
_IDLE_S = 0.01
_TIMER_RESOLUTION_S = 0.001  # asyncio's epoll timeouts are whole milliseconds, rounded up


def fine_timer_slack() -> bool:
    """Ask Linux for a 1 ns timer slack on the calling thread (prctl PR_SET_TIMERSLACK): its short
    ``time.sleep`` naps then last about what they ask for, not that plus the default 50 us slack.
    Per thread, no privilege needed; False where unsupported (not Linux, no libc)."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(29, ctypes.c_ulong(1), 0, 0, 0) == 0  # 29 = PR_SET_TIMERSLACK
    except (OSError, AttributeError):
        return False


async def poll_pause(config, spinning: bool = False) -> None:
    """One pause between two polls of pending NIXL work (see TransportConfig.nixl_poll_nap): a bare
    yield while spinning, a nap of nixl_poll_interval_s in this thread when asked for one below the
    event loop's timer resolution, else asyncio.sleep(nixl_poll_interval_s) (>= ~1 ms in practice)."""
    interval = config.nixl_poll_interval_s
    if spinning:
        await asyncio.sleep(0)
    elif config.nixl_poll_nap and interval < _TIMER_RESOLUTION_S:
        time.sleep(interval)
        await asyncio.sleep(0)
    else:
        await asyncio.sleep(interval)


class NixlNotifications:
    def __init__(self, receiver) -> None:
        self.rx = receiver
        self.config = receiver.config
        self.probe_seen: dict[str, float] = {}
        self.probe_waiting: dict[str, tuple[object, float]] = {}
        self._spin_until = 0.0
        self._holds = 0
        self._wake = asyncio.Event()
        self._task = receiver.loop.create_task(self._run(), name="kvtransfer-nixl-poll")

    def kick(self) -> None:
        """Something NIXL is about to happen: poll now and without sleeping for nixl_spin_s."""
        self._spin_until = time.monotonic() + self.config.nixl_spin_s
        self._wake.set()

    def hold(self) -> None:
        """This process's sending side needs UCX progress too (wire-up during a handshake, a WRITE and
        its notification leaving): poll as if busy until unhold(). The agent is one UCX worker, so this
        one poller progresses both directions (and only it may take notifications off the agent)."""
        self._holds += 1
        self.kick()

    def unhold(self) -> None:
        self._holds -= 1

    def on_probe(self, conn, nonce: str) -> None:
        if self.probe_seen.pop(nonce, None) is not None:
            conn.send(Msg.PROBE_OK, {"nonce": nonce})
        else:
            self.probe_waiting[nonce] = (conn, time.monotonic())
            self.kick()

    def forget_conn(self, conn) -> None:
        for nonce in [n for n, (c, _t) in self.probe_waiting.items() if c is conn]:
            del self.probe_waiting[nonce]

    def close(self) -> None:
        self._task.cancel()

    def _busy(self) -> bool:
        return (self._holds > 0 or bool(self.probe_waiting)
                or any(e.backend == "nixl" for e in self.rx.expectations.values()))

    async def _run(self) -> None:
        last_sweep = time.monotonic()
        while True:
            got = False
            for agent, msgs in self.rx.nixl.poll_notifs().items():
                agent = agent.decode() if isinstance(agent, bytes) else str(agent)
                for raw in msgs:
                    got = True
                    self._on_notif(agent, raw)
            now = time.monotonic()
            if got:
                # More NIXL work pending: keep spinning; none (the usual case after a completion): stop
                # spinning at once rather than burn the rest of the window on a shared CPU.
                self._spin_until = now + self.config.nixl_spin_s if self._busy() else 0.0
            if now - last_sweep > 1.0:
                last_sweep = now
                self._sweep(now)
            if now < self._spin_until or self._busy():
                await poll_pause(self.config, spinning=now < self._spin_until)
            else:
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), _IDLE_S)

    def _sweep(self, now: float) -> None:
        cutoff = now - 60  # probes never matched (a sender that fell back to TCP)
        for nonce in [n for n, t in self.probe_seen.items() if t < cutoff]:
            del self.probe_seen[nonce]
        stale = now - self.config.handshake_timeout_s
        for nonce in [n for n, (_c, t) in self.probe_waiting.items() if t < stale]:
            del self.probe_waiting[nonce]

    def _on_notif(self, agent: str, raw: bytes) -> None:
        meta = parse_notif(raw)
        if meta is None:
            log.warning("kvtransfer: ignoring foreign NIXL notification from %s: %r", agent, raw[:80])
            return
        if meta.get("t") == "probe" and isinstance(meta.get("nonce"), str):
            waiting = self.probe_waiting.pop(meta["nonce"], None)
            if waiting is not None:
                waiting[0].send(Msg.PROBE_OK, {"nonce": meta["nonce"]})
            else:
                self.probe_seen[meta["nonce"]] = time.monotonic()
            return
        rid = meta.get("rid")
        exp = self.rx.expectations.get(rid) if isinstance(rid, str) else None
        xid = meta.get("xid")
        if (exp is None or exp.backend != "nixl" or exp.sender_agent != agent
                or (exp.xid is not None and xid != exp.xid)):
            # A sender that tags its transfers (xid) also sends WROTE frames, which usually win: expected.
            level = logging.DEBUG if isinstance(xid, str) else logging.INFO
            log.log(level, "kvtransfer: NIXL completion for %r from %s matches no transfer (completed by "
                    "WROTE, or aborted?)", rid, agent)
            return
        n = meta.get("n")
        self.rx.complete_nixl(exp, n if isinstance(n, int) and not isinstance(n, bool) else -1, None, "notif")
