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
