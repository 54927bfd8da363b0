"""Moving KV blocks between processes: a Transport protocol, NIXL and TCP backends, the handshake.

See docs/kvtransfer.md. The services use :func:`make_transport` and the :class:`KVTransport` it returns.
"""

from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from .receiver import Expectation
    from .sender import SendHandle
    from .transport import KVTransport, Transport, make_transport, parse_endpoint

# The transport itself imports torch (the KV layout); these names load it on first use, so that a
# process needing only the light modules (the TLS relay helpers, tls_relay.py) starts in milliseconds.
_LAZY = {"Expectation": ".receiver", "SendHandle": ".sender", "KVTransport": ".transport",
         "Transport": ".transport", "make_transport": ".transport", "parse_endpoint": ".transport"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtransfer' has no attribute {name!r}")
    import importlib  # noqa: PLC0415

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


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
