"""Fixtures for the unit tests (shared checkpoints live in ``tests/conftest.py``)."""

import pytest
import torch


@pytest.fixture(scope="module")
def torch_single_thread():
    """Run a module's tiny-model forwards on one intra-op thread.

    Their matrices are far too small to gain from more threads, and on a shared, busy CI machine
    several spinning OpenMP threads per process slow every op down by an order of magnitude.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def engine_factory():
    """``make(model, **config)``: an ``LLMEngine`` of ``EngineConfig(**config)`` on an in-memory model. Every
    engine made ends with the leak check: no request held, no step in flight, every block's reference
    count zero (free or in the evictable prefix cache)."""
    from engine.engine import EngineConfig, LLMEngine

    engines = []

    def make(model, /, **config):
        """``model=None``: the engine loads ``config["model"]`` (a directory) with its tokenizer."""
        engine = LLMEngine(EngineConfig(**config), model=model)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert engine.leak_report() is None, engine.leak_report()
        bm = engine.block_manager
        assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
        engine.close()
