"""``pdserve client --router HOST:PORT (--prompt TEXT | --prompt-ids 1,2,3) ...``: one streamed request.

Prints the text as it streams, then TTFT and mean inter-token latency (stderr). ``--json`` prints one
object instead (token_ids, text, finish_reason, serving metadata, timings). A gRPC error prints
``STATUS_NAME: message`` and exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys

from pdserve.app import constraint_flags, penalty_flags


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("client", help="send one prompt to a router and stream the answer")
    p.add_argument("--router", required=True, help="router address HOST:PORT")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text")
    g.add_argument("--prompt-ids", help="prompt token ids, comma separated")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--session", default="", help="session id (affinity across turns)")
    p.add_argument("--request-id", default="")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    penalty_flags.add(p)
    constraint_flags.add(p)
    p.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds (default 120)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--tls-dir", help="TLS: verify the router against DIR/ca.crt (and present DIR/client.crt)")
    p.set_defaults(func=_run)


# C0 control characters (a random-weight model emits NUL, ESC, ...) would garble a terminal;
# the streamed text shows them escaped. --json output keeps the exact text.
_CONTROL = {c: f"\\x{c:02x}" for c in range(32) if chr(c) not in "\n\t"} | {127: "\\x7f"}


def printable(text: str) -> str:
    return text.translate(_CONTROL)


def _run(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.client import Client, _Collector, build_request

    try:
        ids = None
        if args.prompt_ids is not None:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    except ValueError:
        print("INVALID_ARGUMENT: --prompt-ids must be comma-separated integers", file=sys.stderr)
        return 1
    try:
        penalties = {**penalty_flags.values(args), **constraint_flags.values(args)}
    except ValueError as exc:
        print(f"INVALID_ARGUMENT: {exc}", file=sys.stderr)
        return 1
    req = build_request(prompt=args.prompt, prompt_ids=ids, max_tokens=args.max_tokens,
                        session_id=args.session,
                        request_id=args.request_id, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
                        **penalties)
    col = _Collector()
    try:
        with Client(args.router, tls_dir=args.tls_dir) as client:
            for msg in client.stream(req, timeout=args.timeout):
                chunk = col.add(msg)
                if not args.json and chunk.text:
                    print(printable(chunk.text), end="", flush=True)
    except grpc.RpcError as exc:
        print(f"{exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    r = col.result
    if args.json:
        print(json.dumps(r.to_json()))
    else:
        print()
        itl = f"{r.mean_itl_s * 1e3:.1f} ms" if r.itl_s else "n/a"
        facts = " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in r.final.items() if k not in ("finish_reason", "usage"))
        print(f"[{r.finish_reason}] {len(r.token_ids)} tokens  TTFT {r.ttft_s * 1e3:.1f} ms  "
              f"mean ITL {itl}  {facts}", file=sys.stderr)
    return 0
