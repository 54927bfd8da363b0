"""A failure of a TCP transfer into GPU memory is told only once no frame of it can still be copied into
the blocks (tests/unit/test_kvtransfer_abort_inflight.py on a CUDA cache: staged through page-locked
buffers, the flush of a frame that completes after the ack dropped)."""

import pytest

from tests.unit.test_kvtransfer_abort_inflight import frame_after_ack


@pytest.mark.parametrize("how", ["abort", "link release", "deadline"])
def test_a_frame_still_arriving_after_the_ack_never_lands_in_freed_gpu_blocks(how):
    frame_after_ack(how, "cuda", staged=False)
