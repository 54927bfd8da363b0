"""Structured output in the engine (engine.grammar): every kind of constraint holds, the tokens are the
same synchronous or with steps launched ahead (where a constrained row's sampling waits for the token
before it), a request handed from a prefill engine to a decode engine or continued after a migration
resumes its grammar exactly, unconstrained rows are untouched by constrained neighbours, and bad or
hostile constraints are refused with their reason. Every engine ends with a leak check."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
import torch

from engine import model_runner
from engine.async_engine import AsyncEngine
from engine.engine import EngineConfig, LLMEngine
from engine.grammar import GrammarError
from engine.grammar.spec import MAX_CONSTRAINT_CHARS, grammar_text, validate
from pdserve.sampling import Constraint, SamplingParams

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("torch_single_thread")]

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                         "kind": {"enum": ["cat", "dog"]}}}
NESTED = {"type": "object", "required": ["point", "ok"], "additionalProperties": False,
          "properties": {"point": {"type": "object", "required": ["x", "y"], "additionalProperties": False,
                                   "properties": {"x": {"type": "number", "minimum": -5, "maximum": 5},
                                                  "y": {"type": "integer", "minimum": 0, "maximum": 9}}},
                         "ok": {"type": "boolean"},
                         "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"}}}
ARITH = 'start: expr\nexpr: NUM | expr "+" expr\nNUM: /[0-9]{1,3}/'
CONSTRAINTS = [Constraint("json_schema", json.dumps(PERSON)), Constraint("json_schema", json.dumps(NESTED)),
               Constraint("regex", r"[0-9]{3}-[0-9]{4}"),
               Constraint("choice", choices=("yes", "no", "maybe")),
               Constraint("grammar", ARITH)]


@pytest.fixture
def make(tiny_llama_dir, engine_factory):
    """Engines of the tiny checkpoint with its tokenizer, leak-checked at the end (engine_factory)."""
    def make_engine(ahead: bool = False, **overrides) -> LLMEngine:
        cfg = dict(model=str(tiny_llama_dir), device="cpu", attention_backend="torch", block_size=4,
                   num_blocks=512, max_num_seqs=16, overlap_steps=ahead)
        return engine_factory(None, **{**cfg, **overrides})

    return make_engine


def _text(engine, ids):
    return engine.tokenizer.decode(ids, skip_special_tokens=True)


def _holds(constraint: Constraint, text: str) -> bool:
    if constraint.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(constraint.text))
        return True
    if constraint.kind == "json_object":
        return isinstance(json.loads(text), dict)
    if constraint.kind == "regex":
        return re.fullmatch(constraint.text, text) is not None
    if constraint.kind == "choice":
        return text in constraint.choices
    return re.fullmatch(r"[0-9]{1,3}(\+[0-9]{1,3})*", text) is not None


def _prompts(engine, n):
    words = ["hello there", "the quick brown fox", "a list of", "answer in json", "tell me"]
    return [engine.tokenizer.encode(words[i % len(words)] + f" {i}") for i in range(n)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_kind_holds(make, temperature):
    engine = make()
    params = [SamplingParams(max_tokens=96, temperature=temperature, seed=7 + i, constraint=c)
              for i, c in enumerate(CONSTRAINTS)]
    outs = engine.generate(_prompts(engine, len(params)), params)
    for c, ids in zip(CONSTRAINTS, outs, strict=True):
        assert _holds(c, _text(engine, ids)), (c.kind, _text(engine, ids))
    assert engine.stats.finish_reasons == {"stop": len(CONSTRAINTS)}


def test_json_object_and_a_cut_answer(make):
    engine = make()
    [ids] = engine.generate([_prompts(engine, 1)[0]], SamplingParams(max_tokens=5, constraint=Constraint(
        "json_object")))
    assert engine.stats.finish_reasons == {"length": 1}  # cut short: the reason says so
    assert _text(engine, ids).startswith("{")


def test_launched_ahead_equals_synchronous_and_defers_only_constrained_steps(make, monkeypatch):
    deferred = []
    defer = model_runner.LaunchedStep.defer
    monkeypatch.setattr(model_runner.LaunchedStep, "defer",
                        lambda self, fn: (deferred.append(1), defer(self, fn)))
    mixed = []
    for i in range(12):
        c = CONSTRAINTS[i % len(CONSTRAINTS)] if i % 2 == 0 else None
        mixed.append(SamplingParams(max_tokens=40, temperature=0.0 if i % 3 else 0.8, seed=i, constraint=c,
                                    presence_penalty=0.5 if i % 4 == 0 else 0.0))
    results = {}
    for ahead in (False, True):
        engine = make(ahead)
        results[ahead] = engine.generate(_prompts(engine, len(mixed)), mixed)
        if ahead:
            assert engine.stats.steps_ahead > 0
    assert results[True] == results[False]
    assert deferred, "no launched-ahead step waited for a constrained row's token"


def test_unconstrained_rows_are_untouched(make):
    engine = make(True)
    plain = [SamplingParams(max_tokens=24, temperature=0.7, seed=100 + i) for i in range(4)]
    alone = engine.generate(_prompts(engine, 4), plain)
    constrained = [SamplingParams(max_tokens=24, constraint=c) for c in CONSTRAINTS[:4]]
    together = engine.generate(_prompts(engine, 4) + _prompts(engine, 4), plain + constrained)
    assert together[:4] == alone


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=lambda c: c.kind)
def test_prefill_to_decode_handoff_and_continuation_resume_the_grammar(make, constraint):
    single = make()
    prompt = _prompts(single, 1)[0]
    params = SamplingParams(max_tokens=64, constraint=constraint)
    [want] = single.generate([prompt], params)
    prefill, decode = make(), make(True)
    prefill.add_prefill_request("r", prompt, params)
    first = None
    while first is None:
        for out in prefill.step():
            first = out.new_token_ids[0]
    res = decode.reserve("r", prompt, params)
    src, skip = prefill.block_table("r"), res.num_cached_tokens // 4
    with torch.no_grad():  # the KV plane's part
        decode.kv_cache[:, res.block_ids[skip:]] = prefill.kv_cache[:, src[skip:]]
    prefill.release("r")
    decode.commit_prefilled("r", first)
    got = [first]
    while decode.has_unfinished():
        for out in decode.step():
            got += out.new_token_ids
    assert got == want
    if len(want) > 3:  # a migrated request: its answer so far is prompt context, its grammar replays it
        k = len(want) // 2
        cont = SamplingParams(max_tokens=params.max_tokens - k, constraint=constraint, stop_context=k)
        [tail] = make(True).generate([prompt + want[:k]], cont)
        assert want[:k] + tail == want


def test_a_continuation_outside_its_constraint_is_refused(make):
    engine = make()
    prompt = engine.tokenizer.encode("hi")
    bad = engine.tokenizer.encode("zzz")
    params = SamplingParams(max_tokens=8, constraint=Constraint("regex", "[0-9]+"), stop_context=len(bad))
    with pytest.raises(GrammarError, match="already generated"):
        engine.add_request("x", prompt + bad, params)


@pytest.mark.parametrize("constraint, reason", [
    (Constraint("json_schema", "{not json"), "not valid JSON"),
    (Constraint("json_schema", json.dumps({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})),
     "cannot be compiled"),
    (Constraint("regex", "([0-9]+"), "cannot be compiled"),
    (Constraint("grammar", "start: undefined_rule"), "cannot be compiled"),
    (Constraint("regex", "a" * (MAX_CONSTRAINT_CHARS + 1)), "at most"),
])
def test_bad_constraints_are_refused_with_their_reason(make, constraint, reason):
    with pytest.raises(GrammarError, match=reason):
        validate(constraint)
    engine = make()
    with pytest.raises(GrammarError, match=reason):
        engine.add_request("bad", [1, 2, 3], SamplingParams(constraint=constraint))
    assert engine.num_waiting == 0


def test_hostile_schemas_are_bounded(make):
    """Deep nesting and a huge enum either compile within llguidance's limits and hold, or are refused:
    never an engine that hangs."""
    deep: dict = {"type": "integer", "minimum": 0, "maximum": 3}
    for _ in range(60):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"], "additionalProperties": False}
    enum = {"enum": [f"value-{i:05d}" for i in range(20000)]}
    engine = make()
    for schema in (deep, enum):
        c = Constraint("json_schema", json.dumps(schema))
        try:
            [ids] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=400, constraint=c))
        except GrammarError as exc:
            assert "constraint" in str(exc)
            continue
        text = _text(engine, ids)
        if engine.stats.finish_reasons.get("length"):
            continue
        jsonschema.validate(json.loads(text), schema)


def test_grammars_are_compiled_once(make):
    engine = make()
    c = CONSTRAINTS[0]
    engine.generate(_prompts(engine, 3), [SamplingParams(max_tokens=8, constraint=c)] * 3)
    assert engine.grammars.compiled == 1 and engine.grammars.hits >= 2


def test_choice_and_gbnf_texts():
    assert "start:" in grammar_text(Constraint("choice", choices=('say "hi"', "no")))
    validate(Constraint("grammar", 'root ::= "a" | "b" digit\ndigit ::= [0-9]'))


def test_async_compile_off_the_engine_thread_with_a_time_bound(make, monkeypatch):
    engine = make()

    async def run():
        ae = AsyncEngine(engine)
        ae.start()
        try:
            c = Constraint("regex", "[a-c]{2}")
            outs = [o async for o in ae.generate("a", [1, 2, 3], SamplingParams(max_tokens=8, constraint=c))]
            assert engine.grammars.compiled == 1
            assert re.fullmatch("[a-c]{2}", _text(engine, [t for o in outs for t in o.new_token_ids]))
            slow = Constraint("regex", "[d-f]{2}")
            real = engine.grammars.compile

            def sluggish(constraint):
                import time
                time.sleep(0.5)
                return real(constraint)

            monkeypatch.setattr(engine.grammars, "compile", sluggish)
            monkeypatch.setenv("PDSERVE_GRAMMAR_COMPILE_TIMEOUT_S", "0.05")
            with pytest.raises(GrammarError, match="did not compile within"):
                async for _ in ae.generate("b", [1, 2, 3], SamplingParams(max_tokens=8, constraint=slow)):
                    pass
            await asyncio.sleep(0.6)
        finally:
            await ae.stop()

    asyncio.run(run())


@pytest.mark.parametrize("variant", ["llama", "qwen2-tied-padded-vocab"])
def test_constrained_greedy_matches_transformers_with_the_same_grammar(make_checkpoint, variant):
    """The reference: ``transformers``' greedy ``generate`` with a logits processor that masks by an
    llguidance matcher of its own (not engine.grammar's code) gives the engine's tokens. The padded
    vocabulary (logit rows past the tokenizer's ids) must stay masked."""
    import llguidance
    import numpy as np
    from test_reference_parity import VARIANTS, hf_model
    from transformers import LogitsProcessor, LogitsProcessorList

    path = make_checkpoint(**VARIANTS[variant])
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", attention_backend="torch", num_blocks=256))
    model = hf_model(path)
    vocab = engine.model_config.vocab_size
    eos = sorted(engine.eos_token_ids)

    class Masked(LogitsProcessor):
        def __init__(self, constraint, prompt_len):
            tok = llguidance.LLTokenizer(engine.tokenizer.to_json(), n_vocab=vocab, eos_token=eos)
            self.matcher = llguidance.LLMatcher(tok, grammar_text(constraint))
            self.prompt_len, self.fed = prompt_len, 0

        def __call__(self, input_ids, scores):
            for t in input_ids[0, self.prompt_len + self.fed:].tolist():
                assert self.matcher.consume_token(t)
                self.fed += 1
            bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
            allowed = torch.from_numpy(np.unpackbits(bits, bitorder="little")[:scores.shape[-1]].astype(bool))
            return scores.masked_fill(~allowed, float("-inf"))

    for i, c in enumerate(CONSTRAINTS):
        prompt = engine.tokenizer.encode(f"prompt {i}: give an answer")
        [want] = engine.generate([prompt], SamplingParams(max_tokens=64, constraint=c))
        ones = torch.ones(1, len(prompt), dtype=torch.long)
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), attention_mask=ones, max_new_tokens=64,
                                 do_sample=False, pad_token_id=1, eos_token_id=eos,
                                 logits_processor=LogitsProcessorList([Masked(c, len(prompt))]))
        ref = out[0, len(prompt):].tolist()
        # the engine ends an answer once its grammar allows nothing but the end, one step before the
        # reference picks the EOS the mask forces: the same tokens, without that last one
        if ref[-1:] != want[-1:] and ref[-1] in eos:
            ref = ref[:-1]
        assert ref == want, c.kind
    assert engine.leak_report() is None
    engine.close()


def test_a_grammar_over_the_parser_limits_is_refused_at_compile(make, monkeypatch):
    """llguidance's limits bound a hostile grammar's compilation; over them the request is refused with the
    reason before it runs (a 20,000-string enum at a 128k vocabulary is one: bench/results'
    grammar-engines run), and the refusal is remembered."""
    from engine.grammar import spec

    monkeypatch.setattr(spec, "LIMITS", {**spec.LIMITS, "initial_lexer_fuel": 10_000})
    engine = make()
    enum = Constraint("json_schema", json.dumps({"enum": [f"value-{i:05d}" for i in range(3000)]}))
    for _ in range(2):
        with pytest.raises(GrammarError, match="constraint"):
            engine.add_request("e", [1, 2, 3], SamplingParams(constraint=enum))
    assert engine.grammars.compiled == 1 and engine.num_waiting == 0


def test_a_continuation_of_a_complete_answer_ends_at_once(make):
    """A stream whose answer was complete when its worker died (the final message lost) is continued with
    all of it as context: the grammar is done, only EOS is allowed, and the request ends "stop"."""
    engine = make()
    prompt = engine.tokenizer.encode("pick")
    c = Constraint("choice", choices=("yes", "no"))
    [answer] = engine.generate([prompt], SamplingParams(max_tokens=16, constraint=c))
    done = [t for t in answer if t not in engine.eos_token_ids]
    [tail] = engine.generate([prompt + done], SamplingParams(max_tokens=8, constraint=c,
                                                             stop_context=len(done)))
    assert len(tail) == 1 and tail[0] in engine.eos_token_ids
    assert engine.stats.finish_reasons == {"stop": 2}
