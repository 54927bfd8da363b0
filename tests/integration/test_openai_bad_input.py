"""Bad input over the HTTP door gets OpenAI-shaped errors with the right status and leaves nothing
behind; API keys guard both doors (rotation through the keys file); a client that goes away
mid-stream frees its blocks on both pools. The shared cluster (openai_cluster.py) ends with a leak
check of every worker.
"""

from __future__ import annotations

import http.client
import json
import time

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from openai_cluster import KEY, MODEL, openai_client, raw

from pdserve.client import Client

pytestmark = pytest.mark.slow
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def expect_error(cluster, path: str, body, status: int, *, contains: str = "", **kw) -> dict:
    got, _, payload = raw(cluster, "POST", path, body, **kw)
    assert got == status, payload
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"} and contains in err["message"], err
    return err


@pytest.mark.parametrize("path,body,status,contains", [
    (COMPLETIONS, '{"model": "tiny-chat", "prompt": ', 400, "not valid JSON"),
    (COMPLETIONS, {"model": "gpt-4", "prompt": "hi"}, 404, "does not exist"),
    (CHAT, {"model": MODEL, "messages": []}, 400, "at least one message"),
    (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role must be one of"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "only text parts"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user"}]}, 400, "content is missing"),
    (COMPLETIONS, {"model": MODEL, "prompt": [7] * 2040, "max_tokens": 100}, 400, "model's context"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "top_p": -1}, 400, "top_p"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "top_k": -3}, 400, "top_k"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n must be at least 1"),
    (COMPLETIONS, {"model": MODEL, "prompt": ["a", "b"], "n": 65}, 400, "at most 128 per request"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 129}, 400, "at most 128"),
    (COMPLETIONS, {"model": MODEL, "prompt": [[1], [5, 999999]]}, 400, "out of range"),
    (COMPLETIONS, {"model": MODEL, "prompt": [5, 999999]}, 400, "out of range"),
    (COMPLETIONS, {"model": MODEL, "prompt": ""}, 400, "empty"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "logprobs": 6}, 400, "logprobs must be between 0 and 5"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True,
            "top_logprobs": 21}, 400, "top_logprobs must be between 0 and 20"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs needs logprobs=true"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo with logprobs"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     400, "tools"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "seed": 2**70}, 400, "seed"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias keys"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "logit_bias": {"99999": 1}}, 400,
     "outside the vocabulary"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 500}}, 400,
     "logit_bias values"),
])
def test_bad_input_is_refused(http_cluster, path, body, status, contains) -> None:
    expect_error(http_cluster, path, body, status, contains=contains)


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_nan_and_infinity_are_refused(http_cluster, field) -> None:
    for literal in ("NaN", "Infinity", "-Infinity"):
        body = f'{{"model": "{MODEL}", "prompt": "hi", "{field}": {literal}}}'
        err = expect_error(http_cluster, COMPLETIONS, body, 400)
        assert field in err["message"]


def test_ten_megabyte_body_is_413(http_cluster) -> None:
    body = json.dumps({"model": MODEL, "prompt": "x" * (10 * 1024 * 1024)})
    err = expect_error(http_cluster, COMPLETIONS, body, 413, contains="too large")
    assert err["type"] == "invalid_request_error"


def test_the_openai_client_raises_the_matching_errors(http_cluster) -> None:
    client = openai_client(http_cluster)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 3000}])
    with pytest.raises(openai.AuthenticationError):
        openai_client(http_cluster, key="sk-wrong").completions.create(model=MODEL, prompt="hi")


def test_api_keys_guard_both_doors_and_rotate(http_cluster) -> None:
    expect_error(http_cluster, COMPLETIONS, {"model": MODEL, "prompt": "hi"}, 401, key=None,
                 contains="missing API key")
    expect_error(http_cluster, COMPLETIONS, {"model": MODEL, "prompt": "hi"}, 401, key="sk-wrong",
                 contains="invalid API key")
    assert raw(http_cluster, "GET", "/v1/models", key="sk-wrong")[0] == 401
    assert raw(http_cluster, "GET", "/health", key=None)[0] == 200  # health stays open
    with Client(http_cluster.router, timeout=30) as c:
        with pytest.raises(grpc.RpcError) as info:
            c.generate(prompt_ids=[5, 6, 7], max_tokens=2)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            c.generate(prompt_ids=[5, 6, 7], max_tokens=2, metadata=[("authorization", "Bearer sk-wrong")])
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert len(c.generate(prompt_ids=[5, 6, 7], max_tokens=2,
                              metadata=[("authorization", f"Bearer {KEY}")]).token_ids) == 2
    with grpc.insecure_channel(http_cluster.router) as ch:  # gRPC health needs no key
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING

    # rotation: the new key works once the file says so, the old one stops working, no restart
    new = "sk-rotated-42"
    http_cluster.keys_file.write_text(f"{KEY}\n{new}\n")
    try:
        assert _eventually(lambda: raw(http_cluster, "GET", "/v1/models", key=new)[0] == 200)
        http_cluster.keys_file.write_text(f"{new}\n")
        assert _eventually(lambda: raw(http_cluster, "GET", "/v1/models", key=KEY)[0] == 401)
        with Client(http_cluster.router, timeout=30) as c:
            assert c.generate(prompt_ids=[5, 6], max_tokens=1,
                              metadata=[("authorization", f"Bearer {new}")]).token_ids
    finally:
        http_cluster.keys_file.write_text(f"{KEY}\n")
        assert _eventually(lambda: raw(http_cluster, "GET", "/v1/models", key=KEY)[0] == 200)


def _eventually(check, timeout: float = 20.0) -> bool:
    """Poll ``check`` (the router looks at the keys file at most once a second)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


def test_client_disconnect_mid_stream_frees_blocks(http_cluster) -> None:
    start = http_cluster.free_blocks()
    host, port = http_cluster.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": MODEL, "prompt": "once upon a time " * 20, "max_tokens": 1500, "stream": True,
            "ignore_eos": True}
    conn.request("POST", COMPLETIONS, body=json.dumps(body),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    seen = 0
    while seen < 3:  # a few tokens arrive: the request holds blocks on the decode worker now
        line = resp.fp.readline()
        seen += line.startswith(b"data: ")
    assert http_cluster.free_blocks() != start
    resp.close()  # the client goes away mid-stream
    conn.close()
    stats = http_cluster.wait_idle(start)
    assert {w: s.free_blocks for w, s in stats.items()} == start
    assert all(s.num_running == 0 and s.num_leased == 0 for s in stats.values())
