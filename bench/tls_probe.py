"""How fast can this host move bytes over mutual TLS from Python, and does kernel TLS change it?

    python -m bench.tls_probe [--gib 2] [--conns 1,4] [--json OUT]

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
import socket
import ssl
import tempfile
import threading
import time
from pathlib import Path

from bench.kv_certs import write_certs

_WRITE = 16 << 20
_READ = 1 << 20


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
            buf = memoryview(bytearray(_READ))
            done.wait()
            got = 0
            while got < per:
                n = sock.recv_into(buf, min(_READ, per - got))
                if not n:
                    raise ConnectionError("sender closed early")
                got += n
            sock.sendall(b"k")
            sock.close()
        except BaseException as exc:  # reported below
            errors.append(exc)
            done.abort()

    def send() -> None:
        try:
            raw = socket.create_connection(("127.0.0.1", port))
            sock = client_ctx.wrap_socket(raw) if tls else raw
            data = memoryview(bytearray(_WRITE))
            done.wait()
            sent = 0
            while sent < per:
                n = min(_WRITE, per - sent)
                sock.sendall(data[:n])
                sent += n
            if sock.recv(1) != b"k":
                raise ConnectionError("no ack")
            sock.close()
        except BaseException as exc:  # reported below
            errors.append(exc)
            done.abort()

    threads = []
    for _ in range(conns):
        threads += [threading.Thread(target=receive), threading.Thread(target=send)]
    for th in threads:
        th.start()
    before = _tls_stat()
    try:
        done.wait()
    except threading.BrokenBarrierError:
        pass
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    srv.close()
    after = _tls_stat()
    moved = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    if errors:
        return {"mode": mode, "conns": conns, "error": repr(errors[0])}
    return {"mode": mode, "conns": conns, "bytes": per * conns, "seconds": round(wall, 3),
            "gbps": round(per * conns / wall / 1e9, 3), "tls_stat_delta": moved}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="GiB moved per row (split over its connections)")
    ap.add_argument("--conns", default="1,4", help="connection counts")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    ktls = hasattr(ssl, "OP_ENABLE_KTLS")
    print(f"{ssl.OPENSSL_VERSION}; ssl.OP_ENABLE_KTLS {'offered' if ktls else 'not offered by this Python'}; "
          f"/proc/net/tls_stat {'present' if _tls_stat() else 'absent (no kernel tls module)'}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        certs = write_certs(Path(tmp), ["prefill", "decode"])
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
