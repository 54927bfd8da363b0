"""Translation between pdserve.v1 messages and engine types, with validation.

Every service converts through here so that a bad value gets the same INVALID_ARGUMENT message
whichever process first sees it. Nothing here does I/O (``cache_events_reply`` awaits only the engine
thread it is handed).
"""

from __future__ import annotations

import math

from pdserve.sampling import Constraint, SamplingParams
from pdserve.v1 import common_pb2, router_pb2

DEFAULT_MAX_TOKENS = 16
# A refusal's retry hint (router/shedding.py): trailing metadata, milliseconds as a decimal string.
RETRY_AFTER_KEY = "retry-after-ms"
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
INT32_MAX = 2**31 - 1


def sampling_from_proto(msg: common_pb2.SamplingParams, max_tokens: int | None = None) -> SamplingParams:
    """Engine SamplingParams from the wire message; ValueError (-> INVALID_ARGUMENT) on bad values.

    ``max_tokens``: the public request's own field (it has a default there); internal messages carry
    it in the sampling message itself."""
    if max_tokens is None:
        max_tokens = msg.max_tokens
    def finite(name: str, value: float) -> float:
        if math.isnan(value) or math.isinf(value):
            raise ValueError(f"{name} must be a finite number, got {value}")
        return value

    temperature = finite("temperature", msg.temperature) if msg.HasField("temperature") else 0.0
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    top_p = finite("top_p", msg.top_p) if msg.HasField("top_p") else 1.0
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    top_k = msg.top_k if msg.HasField("top_k") else 0
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if msg.HasField("logprobs") and not 0 <= msg.logprobs <= 20:
        raise ValueError(f"logprobs must be in 0..20, got {msg.logprobs}")
    if len(msg.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LEN for s in msg.stop):
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_LEN} chars")
    if any(t < 0 for t in msg.stop_token_ids):
        raise ValueError("stop_token_ids must be >= 0")
    if msg.seed_draws > INT32_MAX:
        raise ValueError(f"seed_draws must be at most {INT32_MAX}, got {msg.seed_draws}")
    if msg.stop_context > INT32_MAX:
        raise ValueError(f"stop_context must be at most {INT32_MAX}, got {msg.stop_context}")
    if not 1 <= max_tokens <= INT32_MAX:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    penalties = {name: finite(name, getattr(msg, name)) for name in
                 ("presence_penalty", "frequency_penalty", "repetition_penalty") if msg.HasField(name)}
    bias = {int(t): finite(f"logit_bias[{t}]", v) for t, v in msg.logit_bias.items()}
    return SamplingParams(**penalties, logit_bias=tuple(bias.items()),
        max_tokens=int(max_tokens), temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
        seed=int(msg.seed) if msg.HasField("seed") else None, stop=tuple(msg.stop),
        stop_token_ids=tuple(int(t) for t in msg.stop_token_ids), ignore_eos=bool(msg.ignore_eos),
        logprobs=int(msg.logprobs) if msg.HasField("logprobs") else None, seed_draws=int(msg.seed_draws),
        stop_context=int(msg.stop_context), constraint=constraint_from_proto(msg.constraint))


def constraint_from_proto(msg: common_pb2.Constraint) -> Constraint | None:
    """The engine's Constraint of a wire message (None when no kind is set); ValueError when empty."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        return Constraint("json_object") if msg.json_object else None
    if kind == "choice":
        return Constraint("choice", choices=tuple(msg.choice.values))
    return Constraint(kind, getattr(msg, kind))


def constraint_to_proto(constraint: Constraint | None, msg: common_pb2.Constraint) -> None:
    if constraint is None:
        return
    if constraint.kind == "json_object":
        msg.json_object = True
    elif constraint.kind == "choice":
        msg.choice.values.extend(constraint.choices)
    else:
        setattr(msg, constraint.kind, constraint.text)


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
        max_tokens=params.max_tokens)
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    msg.seed_draws = params.seed_draws
    msg.stop_context = params.stop_context
    if params.presence_penalty:
        msg.presence_penalty = params.presence_penalty
    if params.frequency_penalty:
        msg.frequency_penalty = params.frequency_penalty
    if params.repetition_penalty != 1.0:
        msg.repetition_penalty = params.repetition_penalty
    for token, bias in params.logit_bias:
        msg.logit_bias[token] = bias
    constraint_to_proto(params.constraint, msg.constraint)
    return msg


def report(final: router_pb2.FinalInfo) -> dict:
    """The per-request report: ``finish_reason``, every ``RequestFacts`` field, and ``usage``, as plain
    JSON (built by hand: the protobuf JSON mapping would turn int64 into a string and drop zeros). The
    one formatter every door and client prints, so a new fact shows up everywhere at once."""
    facts = final.facts
    out = {"finish_reason": final.finish_reason}
    out.update((f.name, getattr(facts, f.name)) for f in facts.DESCRIPTOR.fields)
    u = final.usage
    out["usage"] = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                    "cached_tokens": u.cached_tokens}
    return out


def retry_after_ms(trailing_metadata) -> float | None:
    """The router's ``retry-after-ms`` hint in a refusal's trailing metadata (pairs of key, value), if any."""
    for key, value in trailing_metadata or ():
        if key == RETRY_AFTER_KEY:
            try:
                return float(value)
            except (TypeError, ValueError):
                return None
    return None


def validate_token_ids(ids: list[int], vocab_size: int) -> list[int]:
    if not ids:
        raise ValueError("prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    return list(ids)


def first_logprob(out: object) -> float | None:
    """The sampled token's logprob from a StepOutput's ``new_logprobs`` entry, whatever its shape."""
    lps = getattr(out, "new_logprobs", None)
    if not lps:
        return None
    first = lps[0]
    if isinstance(first, (int, float)):
        return float(first)
    for attr in ("logprob", "sampled_logprob"):
        if hasattr(first, attr):
            return float(getattr(first, attr))
    if isinstance(first, (tuple, list)) and first and isinstance(first[0], (int, float)):
        return float(first[0])
    return None


def top_logprobs(pairs: object) -> common_pb2.TopLogprobs | None:
    """One token's alternatives ((token_id, logprob) pairs, most likely first: a model_runner
    TokenLogprob's ``top``, or that entry itself) as the wire message; None when the request asked
    for none (logprobs unset or 0)."""
    pairs = getattr(pairs, "top", pairs)
    if not pairs or not isinstance(pairs, (tuple, list)):
        return None
    return common_pb2.TopLogprobs(entries=[common_pb2.TopLogprob(token_id=int(t), logprob=float(lp))
                                           for t, lp in pairs])


def top_pairs(msg: common_pb2.TopLogprobs) -> list[tuple[int, float]]:
    """A TopLogprobs message as (token_id, logprob) pairs, in the order sent (most likely first)."""
    return [(e.token_id, e.logprob) for e in msg.entries]


def worker_stats(*, worker_id: str, role: str, incarnation: str, engine: object, snapshot: object,
                 transports: list[str], kv_endpoint: bytes, address: str, num_leased: int = 0,
                 queue_depth: int | None = None, num_running: int | None = None) -> common_pb2.WorkerStats:
    """GetStats reply from an engine and its AsyncEngine snapshot (never blocks on the engine thread)."""
    layout = getattr(engine, "kv_layout", None)
    config = getattr(engine, "model_config", None)
    return common_pb2.WorkerStats(
        worker_id=worker_id, role=role, incarnation=incarnation,
        layout_hash=layout.compat_hash() if layout is not None else "",
        model_fingerprint=getattr(layout, "model_fingerprint", "") or "",
        queue_depth=snapshot.queue_depth if queue_depth is None else queue_depth,
        num_running=snapshot.num_running if num_running is None else num_running,
        free_blocks=snapshot.free_blocks, total_blocks=snapshot.total_blocks,
        block_size=getattr(layout, "block_size", 0), transports=transports, kv_endpoint=kv_endpoint,
        address=address, num_leased=num_leased,
        max_model_len=int(getattr(config, "max_position_embeddings", 0) or 0),
        kv_bytes_per_block=int(getattr(layout, "num_layers", 0) * getattr(layout, "block_bytes", 0)),
        max_num_seqs=int(getattr(getattr(engine, "config", None), "max_num_seqs", 0) or 0))


# Cache events per GetStats answer (8 bytes each): a router catching up takes the rest on its next calls.
CACHE_EVENTS_PER_ANSWER = 65_536
# A snapshot's hashes per tier, most recently used: about what the router's prefix index keeps per worker.
CACHE_SNAPSHOT_PER_TIER = 131_072


async def cache_events_reply(request: common_pb2.StatsRequest, engine: object,
                             call) -> common_pb2.CacheEvents | None:
    """GetStats' ``cache`` field (engine/kv_events.py): the events after ``cache_events_after``, or a
    snapshot when there is no number yet or its events are no longer kept. ``engine`` is the worker's
    LLMEngine, ``call`` runs a function on its thread (``AsyncEngine.call``; only a snapshot needs it).
    None when not asked for, or the engine keeps no events."""
    events = getattr(engine, "kv_events", None)
    if not request.cache_events or events is None:
        return None
    after = request.cache_events_after
    got = events.since(after, CACHE_EVENTS_PER_ANSWER) if after else None
    if got is None:
        last, held = await call(lambda e: e.cache_snapshot(CACHE_SNAPSHOT_PER_TIER))
        return common_pb2.CacheEvents(
            last=last, snapshot=True, more=events.last > last,
            batches=[common_pb2.CacheEventBatch(tier=tier, stored=True, hashes=hashes)
                     for tier, hashes in held.items() if hashes])
    last, batches = got
    return common_pb2.CacheEvents(
        last=last, more=events.last > last,
        batches=[common_pb2.CacheEventBatch(tier=tier, stored=stored, hashes=hashes)
                 for tier, stored, hashes in batches])
