"""Top alternatives per generated token, in translation (no processes): the engine's entry to the wire
message and back, a stream continued on another worker (router/migration.py) keeping one entry per
token through the shared ``generate_messages``, and the OpenAI shapes the HTTP door builds from them."""

from __future__ import annotations

import asyncio

import grpc

from engine.model_runner import TokenLogprob
from pdserve.sampling import SamplingParams
from pdserve.wire import top_logprobs, top_pairs
from router.admission import Admitted
from router.http.responses import Collector
from router.migration import Migration, MigrationConfig
from router.pipeline import _EVENTS, Done, FirstToken, RequestFailed, ServingMeta, Tokens
from router.service import generate_messages


def _top(*pairs) -> object:
    return top_logprobs(pairs)


def test_engine_entry_to_wire_and_back() -> None:
    entry = TokenLogprob(token_id=7, logprob=-0.5, top=((7, -0.5), (3, -1.25)))
    msg = top_logprobs(entry)
    assert top_pairs(msg) == [(7, -0.5), (3, -1.25)]
    assert top_logprobs(TokenLogprob(token_id=7, logprob=-0.5)) is None  # logprobs=0: none asked
    assert top_logprobs(()) is None and top_logprobs(None) is None


def test_continued_stream_keeps_one_entry_per_token() -> None:
    failed = RequestFailed(grpc.StatusCode.UNAVAILABLE, "decode on decode-1 failed")
    failed.extra_worker = "decode-1"  # type: ignore[attr-defined]
    attempts = [
        [FirstToken(10, -0.1, _top((10, -0.1), (4, -2.0))),
         Tokens([11, 12], [-0.2, -0.3], [_top((11, -0.2), (5, -2.1)), _top((12, -0.3), (6, -2.2))]), failed],
        # the continuation's token 1 (from its prefill worker) is the stream's token 4
        [FirstToken(13, -0.4, _top((13, -0.4), (8, -2.3))), Done("length", 1, ServingMeta())],
    ]

    async def attempt(req, timeout):
        for ev in attempts.pop(0):
            if isinstance(ev, BaseException):
                raise ev
            yield ev

    class Pipeline:
        async def run(self, req, timeout):
            m = Migration(MigrationConfig(backoff_s=0.01, max_backoff_s=0.02, wait_s=0.1))
            async for ev in m.run(req, timeout, attempt, _EVENTS):
                yield ev

    req = Admitted(request_id="r1", prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=4, logprobs=2),
                   session_id=None, reusable_prefix_len=None, want_text=False)

    async def go():
        return [m async for m in generate_messages(Pipeline(), req, None, 30.0)]
    msgs = asyncio.run(go())
    for m in msgs:
        assert len(m.top_logprobs) == len(m.token_ids) == len(m.logprobs)
    ids = [t for m in msgs for t in m.token_ids]
    tops = [top_pairs(t) for m in msgs for t in m.top_logprobs]
    assert ids == [10, 11, 12, 13]
    assert [p[0][0] for p in tops] == ids and [p[1][0] for p in tops] == [4, 5, 6, 8]


class Tok:
    """Token 9 decodes like token 4: completions' dicts keep the likelier one's value."""

    def decode(self, ids, skip_special_tokens=False) -> str:
        return "".join("t4" if t == 9 else f"t{t}" for t in ids)


def _message(ids, lps, tops):
    from pdserve.v1 import router_pb2
    return router_pb2.GenerateResponse(request_id="r1", token_ids=ids, logprobs=lps, text="".join(
        f"t{t}" for t in ids), top_logprobs=[_top(*p) for p in tops])


def test_openai_shapes() -> None:
    msg = _message([1, 2], [-0.25, -3.0],
                   [[(1, -0.25), (4, -1.0), (9, -1.5)], [(5, -0.5), (4, -1.0), (9, -2.0)]])
    comp = Collector(kind="completion", request_id="r1", model="m", tokenizer=Tok(), logprobs=True)
    [chunk] = comp.chunk(msg)
    lp = chunk["choices"][0]["logprobs"]
    assert lp["tokens"] == ["t1", "t2"] and lp["token_logprobs"] == [-0.25, -3.0]
    assert lp["text_offset"] == [0, 2]
    # the sampled token is always there (OpenAI: up to logprobs + 1 entries)
    assert lp["top_logprobs"] == [{"t1": -0.25, "t4": -1.0}, {"t5": -0.5, "t4": -1.0, "t2": -3.0}]
    chat = Collector(kind="chat", request_id="r1", model="m", tokenizer=Tok(), logprobs=True)
    chat.add(msg)
    content = chat.response()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["t1", "t2"]
    assert content[1]["top_logprobs"] == [{"token": "t5", "logprob": -0.5, "bytes": list(b"t5")},
                                          {"token": "t4", "logprob": -1.0, "bytes": list(b"t4")},
                                          {"token": "t4", "logprob": -2.0, "bytes": list(b"t4")}]
    plain = Collector(kind="completion", request_id="r1", model="m", tokenizer=Tok(), logprobs=True)
    plain.add(_message([1], [-0.25], []))  # logprobs=0: no alternatives asked
    assert plain.response()["choices"][0]["logprobs"]["top_logprobs"] is None
