"""engine.tokenizer: agreement with transformers' AutoTokenizer, and streaming detokenization."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from engine.checkpoint import BOS_ID, EOS_ID, TOKENIZER_VOCAB
from engine.errors import ModelLoadError
from engine.tokenizer import IncrementalDecoder, Tokenizer

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Zürich 🦊 日本語 — naïve café, 👍🏽!",
    "  leading spaces and\ttabs\nnew lines  ",
    "def f(x):\n    return x ** 2  # 42",
    "",
]


@pytest.fixture(scope="module")
def tok(tiny_llama_dir) -> Tokenizer:
    t = Tokenizer.from_dir(tiny_llama_dir)
    assert t is not None
    return t


def test_special_tokens_and_sizes(tok):
    assert tok.vocab_size == len(tok) == TOKENIZER_VOCAB
    assert (tok.bos_token_id, tok.eos_token_id) == (BOS_ID, EOS_ID)
    assert tok.encode("hi")[0] == BOS_ID and tok.encode("hi", add_special_tokens=False)[0] != BOS_ID


@pytest.mark.parametrize("text", TEXTS)
def test_matches_transformers_and_round_trips(tok, tiny_llama_dir, text):
    hf = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    ids = tok.encode(text)
    assert ids == hf(text).input_ids
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids, skip_special_tokens=False).startswith("<|begin_of_text|>")


def test_no_tokenizer_json_gives_none_and_bad_json_errors(make_checkpoint, tmp_path):
    assert Tokenizer.from_dir(make_checkpoint("llama", with_tokenizer=False)) is None
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_ids_beyond_the_tokenizer_decode_to_nothing(tok):
    # A model's vocabulary may be padded past the tokenizer's (llama3-8b: 128256 vs 1024).
    assert tok.decode([tok.encode("a", add_special_tokens=False)[0], 128255, 5000]) == "a"
    dec = IncrementalDecoder(tok)
    assert dec.push(127999) == "" and dec.push_many(tok.encode("ok", add_special_tokens=False)) == "ok"


def stream(tok, ids, **kw) -> list[str]:
    dec = IncrementalDecoder(tok, **kw)
    deltas = [dec.push(i) for i in ids]
    deltas.append(dec.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_deltas_concatenate_to_the_text(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    deltas = stream(tok, ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)  # never a half character


def test_multibyte_characters_are_held_until_complete(tok):
    ids = tok.encode("🦊", add_special_tokens=False)
    assert len(ids) >= 2  # the emoji's 4 bytes span several byte-level tokens
    deltas = stream(tok, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1) and deltas[-2] == "🦊" and deltas[-1] == ""


def test_random_token_streams_match_full_decode(tok):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(TOKENIZER_VOCAB) for _ in range(rng.randrange(1, 60))]
        assert "".join(stream(tok, ids)) == tok.decode(ids)
        assert "".join(stream(tok, ids, skip_special_tokens=False)) == \
            tok.decode(ids, skip_special_tokens=False)


def test_prompt_context_is_not_emitted_and_long_streams_stay_bounded(tok):
    prompt = tok.encode("Once upon a time")
    text = " there was a small village at the edge of a great forest. " * 20
    ids = tok.encode(text, add_special_tokens=False)
    dec = IncrementalDecoder(tok, prompt_ids=prompt)
    assert "".join(dec.push(i) for i in ids) + dec.flush() == text
    assert len(dec._ids) < 40  # the window is trimmed, not the whole generation
