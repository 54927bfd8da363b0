"""The OpenAI-compatible HTTP API as a FastAPI application.

    POST /v1/completions        POST /v1/chat/completions   (``stream: true``: server-sent events,
    GET  /v1/models             GET  /health                 ending with ``data: [DONE]``)
    GET  /v1/models/{model}     POST /tokenize, /detokenize  (vLLM's: ids of a prompt or chat, and back)

Routes only translate (``frontend.py`` builds and admits the request, ``responses.py`` shapes the
answer). A streamed request waits for its first message before the response starts, so a refusal
that comes before the first token (no worker, every worker full, a bad value) is a real HTTP status
with Retry-After where it applies, not an error event inside a 200. An error after the first token
is sent as an ``{"error": ...}`` event (what OpenAI's clients raise on), then ``[DONE]``.

Bodies over ``MAX_BODY_BYTES`` are refused with 413 before they are read whole. API keys are checked
ahead of everything else (a wrong key gets 401 even with a malformed body); /health stays open.
SSE framing is FastAPI's (``fastapi.sse``), JSON is the standard library's.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse, format_sse_event
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.body_limit import RequestBodyLimitMiddleware

from router.api_keys import ApiKeys, bearer_token
from router.http.errors import OpenAIError
from router.http.frontend import Choice, OpenAIFrontend, Run
from router.http.responses import Answer, Collector, report_headers
from router.http.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

MAX_BODY_BYTES = 8 * 1024 * 1024  # a 128k-token prompt as JSON token ids is under 1 MiB
OPEN_PATHS = frozenset({"/health"})
_DONE = format_sse_event(data_str="[DONE]")


class Gate:
    """ASGI middleware in front of everything: with keys, every path but OPEN_PATHS needs
    ``Authorization: Bearer KEY`` (401); a declared Content-Length over the limit is refused (413) in
    OpenAI's shape before a byte of the body is read. (A chunked body without a length is cut by
    Starlette's limiter, also 413, as plain text.)"""

    def __init__(self, app, keys: ApiKeys | None, max_body_bytes: int) -> None:
        self.app = app
        self.keys = keys if keys is not None and keys.enabled else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            err = self._refusal(scope)
            if err is not None:
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> OpenAIError | None:
        headers = Headers(scope=scope)
        if self.keys is not None and scope["path"] not in OPEN_PATHS:
            key = bearer_token(headers.get("authorization"))
            if not self.keys.allows(key):
                return OpenAIError(401, self.keys.refusal(key), code="invalid_api_key")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return OpenAIError(413, f"request body too large: {length} bytes, at most {self.max_body_bytes}",
                               code="request_too_large")
        return None


def _sse(obj: dict) -> bytes:
    return format_sse_event(data_str=json.dumps(obj, ensure_ascii=False))


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    e = errors[0]
    if e.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    where = ".".join(loc) or "body"
    return f"{where}: {e.get('msg', 'invalid value')}", where


def build_app(frontend: OpenAIFrontend, *, keys: ApiKeys | None = None,
              healthy: Callable[[], bool] = lambda: True, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None, strict_content_type=False)
    app.add_middleware(RequestBodyLimitMiddleware, max_body_size=max_body_bytes)  # bodies without a length
    app.add_middleware(Gate, keys=keys, max_body_bytes=max_body_bytes)  # added last: runs first

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return OpenAIError(400, message, param=param, code="invalid_request").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = (f"request body too large: at most {max_body_bytes} bytes" if exc.status_code == 413
                   else str(exc.detail))
        return OpenAIError(exc.status_code, message).response()

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = healthy()
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    def model_card() -> dict:
        return {"id": frontend.model_name, "object": "model", "created": 0, "owned_by": "pdserve",
                "max_model_len": frontend.limits.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        if model != frontend.model_name:
            raise OpenAIError(404, f"the model {model!r} does not exist: this router serves "
                                   f"{frontend.model_name!r}", code="model_not_found", param="model")
        return model_card()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        ids = await frontend.tokenize(body)
        return {"count": len(ids), "max_model_len": frontend.limits.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        return {"prompt": frontend.detokenize(body)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        choices = await frontend.admit_completion(body, request.headers)
        return await _answer(frontend.start(choices), _answer_for(frontend, body, choices, "completion",
                                                                  body.logprobs is not None), body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        choices = await frontend.admit_chat(body, request.headers)
        return await _answer(frontend.start(choices), _answer_for(frontend, body, choices, "chat",
                                                                  body.logprobs), body.stream)

    return app


def _answer_for(frontend: OpenAIFrontend, body, choices: list[Choice], kind: str, logprobs: bool) -> Answer:
    usage = bool(body.stream_options and body.stream_options.include_usage)
    return Answer([Collector(kind=kind, request_id=c.response_id, model=frontend.model_name,
                             tokenizer=frontend.limits.tokenizer, logprobs=logprobs, include_usage=usage,
                             return_token_ids=body.return_token_ids, index=c.index, echo=c.echo,
                             tool_parser=c.tool_parser)
                   for c in choices], [c.prompt for c in choices])


async def _answer(run: Run, answer: Answer, stream: bool):
    headers = {"x-request-id": run.request_id}
    try:
        first = await run.first_messages()  # a refusal before the first token is the response's status
    except BaseException:
        run.close()
        raise
    if stream:
        return EventSourceResponse(_events(run, answer, first), headers=headers)
    try:
        for index, msg in first:
            answer.add(index, msg)
        while (item := await run.next()) is not None:
            answer.add(*item)
    finally:
        run.close()
    body = answer.response()
    if answer.first.report is not None:
        headers.update(report_headers(answer.first.report, answer.usage or answer.first.usage))
    return JSONResponse(body, headers=headers)


async def _events(run: Run, answer: Answer, first: list) -> AsyncIterator[bytes]:
    try:
        for opener in answer.first_chunks():
            yield _sse(opener)
        for index, msg in first:
            for chunk in answer.chunk(index, msg):
                yield _sse(chunk)
        while True:
            try:
                item = await run.next()
            except OpenAIError as exc:  # after the first token the status is sent: report in-band
                yield _sse(exc.body())
                break
            if item is None:
                break
            for chunk in answer.chunk(*item):
                yield _sse(chunk)
        yield _DONE
    finally:
        run.close()  # the client went away mid-stream: the requests' tasks are cancelled, blocks freed
