"""router/migration.py against scripted attempts (no processes): what it re-runs, what it gives up on.

A scripted attempt yields the events of router/pipeline.py and raises RequestFailed where told;
the checks: one unbroken stream (a continuation's first token arrives as the next tokens, the final
count covers every attempt), the continuation's prompt / max_tokens / seed_draws / request id, no
retry for capacity or bad input, the retry limit and the wait limit with their message.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.sampling import SamplingParams
from router.admission import Admitted
from router.migration import Migration, MigrationConfig
from router.pipeline import _EVENTS, Done, FirstToken, RequestFailed, ServingMeta, Tokens


def _req(**params) -> Admitted:
    return Admitted(request_id="r1", prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=6, **params),
                    session_id=None, reusable_prefix_len=None, want_text=False)


def _failed(code=grpc.StatusCode.UNAVAILABLE, worker="decode-1") -> RequestFailed:
    exc = RequestFailed(code, f"decode on {worker} failed")
    exc.extra_worker = worker if worker else ""  # type: ignore[attr-defined]
    return exc


class Script:
    """Attempt n runs script[n]: a list of events, ending in an exception to raise or not."""

    def __init__(self, *steps) -> None:
        self.steps, self.seen = list(steps), []

    async def __call__(self, req: Admitted, timeout):
        self.seen.append(req)
        for ev in self.steps.pop(0):
            if isinstance(ev, BaseException):
                raise ev
            yield ev


def _run(script: Script, req: Admitted, config: MigrationConfig | None = None) -> list:
    async def go():
        m = Migration(config or MigrationConfig(backoff_s=0.01, max_backoff_s=0.02, wait_s=0.1))
        return [ev async for ev in m.run(req, 30.0, script, _EVENTS)]
    return asyncio.run(go())


def test_mid_stream_failure_continues_as_one_stream() -> None:
    req = _req(temperature=0.7, seed=5)
    script = Script([FirstToken(10, None), Tokens([11, 12], []), _failed()],
                    [FirstToken(13, None), Tokens([14, 15], []), Done("length", 3, ServingMeta())])
    events = _run(script, req)
    ids = [e.token_id for e in events if isinstance(e, FirstToken)] + \
        [t for e in events if isinstance(e, Tokens) for t in e.token_ids]
    assert ids == [10, 11, 12, 13, 14, 15]
    assert sum(isinstance(e, FirstToken) for e in events) == 1
    assert events[-1].completion_tokens == 6
    cont = script.seen[1]
    assert cont.prompt_ids == [1, 2, 3, 10, 11, 12] and cont.params.max_tokens == 3
    assert cont.params.seed_draws == 3 and cont.params.seed == 5 and cont.request_id != "r1"
    assert cont.params.stop_context == 3  # stop strings are looked for across the tokens sent before


@pytest.mark.parametrize("params,stops", [({}, True), ({"ignore_eos": True}, False),
                                          ({"ignore_eos": True, "stop_token_ids": (2,)}, True)])
def test_a_request_whose_last_sent_token_ends_it_is_not_continued(params, stops) -> None:
    """An EOS (or stop token) first token from the prefill reached the client, then the decode worker
    died before its final message: the request is over, not continued past its end."""
    import dataclasses

    req = dataclasses.replace(_req(**params), eos_token_ids=(2,))
    script = Script([FirstToken(2, None), _failed()],
                    [Tokens([9], []), Done("length", 5, ServingMeta())])
    events = _run(script, req)
    assert isinstance(events[-1], Done)
    if stops:
        assert len(script.seen) == 1 and events[-1].finish_reason == "stop"
        assert events[-1].completion_tokens == 1
    else:
        assert len(script.seen) == 2 and events[-1].finish_reason == "length"


def test_failure_before_the_first_token_reruns_the_same_request() -> None:
    script = Script([_failed()], [FirstToken(7, None), Done("stop", 1, ServingMeta())])
    _run(script, _req())
    assert script.seen[1].prompt_ids == [1, 2, 3] and script.seen[1].params.max_tokens == 6


@pytest.mark.parametrize("code", [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT,
                                  grpc.StatusCode.DEADLINE_EXCEEDED])
def test_capacity_bad_input_and_deadlines_reach_the_client(code) -> None:
    with pytest.raises(RequestFailed) as info:
        _run(Script([_failed(code)]), _req())
    assert info.value.code == code


def test_retry_limit_and_wait_limit_say_what_was_tried() -> None:
    with pytest.raises(RequestFailed, match=r"2 tokens sent; gave up after 1 retries") as info:
        _run(Script([FirstToken(1, None), Tokens([2], []), _failed()], [_failed()]), _req(),
             MigrationConfig(max_retries=1, backoff_s=0.01, max_backoff_s=0.01))
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    no_worker = [_failed(worker="")]  # nobody was there to try: waits, bounded by wait_s
    with pytest.raises(RequestFailed, match="gave up after 0.1s of waiting"):
        _run(Script(*[no_worker] * 50), _req())


def test_everything_sent_only_the_end_lost() -> None:
    events = _run(Script([FirstToken(1, None), Tokens([2, 3, 4, 5, 6], []), _failed()]), _req())
    assert isinstance(events[-1], Done) and events[-1].completion_tokens == 6
