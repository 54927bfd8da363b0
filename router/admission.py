"""Admission: turn a public GenerateRequest into a validated internal request, or refuse it.

Everything a client can get wrong is caught here, before any worker is touched, with a message a
person can act on (ValueError → INVALID_ARGUMENT): empty prompt, ids outside the vocabulary, text
without a tokenizer, prompt + max_tokens beyond the model's context, negative / NaN / out-of-range
sampling values, oversize stop lists, a too-long request id.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from pdserve.sampling import SamplingParams
from pdserve.v1 import router_pb2
from pdserve.wire import DEFAULT_MAX_TOKENS, sampling_from_proto, validate_token_ids

MAX_REQUEST_ID_LEN = 128
MAX_SESSION_ID_LEN = 256
SESSION_METADATA_KEY = "x-session-affinity"


@dataclass(frozen=True, kw_only=True)
class Admitted:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    session_id: str | None
    reusable_prefix_len: int | None
    want_text: bool


@dataclass(frozen=True, kw_only=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    tokenizer: object | None  # engine.tokenizer.Tokenizer or None


def admit(req: router_pb2.GenerateRequest, limits: ModelLimits,
          metadata_session: str | None = None) -> Admitted:
    request_id = req.request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_LEN or not request_id.isprintable():
        raise ValueError(f"request_id must be printable and at most {MAX_REQUEST_ID_LEN} characters")
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise ValueError("prompt is empty: set `text` or `token_ids`")
    if kind == "text":
        if not req.text:
            raise ValueError("prompt is empty")
        if limits.tokenizer is None:
            raise ValueError("this model has no tokenizer.json: send token_ids instead of text")
        ids = limits.tokenizer.encode(req.text)
    else:
        ids = list(req.token_ids.ids)
    ids = validate_token_ids(ids, limits.vocab_size)
    max_tokens = req.max_tokens if req.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    params = sampling_from_proto(req.sampling, max_tokens)
    if len(ids) + params.max_tokens > limits.max_model_len:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                         f"model's context of {limits.max_model_len} tokens")
    session = req.session_id or metadata_session or None
    if session is not None and len(session) > MAX_SESSION_ID_LEN:
        raise ValueError(f"session_id must be at most {MAX_SESSION_ID_LEN} characters")
    reusable = req.reusable_prefix_len if req.HasField("reusable_prefix_len") else None
    if reusable is not None and not 0 <= reusable <= len(ids):
        raise ValueError(f"reusable_prefix_len must be in 0..{len(ids)}, got {reusable}")
    return Admitted(request_id=request_id, prompt_ids=ids, params=params, session_id=session,
                    reusable_prefix_len=reusable,
                    want_text=not req.skip_text and limits.tokenizer is not None)


def limits_from_model_dir(path: str) -> ModelLimits:
    from engine.config import ModelConfig
    from engine.tokenizer import Tokenizer

    config = ModelConfig.from_pretrained(path)
    return ModelLimits(vocab_size=config.vocab_size, max_model_len=config.max_position_embeddings,
                       tokenizer=Tokenizer.from_dir(path))
