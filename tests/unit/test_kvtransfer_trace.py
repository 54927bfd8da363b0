"""kvtransfer/trace.py: with TransportConfig.trace (PDSERVE_KV_TRACE=1, read by pdserve/settings.py) each
side logs one line per transfer with its timeline."""

import asyncio
import json
import logging

import torch

from bench.kv_peer_proc import fill_random
from engine.kv_layout import KVLayout
from kvtransfer import make_transport
from pdserve.settings import ServeSettings, kv_transport_options

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=8, dtype="float32")


def run_one(monkeypatch, caplog, on: bool) -> list[str]:
    if on:
        monkeypatch.setenv("PDSERVE_KV_TRACE", "1")
    else:
        monkeypatch.delenv("PDSERVE_KV_TRACE", raising=False)
    settings = ServeSettings(role="decode", model="m", host="127.0.0.1")
    opts = kv_transport_options(settings)
    assert opts["trace"] is on

    async def main():
        src, dst = LAYOUT.allocate(4), LAYOUT.allocate(4)
        fill_random(src, 3)
        a = await make_transport("tcp", LAYOUT, src, trace=opts["trace"]).start()
        b = await make_transport("tcp", LAYOUT, dst, trace=opts["trace"]).start()
        exp = b.expect("r1", [2], timeout=10)
        await a.start_send("r1", b.endpoint(), [1], [2]).wait()
        await exp.wait()
        assert torch.equal(dst[:, 2].view(torch.uint8), src[:, 1].view(torch.uint8))  # bytes (NaNs)
        await a.close()
        await b.close()

    with caplog.at_level(logging.INFO, logger="kvtransfer.trace"):
        asyncio.run(asyncio.wait_for(main(), 30))
    return [r.getMessage() for r in caplog.records if r.name == "kvtransfer.trace"]


def test_both_sides_log_their_timeline_only_when_asked(monkeypatch, caplog):
    assert run_one(monkeypatch, caplog, on=False) == []
    lines = run_one(monkeypatch, caplog, on=True)
    sides = {line.split()[1]: json.loads(line.split(maxsplit=3)[3]) for line in lines}
    assert set(sides) == {"tx", "tx-frames", "rx"} and all(line.split()[2] == "r1" for line in lines)
    tx, rx, frames = sides["tx"], sides["rx"], sides["tx-frames"]
    assert tx["start"] <= tx["acked"] and rx["begin"] <= rx["complete"] <= tx["acked"]
    # the sender's DATA frames: where their time went (one frame here)
    assert frames["frames"] == 1 and min(frames["staging_s"], frames["lane_wait_s"], frames["in_lane_s"]) >= 0
    assert frames["span_s"] >= frames["in_lane_s"]


def test_large_frames_are_summed_on_both_sides(caplog):
    """A striped transfer of 2 MiB frames: the sender's tx-frames line counts every DATA frame, the
    receiver's rx-frames line those read by threads, and both say where the time went."""
    big = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")  # 16 KiB

    async def main():
        src, dst = big.allocate(400), big.allocate(400)
        fill_random(src, 5)
        cfg = {"trace": True, "max_frame_bytes": 2 << 20, "tcp_connections": 2}
        a = await make_transport("tcp", big, src, **cfg).start()
        b = await make_transport("tcp", big, dst, **cfg).start()
        ids = list(range(400))
        exp = b.expect("big", ids, timeout=30)
        await a.start_send("big", b.endpoint(), ids, ids).wait()
        await exp.wait()
        assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
        await a.close()
        await b.close()

    with caplog.at_level(logging.INFO, logger="kvtransfer.trace"):
        asyncio.run(asyncio.wait_for(main(), 60))
    lines = {r.getMessage().split()[1]: json.loads(r.getMessage().split(maxsplit=3)[3])
             for r in caplog.records if r.name == "kvtransfer.trace"}
    tx, rx = lines["tx-frames"], lines["rx-frames"]
    # 12.5 MiB in 2 MiB frames: seven sent; the six of 1 MiB or more are read by threads (rx_conn)
    assert tx["frames"] == 7 and rx["frames"] == 6
    assert rx["thread_s"] > 0 and rx["frame_s"] >= rx["poll_s"] >= 0 and rx.get("gap_s", 0) >= 0
