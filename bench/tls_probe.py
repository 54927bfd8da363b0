"""How fast can this host move bytes over mutual TLS from Python, and does kernel TLS change it?

    python -m bench.tls_probe [--gib 2] [--conns 1,4] [--stages] [--relay 1,8 [--pieces 96,1024]]
                              [--json OUT]

Loopback, one process: for each connection count, plaintext sockets, TLS through CPython's ``ssl``
(what the KV plane's TCP fallback uses: one 16 KiB record per read call), and TLS with
``ssl.OP_ENABLE_KTLS`` where this Python and OpenSSL offer it (the kernel then does the record work
once the handshake is done, if its ``tls`` module is loaded; ``/proc/net/tls_stat`` says whether it
did). Each connection has a sending and a receiving thread moving ``--gib`` GiB in 16 MiB writes and
1 MiB reads. Prints a table and writes JSON; timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import ssl
import tempfile
import threading
import time
from pathlib import Path

from bench.kv_certs import write_certs

_WRITE = 16 << 20
_READ = 1 << 20


def _send_bytes(sock, nbytes: int) -> None:
    """Write nbytes (zeros) in _WRITE pieces."""
    data = memoryview(bytearray(_WRITE))
    sent = 0
    while sent < nbytes:
        n = min(_WRITE, nbytes - sent)
        sock.sendall(data[:n])
        sent += n


def _recv_bytes(sock, nbytes: int) -> None:
    """Read exactly nbytes in _READ pieces."""
    buf = memoryview(bytearray(_READ))
    got = 0
    while got < nbytes:
        n = sock.recv_into(buf, min(_READ, nbytes - got))
        if not n:
            raise ConnectionError("the sender closed early")
        got += n


def _timed(threads: list[threading.Thread], start: threading.Barrier) -> float:
    """Start the threads, release them together at the barrier; seconds until all have ended."""
    for th in threads:
        th.start()
    try:
        start.wait()
    except threading.BrokenBarrierError:
        pass
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    return time.perf_counter() - t0


def _tls_stat() -> dict[str, int]:
    try:
        text = Path("/proc/net/tls_stat").read_text()
    except OSError:
        return {}
    return {k: int(v) for k, v in (line.split() for line in text.splitlines() if line.strip())}


def _contexts(certs: Path, ktls: bool) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    for ctx, role in ((server, "decode"), (client, "prefill")):
        ctx.load_cert_chain(certs / f"{role}.crt", certs / f"{role}.key")
        ctx.load_verify_locations(cafile=certs / "ca.crt")
        ctx.verify_mode = ssl.CERT_REQUIRED
        if ktls:
            ctx.options |= ssl.OP_ENABLE_KTLS
    return server, client


def _run(mode: str, conns: int, nbytes: int, certs: Path) -> dict:
    tls = mode != "plain"
    server_ctx, client_ctx = _contexts(certs, mode == "ktls") if tls else (None, None)
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    per = nbytes // conns
    done = threading.Barrier(2 * conns + 1)
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            raw, _ = srv.accept()
            sock = server_ctx.wrap_socket(raw, server_side=True) if tls else raw
            done.wait()
            _recv_bytes(sock, per)
            sock.sendall(b"k")
            sock.close()
        except BaseException as exc:  # reported below
            errors.append(exc)
            done.abort()

    def send() -> None:
        try:
            raw = socket.create_connection(("127.0.0.1", port))
            sock = client_ctx.wrap_socket(raw) if tls else raw
            done.wait()
            _send_bytes(sock, per)
            if sock.recv(1) != b"k":
                raise ConnectionError("no ack")
            sock.close()
        except BaseException as exc:  # reported below
            errors.append(exc)
            done.abort()

    threads = []
    for _ in range(conns):
        threads += [threading.Thread(target=receive), threading.Thread(target=send)]
    before = _tls_stat()
    wall = _timed(threads, done)
    srv.close()
    after = _tls_stat()
    moved = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    if errors:
        return {"mode": mode, "conns": conns, "error": repr(errors[0])}
    return {"mode": mode, "conns": conns, "bytes": per * conns, "seconds": round(wall, 3),
            "gbps": round(per * conns / wall / 1e9, 3), "tls_stat_delta": moved}


def _stages(certs: Path, mib: int = 256) -> dict:
    """What one core does of a TLS relay's work (kvtransfer/tls_relay.py), one thread, no sockets: a
    TlsChannel pair over memory BIOs, per MiB: encrypt (records + the copy out of the BIO), then feed +
    decrypt_all_into, each timed; beside OpenSSL's own cipher speed (``openssl speed``). Each MiB's
    ciphertext is dropped before the next, as a relay drops it once sent: keeping all of them made every
    encryption write fresh pages and read 1.1 GB/s where the relay's steady state does ~2.8 (2-core box)."""
    import shutil  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    from kvtransfer.tls import TlsChannel  # noqa: PLC0415

    server_ctx, client_ctx = _contexts(certs, False)
    a, b = TlsChannel(client_ctx, server_side=False), TlsChannel(server_ctx, server_side=True)
    out = a.handshake()
    while not (a.established and b.established):
        back = b.handshake(out)
        out = a.handshake(back)
    b.handshake(out)
    chunk, dst = memoryview(bytearray(_READ)), memoryview(bytearray(_READ))
    enc = dec = 0.0
    for _ in range(mib):
        t0 = time.perf_counter()
        parts = a.encrypt([chunk])
        t1 = time.perf_counter()
        for ct in parts:
            b.feed(ct)
        got = 0
        while got < _READ:
            got += b.decrypt_all_into(dst[got:])
        enc, dec = enc + t1 - t0, dec + time.perf_counter() - t1
        del parts
    row = {"mode": "stages", "cipher": b._obj.cipher()[0], "encrypt_gbps": round(mib * _READ / enc / 1e9, 3),
           "decrypt_gbps": round(mib * _READ / dec / 1e9, 3)}
    if shutil.which("openssl"):
        for cipher in ("aes-128-gcm", "aes-256-gcm"):
            res = subprocess.run(["openssl", "speed", "-seconds", "1", "-bytes", "16384", "-evp", cipher],
                                 capture_output=True, text=True, timeout=60)
            last = res.stdout.strip().splitlines()[-1].split() if res.returncode == 0 and res.stdout else []
            if last and last[-1].endswith("k"):
                row[f"openssl_{cipher}_gbps"] = round(float(last[-1][:-1]) * 1000 / 1e9, 3)
    return row


def _relay_run(conns: int, nbytes: int, certs: Path, procs: int, piece: int | None) -> dict:
    """Bytes through pairs of TLS relay helpers (kvtransfer/tls_relay.py) as the KV plane moves them:
    plaintext into a sender's socketpair end, TLS between a client-side and a server-side helper,
    plaintext out of the receiver's end; one sending and one receiving thread per connection. procs 0:
    the same connections without TLS (plain TCP), the baseline."""
    from kvtransfer.config import TransportConfig  # noqa: PLC0415
    from kvtransfer.tls_relay import TlsRelays, client_status  # noqa: PLC0415

    def cfg(role: str) -> TransportConfig:
        return TransportConfig(tls_ca=str(certs / "ca.crt"), tls_cert=str(certs / f"{role}.crt"),
                               tls_key=str(certs / f"{role}.key"))

    rx = TlsRelays(cfg("decode"), procs, piece=piece) if procs else None
    tx = TlsRelays(cfg("prefill"), procs, piece=piece) if procs else None
    for relays in (rx, tx):
        if relays is not None:
            relays.start()
    srv = socket.create_server(("127.0.0.1", 0))
    pairs = []
    for _ in range(conns):
        out = socket.create_connection(srv.getsockname())
        inn, _addr = srv.accept()
        if tx is not None:
            out, inn = tx.attach(out, server_side=False), rx.attach(inn, server_side=True)
            out.setblocking(True)
            inn.setblocking(True)
            status = out.recv(1)
            if client_status(status) is not None:
                raise RuntimeError(client_status(status + out.recv(4096)))
        pairs.append((out, inn))
    per = nbytes // conns
    start = threading.Barrier(2 * conns + 1)

    def send(sock) -> None:
        start.wait()
        _send_bytes(sock, per)

    def receive(sock) -> None:
        start.wait()
        _recv_bytes(sock, per)

    cpu0 = _children_cpu()
    threads = [threading.Thread(target=f, args=(s,)) for o, i in pairs for f, s in ((send, o), (receive, i))]
    wall = _timed(threads, start)
    helpers_cpu = _children_cpu() - cpu0
    for o, i in pairs:
        o.close()
        i.close()
    srv.close()
    for relays in (rx, tx):
        if relays is not None:
            relays.close()
    return {"mode": f"relay{procs}" + (f"-piece{piece >> 10}k" if piece else "") if procs else "plain-tcp",
            "conns": conns, "bytes": per * conns, "seconds": round(wall, 3),
            "gbps": round(per * conns / wall / 1e9, 3), "helper_cores": round(helpers_cpu / wall, 2)}


def _children_cpu() -> float:
    """CPU seconds of this process's live children (the relay helpers), from /proc."""
    total = 0.0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid():
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="GiB moved per row (split over its connections)")
    ap.add_argument("--conns", default="1,4", help="connection counts")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--stages", action="store_true", help="first, what one core does of a TLS relay's work")
    ap.add_argument("--relay", default="", help="connection counts: bytes through TLS relay helper pairs "
                    "(kvtransfer/tls_relay.py, one helper per connection a side) beside plain TCP")
    ap.add_argument("--pieces", default="", help="KiB: relay rows per TlsChannel encrypt piece (A/B)")
    ap.add_argument("--rounds", type=int, default=1, help="relay rows repeated, interleaved")
    args = ap.parse_args(argv)
    ktls = hasattr(ssl, "OP_ENABLE_KTLS")
    print(f"{ssl.OPENSSL_VERSION}; ssl.OP_ENABLE_KTLS {'offered' if ktls else 'not offered by this Python'}; "
          f"/proc/net/tls_stat {'present' if _tls_stat() else 'absent (no kernel tls module)'}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        certs = write_certs(Path(tmp), ["prefill", "decode"])
        if args.relay:
            pieces = [int(p) << 10 for p in args.pieces.split(",") if p] or [None]
            for conns in [int(c) for c in args.relay.split(",") if c]:
                for _round in range(args.rounds):
                    for procs, piece in [(0, None)] + [(conns, p) for p in pieces]:
                        row = _relay_run(conns, int(args.gib * (1 << 30)), Path(certs), procs, piece)
                        rows.append(row)
                        print(f"{row['mode']:<18} conns {conns:>2}  {row['gbps']:7.3f} GB/s  helpers "
                              f"{row['helper_cores']} cores", flush=True)
        if args.stages:
            rows.append(_stages(Path(certs)))
            print("one core, 16 KiB records:", {k: v for k, v in rows[-1].items() if k != "mode"}, flush=True)
        for conns in [int(c) for c in args.conns.split(",") if c]:
            plain = None
            for mode in ["plain", "tls"] + (["ktls"] if ktls else []):
                row = _run(mode, conns, int(args.gib * (1 << 30)), Path(certs))
                if mode == "plain":
                    plain = row.get("gbps")
                elif plain and "gbps" in row:
                    row["vs_plain"] = round(row["gbps"] / plain, 3)
                rows.append(row)
                what = (f"{row['gbps']:7.3f} GB/s  vs plain {row.get('vs_plain', 1.0):.2f}  kernel tls "
                        f"counters moved: {row['tls_stat_delta'] or '-'}") if "gbps" in row \
                    else f"FAILED {row['error']}"
                print(f"{mode:<6} conns {conns:>2}  {what}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
