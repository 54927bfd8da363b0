"""Tool calls in chat completions: the model's own call syntax → OpenAI's ``tool_calls``.

A chat request with ``tools`` has them rendered by the model's chat template (its ``tools`` variable,
as ``transformers``' ``apply_chat_template`` passes them), and the model answers a call in the syntax
it was trained on. A parser turns that text back into OpenAI's shape, as vLLM's ``--tool-call-parser``
does; which one is the router's ``--tool-call-parser`` (``auto``: read from the template):

* ``hermes`` (Qwen2.5, Hermes, many fine-tunes): ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``, any number, after optional text (the message's ``content``);
* ``llama3_json`` (Llama 3.1 / 3.2 / 3.3): the whole answer is one JSON object ``{"name": ...,
  "parameters": {...}}``, or several separated by ``;``, optionally after ``<|python_tag|>``.

Streaming: text that cannot be the start of a call goes out as content deltas at once; from where a
call may begin, the text is held until the answer ends, then sent as one ``tool_calls`` delta per call
(whole arguments; OpenAI's clients accumulate deltas either way), or as content if it was none. An
answer cut by ``max_tokens`` inside a call is content, finish reason ``length``. ``tool_choice``:
``auto`` (the default with tools) parses, ``none`` does not; ``required`` and a named function constrain
the answer (router/http/structured.py) to a JSON array of ``{"name", "parameters"}`` objects or to the
function's arguments, which are read back here whatever the model's own call syntax.
"""

from __future__ import annotations

import json
import re
import uuid

PARSERS = ("auto", "hermes", "llama3_json", "none")  # pdserve.settings.TOOL_CALL_PARSERS
# a tool_choice the answer is constrained to (router/http/structured.py): its calls are the whole answer
REQUIRED, NAMED = "required", "named:"
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
MARKERS = {"hermes": (_HERMES_OPEN, _HERMES_CLOSE), "llama3_json": (_PYTHON_TAG,)}  # what each parser reads


def detect(template_source: str | None) -> str:
    """The parser a chat template's own call syntax asks for; "none" when it shows none."""
    src = template_source or ""
    if _HERMES_OPEN in src:
        return "hermes"
    if _PYTHON_TAG in src or ("tools" in src and '"parameters"' in src):
        return "llama3_json"
    return "none"


def marks_are_special(parser: str, tokenizer) -> bool:
    """Whether one of ``parser``'s call markers is a special token of ``tokenizer``: the text the router
    sends leaves special tokens out by default, so the parser would never see the call (vLLM turns
    ``skip_special_tokens`` off for such parsers too)."""
    for marker in MARKERS.get(parser, ()):
        token_id = tokenizer.token_to_id(marker)
        if token_id is not None and tokenizer.decode([token_id], skip_special_tokens=True) == "":
            return True
    return False


def renders_tools(template_source: str | None) -> bool:
    """Whether the template reads the ``tools`` variable at all (else tools would vanish silently)."""
    return bool(template_source) and re.search(r"\btools\b", template_source) is not None


def _call(name, arguments) -> dict | None:
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _hermes(text: str) -> tuple[str | None, list[dict]]:
    calls = []
    for body in _HERMES.findall(text):
        try:
            obj = json.loads(body)
        except ValueError:
            return text, []  # not the syntax after all: all of it is content
        call = _call(obj.get("name"), obj.get("arguments")) if isinstance(obj, dict) else None
        if call is None:
            return text, []
        calls.append(call)
    if not calls:
        return text, []
    content = text[:text.index(_HERMES_OPEN)].strip()
    return content or None, calls


def _llama3_json(text: str) -> tuple[str | None, list[dict]]:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return text, []
    decoder, pos, calls = json.JSONDecoder(), 0, []
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return text, []
        call = _call(obj.get("name"), obj.get("parameters", obj.get("arguments"))) \
            if isinstance(obj, dict) else None
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return None, calls


def _forced(parser: str, text: str) -> tuple[str | None, list[dict]]:
    """A ``tool_choice`` the answer was constrained to (router/http/structured.py): a JSON array of
    ``{"name", "parameters"}`` (``required``), or the named function's arguments (``named:NAME``)."""
    try:
        value = json.loads(text)
    except ValueError:
        return text, []
    if parser.startswith(NAMED):
        call = _call(parser[len(NAMED):], value if isinstance(value, dict) else None)
        return (None, [call]) if call is not None else (text, [])
    if not isinstance(value, list):
        return text, []
    calls = [_call(v.get("name"), v.get("parameters")) if isinstance(v, dict) else None for v in value]
    if not calls or any(c is None for c in calls):
        return text, []
    return None, calls


def parse(parser: str, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole answer; no calls: the text unchanged as content."""
    if parser == REQUIRED or parser.startswith(NAMED):
        return _forced(parser, text)
    if parser == "hermes":
        return _hermes(text)
    if parser == "llama3_json":
        return _llama3_json(text)
    return text, []


class ToolStream:
    """One streamed choice's text: ``feed`` returns what may go out as content now, ``finish`` the rest
    as (content, calls) once the answer has ended."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.text = ""  # everything so far
        self.sent = 0  # characters of it already sent as content

    def feed(self, delta: str) -> str:
        self.text += delta
        hold = self._hold_from()
        if hold <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:hold], hold
        return out

    def _hold_from(self) -> int:
        """Where a call may begin: nothing from there on goes out before the end."""
        if self.parser == REQUIRED or self.parser.startswith(NAMED):
            return 0  # the whole answer is the call(s)
        if self.parser == "hermes":
            at = self.text.find(_HERMES_OPEN)
            if at >= 0:
                return at
            for k in range(len(_HERMES_OPEN) - 1, 0, -1):  # a marker's first characters at the end
                if self.text.endswith(_HERMES_OPEN[:k]):
                    return len(self.text) - k
            return len(self.text)
        if self.parser == "llama3_json":
            stripped = self.text.lstrip()
            if not stripped or stripped[0] == "{" or _PYTHON_TAG.startswith(stripped[:len(_PYTHON_TAG)]):
                return self.sent  # (nothing is sent before the answer's start shows it is no call)
            return len(self.text)
        return len(self.text)

    def finish(self, finish_reason: str | None) -> tuple[str, list[dict]]:
        """(content not sent yet, calls). A cut answer (``length``) has no calls: all of it is content."""
        rest = self.text[self.sent:]
        if finish_reason == "length" or self.parser == "none":
            return rest, []
        content, calls = parse(self.parser, self.text)
        if not calls:
            return rest, []
        return (content or "")[self.sent:], calls
