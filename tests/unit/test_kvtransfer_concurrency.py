"""Many TCP transfers in flight over loopback (one process, two transports): spread over the peer's
connections, byte-exact, none aborted because others were queued ahead of it -- a deadline that passes
while a transfer's connection keeps moving bytes is not a failure, on either side -- and a sender that
stalls mid-frame is failed once its connection has been idle for stall_timeout_s. Leak checks after
each."""

import asyncio
import random
import socket
import time

import pytest
import torch

from bench.kv_peer_proc import fill_random
from engine.kv_layout import KVLayout
from kvtransfer import TransferTimeout, UnknownRequest, make_transport
from kvtransfer.protocol import HEADER, Msg, decode_header, decode_meta, encode
from tests.unit.kvtransfer_testkit import recv_exact as _recv_exact
from tests.unit.kvtransfer_testkit import settled

pytestmark = pytest.mark.timeout(120)

# 16 KiB per (layer, block); frames of one block each, so every transfer is many frames and they interleave.
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
N, BLOCKS = 32, 4


def test_32_transfers_in_flight_byte_exact_none_aborted_past_their_deadlines():
    async def main():
        src, dst = LAYOUT.allocate(N * BLOCKS), LAYOUT.allocate(N * BLOCKS + 8)
        fill_random(src, 11)
        cfg = {"max_frame_bytes": LAYOUT.block_bytes * LAYOUT.num_layers, "tcp_connections": 4}
        a = await make_transport("tcp", LAYOUT, src, **cfg).start()
        b = await make_transport("tcp", LAYOUT, dst, **cfg).start()
        rng = random.Random(5)
        dst_ids = rng.sample(range(N * BLOCKS + 8), N * BLOCKS)
        plans = {f"r{i}": (list(range(i * BLOCKS, (i + 1) * BLOCKS)), dst_ids[i * BLOCKS:(i + 1) * BLOCKS])
                 for i in range(N)}
        rx = b.receiver
        forced: list[str] = []
        on_data = rx.on_data

        def data_then_deadline(conn, meta, payload_len, threaded=False):
            # The expectation's deadline "passes" right as its first frame arrives: bound, its connection
            # just moved bytes. It must carry on (the deadline is re-armed, nothing fails).
            out = on_data(conn, meta, payload_len, threaded)
            rid = meta["rid"]
            if rid not in forced:
                forced.append(rid)
                rx._on_deadline(rid)
                assert rid in rx.expectations and rx.expectations[rid].state == "receiving"
            return out

        rx.on_data = data_then_deadline
        exps = {rid: b.expect(rid, d, timeout=60) for rid, (_s, d) in plans.items()}
        ep = b.endpoint()
        handles = {rid: a.start_send(rid, ep, s, d) for rid, (s, d) in plans.items()}
        # The sender's deadline "passes" too while each send is on its connection: not a failure either.
        while not all(h.path is not None or h.done() for h in handles.values()):
            await asyncio.sleep(0)
        for h in handles.values():
            if not h.done():
                h._on_deadline()
        results = await asyncio.gather(*(h.wait() for h in handles.values()),
                                       *(e.wait() for e in exps.values()))
        assert all(r["bytes"] == LAYOUT.num_layers * BLOCKS * LAYOUT.block_bytes for r in results)
        assert sorted(forced) == sorted(plans)
        for s_ids, d_ids in plans.values():
            for s, d in zip(s_ids, d_ids, strict=True):
                assert torch.equal(dst[:, d].view(torch.uint8), src[:, s].view(torch.uint8)), (s, d)
        # One peer with four connections; the receiver saw all of them.
        assert a.stats()["peers"] == 1 and b.stats()["rx_connections"] == 4
        await settled(a, b)
    asyncio.run(asyncio.wait_for(main(), 100))


def test_large_frames_go_through_the_io_threads_and_are_counted():
    """Frames above inline_write_max_bytes are written by a send thread, payloads of 1 MiB and more read by
    a receive thread; counters() says what those threads moved (bench.kv_bench's "where the time goes")."""
    big = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
    blocks = 128  # 2 MiB per layer: one frame each

    async def main():
        src, dst = big.allocate(blocks), big.allocate(blocks)
        fill_random(src, 3)
        cfg = {"max_frame_bytes": 2 << 20, "tcp_connections": 2}
        a = await make_transport("tcp", big, src, **cfg).start()
        b = await make_transport("tcp", big, dst, **cfg).start()
        ids = list(range(blocks))
        exp = b.expect("big", ids, timeout=30)
        await asyncio.gather(a.start_send("big", b.endpoint(), ids, ids).wait(), exp.wait())
        assert torch.equal(src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8))  # NaN bits
        payload = big.num_layers * blocks * big.block_bytes
        tx, rx = a.counters()["tcp_tx_io"], b.counters()["tcp_rx_io"]
        assert tx["frames"] >= 1 and payload <= tx["bytes"] < payload + 4096, tx  # + frame headers
        assert rx["frames"] == 2 and rx["bytes"] == payload, rx
        for io in (tx, rx):
            assert io["syscalls"] >= io["frames"] and 0 <= io["poll_s"] <= io["thread_s"], io
        await settled(a, b)

    asyncio.run(main())


def test_a_transfer_of_many_frames_is_striped_over_every_connection_byte_exact():
    """To a receiver that advertises CAP_STRIPE, a transfer's frames spread over all of the peer's
    connections (one connection moves a few GB/s at most); one-frame transfers stay on one."""
    async def main():
        src, dst = LAYOUT.allocate(N * BLOCKS), LAYOUT.allocate(N * BLOCKS)
        fill_random(src, 21)
        cfg = {"max_frame_bytes": LAYOUT.block_bytes * LAYOUT.num_layers, "tcp_connections": 4}
        a = await make_transport("tcp", LAYOUT, src, **cfg).start()
        b = await make_transport("tcp", LAYOUT, dst, **cfg).start()
        conns: dict[str, set] = {}
        on_data = b.receiver.on_data

        def spy(conn, meta, payload_len, threaded=False):
            conns.setdefault(meta["rid"], set()).add(conn)
            return on_data(conn, meta, payload_len, threaded)

        b.receiver.on_data = spy
        big, small = list(range(0, 3 * BLOCKS)), [3 * BLOCKS]  # 12 frames; 1 frame
        for rid, ids in (("big", big), ("small", small), ("big2", big)):
            exp = b.expect(rid, ids, timeout=30)
            await asyncio.gather(a.start_send(rid, b.endpoint(), ids, ids).wait(), exp.wait())
            assert torch.equal(dst[:, ids].view(torch.uint8), src[:, ids].view(torch.uint8))
        assert len(conns["big"]) == len(conns["big2"]) == 4 and len(conns["small"]) == 1
        await settled(a, b)

    asyncio.run(main())


class _Conn:
    """A stand-in for one receiving connection: what Receiver reads of it and what it sent back."""

    def __init__(self, sender: str | None) -> None:
        self.sender, self.closed, self.peer, self.nixl_agent = sender, False, f"fake-{sender}", None
        self.last_progress, self.abort_acks, self.sent = time.monotonic(), {}, []

    def send(self, msg, meta) -> None:
        self.sent.append((msg, meta))

    def close(self) -> None:
        self.closed = True


def test_a_striped_end_before_the_last_frame_completes_when_it_arrives_and_strangers_are_refused():
    """Receiver order independence: END on the home connection may overtake frames still on the
    sender's other connections; the last byte completes the request. A connection of another sender
    cannot write into it."""
    async def main():
        layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
        t = await make_transport("tcp", layout, layout.allocate(8)).start()
        rx = t.receiver
        home, other, stranger = _Conn("s1"), _Conn("s1"), _Conn("s2")
        exp = t.expect("r", [2, 3], timeout=30)
        nbytes = 2 * 2 * layout.block_bytes
        rx.on_control(home, Msg.BEGIN, {"rid": "r", "dst": [2, 3], "nbytes": nbytes, "backend": "tcp",
                                        "stripe": True})
        assert home.sent == [(Msg.BEGIN_OK, {"rid": "r"})]

        def frame(conn, layer):
            ctx, views = rx.on_data(conn, {"rid": "r", "segs": [[layer, 2, 2]]}, 2 * layout.block_bytes)
            for v in views:
                v[:] = bytes([layer + 1]) * len(v)
            rx.on_data_complete(conn, ctx)

        frame(home, 0)
        with pytest.raises(UnknownRequest):
            rx.on_data(stranger, {"rid": "r", "segs": [[1, 2, 2]]}, 2 * layout.block_bytes)
        rx.on_control(home, Msg.END, {"rid": "r", "nbytes": nbytes})
        assert not exp.done() and exp.state == "receiving"
        frame(other, 1)
        result = await exp.wait()
        assert result["bytes"] == nbytes and (Msg.DONE, {"rid": "r"}) in home.sent
        assert t.stats()["expectations"] == 0
        await t.close()

    asyncio.run(main())


def test_a_stalled_sender_fails_at_its_deadline_once_idle_for_the_stall_timeout():
    """BEGIN and half a DATA frame, then silence on an open connection: the expectation fails with
    TransferTimeout naming the idle connection (its deadline passed while receiving, and the connection
    then moved nothing for stall_timeout_s)."""
    async def main():
        dst = LAYOUT.allocate(8)
        b = await make_transport("tcp", LAYOUT, dst, stall_timeout_s=0.2).start()
        port, bb = b.endpoint()["port"], LAYOUT.block_bytes
        exp = b.expect("s", [1, 2], timeout=0.1)
        sock = socket.create_connection(("127.0.0.1", port))
        loop = asyncio.get_running_loop()

        def send(msg, meta, payload=b"", plen=None):
            sock.sendall(encode(msg, meta, len(payload) if plen is None else plen) + payload)

        def start():
            send(Msg.HELLO, {"version": 1, "layout_hash": LAYOUT.compat_hash(), "want": "tcp"})
            head = sock.recv(HEADER.size, socket.MSG_WAITALL)
            assert decode_header(head)[0] == Msg.HELLO_OK
            sock.recv(decode_header(head)[2], socket.MSG_WAITALL)
            nbytes = 2 * LAYOUT.num_layers * bb
            send(Msg.BEGIN, {"rid": "s", "dst": [1, 2], "nbytes": nbytes, "backend": "tcp"})
            send(Msg.DATA, {"rid": "s", "segs": [[0, 1, 2]]}, b"\x07" * bb, plen=2 * bb)

        await loop.run_in_executor(None, start)
        with pytest.raises(TransferTimeout, match="state receiving.*idle"):
            await exp.wait()
        # The receiver told the sender (ABORT) before giving up on it.
        head = await loop.run_in_executor(None, lambda: sock.recv(HEADER.size, socket.MSG_WAITALL))
        msg, _f, meta_len, _p = decode_header(head)
        meta = decode_meta(await loop.run_in_executor(None, lambda: sock.recv(meta_len, socket.MSG_WAITALL)))
        assert msg == Msg.ABORT and meta["rid"] == "s"
        sock.close()
        await settled(b)
    asyncio.run(asyncio.wait_for(main(), 60))


def test_an_abort_among_transfers_sharing_one_lane_leaves_the_others_byte_exact():
    """Six transfers of 1 MiB frames queued on one connection (its writer thread takes them in turn);
    one is aborted by its sender while its frames are queued there: it fails, the other five arrive
    byte-exact over the same connection, and nothing is left behind."""
    from kvtransfer import TransferAborted

    big = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")  # 16 KiB

    async def main():
        per = 128  # blocks per transfer: 4 MiB, four 1 MiB frames
        src, dst = big.allocate(6 * per), big.allocate(6 * per)
        fill_random(src, 13)
        cfg = {"max_frame_bytes": 1 << 20, "tcp_connections": 1}
        a = await make_transport("tcp", big, src, **cfg).start()
        b = await make_transport("tcp", big, dst, **cfg).start()
        plans = {f"r{i}": list(range(i * per, (i + 1) * per)) for i in range(6)}
        exps = {rid: b.expect(rid, ids, timeout=60) for rid, ids in plans.items()}
        handles = {rid: a.start_send(rid, b.endpoint(), ids, ids) for rid, ids in plans.items()}
        # The sender aborts r3 the moment its first frame has landed on the receiver: its other frames
        # (one in flight per lane per transfer) are still to come, behind the other transfers' frames.
        rx, aborted = b.receiver, []
        on_data_complete = rx.on_data_complete

        def first_frame_then_abort(conn, ctx):
            on_data_complete(conn, ctx)
            if ctx.exp.request_id == "r3" and not aborted:
                assert ctx.exp.received < ctx.exp.nbytes
                aborted.append(asyncio.ensure_future(a.abort("r3", "test")))

        rx.on_data_complete = first_frame_then_abort
        results = await asyncio.gather(*(h.wait() for h in handles.values()), return_exceptions=True)
        outcome = dict(zip(handles, results, strict=True))
        assert aborted and isinstance(outcome["r3"], TransferAborted), outcome["r3"]
        await aborted[0]
        with pytest.raises(TransferAborted):  # the sender's ABORT fails it on the receiver too
            await asyncio.wait_for(exps["r3"].wait(), 30)
        b.release("r3")  # (idempotent) as the decode worker does when the router gives the request up
        for rid, ids in plans.items():
            if rid == "r3":
                continue
            assert isinstance(outcome[rid], dict), outcome[rid]
            await exps[rid].wait()
            assert torch.equal(dst[:, ids].view(torch.uint8), src[:, ids].view(torch.uint8)), rid
        await settled(a, b)

    asyncio.run(asyncio.wait_for(main(), 100))


def test_a_receiver_that_stops_reading_blocks_only_the_lanes_writer_thread_never_the_event_loop():
    """A lane's socket is blocking for its writer thread (iovec.whole_frame_io). A receiver that answers
    the handshake and then reads nothing: the frame's write waits in the writer thread while the sender's
    event loop keeps running (its own reads and small writes pass MSG_DONTWAIT), and closing the sender
    ends the stuck write (SO_SNDTIMEO bounds each call) without a leak."""
    big = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
    blocks = 128  # 2 MiB per layer: far more than the loopback socket buffers hold
    lsock = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def fake_receiver() -> None:
        conn, _ = lsock.accept()
        held.append(conn)
        while True:
            msg, _f, meta_len, _p = decode_header(_recv_exact(conn, HEADER.size))
            meta = decode_meta(_recv_exact(conn, meta_len))
            if msg == Msg.HELLO:
                conn.sendall(encode(Msg.HELLO_OK, {"version": 1, "layout_hash": meta["layout_hash"],
                                                   "num_blocks": blocks, "backend": "tcp", "caps": []}))
            elif msg == Msg.BEGIN:
                return  # from here on nothing is read

    async def main():
        src = big.allocate(blocks)
        fill_random(src, 5)
        a = await make_transport("tcp", big, src, tcp_connections=1, max_frame_bytes=2 << 20,
                                 send_timeout_s=30).start()
        loop = asyncio.get_running_loop()
        rx = loop.run_in_executor(None, fake_receiver)
        endpoint = {**a.endpoint(), "host": "127.0.0.1", "port": lsock.getsockname()[1], "instance": "fake"}
        ids = list(range(blocks))
        handle = a.start_send("stuck", endpoint, ids, ids)
        await rx
        ticks, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < 0.5:  # the loop turns while the write is stuck
            await asyncio.sleep(0.005)
            ticks += 1
        assert ticks >= 20, ticks
        assert not handle.done()
        await a.close()
        with pytest.raises(Exception):  # noqa: B017 (the stuck send fails, however the close words it)
            await asyncio.wait_for(handle.wait(), 10)
        s = a.stats()
        assert s == {k: 0 for k in s}, s

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        for conn in held:
            conn.close()
        lsock.close()


def test_a_sender_stalled_mid_way_through_a_thread_read_frame_fails_once_idle_and_the_thread_ends():
    """A DATA frame big enough for a receive thread (blocking whole-frame reads, iovec.whole_frame_io),
    half sent, then silence: the expectation fails with TransferTimeout once the connection is idle, and
    closing the receiver ends the thread's read (SO_RCVTIMEO bounds each call) without a leak."""
    big = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
    blocks = 128  # 2 MiB per layer

    async def main():
        dst = big.allocate(blocks)
        b = await make_transport("tcp", big, dst, stall_timeout_s=0.3).start()
        port, bb = b.endpoint()["port"], big.block_bytes
        ids = list(range(blocks))
        exp = b.expect("half", ids, timeout=0.2)
        sock = socket.create_connection(("127.0.0.1", port))
        loop = asyncio.get_running_loop()

        def start():
            sock.sendall(encode(Msg.HELLO, {"version": 1, "layout_hash": big.compat_hash(), "want": "tcp"}))
            head = _recv_exact(sock, HEADER.size)
            _recv_exact(sock, decode_header(head)[2])
            nbytes = big.num_layers * blocks * bb
            sock.sendall(encode(Msg.BEGIN, {"rid": "half", "dst": ids, "nbytes": nbytes, "backend": "tcp"}))
            frame = blocks * bb  # one layer: 2 MiB, read by a receive thread
            sock.sendall(encode(Msg.DATA, {"rid": "half", "segs": [[0, 0, blocks]]}, frame)
                         + b"\x05" * (frame // 2))

        await loop.run_in_executor(None, start)
        with pytest.raises(TransferTimeout, match="idle"):
            await exp.wait()
        assert b.counters()["tcp_rx_io"]["frames"] == 0  # the frame never completed
        await b.close()
        sock.close()
        s = b.stats()
        assert s == {k: 0 for k in s}, s

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_transfer_starting_behind_others_sends_larger_frames():
    """TransportConfig.tcp_busy_frame_factor: a transfer alone frames at max_frame_bytes (its frames
    pipeline over its lanes); one that starts while another to the same receiver is in flight frames at
    twice that (fewer per-frame hand-offs where transfers queue). Byte-exact either way, leak-free."""
    async def main():
        frame = LAYOUT.block_bytes * 8
        src, dst = LAYOUT.allocate(512), LAYOUT.allocate(512)  # 32 MiB
        fill_random(src, 31)
        cfg = {"max_frame_bytes": frame, "tcp_connections": 2, "tcp_busy_frame_factor": 2}
        a = await make_transport("tcp", LAYOUT, src, **cfg).start()
        b = await make_transport("tcp", LAYOUT, dst, **cfg).start()
        sizes: dict[str, list[int]] = {}
        on_data = b.receiver.on_data

        def spy(conn, meta, payload_len, *rest):
            sizes.setdefault(meta["rid"], []).append(payload_len)
            return on_data(conn, meta, payload_len, *rest)

        b.receiver.on_data = spy
        first, second = list(range(0, 448)), list(range(448, 512))  # the first still moving then
        exps = [b.expect("alone", first, timeout=30), b.expect("behind", second, timeout=30)]
        alone = a.start_send("alone", b.endpoint(), first, first)
        while alone.path is None:
            await asyncio.sleep(0)
        behind = a.start_send("behind", b.endpoint(), second, second)
        await asyncio.gather(alone.wait(), behind.wait(), *(e.wait() for e in exps))
        assert (alone.path.frame_bytes, behind.path.frame_bytes) == (frame, 2 * frame)
        assert max(sizes["alone"]) == frame and max(sizes["behind"]) == 2 * frame, sizes
        assert torch.equal(src.view(torch.uint8), dst.view(torch.uint8))
        await settled(a, b)

    asyncio.run(main())
