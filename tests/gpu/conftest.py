"""GPU tests: every test here is marked ``gpu`` and skips, with the reason, where CUDA is missing.

That skip is the only one allowed. On the device machine (``bash bench/device_run.sh tests``) CUDA is
there, so every test runs for real; a missing flashinfer or nixl there is a failure, not a skip.
"""

from __future__ import annotations

import pytest
import torch

NO_CUDA = (
    "no CUDA device on this machine (GPU tests run on the device machine: bash bench/device_run.sh tests)"
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason=NO_CUDA))
