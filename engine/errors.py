"""Exceptions the engine raises to its callers.

The services map them to gRPC status codes (see DESIGN.md "Errors are gRPC status codes"):

=======================  =====================  ==========================================
exception                typical status         raised when
=======================  =====================  ==========================================
ModelLoadError           FAILED_PRECONDITION    a model directory is missing, malformed, of an
                                                unsupported architecture, or its tensors do not
                                                match the config
KVCacheFull              RESOURCE_EXHAUSTED     not enough free KV blocks for a reservation
QueueFull                RESOURCE_EXHAUSTED     the admission queue is at ``max_queue``
RequestTooLong           INVALID_ARGUMENT       a prompt (+max_tokens) can never fit the cache
                                                or the model's context
DuplicateRequest         INVALID_ARGUMENT       a request id is already known to the engine
UnknownRequest           NOT_FOUND              a hook names a request the engine does not hold
=======================  =====================  ==========================================

Every message names the problem (which file, which tensor, how many blocks) so a person can act on
it without reading the code. ``ValueError`` subclasses are used where a caller's argument is wrong,
so generic ``except ValueError`` handlers (argument validation) keep working.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelLoadError(EngineError):
    """A model directory cannot be loaded: missing files, bad JSON, unsupported model, bad tensors."""

    code = "FAILED_PRECONDITION"


class KVCacheFull(EngineError):
    """Not enough free KV cache blocks for the request right now (it may fit later)."""

    code = "RESOURCE_EXHAUSTED"


class QueueFull(EngineError):
    """The engine's admission queue is full; the caller should retry later or elsewhere."""

    code = "RESOURCE_EXHAUSTED"


class RequestTooLong(EngineError, ValueError):
    """The request can never be served: it exceeds the context length or the whole KV cache."""

    code = "INVALID_ARGUMENT"


class DuplicateRequest(EngineError, ValueError):
    """A request id that the engine already holds was submitted again."""

    code = "INVALID_ARGUMENT"


class UnknownRequest(EngineError, KeyError):
    """A hook (commit_prefilled, block_table, ...) named a request the engine does not hold."""

    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


__all__ = [
    "DuplicateRequest",
    "EngineError",
    "KVCacheFull",
    "ModelLoadError",
    "QueueFull",
    "RequestTooLong",
    "UnknownRequest",
]
