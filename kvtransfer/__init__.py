"""Moving KV blocks between processes: a Transport protocol, NIXL and TCP backends, the handshake.

See docs/kvtransfer.md. The services use :func:`make_transport` and the :class:`KVTransport` it returns.
"""

from .config import TransportConfig
from .errors import (
    BackendUnavailable,
    InvalidTransfer,
    LayoutMismatch,
    PeerUnavailable,
    ProtocolError,
    TransferAborted,
    TransferError,
    TransferTimeout,
    UnknownRequest,
)
from .protocol import PROTOCOL_VERSION
from .receiver import Expectation
from .sender import SendHandle
from .transport import KVTransport, Transport, make_transport, parse_endpoint

__all__ = [
    "PROTOCOL_VERSION",
    "BackendUnavailable",
    "Expectation",
    "InvalidTransfer",
    "KVTransport",
    "LayoutMismatch",
    "PeerUnavailable",
    "ProtocolError",
    "SendHandle",
    "Transport",
    "TransferAborted",
    "TransferError",
    "TransferTimeout",
    "TransportConfig",
    "UnknownRequest",
    "make_transport",
    "parse_endpoint",
]
