"""``pdserve certs init DIR [--host NAME ...] [--days N] [--force]``: the files of ``--tls-dir``.

Writes a cluster CA and a certificate + key for the router and each role (router, prefill, decode,
colocated, client); ``--host`` adds names or IPs clients dial the router at (localhost and
127.0.0.1 are always in). Then ``pdserve up --tls-dir DIR`` runs every gRPC port over TLS (mutual
TLS between the cluster's components) and ``pdserve client --tls-dir DIR`` talks to it.
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("certs", help="TLS certificates for --tls-dir")
    sub = p.add_subparsers(dest="certs_command", metavar="ACTION", required=True)
    init = sub.add_parser("init", help="write a cluster CA and a certificate per component")
    init.add_argument("dir")
    init.add_argument("--host", action="append", default=[], metavar="NAME",
                      help="DNS name or IP clients reach the router at (repeatable)")
    init.add_argument("--days", type=int, default=365, help="validity (default 365)")
    init.add_argument("--force", action="store_true", help="replace an existing CA")
    init.set_defaults(func=_init)


def _init(args: argparse.Namespace) -> int:
    from pdserve.app.certs import init_certs

    try:
        written = init_certs(args.dir, hosts=args.host, days=args.days, force=args.force)
    except (ValueError, FileExistsError) as exc:
        print(f"pdserve certs: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} files to {args.dir} (keep ca.key offline; the rest is --tls-dir {args.dir})")
    return 0
