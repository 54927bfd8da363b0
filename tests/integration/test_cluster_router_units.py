"""In-process checks of the router's pure pieces: admission, text assembly, transport choice, leases."""

from __future__ import annotations

import pytest

from decode_service.leases import Lease, LeaseTable
from pdserve.client import build_request
from router.admission import ModelLimits, admit
from router.pipeline import _choose_transport
from router.text import TextAssembler


class _Tok:
    """Each id decodes to one character: enough to check hold-back and stop cuts."""

    def encode(self, text: str) -> list[int]:
        return [ord(ch) for ch in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


LIMITS = ModelLimits(vocab_size=1024, max_model_len=64, tokenizer=None)


def test_admission_accepts_and_defaults() -> None:
    a = admit(build_request(prompt_ids=[5, 6], max_tokens=10, session_id=""), LIMITS, metadata_session="m")
    assert a.prompt_ids == [5, 6] and a.params.max_tokens == 10 and a.session_id == "m" and a.request_id
    assert a.params.temperature == 0.0 and a.params.top_p == 1.0 and not a.want_text
    b = admit(build_request(prompt_ids=[5], session_id="s", reusable_prefix_len=1), LIMITS)
    assert b.session_id == "s" and b.reusable_prefix_len == 1 and b.params.max_tokens == 16
    assert a.skip_special_tokens and b.skip_special_tokens
    assert not admit(build_request(prompt_ids=[5], skip_special_tokens=False), LIMITS).skip_special_tokens


@pytest.mark.parametrize("kw,needle", [
    (dict(prompt_ids=[5] * 60, max_tokens=5), "context"),
    (dict(prompt="hi"), "tokenizer"),
    (dict(prompt_ids=[5], reusable_prefix_len=3), "reusable_prefix_len"),
    (dict(prompt_ids=[5], top_k=-2), "top_k"),
    (dict(prompt_ids=[5], top_p=1.5), "top_p"),
    (dict(prompt_ids=[5], temperature=float("inf")), "temperature"),
    (dict(prompt_ids=[5], session_id="s" * 300), "session_id"),
])
def test_admission_refuses(kw, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        admit(build_request(**kw), LIMITS)


def test_text_assembler_holds_back_possible_stop_prefix(monkeypatch) -> None:
    import engine.tokenizer as tk

    class Dec:
        def __init__(self, tok, **kw) -> None:
            pass

        def push(self, t: int) -> str:
            return chr(t)

        def flush(self) -> str:
            return ""

    monkeypatch.setattr(tk, "IncrementalDecoder", Dec)
    t = TextAssembler(_Tok(), stop=("END",))
    out = t.push([ord(c) for c in "abcE"])
    assert out == "ab"  # the last len("END") - 1 characters wait: they could begin the stop string
    out += t.push([ord(c) for c in "NDxyz"])
    assert out == "abc" and t.stopped
    assert t.finish() == ""
    plain = TextAssembler(_Tok())
    assert plain.push([ord("h"), ord("i")]) == "hi" and plain.finish() == ""
    assert TextAssembler(None).push([1, 2]) == ""
    # special tokens kept: the ends (stop token ids, EOS) still never show
    kept = TextAssembler(_Tok(), skip_special_tokens=False, ends=frozenset({ord("$")}))
    assert kept.push([ord(c) for c in "a$"]) == "a" and kept.finish() == ""
    assert TextAssembler(_Tok(), ends=frozenset({ord("$")})).push([ord(c) for c in "a$"]) == "a$"


def test_transport_choice_prefers_prefill_order() -> None:
    assert _choose_transport(["nixl", "tcp"], ["nixl", "tcp"]) == ("nixl", "")
    chosen, why = _choose_transport(["nixl", "tcp"], ["tcp"])
    assert chosen == "tcp" and "nixl" in why
    assert _choose_transport(["tcp"], ["nixl"]) == (None, "")


def test_lease_table_take_expire() -> None:
    t = LeaseTable()
    t.add(Lease(request_id="a", block_ids=[1], num_cached_tokens=0, num_prompt_tokens=3, expects_kv=True,
                deadline=10.0))
    t.add(Lease(request_id="b", block_ids=[2], num_cached_tokens=0, num_prompt_tokens=3, expects_kv=False,
                deadline=20.0))
    with pytest.raises(ValueError):
        t.add(Lease(request_id="a", block_ids=[], num_cached_tokens=0, num_prompt_tokens=1, expects_kv=False,
                    deadline=1.0))
    assert [x.request_id for x in t.expired(now=15.0)] == ["a"]
    assert t.take("a") is None and t.take("b").request_id == "b" and len(t) == 0
