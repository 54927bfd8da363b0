"""The router's check of a structured-output constraint, before any worker sees the request.

A constraint that cannot compile (a malformed schema, regex or grammar, or one over llguidance's
limits at this model's vocabulary) is refused here with its reason (INVALID_ARGUMENT, HTTP 400), so a
client learns it at once and no worker spends a slot on it. The check compiles the grammar against the
model's vocabulary and computes its first mask, as a worker will (``engine.grammar.GrammarCompiler``,
one per model), on the admission executor, never on the event loop, and gives up after
``PDSERVE_GRAMMAR_COMPILE_TIMEOUT_S``: a hostile constraint costs its sender a refusal and the other
requests nothing. Results are remembered (the compiler's LRU), and a check already running for the same
constraint is awaited rather than repeated, so a client retrying a hostile schema cannot pile up
compilations.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from engine.grammar import GrammarCompiler, GrammarError
from pdserve.sampling import Constraint
from pdserve.settings import grammar_compile_timeout_s

_compilers: dict[int, GrammarCompiler] = {}  # id(tokenizer) -> its compiler
_running: dict[tuple, asyncio.Future] = {}


def compiler_for(tokenizer, vocab_size: int, eos_token_ids) -> GrammarCompiler:
    """The router's compiler of a model (its tokenizer, vocabulary size and EOS ids), made once."""
    found = _compilers.get(id(tokenizer))
    if found is None or found.tokenizer is not tokenizer:
        found = _compilers[id(tokenizer)] = GrammarCompiler(tokenizer, vocab_size=vocab_size,
                                                            eos_token_ids=eos_token_ids)
    return found


async def check_constraint(constraint: Constraint, compiler: GrammarCompiler,
                           executor: Executor | None = None) -> None:
    """GrammarError (a ValueError) when ``constraint`` cannot be compiled or its check outlasts the
    bound; returns at once for a constraint compiled before."""
    key = constraint.key
    if compiler.cached(constraint):
        compiler.compile(constraint)  # the cached template, or its cached error
        return
    fut = _running.get(key)
    if fut is None:
        loop = asyncio.get_running_loop()
        fut = asyncio.ensure_future(loop.run_in_executor(executor, compiler.compile, constraint))
        _running[key] = fut
        fut.add_done_callback(lambda _f: _running.pop(key, None))
    timeout = grammar_compile_timeout_s()
    try:
        await asyncio.wait_for(asyncio.shield(fut), timeout)
    except TimeoutError:
        raise GrammarError(f"the {constraint.kind} constraint did not compile within {timeout:g} s") from None
