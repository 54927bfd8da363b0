"""A small Python client for the public Router API (also used by `pdserve client` and `pdserve bench`).

    from pdserve.client import Client
    with Client("127.0.0.1:50051") as c:
        result = c.generate(prompt="Hello", max_tokens=16)
        print(result.text, result.ttft_s, result.final["decode_worker"])

``stream()`` yields ``Chunk``s as they arrive (the first one carries the first token, straight from
prefill); ``generate()`` collects them into a ``Result`` with TTFT and inter-token latencies. Errors
surface as ``grpc.RpcError`` with the router's status code. ``AsyncClient`` is the asyncio twin.

TLS: ``Client(address, tls_dir=DIR)`` (the directory of ``pdserve certs init``) verifies the router
against the cluster CA in ``DIR/ca.crt``, expecting a certificate for ``server_name`` (default
``"router"``, which every router certificate of ``certs init`` carries; ``""`` checks the address's
host name instead), and presents ``DIR/client.crt`` when there is one. ``set_default_tls(DIR)``
makes that the default of every client created afterwards (tools that create clients inside).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

from google.protobuf.json_format import MessageToDict

from pdserve.sampling import Constraint
from pdserve.tls import KEEPALIVE_OPTIONS, TlsDir, open_channel
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from pdserve.wire import constraint_to_proto, report, top_pairs

# keepalive during calls: a stream from a router that froze ends UNAVAILABLE, not at its deadline
_OPTIONS = [("grpc.max_receive_message_length", 16 << 20), ("grpc.max_send_message_length", 16 << 20),
            *KEEPALIVE_OPTIONS]
_DEFAULT_TLS: list[str | None] = [None]


def set_default_tls(tls_dir: str | None) -> None:
    """The ``tls_dir`` of every client created without one (``pdserve bench --tls-dir``)."""
    _DEFAULT_TLS[0] = tls_dir


def _channel(address: str, tls_dir: str | None, server_name: str, aio: bool):

    tls_dir = tls_dir if tls_dir is not None else _DEFAULT_TLS[0]
    tls = TlsDir(tls_dir) if tls_dir else None
    identity = "client" if tls is not None and tls.has("client") else None
    return open_channel(address, tls=tls, identity=identity, server_role=server_name, options=_OPTIONS,
                        aio=aio)


@dataclass(frozen=True)
class Chunk:
    token_ids: list[int]
    text: str
    at: float  # time.perf_counter() when received
    final: router_pb2.FinalInfo | None = None
    logprobs: list[float] = field(default_factory=list)  # per token (logprobs requested)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token (logprobs > 0)


@dataclass
class Result:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    # with logprobs=N: each token's logprob, and (N > 0) its N most likely (token_id, logprob)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str = ""
    final: dict = field(default_factory=dict)
    start: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival time of each token
    end: float = 0.0

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.start if self.token_times else float("nan")

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies (tokens arriving in one message count as gap 0)."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def mean_itl_s(self) -> float:
        gaps = self.itl_s
        return sum(gaps) / len(gaps) if gaps else float("nan")

    @property
    def e2e_s(self) -> float:
        return self.end - self.start

    @property
    def tpot_s(self) -> float:
        n = len(self.token_ids)
        return (self.end - self.token_times[0]) / (n - 1) if n > 1 else float("nan")

    def to_json(self) -> dict:
        out = {"request_id": self.request_id, "token_ids": self.token_ids, "text": self.text,
               "finish_reason": self.finish_reason}
        out.update((k, v) for k, v in self.final.items() if k != "finish_reason")  # every fact it carries
        out["ttft_ms"] = self.ttft_s * 1e3
        out["mean_itl_ms"] = self.mean_itl_s * 1e3 if self.itl_s else None
        out["e2e_ms"] = self.e2e_s * 1e3
        return out


def build_request(*, prompt: str | None = None, prompt_ids: Sequence[int] | None = None, max_tokens: int = 16,
                  session_id: str = "", request_id: str = "", temperature: float | None = None,
                  top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                  stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                  reusable_prefix_len: int | None = None, logprobs: int | None = None,
                  presence_penalty: float | None = None, frequency_penalty: float | None = None,
                  repetition_penalty: float | None = None, logit_bias: dict[int, float] | None = None,
                  skip_special_tokens: bool | None = None,
                  constraint: Constraint | None = None) -> router_pb2.GenerateRequest:
    """``logprobs``: None = off, 0 = each token's logprob, N = also its N most likely alternatives.
    Penalties and ``logit_bias`` (token id -> bias) as in ``SamplingParams`` (pdserve.sampling).
    ``skip_special_tokens=False`` keeps special tokens in the text (None: the router's default, True).
    ``constraint``: structured output (a JSON schema, regex, choice or grammar; pdserve.sampling)."""
    sampling = common_pb2.SamplingParams(stop=list(stop), stop_token_ids=list(stop_token_ids),
                                         ignore_eos=ignore_eos, logit_bias=logit_bias or {})
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("seed", seed),
                        ("logprobs", logprobs), ("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty), ("repetition_penalty", repetition_penalty)):
        if value is not None:
            setattr(sampling, name, value)
    constraint_to_proto(constraint, sampling.constraint)
    req = router_pb2.GenerateRequest(request_id=request_id, sampling=sampling, max_tokens=max_tokens,
                                     session_id=session_id)
    if prompt_ids is not None:
        req.token_ids.ids.extend(int(t) for t in prompt_ids)
    elif prompt is not None:
        req.text = prompt
    if reusable_prefix_len is not None:
        req.reusable_prefix_len = reusable_prefix_len
    if skip_special_tokens is not None:
        req.skip_special_tokens = skip_special_tokens
    return req


def _final_dict(final: router_pb2.FinalInfo) -> dict:
    return report(final)


class _Collector:
    def __init__(self) -> None:
        self.result = Result(start=time.perf_counter())

    def add(self, msg: router_pb2.GenerateResponse) -> Chunk:
        now = time.perf_counter()
        r = self.result
        r.request_id = msg.request_id or r.request_id
        r.token_ids.extend(msg.token_ids)
        r.token_times.extend([now] * len(msg.token_ids))
        r.text += msg.text
        lps = list(msg.logprobs)
        top = [top_pairs(t) for t in msg.top_logprobs]
        r.logprobs.extend(lps)
        r.top_logprobs.extend(top)
        final = msg.final if msg.HasField("final") else None
        if final is not None:
            r.final = _final_dict(final)
            r.finish_reason = final.finish_reason
            r.end = now
        return Chunk(list(msg.token_ids), msg.text, now, final, lps, top)


class Client:
    def __init__(self, address: str, *, timeout: float | None = None, tls_dir: str | None = None,
                 server_name: str = "router") -> None:
        self.channel = _channel(address, tls_dir, server_name, aio=False)
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.timeout = timeout

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def stream(self, request: router_pb2.GenerateRequest | None = None, *, timeout: float | None = None,
               metadata: Sequence[tuple[str, str]] = (), **kwargs) -> Iterator[router_pb2.GenerateResponse]:
        request = request or build_request(**kwargs)
        return self.stub.Generate(request, timeout=timeout or self.timeout, metadata=list(metadata) or None)

    def generate(self, request: router_pb2.GenerateRequest | None = None, *, timeout: float | None = None,
                 metadata: Sequence[tuple[str, str]] = (), **kwargs) -> Result:
        col = _Collector()
        for msg in self.stream(request, timeout=timeout, metadata=metadata, **kwargs):
            col.add(msg)
        if not col.result.end:
            col.result.end = time.perf_counter()
        return col.result

    def list_workers(self) -> list[dict]:
        """The router's workers as dicts, every field present (``healthy`` is False for a worker that is
        not answering, not a missing key)."""
        resp = self.stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=self.timeout or 10)
        return [MessageToDict(w, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
                for w in resp.workers]


class AsyncClient:
    def __init__(self, address: str, *, timeout: float | None = None, tls_dir: str | None = None,
                 server_name: str = "router") -> None:
        self.channel = _channel(address, tls_dir, server_name, aio=True)
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.timeout = timeout

    async def close(self) -> None:
        await self.channel.close()

    async def stream(self, request: router_pb2.GenerateRequest, *, timeout: float | None = None,
                     metadata: Sequence[tuple[str, str]] = ()) -> AsyncIterator[Chunk]:
        col = _Collector()
        call = self.stub.Generate(request, timeout=timeout or self.timeout, metadata=list(metadata) or None)
        async for msg in call:
            yield col.add(msg)

    async def generate(self, request: router_pb2.GenerateRequest, *, timeout: float | None = None,
                       metadata: Sequence[tuple[str, str]] = ()) -> Result:
        col = _Collector()
        call = self.stub.Generate(request, timeout=timeout or self.timeout, metadata=list(metadata) or None)
        async for msg in call:
            col.add(msg)
        if not col.result.end:
            col.result.end = time.perf_counter()
        return col.result
