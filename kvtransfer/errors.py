"""Errors raised by kvtransfer, each carrying the gRPC status code a servicer should map it to.

Services translate with ``grpc.StatusCode[err.code]``; the message is meant for a person and names
the values that disagreed.
"""

from __future__ import annotations


class TransferError(Exception):
    """Base class. ``code`` is a ``grpc.StatusCode`` member name."""

    code = "INTERNAL"


class InvalidTransfer(TransferError):
    """Bad block ids, byte counts or layer ranges; rejected before anything is written."""

    code = "INVALID_ARGUMENT"


class LayoutMismatch(TransferError):
    """The two sides' KV layouts (or protocol versions) differ; nothing is exchanged."""

    code = "FAILED_PRECONDITION"


class UnknownRequest(TransferError):
    """A transfer named a request id the receiver does not expect (or no longer expects)."""

    code = "NOT_FOUND"


class PeerUnavailable(TransferError):
    """The peer could not be reached, or died / closed the connection mid-transfer."""

    code = "UNAVAILABLE"


class BackendUnavailable(TransferError):
    """The requested backend (NIXL) cannot be used here; the message says why."""

    code = "UNAVAILABLE"


class TransferTimeout(TransferError):
    """The transfer did not complete before its deadline."""

    code = "DEADLINE_EXCEEDED"


class TransferAborted(TransferError):
    """One of the two sides aborted the request."""

    code = "ABORTED"


class ProtocolError(TransferError):
    """A malformed frame; the connection it came on is closed."""

    code = "INTERNAL"


_BY_NAME = {cls.__name__: cls for cls in (
    InvalidTransfer, LayoutMismatch, UnknownRequest, PeerUnavailable, BackendUnavailable, TransferTimeout,
    TransferAborted, ProtocolError, TransferError)}


def error_to_wire(exc: BaseException) -> dict:
    """A JSON-able description of an error for an ERROR frame."""
    kind = type(exc).__name__ if isinstance(exc, TransferError) else "TransferError"
    return {"kind": kind, "message": str(exc)}


def error_from_wire(meta: dict, prefix: str = "") -> TransferError:
    cls = _BY_NAME.get(str(meta.get("kind")), TransferError)
    return cls(prefix + str(meta.get("message", "unknown error")))
