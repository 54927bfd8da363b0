"""Admission: turn a public GenerateRequest into a validated internal request, or refuse it.

Everything a client can get wrong is caught here, before any worker is touched, with a message a
person can act on (ValueError → INVALID_ARGUMENT): empty prompt, ids outside the vocabulary, text
without a tokenizer, prompt + max_tokens beyond the model's context, negative / NaN / out-of-range
sampling values, oversize stop lists, a too-long request id.

Nothing a single request sends may stall the others (the router's event loop serves every stream):

- the request's size is bounded by gRPC itself (``--max-request-bytes``, pdserve/server.py), before
  the message is parsed;
- every cheap check runs first, and a prompt that cannot fit the context is refused by its length
  alone: token ids by their count, text by a lower bound on its token count (no token covers more
  characters than the longest vocabulary entry, ``Tokenizer.max_token_chars``; a factor
  ``NORMALIZER_SLACK`` leaves room for normalizers that shrink text), so an 8 MiB text for a 2k
  context costs microseconds, not a tokenization;
- a structured-output constraint is compiled once against the vocabulary off the event loop, under a
  time bound, and remembered (router/constraints.py);
- a text above ``INLINE_TEXT_CHARS`` is tokenized on a worker thread through the GIL-releasing
  ``encode_releasing_gil``, and its ids are validated there too, so other streams keep flowing.
"""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import Executor
from dataclasses import dataclass

from pdserve.sampling import SamplingParams
from pdserve.v1 import router_pb2
from pdserve.wire import DEFAULT_MAX_TOKENS, sampling_from_proto, validate_token_ids
from router.constraints import check_constraint, compiler_for

MAX_REQUEST_ID_LEN = 128
MAX_SESSION_ID_LEN = 256
SESSION_METADATA_KEY = "x-session-affinity"
INLINE_TEXT_CHARS = 16 * 1024  # longer texts are tokenized off the event loop
NORMALIZER_SLACK = 4


@dataclass(frozen=True, kw_only=True)
class Admitted:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    session_id: str | None
    reusable_prefix_len: int | None
    want_text: bool
    eos_token_ids: tuple[int, ...] = ()  # the model's; a continuation never runs past one (migration)
    skip_special_tokens: bool = True  # special tokens left out of the text (router/text.py)
    trace: object = None  # the trace context of its request span (pdserve/tracing.py), when tracing is on


@dataclass(frozen=True, kw_only=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    tokenizer: object | None  # engine.tokenizer.Tokenizer or None
    eos_token_ids: tuple[int, ...] = ()  # the model's end-of-sequence tokens
    # characters of the tokenizer's longest vocabulary entry (0: measured here from the tokenizer)
    max_token_chars: int = 0

    def __post_init__(self) -> None:
        if not self.max_token_chars and self.tokenizer is not None:
            object.__setattr__(self, "max_token_chars", max(1, self.tokenizer.max_token_chars()))


@dataclass(frozen=True)
class _Checked:
    """What admission learnt before tokenizing: everything except the prompt's ids."""
    request_id: str
    params: SamplingParams
    session_id: str | None


def _check(req: router_pb2.GenerateRequest, limits: ModelLimits, metadata_session: str | None) -> _Checked:
    """Every check that needs no tokenization, the context bound included; ValueError on the first miss."""
    request_id = req.request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_LEN or not request_id.isprintable():
        raise ValueError(f"request_id must be printable and at most {MAX_REQUEST_ID_LEN} characters")
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise ValueError("prompt is empty: set `text` or `token_ids`")
    max_tokens = req.max_tokens if req.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    params = sampling_from_proto(req.sampling, max_tokens)
    params.check_vocab(limits.vocab_size)
    room = limits.max_model_len - params.max_tokens
    if params.seed_draws >= limits.max_model_len:
        raise ValueError(f"seed_draws must be below the model's context of {limits.max_model_len}")
    if kind == "text":
        if not req.text:
            raise ValueError("prompt is empty")
        if limits.tokenizer is None:
            raise ValueError("this model has no tokenizer.json: send token_ids instead of text")
        at_least = len(req.text) // (limits.max_token_chars * NORMALIZER_SLACK)
        if at_least > room:
            raise ValueError(f"prompt text of {len(req.text)} characters is at least {at_least} tokens; with "
                             f"max_tokens ({params.max_tokens}) it exceeds the model's context of "
                             f"{limits.max_model_len} tokens")
    elif len(req.token_ids.ids) > room:
        raise ValueError(f"prompt ({len(req.token_ids.ids)} tokens) + max_tokens ({params.max_tokens}) "
                         f"exceeds the model's context of {limits.max_model_len} tokens")
    session = req.session_id or metadata_session or None
    if session is not None and len(session) > MAX_SESSION_ID_LEN:
        raise ValueError(f"session_id must be at most {MAX_SESSION_ID_LEN} characters")
    return _Checked(request_id, params, session)


def _prompt_ids(req: router_pb2.GenerateRequest, limits: ModelLimits, *, release_gil: bool) -> list[int]:
    if req.WhichOneof("prompt") == "text":
        tok = limits.tokenizer
        ids = tok.encode_releasing_gil(req.text) if release_gil else tok.encode(req.text)
    else:
        ids = req.token_ids.ids
    return validate_token_ids(ids, limits.vocab_size)


def _admitted(req: router_pb2.GenerateRequest, limits: ModelLimits, c: _Checked, ids: list[int]) -> Admitted:
    if len(ids) + c.params.max_tokens > limits.max_model_len:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({c.params.max_tokens}) exceeds the "
                         f"model's context of {limits.max_model_len} tokens")
    reusable = req.reusable_prefix_len if req.HasField("reusable_prefix_len") else None
    if reusable is not None and not 0 <= reusable <= len(ids):
        raise ValueError(f"reusable_prefix_len must be in 0..{len(ids)}, got {reusable}")
    return Admitted(request_id=c.request_id, prompt_ids=ids, params=c.params, session_id=c.session_id,
                    reusable_prefix_len=reusable, eos_token_ids=limits.eos_token_ids,
                    want_text=not req.skip_text and limits.tokenizer is not None,
                    skip_special_tokens=not req.HasField("skip_special_tokens") or req.skip_special_tokens)


def admit(req: router_pb2.GenerateRequest, limits: ModelLimits,
          metadata_session: str | None = None) -> Admitted:
    """Admit on the calling thread (tests, tools); the servicers use ``admit_async``."""
    checked = _check(req, limits, metadata_session)
    if checked.params.constraint is not None:
        _compiler(limits).compile(checked.params.constraint)
    return _admitted(req, limits, checked, _prompt_ids(req, limits, release_gil=False))


def _compiler(limits: ModelLimits):
    if limits.tokenizer is None:
        raise ValueError("structured output needs the model's tokenizer.json, which this model lacks")
    return compiler_for(limits.tokenizer, limits.vocab_size, limits.eos_token_ids)


def _is_large(req: router_pb2.GenerateRequest) -> bool:
    kind = req.WhichOneof("prompt")
    return (len(req.text) > INLINE_TEXT_CHARS if kind == "text"
            else len(req.token_ids.ids) > INLINE_TEXT_CHARS)


async def admit_async(req: router_pb2.GenerateRequest, limits: ModelLimits,
                      metadata_session: str | None = None, executor: Executor | None = None) -> Admitted:
    """``admit`` that tokenizes and validates a large prompt on ``executor`` (default: the loop's), and
    checks a structured-output constraint there (router/constraints.py)."""
    checked = _check(req, limits, metadata_session)
    if checked.params.constraint is not None:
        await check_constraint(checked.params.constraint, _compiler(limits), executor)
    if not _is_large(req):
        return _admitted(req, limits, checked, _prompt_ids(req, limits, release_gil=False))
    loop = asyncio.get_running_loop()
    ids = await loop.run_in_executor(executor, lambda: _prompt_ids(req, limits, release_gil=True))
    return _admitted(req, limits, checked, ids)


def limits_from_model_dir(path: str) -> ModelLimits:
    from engine.config import ModelConfig
    from engine.tokenizer import Tokenizer

    config = ModelConfig.from_pretrained(path)
    return ModelLimits(vocab_size=config.vocab_size, max_model_len=config.max_position_embeddings,
                       tokenizer=Tokenizer.from_dir(path), eos_token_ids=tuple(config.eos_token_ids))
