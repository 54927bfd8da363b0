"""A ``Constraint`` as llguidance's grammar text, and the bounds on what compiling one may cost.

Every kind becomes one grammar string that ``llguidance.LLMatcher`` takes:

* ``json_schema``: the schema through llguidance's JSON compiler. The defaults are compact: ``", "``
  between items, ``": "`` after keys and no other whitespace, so a model cannot wander into endless
  whitespace inside a valid document (a failure users of flexible-whitespace engines report); a schema
  may ask otherwise with llguidance's own ``"x-guidance"`` key (e.g. ``{"whitespace_flexible": true}``);
* ``json_object``: the schema ``{"type": "object"}`` (OpenAI's ``response_format: json_object``);
* ``regex``: the whole answer matches it (Rust ``regex`` syntax, which llguidance's lexer implements);
* ``choice``: a Lark grammar whose start rule is the alternation of the strings as literals;
* ``grammar``: Lark syntax (llguidance's dialect), or GBNF (llama.cpp's; any text holding ``::=``),
  translated to Lark by llguidance.

Bounds: a constraint's text is at most ``MAX_CONSTRAINT_CHARS``; llguidance's parser limits
(``limits()``) cap the work of building its lexer and of each mask, so a hostile grammar (deep nesting,
a huge enum) fails to compile or fails a step instead of stalling a worker; and callers time the
compilation itself (``GrammarCompiler.compile``'s ``timeout``).
"""

from __future__ import annotations

import json

from pdserve.sampling import Constraint

MAX_CONSTRAINT_CHARS = 256 * 1024  # a constraint's text (the schema, regex, grammar or choices)
MAX_CHOICES = 4096
JSON_DEFAULTS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
# llguidance's LLParserLimits, tighter than its defaults where one request could otherwise hold a step
# (verbose errors would put the parser's state and the whole grammar into a client's error message)
LIMITS = {"initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000, "step_max_items": 50_000,
          "max_lexer_states": 100_000, "max_grammar_size": 200_000, "verbose_errors": False}


class GrammarError(ValueError):
    """A constraint that cannot be compiled (bad schema, regex or grammar; over a bound); the message
    says why. ValueError: every service answers it INVALID_ARGUMENT (HTTP 400)."""


def limits():
    import llguidance

    return llguidance.LLParserLimits(**LIMITS)


def grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for ``constraint``; GrammarError when its text is malformed or too large."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if constraint.size > MAX_CONSTRAINT_CHARS:
        raise GrammarError(f"the {constraint.kind} constraint is {constraint.size} characters; at most "
                           f"{MAX_CONSTRAINT_CHARS} are compiled")
    kind = constraint.kind
    if kind in ("json_schema", "json_object"):
        if kind == "json_object":
            schema = {"type": "object"}
        else:
            try:
                schema = json.loads(constraint.text)
            except ValueError as exc:
                raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
            if isinstance(schema, bool):
                schema = {} if schema else {"not": {}}
            if not isinstance(schema, dict):
                raise GrammarError("a JSON schema must be a JSON object (or true / false)")
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"the JSON schema cannot be compiled: {exc}") from None
    if kind == "regex":
        return LLMatcher.grammar_from_regex(constraint.text)
    if kind == "choice":
        if len(constraint.choices) > MAX_CHOICES:
            raise GrammarError(f"{len(constraint.choices)} choices; at most {MAX_CHOICES}")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in constraint.choices))
    text = constraint.text
    if "::=" in text:
        try:
            text = any_to_lark(text)
        except Exception as exc:  # noqa: BLE001 - the converter raises what its parser hits
            raise GrammarError(f"the GBNF grammar cannot be read: {exc}") from None
    return LLMatcher.grammar_from_lark(text)


def validate(constraint: Constraint) -> None:
    """GrammarError unless ``constraint`` compiles (without a vocabulary: the router's early check, which
    gives a client its 400 before the request reaches a worker)."""
    from llguidance import LLMatcher

    grammar = grammar_text(constraint)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, None, limits=limits())
    if is_error:
        raise GrammarError(f"the {constraint.kind} constraint cannot be compiled: {messages[0]}")
