"""Logit penalties and biases of a request, applied by the sampler before any token is picked.

The semantics are vLLM's (so an OpenAI client sees what it sees elsewhere), applied in its order:

1. ``logit_bias``: each (token, bias) pair is added to that token's logit;
2. ``repetition_penalty`` r (transformers' and vLLM's): for every token in the prompt or already
   generated, a positive logit is divided by r and a non-positive one multiplied by it;
3. ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's): ``logit -= f * count + p * (count >
   0)``, ``count`` being how often the token was generated.

Greedy rows take the argmax of the result too. Log-probabilities returned to the client stay those of
the model's own distribution (the raw logits), as vLLM's default.

A penalized request keeps its token statistics on the device (``PenaltyState``): the counts of its
generated tokens and a mask of the tokens it has seen. They are made from the sequence's tokens when
it first samples (``state_for``; so only running sequences hold one: a decode worker's reservations
waiting for their KV hold none), and from then on the sampler updates them with the token it picks,
in stream order, so a step launched before the previous one's tokens reached the host
(engine.step_ahead) still sees them. Generated tokens are the sequence's own plus, for a continuation
(the router continuing a request on another worker), the last ``stop_context`` prompt tokens; the
decode side of a disaggregated request holds the prefill worker's first token as its own. So a
penalized request samples the same tokens colocated, disaggregated or migrated. Requests without
penalties cost nothing here; one with them holds about 5 bytes per vocabulary entry on the device
(640 KiB at a 128k vocabulary) while it runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.staging import to_device
from pdserve.sampling import SamplingParams


def state_for(seq, vocab_size: int, device: torch.device) -> PenaltyState | None:
    """The penalty state of an ``engine.sequence.Sequence`` about to sample, made on first use from its
    tokens (every one known then: the first sample comes after a prompt, and a launched-ahead step
    only follows one that sampled); None when the request has no penalties."""
    if seq.penalties is None and seq.params.penalized:
        generated = seq.num_tokens - seq.num_prompt_tokens + seq.params.stop_context
        seq.penalties = PenaltyState(seq.params, seq.tokens, generated=generated, vocab_size=vocab_size,
                                     device=device)
    return seq.penalties


class PenaltyState:
    """One penalized request's statistics on the device. ``tokens``: its tokens so far, the last
    ``generated`` of which it generated."""

    def __init__(self, params: SamplingParams, tokens: Sequence[int], *, generated: int, vocab_size: int,
                 device: torch.device) -> None:
        self.params = params
        self.counts: torch.Tensor | None = None  # [V] float32: generated tokens, by id
        self.seen: torch.Tensor | None = None  # [V] bool: in the prompt or generated
        self.bias_ids: torch.Tensor | None = None
        self.bias_values: torch.Tensor | None = None
        self._one: torch.Tensor | None = None
        generated = min(generated, len(tokens))
        if params.presence_penalty or params.frequency_penalty:
            self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            self._one = torch.ones(1, dtype=torch.float32, device=device)
            if generated:
                tail = to_device(torch.tensor(tokens[len(tokens) - generated:], dtype=torch.int64), device)
                self.counts.index_add_(0, tail, torch.ones(generated, dtype=torch.float32, device=device))
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.seen[to_device(torch.tensor(list(tokens), dtype=torch.int64), device)] = True
        if params.logit_bias:
            ids, values = zip(*params.logit_bias, strict=True)
            self.bias_ids = to_device(torch.tensor(ids, dtype=torch.int64), device)
            self.bias_values = to_device(torch.tensor(values, dtype=torch.float32), device)

    def record(self, token: torch.Tensor) -> None:
        """Count a picked token (``token``: a [1] int64 tensor on the device; no host sync)."""
        if self.counts is not None:
            self.counts.index_add_(0, token, self._one)
        if self.seen is not None:
            self.seen.index_fill_(0, token, True)


def penalized_logits(logits: torch.Tensor, rows: list[int], states: Sequence[PenaltyState]) -> torch.Tensor:
    """``logits [B, V]`` with the penalties of ``states[k]`` applied to row ``rows[k]``; a new tensor
    (the raw logits stay as they are, for log-probabilities). Vectorised over the penalized rows: one
    stacked tensor per statistic, neutral values for a row without that penalty."""
    out = logits.clone()
    dev, vocab = logits.device, logits.shape[-1]
    idx = to_device(torch.tensor(rows, dtype=torch.int64), dev)
    sub = out.index_select(0, idx)  # [b, V]
    biased = [k for k, s in enumerate(states) if s.bias_ids is not None]
    if biased:
        at_rows = torch.cat([torch.full_like(states[k].bias_ids, k) for k in biased])
        at_ids = torch.cat([states[k].bias_ids for k in biased])
        sub.index_put_((at_rows, at_ids), torch.cat([states[k].bias_values for k in biased]), accumulate=True)
    if any(s.seen is not None for s in states):
        none = torch.zeros(vocab, dtype=torch.bool, device=dev)
        seen = torch.stack([s.seen if s.seen is not None else none for s in states])
        rp = to_device(torch.tensor([s.params.repetition_penalty for s in states], dtype=sub.dtype), dev)
        rp = rp[:, None]
        sub = torch.where(seen, torch.where(sub > 0, sub / rp, sub * rp), sub)
    if any(s.counts is not None for s in states):
        zero = torch.zeros(vocab, dtype=torch.float32, device=dev)
        counts = torch.stack([s.counts if s.counts is not None else zero for s in states]).to(sub.dtype)
        freq = to_device(torch.tensor([s.params.frequency_penalty for s in states], dtype=sub.dtype), dev)
        pres = to_device(torch.tensor([s.params.presence_penalty for s in states], dtype=sub.dtype), dev)
        sub = sub - freq[:, None] * counts - pres[:, None] * (counts > 0).to(sub.dtype)
    return out.index_copy_(0, idx, sub)


def record_picks(tokens: torch.Tensor, rows: list[int], states: Sequence[PenaltyState]) -> None:
    """Count each penalized row's picked token in its state (on the device, in stream order)."""
    for row, state in zip(rows, states, strict=True):
        state.record(tokens[row:row + 1])
