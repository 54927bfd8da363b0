"""Shared grpc.aio server bootstrap for every role: health, reflection, graceful drain.

Lifecycle of one serving process:

1. ``GrpcServer(settings, service_names)`` builds a ``grpc.aio`` server with the message-size limits
   and registers ``grpc.health.v1`` (overall "" plus each service name) as NOT_SERVING and server
   reflection.
2. The role adds its servicers, calls ``start()`` (binds; the port is known afterwards), loads the
   model / brings up the KV transport, then ``set_serving(True)``.
3. ``serve_until_signal()`` waits. On SIGTERM/SIGINT the health status flips to NOT_SERVING at once,
   the server stops accepting new RPCs and in-flight ones get up to ``--drain-timeout`` seconds to
   finish; then the role's ``on_stop`` callbacks run and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from pdserve import process_stats
from pdserve.settings import DEFAULT_DRAIN_TIMEOUT_S
from pdserve.tls import KEEPALIVE_OPTIONS, KEEPALIVE_TIME_MS
from pdserve.v1 import process_pb2_grpc

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    # Accept the keepalive pings of our channels (pdserve/tls.py KEEPALIVE_OPTIONS), idle or not:
    # gRPC's server default takes a ping less than 5 minutes after the last one, on a connection
    # sending no data, for a strike, and after two it sends GOAWAY "too_many_pings", after which the
    # client doubles its keepalive time.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
]
# Client channels to internal services: keepalive so a dead or frozen peer is noticed, not waited on.
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    *KEEPALIVE_OPTIONS,
    ("grpc.keepalive_permit_without_calls", 1),  # an idle worker's death is noticed before its next request
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


class GrpcServer:
    def __init__(self, *, host: str, port: int, service_full_names: Sequence[str],
                 drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S, max_receive_bytes: int = MAX_MESSAGE_BYTES,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 credentials: grpc.ServerCredentials | None = None) -> None:
        # credentials: TLS (pdserve/tls.py, --tls-dir); None serves plaintext
        self.credentials = credentials
        # gRPC refuses a larger request (RESOURCE_EXHAUSTED) before it is parsed: the public port's
        # --max-request-bytes is enforced here, ahead of any work.
        options = [(k, max_receive_bytes if k == "grpc.max_receive_message_length" else v)
                   for k, v in GRPC_OPTIONS]
        self.server = grpc.aio.server(options=options, interceptors=list(interceptors) or None)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        # every process reports its own CPU and boot phases (pdserve/process_stats.py)
        process_pb2_grpc.add_ProcessServicer_to_server(process_stats.ProcessServicer(), self.server)
        self._names = list(service_full_names)
        reflection.enable_server_reflection(
            [*self._names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             process_stats.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self._bind = f"{host}:{port}"
        self.port = 0
        self.drain_timeout = drain_timeout
        self._stop_callbacks: list[Callable[[], Awaitable[None]]] = []
        self._stopping = asyncio.Event()
        # set as the drain begins: servicers with long-lived calls (DecodeMany) refuse new work on
        # them and end them once idle, so the grace period is not waited out
        self.draining = asyncio.Event()
        self.serving = False  # what health says; the router's HTTP door reports the same
        self.exit_status = 0  # 1 once ``fail`` ended the process's serving (an error to restart on)

    async def start(self) -> int:
        if self.credentials is not None:
            self.port = self.server.add_secure_port(self._bind, self.credentials)
        else:
            self.port = self.server.add_insecure_port(self._bind)
        if self.port == 0:
            raise RuntimeError(f"cannot bind gRPC server to {self._bind}")
        await self.set_serving(False)
        await self.server.start()
        log.info("gRPC listening on %s (port %d%s)", self._bind, self.port,
                 ", TLS" if self.credentials else "")
        return self.port

    async def set_serving(self, serving: bool) -> None:
        self.serving = serving
        if serving:
            process_stats.BOOT.serving()
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", *self._names):
            await self.health.set(name, status)

    def on_stop(self, callback: Callable[[], Awaitable[None]]) -> None:
        self._stop_callbacks.append(callback)

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._stopping.set)

    def fail(self, why: str) -> None:
        """Stop serving for good: drain and exit with status 1, so that the launcher's supervisor (or
        the kubelet) starts the process again. For a worker whose engine thread died: it would
        otherwise stay up NOT_SERVING, a pool member short, until someone restarts it."""
        log.error("%s: stopping, to exit with status 1", why)
        self.exit_status = 1
        self._stopping.set()

    async def serve_until_signal(self) -> None:
        self.install_signal_handlers()
        await self._stopping.wait()
        await self.shutdown()

    async def shutdown(self) -> None:
        log.info("draining (up to %.1fs)", self.drain_timeout)
        self.draining.set()
        await self.set_serving(False)
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace=self.drain_timeout)
        for callback in reversed(self._stop_callbacks):
            try:
                await callback()
            except Exception:  # one failing cleanup must not skip the others
                log.exception("stop callback failed")
        log.info("stopped")


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Map an internal exception to the gRPC status a caller can act on (DESIGN.md "Errors").

    Errors raised on purpose (engine.errors, kvtransfer.errors) name their status in a class attribute
    ``code``, so this floor module needs no import of the layers above it.
    """
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or ""
    code_name = getattr(type(exc), "code", None)
    if isinstance(code_name, str) and code_name in grpc.StatusCode.__members__:
        return grpc.StatusCode[code_name], str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "timed out"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


async def abort_from(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Abort the RPC with the status mapped from ``exc`` (never returns)."""
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("internal error: %s", message, exc_info=exc)
    await context.abort(code, message)
