"""A failure is told only once nothing of the request can land any more.

A striped transfer's frames ride several connections. When the receiver aborts it, the sender
confirms on the home connection (ABORT_ACK) once its writes are done, but a frame it already wrote on
another connection may still be arriving there. If the failure were told at the ack, the decode
service would free the blocks and the rest of that frame would land in them (host memory: straight
into the blocks; device memory: its staging buffer flushed into them). So ``abort()`` and the waiter
return only after every frame of the request being received is in (and dropped, not copied) or its
connection is gone; so does the decode worker's ``KVLink.release``, after which it frees the blocks.
A raw-socket sender plays the sender's part so the timing is exact."""

import asyncio
import dataclasses
import socket

import pytest
import torch

from engine.kv_layout import KVLayout
from kvtransfer import make_transport
from kvtransfer.errors import TransferAborted
from kvtransfer.link import KVLink
from kvtransfer.protocol import HEADER, Msg, decode_header, decode_meta, encode
from tests.unit.kvtransfer_testkit import recv_exact, settled

pytestmark = pytest.mark.timeout(120)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")  # 16 KiB blocks
BLOCKS = 128  # one layer of them per frame: 2 MiB, received by a thread


def _hello(port: int, layout: KVLayout = LAYOUT) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(encode(Msg.HELLO, {"version": 1, "layout_hash": layout.compat_hash(), "want": "tcp",
                                    "sender": "fake-sender"}))
    msg, _f, meta_len, _p = decode_header(recv_exact(sock, HEADER.size))
    assert msg == Msg.HELLO_OK
    recv_exact(sock, meta_len)
    return sock


def _read_frame(sock: socket.socket) -> tuple[Msg, dict]:
    msg, _f, meta_len, _p = decode_header(recv_exact(sock, HEADER.size))
    return msg, decode_meta(recv_exact(sock, meta_len))


@pytest.mark.parametrize("staged", [False, True], ids=["host", "staged"])
@pytest.mark.parametrize("how", ["abort", "link release", "deadline"])
def test_a_frame_still_arriving_after_the_ack_never_lands_in_freed_blocks(staged, how):
    frame_after_ack(how, "cpu", staged)


def frame_after_ack(how: str, device: str, staged: bool) -> None:
    """The scenario, on a cache in ``device`` memory (tests/gpu runs it on CUDA: staged by nature)."""
    layout = dataclasses.replace(LAYOUT, memory=device)

    async def main():
        dst = layout.allocate(BLOCKS + 8)
        b = await make_transport("tcp", layout, dst, force_staging=staged, abort_ack_timeout_s=5.0,
                                 stall_timeout_s=0.5).start()
        loop = asyncio.get_running_loop()
        dst_ids = list(range(8, 8 + BLOCKS))
        link = KVLink(b, lease_s=1.0 if how == "deadline" else 30.0)
        link.expect("s", dst_ids)
        exp = b.receiver.expectations["s"]
        port = b.endpoint()["port"]
        home, other = await loop.run_in_executor(None, lambda: (_hello(port, layout), _hello(port, layout)))
        nbytes = BLOCKS * LAYOUT.num_layers * LAYOUT.block_bytes
        home.sendall(encode(Msg.BEGIN, {"rid": "s", "dst": dst_ids, "nbytes": nbytes, "backend": "tcp",
                                        "stripe": True}))
        msg, _meta = await loop.run_in_executor(None, _read_frame, home)
        assert msg == Msg.BEGIN_OK
        payload = torch.full((BLOCKS * LAYOUT.block_bytes,), 7, dtype=torch.uint8).numpy().tobytes()
        half = len(payload) // 2
        # Layer 0's frame on the other connection: header, metadata and half of the payload now.
        other.sendall(encode(Msg.DATA, {"rid": "s", "segs": [[0, dst_ids[0], BLOCKS]]}, len(payload)))
        other.sendall(payload[:half])
        await asyncio.sleep(0.3)  # a receive thread is on it
        if how == "abort":
            aborting = asyncio.ensure_future(b.abort("s", "client went away"))
        elif how == "link release":
            aborting = asyncio.ensure_future(link.release("s"))
        msg, meta = await loop.run_in_executor(None, _read_frame, home)  # the deadline, or the abort
        assert (msg, meta["rid"]) == (Msg.ABORT, "s")
        home.sendall(encode(Msg.ABORT_ACK, {"rid": "s"}))  # "my writes are done" (one is still in a socket)
        await asyncio.sleep(0.3)
        assert not exp.done(), "failure told while a frame of the request was still arriving"
        if how != "deadline":
            assert not aborting.done()
        assert b.stats()["unsettled"] == 1
        other.sendall(payload[half:])  # the rest of the frame comes in
        with pytest.raises(TransferAborted if how != "deadline" else Exception):
            await asyncio.wait_for(exp.wait(), 5)
        if how != "deadline":
            assert await asyncio.wait_for(aborting, 5) is (True if how == "abort" else None)
        # What the decode service does next: free the blocks, another request's KV lands there.
        dst[:, 8:].zero_()
        await asyncio.sleep(0.3)
        if dst.is_cuda:
            torch.cuda.synchronize()
        assert int(dst[:, 8:].view(torch.uint8).max()) == 0, "an aborted request's bytes landed afterwards"
        home.close()
        other.close()
        await settled(b)

    asyncio.run(main())


def test_a_sender_that_never_finishes_its_frame_is_cut_off_at_the_ack_timeout():
    """No ack, and the frame on the other connection stalls halfway: at abort_ack_timeout_s that
    connection is closed, abort() returns False (unconfirmed) and the blocks stay untouched after."""
    async def main():
        dst = LAYOUT.allocate(BLOCKS + 8)
        b = await make_transport("tcp", LAYOUT, dst, abort_ack_timeout_s=0.5).start()
        loop = asyncio.get_running_loop()
        dst_ids = list(range(8, 8 + BLOCKS))
        b.expect("s", dst_ids, timeout=30)
        port = b.endpoint()["port"]
        home, other = await loop.run_in_executor(None, lambda: (_hello(port), _hello(port)))
        nbytes = BLOCKS * LAYOUT.num_layers * LAYOUT.block_bytes
        home.sendall(encode(Msg.BEGIN, {"rid": "s", "dst": dst_ids, "nbytes": nbytes, "backend": "tcp",
                                        "stripe": True}))
        assert (await loop.run_in_executor(None, _read_frame, home))[0] == Msg.BEGIN_OK
        size = BLOCKS * LAYOUT.block_bytes
        other.sendall(encode(Msg.DATA, {"rid": "s", "segs": [[0, dst_ids[0], BLOCKS]]}, size))
        other.sendall(bytes(size // 2))
        await asyncio.sleep(0.3)
        assert await asyncio.wait_for(b.abort("s", "give up"), 10) is False
        dst[:, 8:].fill_(1.0)
        # the receiver closed the stalled connection (a send timeout would mean it did not)
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            other.settimeout(5)
            for _ in range(64):
                other.sendall(bytes(1 << 20))
        await asyncio.sleep(0.2)
        assert bool((dst[:, 8:] == 1.0).all())
        home.close()
        other.close()
        await settled(b)

    asyncio.run(main())
