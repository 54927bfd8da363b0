"""What a failed Prefill call means for the request: the decode side losing the request re-places it."""

from __future__ import annotations

import grpc
import pytest

from router.pipeline import RETRYABLE, _prefill_failed


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@pytest.mark.parametrize("code, details", [
    (grpc.StatusCode.ABORTED, "transfer aborted by receiver: released by receiver"),
    (grpc.StatusCode.NOT_FOUND, "KV receiver 127.0.0.1:1 rejected 'r/0': request 'r/0' is not expected "
                                "by this receiver (never, or no longer)"),
])
def test_the_decode_worker_losing_the_request_blames_it_and_is_retryable(code, details) -> None:
    err = _prefill_failed(_rpc_error(code, details), "prefill-1", "decode-2")
    assert err.code == grpc.StatusCode.UNAVAILABLE and err.code in RETRYABLE
    assert err.extra_worker == "decode-2"  # placed again, away from the decode worker
    assert "prefill-1" in str(err) and details in str(err)


@pytest.mark.parametrize("code, blamed", [
    (grpc.StatusCode.UNAVAILABLE, "prefill-1"),        # the prefill worker died: retried elsewhere
    (grpc.StatusCode.INVALID_ARGUMENT, ""),            # the request itself is bad: final
    (grpc.StatusCode.DEADLINE_EXCEEDED, ""),           # the client's deadline: final
])
def test_other_failures_are_the_prefill_workers(code, blamed) -> None:
    err = _prefill_failed(_rpc_error(code, "x"), "prefill-1", "decode-2")
    assert err.code == code and err.extra_worker == blamed
