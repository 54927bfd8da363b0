"""Request bodies of the OpenAI-compatible door, as pydantic models.

Only shapes are checked here (types, NaN / infinity refused, ranges the wire types impose); what a
value means (temperature >= 0, top_p in (0, 1], prompt + max_tokens within the context) is checked
once, by the router's admission, for both doors alike. Fields OpenAI defines that the cluster does
not implement are declared so that a non-default value is refused with a message instead of being
silently ignored (``UNSUPPORTED``); fields nobody declared are ignored, as OpenAI-compatible servers
do, so clients that send vendor extras keep working.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT32 = 2**31 - 1
INT64 = 2**63 - 1


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, ge=-INT32, le=INT32)  # vLLM extension; -1 = off there
    seed: int | None = Field(default=None, ge=-INT64 - 1, le=INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    return_token_ids: bool = False  # vLLM extension: each choice also carries the generated token ids
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM extension
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's JSON) -> bias
    # vLLM extension: false keeps special tokens in the text (default: true; a chat with tools whose
    # call markers are special tokens keeps them unless this says otherwise)
    skip_special_tokens: bool | None = None
    # structured output (router/http/structured.py): OpenAI's response_format, vLLM's guided_* fields and
    # their newer structured_outputs form
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: this cluster has one (llguidance)
    guided_whitespace_pattern: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=-INT32, le=INT32)
    logprobs: int | None = Field(default=None, ge=-INT32, le=INT32)  # top alternatives (0..5 in OpenAI)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class OtherPart(_Body):
    type: str


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart | OtherPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call


class FunctionDef(_Body):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(default=None, ge=-INT32, le=INT32)
    max_completion_tokens: int | None = Field(default=None, ge=-INT32, le=INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=-INT32, le=INT32)
    add_generation_prompt: bool = True  # vLLM extension
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


# field -> (the value meaning "not used", what to say); a request with anything else is refused
UNSUPPORTED: dict[str, tuple[object, str]] = {
    "best_of": (1, "best_of > 1 is not supported"),
    "suffix": ("", "suffix is not supported"),
}


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages rendered as /v1/chat/completions would."""
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompt only: a chat rendering holds its special tokens already
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None


class DetokenizeRequest(_Body):
    model: str
    tokens: list[int]
