"""A model's chat template: the Jinja program that turns chat messages into one prompt string.

Found where Hugging Face keeps it: ``chat_template.jinja`` in the model directory (the current
format), else ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates
of which "default" is used). A directory with neither has no template, and the HTTP door then
refuses chat requests with a message saying so, instead of guessing a format the model never saw.

Rendering follows ``transformers``' ``apply_chat_template`` so a prompt is byte-identical to what
the model was trained on: Jinja's ``ImmutableSandboxedEnvironment`` (templates from the Hub are
untrusted code) with ``trim_blocks`` / ``lstrip_blocks`` and the loop-controls extension; a
``tojson`` filter that does not HTML-escape; the globals ``raise_exception``, ``strftime_now``,
``dict`` and a ``namespace`` that refuses underscore attributes; the named special tokens
(``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``) as variables; messages whose ``None``
values are dropped. The rendered text already holds the template's special tokens (``bos_token``
usually), so it is tokenized without adding them again (``add_special_tokens=False``).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import ModelLoadError
from engine.tokenizer import TOKENIZER_CONFIG_FILE, read_tokenizer_config, token_str

CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """The template refused the conversation (``raise_exception``) or failed to render it."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` in a template, without exposing the ``dict`` type itself."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore attributes (no reach into CPython internals)."""

    def __init__(*args, **kwargs) -> None:  # noqa: N805 - Jinja's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes "
                                                  f"({name!r})")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


class ChatTemplate:
    def __init__(self, source: str, *, special_tokens: dict[str, str] | None = None) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ValueError(f"the chat template does not parse: {exc}") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ChatTemplate | None:
        """The directory's template, or None when it has none; ValueError on a malformed one."""
        path = Path(path)
        cfg_file = path / TOKENIZER_CONFIG_FILE
        try:
            config = read_tokenizer_config(path)
        except ModelLoadError as exc:
            raise ValueError(str(exc)) from None
        specials = {name: tok for name in SPECIAL_TOKEN_NAMES
                    if (tok := token_str(config.get(name))) is not None}
        jinja_file = path / CHAT_TEMPLATE_FILE
        if jinja_file.is_file():
            return cls(jinja_file.read_text(encoding="utf-8"), special_tokens=specials)
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not source:
            return None
        if not isinstance(source, str):
            raise ValueError(f"{cfg_file}: chat_template must be a string or a list of named templates")
        return cls(source, special_tokens=specials)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True,
               tools: list[dict] | None = None, **kwargs) -> str:
        """The prompt text for ``messages``; ChatTemplateError when the template refuses them."""
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(messages=chat, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as exc:  # raise_exception, SecurityError, undefined calls
            raise ChatTemplateError(f"the model's chat template refused the messages: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(f"the model's chat template failed on the messages: "
                                    f"{type(exc).__name__}: {exc}") from None


