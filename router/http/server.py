"""uvicorn inside the router's own asyncio loop, beside the gRPC server.

One process, one loop: the HTTP door reaches the same Pipeline, Placer and directory objects as the
gRPC servicer with plain calls. uvicorn normally owns the process (its own loop, SIGINT/SIGTERM
handlers); embedded here it owns neither: the socket is bound by us on the configured host only
(so a taken port fails the start with a clear error, not a SystemExit from inside a task), signals
stay with ``GrpcServer`` (which drains both doors), and ``stop()`` asks uvicorn to finish in-flight
responses within the drain timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

import uvicorn

from pdserve.settings import DEFAULT_DRAIN_TIMEOUT_S

log = logging.getLogger(__name__)


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the router's GrpcServer handles signals for the whole process
        yield


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"cannot bind the HTTP port {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(False)
    return sock


class HttpServer:
    def __init__(self, app, *, host: str, port: int, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        self.host = host
        self.sock = bind_socket(host, port)
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, lifespan="off", log_config=None, log_level=logging.WARNING,
                                access_log=False, timeout_graceful_shutdown=max(1, int(drain_timeout)),
                                timeout_keep_alive=30, server_header=False)
        self.server = _EmbeddedServer(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        self._task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]),
                                                            name="http-server")
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.01)
        log.info("HTTP listening on %s:%d (pid %d)", self.host, self.port, os.getpid())
        return self.port

    async def stop(self) -> None:
        if self._task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.sock.close()


async def serve_http(servicer, settings, *, keys=None, healthy=lambda: True) -> HttpServer:
    """Start the OpenAI-compatible door for a router built by ``router.bootstrap.build_router``."""
    from router.chat_template import ChatTemplate
    from router.http.app import MAX_BODY_BYTES, build_app
    from router.http.frontend import OpenAIFrontend

    template = await asyncio.to_thread(ChatTemplate.from_model_dir, settings.model)
    if template is None:
        log.warning("%s has no chat template: /v1/chat/completions will refuse requests", settings.model)
    frontend = OpenAIFrontend(pipeline=servicer.pipeline, limits=servicer.limits,
                              model_name=settings.served_model_name or os.path.basename(
                                  os.path.normpath(settings.model)),
                              chat_template=template, tokenize_pool=getattr(servicer, "tokenize_pool", None),
                              serving=healthy, tool_call_parser=settings.tool_call_parser)
    max_body = min(MAX_BODY_BYTES, getattr(settings, "max_request_bytes", MAX_BODY_BYTES))
    server = HttpServer(build_app(frontend, keys=keys, healthy=healthy, max_body_bytes=max_body),
                        host=settings.host,
                        port=settings.http_port, drain_timeout=settings.drain_timeout)
    await server.start()
    return server
