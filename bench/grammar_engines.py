"""llguidance vs xgrammar for constrained decoding: compile cost, per-token mask cost, coverage.

Runs outside the project's environment, in a scratch venv with both engines (CPU only):

    python3 -m venv /tmp/gbench && /tmp/gbench/bin/pip install torch==2.13.0 \\
        && /tmp/gbench/bin/pip install llguidance xgrammar tokenizers jsonschema numpy tabulate
    # a Llama-3-sized byte-level BPE (128256 ids) with the project's recipe, and the tiny preset's:
    /tmp/gbench/bin/python bench/grammar_engines.py tokenizer --out /tmp/tok-128k --vocab-size 128256
    /tmp/gbench/bin/python bench/grammar_engines.py tokenizer --out /tmp/tok-tiny --preset tiny
    /tmp/gbench/bin/python bench/grammar_engines.py run --tokenizer /tmp/tok-128k/tokenizer.json \\
        --tokenizer /tmp/tok-tiny/tokenizer.json --out /tmp/grammar-bench

``tokenizer``: the tiny preset's tokenizer is ``engine.checkpoint.write_tokenizer`` itself (1024 ids).
A larger vocabulary uses the same recipe (byte-level BPE, specials <|begin_of_text|> 0,
<|end_of_text|> 1, <|eot_id|> 2, the Llama-3 post-processor) trained on more text than the embedded
``engine.bpe_corpus`` (which saturates at a few thousand merges): that corpus, docs/*.md, the
interpreter's standard library and the scratch venv's torch/transformers sources, all local files.
Ids above the trained BPE are ``<|reserved_special_token_N|>`` specials, as in Llama 3.

``run``: for every tokenizer x engine x case of the suite (JSON Schema features, a regex, a choice, a
small arithmetic CFG as Lark for llguidance and GBNF for xgrammar, json_object, and two hostile
schemas: objects nested 60 deep and an enum of 20,000 strings, each compiled in a child process
under ``--hostile-timeout``):

* compile: the first compile, the same text again (xgrammar caches per GrammarCompiler; llguidance has
  no cache, its matcher is built again), and a new matcher for a request from the compiled form
  (llguidance ``LLMatcher.deep_copy()`` of a template matcher, xgrammar ``GrammarMatcher(compiled)``);
* masks: a known-valid document is tokenized (no BOS) and fed token by token, the mask computed
  before each token (at most ``--max-tokens``). Single matcher: a fresh one ("cold", includes lazily
  built lexer state) and the same matcher again after reset() ("warm"). Batches of 16 and 64
  matchers of the same grammar, each started at a different offset of the document (so the states
  differ), masks filled together (``llguidance.torch.fill_next_token_bitmask_par`` over an
  ``LLExecutor``; xgrammar ``BatchGrammarMatcher.batch_fill_next_token_bitmask``), both with
  ``--threads`` threads, for ``--batch-steps`` steps. Times are wall microseconds around the call;
* coverage: compiles, every token of the valid document is in the mask and accepted and the end
  is accepting with EOS allowed; the invalid document (when the case has one) is refused somewhere;
* mask agreement: per step, whether the two engines' masks are bit-identical (same vocabulary), and
  whether either ever allows a special (non-EOS) token such as <|begin_of_text|>.

Prints tables and writes ``grammar-engines.json`` (and ``grammar-engines.md``) under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import glob
import hashlib
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------
# tokenizer


def make_tokenizer(out: Path, vocab_size: int | None, preset: str | None) -> dict:
    """Write out/tokenizer.json + tokenizer_config.json; returns what was made and how long it took."""
    sys.path.insert(0, str(REPO))
    from engine import checkpoint as ck  # the project's recipe (torch + safetensors + tokenizers)

    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if preset == "tiny" or vocab_size == ck.TOKENIZER_VOCAB:
        ck.write_tokenizer(out)
        info = {"recipe": "engine.checkpoint.write_tokenizer", "vocab_size": ck.TOKENIZER_VOCAB}
    else:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

        from engine.bpe_corpus import CORPUS

        files = [
            f
            for f in sorted(glob.glob(f"{sys.base_prefix}/lib/python3*/**/*.py", recursive=True))
            if "site-packages" not in f
        ]
        files += sorted(glob.glob(str(REPO / "docs" / "*.md")))
        site = Path(__import__("tokenizers").__file__).resolve().parents[1]
        files += sorted(glob.glob(f"{site}/[tx]*/**/*.py", recursive=True))  # torch, transformers, ...

        def texts():
            yield from CORPUS.splitlines()
            for f in files:
                try:
                    yield Path(f).read_text(encoding="utf-8", errors="replace")
                except OSError:
                    pass

        n_reserved = 253 if vocab_size and vocab_size > 100_000 else 0
        bpe_size = vocab_size - n_reserved
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=bpe_size,
            special_tokens=list(ck.SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
            min_frequency=2,
        )
        tok.train_from_iterator(texts(), trainer=trainer)
        trained = tok.get_vocab_size()
        if n_reserved:
            tok.add_special_tokens(
                [AddedToken(f"<|reserved_special_token_{i}|>", special=True) for i in range(n_reserved)]
            )
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{ck.BOS_TOKEN} $A",
                    pair=f"{ck.BOS_TOKEN} $A {ck.BOS_TOKEN} $B",
                    special_tokens=[(ck.BOS_TOKEN, ck.BOS_ID)],
                ),
            ]
        )
        (out / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
        (out / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "bos_token": ck.BOS_TOKEN,
                    "eos_token": ck.EOS_TOKEN,
                    "add_bos_token": True,
                },
                indent=2,
            )
            + "\n"
        )
        info = {
            "recipe": "engine.checkpoint.trained_tokenizer_json's, larger corpus",
            "requested_vocab_size": vocab_size,
            "bpe_trained": trained,
            "reserved_specials": n_reserved,
            "vocab_size": tok.get_vocab_size(with_added_tokens=True),
            "corpus_files": len(files),
            "corpus_bytes": sum(os.path.getsize(f) for f in files) + len(CORPUS),
        }
    text = (out / "tokenizer.json").read_text(encoding="utf-8")
    info.update(
        path=str(out / "tokenizer.json"),
        seconds=round(time.perf_counter() - t0, 2),
        sha256=hashlib.sha256(text.encode()).hexdigest()[:16],
    )
    (out / "tokenizer-info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


class Vocab:
    """A tokenizer.json as both engines and the documents need it."""

    def __init__(self, path: str, eos: list[int] | None):
        from tokenizers import Tokenizer

        self.path = path
        self.json = Path(path).read_text(encoding="utf-8")
        self.hf = Tokenizer.from_str(self.json)
        vocab = self.hf.get_vocab(with_added_tokens=True)
        self.size = max(vocab.values()) + 1
        self.encoded = [""] * self.size
        for text, i in vocab.items():
            self.encoded[i] = text
        if not eos:
            cfg = Path(path).with_name("tokenizer_config.json")
            name = json.loads(cfg.read_text()).get("eos_token") if cfg.is_file() else None
            if isinstance(name, dict):
                name = name.get("content")
            eos = (
                [vocab[name]]
                if name in vocab
                else [vocab[n] for n in ("<|end_of_text|>", "</s>") if n in vocab][:1]
            )
        self.eos = list(eos)
        added = json.loads(self.json).get("added_tokens", [])
        self.specials = sorted({a["id"] for a in added if a.get("special")} - set(self.eos))
        self.sha = hashlib.sha256(self.json.encode()).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids


# ---------------------------------------------------------------------------------------------
# the suite


def _nested(depth: int) -> tuple[dict, str, str]:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {
            "type": "object",
            "properties": {"a": schema},
            "required": ["a"],
            "additionalProperties": False,
        }
    valid = '{"a": ' * depth + "1" + "}" * depth
    invalid = '{"a": ' * depth + '"x"' + "}" * depth
    return schema, valid, invalid


def _big_enum(n: int) -> tuple[dict, str, str]:
    rng = random.Random(20000)
    letters = "abcdefghijklmnopqrstuvwxyz"
    values: list[str] = []
    seen: set[str] = set()
    while len(values) < n:
        v = "".join(rng.choice(letters) for _ in range(rng.randint(5, 14))) + f"-{rng.randint(0, 999)}"
        if v not in seen:
            seen.add(v)
            values.append(v)
    return {"type": "string", "enum": values}, json.dumps(values[n // 2]), json.dumps("zz-not-in-enum")


ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "email": {"type": "string", "format": "email"}},
            "required": ["name", "email"],
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "qty": {"type": "integer", "minimum": 1},
                    "price": {"type": "number", "minimum": 0},
                },
                "required": ["sku", "qty", "price"],
            },
        },
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "notes": {"type": "string", "maxLength": 400},
    },
    "required": ["order_id", "customer", "items", "status"],
    "additionalProperties": False,
}
ORDER_VALID = {
    "order_id": "ORD-004217",
    "customer": {"name": "Ada Lovelace", "email": "ada@example.org"},
    "items": [
        {"sku": "KB-101", "qty": 2, "price": 49.5},
        {"sku": "MS-7", "qty": 1, "price": 19.99},
        {"sku": "CBL-USB-C", "qty": 3, "price": 7.25},
    ],
    "status": "shipped",
    "notes": "Leave the parcel at the back door if nobody answers; the dog is friendly but loud. "
    "Invoice to the same address, and please call before delivery on Monday or Tuesday.",
}

TREE_SCHEMA = {
    "$ref": "#/$defs/node",
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "value": {"type": "integer"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
            },
            "required": ["value", "children"],
            "additionalProperties": False,
        }
    },
}
TREE_VALID = {
    "value": 1,
    "children": [{"value": 2, "children": [{"value": 4, "children": []}]}, {"value": 3, "children": []}],
}

LARK_ARITH = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
GBNF_ARITH = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
"""


def _obj(props: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props), **extra}


def suite() -> list[dict]:
    """Cases: kind json_schema / regex / choice / grammar / json_object; valid and invalid documents."""
    d = json.dumps
    cases = [
        dict(
            name="order_realistic",
            kind="json_schema",
            schema=ORDER_SCHEMA,
            valid=d(ORDER_VALID),
            invalid=d({**ORDER_VALID, "status": "lost"}),
        ),
        dict(
            name="nested_objects",
            kind="json_schema",
            schema=_obj(
                {
                    "person": _obj(
                        {
                            "name": {"type": "string"},
                            "address": _obj(
                                {
                                    "city": {"type": "string"},
                                    "geo": _obj({"lat": {"type": "number"}, "lon": {"type": "number"}}),
                                }
                            ),
                        }
                    )
                }
            ),
            valid=d(
                {"person": {"name": "Lin", "address": {"city": "Zurich", "geo": {"lat": 47.37, "lon": 8.54}}}}
            ),
            invalid=d({"person": {"name": "Lin", "address": {"city": "Zurich", "geo": {"lat": "north"}}}}),
        ),
        dict(
            name="array_min_max_items",
            kind="json_schema",
            schema={"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 5},
            valid=d([3, 1, 4, 1]),
            invalid=d([1, 2, 3, 4, 5, 6]),
        ),
        dict(
            name="enum",
            kind="json_schema",
            schema=_obj({"color": {"enum": ["red", "green", "blue"]}}),
            valid=d({"color": "green"}),
            invalid=d({"color": "purple"}),
        ),
        dict(
            name="required_fields",
            kind="json_schema",
            schema=_obj(
                {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"}}, ["a", "b"]
            ),
            valid=d({"a": 1, "b": "x"}),
            invalid=d({"a": 1}),
        ),
        dict(
            name="number_min_max",
            kind="json_schema",
            schema=_obj({"score": {"type": "number", "minimum": 0, "maximum": 100}}),
            valid=d({"score": 42.5}),
            invalid=d({"score": 150}),
        ),
        dict(
            name="integer_min_max",
            kind="json_schema",
            schema=_obj({"n": {"type": "integer", "minimum": -5, "maximum": 1000}}),
            valid=d({"n": 512}),
            invalid=d({"n": 1.5}),
        ),
        dict(
            name="string_pattern",
            kind="json_schema",
            schema=_obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}),
            valid=d({"code": "ABC-123"}),
            invalid=d({"code": "abc-123"}),
        ),
        dict(
            name="format_date_time",
            kind="json_schema",
            schema=_obj({"at": {"type": "string", "format": "date-time"}}),
            valid=d({"at": "2024-01-15T12:30:45Z"}),
            invalid=d({"at": "yesterday"}),
        ),
        dict(
            name="format_email",
            kind="json_schema",
            schema=_obj({"to": {"type": "string", "format": "email"}}),
            valid=d({"to": "alice@example.com"}),
            invalid=d({"to": "not-an-email"}),
        ),
        dict(
            name="anyOf",
            kind="json_schema",
            schema=_obj({"v": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}),
            valid=d({"v": 5}),
            invalid=d({"v": True}),
        ),
        dict(
            name="oneOf",
            kind="json_schema",
            schema={
                "oneOf": [
                    _obj({"kind": {"const": "a"}, "x": {"type": "integer"}}),
                    _obj({"kind": {"const": "b"}, "y": {"type": "string"}}),
                ]
            },
            valid=d({"kind": "b", "y": "hi"}),
            invalid=d({"kind": "c", "y": "hi"}),
        ),
        dict(
            name="ref_defs_recursion",
            kind="json_schema",
            schema=TREE_SCHEMA,
            valid=d(TREE_VALID),
            invalid=d({"value": 1, "children": [{"value": "x", "children": []}]}),
        ),
        dict(
            name="additionalProperties_false",
            kind="json_schema",
            schema=_obj({"a": {"type": "integer"}}, additionalProperties=False),
            valid=d({"a": 1}),
            invalid=d({"a": 1, "b": 2}),
        ),
        dict(
            name="additionalProperties_default",
            kind="json_schema",
            schema=_obj({"a": {"type": "integer"}}),
            valid=d({"a": 1, "extra": "allowed by JSON Schema"}),
            invalid=d({"b": 1}),
        ),
        dict(
            name="property_order_free",
            kind="json_schema",
            schema=_obj({"a": {"type": "integer"}, "b": {"type": "integer"}}),
            valid=d({"b": 2, "a": 1}),
            invalid=d({"a": 1}),
        ),
        dict(
            name="const",
            kind="json_schema",
            schema=_obj({"version": {"const": "v1"}}),
            valid=d({"version": "v1"}),
            invalid=d({"version": "v2"}),
        ),
        dict(
            name="string_min_max_length",
            kind="json_schema",
            schema=_obj({"s": {"type": "string", "minLength": 3, "maxLength": 8}}),
            valid=d({"s": "hello"}),
            invalid=d({"s": "hi"}),
        ),
        dict(name="regex", kind="regex", regex=r"\d{3}-\d{4}", valid="555-1234", invalid="55-1234"),
        dict(name="choice", kind="choice", choices=["yes", "no", "maybe"], valid="maybe", invalid="perhaps"),
        dict(
            name="cfg_arith",
            kind="grammar",
            lark=LARK_ARITH,
            gbnf=GBNF_ARITH,
            valid="(12+3)*4-56/(7+8)",
            invalid="(12+3)*",
        ),
        dict(
            name="json_object",
            kind="json_object",
            valid=d({"any": [1, 2.5, None, True], "nested": {"k": "v"}, "s": "text"}),
            invalid="[1, 2",
        ),
    ]
    schema, valid, invalid = _nested(60)
    cases.append(
        dict(
            name="hostile_depth60",
            kind="json_schema",
            schema=schema,
            valid=valid,
            invalid=invalid,
            hostile=True,
        )
    )
    schema, valid, invalid = _big_enum(20000)
    cases.append(
        dict(
            name="hostile_enum20000",
            kind="json_schema",
            schema=schema,
            valid=valid,
            invalid=invalid,
            hostile=True,
        )
    )
    return cases


def reference_check(case: dict) -> dict:
    """jsonschema's verdict on the case's documents (what 'valid' means here)."""
    if case["kind"] != "json_schema":
        return {}
    import jsonschema

    out = {}
    for which in ("valid", "invalid"):
        try:
            jsonschema.validate(
                json.loads(case[which]), case["schema"], format_checker=jsonschema.FormatChecker()
            )
            out[which] = True
        except jsonschema.ValidationError:
            out[which] = False
    return out


# ---------------------------------------------------------------------------------------------
# engines (one interface)


class CompileError(Exception):
    pass


class LLGuidance:
    name = "llguidance"

    def __init__(self, vocab: Vocab, threads: int):
        import llguidance as llg
        import llguidance.torch as lt

        self.llg, self.lt = llg, lt
        t0 = time.perf_counter()
        self.tok = llg.LLTokenizer(vocab.json, n_vocab=vocab.size, eos_token=vocab.eos)
        self.setup_s = time.perf_counter() - t0
        self.limits = llg.LLParserLimits(verbose_errors=False)
        self.executor = llg.LLExecutor(num_threads=threads)
        self.vocab_size = self.tok.vocab_size

    def grammar(self, case: dict) -> str:
        llg, k = self.llg, case["kind"]
        if k == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(json.dumps(case["schema"]))
        if k == "regex":
            return llg.grammar_from("regex", case["regex"])
        if k == "choice":
            return llg.grammar_from("choice", json.dumps(case["choices"]))
        if k == "grammar":
            return llg.grammar_from("lark", case["lark"])
        if k == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"})
        raise ValueError(k)

    def compile(self, case: dict):
        m = self.llg.LLMatcher(self.tok, self.grammar(case), log_level=0, limits=self.limits)
        if m.is_error():
            raise CompileError(m.get_error())
        return m  # the template; requests deep_copy() it

    def new_matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, bm, idx=0):
        self.lt.fill_next_token_bitmask(m, bm, idx)

    def fill_batch(self, ms, bm):
        self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], bm)

    def consume(self, m, t: int) -> bool:
        return m.consume_token(t)

    def consume_batch(self, ms, toks):
        return self.executor.consume_token_par(list(zip(ms, toks, strict=True)))

    def accepting(self, m) -> bool:
        return m.is_accepting()

    def reset(self, m):
        m.reset()

    def error(self, m) -> str | None:
        return m.get_error() if m.is_error() else None

    def alloc(self, batch: int):
        return self.lt.allocate_token_bitmask(batch, self.vocab_size)


class XGrammar:
    name = "xgrammar"

    def __init__(self, vocab: Vocab, threads: int):
        import xgrammar as xgr

        self.xgr = xgr
        t0 = time.perf_counter()
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(vocab.json)  # what from_huggingface() does
        self.info = xgr.TokenizerInfo(
            vocab.encoded,
            meta["vocab_type"],
            vocab_size=vocab.size,
            stop_token_ids=vocab.eos,
            add_prefix_space=meta["add_prefix_space"],
        )
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads)
        self.setup_s = time.perf_counter() - t0
        self.batcher = xgr.BatchGrammarMatcher(max_threads=threads)
        self.vocab_size = self.info.vocab_size

    def compile(self, case: dict):
        c, k = self.compiler, case["kind"]
        try:
            if k == "json_schema":
                return c.compile_json_schema(json.dumps(case["schema"]))
            if k == "regex":
                return c.compile_regex(case["regex"])
            if k == "choice":
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in case["choices"]))
            if k == "grammar":
                return c.compile_grammar(case["gbnf"])
            if k == "json_object":
                return c.compile_builtin_json_grammar()
        except (RuntimeError, ValueError, self.xgr.InvalidJSONError) as exc:
            raise CompileError(str(exc)) from exc
        raise ValueError(k)

    def new_matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bm, idx=0):
        m.fill_next_token_bitmask(bm, idx)

    def fill_batch(self, ms, bm):
        self.batcher.batch_fill_next_token_bitmask(ms, bm)

    def consume(self, m, t: int) -> bool:
        return m.accept_token(t)

    def consume_batch(self, ms, toks):
        return self.xgr.BatchGrammarMatcher.batch_accept_token(ms, toks)

    def accepting(self, m) -> bool:
        return m.is_completed()

    def reset(self, m):
        m.reset()

    def error(self, m) -> str | None:
        return None  # a refused token is reported by accept_token's False; the matcher stays usable

    def alloc(self, batch: int):
        return self.xgr.allocate_token_bitmask(batch, self.vocab_size)


ENGINES = {"llguidance": LLGuidance, "xgrammar": XGrammar}

# ---------------------------------------------------------------------------------------------
# measuring


def _stats(us: list[float]) -> dict:
    if not us:
        return {}
    s = sorted(us)
    return {
        "n": len(s),
        "mean": round(statistics.fmean(s), 2),
        "p50": round(s[len(s) // 2], 2),
        "p99": round(s[min(len(s) - 1, int(len(s) * 0.99))], 2),
        "max": round(s[-1], 2),
    }


class MaskView:
    def __init__(self, bm, vocab_size: int):
        import numpy as np

        self.np, self.bm, self.v = np, bm, vocab_size
        self.u32 = bm.numpy().view(np.uint32)

    def allowed(self, row: int, tok: int) -> bool:
        return bool((int(self.u32[row, tok >> 5]) >> (tok & 31)) & 1)

    def bits(self, row: int = 0):
        np = self.np
        return np.unpackbits(self.u32[row].view(np.uint8), bitorder="little")[: self.v].astype(bool)


def drive(eng, m, bm, view: MaskView, tokens: list[int], eos: list[int], keep_masks: bool, specials):
    """Feed tokens one by one, the mask before each; returns timings and the verdict."""
    mask_us, consume_us, masks, allowed, special_steps = [], [], [], [], 0
    refused_at = None
    for i, t in enumerate(tokens):
        t0 = time.perf_counter_ns()
        eng.fill(m, bm)
        t1 = time.perf_counter_ns()
        mask_us.append((t1 - t0) / 1e3)
        in_mask = view.allowed(0, t)
        if keep_masks or specials is not None:
            bits = view.bits()
            if keep_masks:
                masks.append(view.np.packbits(bits))
                allowed.append(int(bits.sum()))
            if specials is not None and len(specials) and bits[specials].any():
                special_steps += 1
        t2 = time.perf_counter_ns()
        ok = eng.consume(m, t)
        consume_us.append((time.perf_counter_ns() - t2) / 1e3)
        if not (ok and in_mask):
            refused_at = {
                "index": i,
                "in_mask": in_mask,
                "accepted": bool(ok),
                "error": (eng.error(m) or "")[:300],
            }
            break
    end = {}
    if refused_at is None:
        eng.fill(m, bm)
        if keep_masks:
            masks.append(view.np.packbits(view.bits()))
        end = {"accepting": bool(eng.accepting(m)), "eos_allowed": any(view.allowed(0, e) for e in eos)}
    return {
        "mask_us": mask_us,
        "consume_us": consume_us,
        "refused_at": refused_at,
        "end": end,
        "masks": masks,
        "allowed": allowed,
        "special_steps": special_steps,
    }


def batch_run(eng, compiled, tokens: list[int], batch: int, steps: int) -> dict:
    ms = [eng.new_matcher(compiled) for _ in range(batch)]
    n = len(tokens)
    pos = [(i * n) // batch for i in range(batch)]
    for m, p in zip(ms, pos, strict=True):
        for t in tokens[:p]:
            eng.consume(m, t)
    bm = eng.alloc(batch)
    fill_us, seq_us, consume_us, failures = [], [], [], 0

    def par():
        t0 = time.perf_counter_ns()
        eng.fill_batch(ms, bm)
        fill_us.append((time.perf_counter_ns() - t0) / 1e3)

    def seq():  # the same masks one matcher after another on this thread (the no-pool baseline)
        t0 = time.perf_counter_ns()
        for i, m in enumerate(ms):
            eng.fill(m, bm, i)
        seq_us.append((time.perf_counter_ns() - t0) / 1e3)

    for step in range(steps):
        # a state's first mask is dearer than a repeat (lazily built lexer states), so alternate
        for f in (par, seq) if step % 2 == 0 else (seq, par):
            f()
        t1 = time.perf_counter_ns()
        oks = eng.consume_batch(ms, [tokens[p] for p in pos])
        consume_us.append((time.perf_counter_ns() - t1) / 1e3)
        failures += sum(1 for ok in oks if not ok)
        for i in range(batch):
            pos[i] += 1
            if pos[i] >= n:
                eng.reset(ms[i])
                pos[i] = 0
    st, sq = _stats(fill_us), _stats(seq_us)
    return {
        "batch": batch,
        "steps": steps,
        "fill_us_per_step": st,
        "fill_us_per_mask_mean": round(st["mean"] / batch, 2) if st else None,
        "sequential_us_per_step": sq,
        "sequential_us_per_mask_mean": round(sq["mean"] / batch, 2) if sq else None,
        "consume_us_per_step": _stats(consume_us),
        "consume_failures": failures,
    }


_ENGINE_CACHE: dict = {}


def get_engine(engine: str, vocab_path: str, eos: list[int] | None, threads: int):
    key = (engine, vocab_path)
    if key not in _ENGINE_CACHE:
        vocab = _ENGINE_CACHE.setdefault(("vocab", vocab_path), None) or Vocab(vocab_path, eos)
        _ENGINE_CACHE[("vocab", vocab_path)] = vocab
        _ENGINE_CACHE[key] = ENGINES[engine](vocab, threads)
    return _ENGINE_CACHE[key], _ENGINE_CACHE[("vocab", vocab_path)]


LIMIT_PROBES = (
    {"initial_lexer_fuel": 10_000},
    {"max_grammar_size": 1_000},
    {"max_lexer_states": 500},
    {"step_max_items": 100},
    {"step_lexer_fuel": 1_000},
)


def llg_limits_probe(eng: LLGuidance, vocab: Vocab, case: dict) -> list[dict]:
    """Does a tight LLParserLimits refuse the case, and where (construction or while matching)?"""
    out = []
    grammar = eng.grammar(case)
    for lim in LIMIT_PROBES:
        t0 = time.perf_counter()
        m = eng.llg.LLMatcher(
            eng.tok, grammar, log_level=0, limits=eng.llg.LLParserLimits(verbose_errors=False, **lim)
        )
        row = {"limits": lim, "construct_ms": round((time.perf_counter() - t0) * 1e3, 2)}
        if m.is_error():
            row["refused"] = "at construction: " + m.get_error()[:200]
        else:
            bm = eng.alloc(1)
            for t in vocab.encode(case["valid"]):
                eng.fill(m, bm)
                if not m.consume_token(t):
                    break
            row["refused"] = ("while matching: " + m.get_error()[:200]) if m.is_error() else None
        out.append(row)
    return out


def run_unit(
    engine: str, vocab_path: str, eos, threads: int, case: dict, cfg: dict, on_compiled=None
) -> dict:
    """Everything for one engine x tokenizer x case. Masks of the cold pass come back for comparison."""
    eng, vocab = get_engine(engine, vocab_path, eos, threads)
    res: dict = {
        "engine": engine,
        "case": case["name"],
        "kind": case["kind"],
        "hostile": bool(case.get("hostile")),
    }
    t0 = time.perf_counter()
    try:
        compiled = eng.compile(case)
    except CompileError as exc:
        res.update(
            compile_ok=False, compile_ms=round((time.perf_counter() - t0) * 1e3, 3), error=str(exc)[:500]
        )
        return res
    res["compile_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
    t0 = time.perf_counter()
    try:
        eng.compile(case)
        res["compile2_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
    except CompileError:
        res["compile2_ms"] = None
    res["compile_ok"] = True
    if engine == "xgrammar":
        res["compiled_bytes"] = compiled.memory_size_bytes
    if on_compiled:
        on_compiled(dict(res))
    t0 = time.perf_counter_ns()
    m = eng.new_matcher(compiled)
    res["new_matcher_us"] = round((time.perf_counter_ns() - t0) / 1e3, 2)

    tokens_full = vocab.encode(case["valid"])
    tokens = tokens_full[: cfg["max_tokens"]]
    res["doc_tokens"], res["timed_tokens"] = len(tokens_full), len(tokens)
    bm = eng.alloc(1)
    view = MaskView(bm, eng.vocab_size)
    specials = vocab.specials if vocab.specials else None
    import numpy as np

    specials = np.array(specials) if specials else None
    cold = drive(eng, m, bm, view, tokens, vocab.eos, keep_masks=True, specials=specials)
    res["first_mask_us"] = round(cold["mask_us"][0], 2) if cold["mask_us"] else None
    res["single_cold"] = _stats(cold["mask_us"])
    res["special_token_steps"] = cold["special_steps"]
    masks = cold["masks"]
    eng.reset(m)
    warm = drive(eng, m, bm, view, tokens, vocab.eos, keep_masks=False, specials=None)
    res["single_warm"] = _stats(warm["mask_us"])
    # where the time goes: steps that allow few tokens (structure) vs most of the vocabulary (free text)
    res["allowed_per_step"] = cold["allowed"]
    res["warm_mask_us_steps"] = [round(x, 1) for x in warm["mask_us"]]
    pairs = list(zip(cold["allowed"], warm["mask_us"], strict=False))
    res["warm_by_allowed"] = {
        "few_lt100": _stats([u for a, u in pairs if a < 100]),
        "most_gt_half": _stats([u for a, u in pairs if a > eng.vocab_size // 2]),
    }
    res["consume_us"] = _stats(warm["consume_us"])
    if cold["refused_at"]:
        res["valid_refused_at"] = cold["refused_at"]
    # coverage on the whole document (untimed past max_tokens)
    m2 = eng.new_matcher(compiled)
    full = drive(eng, m2, bm, view, tokens_full, vocab.eos, keep_masks=False, specials=None)
    res["accepts_valid"] = (
        full["refused_at"] is None
        and full["end"].get("accepting", False)
        and full["end"].get("eos_allowed", False)
    )
    if full["refused_at"] is not None:
        res["valid_refused_at"] = full["refused_at"]
    elif not res["accepts_valid"]:
        res["valid_end"] = full["end"]
    if case.get("invalid") is not None:
        m3 = eng.new_matcher(compiled)
        bad = drive(
            eng, m3, bm, view, vocab.encode(case["invalid"]), vocab.eos, keep_masks=False, specials=None
        )
        res["rejects_invalid"] = bad["refused_at"] is not None or not (
            bad["end"].get("accepting") and bad["end"].get("eos_allowed")
        )
    res["batches"] = []
    if res["accepts_valid"] and tokens:
        for b in cfg["batches"]:
            res["batches"].append(batch_run(eng, compiled, tokens, b, cfg["batch_steps"]))
    if engine == "llguidance" and case.get("hostile"):
        res["limits_probe"] = llg_limits_probe(eng, vocab, case)
    res["_masks"] = masks
    return res


def _child(q, *args):
    try:
        q.put(("done", run_unit(*args, on_compiled=lambda r: q.put(("compiled", r)))))
    except BaseException as exc:  # noqa: BLE001 - report, whatever it was
        q.put(
            (
                "done",
                {
                    "engine": args[0],
                    "case": args[4]["name"],
                    "compile_ok": False,
                    "error": f"{type(exc).__name__}: {exc}",
                },
            )
        )


def run_isolated(engine, vocab_path, eos, threads, case, cfg, timeout: float) -> dict:
    """A hostile case in a child process: a hang or a crash is a result, not the end of the run."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q, engine, vocab_path, eos, threads, case, cfg))
    t0 = time.perf_counter()
    p.start()
    res, partial = None, None
    while res is None:
        try:
            what, r = q.get(timeout=max(0.1, timeout - (time.perf_counter() - t0)))
        except Exception:  # queue.Empty: out of time
            break
        if what == "compiled":
            partial = r
        else:
            res = r
    p.join(5)
    if p.is_alive():
        p.kill()
        p.join()
    if res is None and partial is not None:
        res = {
            **partial,
            "error": f"compiled, but the mask runs did not finish within {timeout:.0f} s; killed",
        }
    elif res is None:
        res = {
            "engine": engine,
            "case": case["name"],
            "compile_ok": False,
            "hostile": True,
            "error": f"no compile within {timeout:.0f} s (exit code {p.exitcode}); killed",
        }
    res["isolated_wall_s"] = round(time.perf_counter() - t0, 2)
    return res


# ---------------------------------------------------------------------------------------------
# report


def _fmt(x, nd=1):
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def _batch(r, b, key="fill_us_per_step"):
    for x in r.get("batches", []):
        if x["batch"] == b:
            return x[key]["p50"] if key.endswith("step") else x[key]
    return None


def rows_for(results: list[dict], batches: list[int]) -> list[list]:
    rows = []
    for r in results:
        ok = r.get("compile_ok")
        rows.append(
            [
                r["case"],
                r["engine"],
                _fmt(r.get("compile_ms"), 2),
                _fmt(r.get("compile2_ms"), 3),
                _fmt(r.get("new_matcher_us")),
                _fmt(r.get("first_mask_us")),
                _fmt((r.get("single_warm") or {}).get("p50")),
                _fmt((r.get("single_warm") or {}).get("p99")),
                _fmt((r.get("single_cold") or {}).get("mean")),
                *[_fmt(_batch(r, b)) for b in batches],
                "yes" if ok else "NO",
                "yes" if r.get("accepts_valid") else ("-" if not ok else "NO"),
                {True: "yes", False: "NO", None: "-"}[r.get("rejects_invalid")],
                _fmt(r.get("mask_agree_pct")),
            ]
        )
    return rows


HEADERS_BASE = [
    "case",
    "engine",
    "compile ms",
    "2nd compile ms",
    "new matcher us",
    "1st mask us",
    "mask p50 us",
    "mask p99 us",
    "cold mean us",
]
HEADERS_TAIL = ["compiles", "accepts valid", "rejects invalid", "same mask %"]


def summary(results: list[dict], batches: list[int]) -> list[list]:
    """Per engine: medians over the non-hostile cases both engines accept."""
    both = {r["case"] for r in results if r.get("accepts_valid") and not r.get("hostile")}
    for r in results:
        if not r.get("accepts_valid"):
            both.discard(r["case"])
    out = []
    for engine in ENGINES:
        rs = [r for r in results if r["engine"] == engine and r["case"] in both]
        if not rs:
            continue

        def med(f, rs=rs):
            vals = [v for v in (f(r) for r in rs) if v is not None]
            return round(statistics.median(vals), 2) if vals else None

        out.append(
            [
                engine,
                len(rs),
                med(lambda r: r["compile_ms"]),
                med(lambda r: r["compile2_ms"]),
                med(lambda r: r["new_matcher_us"]),
                med(lambda r: r["first_mask_us"]),
                med(lambda r: r["single_warm"]["mean"]),
                med(lambda r: r["single_warm"]["p50"]),
                med(lambda r: r["single_warm"]["p99"]),
                med(lambda r: r["warm_by_allowed"]["few_lt100"].get("p50")),
                med(lambda r: r["warm_by_allowed"]["most_gt_half"].get("p50")),
                *[med(lambda r, b=b: _batch(r, b, "fill_us_per_mask_mean")) for b in batches],
                *[med(lambda r, b=b: _batch(r, b, "sequential_us_per_mask_mean")) for b in batches],
                *[med(lambda r, b=b: _batch(r, b)) for b in batches],
            ]
        )
    return out


def summary_headers(batches):
    return (
        [
            "engine",
            "cases",
            "compile ms",
            "2nd compile ms",
            "new matcher us",
            "1st mask us",
            "mask mean us",
            "mask p50 us",
            "mask p99 us",
            "p50 us <100 allowed",
            "p50 us >half allowed",
        ]
        + [f"b{b} us/mask" for b in batches]
        + [f"b{b} seq us/mask" for b in batches]
        + [f"b{b} us/step p50" for b in batches]
    )


def table(rows, headers, fmt="github"):
    try:
        from tabulate import tabulate

        return tabulate(rows, headers=headers, tablefmt=fmt, disable_numparse=True)
    except ImportError:
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for p in ("llguidance", "xgrammar", "torch", "tokenizers", "numpy"):
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = None
    return out


def cmd_run(args) -> int:
    import numpy as np

    cases = [c for c in suite() if not args.cases or c["name"] in args.cases.split(",")]
    engines = [e for e in args.engines.split(",") if e]
    batches = [int(b) for b in args.batches.split(",") if b]
    cfg = {"max_tokens": args.max_tokens, "batches": batches, "batch_steps": args.batch_steps}
    import_errors = {}
    for e in list(engines):
        try:
            __import__(e)
        except Exception as exc:  # noqa: BLE001 - say so and compare what we can
            import_errors[e] = f"{type(exc).__name__}: {exc}"
            engines.remove(e)
    out = {
        "what": "grammar engines: llguidance vs xgrammar (CPU)",
        "date": dt.date.today().isoformat(),
        "command": " ".join([Path(sys.executable).as_posix(), *sys.argv]),
        "commit": git_commit(),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
        "versions": versions(),
        "import_errors": import_errors,
        "config": {**cfg, "threads": args.threads},
        "reference": {c["name"]: reference_check(c) for c in cases},
        "tokenizers": [],
    }
    try:
        import llguidance

        lim = llguidance.LLParserLimits()
        out["llguidance_default_limits"] = {
            k: getattr(lim, k)
            for k in (
                "max_items_in_row",
                "initial_lexer_fuel",
                "step_lexer_fuel",
                "step_max_items",
                "max_lexer_states",
                "max_grammar_size",
                "precompute_large_lexemes",
                "verbose_errors",
            )
        }
    except ImportError:
        pass
    try:
        import xgrammar

        out["xgrammar_max_recursion_depth"] = xgrammar.get_max_recursion_depth()
    except ImportError:
        pass
    t_start = time.perf_counter()
    for path in args.tokenizer:
        vocab = Vocab(path, args.eos)
        info_file = Path(path).with_name("tokenizer-info.json")
        tinfo = {
            "path": path,
            "vocab_size": vocab.size,
            "eos": vocab.eos,
            "specials_non_eos": len(vocab.specials),
            "sha256": vocab.sha,
            "made": json.loads(info_file.read_text()) if info_file.is_file() else None,
            "engine_setup_s": {},
            "results": [],
        }
        tinfo["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
        print(f"\n== {path}: {vocab.size} ids, eos {vocab.eos}, load {tinfo['loadavg_start']}", flush=True)
        for e in engines:
            eng, _ = get_engine(e, path, args.eos, args.threads)
            tinfo["engine_setup_s"][e] = round(eng.setup_s, 3)
            warm = {"name": "warmup", "kind": "json_schema", "schema": {"type": "object"}, "valid": "{}"}
            t0 = time.perf_counter()
            wm = eng.new_matcher(eng.compile(warm))  # process-wide first-use costs, kept out of the cases
            eng.fill(wm, eng.alloc(1))
            tinfo.setdefault("warmup_ms", {})[e] = round((time.perf_counter() - t0) * 1e3, 2)
            print(
                f"   {e}: tokenizer setup {eng.setup_s:.2f} s, warm-up {tinfo['warmup_ms'][e]} ms", flush=True
            )
        for case in cases:
            unit = {}
            for e in engines:
                t0 = time.perf_counter()
                if case.get("hostile") and not args.no_isolate:
                    r = run_isolated(e, path, args.eos, args.threads, case, cfg, args.hostile_timeout)
                else:
                    r = run_unit(e, path, args.eos, args.threads, case, cfg)
                unit[e] = r
                print(
                    f"   {case['name']:<30} {e:<10} compile {_fmt(r.get('compile_ms'), 2):>9} ms  "
                    f"mask p50 {_fmt((r.get('single_warm') or {}).get('p50')):>8} us  "
                    f"valid {r.get('accepts_valid')}  invalid-refused {r.get('rejects_invalid')}  "
                    f"({time.perf_counter() - t0:.1f} s)"
                    f"{'  ERR ' + r['error'][:120] if r.get('error') else ''}",
                    flush=True,
                )
            if len(unit) == 2:
                a, b = (unit[e].get("_masks") or [] for e in engines)
                n = min(len(a), len(b))
                if n:
                    same = sum(1 for i in range(n) if np.array_equal(a[i], b[i]))
                    diffs = [int(np.unpackbits(a[i] ^ b[i]).sum()) for i in range(n)]
                    for e in engines:
                        unit[e]["mask_agree_pct"] = round(100.0 * same / n, 1)
                        unit[e]["mask_diff_tokens_mean"] = round(statistics.fmean(diffs), 1)
                    only = {
                        e: int(sum(np.unpackbits(m[i] & ~o[i]).sum() for i in range(n)))
                        for e, m, o in ((engines[0], a, b), (engines[1], b, a))
                    }
                    for e in engines:
                        unit[e]["allowed_only_by_this_engine_token_steps"] = only[e]
                    toks = vocab.encode(case["valid"])[: args.max_tokens]
                    examples = []
                    for i in range(n):
                        if diffs[i] and len(examples) < 3:
                            x, y = np.unpackbits(a[i])[: vocab.size], np.unpackbits(b[i])[: vocab.size]
                            ex = {"step": i, "after": vocab.hf.decode(toks[:i])[-40:]}
                            for e, mine, other in ((engines[0], x, y), (engines[1], y, x)):
                                ids = np.nonzero(mine & (1 - other))[0]
                                ex[f"only_{e}"] = {
                                    "count": int(len(ids)),
                                    "sample": [f"{int(j)}:{vocab.hf.id_to_token(int(j))}" for j in ids[:6]],
                                }
                            examples.append(ex)
                    unit[engines[0]]["mask_diff_examples"] = examples
            for e in engines:
                unit[e].pop("_masks", None)
                tinfo["results"].append(unit[e])
        tinfo["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        out["tokenizers"].append(tinfo)
        print()
        print(
            table(
                rows_for(tinfo["results"], batches),
                HEADERS_BASE + [f"b{b} us/step p50" for b in batches] + HEADERS_TAIL,
            )
        )
        print()
        print(table(summary(tinfo["results"], batches), summary_headers(batches)))
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    dest = Path(args.out)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "grammar-engines.json").write_text(json.dumps(out, indent=1) + "\n")
    (dest / "grammar-engines.md").write_text(markdown(out, batches))
    print(f"\nwrote {dest / 'grammar-engines.json'} and grammar-engines.md ({out['wall_s']} s)")
    return 0


def markdown(out: dict, batches: list[int]) -> str:
    lines = [
        f"# Grammar engines on CPU: llguidance {out['versions'].get('llguidance')} vs "
        f"xgrammar {out['versions'].get('xgrammar')}",
        "",
        f"{out['date']}, {out['host']['cpus']} CPUs, threads {out['config']['threads']}, "
        f"at most {out['config']['max_tokens']} tokens per document, "
        f"batches {batches} for {out['config']['batch_steps']} steps.",
        "",
        "Command:",
        "",
        "```",
        out["command"],
        "```",
        "",
        f"commit: {out['commit']}",
        "",
    ]
    if out["import_errors"]:
        lines += [f"Not importable: {out['import_errors']}", ""]
    for t in out["tokenizers"]:
        lines += [
            f"## {t['vocab_size']} ids ({Path(t['path']).parent.name}), eos {t['eos']}",
            "",
            f"Load average (1/5/15 min) at start {t.get('loadavg_start')}, at end {t.get('loadavg_end')} "
            f"on {out['host']['cpus']} CPUs.",
            "",
            "Tokenizer setup s: " + ", ".join(f"{k} {v}" for k, v in t["engine_setup_s"].items()),
            "",
            "Medians over the non-hostile cases both engines accept (us per mask of a batch = the "
            "batch step / B):",
            "",
            table(summary(t["results"], batches), summary_headers(batches)),
            "",
            "Per case:",
            "",
            table(
                rows_for(t["results"], batches),
                HEADERS_BASE + [f"b{b} us/step p50" for b in batches] + HEADERS_TAIL,
            ),
            "",
        ]
        errs = [r for r in t["results"] if r.get("error") or r.get("valid_refused_at")]
        if errs:
            lines += ["Errors and refusals:", ""]
            for r in errs:
                why = r.get("error") or json.dumps(r.get("valid_refused_at"))
                lines.append(f"- {r['case']} / {r['engine']}: {why[:300]}")
            lines.append("")
        probes = [r for r in t["results"] if r.get("limits_probe")]
        if probes:
            lines += ["llguidance with one tight LLParserLimits field (defaults otherwise):", ""]
            for r in probes:
                for p in r["limits_probe"]:
                    lines.append(
                        f"- {r['case']} {p['limits']}: {p['refused'] or 'not refused'}"
                        f" ({p['construct_ms']} ms to construct)"
                    )
            lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenizer", help="write a tokenizer.json with the project's recipe")
    t.add_argument("--out", required=True)
    t.add_argument("--vocab-size", type=int, default=128256)
    t.add_argument("--preset", choices=["tiny"], help="the tiny preset's own tokenizer (1024 ids)")
    r = sub.add_parser("run", help="run the benchmark")
    r.add_argument("--tokenizer", action="append", required=True, help="PATH/tokenizer.json (repeatable)")
    r.add_argument(
        "--eos",
        type=int,
        action="append",
        help="EOS id (repeatable; default: tokenizer_config.json's eos_token)",
    )
    r.add_argument("--engines", default="llguidance,xgrammar")
    r.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    r.add_argument("--max-tokens", type=int, default=200)
    r.add_argument("--batches", default="16,64")
    r.add_argument("--batch-steps", type=int, default=40)
    r.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    r.add_argument("--hostile-timeout", type=float, default=180.0)
    r.add_argument("--no-isolate", action="store_true", help="run hostile cases in-process")
    r.add_argument("--out", required=True, help="directory for grammar-engines.json / .md")
    args = ap.parse_args(argv)
    if args.cmd == "tokenizer":
        info = make_tokenizer(Path(args.out), None if args.preset else args.vocab_size, args.preset)
        print(json.dumps(info, indent=2))
        return 0
    return cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
