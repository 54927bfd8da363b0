"""Staged TCP transfers (the path between GPUs: device memory through host buffers, here host memory
with ``force_staging``) with the staging on each connection's own I/O threads
(``TransportConfig.tcp_lane_staging``, off by default) and on the event loop (the default):
byte-exact with checksums, and with lane staging the event loop makes no staging call at all, on either
side. A send aborted while its frames are queued on the lanes writes none of those whose copies had not
begun and leaves nothing behind."""

import asyncio
import dataclasses
import threading

import pytest
import torch

from bench.kv_peer_proc import fill_random
from engine.kv_layout import KVLayout
from kvtransfer import TransferAborted, make_transport
from tests.unit.kvtransfer_testkit import settled

pytestmark = pytest.mark.timeout(120)

# 16 KiB per (layer, block); 64 blocks a transfer: frames of 1 MiB (one layer each), read by a thread.
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
N, BLOCKS = 16, 64


def _spy(obj, name: str, threads: list) -> None:
    """Record the thread every call of ``obj.name`` runs on."""
    fn = getattr(obj, name)

    def wrapped(*args, **kwargs):
        threads.append((name, threading.get_ident()))
        return fn(*args, **kwargs)

    setattr(obj, name, wrapped)


@pytest.mark.parametrize("lane_staging", [True, False], ids=["lanes", "loop"])
def test_staged_transfers_in_flight_are_byte_exact_and_staged_where_configured(lane_staging):
    staged_in_flight("cpu", lane_staging)


def staged_in_flight(device: str, lane_staging: bool) -> None:
    """The scenario, on caches in ``device`` memory (tests/gpu runs it on CUDA: staged by nature)."""
    layout = dataclasses.replace(LAYOUT, memory=device)

    async def main():
        src, dst = layout.allocate(N * BLOCKS), layout.allocate(N * BLOCKS + 8)
        fill_random(src, 3)
        cfg = {"max_frame_bytes": LAYOUT.block_bytes * BLOCKS, "tcp_connections": 4, "force_staging": True,
               "checksum": True, "tcp_lane_staging": lane_staging, "tcp_busy_frame_factor": 1}
        a = await make_transport("tcp", layout, src, **cfg).start()
        b = await make_transport("tcp", layout, dst, **cfg).start()
        calls: list = []
        _spy(a.memory, "stage_out", calls)
        _spy(b.memory, "recv_views", calls)
        _spy(b.memory, "flush", calls)
        dst_ids = list(range(8, 8 + N * BLOCKS))[::-1]  # reversed: every frame is a gather / scatter
        plans = {f"r{i}": (list(range(i * BLOCKS, (i + 1) * BLOCKS)), dst_ids[i * BLOCKS:(i + 1) * BLOCKS])
                 for i in range(N)}
        exps = {rid: b.expect(rid, d, timeout=60) for rid, (_s, d) in plans.items()}
        handles = [a.start_send(rid, b.endpoint(), s, d) for rid, (s, d) in plans.items()]
        await asyncio.gather(*(h.wait() for h in handles), *(e.wait() for e in exps.values()))
        for s, d in plans.values():
            assert torch.equal(dst[:, d].view(torch.uint8), src[:, s].view(torch.uint8))  # NaN bits
        loop_thread = threading.get_ident()
        on_loop = sorted({name for name, ident in calls if ident == loop_thread})
        assert {name for name, _ in calls} == {"stage_out", "recv_views", "flush"}
        assert len([c for c in calls if c[0] == "stage_out"]) == N * LAYOUT.num_layers
        assert on_loop == ([] if lane_staging else ["flush", "recv_views", "stage_out"])
        await settled(a, b)

    asyncio.run(main())


def test_an_aborted_send_skips_its_queued_frames_and_leaves_nothing_behind():
    async def main():
        src, dst = LAYOUT.allocate(N * BLOCKS), LAYOUT.allocate(N * BLOCKS + 8)
        fill_random(src, 4)
        # one connection, no stage-ahead: the frames of all transfers queue on one writer thread
        cfg = {"max_frame_bytes": LAYOUT.block_bytes * BLOCKS, "tcp_connections": 1, "force_staging": True,
               "tcp_stage_ahead": 1, "tcp_lane_staging": True}
        a = await make_transport("tcp", LAYOUT, src, **cfg).start()
        b = await make_transport("tcp", LAYOUT, dst, **cfg).start()
        staged: list = []
        _spy(a.memory, "stage_out", staged)
        ids = {f"r{i}": list(range(i * BLOCKS, (i + 1) * BLOCKS)) for i in range(N)}
        exps = {rid: b.expect(rid, d, timeout=60) for rid, d in ids.items()}
        handles = {rid: a.start_send(rid, b.endpoint(), d, d) for rid, d in ids.items()}
        while not staged:
            await asyncio.sleep(0.001)
        victims = [f"r{i}" for i in range(N // 2, N)]  # the last ones queued: their frames wait
        await asyncio.gather(*(handles[rid].abort("test") for rid in victims))
        for rid in victims:
            with pytest.raises(TransferAborted):
                await handles[rid].wait()
            with pytest.raises(TransferAborted):
                await exps[rid].wait()
        for rid, d in ids.items():
            if rid not in victims:
                await handles[rid].wait()
                await exps[rid].wait()
                assert torch.equal(dst[:, d].view(torch.uint8), src[:, d].view(torch.uint8))
        assert len(staged) < N * LAYOUT.num_layers, "every frame was staged: nothing was skipped"
        await settled(a, b)

    asyncio.run(main())
