"""The receiver's check of a DATA frame's segments (kvtransfer/rx_tcp.py ``_mark``): a run of blocks
consecutive in the reservation is checked as one slice, anything else block by block, with the same
refusals either way."""

from __future__ import annotations

import asyncio

import pytest

from kvtransfer.errors import InvalidTransfer
from kvtransfer.expectation import Expectation
from kvtransfer.rx_tcp import _mark


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def expectation(loop, dst, layers=2) -> Expectation:
    return Expectation("r", tuple(dst), layers, 64, loop)


def test_runs_and_scattered_blocks_mark_the_same_cells(loop):
    exp = expectation(loop, [10, 11, 12, 13, 6, 9, 7])
    assert _mark(exp, [[0, 10, 4]]) == 4  # consecutive in the reservation too: one slice
    assert _mark(exp, [[0, 6, 2]]) == 2  # 6, 7 sit at positions 4 and 6: block by block
    assert _mark(exp, [[1, 9, 1], [1, 11, 2]]) == 3
    assert list(exp.written) == [1, 1, 1, 1, 1, 0, 1] + [0, 1, 1, 0, 0, 1, 0]


@pytest.mark.parametrize("segs, message", [
    ([[0, 10, 5]], "block 14 is not reserved"),           # a run running past the reservation
    ([[0, 5, 1]], "block 5 is not reserved"),
    ([[2, 10, 1]], "outside 2 layers"),
    ([[0, 10, 0]], "outside 2 layers"),
    ([[0, 10, "4"]], "malformed segment"),
    ([[0, 10, True]], "malformed segment"),
    ([[0, 10, 3], [0, 12, 2]], r"\(layer 0, block 12\) of 'r' sent twice"),  # two segments of one frame
    ([[0, 11, 1], [0, 10, 3]], r"\(layer 0, block 11\) of 'r' sent twice"),
])
def test_refusals(loop, segs, message):
    exp = expectation(loop, [10, 11, 12, 13])
    with pytest.raises(InvalidTransfer, match=message):
        _mark(exp, segs)


def test_a_block_written_by_an_earlier_frame_is_refused_in_a_later_run(loop):
    exp = expectation(loop, [10, 11, 12, 13])
    _mark(exp, [[1, 12, 1]])
    with pytest.raises(InvalidTransfer, match=r"\(layer 1, block 12\) of 'r' sent twice"):
        _mark(exp, [[1, 10, 4]])


def test_a_huge_count_is_refused_at_once(loop):
    """A peer's segment claiming a billion blocks is refused at the first one past the reservation,
    without building anything of that size."""
    exp = expectation(loop, [10, 11, 12, 13])
    with pytest.raises(InvalidTransfer, match="block 14 is not reserved"):
        _mark(exp, [[0, 10, 10**9]])
