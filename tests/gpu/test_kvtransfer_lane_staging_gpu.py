"""Staged TCP transfers between CUDA caches with the staging copies on the connections' own threads
and on the event loop (tests/unit/test_kvtransfer_lane_staging.py on the GPU): byte-exact, checksummed,
and with lane staging no staging call on the event loop."""

import pytest

from tests.unit.test_kvtransfer_lane_staging import staged_in_flight


@pytest.mark.parametrize("lane_staging", [True, False], ids=["lanes", "loop"])
def test_staged_gpu_transfers_in_flight_are_byte_exact_and_staged_where_configured(lane_staging):
    staged_in_flight("cuda", lane_staging)
