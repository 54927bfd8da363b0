"""The OpenAI door's structured-output fields (router/http/structured.py) become the one constraint the
gRPC API carries; forced tool choices are constrained and read back into ``tool_calls``; what cannot be
honoured is a 400 with the reason. Over a fake pipeline (tests/unit/test_openai_errors.py); the live
cluster's answers are tests/integration/test_structured_output.py's."""

from __future__ import annotations

import json

import pytest
from test_openai_errors import ChoicePipeline, serve_and_call

from pdserve.sampling import Constraint
from router.http.tools import REQUIRED, ToolStream, parse

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function",
         "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture
def tok(tiny_llama_dir):
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_llama_dir)


def test_a_model_without_a_tokenizer_refuses_constraints():
    status, _, raw = serve_and_call(ChoicePipeline(), "/v1/completions",
                                    {"model": "m", "prompt": [1, 2], "guided_regex": "[0-9]"})
    assert status == 400 and "tokenizer" in json.loads(raw)["error"]["message"]


def _constraint_of(body: dict, path: str = "/v1/completions", **kw):
    pipe = ChoicePipeline()
    base = {"model": "m", "max_tokens": 2}
    base.update({"prompt": [1, 2]} if path == "/v1/completions" else {})
    status, _, raw = serve_and_call(pipe, path, {**base, **body}, **kw)
    assert status == 200, raw
    return pipe.admitted[0].params.constraint


@pytest.mark.parametrize("body, want", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, Constraint("json_object")),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     Constraint("json_schema", json.dumps(SCHEMA))),
    ({"guided_json": SCHEMA}, Constraint("json_schema", json.dumps(SCHEMA))),
    ({"guided_json": json.dumps(SCHEMA)}, Constraint("json_schema", json.dumps(SCHEMA))),
    ({"guided_regex": "[0-9]+"}, Constraint("regex", "[0-9]+")),
    ({"guided_choice": ["yes", "no"]}, Constraint("choice", choices=("yes", "no"))),
    ({"guided_grammar": 'start: "a"'}, Constraint("grammar", 'start: "a"')),
    ({"structured_outputs": {"choice": ["x", "y"]}}, Constraint("choice", choices=("x", "y"))),
    ({"structured_outputs": {"json_object": True}}, Constraint("json_object")),
    ({"guided_regex": "[0-9]+", "guided_decoding_backend": "xgrammar"}, Constraint("regex", "[0-9]+")),
])
def test_each_form_becomes_the_constraint(body, want, tok):
    assert _constraint_of(body, tokenizer=tok) == want


def test_whitespace_pattern_reaches_the_schema(tok):
    c = _constraint_of({"guided_json": SCHEMA, "guided_whitespace_pattern": "[ ]?"}, tokenizer=tok)
    assert json.loads(c.text)["x-guidance"] == {"whitespace_flexible": True, "whitespace_pattern": "[ ]?"}


@pytest.mark.parametrize("body, contains", [
    ({"guided_regex": "[0-9]+", "guided_choice": ["a"]}, "one structured-output constraint"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "cannot be compiled"),
    ({"response_format": {"type": "structural_tag"}}, "not supported"),
    ({"guided_json": "{broken"}, "not valid JSON"),
    ({"guided_regex": "(unclosed"}, "cannot be compiled"),
    ({"guided_choice": []}, "non-empty list"),
    ({"structured_outputs": {"structural_tag": {}}}, "not supported"),
])
def test_what_cannot_be_honoured_is_a_400_with_the_reason(body, contains, tok):
    status, _, raw = serve_and_call(ChoicePipeline(), "/v1/completions",
                                    {"model": "m", "prompt": [1, 2], "max_tokens": 2, **body}, tokenizer=tok)
    err = json.loads(raw)["error"]
    assert status == 400 and contains in err["message"], err


def test_forced_tool_choices_constrain_the_answer(tok):
    from test_tool_calls import LLAMA3_CHAT_TEMPLATE

    from router.chat_template import ChatTemplate

    tpl = ChatTemplate(LLAMA3_CHAT_TEMPLATE, special_tokens={"bos_token": "<|begin_of_text|>"})
    msgs = [{"role": "user", "content": "hi"}]
    required = _constraint_of({"messages": msgs, "tools": [WEATHER, CLOCK], "tool_choice": "required",
                               "parallel_tool_calls": False}, "/v1/chat/completions", template=tpl,
                              tokenizer=tok, max_model_len=1024)
    schema = json.loads(required.text)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    named = _constraint_of({"messages": msgs, "tools": [WEATHER, CLOCK],
                            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                           "/v1/chat/completions", template=tpl, tokenizer=tok, max_model_len=1024)
    assert json.loads(named.text) == WEATHER["function"]["parameters"]


def test_forced_answers_are_read_into_tool_calls():
    content, calls = parse(REQUIRED, '[{"name": "get_weather", "parameters": {"city": "Rome"}}, '
                                     '{"name": "get_time", "parameters": {}}]')
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    content, calls = parse("named:get_weather", '{"city": "Oslo"}')
    assert content is None
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    stream = ToolStream("named:get_weather")
    assert stream.feed('{"city": ') == "" and stream.feed('"Oslo"}') == ""
    rest, calls = stream.finish("stop")
    assert rest == "" and calls[0]["function"]["name"] == "get_weather"
    cut = ToolStream(REQUIRED)
    cut.feed('[{"name": "get_we')
    assert cut.finish("length") == ('[{"name": "get_we', [])  # cut short: content, finish reason length
