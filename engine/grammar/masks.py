"""A batch's allowed tokens: computed on the host by llguidance, applied to the logits on the device.

``MaskBuilder.build`` writes one bitmask row (32 tokens a word, llguidance's layout) per constrained
row into a pinned host tensor -- on llguidance's own thread pool (``LLExecutor``, which releases the
GIL) when there are several -- and ``apply`` copies it to the device and sets every disallowed logit
to ``-inf`` there. The engine builds a step's masks while the GPU still computes that step's forward
(engine.model_runner ``LaunchedStep.finish``), so on a GPU the host's share runs beside the device's.
"""

from __future__ import annotations

import torch

from engine.grammar.state import GrammarState

_ALL = -1  # a word with every bit set: no token masked


class MaskBuilder:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.device = device
        self._executor = None
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)

    def build(self, states: list[GrammarState | None]) -> torch.Tensor:
        """``[len(states), words]`` int32 on the host (pinned on CUDA); a row of None allows everything. A
        finished grammar's row allows only EOS (a continuation of an answer that was already complete
        ends at once), and so does a matcher in its error state (which then refuses it: the request
        ends with the error)."""
        out = torch.full((len(states), self.words), _ALL, dtype=torch.int32,
                         pin_memory=self.device.type == "cuda")
        live = [(s.matcher, i) for i, s in enumerate(states) if s is not None]
        if not live:
            return out
        row_bytes = self.words * 4
        if len(live) == 1:
            matcher, i = live[0]
            matcher.unsafe_compute_mask_ptr(out[i].data_ptr(), row_bytes)
        else:
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(live, out.data_ptr(), row_bytes, len(states))
        return out

    def apply(self, logits: torch.Tensor, rows: list[int], mask: torch.Tensor) -> torch.Tensor:
        """``logits`` with rows ``rows`` masked by ``mask`` (``build``'s, one row each); a new tensor, the
        input stays the model's own distribution (log-probabilities are read from it)."""
        n, vocab = len(rows), logits.shape[-1]
        words = mask.to(self.device, non_blocking=True)
        allowed = ((words.unsqueeze(-1) >> self._shifts) & 1).view(n, -1)[:, :vocab].bool()
        out = logits.clone()
        if n == logits.shape[0] and rows == list(range(n)):
            return out.masked_fill_(~allowed, float("-inf"))
        idx = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        out[idx] = out.index_select(0, idx).masked_fill_(~allowed, float("-inf"))
        return out
