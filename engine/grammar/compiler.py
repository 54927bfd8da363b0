"""The vocabulary as llguidance sees it, and compiled grammars cached by their text.

One ``GrammarCompiler`` per engine. Its ``LLTokenizer`` is built from the model's ``tokenizer.json`` on
first use (about a second at a 128k vocabulary), with the model's vocabulary size (logit rows beyond the
tokenizer's ids are never allowed) and its EOS ids (allowed exactly where the grammar may end).

``compile`` builds a matcher for a constraint and keeps it as a template: a request starts from a
``deep_copy`` of it, so a grammar is compiled once per worker however many requests use it (an LRU of
``capacity`` grammars; failures are remembered too, so a hostile constraint sent again costs nothing).
It is thread-safe and meant to run off the engine thread: ``engine.async_engine`` compiles a request's
constraint on its own thread, under a time bound, before the request reaches the engine, whose
``start`` then finds it cached.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from engine.grammar.spec import GrammarError, grammar_text, limits
from engine.grammar.state import GrammarState
from pdserve.sampling import Constraint


class GrammarCompiler:
    def __init__(self, tokenizer, *, vocab_size: int, eos_token_ids, capacity: int = 256) -> None:
        """``tokenizer``: ``engine.tokenizer.Tokenizer`` (or anything with ``to_json()``); None: a model
        without a tokenizer, which cannot serve constraints."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids)
        self.capacity = capacity
        self._ll = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, object] = OrderedDict()  # key -> LLMatcher template | GrammarError
        self.compiled = 0  # grammars compiled (misses)
        self.hits = 0

    def ll_tokenizer(self):
        if self._ll is None:
            if self.tokenizer is None:
                raise GrammarError("this model has no tokenizer: structured output needs one")
            import llguidance

            ll = llguidance.LLTokenizer(self.tokenizer.to_json(), n_vocab=self.vocab_size,
                                        eos_token=self.eos_token_ids or None)
            with self._lock:
                if self._ll is None:
                    self._ll = ll
        return self._ll

    def cached(self, constraint: Constraint) -> bool:
        with self._lock:
            return constraint.key in self._cache

    def compile(self, constraint: Constraint):
        """The template matcher of ``constraint`` (compiled now or found); GrammarError when it cannot be
        compiled."""
        key = constraint.key
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                self.hits += 1
        if found is None:
            found = self._build(constraint)
            with self._lock:
                self.compiled += 1
                self._cache[key] = found
                while len(self._cache) > self.capacity:
                    self._cache.popitem(last=False)
        if isinstance(found, GrammarError):
            raise found
        return found

    def _build(self, constraint: Constraint):
        import llguidance

        try:
            grammar = grammar_text(constraint)
            matcher = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0, limits=limits())
        except GrammarError as exc:
            return exc
        if matcher.is_error():
            return GrammarError(f"the {constraint.kind} constraint cannot be compiled: {matcher.get_error()}")
        # The lexer is built lazily: a grammar over the limits at this vocabulary (a huge enum) fails at its
        # first mask, so one is computed here, where a failure is still the request's 400, not its error
        # mid-answer.
        probe = matcher.deep_copy()
        probe.compute_bitmask()
        if probe.is_error():
            return GrammarError(f"the {constraint.kind} constraint is too complex for this vocabulary: "
                                f"{probe.get_error()}")
        return matcher

    def start(self, constraint: Constraint) -> GrammarState:
        """A request's own matcher at the grammar's start."""
        return GrammarState(self.compile(constraint).deep_copy(), constraint.kind)
