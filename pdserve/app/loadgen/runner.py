"""The open-loop run: Poisson arrivals of single-turn requests or multi-turn sessions.

Single-turn: ``num_requests`` requests; inter-arrival times are exponential with mean ``1/rate``
(``rate`` = inf sends all at once). Sessions (``sessions`` K x ``turns`` T): K conversations start at
Poisson times; each turn's prompt is the previous prompt + the previous answer + fresh tokens, sent
with the same ``session_id`` once the previous turn finished (so prefix reuse and affinity show).
``think_time_s``: a session waits an exponential time of that mean between an answer and its next
turn (a person reading, an agent's tool running), so returning turns find their KV evicted as they
would in a fleet. ``system_prompt_len`` prepends one shared prefix to every request
(shared-system-prompt workload).
Prompts are random token ids (no tokenizer needed), generated from ``seed``; ``ignore_eos`` keeps
output lengths as asked. ``trace``: (input, output) pairs replayed in order (cycling) instead of the two
length distributions. ``run(cfg, on_done=f)`` calls ``f(sample)`` as each request ends (a progress bar).
A refused request keeps the router's retry hint (``retry-after-ms`` trailing metadata) in its sample.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from pdserve.app.loadgen.dist import Dist
from pdserve.app.loadgen.openai_backend import make_client
from pdserve.app.loadgen.stats import Sample
from pdserve.client import AsyncClient, build_request
from pdserve.wire import retry_after_ms


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    router: str
    rate: float
    num_requests: int
    input_len: Dist
    output_len: Dist
    sessions: int = 0
    turns: int = 1
    vocab_size: int = 1000
    seed: int = 0
    timeout_s: float = 300.0
    system_prompt_len: int = 0   # shared by every request / session (drawn once from the seed)
    session_prefix: str = "bench"
    think_time_s: float = 0.0  # mean seconds between an answer and the session's next turn
    trace: tuple[tuple[int, int], ...] = ()  # (input, output) lengths, replayed in order
    # "grpc", or "openai": the router's HTTP door (loadgen/openai_backend.py; router = its HOST:PORT)
    backend: str = "grpc"
    api_key: str = ""

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"--rate must be > 0 (inf = all at once), got {self.rate}")
        if self.num_requests < 1 and self.sessions < 1:
            raise ValueError("--num-requests must be >= 1")
        if self.sessions < 0 or self.turns < 1:
            raise ValueError("--sessions must be >= 0 and --turns >= 1")
        if self.vocab_size < 2:
            raise ValueError("vocab_size must be >= 2")
        if not self.think_time_s >= 0:
            raise ValueError(f"--think-time must be >= 0, got {self.think_time_s}")


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    # Skip the lowest ids (often special tokens) so prompts look like ordinary text.
    lo = min(4, vocab - 1)
    return [rng.randrange(lo, vocab) for _ in range(n)]


async def _one(client: AsyncClient, cfg: RunConfig, prompt: list[int], out_len: int,
               session: str, turn: int = 0, reusable: int = 0) -> tuple[Sample, list[int]]:
    req = build_request(prompt_ids=prompt, max_tokens=out_len, session_id=session, ignore_eos=True)
    req.skip_text = True
    try:
        r = await client.generate(req, timeout=cfg.timeout_s)
    except grpc.aio.AioRpcError as exc:
        return Sample(ok=False, error=exc.code().name, prompt_tokens=len(prompt), session=session,
                      turn=turn, retry_after_ms=retry_after_ms(exc.trailing_metadata())), []
    return Sample(ok=True, ttft_s=r.ttft_s, itl_s=r.itl_s, tpot_s=r.tpot_s, e2e_s=r.e2e_s,
                  prompt_tokens=len(prompt), output_tokens=len(r.token_ids), session=session, turn=turn,
                  final=r.final, reusable_tokens=reusable), r.token_ids


def length_source(cfg: RunConfig, rng: random.Random) -> Callable[[], tuple[int, int]]:
    """(input, output) lengths of the next request: the trace's next pair (cycling), else one draw of
    each distribution."""
    if cfg.trace:
        pairs = itertools.cycle(cfg.trace)
        return lambda: next(pairs)
    return lambda: (cfg.input_len.sample(rng), cfg.output_len.sample(rng))






async def run(cfg: RunConfig, on_done: Callable[[Sample], None] | None = None) -> tuple[list[Sample], float]:
    rng = random.Random(cfg.seed)
    client = make_client(cfg.router, cfg.backend, api_key=cfg.api_key)
    samples: list[Sample] = []
    tasks: list[asyncio.Task] = []
    system = _tokens(rng, cfg.system_prompt_len, cfg.vocab_size)
    lengths = length_source(cfg, rng)

    def done(sample: Sample) -> None:
        samples.append(sample)
        if on_done is not None:
            on_done(sample)

    async def session(k: int) -> None:
        history: list[int] = list(system)
        for t in range(cfg.turns):
            in_len, out_len = lengths()
            prompt = history + _tokens(rng, in_len, cfg.vocab_size)
            name = f"{cfg.session_prefix}-{cfg.seed}-{k}"
            # a returning turn's reusable tokens: the conversation so far (a first turn's: the system prompt)
            sample, answer = await _one(client, cfg, prompt, out_len, name, t, len(history))
            done(sample)
            if not sample.ok:
                return
            history = prompt + answer
            if cfg.think_time_s and t < cfg.turns - 1:
                await asyncio.sleep(rng.expovariate(1.0 / cfg.think_time_s))

    async def single() -> None:
        in_len, out_len = lengths()
        prompt = system + _tokens(rng, in_len, cfg.vocab_size)
        sample, _ = await _one(client, cfg, prompt, out_len, "")
        done(sample)

    n = cfg.sessions if cfg.sessions else cfg.num_requests
    start = time.perf_counter()
    try:
        for i in range(n):
            tasks.append(asyncio.create_task(session(i) if cfg.sessions else single()))
            if cfg.rate != float("inf") and i < n - 1:
                await asyncio.sleep(rng.expovariate(cfg.rate))
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await client.close()
    return samples, time.perf_counter() - start
