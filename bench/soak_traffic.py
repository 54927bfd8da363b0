"""The soak's traffic: seeded request mixes from several client threads, and what each one proved.

Every request the soak sends is one ``Record``: its kind, when it ran, the gRPC status it ended with
(``OK`` or the code the client saw), the tokens it received and whether they match the reference.
References come from one in-process engine run over the same prompts before the cluster takes
traffic (greedy and seeded sampling both have exactly one right answer), so a wrong token is caught
whenever it happens, faults or not.

Kinds (weights in ``KIND_WEIGHTS``):

    greedy    a greedy stream from the prompt pool (some prompts share a 64-token prefix)
    seeded    temperature / top-k / top-p sampling with a fixed seed
    cancel    a greedy stream the client cancels after a random number of tokens
    deadline  a long greedy stream with a deadline of 50 ms .. 1 s
    bad       one of ``BAD_KINDS``: must be refused with INVALID_ARGUMENT, faults or not
    session   a 3-turn conversation under one session id (each turn's prompt is the previous turn's
              prompt + its answer + new user tokens), every turn checked

Which client does what is drawn from ``random.Random(seed, client index)``; when the requests run
depends on the machine, so the seed fixes the mix and the prompts, not the interleaving.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import grpc

from pdserve.client import Client, build_request

KIND_WEIGHTS = {"greedy": 30, "seeded": 15, "cancel": 12, "deadline": 10, "bad": 15, "session": 18}
BAD_KINDS = ("nan_temperature", "negative_temperature", "top_p_above_1", "negative_top_k", "zero_max_tokens",
             "empty_prompt", "over_long_prompt", "prompt_plus_max_tokens_over_context", "token_id_negative",
             "token_id_beyond_vocab")
NORMAL_TIMEOUT_S = 180.0  # a normal request that runs into this deadline counts as hung
SHARED_PREFIX = 64
SESSION_TURNS = 3


@dataclass(frozen=True)
class Case:
    """One prompt with its sampling parameters and the reference answer."""
    prompt: tuple[int, ...]
    params: dict  # keyword arguments of build_request / SamplingParams besides the prompt
    want: tuple[int, ...] = ()


@dataclass
class Record:
    kind: str
    client: int
    start: float
    end: float = 0.0
    code: str = ""          # "OK" or a grpc.StatusCode name
    detail: str = ""
    tokens: int = 0
    exact: bool | None = None  # OK: equal to the reference; error: what arrived is its prefix
    sub: str = ""           # bad: which bad request; session: the turn


@dataclass
class Pools:
    greedy: list[Case]
    seeded: list[Case]
    sessions: list[list[Case]]  # each a list of turns
    vocab: int
    context: int


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def build_pools(model_dir: str, seed: int, *, n_greedy: int = 24, n_seeded: int = 12,
                n_sessions: int = 8) -> Pools:
    """Draw the prompts from ``seed`` and compute every reference answer with one in-process engine."""
    from engine.engine import EngineConfig, LLMEngine
    from pdserve.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model=model_dir, num_blocks=1024, device="cpu"))
    vocab, context = engine.model_config.vocab_size, engine.max_model_len
    rng = random.Random(seed)
    shared = _ids(rng, SHARED_PREFIX, vocab)

    def prompt() -> list[int]:
        body = _ids(rng, rng.randint(4, 160), vocab)
        return shared + body if rng.random() < 0.5 else body

    greedy = [(prompt(), dict(max_tokens=rng.randint(8, 48), ignore_eos=True)) for _ in range(n_greedy)]
    seeded = []
    for _ in range(n_seeded):
        p = dict(max_tokens=rng.randint(8, 40), ignore_eos=True, temperature=rng.choice([0.7, 1.0, 1.3]),
                 seed=rng.randrange(1 << 30))
        p.update(rng.choice([{"top_k": 50}, {"top_p": 0.9}, {}]))
        seeded.append((prompt(), p))

    def run(cases: list[tuple[list[int], dict]]) -> list[Case]:
        outs = engine.generate([c[0] for c in cases], [SamplingParams(**c[1]) for c in cases])
        return [Case(tuple(c[0]), c[1], tuple(o)) for c, o in zip(cases, outs, strict=True)]

    sessions: list[list[Case]] = [[] for _ in range(n_sessions)]
    turns = [(shared + _ids(rng, rng.randint(8, 40), vocab),
              dict(max_tokens=rng.randint(6, 24), ignore_eos=True)) for _ in range(n_sessions)]
    for _ in range(SESSION_TURNS):
        done = run(turns)
        for s, case in enumerate(done):
            sessions[s].append(case)
        turns = [(list(c.prompt) + list(c.want) + _ids(rng, rng.randint(4, 24), vocab),
                  dict(max_tokens=rng.randint(6, 24), ignore_eos=True)) for c in done]
    return Pools(greedy=run(greedy), seeded=run(seeded), sessions=sessions, vocab=vocab, context=context)


def bad_request(kind: str, pools: Pools):
    """A request that admission must refuse with INVALID_ARGUMENT."""
    ok = list(pools.greedy[0].prompt)
    if kind == "nan_temperature":
        return build_request(prompt_ids=ok, temperature=float("nan"))
    if kind == "negative_temperature":
        return build_request(prompt_ids=ok, temperature=-0.5)
    if kind == "top_p_above_1":
        return build_request(prompt_ids=ok, temperature=1.0, top_p=1.5)
    if kind == "negative_top_k":
        return build_request(prompt_ids=ok, temperature=1.0, top_k=-3)
    if kind == "zero_max_tokens":
        return build_request(prompt_ids=ok, max_tokens=0)
    if kind == "empty_prompt":
        return build_request(prompt_ids=[])
    if kind == "over_long_prompt":
        return build_request(prompt_ids=[7] * (pools.context + 50))
    if kind == "prompt_plus_max_tokens_over_context":
        return build_request(prompt_ids=[7] * (pools.context - 10), max_tokens=100)
    if kind == "token_id_negative":
        return build_request(prompt_ids=[*ok[:8], -5])
    if kind == "token_id_beyond_vocab":
        return build_request(prompt_ids=[*ok[:8], pools.vocab + 12345])
    raise ValueError(kind)


class TrafficClient:
    """One client thread: draws a kind, runs it, records it, until ``stop`` is set."""

    def __init__(self, index: int, router: str, pools: Pools, seed: int, stop: threading.Event,
                 records: list[Record], lock: threading.Lock) -> None:
        self.index, self.router, self.pools, self.stop = index, router, pools, stop
        self.rng = random.Random(f"{seed}/{index}")
        self.records, self.lock = records, lock
        self.sessions_run = 0
        self.thread = threading.Thread(target=self._loop, daemon=True, name=f"soak-client-{index}")

    def _loop(self) -> None:
        kinds, weights = zip(*KIND_WEIGHTS.items(), strict=True)
        with Client(self.router) as client:
            while not self.stop.is_set():
                kind = self.rng.choices(kinds, weights)[0]
                getattr(self, f"_{kind}")(client)

    def _add(self, rec: Record) -> None:
        rec.end = rec.end or time.monotonic()
        with self.lock:
            self.records.append(rec)

    def _stream(self, client: Client, rec: Record, req, want: tuple[int, ...], *, timeout: float,
                cancel_after: int | None = None, metadata=()) -> None:
        """Run one stream; fill ``rec`` with its status, token count and exactness against ``want``."""
        got: list[int] = []
        final = None
        call = client.stub.Generate(req, timeout=timeout, metadata=list(metadata) or None)
        try:
            for msg in call:
                got.extend(msg.token_ids)
                if msg.HasField("final"):
                    final = msg.final
                if cancel_after is not None and len(got) >= cancel_after and final is None:
                    call.cancel()
            rec.code = "OK"
            rec.exact = tuple(got) == want and final is not None and \
                final.usage.completion_tokens == len(want)
            if not rec.exact:
                rec.detail = f"got {len(got)} tokens, final={final is not None}, want {len(want)}"
        except grpc.RpcError as exc:
            rec.code = exc.code().name
            rec.detail = (exc.details() or "")[:200]
            rec.exact = tuple(got) == want[:len(got)]
        rec.end = time.monotonic()
        rec.tokens = len(got)

    def _greedy(self, client: Client) -> None:
        case = self.rng.choice(self.pools.greedy)
        rec = Record("greedy", self.index, time.monotonic())
        self._stream(client, rec, build_request(prompt_ids=case.prompt, **case.params), case.want,
                     timeout=NORMAL_TIMEOUT_S)
        self._add(rec)

    def _seeded(self, client: Client) -> None:
        case = self.rng.choice(self.pools.seeded)
        rec = Record("seeded", self.index, time.monotonic())
        self._stream(client, rec, build_request(prompt_ids=case.prompt, **case.params), case.want,
                     timeout=NORMAL_TIMEOUT_S)
        self._add(rec)

    def _cancel(self, client: Client) -> None:
        case = self.rng.choice(self.pools.greedy)
        after = self.rng.randint(1, max(1, len(case.want) - 1))
        rec = Record("cancel", self.index, time.monotonic(), sub=f"after {after}")
        self._stream(client, rec, build_request(prompt_ids=case.prompt, **case.params), case.want,
                     timeout=NORMAL_TIMEOUT_S, cancel_after=after)
        self._add(rec)

    def _deadline(self, client: Client) -> None:
        case = max(self.rng.sample(self.pools.greedy, 3), key=lambda c: len(c.want))
        timeout = self.rng.uniform(0.05, 1.0)
        rec = Record("deadline", self.index, time.monotonic(), sub=f"{timeout * 1e3:.0f} ms")
        self._stream(client, rec, build_request(prompt_ids=case.prompt, **case.params), case.want,
                     timeout=timeout)
        self._add(rec)

    def _bad(self, client: Client) -> None:
        sub = self.rng.choice(BAD_KINDS)
        rec = Record("bad", self.index, time.monotonic(), sub=sub)
        self._stream(client, rec, bad_request(sub, self.pools), (), timeout=30.0)
        self._add(rec)

    def _session(self, client: Client) -> None:
        script = self.rng.choice(self.pools.sessions)
        self.sessions_run += 1
        sid = f"soak-{self.index}-{self.sessions_run}"
        for turn, case in enumerate(script):
            if self.stop.is_set():
                return
            rec = Record("session", self.index, time.monotonic(), sub=f"turn {turn + 1}")
            self._stream(client, rec, build_request(prompt_ids=case.prompt, session_id=sid, **case.params),
                         case.want, timeout=NORMAL_TIMEOUT_S)
            self._add(rec)


# ---- judging --------------------------------------------------------------------------------------
# Statuses a request may end with besides OK-and-exact. ALWAYS holds for every traffic kind at any
# time; OWN is what the kind asks for; IN_FAULT is added while a fault window covers the request
# (from the signal until the worker serves again + FAULT_GRACE_S).
ALWAYS = {"RESOURCE_EXHAUSTED"}  # admission control refused it, with a retry hint
OWN = {"cancel": {"CANCELLED"}, "deadline": {"DEADLINE_EXCEEDED"}}
IN_FAULT = {"kill9": {"UNAVAILABLE"}, "sigterm": {"UNAVAILABLE", "CANCELLED"}, "freeze": {"UNAVAILABLE"}}
FAULT_GRACE_S = 2.0


@dataclass
class Verdict:
    outcome: str            # e.g. "ok_exact", "CANCELLED", "UNAVAILABLE (kill9)"
    violation: str = ""     # empty when allowed
    faults: list[str] = field(default_factory=list)


def judge(rec: Record, windows: list[tuple[float, float, str]]) -> Verdict:
    """Whether ``rec`` ended as allowed; ``windows`` are (start, end, action) of every fault."""
    hit = [a for s, e, a in windows if rec.start <= e + FAULT_GRACE_S and rec.end >= s]
    if rec.kind == "bad":
        if rec.code == "INVALID_ARGUMENT":
            return Verdict("INVALID_ARGUMENT", faults=hit)
        return Verdict(rec.code, f"bad request {rec.sub} ended {rec.code}: {rec.detail}", hit)
    if rec.code == "OK":
        if rec.exact:
            return Verdict("ok_exact", faults=hit)
        return Verdict("ok_wrong", f"{rec.kind} {rec.sub} answered OK but not token-exact: {rec.detail}", hit)
    allowed = ALWAYS | OWN.get(rec.kind, set())
    for a in hit:
        allowed |= IN_FAULT[a]
    outcome = rec.code + (f" ({'+'.join(sorted(set(hit)))})" if hit and rec.code not in OWN.get(rec.kind, ())
                          else "")
    if rec.code not in allowed:
        why = "hung until its deadline" if rec.code == "DEADLINE_EXCEEDED" else "status not allowed"
        return Verdict(outcome, f"{rec.kind} {rec.sub} {why}: {rec.code} {rec.detail}", hit)
    if not rec.exact:
        return Verdict(outcome, f"{rec.kind} {rec.sub} ended {rec.code} after {rec.tokens} tokens that are "
                                f"not a prefix of the reference", hit)
    return Verdict(outcome, faults=hit)
