"""How a NIXL transfer's completion reaches the receiver: the sender's WROTE frame on the side channel, the
NIXL notification, or both (first one wins, the other is dropped); older receivers without CAP_WROTE.

The receiver's notification handling is monkeypatched to suppress or hold back completions, so which path
completed a transfer is decided by the test, never by timing."""

import asyncio

import pytest
import torch
from kvtransfer_testkit import leak_free, needs_nixl, run

import kvtransfer.receiver as rxmod
from bench.kv_peer_proc import fill_random
from engine.kv_layout import KVLayout
from kvtransfer import (
    InvalidTransfer,
    TransferAborted,
    TransferTimeout,
    make_transport,
)
from kvtransfer.protocol import parse_notif

pytestmark = pytest.mark.timeout(90)

pytestmark = [pytestmark, needs_nixl]

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, block_size=16, dtype="bfloat16")
# The sender's fast wait is on for VRAM only by default; here (DRAM) it is turned on explicitly.
FAST = {"nixl_fast_wait_mem": ("DRAM", "VRAM")}




async def until(cond, what: str):
    for _ in range(2000):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


def same(dst, src, d, s):
    return torch.equal(dst[:, d].view(torch.uint8), src[:, s].view(torch.uint8))


class NotifTap:
    """Wraps the receiver's notification handler: counts "done" notifications and either passes them on,
    or drops them (as if the NIXL notification never arrived: the WROTE frame must complete alone)."""

    def __init__(self, monkeypatch, transport, drop: bool) -> None:
        self.done = 0
        notifs = transport.receiver.notifs
        orig = notifs._on_notif

        def tap(agent, raw):
            meta = parse_notif(raw)
            if meta is not None and meta.get("t") == "done":
                self.done += 1
                if drop:
                    return
            orig(agent, raw)
        monkeypatch.setattr(notifs, "_on_notif", tap)


def count_completions(monkeypatch, transport) -> list[str]:
    rx, done = transport.receiver, []
    orig = rx._complete

    def counted(exp):
        done.append(exp.request_id)
        orig(exp)
    monkeypatch.setattr(rx, "_complete", counted)
    return done


# nixl_prebuild off: one WRITE per push, the final one carrying the notification (the path before
# prebuilt per-layer WRITEs, still there when prepared lists are off or a config turns it off).
ONE_WRITE = {"nixl_prebuild": False}


@pytest.mark.parametrize("cfg", [{}, FAST, {**FAST, "nixl_fast_wait_nap_s": 0.0}, ONE_WRITE],
                         ids=["default", "fast_wait", "fast_wait_nap0", "one_write_per_push"])
def test_wrote_frame_completes_without_nixl_notifications(monkeypatch, cfg):
    """The WROTE frame alone completes one-shot and streamed sends. Prebuilt per-layer WRITEs (default)
    carry no notification and, with a WROTE-capable receiver, none is sent after them; one WRITE per
    push attaches it to the final WRITE (dropped here by the tap)."""
    async def main():
        src, dst = LAYOUT.allocate(16), LAYOUT.allocate(24)
        fill_random(src, 11)
        a = await make_transport("nixl", LAYOUT, src, **cfg).start()
        b = await make_transport("nixl", LAYOUT, dst, **cfg).start()
        tap = NotifTap(monkeypatch, b, drop=True)
        done = count_completions(monkeypatch, b)
        ep = b.endpoint()
        # One-shot, scattered ids.
        s_ids, d_ids = [0, 1, 2, 9, 4], [5, 6, 7, 20, 1]
        exp = b.expect("one", d_ids, timeout=20)
        res = await a.start_send("one", ep, s_ids, d_ids).wait()
        assert res["backend"] == "nixl" and (await exp.wait())["bytes"] == res["bytes"]
        assert "wrote" in exp.timeline and "notif" not in exp.timeline
        assert all(same(dst, src, d, s) for s, d in zip(s_ids, d_ids, strict=True))
        # Layer-wise streaming: the completion of the final push, also with finish() after it.
        exps = {rid: b.expect(rid, [10 + i], timeout=20) for i, rid in enumerate(["l0", "l1"])}
        h0 = a.start_send("l0", ep, [10], [10], layers=[0, 1])
        h1 = a.start_send("l1", ep, [11], [11], layers=[0])
        h0.push_layers([2, 3], final=True)
        h1.push_layers([1, 2])
        await asyncio.sleep(0)
        h1.push_layers([3])
        h1.finish()
        await asyncio.gather(h0.wait(), h1.wait(), *(e.wait() for e in exps.values()))
        assert same(dst, src, 10, 10) and same(dst, src, 11, 11)
        assert all("wrote" in e.timeline for e in exps.values())
        assert sorted(done) == ["l0", "l1", "one"]
        if cfg.get("nixl_prebuild", True):
            await leak_free(a, b)  # nothing is left to arrive: no notification was sent
            assert tap.done == 0
        else:
            # Only the attached notifications (one-shot, final push) went out: none after the WRITEs.
            await until(lambda: tap.done >= 2, "attached notifications arrive")
            await leak_free(a, b)
    run(main())


@pytest.mark.parametrize("first", ["wrote", "notif"])
def test_frame_and_notification_complete_once(monkeypatch, first):
    """Both completions arrive; whichever is first completes, the other finds nothing (no second DONE, no
    error to the sender). A retry under the same request id is not completed by the first one's."""
    async def main():
        src, dst = LAYOUT.allocate(8), LAYOUT.allocate(8)
        fill_random(src, 12)
        a = await make_transport("nixl", LAYOUT, src, **FAST, **ONE_WRITE).start()  # both completions
        b = await make_transport("nixl", LAYOUT, dst, **FAST).start()
        rx = b.receiver
        done = count_completions(monkeypatch, b)
        held = {"wrote": [], "notif": []}
        orig = {"wrote": rx._on_wrote, "notif": rx.notifs._on_notif}

        def hold_notif(agent, raw):
            meta = parse_notif(raw)
            if meta is not None and meta.get("t") == "done":
                held["notif"].append((agent, raw))
            else:
                orig["notif"](agent, raw)
        monkeypatch.setattr(rx, "_on_wrote", lambda conn, meta: held["wrote"].append((conn, meta)))
        monkeypatch.setattr(rx.notifs, "_on_notif", hold_notif)
        other = "notif" if first == "wrote" else "wrote"

        def release(kind):
            items, held[kind] = held[kind], []
            for item in items:
                orig[kind](*item)
            return items

        stale = {}
        for i, seed in enumerate((1, 2)):
            exp = b.expect("r", [3, 5], timeout=20)
            h = a.start_send("r", b.endpoint(), [seed, seed + 2], [3, 5])
            await until(lambda: held["wrote"] and held["notif"], "WROTE frame and notification")
            if stale:  # the first transfer's completions, replayed while the retry's WRITEs are done
                for kind, items in stale.items():
                    for item in items:
                        orig[kind](*item)
                assert exp.state == "receiving" and not exp.done()
            stale[first] = release(first)
            res = await exp.wait()
            assert res["bytes"] == exp.nbytes and first in exp.timeline
            stale[other] = release(other)
            assert other not in exp.timeline
            assert (await h.wait())["bytes"] == exp.nbytes
            assert done == ["r"] * (i + 1)
            assert same(dst, src, 3, seed) and same(dst, src, 5, seed + 2)
        await leak_free(a, b)
    run(main())


def test_receiver_without_the_capability_gets_notifications_only(monkeypatch):
    """An older receiver (no "caps" in HELLO_OK) is never sent a WROTE frame; the notification completes."""
    monkeypatch.setattr(rxmod, "CAPS", ())

    async def main():
        src, dst = LAYOUT.allocate(8), LAYOUT.allocate(8)
        fill_random(src, 13)
        a = await make_transport("nixl", LAYOUT, src, **FAST).start()
        b = await make_transport("nixl", LAYOUT, dst).start()
        wrote = []
        monkeypatch.setattr(b.receiver, "_on_wrote", lambda conn, meta: wrote.append(meta))
        exps = {"one": b.expect("one", [1], timeout=20), "lw": b.expect("lw", [2], timeout=20)}
        h = a.start_send("lw", b.endpoint(), [3], [2], layers=[0, 1, 2])
        h.push_layers([3])
        await asyncio.sleep(0.01)
        h.finish()  # usually after the last WRITE: then the notification is sent on its own
        await asyncio.gather(a.start_send("one", b.endpoint(), [0], [1]).wait(), h.wait(),
                             *(e.wait() for e in exps.values()))
        assert not wrote and all("notif" in e.timeline for e in exps.values())
        assert same(dst, src, 1, 0) and same(dst, src, 2, 3)
        await leak_free(a, b)
    run(main())


def test_wrote_with_wrong_size_fails_the_transfer(monkeypatch):
    async def main():
        src, dst = LAYOUT.allocate(4), LAYOUT.allocate(4)
        a = await make_transport("nixl", LAYOUT, src).start()
        b = await make_transport("nixl", LAYOUT, dst).start()
        rx = b.receiver
        NotifTap(monkeypatch, b, drop=True)
        orig = rx._on_wrote
        monkeypatch.setattr(rx, "_on_wrote", lambda conn, meta: orig(conn, {**meta, "layers": 3}))
        exp = b.expect("r", [1], timeout=20)
        h = a.start_send("r", b.endpoint(), [0], [1])
        with pytest.raises(InvalidTransfer, match="3 layers"):
            await exp.wait()
        with pytest.raises(TransferAborted):
            await h.wait()
        await leak_free(a, b)
    run(main())


def test_no_completion_at_all_times_out_without_leaks(monkeypatch):
    """Neither the frame nor the notification is taken: the receiver's deadline fails both sides, and
    nothing stays registered."""
    async def main():
        src, dst = LAYOUT.allocate(4), LAYOUT.allocate(4)
        a = await make_transport("nixl", LAYOUT, src, **FAST).start()
        b = await make_transport("nixl", LAYOUT, dst, abort_ack_timeout_s=5.0).start()
        NotifTap(monkeypatch, b, drop=True)
        monkeypatch.setattr(b.receiver, "_on_wrote", lambda conn, meta: None)
        exp = b.expect("r", [1], timeout=0.5)
        h = a.start_send("r", b.endpoint(), [0], [1], layers=[0, 1])
        h.push_layers([2, 3], final=True)
        with pytest.raises(TransferTimeout):
            await exp.wait()
        with pytest.raises(TransferAborted):
            await h.wait()
        await leak_free(a, b)
    run(main())


def test_fast_wait_budget_and_config():
    """The fast wait is bounded by the expected duration (bytes / assumed rate + 2 ms), capped, VRAM only by
    default, 0 = off; bad values are refused up front."""
    from kvtransfer.config import TransportConfig
    from kvtransfer.sender_nixl import fast_wait_s

    def budget(nbytes, mem, **cfg):
        return fast_wait_s(TransportConfig(**cfg), mem, nbytes)

    assert budget(2 << 20, "DRAM") == 0.0
    assert budget(2 << 20, "VRAM") == pytest.approx(0.002 + (2 << 20) / 20e9)
    assert budget(512 << 20, "VRAM") == 0.02  # capped
    assert budget(512 << 20, "VRAM", nixl_fast_wait_s=0) == 0.0
    assert budget(0, "DRAM", nixl_fast_wait_mem=["DRAM"]) == pytest.approx(0.002)
    for bad in ({"nixl_fast_wait_s": -1}, {"nixl_fast_wait_nap_s": 0.01}, {"nixl_fast_wait_gbps": 0},
                {"nixl_fast_wait_mem": ("HBM",)}):
        with pytest.raises(ValueError, match="nixl_fast_wait"):
            TransportConfig(**bad)


@pytest.mark.parametrize("pushed", [0, 2], ids=["nothing_pushed", "half_pushed"])
def test_prebuilt_writes_one_per_layer_and_released_on_abort(pushed):
    """With nixl_prebuild (default) a send makes one WRITE per layer before BEGIN_OK and posts a layer's
    WRITE when it is pushed; a send aborted with layers not pushed yet releases the unposted ones (no
    NIXL handle left), and the next send over the same peer is byte-exact with one post per layer."""
    async def main():
        src, dst = LAYOUT.allocate(8), LAYOUT.allocate(8)
        fill_random(src, 14)
        a = await make_transport("nixl", LAYOUT, src, **FAST).start()
        b = await make_transport("nixl", LAYOUT, dst).start()
        exp = b.expect("x", [1, 2], timeout=20)
        h = a.start_send("x", b.endpoint(), [0, 1], [1, 2], layers=())
        await h.begun()
        assert "prebuilt" in h.timeline and h.timeline["prebuilt"] <= h.timeline["begin_ok"]
        path = h.path  # the NIXL path of the send (sender_nixl.NixlPath)
        assert sorted(path.ready) == list(range(LAYOUT.num_layers))
        if pushed:
            h.push_layers(range(pushed))
            await until(lambda: len(path.ready) == LAYOUT.num_layers - pushed, "the pushed layers posted")
        # every WRITE is tracked until released: unposted ones, and posted ones until reaped when DONE
        assert a.nixl.num_xfers == LAYOUT.num_layers - pushed + len(path.xfers)
        await h.abort()
        assert not path.ready and a.nixl.num_xfers == 0
        with pytest.raises(TransferAborted):
            await exp.wait()
        posted = a.nixl.posted_xfers
        exp = b.expect("y", [3, 4], timeout=20)
        await a.start_send("y", b.endpoint(), [5, 6], [3, 4]).wait()
        await exp.wait()
        assert a.nixl.posted_xfers - posted == LAYOUT.num_layers
        assert same(dst, src, 3, 5) and same(dst, src, 4, 6)
        await leak_free(a, b)
    run(main())
