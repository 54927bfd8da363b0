"""OpenAI request bodies → the router's own request path, and back.

The HTTP door is a second translator over the path the gRPC servicer uses (``router/service.py``):
a body becomes a ``GenerateRequest``, which goes through the same admission (``admit_async``: the
same validation and messages, large prompts tokenized off the event loop), the same Pipeline
(placement, sessions, retries, cleanup) and the same ``generate_messages`` (detokenization, stop
strings, the final path report). Nothing about serving is decided here, only translated:

- ``model`` must name the served model (404 otherwise); a field OpenAI defines but the cluster
  does not implement is refused when set (``schemas.UNSUPPORTED``);
- ``n`` choices per prompt, and a batch of prompts (``/v1/completions``), are one router request per
  choice (at most ``MAX_CHOICES`` in all), each admitted, placed, streamed and cleaned up on its own;
  the prompt is tokenized once per prompt. Choice ``j`` of a seeded request samples with ``seed +
  j`` (as vLLM's), so choices differ and each is reproducible; greedy choices are equal. They share
  the request's session (a session-affine router sends them to one worker, whose prefix cache then
  holds the prompt for the later ones). Choice ``index`` is ``prompt * n + j``;
- ``echo`` (completions) puts the prompt's text before the completion's;
- chat ``messages`` are checked (roles, text-only content) and rendered with the model's chat
  template (``router/chat_template.py``), then tokenized without adding special tokens again;
- ``x-session-affinity`` / ``x-reusable-prefix-len`` headers carry what gRPC carries in
  ``session_id`` (or the same metadata key) and ``reusable_prefix_len``;
- structured output (``response_format``, vLLM's ``guided_*`` / ``structured_outputs``, a forced
  ``tool_choice``) becomes the request's ``SamplingParams.constraint`` (router/http/structured.py);
- ``max_tokens`` (or ``max_completion_tokens``) defaults to 16 for completions, as OpenAI's, and to
  the rest of the context for chat.

``start`` runs each choice's request in a task of its own that fills one queue for the HTTP request
(``Run``): the HTTP side reads the queue, and a client that goes away cancels the tasks once,
exactly as gRPC cancels a servicer, so the Pipeline's cleanup (Release on decode, Abort on prefill)
runs whatever the ASGI server does to the response's own task. One choice failing ends them all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Executor

from pdserve import tracing
from pdserve.v1 import common_pb2, router_pb2
from pdserve.wire import retry_after_ms, validate_token_ids
from router.admission import SESSION_METADATA_KEY, Admitted, ModelLimits, admit_async
from router.chat_template import ChatTemplate, ChatTemplateError
from router.http import tools
from router.http.errors import OpenAIError, bad_request
from router.http.schemas import (
    UNSUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TextPart,
    TokenizeRequest,
)
from router.http.structured import body_constraint, tool_constraint
from router.pipeline import Pipeline, RequestFailed
from router.service import generate_messages

REUSABLE_PREFIX_HEADER = "x-reusable-prefix-len"
COMPLETION_DEFAULT_MAX_TOKENS = 16
MAX_COMPLETION_LOGPROBS = 5   # OpenAI's limits on the alternatives per token (the engine's is 20)
MAX_CHAT_TOP_LOGPROBS = 20
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
INLINE_ENCODE_CHARS = 16 * 1024  # longer rendered chats are tokenized on the tokenize pool
MAX_CHOICES = 128  # router requests one HTTP request may start (n x prompts; OpenAI caps n at 128)
_END = object()
_INT64 = 1 << 64


@dataclasses.dataclass(frozen=True)
class Choice:
    """One router request of an HTTP request: choice ``index`` of prompt ``prompt``."""
    index: int
    prompt: int
    req: Admitted
    response_id: str  # the HTTP request's: its answer's id and x-request-id
    echo: str = ""  # completions with echo: the prompt's text
    tool_parser: str | None = None  # chat with tools: how its answer's calls are read (tools.py)


class Run:
    """The response messages of an HTTP request's choices, each produced by its own task (see the
    module docstring), read as ``(choice index, message)`` in the order they come."""

    _live: set[asyncio.Task] = set()  # strong references: a running request is never collected

    def __init__(self, pipeline: Pipeline, choices: list[Choice], tokenizer: object | None) -> None:
        self.choices = choices
        self.request_id = choices[0].response_id
        self._queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._tasks = []
        for c in choices:
            task = loop.create_task(self._pump(pipeline, c, tokenizer), name=f"http-{c.req.request_id}")
            Run._live.add(task)
            task.add_done_callback(Run._live.discard)
            self._tasks.append(task)
        self._open = len(choices)
        self._started: set[int] = set()

    async def _pump(self, pipeline: Pipeline, choice: Choice, tokenizer: object | None) -> None:
        try:
            async for msg in generate_messages(pipeline, choice.req, tokenizer, None):
                self._queue.put_nowait((choice.index, msg))
            self._queue.put_nowait((choice.index, _END))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the reader, which maps it to an HTTP error
            self._queue.put_nowait((choice.index, exc))

    async def next(self) -> tuple[int, router_pb2.GenerateResponse] | None:
        """The next (choice index, message), None once every choice has ended; OpenAIError when one
        failed (the others are cancelled then)."""
        while self._open:
            index, item = await self._queue.get()
            if item is _END:
                self._open -= 1
                continue
            if isinstance(item, BaseException):
                self.close()
                raise to_openai_error(item)
            self._started.add(index)
            return index, item
        return None

    async def first_messages(self) -> list[tuple[int, router_pb2.GenerateResponse]]:
        """Every choice's first message (the messages that came meanwhile too, in order), so that a
        refusal of any choice before its first token is the HTTP response's status."""
        got = []
        while len(self._started) < len(self.choices):
            item = await self.next()
            if item is None:
                break
            got.append(item)
        return got

    def close(self) -> None:
        """Cancel every choice still running (synchronous: safe inside a cancelled scope)."""
        for task in self._tasks:
            if not task.done():
                task.cancel()


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
                 serving: Callable[[], bool] = lambda: True, tool_call_parser: str = "auto") -> None:
        self.pipeline = pipeline
        self.limits = limits
        self.model_name = model_name
        self.chat_template = chat_template
        self.tokenize_pool = tokenize_pool
        self.serving = serving
        if tool_call_parser not in tools.PARSERS:
            raise ValueError(f"tool_call_parser must be one of {tools.PARSERS}, got {tool_call_parser!r}")
        self.tool_parser = (tools.detect(chat_template.source if chat_template else None)
                            if tool_call_parser == "auto" else tool_call_parser)

    # ---- requests ---------------------------------------------------------------------------------
    async def admit_completion(self, body: CompletionRequest, headers: Mapping[str, str]) -> list[Choice]:
        self._common_checks(body)
        prompts = body.prompt
        if not (isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list))):
            prompts = [prompts]  # one prompt: a text, or token ids
        self._check_choices(body.n, len(prompts))
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:  # OpenAI's
            raise bad_request(f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}, got "
                              f"{body.logprobs}", param="logprobs")
        if body.echo and body.logprobs is not None:
            raise bad_request("echo with logprobs is not supported (the cluster returns no prompt "
                              "logprobs)", param="echo")
        if body.echo and self.limits.tokenizer is None:
            raise bad_request("echo needs the model's tokenizer (tokenizer.json)", param="echo")
        max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
        base = uuid.uuid4().hex
        choices: list[Choice] = []
        for p, prompt in enumerate(prompts):
            req = self._generate_request(body, headers)
            req.request_id = f"{base}-p{p}" if len(prompts) > 1 else base
            if isinstance(prompt, str):
                req.text = prompt
            else:
                req.token_ids.ids.extend(prompt)
            if body.logprobs is not None:
                req.sampling.logprobs = body.logprobs
            admitted = await self._admit(req, max_tokens, headers)
            echo = ""
            if body.echo:
                echo = prompt if isinstance(prompt, str) else self.limits.tokenizer.decode(
                    admitted.prompt_ids, skip_special_tokens=False)
            choices.extend(self._fan_out(admitted, body.n, p, base, echo))
        return choices

    async def admit_chat(self, body: ChatCompletionRequest, headers: Mapping[str, str]) -> list[Choice]:
        self._common_checks(body)
        self._check_choices(body.n, 1)
        self._template()
        if self.limits.tokenizer is None:
            raise bad_request("this model has no tokenizer.json: chat needs one", param="messages")
        if body.top_logprobs is not None:
            if not 0 <= body.top_logprobs <= MAX_CHAT_TOP_LOGPROBS:  # OpenAI's limit
                raise bad_request(f"top_logprobs must be between 0 and {MAX_CHAT_TOP_LOGPROBS}, got "
                                  f"{body.top_logprobs}", param="top_logprobs")
            if body.top_logprobs and not body.logprobs:
                raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
        tool_defs, parser, forced = self._tools(body)
        ids = await self._encode(self._render(body, body.add_generation_prompt, tool_defs), False)
        req = self._generate_request(body, headers)
        req.token_ids.ids.extend(ids)
        if forced is not None:
            if req.sampling.HasField("constraint"):
                raise bad_request("tool_choice 'required' or a named function constrains the answer "
                                  "already: drop response_format / guided_*", param="tool_choice")
            req.sampling.constraint.CopyFrom(forced)
        if (parser and body.skip_special_tokens is None
                and tools.marks_are_special(parser, self.limits.tokenizer)):
            req.skip_special_tokens = False  # the parser must see the call markers
        if body.logprobs:
            req.sampling.logprobs = body.top_logprobs or 0
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # OpenAI: as long as the context allows
            max_tokens = max(1, self.limits.max_model_len - len(ids))
        return self._fan_out(await self._admit(req, max_tokens, headers), body.n, 0, req.request_id,
                             tool_parser=parser)

    async def tokenize(self, body: TokenizeRequest) -> list[int]:
        """vLLM's /tokenize: the ids a completion's prompt or a chat's messages become here."""
        self._check_model(body.model)
        self._tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send either prompt or messages", param="prompt")
        if body.prompt is not None:
            return await self._encode(body.prompt, body.add_special_tokens)
        self._template()
        chat = ChatCompletionRequest(model=body.model, messages=body.messages, tools=body.tools)
        defs = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        return await self._encode(self._render(chat, body.add_generation_prompt, defs), False)

    def detokenize(self, body: DetokenizeRequest) -> str:
        self._check_model(body.model)
        tok = self._tokenizer()
        try:
            ids = validate_token_ids(body.tokens, self.limits.vocab_size)
        except ValueError as exc:
            raise bad_request(str(exc), param="tokens") from None
        return tok.decode(ids, skip_special_tokens=False)

    def _tokenizer(self):
        if self.limits.tokenizer is None:
            raise bad_request(f"model {self.model_name!r} has no tokenizer.json")
        return self.limits.tokenizer

    def _template(self) -> ChatTemplate:
        if self.chat_template is None:
            raise bad_request(f"model {self.model_name!r} has no chat template (chat_template.jinja or "
                              f"tokenizer_config.json chat_template): use /v1/completions",
                              code="chat_template_missing")
        return self.chat_template

    def _render(self, body: ChatCompletionRequest, add_generation_prompt: bool,
                tool_defs: list[dict] | None) -> str:
        """A chat's prompt text, as the model's template renders its messages (and tools)."""
        try:
            return self._template().render(_chat_messages(body), add_generation_prompt=add_generation_prompt,
                                           tools=tool_defs)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), param="messages") from None

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``; a long one on the tokenize pool (GIL released), off the event loop."""
        tok = self._tokenizer()
        if len(text) > INLINE_ENCODE_CHARS:
            return await asyncio.get_running_loop().run_in_executor(
                self.tokenize_pool, lambda: tok.encode_releasing_gil(text, add_special_tokens))
        return tok.encode(text, add_special_tokens=add_special_tokens)

    def start(self, choices: list[Choice]) -> Run:
        return Run(self.pipeline, choices, self.limits.tokenizer)

    # ---- helpers ----------------------------------------------------------------------------------
    def _common_checks(self, body) -> None:
        if not self.serving():
            raise OpenAIError(503, "the router is not serving (starting or draining)")
        self._check_model(body.model)
        for name, (neutral, message) in UNSUPPORTED.items():
            value = getattr(body, name, None)
            if value is not None and value != neutral and not (value == 1 and name == "best_of"):
                raise bad_request(message, param=name)

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise OpenAIError(404, f"the model {model!r} does not exist: this router serves "
                                   f"{self.model_name!r} (GET /v1/models)", code="model_not_found",
                              param="model")

    @staticmethod
    def _check_choices(n: int, prompts: int) -> None:
        if n < 1:
            raise bad_request(f"n must be at least 1, got {n}", param="n")
        if n * prompts > MAX_CHOICES:
            what = f"n ({n}) x prompts ({prompts})" if prompts > 1 else f"n ({n})"
            raise bad_request(f"{what} asks for {n * prompts} completions; at most {MAX_CHOICES} per "
                              f"request", param="n")

    def _tools(self, body: ChatCompletionRequest) -> tuple[list[dict] | None, str | None,
                                                             common_pb2.Constraint | None]:
        """(the tool definitions the template renders, the parser of the answer's calls or None, the
        constraint of a forced ``tool_choice`` or None)."""
        choice = body.tool_choice
        if not body.tools:
            if choice not in (None, "none"):
                raise bad_request("tool_choice needs tools", param="tool_choice")
            return None, None, None
        renders = tools.renders_tools(self.chat_template.source)
        defs = [t.model_dump(exclude_none=True) for t in body.tools]
        if choice == "required" or isinstance(choice, dict):
            # the answer is held to the calls' schema, so even a template without tools yields calls
            constraint, parser = tool_constraint(body.tools, choice, body.parallel_tool_calls)
            return (defs if renders else None), parser, constraint
        if not renders:
            raise bad_request(f"the chat template of {self.model_name!r} does not render tools",
                              param="tools")
        if choice == "none":
            return defs, None, None
        if self.tool_parser == "none":
            raise bad_request(f"no tool-call parser for {self.model_name!r}: its chat template shows no call "
                              f"syntax this router reads (start it with --tool-call-parser hermes or "
                              f"llama3_json), or send tool_choice 'none'", param="tools")
        return defs, self.tool_parser, None

    @staticmethod
    def _fan_out(req: Admitted, n: int, prompt: int, response_id: str, echo: str = "", *,
                 tool_parser: str | None = None) -> list[Choice]:
        """The n choices of one admitted prompt: choice j is the same request under its own id, with
        ``seed + j`` when seeded (wrapped to int64)."""
        if n == 1:
            return [Choice(prompt, prompt, req, response_id, echo, tool_parser)]
        out = []
        for j in range(n):
            params = req.params
            if params.seed is not None:
                seed = (params.seed + j + (_INT64 >> 1)) % _INT64 - (_INT64 >> 1)
                params = dataclasses.replace(params, seed=seed)
            child = dataclasses.replace(req, request_id=f"{req.request_id}-{j}", params=params)
            out.append(Choice(prompt * n + j, prompt, child, response_id, echo, tool_parser))
        return out

    def _generate_request(self, body, headers: Mapping[str, str]) -> router_pb2.GenerateRequest:
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
        sampling = common_pb2.SamplingParams(stop=stop, ignore_eos=body.ignore_eos)
        try:
            sampling.stop_token_ids.extend(body.stop_token_ids or ())
            for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
                         "repetition_penalty"):
                if (value := getattr(body, name)) is not None:
                    setattr(sampling, name, value)
            for token, bias in (body.logit_bias or {}).items():
                if not token.strip().lstrip("-").isdigit():
                    raise bad_request(f"logit_bias keys must be token ids, got {token!r}", param="logit_bias")
                sampling.logit_bias[int(token)] = bias
            if body.top_k is not None:
                sampling.top_k = 0 if body.top_k == -1 else body.top_k  # -1: "off", as vLLM spells it
        except (ValueError, TypeError) as exc:  # a value the wire type cannot hold
            raise bad_request(f"bad sampling value: {exc}") from None
        constraint = body_constraint(body)
        if constraint is not None:
            sampling.constraint.CopyFrom(constraint)
        req = router_pb2.GenerateRequest(request_id=uuid.uuid4().hex, sampling=sampling)
        if body.skip_special_tokens is not None:
            req.skip_special_tokens = body.skip_special_tokens
        return req

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
            admitted = await admit_async(req, self.limits, headers.get(SESSION_METADATA_KEY) or None,
                                         self.tokenize_pool)
        except ValueError as exc:
            message = str(exc)
            code = "context_length_exceeded" if "context" in message else None
            raise bad_request(message, code=code) from None
        if tracing.enabled():  # the client's traceparent header, continued by the request's span
            admitted = dataclasses.replace(admitted, trace=tracing.extract(headers))
        return admitted


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
        if m.tool_calls and m.role != "assistant":
            raise bad_request(f"messages[{i}]: only assistant messages carry tool_calls",
                              param=f"messages[{i}].tool_calls")
        if content is None and not (m.role == "assistant" and m.tool_calls):
            raise bad_request(f"messages[{i}].content is missing", param=f"messages[{i}].content")
        # "developer" is OpenAI's newer name for the system role; templates know "system"
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [_template_call(c, i) for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _template_call(call, i: int) -> dict:
    """An earlier call as chat templates read it: arguments as an object (OpenAI sends a JSON string;
    templates write it with ``tojson``)."""
    args = call.function.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise bad_request(f"messages[{i}].tool_calls: arguments of {call.function.name!r} are not JSON",
                              param=f"messages[{i}].tool_calls") from None
    out = {"type": "function", "function": {"name": call.function.name, "arguments": args}}
    if call.id is not None:
        out["id"] = call.id
    return out
