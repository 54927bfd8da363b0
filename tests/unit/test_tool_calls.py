"""Tool calls in chat completions (router/http/tools.py): each parser reads its model family's call
syntax back into OpenAI's shape and leaves anything else as content; a stream holds back only text
that may begin a call and ends with one ``tool_calls`` delta per call; the frontend renders the
tools through the chat template, refuses what it cannot honour (``required``, a named function, a
template without tools) with a 400, and passes earlier calls and tool answers to the template."""

from __future__ import annotations

import json

import pytest
from test_openai_errors import ChoicePipeline, serve_and_call

from engine.checkpoint import LLAMA3_CHAT_TEMPLATE
from pdserve.v1 import common_pb2, router_pb2
from router.chat_template import ChatTemplate
from router.http.responses import Collector
from router.http.tools import ToolStream, detect, marks_are_special, parse

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}


def args(call: dict) -> dict:
    assert call["type"] == "function" and call["id"].startswith("call_")
    return json.loads(call["function"]["arguments"])


def test_hermes_calls_and_content() -> None:
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = parse("hermes", text)
    assert content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert args(calls[0]) == {"city": "Paris"} and args(calls[1]) == {}
    for not_a_call in ("plain answer", "<tool_call>{not json}</tool_call>",
                       '<tool_call>{"x": 1}</tool_call>'):
        assert parse("hermes", not_a_call) == (not_a_call, [])


def test_llama3_json_calls() -> None:
    content, calls = parse("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert content is None and args(calls[0]) == {"city": "Oslo"}
    _, two = parse("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": '
                                  '"{\\"k\\": 2}"}')
    assert [c["function"]["name"] for c in two] == ["a", "b"] and args(two[1]) == {"k": 2}
    for not_a_call in ("The weather is fine.", '{"name": "a"} and then words', '{"city": "Oslo"}', "{"):
        assert parse("llama3_json", not_a_call) == (not_a_call, [])


@pytest.mark.parametrize("parser, pieces, streamed, calls", [
    ("hermes", ["Sure", ". <to", "ol_call>{\"name\": \"f\", ", "\"arguments\": {\"x\": 1}}</tool_call>"],
     "Sure. ", ["f"]),
    ("hermes", ["a <t", "able>"], "a <table>", []),  # a marker's prefix that was not one goes out
    ("llama3_json", [" {\"name\"", ": \"f\", \"parameters\": {}}"], "", ["f"]),
    ("llama3_json", ["Hello", " there"], "Hello there", []),
    ("llama3_json", ["{\"oops\": ", "1}"], "{\"oops\": 1}", []),  # JSON that is no call: content at the end
])
def test_streams_hold_only_what_may_be_a_call(parser, pieces, streamed, calls) -> None:
    s = ToolStream(parser)
    out = "".join(s.feed(p) for p in pieces)
    rest, got = s.finish("stop")
    assert out + rest == streamed  # every character of content, once; nothing of a call
    assert [c["function"]["name"] for c in got] == calls


def test_a_call_cut_by_max_tokens_is_content() -> None:
    s = ToolStream("hermes")
    s.feed('<tool_call>{"name": "f", "arguments": {')
    assert s.finish("length") == ('<tool_call>{"name": "f", "arguments": {', [])


def _msg(text: str, final: str | None = None) -> router_pb2.GenerateResponse:
    m = router_pb2.GenerateResponse(request_id="r", text=text, token_ids=[1])
    if final:
        m.final.finish_reason = final
        m.final.usage.CopyFrom(common_pb2.Usage(prompt_tokens=3, completion_tokens=2))
    return m


def test_collector_whole_and_streamed_tool_calls() -> None:
    texts = ['{"name": "get_weather", ', '"parameters": {"city": "Rome"}}']
    whole = Collector(kind="chat", request_id="r", model="m", tokenizer=None, logprobs=False,
                      tool_parser="llama3_json")
    whole.add(_msg(texts[0]))
    whole.add(_msg(texts[1], final="stop"))
    choice = whole.choice()
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert args(choice["message"]["tool_calls"][0]) == {"city": "Rome"}
    streamed = Collector(kind="chat", request_id="r", model="m", tokenizer=None, logprobs=False,
                         tool_parser="llama3_json")
    chunks = streamed.chunk(_msg(texts[0])) + streamed.chunk(_msg(texts[1], final="stop"))
    deltas = [c["choices"][0] for c in chunks]
    assert not any(d["delta"].get("content") for d in deltas)  # nothing of the call went out as text
    [call_delta] = [d["delta"]["tool_calls"] for d in deltas if "tool_calls" in d["delta"]]
    assert call_delta[0]["index"] == 0 and args(call_delta[0]) == {"city": "Rome"}
    assert deltas[-1]["finish_reason"] == "tool_calls"


def _chat(body: dict, template: str | None = LLAMA3_CHAT_TEMPLATE, pipeline=None, **kw):
    from engine.tokenizer import Tokenizer

    tpl = ChatTemplate(template, special_tokens={"bos_token": "<|begin_of_text|>"}) if template else None
    return serve_and_call(pipeline or ChoicePipeline(), "/v1/chat/completions",
                          {"model": "m", "max_tokens": 2, **body}, template=tpl, max_model_len=1024,
                          tokenizer=kw.get("tokenizer") or Tokenizer.from_dir(kw["model_dir"]))


def test_call_markers_that_are_special_tokens_keep_special_tokens_in_the_text(tiny_llama_dir) -> None:
    """The text leaves special tokens out by default; where a parser's marker is one (Llama 3.1's
    ``<|python_tag|>`` is), a chat with tools keeps them, unless the request says otherwise."""
    from engine.tokenizer import Tokenizer

    plain = Tokenizer.from_dir(tiny_llama_dir)
    assert not marks_are_special("llama3_json", plain) and not marks_are_special("hermes", plain)
    added = Tokenizer.from_dir(tiny_llama_dir)
    added.backend.add_tokens(["<tool_call>", "</tool_call>"])  # ordinary added tokens (Qwen2.5's)
    assert not marks_are_special("hermes", added)
    special = Tokenizer.from_dir(tiny_llama_dir)
    special.backend.add_special_tokens(["<|python_tag|>", "<tool_call>"])
    assert marks_are_special("llama3_json", special) and marks_are_special("hermes", special)
    msgs = {"messages": [{"role": "user", "content": "hi"}]}
    for body, tok, want in (({**msgs, "tools": [WEATHER]}, special, False),
                            ({**msgs, "tools": [WEATHER], "skip_special_tokens": True}, special, True),
                            ({**msgs, "tools": [WEATHER]}, plain, True),
                            (msgs, special, True),
                            ({**msgs, "skip_special_tokens": False}, plain, False)):
        pipeline = ChoicePipeline()
        status, _, raw = _chat(body, pipeline=pipeline, tokenizer=tok)
        assert status == 200, raw
        assert [a.skip_special_tokens for a in pipeline.admitted] == [want], body


@pytest.mark.parametrize("body, template, contains", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, LLAMA3_CHAT_TEMPLATE,
     "not among the tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, LLAMA3_CHAT_TEMPLATE,
     "constrains the answer already"),
    ({}, "{% for m in messages %}{{ m['content'] }}{% endfor %}", "does not render tools"),
    ({}, "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ tools | length }}", "no tool-call parser"),
])
def test_what_cannot_be_honoured_is_refused(tiny_llama_dir, body, template, contains) -> None:
    status, _, raw = _chat({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], **body},
                           template, model_dir=tiny_llama_dir)
    err = json.loads(raw)["error"]
    assert status == 400 and contains in err["message"], err


def test_tool_choice_without_tools_and_bad_history_are_refused(tiny_llama_dir) -> None:
    status, _, raw = _chat({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"},
                           model_dir=tiny_llama_dir)
    assert status == 400 and "tool_choice needs tools" in raw.decode()
    bad = [{"role": "user", "content": "hi"},
           {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                 "function": {"name": "f", "arguments": "{oops"}}]}]
    status, _, raw = _chat({"messages": bad}, model_dir=tiny_llama_dir)
    assert status == 400 and "are not JSON" in raw.decode()


def test_the_template_gets_the_tools_the_calls_and_the_answers() -> None:
    t = ChatTemplate(LLAMA3_CHAT_TEMPLATE, special_tokens={"bos_token": "<|begin_of_text|>"})
    assert detect(t.source) == "llama3_json"
    from router.http.frontend import _chat_messages
    from router.http.schemas import ChatCompletionRequest

    body = ChatCompletionRequest(model="m", tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    text = t.render(_chat_messages(body), tools=[x.model_dump(exclude_none=True) for x in body.tools])
    assert '"name": "get_weather"' in text and "Weather of a city" in text
    assert '{"name": "get_weather", "parameters": {"city": "Rome"}}' in text
    assert "ipython<|end_header_id|>\n\nsunny" in text
