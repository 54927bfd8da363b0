"""The HTTP door's refusals that a live CPU cluster does not produce on demand, over a real uvicorn
server on loopback with a stand-in pipeline: a full cluster (RESOURCE_EXHAUSTED with the router's
retry hint → 429 + Retry-After), no worker (UNAVAILABLE → 503), a deadline (504), a model without a
chat template, a failure after the first token (an error event, then [DONE]), and the mapping table.
"""

from __future__ import annotations

import asyncio
import http.client
import json

import grpc
import pytest

from pdserve.v1 import router_pb2
from router.admission import ModelLimits
from router.http.app import build_app
from router.http.errors import HTTP_STATUS, OpenAIError
from router.http.frontend import OpenAIFrontend
from router.http.server import HttpServer
from router.pipeline import FirstToken, RequestFailed


class FakePipeline:
    """Fails with ``exc`` before the first token, or after ``tokens_first`` tokens."""

    def __init__(self, exc: BaseException, tokens_first: int = 0) -> None:
        self.exc = exc
        self.tokens_first = tokens_first

    async def run(self, req, timeout):
        for i in range(self.tokens_first):
            yield FirstToken(10 + i, None)
        raise self.exc


def refused(code: grpc.StatusCode, message: str, retry_ms: int | None = None) -> RequestFailed:
    exc = RequestFailed(code, message)
    if retry_ms is not None:
        exc.trailing_metadata = (("retry-after-ms", str(retry_ms)),)
    return exc


def call(port: int, path: str, body: dict) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def serve_and_call(pipeline, path: str, body: dict, *, template=None, tokenizer=None, max_model_len=256):
    async def main():
        limits = ModelLimits(vocab_size=1024, max_model_len=max_model_len, tokenizer=tokenizer)
        front = OpenAIFrontend(pipeline=pipeline, limits=limits, model_name="m", chat_template=template)
        server = HttpServer(build_app(front), host="127.0.0.1", port=0, drain_timeout=1)
        await server.start()
        try:
            return await asyncio.to_thread(call, server.port, path, body)
        finally:
            await server.stop()

    return asyncio.run(main())


@pytest.mark.parametrize("code,status", [(grpc.StatusCode.UNAVAILABLE, 503),
                                         (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
                                         (grpc.StatusCode.INTERNAL, 500)])
def test_refusals_map_to_http_status(code, status) -> None:
    got, _, body = serve_and_call(FakePipeline(refused(code, "why")), "/v1/completions",
                                  {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2})
    err = json.loads(body)["error"]
    assert got == status and err["message"] == "why" and err["code"] == code.name.lower()


def test_full_cluster_is_429_with_retry_after_from_the_routers_hint() -> None:
    exc = refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "every decode worker is full", retry_ms=2500)
    status, headers, body = serve_and_call(FakePipeline(exc), "/v1/completions",
                                           {"model": "m", "prompt": [1, 2, 3], "stream": True})
    assert status == 429 and headers["retry-after"] == "3"  # seconds, rounded up
    assert json.loads(body)["error"]["type"] == "rate_limit_error"
    status, headers, _ = serve_and_call(FakePipeline(refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")),
                                        "/v1/completions", {"model": "m", "prompt": [1]})
    assert status == 429 and headers["retry-after"] == "1"  # no hint: the default


def test_failure_after_the_first_token_is_an_error_event_then_done() -> None:
    exc = refused(grpc.StatusCode.UNAVAILABLE, "decode worker died")
    status, _, body = serve_and_call(FakePipeline(exc, tokens_first=1), "/v1/completions",
                                     {"model": "m", "prompt": [1, 2], "stream": True, "max_tokens": 5})
    events = [line[len("data: "):] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "decode worker died"


def test_chat_without_template_is_refused_clearly(tiny_llama_dir) -> None:
    from engine.tokenizer import Tokenizer

    status, _, body = serve_and_call(FakePipeline(AssertionError("not reached")), "/v1/chat/completions",
                                     {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                                     tokenizer=Tokenizer.from_dir(tiny_llama_dir))
    err = json.loads(body)["error"]
    assert status == 400 and "no chat template" in err["message"] and err["code"] == "chat_template_missing"


def test_every_grpc_code_has_a_status() -> None:
    for code in grpc.StatusCode:
        e = OpenAIError.from_grpc(code, "x")
        assert e.status == HTTP_STATUS.get(code, 500)
        assert e.body()["error"]["message"] == "x"
    assert HTTP_STATUS[grpc.StatusCode.INVALID_ARGUMENT] == 400
    assert HTTP_STATUS[grpc.StatusCode.UNAUTHENTICATED] == 401
    assert HTTP_STATUS[grpc.StatusCode.NOT_FOUND] == 404
    assert router_pb2.GenerateRequest  # the wire types the door translates into are importable


class ChoicePipeline:
    """Answers each choice with two tokens, except the request ids in ``fail`` (refused before their
    first token, after ``delay`` s); records which requests ran and which were cancelled."""

    def __init__(self, fail: set[str] = frozenset(), delay: float = 0.0, hold: float = 0.0) -> None:
        self.fail, self.delay, self.hold = fail, delay, hold
        self.seen: list[tuple[str, int | None]] = []
        self.admitted: list = []  # the Admitted requests, in order
        self.cancelled: list[str] = []

    async def run(self, req, timeout):
        from router.pipeline import Done, ServingMeta, Tokens

        self.seen.append((req.request_id, req.params.seed))
        self.admitted.append(req)
        try:
            if req.request_id in self.fail:
                await asyncio.sleep(self.delay)
                raise refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "every decode worker is full", retry_ms=900)
            yield FirstToken(11, None)
            await asyncio.sleep(self.hold)
            yield Tokens([12], [], [])
            yield Done("length", 2, ServingMeta(cached_tokens=1))
        except asyncio.CancelledError:
            self.cancelled.append(req.request_id)
            raise


def test_n_choices_fan_out_with_seeds_and_indexes() -> None:
    pipe = ChoicePipeline()
    status, headers, body = serve_and_call(pipe, "/v1/completions",
                                           {"model": "m", "prompt": [[1, 2], [3]], "n": 2, "seed": 2**63 - 1,
                                            "max_tokens": 2, "temperature": 1})
    out = json.loads(body)
    assert status == 200, out
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    rid = headers["x-request-id"]
    assert out["id"] == f"cmpl-{rid}"
    # prompt p, choice j: its own request id and seed + j (wrapped to int64, as the wire holds it)
    assert sorted(pipe.seen) == sorted([(f"{rid}-p0-0", 2**63 - 1), (f"{rid}-p0-1", -2**63),
                                        (f"{rid}-p1-0", 2**63 - 1), (f"{rid}-p1-1", -2**63)])
    # each prompt counted once (2 + 1 tokens, 1 cached each), every choice's 2 completion tokens
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11,
                            "prompt_tokens_details": {"cached_tokens": 2}}
    assert all(c["pdserve"] is not None for c in out["choices"])


def test_a_choice_refused_before_its_first_token_fails_the_request_and_cancels_the_rest() -> None:
    """One choice shed while its siblings already stream: the answer is that refusal (429 with the
    router's hint), and the siblings' requests are cancelled (their pipeline cleanup runs)."""
    pipe = ChoicePipeline(delay=0.3, hold=30.0)
    pipe.fail = {"x"}  # set below, once the ids are known: fail the last choice of any request

    class LastFails(ChoicePipeline):
        async def run(self, req, timeout):
            if req.request_id.endswith("-2"):
                pipe.fail = {req.request_id}
            async for e in pipe.run(req, timeout):
                yield e

    status, headers, body = serve_and_call(LastFails(), "/v1/completions",
                                           {"model": "m", "prompt": [1, 2], "n": 3, "stream": True})
    assert status == 429 and headers["retry-after"] == "1"
    assert json.loads(body)["error"]["type"] == "rate_limit_error"
    assert sorted(r.rsplit("-", 1)[1] for r in pipe.cancelled) == ["0", "1"]
