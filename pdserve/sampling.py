"""Per-request decoding parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_PENALTY = 2.0  # presence / frequency, OpenAI's range
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
MAX_LOGIT_BIAS_VALUE = 100.0  # OpenAI's range
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Constraint:
    """A structured-output constraint (engine.grammar compiles and enforces it).

    ``kind``: ``json_schema`` (``text`` is the schema as JSON), ``json_object`` (any JSON object; no
    text), ``regex`` (the whole answer matches ``text``), ``choice`` (exactly one of ``choices``) or
    ``grammar`` (``text`` in Lark syntax, or GBNF when it holds ``::=``). Equal constraints share one
    compiled grammar (``key``)."""

    kind: str
    text: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, "
                             f"got {self.kind!r}")
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind == "choice":
            if not self.choices or any(not isinstance(c, str) or not c for c in self.choices):
                raise ValueError("a choice constraint needs at least one non-empty string")
        elif self.kind != "json_object" and not self.text:
            raise ValueError(f"a {self.kind} constraint needs its text")

    @property
    def key(self) -> tuple:
        return (self.kind, self.text, self.choices)

    @property
    def size(self) -> int:
        """Characters of its text (the bound on what a worker compiles)."""
        return len(self.text) + sum(len(c) + 1 for c in self.choices)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``seed`` gives the request its own random generator, so the same seed yields the same tokens
    whatever else shares the batch. ``logprobs`` (``None`` = off) asks for the sampled token's
    log-probability plus that many top alternatives. Stop strings need a tokenizer; the returned
    text is cut before the stop string, the token ids keep the token that completed it.

    Penalties change the logits before any selection, greedy included (engine.penalties): OpenAI's
    ``presence_penalty`` and ``frequency_penalty`` on the generated tokens, ``repetition_penalty``
    (vLLM's and transformers') on the prompt's and the generated ones, and ``logit_bias`` (token id,
    bias) pairs added to their logits. Log-probabilities stay those of the model's own distribution.
    A ``constraint`` (structured output) masks every token that would leave it, before the penalties.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    # seeded rows: draws already taken from the seed's stream (a continued request resumes it there)
    seed_draws: int = 0
    # a continued request: its last stop_context prompt tokens were generated before (stop strings are
    # looked for across them and the new tokens; the penalties count them as generated)
    stop_context: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), token ids ascending
    constraint: Constraint | None = None  # structured output (engine.grammar)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0.0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an int >= 0, got {self.logprobs!r}")
        if not isinstance(self.seed_draws, int) or self.seed_draws < 0:
            raise ValueError(f"seed_draws must be an int >= 0, got {self.seed_draws!r}")
        if not isinstance(self.stop_context, int) or self.stop_context < 0:
            raise ValueError(f"stop_context must be an int >= 0, got {self.stop_context!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        rp = self.repetition_penalty
        if not (isinstance(rp, (int, float)) and 0.0 < rp <= MAX_REPETITION_PENALTY):
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {rp!r}")
        bias = dict(self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias)
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
        for token, value in bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            if not (isinstance(value, (int, float)) and abs(value) <= MAX_LOGIT_BIAS_VALUE):
                raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS_VALUE:g}, "
                                 f"{MAX_LOGIT_BIAS_VALUE:g}], got {value!r} for token {token}")
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(v)) for t, v in bias.items())))
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ValueError(f"constraint must be a Constraint, got {type(self.constraint).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError unless every logit_bias token is in the vocabulary (its ids are sorted)."""
        if self.logit_bias and self.logit_bias[-1][0] >= vocab_size:
            bad = [t for t, _ in self.logit_bias if t >= vocab_size]
            raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")

    @property
    def penalized(self) -> bool:
        """Whether any penalty or bias changes this request's logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)
