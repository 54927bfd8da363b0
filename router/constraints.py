"""The router's check of a structured-output constraint, before any worker sees the request.

A constraint that cannot compile (a malformed schema, regex or grammar, or one over llguidance's
limits) is refused here with its reason (INVALID_ARGUMENT, HTTP 400), so a client learns it at once
and no worker spends a slot on it. The check compiles the grammar without the vocabulary
(``engine.grammar.spec.validate``) on the admission executor, never on the event loop, and gives up
after ``PDSERVE_GRAMMAR_COMPILE_TIMEOUT_S``: a hostile constraint costs its sender a refusal and the
other requests nothing. Results are remembered (an LRU of ``CACHE_SIZE``), and a check already running
for the same constraint is awaited rather than repeated, so a client retrying a hostile schema cannot
pile up compilations.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from concurrent.futures import Executor

from engine.grammar.spec import GrammarError, validate
from pdserve.sampling import Constraint
from pdserve.settings import grammar_compile_timeout_s

CACHE_SIZE = 1024
_checked: OrderedDict[tuple, GrammarError | None] = OrderedDict()
_running: dict[tuple, asyncio.Future] = {}


def _remember(key: tuple, result: GrammarError | None) -> None:
    _checked[key] = result
    while len(_checked) > CACHE_SIZE:
        _checked.popitem(last=False)


def _validate(constraint: Constraint) -> GrammarError | None:
    try:
        validate(constraint)
    except GrammarError as exc:
        return exc
    return None


async def check_constraint(constraint: Constraint, executor: Executor | None = None) -> None:
    """GrammarError (a ValueError) when ``constraint`` cannot be compiled or its check outlasts the
    bound; returns at once for a constraint checked before."""
    key = constraint.key
    if key in _checked:
        _checked.move_to_end(key)
        found = _checked[key]
        if found is not None:
            raise found
        return
    fut = _running.get(key)
    if fut is None:
        loop = asyncio.get_running_loop()
        fut = asyncio.ensure_future(loop.run_in_executor(executor, _validate, constraint))
        _running[key] = fut

        def done(f: asyncio.Future) -> None:
            _running.pop(key, None)
            if not f.cancelled() and f.exception() is None:
                _remember(key, f.result())

        fut.add_done_callback(done)
    timeout = grammar_compile_timeout_s()
    try:
        result = await asyncio.wait_for(asyncio.shield(fut), timeout)
    except TimeoutError:
        raise GrammarError(f"the {constraint.kind} constraint did not compile within {timeout:g} s") from None
    if result is not None:
        raise result
