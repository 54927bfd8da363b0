"""Layer-wise KV push on CUDA: layer events recorded on the compute stream, waited for by the
worker's EventWaiter thread, then pushed (TCP staged through host memory; NIXL straight from VRAM).
Same scenario as tests/unit/test_prefill_stream.py (greedy parity, cached prefixes, leak checks)."""

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_prefill_stream import parity  # noqa: E402


@pytest.mark.parametrize("kind", ["tcp", "nixl"])
def test_streamed_prefill_on_cuda_matches_one_engine(kind):
    rig = asyncio.run(asyncio.wait_for(parity(kind, True, device="cuda"), 300))
    assert rig.worker._waiter is not None  # the CUDA events went through the waiter thread
