"""One request's state inside the engine: its tokens, KV block table and progress."""

from __future__ import annotations

import enum

import torch

from engine.prefix_hash import ROOT_HASH, hash_block
from pdserve.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued, holds no blocks
    RUNNING = "running"  # holds blocks for all its tokens; prefilling (maybe in chunks) or decoding
    PINNED = "pinned"  # prefill-only request done: KV kept for the caller until release()
    RESERVED = "reserved"  # decode side: blocks held for KV another worker writes
    FINISHED = "finished"


class Sequence:
    """Tokens (prompt + generated), the KV block table and how much of it is computed.

    ``tokens[:num_computed]`` have their keys/values in the blocks of ``block_table``. A running
    sequence's next step computes ``tokens[num_computed:]``: the rest of the prompt (or a chunk of
    it), or just the last sampled token when decoding, and samples when that reaches the end.
    """

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                 arrival: int, prefill_only: bool = False) -> None:
        self.request_id = request_id
        self.tokens: list[int] = list(prompt_ids)
        self.num_prompt_tokens = len(self.tokens)
        self.params = params
        self.arrival = arrival
        self.prefill_only = prefill_only
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.num_computed = 0
        self.num_cached_tokens = 0  # prefix-cache hit at first admission (GPU and tiers)
        self.num_tier_tokens = 0  # of those, tokens loaded back from the host or disk tier
        self.loading = None  # engine.kv_tiers.LoadHandle while blocks come back from a tier
        self.load_span = (0, 0)  # (first block, blocks) of that load
        self.tier_planned = 0  # tokens that load brings (a reservation counts them as cached)
        self.load_target: int | None = None  # num_computed once it all loads (a committed reservation)
        self.num_registered = 0  # leading blocks already published to the prefix cache
        self.hashes: list[int] = []  # chained hashes of the full blocks of ``tokens``
        self.generator: torch.Generator | None = None
        self.penalties = None  # engine.penalties.PenaltyState of a request with penalties or a bias
        self.grammar = None  # engine.grammar.GrammarState of a request with a structured-output constraint
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.invalid = False  # its error is the request's own (engine_types.StepOutput.invalid)
        self.text = ""  # detokenized output, tracked only for stop strings
        self.text_start = 0  # where its own text begins in ``text`` (after a continuation's context)
        self.decoder = None  # engine.tokenizer.IncrementalDecoder when stop strings are set
        self.num_preemptions = 0
        self.layer_sink = None  # engine.layer_sink.LayerSink until its final prompt chunk has run
        self.first_scheduled_at: float | None = None  # time.monotonic() of its first step (admission)
        # index in ``tokens`` of a placeholder for a token a launched step has not returned yet; only
        # set inside LLMEngine.step (engine.step_ahead)
        self.pending_slot: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens

    def full_block_hashes(self, block_size: int, upto_tokens: int | None = None) -> list[int]:
        """Chained hashes of (at least) the full blocks among the first ``upto_tokens`` tokens (default:
        all), computed once and cached; index it, or slice to ``upto_tokens // block_size``."""
        n = (self.num_tokens if upto_tokens is None else upto_tokens) // block_size
        parent = self.hashes[-1] if self.hashes else ROOT_HASH
        for i in range(len(self.hashes), n):
            parent = hash_block(parent, self.tokens[i * block_size:(i + 1) * block_size])
            self.hashes.append(parent)
        return self.hashes

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed}, blocks={len(self.block_table)})")
