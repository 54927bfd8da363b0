"""A request outlives a worker: continue it elsewhere when a worker dies under it, token-exact.

The router holds each request's prompt and every token it has sent to the client, so a failure of
the worker serving it need not reach the client:

    before the first token   (prefill or Allocate failed, the prefill worker died, no worker left)
        run the same request again; nothing was sent, so the client cannot tell
    after k tokens           (the decode worker died, or was cut at the end of its drain)
        run a *continuation*: prompt + the k tokens as its prompt, max_tokens - k to go, and for
        seeded sampling ``seed_draws + k`` so the engine skips the k draws already taken from the
        seed's stream (``engine/sampler.advance_generator``); its first token is token k+1

The client sees one unbroken stream: the continuation's first token arrives as the next tokens of
the same response, and the final message counts every token. Greedy and seeded output equal a run
without the fault (prefill of prompt + k tokens computes the same KV the decode steps did).
Unseeded random sampling continues with fresh randomness.

Only failures that say "this worker is gone" are continued: UNAVAILABLE (dead process, broken
channel, draining, no worker left) and CANCELLED from the worker's side (a drain that ran out of
time). Capacity (RESOURCE_EXHAUSTED), bad input and deadlines reach the client unchanged.

Limits: at most ``max_retries`` attempts that failed on a worker per request, and at most
``wait_s`` seconds (and the request's own deadline) spent waiting for a usable worker while none is
left (the launcher or the kubelet is restarting it), polling with capped backoff. When either is
spent, the client gets UNAVAILABLE saying what was tried. Each continuation runs under its own
request id (``<id>~r<n>``), so nothing of the failed attempt on any worker can collide with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry, Counter

from router.admission import Admitted

log = logging.getLogger(__name__)
MIGRATABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


@dataclass(frozen=True, kw_only=True)
class EventKinds:
    """The pipeline's event and error types (router/pipeline.py), handed in: this module stays below it."""
    first: type     # FirstToken(token_id, logprob, top)
    tokens: type    # Tokens(token_ids, logprobs, top): top is one alternatives entry per token, or none
    done: type      # Done(finish_reason, completion_tokens, meta)
    failed: type    # RequestFailed(code, message), .extra_worker: the worker it failed on
    meta: type      # ServingMeta()


@dataclass(frozen=True, kw_only=True)
class MigrationConfig:
    enabled: bool = True
    max_retries: int = 3     # attempts that failed on a worker, per request
    wait_s: float = 30.0     # waiting for a usable worker, per request
    backoff_s: float = 0.2   # first wait; doubles up to max_backoff_s
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.wait_s < 0 or not 0 < self.backoff_s <= self.max_backoff_s:
            raise ValueError("migration: max_retries and wait_s must be >= 0, "
                             "0 < backoff_s <= max_backoff_s")


class Migration:
    def __init__(self, config: MigrationConfig | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        self.config = config or MigrationConfig()
        registry = registry if registry is not None else CollectorRegistry()  # tests: one per pipeline
        self.retries = Counter("pdserve_router_request_retries",
                               "Requests run again after a worker failure: stage before_first_token "
                               "(same request) or mid_stream (a continuation of the tokens sent)",
                               ["stage"], registry=registry)
        self.spent = Counter("pdserve_router_request_retries_spent",
                             "Requests failed after their retry limit or wait was spent", registry=registry)

    async def run(self, req: Admitted, timeout: float | None,
                  attempt: Callable[[Admitted, float | None], AsyncIterator[object]],
                  kinds: EventKinds) -> AsyncIterator[object]:
        """Events of ``attempt(req)``, then of its continuations after worker failures."""
        FirstToken, Tokens, Done, RequestFailed = kinds.first, kinds.tokens, kinds.done, kinds.failed

        cfg = self.config
        deadline = None if timeout is None else time.monotonic() + timeout
        sent: list[int] = []  # token ids the client has
        retries = 0           # attempts that failed on a worker
        waited = 0.0          # seconds spent waiting for a usable worker
        backoff = cfg.backoff_s
        cur = req
        for n in itertools.count(1):
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"deadline passed while retrying ({len(sent)} tokens sent)")
            try:
                async for event in attempt(cur, remaining):
                    if isinstance(event, FirstToken) and sent:  # a continuation's token 1: the next one
                        event = Tokens([event.token_id], [] if event.logprob is None else [event.logprob],
                                       [] if event.top is None else [event.top])
                    if isinstance(event, FirstToken):
                        sent.append(event.token_id)
                    elif isinstance(event, Tokens):
                        sent.extend(event.token_ids)
                    elif isinstance(event, Done):
                        event = _whole(event, req, cur)
                    yield event
                return
            except RequestFailed as exc:
                if not cfg.enabled or exc.code not in MIGRATABLE:
                    raise
                # a worker failed under it (else: no usable worker was there to try)
                on_worker = bool(getattr(exc, "extra_worker", "")) or exc.code == grpc.StatusCode.CANCELLED
                retries += on_worker
                pause = 0.0 if on_worker else backoff
                spent = (f"{cfg.max_retries} retries" if retries > cfg.max_retries
                         else f"{cfg.wait_s:g}s of waiting" if waited + pause > cfg.wait_s else "")
                if spent:
                    self.spent.inc()
                    raise RequestFailed(exc.code, f"{exc.message} ({len(sent)} tokens sent; gave up after "
                                                  f"{spent} for a usable worker)") from None
                if on_worker:
                    log.warning("request %s: %s; continuing elsewhere after %d token(s) (retry %d of %d)",
                                req.request_id, exc.message, len(sent), retries, cfg.max_retries)
                    self.retries.labels(stage="mid_stream" if sent else "before_first_token").inc()
                    backoff = cfg.backoff_s
                else:  # no usable worker right now (one is restarting): wait for it
                    waited += pause
                    backoff = min(backoff * 2, cfg.max_backoff_s)
                    await asyncio.sleep(pause)
                if len(sent) >= req.params.max_tokens:  # everything was sent; only the end was lost
                    yield Done("length", len(sent), kinds.meta())
                    return
                if sent and _stops(req, sent[-1]):  # it ended there (say, an EOS first token from the
                    yield Done("stop", len(sent), kinds.meta())  # prefill), only the end was lost
                    return
                cur = continuation(req, sent, n)


def continuation(req: Admitted, sent: list[int], n: int) -> Admitted:
    """The request that produces what ``req`` still owes after ``sent``: same tokens, same stream."""
    if not sent:
        return dataclasses.replace(req, request_id=f"{req.request_id}~r{n}")
    k = len(sent)
    params = dataclasses.replace(req.params, max_tokens=req.params.max_tokens - k,
                                 seed_draws=req.params.seed_draws + k,
                                 stop_context=req.params.stop_context + k)
    return dataclasses.replace(req, request_id=f"{req.request_id}~r{n}", prompt_ids=[*req.prompt_ids, *sent],
                               params=params)


def _stops(req: Admitted, token: int) -> bool:
    """Whether ``token`` ends the request (a stop token, or EOS unless ``ignore_eos``): the engine
    would have stopped on it, so a continuation must not run past it."""
    p = req.params
    return token in p.stop_token_ids or (not p.ignore_eos and token in req.eos_token_ids)


def _whole(done, req: Admitted, cur: Admitted):
    """The final event of the whole request: its completion counts the tokens of earlier attempts."""
    if cur is req:
        return done
    before = len(cur.prompt_ids) - len(req.prompt_ids)
    return dataclasses.replace(done, completion_tokens=done.completion_tokens + before)
