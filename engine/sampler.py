"""Token selection for a batch of rows, each with its own ``SamplingParams``.

One call handles greedy and random rows together, vectorized over the batch:

* temperature scaling, then top-k and top-p (nucleus) filtering by masking logits to ``-inf``
  (a full sort only when some row uses top-p; a ``topk`` threshold when only top-k is used);
* sampling by the exponential race ``argmax(probs / E)``, ``E ~ Exp(1)`` — equivalent to drawing
  from ``probs`` — where each *seeded* row draws its ``E`` from its own ``torch.Generator``. The
  generator advances only when its row samples, so a seed gives the same tokens whatever shares
  the batch; unseeded rows draw from one shared generator;
* rows with penalties or a logit bias (engine.penalties) have them applied first, greedy rows too,
  and their picks counted on the device;
* rows under a structured-output constraint have every token outside it masked to ``-inf``
  (engine.grammar.masks), after their penalties;
* greedy rows take ``argmax`` of their logits (after their own penalties), independent of the rest;
* optional log-probabilities (of the raw distribution, as a model score) of the chosen token and
  the top-``n`` alternatives.

Everything stays on the device; the only host transfer is the caller's ``.tolist()`` of the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.grammar.masks import MaskBuilder
from engine.penalties import PenaltyState, penalized_logits, record_picks
from engine.staging import to_device
from pdserve.sampling import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] logprob of the chosen token (rows that asked)
    top_ids: torch.Tensor | None = None  # [B, n] alternatives (n = max requested), -1 padding
    top_logprobs: torch.Tensor | None = None  # [B, n]


def _on(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=dtype), device)


def advance_generator(generator: torch.Generator, vocab_size: int, draws: int = 1) -> None:
    """Consume exactly what ``draws`` sampled tokens consume from a row's own generator.

    A disaggregated request samples its first token on the prefill worker and the rest on the
    decode worker, each with a generator made from the same seed. Skipping the prefill's draw
    keeps the decode worker's stream where a single engine's would be, so seeded output is the
    same colocated or disaggregated (on the same device kind).
    """
    device = generator.device
    for _ in range(draws):
        torch.empty(vocab_size, device=device).exponential_(generator=generator)


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


class Sampler:
    def __init__(self, device: torch.device | str, seed: int | None = None) -> None:
        self.device = torch.device(device)
        # Shared stream for unseeded rows: reproducible per engine when ``seed`` is given.
        self._shared = torch.Generator(device=self.device)
        if seed is None:
            self._shared.seed()
        else:
            self._shared.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None],
                 penalties: Sequence[PenaltyState | None] | None = None,
                 masks: tuple[list[int], torch.Tensor, MaskBuilder] | None = None) -> SamplerOutput:
        """``logits [B, V]`` float32; ``generators[i]`` is row i's own generator (None: shared);
        ``penalties[i]`` row i's penalty state (None, or no list: none); ``masks``: (rows, host bitmask,
        its builder) of the rows under a structured-output constraint (engine.grammar)."""
        n = logits.shape[0]
        if n != len(params) or n != len(generators) or (penalties is not None and n != len(penalties)):
            raise ValueError(f"{n} logit rows for {len(params)} params / {len(generators)} generators")
        pen_rows = [i for i, s in enumerate(penalties or ()) if s is not None]
        pen_states = [penalties[i] for i in pen_rows]
        work = penalized_logits(logits, pen_rows, pen_states) if pen_rows else logits
        if masks is not None:
            rows, bitmask, builder = masks
            work = builder.apply(work, rows, bitmask)
        greedy = [p.temperature == 0.0 for p in params]
        tokens = work.argmax(dim=-1)
        if not all(greedy):
            rows = [i for i, g in enumerate(greedy) if not g]
            sampled = self._sample(work[rows] if len(rows) < n else work,
                                   [params[i] for i in rows], [generators[i] for i in rows])
            if len(rows) == n:
                tokens = sampled
            else:
                tokens[_on(rows, logits.device)] = sampled
        if pen_rows:
            record_picks(tokens, pen_rows, pen_states)
        out = SamplerOutput(token_ids=tokens)
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        if wanted:
            logp = torch.log_softmax(logits, dim=-1)
            out.logprobs = logp.gather(1, tokens[:, None])[:, 0]
            top = max(wanted)
            if top:
                out.top_logprobs, out.top_ids = logp.topk(top, dim=-1)
        return out

    def _sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        dev = logits.device
        temps = _on([p.temperature for p in params], dev, logits.dtype)
        logits = logits / temps[:, None]
        vocab = logits.shape[-1]
        top_ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        top_ps = [p.top_p for p in params]
        if any(p < 1.0 for p in top_ps):
            logits = _top_k_top_p(logits, top_ks, top_ps)
        elif any(top_ks):
            k_max = max(top_ks)
            kth = logits.topk(k_max, dim=-1).values  # [B, k_max], descending
            ks = _on([k or k_max for k in top_ks], dev)
            thresh = kth.gather(1, (ks - 1)[:, None])
            keep_all = _on([k == 0 for k in top_ks], dev)[:, None]
            logits = logits.masked_fill((logits < thresh) & ~keep_all, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        seeded = [i for i, g in enumerate(generators) if g is not None]
        for i in seeded:
            noise[i].exponential_(generator=generators[i])
        if len(seeded) < len(generators):
            shared = [i for i, g in enumerate(generators) if g is None]
            if len(shared) == len(generators):
                noise.exponential_(generator=self._shared)
            else:
                idx = _on(shared, dev)
                noise[idx] = torch.empty(len(shared), vocab, device=dev).exponential_(generator=self._shared)
        # Exp(1) draws of exactly 0 would turn masked tokens (prob 0) into 0/0 = NaN.
        return (probs / noise.clamp_(min=1e-30)).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Mask everything outside each row's top-k and its smallest nucleus of mass ``>= top_p``."""
    dev = logits.device
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=dev)[None, :]
    ks = _on([k or vocab for k in top_ks], dev)[:, None]
    sorted_logits = sorted_logits.masked_fill(ranks >= ks, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p (the top one always stays).
    before = probs.cumsum(dim=-1) - probs
    ps = _on(top_ps, dev, probs.dtype)[:, None]
    sorted_logits = sorted_logits.masked_fill(before >= ps, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
