"""Streaming text for one request: incremental detokenization plus stop-string handling.

The engine stops generation at a stop string, but the text the client sees is assembled here (the
engine's StepOutput carries ids only). Text that might be the start of a stop string is held back
until it is known not to be one, so a client never receives text past a stop string.
"""

from __future__ import annotations


class TextAssembler:
    """``skip_special_tokens=False`` keeps special tokens in the text, except the ones that end the
    answer (``ends``: the stop token ids, and the model's EOS unless it is ignored), whose text is
    never shown, as a stop string's is not."""

    def __init__(self, tokenizer: object | None, stop: tuple[str, ...] = (), *,
                 skip_special_tokens: bool = True, ends: frozenset[int] = frozenset()) -> None:
        self._decoder = None
        self._ends = frozenset() if skip_special_tokens else ends
        if tokenizer is not None:
            from engine.tokenizer import IncrementalDecoder

            self._decoder = IncrementalDecoder(tokenizer, skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._pending = ""
        self.stopped = False

    def push(self, token_ids: list[int]) -> str:
        if self._decoder is None or self.stopped:
            return ""
        self._pending += "".join(self._decoder.push(t) for t in token_ids if t not in self._ends)
        return self._emit(final=False)

    def finish(self) -> str:
        if self._decoder is None or self.stopped:
            return ""
        self._pending += self._decoder.flush()
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        for s in self._stop:
            idx = self._pending.find(s)
            if idx >= 0:
                self.stopped = True
                out, self._pending = self._pending[:idx], ""
                return out
        if final or not self._hold:
            out, self._pending = self._pending, ""
            return out
        cut = max(0, len(self._pending) - self._hold)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out
