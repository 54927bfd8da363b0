"""Tracing: one trace per request across the router, the prefill worker, the KV push and the decode
worker (OpenTelemetry, exported over OTLP/gRPC).

Off by default, and free when off: without ``--otlp-endpoint`` nothing is installed and every helper
here returns at its first line (no span objects, no context lookups). On (``setup``), each process
has a TracerProvider named after its role, a parent-based ratio sampler (``--otlp-sampling``: a
request the client's ``traceparent`` marks as sampled is traced whatever the ratio, as W3C asks) and a
batch exporter.

Context travels as W3C trace context: the router continues the client's ``traceparent`` (gRPC
metadata, HTTP headers) or starts a trace, and hands it to the workers inside the request messages
(``trace_context`` of AllocateRequest, PrefillRequest, DecodeRequest): the router's calls to a decode
worker share one multiplexed stream, so per-call metadata could not carry it. Spans whose times are
measured elsewhere (the prefill worker's queue and compute, the KV push) are recorded after the fact
with explicit start and end times (``record``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping

_tracer = None  # the process's tracer once setup() ran; None: tracing off
_provider = None


def setup(service: str, endpoint: str, sample_ratio: float = 1.0, *, insecure: bool = True,
          schedule_delay_ms: int = 500) -> None:
    """Export this process's spans to ``endpoint`` (``host:port`` or ``http://host:port`` of an OTLP/gRPC
    receiver) as ``service`` (pdserve-router, pdserve-prefill, ...)."""
    global _tracer, _provider
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    if not 0.0 <= sample_ratio <= 1.0:
        raise ValueError(f"--otlp-sampling must be in [0, 1], got {sample_ratio}")
    provider = TracerProvider(resource=Resource.create({"service.name": service}),
                              sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
    exporter = OTLPSpanExporter(endpoint=endpoint.removeprefix("http://"), insecure=insecure)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=schedule_delay_ms))
    _provider, _tracer = provider, provider.get_tracer("pdserve")


def shutdown() -> None:
    """Send what is queued and stop (a draining process, before it exits)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def enabled() -> bool:
    return _tracer is not None


def extract(carrier: Mapping[str, str] | Iterable[tuple[str, str]] | None):
    """The trace context in ``carrier`` (a dict of headers or gRPC metadata pairs), or None."""
    if _tracer is None or not carrier:
        return None
    from opentelemetry.propagate import extract as _extract

    items = carrier.items() if isinstance(carrier, Mapping) else carrier
    return _extract({str(k).lower(): v for k, v in items if isinstance(v, str)})


def inject(span_context) -> dict[str, str]:
    """``span_context``'s trace context (from ``context_of``) as W3C headers, for a request message's
    ``trace_context``; empty when tracing is off."""
    if _tracer is None or span_context is None:
        return {}
    from opentelemetry.propagate import inject as _inject

    carrier: dict[str, str] = {}
    _inject(carrier, context=span_context)
    return carrier


def start(name: str, parent=None, attributes: Mapping[str, object] | None = None, kind: str = "internal"):
    """A started span (None when tracing is off), a child of ``parent`` (a context from ``extract`` or
    ``context_of``). Spans are passed explicitly, never made current: a request's stages run in async
    generators that one task drives, and an explicit parent cannot be lost between their steps."""
    if _tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    return _tracer.start_span(name, context=parent, kind=getattr(SpanKind, kind.upper()),
                              attributes={k: v for k, v in (attributes or {}).items() if v is not None})


def context_of(span):
    """The context whose parent is ``span`` (for its children and for ``inject``); None when off."""
    if span is None:
        return None
    from opentelemetry.trace import set_span_in_context

    return set_span_in_context(span)


def end(span, attributes: Mapping[str, object] | None = None, error: str | None = None) -> None:
    """End ``span`` (no-op for None), with its last attributes and, for a failure, an error status."""
    if span is None:
        return
    if attributes:
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


@contextlib.contextmanager
def span(name: str, parent=None, attributes: Mapping[str, object] | None = None, kind: str = "internal",
         ) -> Iterator[object]:
    """``start`` .. ``end`` around a block; an exception leaving the block marks the span failed."""
    s = start(name, parent, attributes, kind)
    try:
        yield s
    except BaseException as exc:
        end(s, error=f"{type(exc).__name__}: {exc}")
        raise
    end(s)


def record(name: str, start_s: float, end_s: float, parent=None,
           attributes: Mapping[str, object] | None = None) -> None:
    """A span measured elsewhere: ``start_s`` and ``end_s`` on this process's ``time.time()`` clock."""
    if _tracer is None:
        return
    s = _tracer.start_span(name, context=parent, start_time=int(start_s * 1e9),
                           attributes={k: v for k, v in (attributes or {}).items() if v is not None})
    s.end(end_time=int(end_s * 1e9))


def event(span, name: str, attributes: Mapping[str, object] | None = None) -> None:
    if span is not None:
        span.add_event(name, attributes=dict(attributes or {}))


def now() -> float:
    """The clock ``record`` takes (wall time: spans of several processes line up on it)."""
    return time.time()
