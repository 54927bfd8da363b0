"""Tensor-parallel groups as threads of the test process (gloo over a ``HashStore``).

``run_ranks(size, fn)`` calls ``fn(group)`` on ``size`` threads, one ``TPGroup`` each, and returns
the results in rank order (re-raising the first failure); ``run_threads(size, fn)`` calls ``fn(rank)``.
``tp_generate`` runs an ``LLMEngine`` on rank 0 and ``TPFollower``s on the others, exactly as a worker's
processes do.
"""

from __future__ import annotations

import threading

import torch.distributed as dist

from engine.engine import EngineConfig, LLMEngine
from engine.tp_group import TPGroup
from engine.tp_worker import TPFollower

TIMEOUT_S = 60.0


def run_threads(size: int, fn) -> list:
    """``fn(rank)`` on ``size`` threads; the results in rank order (re-raising the first failure). A
    thread still running after twice ``TIMEOUT_S`` fails the test as a hung rank."""
    results: list = [None] * size
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 2)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a tensor parallel rank hung"
    return results


def run_ranks(size: int, fn) -> list:
    store = dist.HashStore()
    return run_threads(size, lambda rank: fn(TPGroup(rank=rank, size=size, store=store, device="cpu",
                                                     timeout_s=TIMEOUT_S)))


def tp_engine_run(size: int, config: EngineConfig, body, **engine_kwargs):
    """``body(engine)`` on rank 0's ``LLMEngine``; returns (its result, the followers' step counts,
    rank 0's step count). Every rank's leak check runs here: rank 0's ``leak_report`` must be None."""

    def rank(group: TPGroup):
        if group.rank == 0:
            engine = LLMEngine(config, tp=group, **engine_kwargs)
            try:
                out = body(engine)
                assert engine.leak_report() is None, engine.leak_report()
                return out, engine.stats.steps
            finally:
                engine.close()
        follower = TPFollower(config, group)
        follower.run()
        return follower.steps

    results = run_ranks(size, rank)
    (out, steps), follower_steps = results[0], results[1:]
    return out, follower_steps, steps
