"""API keys for the router's two doors (gRPC and HTTP): which keys are accepted, and the gRPC check.

Keys come from ``--api-key`` (repeatable; ``PDSERVE_API_KEY`` takes a comma-separated list) and from
``--api-keys-file`` (one key a line, ``#`` comments and blank lines ignored). The file is re-read
when its modification time or size changes (looked at most once a second, on a request), so keys
rotate without a restart: add the new key, move clients over, remove the old one. A file that
becomes unreadable keeps the last good set (logged) rather than locking everyone out or letting
everyone in. Keys are kept as SHA-256 digests and compared with ``hmac.compare_digest``.

Clients present a key as ``authorization: Bearer KEY`` (gRPC metadata or HTTP header, what the
OpenAI clients send). Health stays open on both doors (orchestrators probe without keys), and so
does the Prometheus endpoint, which is its own listener.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import grpc

log = logging.getLogger(__name__)
AUTH_METADATA_KEY = "authorization"
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/",)
MISSING_KEY = "missing API key: send `authorization: Bearer KEY`"
WRONG_KEY = "invalid API key"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def read_keys_file(path: str | Path) -> list[str]:
    """The keys of a keys file; OSError when it cannot be read."""
    text = Path(path).read_text(encoding="utf-8")
    return [s for line in text.splitlines() if (s := line.strip()) and not s.startswith("#")]


def bearer_token(value: str | None) -> str | None:
    """KEY of ``Bearer KEY`` (scheme case-insensitive), else None."""
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class ApiKeys:
    def __init__(self, keys: Iterable[str] = (), file: str | None = None, *, check_interval_s: float = 1.0,
                 clock=time.monotonic) -> None:
        self._static = [_digest(k) for k in keys if k]
        self._file = file
        self._interval = check_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._file_keys: list[bytes] = []
        self._file_sig: tuple[int, int] | None = None
        self._next_check = 0.0
        if file is not None:
            try:
                self._load()
            except OSError as exc:
                raise ValueError(f"--api-keys-file {file}: {exc.strerror or exc}") from None

    @property
    def enabled(self) -> bool:
        return bool(self._static) or self._file is not None

    def _load(self) -> None:
        st = os.stat(self._file)
        keys = read_keys_file(self._file)
        self._file_keys = [_digest(k) for k in keys]
        self._file_sig = (st.st_mtime_ns, st.st_size)
        if not keys:
            log.warning("api keys file %s holds no key: every keyed request is refused", self._file)

    def _maybe_reload(self) -> None:
        now = self._clock()
        if self._file is None or now < self._next_check:
            return
        with self._lock:
            if now < self._next_check:
                return
            self._next_check = now + self._interval
            try:
                st = os.stat(self._file)
                if (st.st_mtime_ns, st.st_size) != self._file_sig:
                    self._load()
                    log.info("api keys reloaded from %s", self._file)
            except OSError as exc:
                log.warning("api keys file %s unreadable (%s): keeping the previous keys", self._file, exc)

    def allows(self, key: str | None) -> bool:
        if not self.enabled:
            return True
        if not key:
            return False
        self._maybe_reload()
        d = _digest(key)
        ok = False
        for known in (*self._static, *self._file_keys):  # no early exit: same work for every key
            ok |= hmac.compare_digest(d, known)
        return ok

    def refusal(self, key: str | None) -> str:
        return MISSING_KEY if not key else WRONG_KEY


def _metadata_key(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for k, v in metadata or ():
        if k == AUTH_METADATA_KEY:
            return bearer_token(v if isinstance(v, str) else v.decode(errors="replace"))
    return None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every RPC but health without a valid key (UNAUTHENTICATED), before the servicer runs."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_GRPC_PREFIXES):
            return handler
        key = _metadata_key(handler_call_details.invocation_metadata)
        if self.keys.allows(key):
            return handler
        return _refusing(handler, self.keys.refusal(key))


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that aborts with UNAUTHENTICATED."""
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises

    codec = dict(request_deserializer=handler.request_deserializer,
                 response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **codec)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **codec)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **codec)
    return grpc.stream_stream_rpc_method_handler(streaming, **codec)
