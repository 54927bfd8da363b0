"""Text <-> token ids for a model directory, and streaming detokenization.

``Tokenizer.from_dir(dir)`` wraps the ``tokenizers`` library around ``dir/tokenizer.json`` (the
Hugging Face "fast" format) and reads the bos/eos token strings from ``tokenizer_config.json`` when
present. It returns ``None`` for a directory without ``tokenizer.json``: such a checkpoint is still
servable with token ids (``--prompt-ids``).

Streaming: a byte-level BPE token can hold part of a UTF-8 character, so decoding one token at a
time would print replacement characters. ``IncrementalDecoder`` keeps two offsets into the tokens
seen so far, the way vLLM and TGI do:

    tokens:  ... [prefix_offset ........ read_offset) [read_offset .... end)
                  \\__ context, already emitted __/    \\__ not yet emitted __/

Each ``push`` decodes ``tokens[prefix_offset:]`` and ``tokens[prefix_offset:read_offset]``; the
difference is the new text. If the new text ends in U+FFFD (an incomplete character) nothing is
emitted and the token waits for the rest of its bytes. Decoding with a few tokens of left context
(rather than each token alone) keeps tokenizer-specific spacing rules right, and decoding only a
short window keeps each push O(1) in the length of the generation. ``flush()`` emits whatever is
still held (incomplete bytes become U+FFFD) when the stream ends.

Ids the tokenizer does not know (a model's vocabulary may be padded beyond the tokenizer's, e.g.
128256 for Llama-3 shapes) decode to nothing rather than raising.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from engine.errors import ModelLoadError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_REPLACEMENT = "\ufffd"


class Tokenizer:
    """A thin, typed wrapper over ``tokenizers.Tokenizer`` with the model's special tokens."""

    def __init__(self, hf: _HFTokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 add_bos_token: bool | None = None) -> None:
        self._tok = hf
        self.bos_token_id = hf.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = hf.token_to_id(eos_token) if eos_token else None
        # When the tokenizer.json post-processor does not add bos itself but the config asks for it.
        self._prepend_bos = bool(add_bos_token) and self.bos_token_id is not None and \
            self.bos_token_id not in hf.encode("", add_special_tokens=True).ids

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer | None:
        path = Path(path)
        file = path / TOKENIZER_FILE
        if not file.is_file():
            return None
        try:
            hf = _HFTokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
            raise ModelLoadError(f"cannot load {file}: {exc}") from None
        cfg = read_tokenizer_config(path)
        return cls(hf, bos_token=token_str(cfg.get("bos_token")), eos_token=token_str(cfg.get("eos_token")),
                   add_bos_token=cfg.get("add_bos_token"))

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows (special tokens included); may be < the model's."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (engine.grammar builds its vocabulary from it)."""
        return self._tok.to_str()

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_releasing_gil(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Like ``encode``, through ``encode_batch``, which releases the GIL while the Rust tokenizer
        runs (``encode`` holds it): called on a worker thread for a large text, the caller's event loop
        keeps running meanwhile."""
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self._prepend_bos:
            ids = [self.bos_token_id, *ids]
        return ids

    def max_token_chars(self) -> int:
        """Characters of the longest vocabulary entry (added tokens included): no token covers more
        of a text, which bounds a text's token count from below without tokenizing it."""
        return max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @property
    def backend(self) -> _HFTokenizer:
        return self._tok


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas whose concatenation equals ``decode(all ids)``."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True,
                 prompt_ids: list[int] | None = None, context_tokens: int = 6) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # Prompt tail as left context only: spacing rules see it, but it is never emitted.
        self._ids: list[int] = list(prompt_ids[-context_tokens:]) if prompt_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._context_tokens = context_tokens

    def push(self, token_id: int) -> str:
        """Add one generated token; return the newly completed text (may be empty)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if full_text.endswith(_REPLACEMENT) or len(full_text) <= len(prefix_text):
            return ""  # an incomplete UTF-8 sequence (or a token that decodes to nothing): wait
        delta = full_text[len(prefix_text):]
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._prefix_offset, self._read_offset - self._context_tokens)
        self._trim()
        return delta

    def push_many(self, token_ids: list[int]) -> str:
        return "".join(self.push(t) for t in token_ids)

    def flush(self) -> str:
        """Emit whatever is still held back (an unfinished character becomes U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text):] if len(full_text) > len(prefix_text) else ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _trim(self) -> None:
        # Forget tokens left of the context window so memory stays bounded on long generations.
        if self._prefix_offset > 4 * self._context_tokens:
            cut = self._prefix_offset
            del self._ids[:cut]
            self._prefix_offset -= cut
            self._read_offset -= cut


def read_tokenizer_config(path: str | Path) -> dict:
    """A model directory's tokenizer_config.json as a dict ({} without one); ModelLoadError if malformed."""
    cfg_file = Path(path) / TOKENIZER_CONFIG_FILE
    if not cfg_file.is_file():
        return {}
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{cfg_file} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_file} must hold a JSON object")
    return cfg


def token_str(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: "<s>" or {"content": "<s>", ...} (AddedToken)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
