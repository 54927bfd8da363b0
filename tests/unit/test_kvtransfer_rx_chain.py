"""A receive thread that finished a DATA payload takes the next frame's head off the socket when it is
already there (TransportConfig.tcp_rx_chain): frames queued back to back are chained byte-exact, and a
malformed head behind a thread-read payload still closes the connection. Leak checks after each."""

import asyncio
import socket

import pytest
import torch

from bench.kv_peer_proc import fill_random
from engine.kv_layout import KVLayout
from kvtransfer import make_transport
from kvtransfer.protocol import HEADER, Msg, decode_header, encode
from tests.unit.kvtransfer_testkit import recv_exact as _recv_exact
from tests.unit.kvtransfer_testkit import settled

pytestmark = pytest.mark.timeout(120)


def _chain_counter(monkeypatch) -> list[int]:
    """Counts the frame heads receive threads took off the socket after their payload (tcp_rx_chain)."""
    from kvtransfer import rx_conn

    took: list[int] = []
    real = rx_conn._next_frame_head

    def counted(sock):
        head = real(sock)
        if head is not None:
            took.append(len(head))
        return head

    monkeypatch.setattr(rx_conn, "_next_frame_head", counted)
    return took


@pytest.mark.parametrize("chain", [True, False])
def test_frames_queued_back_to_back_are_chained_by_the_receive_thread_byte_exact(monkeypatch, chain):
    """A sender writes BEGIN, four 1 MiB DATA frames and END in one go, so each next frame's head is in the
    socket when a receive thread finishes a payload: with tcp_rx_chain the thread takes it (one loop turn
    per frame), the last one being END, a control frame; the KV is byte-exact either way and nothing is
    left behind."""
    big = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")  # 16 KiB

    async def main():
        took = _chain_counter(monkeypatch)
        blocks = 128  # frames of one layer and half the blocks: 64 x 16 KiB = 1 MiB, read by a thread
        src = big.allocate(blocks)
        fill_random(src, 21)
        dst = big.allocate(blocks + 4)
        b = await make_transport("tcp", big, dst, tcp_rx_chain=chain).start()
        dst_ids = list(range(4, 4 + blocks))
        exp = b.expect("c", dst_ids, timeout=30)
        sock = socket.create_connection(("127.0.0.1", b.endpoint()["port"]))
        bb = big.block_bytes
        nbytes = blocks * big.num_layers * bb

        def send_all():
            sock.sendall(encode(Msg.HELLO, {"version": 1, "layout_hash": big.compat_hash(), "want": "tcp"}))
            msg, _f, meta_len, _p = decode_header(_recv_exact(sock, HEADER.size))
            assert msg == Msg.HELLO_OK
            _recv_exact(sock, meta_len)
            out = [encode(Msg.BEGIN, {"rid": "c", "dst": dst_ids, "nbytes": nbytes, "backend": "tcp"})]
            half = blocks // 2  # each frame: one layer, half of the blocks
            for layer in range(big.num_layers):
                for part in range(2):
                    lo = part * half
                    payload = src[layer, lo:lo + half].contiguous().view(torch.uint8).numpy().tobytes()
                    meta = {"rid": "c", "segs": [[layer, dst_ids[lo], half]]}
                    out += [encode(Msg.DATA, meta, len(payload)), payload]
            out.append(encode(Msg.END, {"rid": "c", "nbytes": nbytes}))
            sock.sendall(b"".join(out))

        await asyncio.get_running_loop().run_in_executor(None, send_all)
        result = await exp.wait()
        assert result["bytes"] == nbytes
        assert torch.equal(dst[:, dst_ids].view(torch.uint8), src.view(torch.uint8))
        assert (len(took) > 0) if chain else not took, took
        sock.close()
        await settled(b)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_malformed_frame_head_behind_a_thread_read_payload_closes_the_connection_and_fails_the_transfer():
    """Garbage right behind a thread-read DATA payload: the receive thread leaves it on the socket (it only
    takes a head that decodes), the loop's parser refuses it, the connection is closed and the transfer
    fails; nothing is left behind."""
    from kvtransfer import TransferError

    big = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")

    async def main():
        src, dst = big.allocate(64), big.allocate(64)
        fill_random(src, 22)
        b = await make_transport("tcp", big, dst, stall_timeout_s=0.2).start()
        ids = list(range(64))
        exp = b.expect("g", ids, timeout=30)
        sock = socket.create_connection(("127.0.0.1", b.endpoint()["port"]))
        nbytes = 64 * big.num_layers * big.block_bytes

        def send_all():
            sock.sendall(encode(Msg.HELLO, {"version": 1, "layout_hash": big.compat_hash(), "want": "tcp"}))
            _recv_exact(sock, decode_header(_recv_exact(sock, HEADER.size))[2])
            payload = src[0].contiguous().view(torch.uint8).numpy().tobytes()  # 1 MiB: a thread reads it
            sock.sendall(encode(Msg.BEGIN, {"rid": "g", "dst": ids, "nbytes": nbytes, "backend": "tcp"})
                         + encode(Msg.DATA, {"rid": "g", "segs": [[0, 0, 64]]}, len(payload)) + payload
                         + b"NOPE" + bytes(60))

        await asyncio.get_running_loop().run_in_executor(None, send_all)
        with pytest.raises(TransferError):
            await exp.wait()
        sock.close()
        await settled(b)

    asyncio.run(asyncio.wait_for(main(), 60))
