"""The router's OpenAI-compatible door, driven by the real `openai` client against a live 1P1D cluster.

Greedy output is token-identical to the gRPC API and to `pdserve generate` for the same prompt
(completions with a text prompt; chat against the gRPC API fed the chat template's rendering);
streamed and whole answers agree; stop strings, seeds, logprobs and usage (cached tokens included)
match what gRPC reports; a session rides the ``x-session-affinity`` header; the path report arrives
in the ``pdserve`` field and headers. The shared cluster (openai_cluster.py) ends with a leak check.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from openai_cluster import KEY, MODEL, openai_client, raw

from pdserve.client import Client, build_request
from router.chat_template import ChatTemplate

pytestmark = pytest.mark.slow
PROMPT = "The quick brown fox jumps over the lazy dog and"
AUTH = [("authorization", f"Bearer {KEY}")]


def grpc_generate(cluster, **kw):
    """(Result, logprobs) from the gRPC door."""
    logprobs = kw.pop("logprobs", None)
    req = build_request(**kw)
    lps: list[float] = []
    with Client(cluster.router, timeout=120) as c:
        if logprobs is None:
            return c.generate(req, metadata=AUTH), lps
        req.sampling.logprobs = logprobs
        for m in c.stream(req, metadata=AUTH):
            lps.extend(m.logprobs)
    return None, lps


def test_completion_greedy_matches_grpc_and_pdserve_generate(http_cluster) -> None:
    client = openai_client(http_cluster)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = r.choices[0]
    ids = choice.model_extra["token_ids"]
    grpc_res, _ = grpc_generate(http_cluster, prompt=PROMPT, max_tokens=12, ignore_eos=True)
    assert ids == grpc_res.token_ids and choice.text == grpc_res.text
    out = subprocess.run([sys.executable, "-m", "pdserve.app.cli", "generate", "--model",
                          str(http_cluster.model), "--prompt", PROMPT, "--max-tokens", "12", "--ignore-eos",
                          "--json", "--device", "cpu"], capture_output=True, text=True, timeout=300,
                         check=True)
    local = json.loads(out.stdout)
    assert ids == local["token_ids"] and choice.text == local["text"]
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == grpc_res.final["usage"]["prompt_tokens"]
    report = r.model_extra["pdserve"]
    assert report["transport"] == "tcp" and report["decode_worker"].startswith("decode")
    assert report["prefill_compute_ms"] > 0


def test_chat_greedy_matches_grpc_on_the_rendered_prompt(http_cluster) -> None:
    from engine.tokenizer import Tokenizer

    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fox."}]
    client = openai_client(http_cluster)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    prompt = ChatTemplate.from_model_dir(http_cluster.model).render(messages, add_generation_prompt=True)
    prompt_ids = Tokenizer.from_dir(http_cluster.model).encode(prompt, add_special_tokens=False)
    grpc_res, _ = grpc_generate(http_cluster, prompt_ids=prompt_ids, max_tokens=10, ignore_eos=True)
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == grpc_res.token_ids
    assert choice.message.role == "assistant" and choice.message.content == grpc_res.text
    assert r.usage.prompt_tokens == len(prompt_ids)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_stream_equals_whole_answer_with_usage(http_cluster, kind) -> None:
    client = openai_client(http_cluster)
    kw = dict(model=MODEL, max_tokens=9, extra_body={"ignore_eos": True})
    prompt = f"{kind}: {PROMPT} {PROMPT} {PROMPT}"  # two full KV blocks at least
    if kind == "chat":
        call, kw["messages"] = client.chat.completions.create, [{"role": "user", "content": prompt}]
    else:
        call, kw["prompt"] = client.completions.create, prompt
    whole = call(**kw)
    chunks = list(call(stream=True, stream_options={"include_usage": True}, **kw))
    usage = [c for c in chunks if not c.choices]
    assert len(usage) == 1 and chunks[-1] is usage[0]
    assert usage[0].usage.completion_tokens == whole.usage.completion_tokens == 9
    body = [c for c in chunks if c.choices]
    if kind == "chat":
        assert body[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in body)
        assert text == whole.choices[0].message.content
    else:
        text = "".join(c.choices[0].text for c in body)
        assert text == whole.choices[0].text
    assert body[-1].choices[0].finish_reason == "length"
    assert body[-1].model_extra["pdserve"]["decode_worker"]
    # the second time the same prompt is served, its full blocks come from a prefix cache
    assert usage[0].usage.prompt_tokens_details.cached_tokens >= 16


def test_stop_string_matches_grpc(http_cluster) -> None:
    client = openai_client(http_cluster)
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, stop=[stop],
                                  extra_body={"ignore_eos": True})
    grpc_res, _ = grpc_generate(http_cluster, prompt=PROMPT, max_tokens=16, stop=[stop], ignore_eos=True)
    assert r.choices[0].text == grpc_res.text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop" == grpc_res.finish_reason


def test_seed_reproducible_and_equal_to_grpc(http_cluster) -> None:
    client = openai_client(http_cluster)
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, top_p=0.9, seed=1234,
              extra_body={"return_token_ids": True, "ignore_eos": True, "top_k": 50})
    a = client.completions.create(**kw).choices[0].model_extra["token_ids"]
    b = client.completions.create(**kw).choices[0].model_extra["token_ids"]
    grpc_res, _ = grpc_generate(http_cluster, prompt=PROMPT, max_tokens=10, temperature=1.0, top_p=0.9,
                                top_k=50, seed=1234, ignore_eos=True)
    assert a == b == grpc_res.token_ids


def test_logprobs_match_grpc(http_cluster) -> None:
    client = openai_client(http_cluster)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=0,
                                  extra_body={"ignore_eos": True})
    _, grpc_lps = grpc_generate(http_cluster, prompt=PROMPT, max_tokens=6, ignore_eos=True, logprobs=0)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(grpc_lps, abs=1e-6) and len(lp.tokens) == 6
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, logprobs=True, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(c.logprob <= 0 for c in content)


def test_top_logprobs_match_grpc(http_cluster) -> None:
    """The alternatives travel prefill (token 1) -> decode (the rest, several per message) -> router:
    OpenAI's shapes over HTTP carry exactly what the gRPC API returns for the same greedy request."""
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(http_cluster.model)
    text = lambda t: tok.decode([t], skip_special_tokens=False)  # noqa: E731
    client = openai_client(http_cluster)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=5, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    with Client(http_cluster.router, timeout=120) as c:
        g = c.generate(build_request(prompt=PROMPT, max_tokens=6, ignore_eos=True, temperature=0, logprobs=5),
                       metadata=AUTH)
    lp = r.choices[0].logprobs
    assert r.choices[0].model_extra["token_ids"] == g.token_ids and len(g.top_logprobs) == 6
    for i, (tid, pairs) in enumerate(zip(g.token_ids, g.top_logprobs, strict=True)):
        assert len(pairs) == 5 and pairs[0][0] == tid  # greedy: the sampled token is the likeliest
        assert pairs[0][1] == pytest.approx(g.logprobs[i], abs=1e-6)
        expected: dict[str, float] = {}
        for t, a in pairs:
            expected.setdefault(text(t), a)
        assert lp.top_logprobs[i] == pytest.approx(expected, abs=1e-6)
        assert lp.tokens[i] in lp.top_logprobs[i]
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=5, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    streamed = [d for ch in stream if ch.choices and ch.choices[0].logprobs
                for d in ch.choices[0].logprobs.top_logprobs]
    assert streamed == lp.top_logprobs

    messages = [{"role": "user", "content": "Name a fox."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, logprobs=True,
                                          top_logprobs=3, extra_body={"ignore_eos": True})
    prompt_ids = tok.encode(ChatTemplate.from_model_dir(http_cluster.model).render(
        messages, add_generation_prompt=True), add_special_tokens=False)
    with Client(http_cluster.router, timeout=120) as c:
        g = c.generate(build_request(prompt_ids=prompt_ids, max_tokens=4, ignore_eos=True, logprobs=3),
                       metadata=AUTH)
    content = chat.choices[0].logprobs.content
    assert len(content) == len(g.top_logprobs) == 4
    for entry, tid, pairs in zip(content, g.token_ids, g.top_logprobs, strict=True):
        assert entry.token == text(tid) == entry.top_logprobs[0].token
        assert [(a.token, a.logprob) for a in entry.top_logprobs] == [
            (text(t), pytest.approx(v, abs=1e-6)) for t, v in pairs]
        assert entry.top_logprobs[0].bytes == list(entry.token.encode())


def test_session_affinity_header_and_prefix_hint(http_cluster) -> None:
    client = openai_client(http_cluster)
    headers = {"x-session-affinity": "http-session-1", "x-reusable-prefix-len": "8"}
    messages = [{"role": "user", "content": "Tell me about foxes."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                           extra_headers=headers)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And dogs?"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                            extra_headers=headers)
    a, b = first.model_extra["pdserve"], second.model_extra["pdserve"]
    assert b["session_hit"] and b["decode_worker"] == a["decode_worker"]
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # the first turn's KV stayed on decode


def test_models_health_and_report_headers(http_cluster) -> None:
    client = openai_client(http_cluster)
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    status, _, body = raw(http_cluster, "GET", "/v1/models/gpt-4")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, _, body = raw(http_cluster, "GET", "/health", key=None)
    assert status == 200 and body["status"] == "ok"
    status, headers, body = raw(http_cluster, "POST", "/v1/completions",
                                {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 3})
    assert status == 200 and len(body["choices"][0]["text"]) > 0
    lower = {k.lower(): v for k, v in headers.items()}
    assert lower["x-pdserve-decode-worker"] == body["pdserve"]["decode_worker"]
    assert lower["x-pdserve-transport"] == "tcp" and lower["x-request-id"] in body["id"]
    assert int(lower["x-pdserve-kv-bytes-sent"]) == body["pdserve"]["kv_bytes_sent"]


def test_load_generator_over_http_matches_grpc(http_cluster) -> None:
    """`pdserve bench --backend openai`'s client: the same workload over both doors, every request served
    with the asked length, the path report and token timings filled in alike."""
    import asyncio

    from pdserve.app.loadgen.dist import parse_dist
    from pdserve.app.loadgen.runner import RunConfig, run

    def config(router: str, backend: str) -> RunConfig:
        return RunConfig(router=router, rate=float("inf"), num_requests=4, input_len=parse_dist("24"),
                         output_len=parse_dist("5"), sessions=2, turns=2, seed=3, backend=backend,
                         api_key=KEY)

    http_samples, _ = asyncio.run(run(config(http_cluster.http, "openai")))
    assert len(http_samples) == 4 and all(s.ok for s in http_samples), [s.error for s in http_samples]
    for s in http_samples:
        assert s.output_tokens == 5 and len(s.itl_s) == 4 and s.ttft_s > 0
        assert s.final["decode_worker"] and s.final["usage"]["completion_tokens"] == 5
    assert any(s.final["session_hit"] for s in http_samples if s.turn == 1)
    bad, _ = asyncio.run(run(RunConfig(router=http_cluster.http, rate=float("inf"), num_requests=1,
                                       input_len=parse_dist("4"), output_len=parse_dist("2"),
                                       backend="openai", api_key="sk-wrong")))
    assert not bad[0].ok and bad[0].error == "UNAUTHENTICATED"


def test_penalties_and_logit_bias_match_grpc(http_cluster) -> None:
    """OpenAI's presence / frequency penalties and logit_bias (string keys, as its JSON has them), and
    vLLM's repetition_penalty, reach the engine: the same tokens as the gRPC door's fields."""
    client = openai_client(http_cluster)
    kw = dict(presence_penalty=0.8, frequency_penalty=1.1, logit_bias={"9": 3.0, "10": -100})
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, **kw,
                                  extra_body={"return_token_ids": True, "ignore_eos": True,
                                              "repetition_penalty": 1.3})
    grpc_res, _ = grpc_generate(http_cluster, prompt=PROMPT, max_tokens=12, ignore_eos=True,
                                presence_penalty=0.8, frequency_penalty=1.1, repetition_penalty=1.3,
                                logit_bias={9: 3.0, 10: -100.0})
    plain, _ = grpc_generate(http_cluster, prompt=PROMPT, max_tokens=12, ignore_eos=True)
    ids = r.choices[0].model_extra["token_ids"]
    assert ids == grpc_res.token_ids != plain.token_ids and 10 not in ids


def test_chat_with_tools_renders_them_and_answers(http_cluster) -> None:
    """Tools reach the prompt through the model's template (its Llama 3.1 tool syntax), the answer is
    the gRPC door's greedy answer to that rendering; a random model calls no tool, so it is content
    (the call parsing itself: tests/unit/test_tool_calls.py)."""
    from engine.tokenizer import Tokenizer

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    client = openai_client(http_cluster)
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=8,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    prompt = ChatTemplate.from_model_dir(http_cluster.model).render(messages, tools=tools)
    assert "get_weather" in prompt
    ids = Tokenizer.from_dir(http_cluster.model).encode(prompt, add_special_tokens=False)
    want, _ = grpc_generate(http_cluster, prompt_ids=ids, max_tokens=8, ignore_eos=True)
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == want.token_ids
    assert choice.message.content == want.text and choice.finish_reason == "length"
    assert not choice.message.tool_calls


def test_tokenize_and_detokenize(http_cluster) -> None:
    """vLLM's /tokenize and /detokenize: a prompt's ids are what the door generates from (its usage),
    a chat's are the template's rendering; bad ids and a wrong model are refused."""
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(http_cluster.model)
    status, _, body = raw(http_cluster, "POST", "/tokenize", {"model": MODEL, "prompt": PROMPT})
    assert status == 200 and body["tokens"] == tok.encode(PROMPT) and body["count"] == len(body["tokens"])
    r = openai_client(http_cluster).completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    assert r.usage.prompt_tokens == body["count"]
    messages = [{"role": "user", "content": "Name a fox."}]
    status, _, chat = raw(http_cluster, "POST", "/tokenize", {"model": MODEL, "messages": messages})
    rendered = ChatTemplate.from_model_dir(http_cluster.model).render(messages)
    assert status == 200 and chat["tokens"] == tok.encode(rendered, add_special_tokens=False)
    status, _, back = raw(http_cluster, "POST", "/detokenize", {"model": MODEL, "tokens": chat["tokens"]})
    assert status == 200 and back["prompt"] == rendered
    assert raw(http_cluster, "POST", "/detokenize", {"model": MODEL, "tokens": [99999]})[0] == 400
    assert raw(http_cluster, "POST", "/tokenize", {"model": "x", "prompt": "a"})[0] == 404
    assert raw(http_cluster, "POST", "/tokenize", {"model": MODEL})[0] == 400
