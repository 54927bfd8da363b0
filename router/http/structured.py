"""Structured output at the OpenAI door: the body's constraint fields → one ``pdserve.v1.Constraint``.

What clients send, all mapped onto the one constraint the gRPC API carries (``SamplingParams.constraint``):

* OpenAI's ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``, ``{"type":
  "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`` (strict or not, the
  answer is held to the schema: constrained decoding cannot do less);
* vLLM's extensions: ``guided_json`` (a schema, as an object or JSON text), ``guided_regex``,
  ``guided_choice``, ``guided_grammar`` (Lark or GBNF), ``guided_whitespace_pattern`` (the whitespace a
  JSON answer may hold), and the newer ``structured_outputs`` object (``json``, ``regex``, ``choice``,
  ``grammar``, ``json_object``);
* ``tool_choice: "required"`` and a named function (chat with ``tools``): the answer is constrained to
  a JSON array of calls to the given tools (``required``; one call when ``parallel_tool_calls`` is false)
  or to the named function's arguments, and read back into ``tool_calls`` (``tools.parse``).

A request may set one of them; two are refused (400), as is a kind this door does not know. Whether the
constraint compiles is the router's admission's question (router/constraints.py), answered for both
doors alike.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.v1 import common_pb2
from router.http.errors import bad_request
from router.http.tools import NAMED, REQUIRED


def _schema_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, bool)):
        return json.dumps(value)
    raise bad_request(f"{param} must be a JSON schema (an object)", param=param)


def _from_response_format(rf: dict) -> common_pb2.Constraint | None:
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return common_pb2.Constraint(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format json_schema needs a json_schema object with a schema",
                              param="response_format")
        schema = spec.get("schema", {})
        return common_pb2.Constraint(json_schema=_schema_text(schema, "response_format.json_schema.schema"))
    raise bad_request(f"response_format type {kind!r} is not supported: use text, json_object or "
                      f"json_schema", param="response_format")


def _from_structured_outputs(so: dict) -> list[tuple[str, common_pb2.Constraint]]:
    found = []
    for key, value in so.items():
        if value is None or value is False:
            continue
        param = f"structured_outputs.{key}"
        if key == "json":
            found.append((param, common_pb2.Constraint(json_schema=_schema_text(value, param))))
        elif key == "json_object":
            found.append((param, common_pb2.Constraint(json_object=True)))
        elif key == "regex":
            found.append((param, common_pb2.Constraint(regex=str(value))))
        elif key == "choice":
            found.append((param, _choice(value, param)))
        elif key == "grammar":
            found.append((param, common_pb2.Constraint(grammar=str(value))))
        elif key in ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"):
            continue  # options of a JSON constraint this door's defaults already decide
        else:
            raise bad_request(f"structured_outputs.{key} is not supported: use json, json_object, regex, "
                              f"choice or grammar", param=param)
    return found


def _choice(value: Any, param: str) -> common_pb2.Constraint:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise bad_request(f"{param} must be a non-empty list of non-empty strings", param=param)
    return common_pb2.Constraint(choice=common_pb2.Choices(values=value))


def body_constraint(body) -> common_pb2.Constraint | None:
    """The constraint a completion or chat body asks for (None: none); 400 for two, or a bad shape."""
    found: list[tuple[str, common_pb2.Constraint]] = []
    if body.response_format:
        c = _from_response_format(body.response_format)
        if c is not None:
            found.append(("response_format", c))
    if body.guided_json is not None:
        found.append(("guided_json", common_pb2.Constraint(
            json_schema=_schema_text(body.guided_json, "guided_json"))))
    if body.guided_regex is not None:
        found.append(("guided_regex", common_pb2.Constraint(regex=body.guided_regex)))
    if body.guided_choice is not None:
        found.append(("guided_choice", _choice(body.guided_choice, "guided_choice")))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", common_pb2.Constraint(grammar=body.guided_grammar)))
    if body.structured_outputs:
        found += _from_structured_outputs(body.structured_outputs)
    if len(found) > 1:
        raise bad_request(f"one structured-output constraint per request; this one sets "
                          f"{', '.join(name for name, _ in found)}", param=found[1][0])
    if not found:
        return None
    constraint = found[0][1]
    if body.guided_whitespace_pattern and constraint.WhichOneof("kind") == "json_schema":
        constraint.json_schema = _with_whitespace(constraint.json_schema, body.guided_whitespace_pattern)
    return constraint


def _with_whitespace(schema_text: str, pattern: str) -> str:
    """The schema with llguidance's whitespace option set (``x-guidance``), as vLLM's
    ``guided_whitespace_pattern`` asks."""
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return schema_text  # admission answers the schema's own error
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), "whitespace_flexible": True,
                                           "whitespace_pattern": pattern}}
    return json.dumps(schema)


def tool_constraint(tools: list, choice, parallel: bool | None) -> tuple[common_pb2.Constraint, str]:
    """(the constraint, the answer's parser) of ``tool_choice`` ``"required"`` or a named function."""
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                   "parameters": t.function.parameters or {"type": "object"}},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if parallel is False:
            schema["maxItems"] = 1
        return common_pb2.Constraint(json_schema=json.dumps(schema)), REQUIRED
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str) or choice.get("type", "function") != "function":
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", '
                          '"function": {"name": ...}}', param="tool_choice")
    for t in tools:
        if t.function.name == name:
            params = t.function.parameters or {"type": "object"}
            return common_pb2.Constraint(json_schema=json.dumps(params)), NAMED + name
    raise bad_request(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
