"""Structured output over the shared 1P1D cluster (KV over TCP) with the real ``openai`` client.

For a suite of JSON schemas (nested objects, arrays, enums, required fields, bounded numbers, strings
with patterns), every answer parses and validates (``jsonschema``), greedy and sampled, streamed and
not, with ``n`` > 1; regex and choice constraints hold; ``tool_choice: "required"`` and a named function
always yield valid calls; a hostile schema is refused or bounded while other requests keep flowing (their
latency is printed). The random-weight model says nothing sensible, which makes this a test of the
constraint alone: whatever the logits, the answer must hold.
"""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest
from openai_cluster import MODEL, openai_client

pytestmark = [pytest.mark.timeout(600)]

SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
               "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 10},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120},
                              "pets": {"type": "array", "maxItems": 3,
                                       "items": {"enum": ["cat", "dog", "fish"]}}}},
    "nested": {"type": "object", "additionalProperties": False, "required": ["point", "label"],
               "properties": {"point": {"type": "object", "additionalProperties": False,
                                        "required": ["x", "y"],
                                        "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10},
                                                       "y": {"type": "integer", "minimum": 0,
                                                             "maximum": 99}}},
                              "label": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}},
    "list": {"type": "array", "minItems": 1, "maxItems": 4,
             "items": {"type": "object", "required": ["id", "ok"], "additionalProperties": False,
                       "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9},
                                      "ok": {"type": "boolean"}}}},
    "choice_of_shapes": {"anyOf": [{"type": "object", "required": ["kind"], "additionalProperties": False,
                                    "properties": {"kind": {"const": "empty"}}},
                                   {"type": "integer", "minimum": 0, "maximum": 5}]},
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "properties": {"city": {"enum": ["Rome", "Oslo"]},
                                                                          "days": {"type": "integer",
                                                                                   "minimum": 1,
                                                                                   "maximum": 7}},
                                                           "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                          "parameters": {"type": "object", "additionalProperties": False,
                                                         "properties": {}}}}
MAX_TOKENS = 120


def _texts(client, *, stream: bool, **kw) -> list[str]:
    """Each choice's whole text (streamed: the deltas joined by choice index)."""
    if not stream:
        r = client.chat.completions.create(model=MODEL, max_tokens=MAX_TOKENS, **kw)
        assert all(c.finish_reason == "stop" for c in r.choices), [c.finish_reason for c in r.choices]
        return [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
    parts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=MODEL, max_tokens=MAX_TOKENS, stream=True, **kw):
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert set(reasons.values()) == {"stop"}, reasons
    return [parts[i] for i in sorted(parts)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_every_answer_validates_against_its_schema(http_cluster, temperature, stream):
    client = openai_client(http_cluster)
    for name, schema in SCHEMAS.items():
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        msgs = [{"role": "user", "content": f"Give me a {name} as JSON."}]
        texts = _texts(client, stream=stream, n=2, temperature=temperature, seed=3, messages=msgs,
                       response_format=fmt)
        assert len(texts) == 2
        for text in texts:
            jsonschema.validate(json.loads(text), schema)
        if temperature == 0.0:
            assert texts[0] == texts[1]  # greedy choices are equal


def test_json_object_regex_choice_and_grammar_hold(http_cluster):
    client = openai_client(http_cluster)
    msgs = [{"role": "user", "content": "Answer."}]
    # any JSON object: a random model may write a string until max_tokens; a finished answer is an object
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=400, n=4, temperature=0.7,
                                       seed=1, response_format={"type": "json_object"})
    finished = [c.message.content for c in r.choices if c.finish_reason == "stop"]
    assert all(isinstance(json.loads(t), dict) for t in finished)
    assert all(c.message.content.startswith("{") for c in r.choices)
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    cases = (({"guided_regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
             ({"guided_choice": ["yes", "no", "not sure"]}, lambda t: t in ("yes", "no", "not sure")),
             ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
             ({"guided_grammar": 'start: NUM ("+" NUM)*\nNUM: /[1-9][0-9]?/'},
              lambda t: re.fullmatch(r"[1-9][0-9]?(\+[1-9][0-9]?)*", t)))
    for body, check in cases:
        for stream in (False, True):
            texts = _texts(client, stream=stream, n=3, temperature=1.0, seed=5, messages=msgs,
                           extra_body=body)
            assert all(check(t) for t in texts), (body, texts)
    r = client.completions.create(model=MODEL, prompt="A phone number:", max_tokens=20,
                                  extra_body={"guided_regex": r"\+[0-9]{2} [0-9]{4}"})
    assert re.fullmatch(r"\+[0-9]{2} [0-9]{4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"


def test_a_cut_answer_says_length(http_cluster):
    client = openai_client(http_cluster)
    r = client.chat.completions.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "p", "schema": SCHEMAS["person"]}})
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_required_and_named_always_call(http_cluster, stream):
    client = openai_client(http_cluster)
    msgs = [{"role": "user", "content": "What is the weather in Oslo, and the time?"}]
    for choice, names in (("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"})):
        for seed in range(3):
            kw = dict(model=MODEL, messages=msgs, tools=[WEATHER, CLOCK], tool_choice=choice,
                      max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
            if stream:
                calls: dict[int, dict] = {}
                reason = None
                for chunk in client.chat.completions.create(stream=True, **kw):
                    for c in chunk.choices:
                        for d in c.delta.tool_calls or ():
                            entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                            entry["name"] += d.function.name or ""
                            entry["arguments"] += d.function.arguments or ""
                        reason = c.finish_reason or reason
                got = list(calls.values())
            else:
                r = client.chat.completions.create(**kw)
                reason = r.choices[0].finish_reason
                got = [{"name": t.function.name, "arguments": t.function.arguments}
                       for t in r.choices[0].message.tool_calls or ()]
            assert reason == "tool_calls" and got, (choice, reason, got)
            for call in got:
                assert call["name"] in names
                tool = WEATHER if call["name"] == "get_weather" else CLOCK
                jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])


def test_bad_and_hostile_schemas_are_refused_or_bounded_without_stalling_others(http_cluster):
    client = openai_client(http_cluster)
    from openai import BadRequestError

    with pytest.raises(BadRequestError, match="cannot be compiled"):
        client.chat.completions.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "bad", "schema": {"type": "object",
                                                                     "properties": {"a": {"$ref": "#/no"}}}}})
    with pytest.raises(BadRequestError, match="characters; at most"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=5,
                                  extra_body={"guided_choice": [f"option-{i:06d}" for i in range(30000)]})
    # the latency of plain requests alone, then while hostile constraints (a 9,000-string enum, 50 levels
    # of nesting, each a fresh schema) are compiled and served beside them
    def plain_latencies(n: int) -> list[float]:
        out = []
        for i in range(n):
            t0 = time.perf_counter()
            client.completions.create(model=MODEL, prompt=f"plain {i}", max_tokens=8,
                                      extra_body={"ignore_eos": True})
            out.append(time.perf_counter() - t0)
        return out

    alone = plain_latencies(6)
    hostile_done: list = []

    def hostile(k: int) -> None:
        enum = {"enum": [f"v{k}-{i:05d}" for i in range(9000)]}
        deep: dict = {"type": "integer", "minimum": 0, "maximum": 9}
        for _ in range(50):
            deep = {"type": "object", "properties": {f"k{k}": deep}, "required": [f"k{k}"],
                    "additionalProperties": False}
        for schema in (enum, deep):
            t0 = time.perf_counter()
            try:
                r = client.completions.create(model=MODEL, prompt="x", max_tokens=400,
                                              extra_body={"guided_json": schema})
                text, reason = r.choices[0].text, r.choices[0].finish_reason
                if reason == "stop":
                    jsonschema.validate(json.loads(text), schema)
                hostile_done.append(("served", reason, time.perf_counter() - t0))
            except BadRequestError as exc:
                hostile_done.append(("refused", str(exc)[:80], time.perf_counter() - t0))

    threads = [threading.Thread(target=hostile, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    during = plain_latencies(6)
    for t in threads:
        t.join(300)
    assert len(hostile_done) == 4
    print(f"\nplain request latency alone p50 {sorted(alone)[3] * 1e3:.0f} ms max {max(alone) * 1e3:.0f} ms; "
          f"during hostile schemas p50 {sorted(during)[3] * 1e3:.0f} ms max {max(during) * 1e3:.0f} ms; "
          f"hostile: {[(h[0], h[1], round(h[2], 2)) for h in hostile_done]}")
