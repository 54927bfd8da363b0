"""The KV plane's admission: mutual TLS with the cluster CA on every KV connection (TCP data and NIXL
side channel), NIXL transfers only from the agent a connection named in its HELLO, and listeners on the
configured host only (ours and UCX's). Leak checks after each."""

import asyncio
import os
import signal
import socket
import ssl

import pytest
import torch

from bench.kv_certs import tls_config, write_certs
from bench.kv_peer_proc import fill_random
from bench.kv_peers import PeerClient
from engine.kv_layout import KVLayout
from kvtransfer import InvalidTransfer, PeerUnavailable, make_transport
from kvtransfer.protocol import HEADER, Msg, decode_header, decode_meta, encode
from pdserve.settings import ServeSettings, kv_transport_options
from tests.unit.kvtransfer_testkit import NIXL_ERROR, leak_free

pytestmark = pytest.mark.timeout(120)
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    good = write_certs(tmp_path_factory.mktemp("cluster"), ["prefill", "decode"])
    other = write_certs(tmp_path_factory.mktemp("stranger"), ["prefill"], ca_name="another-ca")
    return good, other


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 100))


async def tls_pair(certs, kind="tcp", **cfg):
    src, dst = LAYOUT.allocate(16), LAYOUT.allocate(16)
    fill_random(src, 3)
    a = await make_transport(kind, LAYOUT, src, **tls_config(certs[0], "prefill"), **cfg).start()
    b = await make_transport(kind, LAYOUT, dst, **tls_config(certs[0], "decode"), **cfg).start()
    return a, b, src, dst


@pytest.mark.parametrize(("kind", "procs"), [("tcp", 0), ("tcp", 2), ("nixl", 1)])
def test_transfers_over_mutual_tls_are_byte_exact(certs, kind, procs):
    """TLS on the connections' own threads (procs 0) and in relay helper processes (tls_relay.py)."""
    if kind == "nixl" and NIXL_ERROR:
        pytest.fail(f"NIXL must import here: {NIXL_ERROR}")

    async def main():
        a, b, src, dst = await tls_pair(certs, kind, tls_procs=procs)
        plans = {f"r{i}": ([i * 2, i * 2 + 1], [15 - i * 2, 14 - i * 2]) for i in range(6)}
        exps = {rid: b.expect(rid, d, timeout=30) for rid, (_s, d) in plans.items()}
        handles = [a.start_send(rid, b.endpoint(), s, d) for rid, (s, d) in plans.items()]
        results = await asyncio.gather(*(h.wait() for h in handles))
        await asyncio.gather(*(e.wait() for e in exps.values()))
        assert {r["backend"] for r in results} == {kind}
        for s_ids, d_ids in plans.values():
            for s, d in zip(s_ids, d_ids, strict=True):
                assert torch.equal(dst[:, d].view(torch.uint8), src[:, s].view(torch.uint8))
        pids = a.relays.pids() + b.relays.pids() if procs else []
        for t in (a, b):
            relays = t.counters()["tls_relays"]
            assert relays["procs"] == procs and (relays["handed"] > 0) == bool(procs), relays
        await leak_free(a, b)
        assert not [pid for pid in pids if _alive(pid)], "TLS relay helpers outlived their transport"
    run(main())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie not reaped yet counts as gone
        return f.read().split(")")[-1].split()[0] != "Z"


def test_a_dead_tls_relay_fails_its_connections_cleanly_and_is_started_again(certs):
    """kill -9 of the receiver's only relay helper: the transfer riding it fails with a clear error (the
    connection reads as reset), nothing leaks, and the next connection gets a new helper that works."""

    async def main():
        a, b, src, dst = await tls_pair(certs, "tcp", tls_procs=1, tcp_connections=1)
        exp = b.expect("r0", [0], timeout=30)
        await a.start_send("r0", b.endpoint(), [0], [0]).wait()
        await exp.wait()
        (pid,) = b.relays.pids()
        os.kill(pid, signal.SIGKILL)
        exp = b.expect("r1", [1], timeout=30)
        for _ in range(3000):  # the sender's connection breaks: its peer is dropped (30 s at most)
            if a.stats()["peers"] == 0:
                break
            await asyncio.sleep(0.01)
        assert a.stats()["peers"] == 0
        await a.start_send("r1", b.endpoint(), [1], [1]).wait()  # a new connection, a new helper
        await exp.wait()
        assert torch.equal(dst[:, :2].view(torch.uint8), src[:, :2].view(torch.uint8))
        assert b.counters()["tls_relays"]["restarts"] == 1 and b.relays.pids() != [pid]
        await leak_free(a, b)
    run(main())


@pytest.mark.parametrize("procs", [0, 1])
def test_large_frames_over_tls_are_byte_exact(certs, procs):
    """In this process (procs 0), payloads of 1 MiB and more are encrypted by the sending lane's I/O thread
    and decrypted by the receiving connection's, straight into the KV (what the thread reads past its
    frame is parsed by the loop); through a relay helper, they cross its socketpair. Transfers sharing a
    connection, small and large, all arrive byte-exact."""
    big = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")  # 16 KiB

    async def main():
        src, dst = big.allocate(600), big.allocate(600)
        fill_random(src, 9)
        cfg = {"max_frame_bytes": 2 << 20, "tcp_connections": 2, "tls_procs": procs}
        a = await make_transport("tcp", big, src, **tls_config(certs[0], "prefill"), **cfg).start()
        b = await make_transport("tcp", big, dst, **tls_config(certs[0], "decode"), **cfg).start()
        sizes = [200, 1, 150, 3, 240]  # blocks: 6.25 MiB .. 32 KiB per transfer
        plans, at = {}, 0
        for i, n in enumerate(sizes):
            plans[f"r{i}"] = (list(range(at, at + n)), list(range(599 - at, 599 - at - n, -1)))
            at += n
        exps = {rid: b.expect(rid, d, timeout=60) for rid, (_s, d) in plans.items()}
        handles = [a.start_send(rid, b.endpoint(), s, d) for rid, (s, d) in plans.items()]
        await asyncio.gather(*(h.wait() for h in handles), *(e.wait() for e in exps.values()))
        for s_ids, d_ids in plans.values():
            assert torch.equal(dst[:, d_ids].view(torch.uint8), src[:, s_ids].view(torch.uint8))
        assert a.counters()["tcp_tx_io"]["frames"] > 0 and b.counters()["tcp_rx_io"]["frames"] > 0
        await leak_free(a, b)
    run(main())


def _recv(sock, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            break
        buf += got
    return buf


def _raw_hello(port: int, wrap=None) -> str:
    """Speak the pdkv HELLO to a KV port (optionally through a TLS context); what came back."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        if wrap is not None:
            sock = wrap.wrap_socket(sock)
        sock.sendall(encode(Msg.HELLO, {"version": 1, "layout_hash": LAYOUT.compat_hash(), "want": "tcp"}))
        # (TLS 1.3: the client's handshake ends before the server has checked the client's certificate;
        # a refusal arrives on the first read.)
        head = _recv(sock, HEADER.size)
        if len(head) < HEADER.size:
            return "closed"
        msg, _f, meta_len, _p = decode_header(head)
        decode_meta(_recv(sock, meta_len))
        return msg.name
    except (ssl.SSLError, ConnectionError, OSError) as exc:
        return f"refused: {type(exc).__name__}"
    finally:
        sock.close()


def test_plaintext_and_wrong_ca_peers_are_refused(certs):
    good, other = certs

    async def main():
        a, b, _src, dst = await tls_pair(certs)
        port = b.endpoint()["port"]
        loop = asyncio.get_running_loop()
        # A plaintext client speaking the protocol: the TLS listener never answers it.
        assert (await loop.run_in_executor(None, _raw_hello, port)).startswith(("closed", "refused"))
        # A TLS client with no certificate, and one whose certificate another CA signed.
        no_cert = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        no_cert.check_hostname = False
        no_cert.load_verify_locations(good / "ca.crt")
        stranger = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        stranger.check_hostname = False
        stranger.load_verify_locations(good / "ca.crt")
        stranger.load_cert_chain(other / "prefill.crt", other / "prefill.key")
        for ctx in (no_cert, stranger):
            assert (await loop.run_in_executor(None, _raw_hello, port, ctx)).startswith(("closed", "refused"))
        member = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # the control: a cluster certificate is answered
        member.check_hostname = False
        member.load_verify_locations(good / "ca.crt")
        member.load_cert_chain(good / "prefill.crt", good / "prefill.key")
        assert await loop.run_in_executor(None, _raw_hello, port, member) == "HELLO_OK"
        # The same with kvtransfer senders: plaintext, and the stranger's CA (both directions of the check).
        exp = b.expect("x", [1], timeout=30)
        for cfg in ({}, tls_config(other, "prefill")):
            async with make_transport("tcp", LAYOUT, LAYOUT.allocate(4), **cfg) as c:
                with pytest.raises(PeerUnavailable):
                    await c.start_send("x", b.endpoint(), [0], [1]).wait()
        assert exp.state == "waiting" and not dst.view(torch.uint8).any(), "a refused peer wrote KV"
        # ... and the legitimate sender still gets through.
        await a.start_send("x", b.endpoint(), [0], [1]).wait()
        await exp.wait()
        for _ in range(200):  # the refused handshakes' connections are gone
            if b.stats()["rx_connections"] <= a.stats()["peers"] * a.config.tcp_connections:
                break
            await asyncio.sleep(0.01)
        await leak_free(a, b)
    run(main())


def test_nixl_begin_only_from_the_agent_named_in_hello(certs):
    """A connection that said HELLO as agent A cannot announce a transfer from agent B: B's WRITE
    completions would otherwise count for it."""
    if NIXL_ERROR:
        pytest.fail(f"NIXL must import here: {NIXL_ERROR}")

    async def main():
        a, b, _src, _dst = await tls_pair(certs, "nixl")
        exp = b.expect("n", [1], timeout=30)
        rx = b.receiver

        class Conn:
            nixl_agent = a.nixl.name
            closed = False
            sent: list = []

            def send(self, msg, meta):
                self.sent.append((msg, meta))

        conn = Conn()
        nbytes = LAYOUT.num_layers * LAYOUT.block_bytes
        rx.on_control(conn, Msg.BEGIN, {"rid": "n", "dst": [1], "nbytes": nbytes, "backend": "nixl",
                                        "agent": "someone-else", "xid": "x1"})
        msg, meta = conn.sent[-1]
        assert msg == Msg.ERROR and "was not named" in meta["message"]
        with pytest.raises(InvalidTransfer, match="was not named"):
            await exp.wait()
        await leak_free(a, b)
    run(main())


@pytest.mark.parametrize("kind", ["tcp", "nixl"])
def test_with_host_127_0_0_1_no_kv_socket_listens_elsewhere(kind):
    """Options as a worker derives them (pdserve/settings.py: the KV listener on --kv-host, UCX's
    devices from it), in a process of its own: every listening socket it has is on 127.0.0.1."""
    opts = kv_transport_options(ServeSettings(role="decode", model="m", host="127.0.0.1"), env={})
    assert opts["listen_host"] == "127.0.0.1" and ("UCX_NET_DEVICES", "lo") in opts["ucx_env"]

    async def main():
        peer = await PeerClient.spawn(env={"UCX_TLS": None, "UCX_NET_DEVICES": None})
        try:
            before = (await peer.call("listening"))["sockets"]
            config = {k: v for k, v in opts.items() if k != "listen_port"}
            config["ucx_env"] = [list(kv) for kv in config["ucx_env"]]
            await peer.call("init", kind=kind, layout=LAYOUT.to_dict(), num_blocks=4, config=config)
            after = (await peer.call("listening"))["sockets"]
        finally:
            await peer.close()
        new = [s for s in after if s not in before]
        assert new, "the transport listens somewhere"
        assert all(host == "127.0.0.1" for host, _port in new), new
        if kind == "nixl":
            assert len(new) >= 2, f"UCX's listeners are counted too: {new}"
    run(main())


def test_kv_tls_procs_reaches_the_transport_only_with_tls(tmp_path):
    """--kv-tls-procs: the worker's TransportConfig gets it when a TLS directory is configured; -1 (the
    default) leaves the transport's own default (a quarter of the cores, 1..8)."""
    base = {"role": "decode", "model": "m", "host": "127.0.0.1"}
    assert "tls_procs" not in kv_transport_options(ServeSettings(**base, kv_tls_procs=3), env={})
    with_tls = ServeSettings(**base, kv_tls_procs=0, tls_dir=str(tmp_path))
    assert kv_transport_options(with_tls, env={})["tls_procs"] == 0
    assert "tls_procs" not in kv_transport_options(ServeSettings(**base, tls_dir=str(tmp_path)), env={})
    with pytest.raises(ValueError, match="kv-tls-procs"):
        ServeSettings(**base, kv_tls_procs=65)


def test_relays_deliver_everything_written_before_a_close_both_ways(certs):
    """Bytes written into a relay's plaintext end just before that end closes reach the other side whole
    (a last ERROR frame before a close, say), then the other side sees the end; both ways."""
    from kvtransfer.config import TransportConfig
    from kvtransfer.tls_relay import TlsRelays, client_status

    def cfg(role):
        good = certs[0]
        return TransportConfig(tls_ca=str(good / "ca.crt"), tls_cert=str(good / f"{role}.crt"),
                               tls_key=str(good / f"{role}.key"))

    rx, tx = TlsRelays(cfg("decode"), 1), TlsRelays(cfg("prefill"), 1)
    try:
        for direction in ("out", "back"):
            srv = socket.create_server(("127.0.0.1", 0))
            out = socket.create_connection(srv.getsockname())
            inn, _ = srv.accept()
            srv.close()
            out, inn = tx.attach(out, server_side=False), rx.attach(inn, server_side=True)
            for s in (out, inn):
                s.setblocking(True)
                s.settimeout(30)
            assert client_status(out.recv(1)) is None
            src, dst = (out, inn) if direction == "out" else (inn, out)
            payload = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MiB, several relay buffers
            src.sendall(payload)
            src.close()
            got = bytearray()
            while chunk := dst.recv(1 << 20):
                got += chunk
            assert bytes(got) == payload, direction
            dst.close()
    finally:
        rx.close()
        tx.close()
    assert not rx.pids() and not tx.pids()
