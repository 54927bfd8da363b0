"""One trace per request across three processes: a real cluster (router, prefill, decode, TCP) exporting
over OTLP/gRPC to a receiver in this test, built on the official OTLP protobufs
(opentelemetry-proto's TraceService). A request whose client sends a W3C ``traceparent`` yields spans
from the router, the prefill worker and the decode worker in the client's trace, each parented by the
span that called it, with the KV push's bytes; a request sent without one gets a trace of its own."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from pdserve.app.launcher.local import LocalCluster
from pdserve.client import Client
from pdserve.probe import free_port

pytestmark = pytest.mark.slow
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every exported span with its service name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes
                                if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    self.spans.extend((service, s) for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def of_trace(self, trace_id: str) -> list[tuple[str, object]]:
        with self.lock:
            return [(svc, s) for svc, s in self.spans if s.trace_id.hex() == trace_id]


@pytest.fixture
def receiver():
    """An OTLP/gRPC receiver on a free port: ``receiver.endpoint`` for the processes' --otlp-endpoint."""
    rec = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, server)
    rec.endpoint = f"127.0.0.1:{server.add_insecure_port(f'127.0.0.1:{free_port()}')}"
    server.start()
    yield rec
    server.stop(0)


def attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = v.string_value or v.int_value or v.double_value or v.bool_value
    return out


def test_one_trace_across_router_prefill_and_decode(make_checkpoint, tmp_path, receiver):
    otlp = ("--otlp-endpoint", receiver.endpoint)
    with LocalCluster(make_checkpoint("llama"), run_dir=tmp_path / "run", transport="tcp",
                      worker_args=("--num-blocks", "256", *otlp), router_args=otlp) as c:
        with Client(c.router, timeout=60) as client:
            r = client.generate(prompt_ids=list(range(5, 60)), max_tokens=6, ignore_eos=True,
                                metadata=[("traceparent", f"00-{TRACE_ID}-{CLIENT_SPAN}-01")])
            assert len(r.token_ids) == 6
            other = client.generate(prompt_ids=list(range(70, 90)), max_tokens=3, ignore_eos=True)
            assert len(other.token_ids) == 3
        wanted = {"pdserve.request", "pdserve.attempt", "pdserve.allocate", "pdserve.prefill",
                  "pdserve.decode", "decode.allocate", "prefill.request", "prefill.queue",
                  "prefill.compute", "kv.push", "decode.stream"}
        deadline = time.monotonic() + 60
        while {s.name for _, s in receiver.of_trace(TRACE_ID)} < wanted and time.monotonic() < deadline:
            time.sleep(0.2)
    spans = receiver.of_trace(TRACE_ID)
    by_name = {s.name: (svc, s) for svc, s in spans}
    assert set(by_name) >= wanted, sorted(by_name)
    assert {svc for svc, _ in spans} == {"pdserve-router", "pdserve-prefill", "pdserve-decode"}

    def parent(name: str) -> str:
        return by_name[name][1].parent_span_id.hex()

    def sid(name: str) -> str:
        return by_name[name][1].span_id.hex()

    # the client's span, then the router's request, attempt and calls, then the workers' spans
    assert parent("pdserve.request") == CLIENT_SPAN
    assert parent("pdserve.attempt") == sid("pdserve.request")
    for call in ("pdserve.allocate", "pdserve.prefill", "pdserve.decode"):
        assert parent(call) == sid("pdserve.attempt")
    assert parent("decode.allocate") == sid("pdserve.allocate") and by_name["decode.allocate"][0] == \
        "pdserve-decode"
    assert parent("prefill.request") == sid("pdserve.prefill") and by_name["prefill.request"][0] == \
        "pdserve-prefill"
    assert parent("decode.stream") == sid("pdserve.decode")
    for stage in ("prefill.queue", "prefill.compute", "kv.push"):
        assert parent(stage) == sid("prefill.request")
    push = attrs(by_name["kv.push"][1])
    assert push["pdserve.kv_bytes"] == r.final["kv_bytes_sent"] > 0
    assert push["pdserve.kv_transport"] == "tcp"
    assert attrs(by_name["pdserve.request"][1])["pdserve.completion_tokens"] == 6
    # the request without a traceparent: a trace of its own, rooted at the router
    roots = [s for _, s in receiver.spans if s.name == "pdserve.request" and s.trace_id.hex() != TRACE_ID]
    assert len(roots) == 1 and not roots[0].parent_span_id


def test_a_migrated_request_shows_its_retry(make_checkpoint, tmp_path, receiver):
    """kill -9 of the decode worker under a traced stream: the request's trace holds a second attempt,
    a continuation on the other decode worker, beside the first one ended with an error."""
    otlp = ("--otlp-endpoint", receiver.endpoint)
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    with LocalCluster(make_checkpoint("llama"), prefill=1, decode=2, run_dir=tmp_path / "run",
                      worker_args=("--num-blocks", "256", *otlp), router_args=otlp) as c:
        with Client(c.router, timeout=120) as client:
            stream = client.stream(prompt_ids=list(range(5, 40)), max_tokens=400, ignore_eos=True,
                                   metadata=[("traceparent", f"00-{trace_id}-{CLIENT_SPAN}-01")])
            ids, killed = [], None
            for msg in stream:
                ids.extend(msg.token_ids)
                if killed is None and len(ids) >= 4:
                    stats = c.stats()
                    busy = [h for h in c.workers if h.role == "decode" and h.alive()
                            and stats[h.worker_id].num_running > 0]
                    assert len(busy) == 1, {w: s.num_running for w, s in stats.items()}
                    killed = busy[0].worker_id
                    c.kill(busy[0])
                if msg.HasField("final"):
                    final = msg.final
            assert len(ids) == 400 and final.facts.decode_worker != killed
        deadline = time.monotonic() + 60
        while (sum(s.name == "pdserve.attempt" for _, s in receiver.of_trace(trace_id)) < 2
               and time.monotonic() < deadline):
            time.sleep(0.2)
    attempts = [s for _, s in receiver.of_trace(trace_id) if s.name == "pdserve.attempt"]
    assert len(attempts) == 2, [attrs(s) for s in attempts]
    first, retry = sorted(attempts, key=lambda s: s.start_time_unix_nano)
    assert attrs(first)["pdserve.decode_worker"] == killed and first.status.code == 2  # ERROR
    assert attrs(retry)["pdserve.continuation"] is True
    assert attrs(retry)["pdserve.decode_worker"] == final.facts.decode_worker
    (request,) = [s for _, s in receiver.of_trace(trace_id) if s.name == "pdserve.request"]
    assert first.parent_span_id == retry.parent_span_id == request.span_id
