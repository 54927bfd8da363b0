"""OpenAI request bodies → the router's own request path, and back.

The HTTP door is a second translator over the path the gRPC servicer uses (``router/service.py``):
a body becomes a ``GenerateRequest``, which goes through the same admission (``admit_async``: the
same validation and messages, large prompts tokenized off the event loop), the same Pipeline
(placement, sessions, retries, cleanup) and the same ``generate_messages`` (detokenization, stop
strings, the final path report). Nothing about serving is decided here, only translated:

- ``model`` must name the served model (404 otherwise); ``n`` must be 1; a field OpenAI defines
  but the cluster does not implement is refused when set (``schemas.UNSUPPORTED``);
- chat ``messages`` are checked (roles, text-only content) and rendered with the model's chat
  template (``router/chat_template.py``), then tokenized without adding special tokens again;
- ``x-session-affinity`` / ``x-reusable-prefix-len`` headers carry what gRPC carries in
  ``session_id`` (or the same metadata key) and ``reusable_prefix_len``;
- ``max_tokens`` (or ``max_completion_tokens``) defaults to 16 for completions, as OpenAI's, and to
  the rest of the context for chat.

``start`` runs a request in a task of its own that fills a queue (``Run``): the HTTP side reads the
queue, and a client that goes away cancels the task once, exactly as gRPC cancels a servicer, so
the Pipeline's cleanup (Release on decode, Abort on prefill) runs whatever the ASGI server does to
the response's own task.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Executor

from pdserve.v1 import common_pb2, router_pb2
from pdserve.wire import retry_after_ms
from router.admission import SESSION_METADATA_KEY, Admitted, ModelLimits, admit_async
from router.chat_template import ChatTemplate, ChatTemplateError
from router.http.errors import OpenAIError, bad_request
from router.http.schemas import UNSUPPORTED, ChatCompletionRequest, CompletionRequest, TextPart
from router.pipeline import Pipeline, RequestFailed
from router.service import generate_messages

REUSABLE_PREFIX_HEADER = "x-reusable-prefix-len"
COMPLETION_DEFAULT_MAX_TOKENS = 16
MAX_COMPLETION_LOGPROBS = 5   # OpenAI's limits on the alternatives per token (the engine's is 20)
MAX_CHAT_TOP_LOGPROBS = 20
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
INLINE_ENCODE_CHARS = 16 * 1024  # longer rendered chats are tokenized on the tokenize pool
_END = object()


class Run:
    """One request's response messages, produced by its own task (see the module docstring)."""

    _live: set[asyncio.Task] = set()  # strong references: a running request is never collected

    def __init__(self, pipeline: Pipeline, req: Admitted, tokenizer: object | None) -> None:
        self.req = req
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._pump(pipeline, tokenizer),
                                                            name=f"http-{req.request_id}")
        Run._live.add(self._task)
        self._task.add_done_callback(Run._live.discard)

    async def _pump(self, pipeline: Pipeline, tokenizer: object | None) -> None:
        try:
            async for msg in generate_messages(pipeline, self.req, tokenizer, None):
                self._queue.put_nowait(msg)
            self._queue.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the reader, which maps it to an HTTP error
            self._queue.put_nowait(exc)

    async def next(self) -> router_pb2.GenerateResponse | None:
        """The next message, None at the end; OpenAIError when the request failed."""
        item = await self._queue.get()
        if item is _END:
            return None
        if isinstance(item, BaseException):
            raise to_openai_error(item)
        return item

    def close(self) -> None:
        """Cancel the request if it is still running (synchronous: safe inside a cancelled scope)."""
        if not self._task.done():
            self._task.cancel()


def to_openai_error(exc: BaseException) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RequestFailed):
        hint = retry_after_ms(getattr(exc, "trailing_metadata", None))
        return OpenAIError.from_grpc(exc.code, exc.message, retry_after_ms=hint)
    from pdserve.server import status_for

    code, message = status_for(exc)
    return OpenAIError.from_grpc(code, message)




class OpenAIFrontend:
    def __init__(self, *, pipeline: Pipeline, limits: ModelLimits, model_name: str,
                 chat_template: ChatTemplate | None, tokenize_pool: Executor | None = None,
                 serving: Callable[[], bool] = lambda: True) -> None:
        self.pipeline = pipeline
        self.limits = limits
        self.model_name = model_name
        self.chat_template = chat_template
        self.tokenize_pool = tokenize_pool
        self.serving = serving

    # ---- requests ---------------------------------------------------------------------------------
    async def admit_completion(self, body: CompletionRequest, headers: Mapping[str, str]) -> Admitted:
        self._common_checks(body)
        req = self._generate_request(body, headers)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request("a batch of prompts is not supported: send one prompt per request",
                                  param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        if body.logprobs is not None:
            if not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:  # OpenAI's limit
                raise bad_request(f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}, got "
                                  f"{body.logprobs}", param="logprobs")
            req.sampling.logprobs = body.logprobs
        max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
        return await self._admit(req, max_tokens, headers)

    async def admit_chat(self, body: ChatCompletionRequest, headers: Mapping[str, str]) -> Admitted:
        self._common_checks(body)
        if self.chat_template is None:
            raise bad_request(f"model {self.model_name!r} has no chat template (chat_template.jinja or "
                              f"tokenizer_config.json chat_template): use /v1/completions",
                              code="chat_template_missing")
        tok = self.limits.tokenizer
        if tok is None:
            raise bad_request("this model has no tokenizer.json: chat needs one", param="messages")
        if body.top_logprobs is not None:
            if not 0 <= body.top_logprobs <= MAX_CHAT_TOP_LOGPROBS:  # OpenAI's limit
                raise bad_request(f"top_logprobs must be between 0 and {MAX_CHAT_TOP_LOGPROBS}, got "
                                  f"{body.top_logprobs}", param="top_logprobs")
            if body.top_logprobs and not body.logprobs:
                raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
        messages = _chat_messages(body)
        try:
            text = self.chat_template.render(messages, add_generation_prompt=body.add_generation_prompt)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), param="messages") from None
        if len(text) > INLINE_ENCODE_CHARS:
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(self.tokenize_pool, lambda: tok.encode(text, False))
        else:
            ids = tok.encode(text, add_special_tokens=False)
        req = self._generate_request(body, headers)
        req.token_ids.ids.extend(ids)
        if body.logprobs:
            req.sampling.logprobs = body.top_logprobs or 0
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # OpenAI: as long as the context allows
            max_tokens = max(1, self.limits.max_model_len - len(ids))
        return await self._admit(req, max_tokens, headers)

    def start(self, req: Admitted) -> Run:
        return Run(self.pipeline, req, self.limits.tokenizer)

    # ---- helpers ----------------------------------------------------------------------------------
    def _common_checks(self, body) -> None:
        if not self.serving():
            raise OpenAIError(503, "the router is not serving (starting or draining)")
        if body.model != self.model_name:
            raise OpenAIError(404, f"the model {body.model!r} does not exist: this router serves "
                                   f"{self.model_name!r} (GET /v1/models)", code="model_not_found",
                              param="model")
        if body.n != 1:
            raise bad_request(f"n must be 1, got {body.n}: send one request per completion", param="n")
        for name, (neutral, message) in UNSUPPORTED.items():
            value = getattr(body, name, None)
            if value is not None and value != neutral and not (value == 1 and name == "best_of"):
                raise bad_request(message, param=name)

    def _generate_request(self, body, headers: Mapping[str, str]) -> router_pb2.GenerateRequest:
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
        sampling = common_pb2.SamplingParams(stop=stop, ignore_eos=body.ignore_eos)
        try:
            sampling.stop_token_ids.extend(body.stop_token_ids or ())
            for name in ("temperature", "top_p", "seed"):
                if (value := getattr(body, name)) is not None:
                    setattr(sampling, name, value)
            if body.top_k is not None:
                sampling.top_k = 0 if body.top_k == -1 else body.top_k  # -1: "off", as vLLM spells it
        except (ValueError, TypeError) as exc:  # a value the wire type cannot hold
            raise bad_request(f"bad sampling value: {exc}") from None
        return router_pb2.GenerateRequest(request_id=uuid.uuid4().hex, sampling=sampling)

    async def _admit(self, req: router_pb2.GenerateRequest, max_tokens: int,
                     headers: Mapping[str, str]) -> Admitted:
        try:
            req.max_tokens = max_tokens
        except ValueError as exc:
            raise bad_request(f"max_tokens: {exc}", param="max_tokens") from None
        reusable = headers.get(REUSABLE_PREFIX_HEADER)
        if reusable is not None:
            try:
                req.reusable_prefix_len = int(reusable)
            except ValueError:
                raise bad_request(f"{REUSABLE_PREFIX_HEADER} must be an integer, got {reusable!r}") from None
        try:
            return await admit_async(req, self.limits, headers.get(SESSION_METADATA_KEY) or None,
                                     self.tokenize_pool)
        except ValueError as exc:
            message = str(exc)
            code = "context_length_exceeded" if "context" in message else None
            raise bad_request(message, code=code) from None


def _chat_messages(body: ChatCompletionRequest) -> list[dict]:
    if not body.messages:
        raise bad_request("messages must hold at least one message", param="messages")
    out = []
    for i, m in enumerate(body.messages):
        if m.role not in CHAT_ROLES:
            raise bad_request(f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {m.role!r}",
                              param=f"messages[{i}].role")
        content = m.content
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, TextPart):
                    raise bad_request(f"messages[{i}].content[{j}] has type {part.type!r}: only text parts "
                                      f"are supported", param=f"messages[{i}].content")
                parts.append(part.text)
            content = "".join(parts)
        if content is None:
            raise bad_request(f"messages[{i}].content is missing", param=f"messages[{i}].content")
        # "developer" is OpenAI's newer name for the system role; templates know "system"
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out
