"""What tracing costs the router: CPU per relayed token and per request with tracing off, on (every trace
sampled) and on at 1%, paired in one run (bench/relay_cpu.py), against an OTLP receiver in this process
that keeps nothing (the exporter's work is all that is measured, not a collector's).

    python -m bench.tracing_cost --model .models/tiny --rounds 3 --json out.json
    python -m bench.tracing_cost --model .models/tiny --trees /tmp/pdserve-old,. --off-only

``--off-only`` with ``--trees OLD,NEW``: tracing off on both trees (did the off path change anything?).
The flags of a variant go to every process (router and workers), as ``pdserve up --otlp-endpoint`` does.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = 0

    def Export(self, request, context):
        self.spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--trees", default=".")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--off-only", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("relay_args", nargs="*", help="more bench/relay_cpu.py flags (after --)")
    args = ap.parse_args()
    sink = Sink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    otlp = f"--otlp-endpoint 127.0.0.1:{port}"
    variants = [] if args.off_only else [
        "off=", f"on={otlp} --otlp-sampling 1", f"sampled-1pct={otlp} --otlp-sampling 0.01"]
    cmd = [sys.executable, "-m", "bench.relay_cpu", "--model", args.model, "--trees", args.trees,
           "--rounds", str(args.rounds), *(["--json", args.json] if args.json else []), *args.relay_args]
    for v in variants:
        cmd += ["--variant", v, "--router-variant", v]
    try:
        return subprocess.run(cmd, cwd=Path(__file__).resolve().parent.parent).returncode
    finally:
        print(f"OTLP receiver: {sink.spans} spans received", file=sys.stderr)
        server.stop(0)


if __name__ == "__main__":
    sys.exit(main())
