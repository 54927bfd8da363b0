"""kvtransfer in one process (one event loop, two transports over loopback TCP): data path, validation,
aborts, deadlines, concurrency. Every scenario ends with a leak check on both sides."""

import asyncio
import socket

import pytest
import torch

from bench.kv_peer_proc import fill_random
from engine.kv_layout import KVLayout
from kvtransfer import (
    InvalidTransfer,
    LayoutMismatch,
    TransferAborted,
    TransferTimeout,
    UnknownRequest,
    make_transport,
)
from kvtransfer.protocol import HEADER, Msg, decode_header, decode_meta, encode
from tests.unit.kvtransfer_testkit import closed_clean

pytestmark = pytest.mark.timeout(60)


def layout(**kw):
    base = dict(num_layers=3, num_kv_heads=2, head_dim=8, block_size=8, dtype="bfloat16")
    return KVLayout(**{**base, **kw})


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 45))


async def pair(lay=None, src_blocks=12, dst_blocks=16, kind="tcp", **cfg):
    lay = lay or layout()
    src, dst = lay.allocate(src_blocks), lay.allocate(dst_blocks)
    fill_random(src, 7)
    a = await make_transport(kind, lay, src, **cfg).start()
    b = await make_transport(kind, lay, dst, **cfg).start()
    return a, b, src, dst


def assert_copied(src, dst, s_ids, d_ids):
    for s, d in zip(s_ids, d_ids, strict=True):
        assert torch.equal(dst[:, d].view(torch.uint8), src[:, s].view(torch.uint8)), (s, d)
    others = [b for b in range(dst.shape[1]) if b not in set(d_ids)]
    assert not dst[:, others].view(torch.uint8).any(), "blocks outside the destination were written"


async def close_clean(*transports):
    # connection teardown on the far side is asynchronous
    await closed_clean(transports, ready=lambda s: s["rx_connections"] == 0 or s["peers"] == 0,
                       fields=("expectations", "sends", "peer_handles", "nixl_xfers"), polls=50)


@pytest.mark.parametrize("opts", [{}, {"checksum": True}, {"force_staging": True}, {"max_frame_bytes": 4096}])
def test_scattered_blocks_arrive_byte_exact(opts):
    async def main():
        a, b, src, dst = await pair(**opts)
        s_ids, d_ids = [3, 4, 5, 0, 11, 7], [9, 10, 11, 2, 15, 0]
        exp = b.expect("r1", d_ids, timeout=20)
        res = await a.start_send("r1", b.endpoint(), s_ids, d_ids).wait()
        assert (await exp.wait())["bytes"] == res["bytes"] == 3 * 6 * layout().block_bytes
        assert res["backend"] == "tcp"
        assert_copied(src, dst, s_ids, d_ids)
        await close_clean(a, b)
    run(main())


def test_layerwise_streaming_and_concurrent_requests():
    async def main():
        lay = layout(num_layers=4, dtype="float32", block_size=16)
        a, b, src, dst = await pair(lay, src_blocks=20, dst_blocks=24)
        plans = {f"r{i}": ([i * 4 + k for k in range(4)], [23 - i * 5 - k for k in range(4)])
                 for i in range(5)}
        exps = {rid: b.expect(rid, d, timeout=20) for rid, (_s, d) in plans.items()}
        ep = b.endpoint()
        handles = {rid: a.start_send(rid, ep, s, d, layers=[0]) for rid, (s, d) in plans.items()}
        for h in handles.values():
            h.push_layers(range(1, 3))
        await asyncio.sleep(0.02)
        assert not any(e.done() for e in exps.values()), "complete before all layers were pushed"
        for h in handles.values():
            h.push_layers([3])
            h.finish()
        await asyncio.gather(*(h.wait() for h in handles.values()), *(e.wait() for e in exps.values()))
        for s, d in plans.values():
            for si, di in zip(s, d, strict=True):
                assert torch.equal(dst[:, di].view(torch.uint8), src[:, si].view(torch.uint8))
        # one cached peer for all, with its tcp_connections lanes
        assert b.stats()["rx_connections"] == a.config.tcp_connections and a.stats()["peers"] == 1
        h = handles["r0"]
        with pytest.raises(InvalidTransfer, match="already finished"):
            h.push_layers([0])
        await close_clean(a, b)
    run(main())


def test_sender_side_validation_rejects_before_anything_is_sent():
    async def main():
        a, b, src, dst = await pair()
        ep = b.endpoint()
        exp = b.expect("r", [1, 2], timeout=20)
        for s, d, match in (([0, 1], [1, 16], "out of range"), ([0, 0], [1, 2], "duplicate source"),
                            ([0, 1], [2, 2], "duplicate destination"), ([0], [1, 2], "1 source blocks but 2"),
                            ([0, 12], [1, 2], "out of range")):
            with pytest.raises(InvalidTransfer, match=match):
                a.start_send("r", ep, s, d)
        with pytest.raises(InvalidTransfer, match="layers out of range"):
            a.start_send("r", ep, [0, 1], [1, 2], layers=[5])
        h = a.start_send("r", ep, [0, 1], [1, 2], layers=[0])
        while exp.state != "receiving":
            await asyncio.sleep(0.005)
        with pytest.raises(InvalidTransfer, match="never pushed"):
            h.finish()
        await h.abort()
        with pytest.raises(TransferAborted):
            await exp.wait()
        assert not dst[:, 0].view(torch.uint8).any() and not dst[:, 3:].view(torch.uint8).any()
        await close_clean(a, b)
    run(main())


def test_layout_mismatch_is_refused_naming_both_sides():
    async def main():
        src = layout().allocate(4)
        other = layout(block_size=16)
        dst = other.allocate(4)
        a = await make_transport("tcp", layout(), src).start()
        b = await make_transport("tcp", other, dst).start()
        b.expect("r", [0], timeout=5)
        with pytest.raises(LayoutMismatch) as err:
            a.start_send("r", b.endpoint(), [0], [0])
        assert layout().compat_hash() in str(err.value) and other.compat_hash() in str(err.value)
        assert "block_size=8" in str(err.value) and "block_size=16" in str(err.value)
        with pytest.raises(LayoutMismatch, match="protocol version mismatch: receiver 2, sender 1"):
            a.start_send("r", {**b.endpoint(), "version": 2}, [0], [0])
        # A lying endpoint (our hash on their side) is caught by the receiver's HELLO check.
        ep = {**b.endpoint(), "layout_hash": layout().compat_hash()}
        with pytest.raises(LayoutMismatch, match=other.compat_hash()):
            await a.start_send("r", ep, [0], [0]).wait()
        assert not dst.view(torch.uint8).any()
        b.release("r")
        await close_clean(a, b)
    run(main())


class RawSender:
    """Hand-made frames, to show the receiver itself refuses bad ones (a sender could be buggy)."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)

    def send(self, msg, meta, payload=b""):
        self.sock.sendall(encode(msg, meta, len(payload)) + payload)

    def recv(self):
        head = self.sock.recv(HEADER.size, socket.MSG_WAITALL)
        msg, _f, meta_len, _p = decode_header(head)
        return msg, decode_meta(self.sock.recv(meta_len, socket.MSG_WAITALL))

    def hello(self, lay):
        self.send(Msg.HELLO, {"version": 1, "layout_hash": lay.compat_hash(), "want": "tcp"})
        return self.recv()


def test_receiver_rejects_bad_frames_before_writing():
    async def main():
        lay = layout()
        dst = lay.allocate(8)
        b = await make_transport("tcp", lay, dst).start()
        port, bb = b.endpoint()["port"], lay.block_bytes
        loop = asyncio.get_running_loop()

        def scenario():
            r = RawSender(port)
            assert r.hello(lay)[0] == Msg.HELLO_OK
            out = {}
            # Unknown request.
            r.send(Msg.BEGIN, {"rid": "nobody", "dst": [0], "nbytes": 3 * bb, "backend": "tcp"})
            out["unknown"] = r.recv()
            # Destination blocks not the reserved ones / out of range / duplicated / wrong byte count.
            for rid, dst_ids, nbytes in (("a", [1, 3], 6 * bb), ("b", [1, 99], 6 * bb), ("c", [1, 1], 6 * bb),
                                         ("d", [1, 2], 6 * bb + 1)):
                r.send(Msg.BEGIN, {"rid": rid, "dst": dst_ids, "nbytes": nbytes, "backend": "tcp"})
                out[rid] = r.recv()
            # A good BEGIN, then DATA whose payload length disagrees with its segments, then DATA for a
            # block that was not reserved: both refused, payloads discarded, stream still in sync.
            r.send(Msg.BEGIN, {"rid": "e", "dst": [4, 5], "nbytes": 6 * bb, "backend": "tcp"})
            r.send(Msg.DATA, {"rid": "e", "segs": [[0, 4, 2]]}, b"\x01" * (2 * bb - 1))
            out["e"] = r.recv()
            r.send(Msg.BEGIN, {"rid": "f", "dst": [6], "nbytes": 3 * bb, "backend": "tcp"})
            r.send(Msg.DATA, {"rid": "f", "segs": [[0, 7, 1]]}, b"\x02" * bb)
            out["f"] = r.recv()
            r.send(Msg.BEGIN, {"rid": "g", "dst": [0], "nbytes": 3 * bb, "backend": "tcp"})
            r.send(Msg.END, {"rid": "g", "nbytes": 3 * bb})
            out["g"] = r.recv()
            # A wrong layout hash in HELLO closes the connection with an error naming both hashes.
            r2 = RawSender(port)
            out["hello"] = r2.hello(layout(num_layers=5))
            r.sock.close()
            r2.sock.close()
            return out

        exps = {rid: b.expect(rid, ids, timeout=20) for rid, ids in
                (("a", [1, 2]), ("b", [1, 2]), ("c", [1, 2]), ("d", [1, 2]), ("e", [4, 5]), ("f", [6]),
                 ("g", [0]))}
        out = await loop.run_in_executor(None, scenario)
        assert out["unknown"][0] == Msg.ERROR and out["unknown"][1]["kind"] == "UnknownRequest"
        assert "not reserved: [3]" in out["a"][1]["message"]
        assert "out of range" in out["b"][1]["message"]
        assert "duplicate" in out["c"][1]["message"]
        assert "announces" in out["d"][1]["message"]
        assert "carries" in out["e"][1]["message"]
        assert "block 7 is not reserved" in out["f"][1]["message"]
        assert "before all KV arrived" in out["g"][1]["message"]
        msg, meta = out["hello"]
        assert msg == Msg.ERROR and meta["kind"] == "LayoutMismatch"
        assert lay.compat_hash() in meta["message"] and layout(num_layers=5).compat_hash() in meta["message"]
        for exp in exps.values():
            with pytest.raises(InvalidTransfer):
                await exp.wait()
        assert not dst.view(torch.uint8).any(), "a rejected frame wrote into KV memory"
        await close_clean(b)
    run(main())


def test_aborts_deadlines_and_unknown_requests():
    async def main():
        a, b, src, dst = await pair()
        ep = b.endpoint()
        # Receiver aborts while the sender streams: sender learns, abort() confirms no more writes.
        exp = b.expect("x", [1, 2], timeout=20)
        h = a.start_send("x", ep, [0, 1], [1, 2], layers=[0])
        while exp.state != "receiving" or exp.received == 0:
            await asyncio.sleep(0.005)
        assert await b.abort("x", "client went away") is True
        with pytest.raises(TransferAborted, match="client went away"):
            await h.wait()
        with pytest.raises(TransferAborted):
            await exp.wait()
        # Sender aborts: the receiver's waiter fails with the sender's reason.
        exp = b.expect("y", [3], timeout=20)
        h = a.start_send("y", ep, [2], [3], layers=[0])
        while exp.state != "receiving":
            await asyncio.sleep(0.005)
        await h.abort("prefill cancelled")
        with pytest.raises(TransferAborted, match="prefill cancelled"):
            await exp.wait()
        # Deadline with nobody sending.
        exp = b.expect("z", [4], timeout=0.05)
        with pytest.raises(TransferTimeout, match="deadline"):
            await exp.wait()
        # Sending for a request the receiver does not expect.
        with pytest.raises(UnknownRequest):
            await a.start_send("ghost", ep, [0], [5]).wait()
        # Sender-side deadline: the receiver never gets the rest.
        exp = b.expect("slow", [6], timeout=20)
        h = a.start_send("slow", ep, [0], [6], layers=[0], timeout=0.2)
        with pytest.raises(TransferTimeout):
            await h.wait()
        with pytest.raises(TransferAborted):
            await exp.wait()
        b.release("never-existed")  # idempotent
        await close_clean(a, b)
    run(main())


@pytest.mark.parametrize("layers", [None, ()])
def test_abort_right_after_start_send_settles_the_handle(layers):
    """The send's task is cancelled before its first step (it never ran): wait() and begun() must still
    end with TransferAborted, nothing sent, nothing left registered."""
    async def scenario():
        a, b, src, dst = await pair()
        exp = b.expect("r", [0, 1], timeout=5.0)
        h = a.start_send("r", b.endpoint(), [0, 1], [0, 1], layers=layers)
        await h.abort()
        with pytest.raises(TransferAborted):
            await h.wait()
        with pytest.raises(TransferAborted):
            await h.begun()
        assert h.state == "aborted" and not dst.view(torch.uint8).any()
        await b.abort("r")  # the decode side gives its blocks back (its lease / the router's Release)
        with pytest.raises(TransferAborted):
            await exp.wait()
        await close_clean(a, b)

    run(scenario())


@pytest.mark.parametrize("opts", [{}, {"force_staging": True, "max_frame_bytes": 4096}])
def test_layers_pushed_one_by_one_while_sending_arrive_byte_exact(opts):
    """Layer-wise pushes queued back to back (the path where the sender merges them into one pipelined
    call): every layer lands in its own blocks, byte-exact, and the send and the expectation complete."""
    async def main():
        lay = layout(num_layers=6, dtype="float32", block_size=16)
        a, b, src, dst = await pair(lay, src_blocks=20, dst_blocks=24, **opts)
        s_ids, d_ids = [3, 4, 5, 9, 1], [20, 21, 22, 2, 7]
        exp = b.expect("r", d_ids, timeout=20)
        h = a.start_send("r", b.endpoint(), s_ids, d_ids, layers=())
        await h.begun()
        for layer in range(lay.num_layers):  # no await between: they queue behind the first
            h.push_layers([layer], final=layer == lay.num_layers - 1)
        await asyncio.gather(h.wait(), exp.wait())
        assert_copied(src, dst, s_ids, d_ids)
        await close_clean(a, b)
    run(main())
