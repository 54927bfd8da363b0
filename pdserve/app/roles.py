"""Wire one role's pieces together: engine, KV transport, worker logic, servicers, gRPC server.

Start-up order matters for health: the gRPC port is bound first (so the launcher learns it and
probes get NOT_SERVING rather than connection refused), then the model is loaded and the KV
transport comes up, and only then is the role marked SERVING. Shutdown runs in reverse.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid

from pdserve.server import GrpcServer
from pdserve.settings import ServeSettings

log = logging.getLogger(__name__)

_STREAMING = {"Generate", "Decode"}
SERVICE_NAMES = {
    "prefill": ["pdserve.v1.Prefill"],
    "decode": ["pdserve.v1.Decode"],
    "router": ["pdserve.v1.Router"],
    "colocated": ["pdserve.v1.Router", "pdserve.v1.Decode"],
}


def build_engine(settings: ServeSettings):
    """An LLMEngine for a worker role, from the serve settings. At ``tensor_parallel_size > 1`` it is
    rank 0 of the worker and ``engine.tp_ranks`` holds the other ranks' processes
    (``pdserve.app.tp_ranks``); ``close_engine`` stops them."""
    from engine.engine import EngineConfig, LLMEngine

    kwargs = dict(model=settings.model, dtype=None if settings.dtype == "auto" else settings.dtype,
                  device=settings.device,
                  block_size=settings.block_size, max_num_seqs=settings.max_num_seqs,
                  gpu_wait=settings.gpu_wait,
                  cuda_graphs=settings.role != "prefill")  # a prefill worker never runs a decode step
    if settings.num_blocks is not None:
        kwargs["num_blocks"] = settings.num_blocks
    if settings.kv_memory_gb is not None:
        kwargs["kv_cache_bytes"] = int(settings.kv_memory_gb * 2**30)
    kwargs["tiers"] = tier_config(settings)
    if settings.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = settings.max_num_batched_tokens
    if settings.launch_ahead_layers is not None:
        kwargs["launch_ahead_layers"] = settings.launch_ahead_layers
    if settings.tensor_parallel_size == 1:
        return LLMEngine(EngineConfig(**kwargs))
    from pdserve.app.tp_ranks import KVRankConfig, rank_device, start_ranks

    config = EngineConfig(**{**kwargs, "device": rank_device(settings.device, 0)})
    kv = KVRankConfig.from_settings(settings) if settings.role in ("prefill", "decode") else None
    ranks = start_ranks(config, settings.tensor_parallel_size, kv=kv)
    try:
        engine = LLMEngine(config, tp=ranks.group)
    except BaseException:
        ranks.stop(timeout=0)
        raise
    engine.tp_ranks = ranks
    return engine


def tier_config(settings: ServeSettings):
    """The KV tiers of a worker (engine.kv_tiers.TierConfig) from --kv-host-gb / --kv-disk-dir / -gb."""
    from engine.kv_tiers import TierConfig

    host = settings.kv_host_gb
    return TierConfig(host_bytes=0 if host is None else int(host * 2**30), host_auto=host is None,
                      disk_dir=settings.kv_disk_dir or None, disk_bytes=int(settings.kv_disk_gb * 2**30))


def close_engine(engine) -> None:
    """Release a tensor-parallel engine's other ranks and wait for their processes (no-op at TP 1).
    Call once the engine thread has stopped."""
    ranks = getattr(engine, "tp_ranks", None)
    if ranks is not None:
        engine.close()
        ranks.stop()


async def run_role(settings: ServeSettings) -> int:
    """Serve one role until a signal (or a fatal error: ``GrpcServer.fail``); returns the exit status."""
    if settings.otlp_endpoint:
        from pdserve import tracing

        tracing.setup(f"pdserve-{settings.role}", settings.otlp_endpoint, settings.otlp_sampling)
    try:
        return await _run_role(settings)
    finally:
        if settings.otlp_endpoint:
            tracing.shutdown()  # the spans still queued go out before the process ends


async def _run_role(settings: ServeSettings) -> int:
    public = settings.role in ("router", "colocated")  # serves the client-facing API
    keys = _api_keys(settings)
    server = GrpcServer(host=settings.host, port=settings.port,
                        service_full_names=SERVICE_NAMES[settings.role],
                        drain_timeout=settings.drain_timeout,
                        **({"max_receive_bytes": settings.max_request_bytes} if public else {}),
                        credentials=_server_credentials(settings),
                        interceptors=_key_interceptors(keys))
    setup = {"prefill": _prefill, "decode": _decode, "router": functools.partial(_router, keys=keys),
             "colocated": _colocated}[settings.role]
    # Servicers must be registered before the server starts, so roles register first and load after.
    finish = await setup(settings, server)
    server.install_signal_handlers()  # a SIGTERM during loading still drains instead of killing
    port = await server.start()
    settings = _with_port(settings, port)
    try:
        await finish(settings)
    except BaseException:
        # A start that failed (bad settings, a model that does not load): nothing to drain, and no
        # running server left for the collector to stop on a closed loop (a traceback after the error).
        await server.server.stop(0)
        raise
    await server.set_serving(True)
    print(f"pdserve {settings.role} {settings.worker_id} listening on {settings.advertise_host}:{port}",
          flush=True)
    await server.serve_until_signal()
    return server.exit_status


def _api_keys(settings: ServeSettings):
    """The router's accepted API keys (router/api_keys.py), or None when it takes none."""
    if not (settings.api_key or settings.api_keys_file):
        return None
    from router.api_keys import ApiKeys

    return ApiKeys(settings.api_key, settings.api_keys_file)


def _key_interceptors(keys) -> list:
    if keys is None:
        return []
    from router.api_keys import ApiKeyInterceptor

    return [ApiKeyInterceptor(keys)]


def _server_credentials(settings: ServeSettings):
    """TLS of this process's gRPC port under --tls-dir: the router's public port takes any TLS client;
    every worker port requires a client certificate of the cluster CA (mutual TLS)."""
    if not settings.tls_dir:
        return None
    from pdserve.tls import TlsDir

    return TlsDir(settings.tls_dir).server_credentials(settings.role,
                                                       require_client_cert=settings.role != "router")


def _with_port(settings: ServeSettings, port: int) -> ServeSettings:
    import dataclasses

    return dataclasses.replace(settings, port=port)


class _Late:
    """Servicer placeholder whose target is set once the model is loaded (after the port is bound)."""

    def __init__(self) -> None:
        self.target = None

    def __getattr__(self, name: str):
        return getattr(self.target, name)


async def _load_engine(settings: ServeSettings, server: GrpcServer, *, idle_work: bool = True):
    """``idle_work=False``: the engine's deferred CUDA graph captures wait for ``allow_idle_work()``
    (a worker calls it once its KV plane is up: see ``AsyncEngine``)."""
    from engine.async_engine import AsyncEngine

    engine = await asyncio.to_thread(build_engine, settings)
    aengine = AsyncEngine(engine, name=f"engine-{settings.role}", idle_work=idle_work)
    aengine.start()

    async def watch() -> None:
        # A crashed engine thread fails its requests; health must say so, so the router and the
        # orchestrator stop sending work here.
        while aengine.alive or aengine.error is None:
            await asyncio.sleep(1.0)
        log.error("engine thread died (%s)", aengine.error)
        server.fail(f"engine thread died ({type(aengine.error).__name__})")  # NOT_SERVING, drain, exit 1

    task = asyncio.get_running_loop().create_task(watch())

    async def close_ranks() -> None:  # registered first, so it runs after the role's aengine.stop
        await asyncio.to_thread(close_engine, engine)

    server.on_stop(close_ranks)

    async def stop_watch() -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    server.on_stop(stop_watch)
    return engine, aengine


async def _prefill(settings: ServeSettings, server: GrpcServer):
    from pdserve.app.tp_ranks import make_rank_link
    from pdserve.v1 import prefill_pb2_grpc
    from prefill_service.service import PrefillServicer
    from prefill_service.worker import PrefillWorker

    holder = _Late()
    prefill_pb2_grpc.add_PrefillServicer_to_server(_Delegate(holder, prefill_pb2_grpc.PrefillServicer),
                                                   server.server)

    async def finish(settings: ServeSettings) -> None:
        engine, aengine = await _load_engine(settings, server, idle_work=False)
        kv = await make_rank_link(settings, engine)  # every rank moves its own KV heads
        aengine.allow_idle_work()
        worker = PrefillWorker(engine=aengine, kv=kv, worker_id=settings.worker_id,
                               block_size=engine.kv_layout.block_size,
                               stream_layers=settings.kv_stream_layers == "on")
        holder.target = PrefillServicer(worker, address=settings.advertise_address, transports=kv.transports)
        server.on_stop(aengine.stop)
        server.on_stop(kv.close)
        await _worker_extras(settings, server, engine, aengine)

    return finish


async def _decode(settings: ServeSettings, server: GrpcServer):
    from decode_service.service import DecodeServicer
    from decode_service.worker import DecodeWorker
    from pdserve.app.tp_ranks import make_rank_link
    from pdserve.v1 import decode_pb2_grpc

    holder = _Late()
    decode_pb2_grpc.add_DecodeServicer_to_server(_Delegate(holder, decode_pb2_grpc.DecodeServicer),
                                                 server.server)

    async def finish(settings: ServeSettings) -> None:
        engine, aengine = await _load_engine(settings, server, idle_work=False)
        # every rank moves its own KV heads (rank 0's on a loop of its own with --kv-own-loop on)
        kv = await make_rank_link(settings, engine, own_loop=settings.kv_own_loop == "on")
        aengine.allow_idle_work()  # no capture while the KV plane set up its CUDA memory domain
        worker = DecodeWorker(engine=aengine, kv=kv, worker_id=settings.worker_id,
                              block_size=engine.kv_layout.block_size, default_lease_ms=settings.lease_ms)
        worker.start()
        holder.target = DecodeServicer(worker, address=settings.advertise_address, transports=kv.transports,
                                       stream_interval=settings.stream_interval, draining=server.draining)
        server.on_stop(aengine.stop)
        server.on_stop(kv.close)
        server.on_stop(worker.stop)
        await _worker_extras(settings, server, engine, aengine)

    return finish


async def _colocated(settings: ServeSettings, server: GrpcServer):
    from decode_service.service import DecodeServicer
    from decode_service.worker import DecodeWorker
    from pdserve.v1 import decode_pb2_grpc, router_pb2_grpc
    from router.admission import ModelLimits
    from router.colocated import ColocatedServicer

    holder, decode_holder = _Late(), _Late()
    router_pb2_grpc.add_RouterServicer_to_server(_Delegate(holder, router_pb2_grpc.RouterServicer),
                                                 server.server)
    decode_pb2_grpc.add_DecodeServicer_to_server(_Delegate(decode_holder, decode_pb2_grpc.DecodeServicer),
                                                 server.server)

    async def finish(settings: ServeSettings) -> None:
        engine, aengine = await _load_engine(settings, server)
        cfg = engine.model_config
        limits = ModelLimits(vocab_size=cfg.vocab_size, max_model_len=cfg.max_position_embeddings,
                             tokenizer=engine.tokenizer, eos_token_ids=tuple(cfg.eos_token_ids))
        holder.target = ColocatedServicer(engine=aengine, limits=limits, worker_id=settings.worker_id,
                                          incarnation=uuid.uuid4().hex[:12],
                                          address=settings.advertise_address)
        # The Decode service too, so a router (--mode colocated) can front several of these: it
        # Allocates (reporting the cached prefix) and Decodes with prefill_locally. No KV transport:
        # nothing is ever pushed here.
        worker = DecodeWorker(engine=aengine, kv=_NoKV(), worker_id=settings.worker_id,
                              block_size=engine.kv_layout.block_size, default_lease_ms=settings.lease_ms)
        worker.start()
        decode_holder.target = DecodeServicer(worker, address=settings.advertise_address, transports=[],
                                              role="colocated", stream_interval=settings.stream_interval,
                                              draining=server.draining)
        server.on_stop(aengine.stop)
        server.on_stop(worker.stop)

    return finish


class _NoKV:
    """The KV link of a colocated worker: receives nothing; a Decode that waits for KV fails clearly."""

    def endpoint(self) -> bytes:
        return b""

    def expect(self, request_id: str, blocks: list[int]) -> None:
        return None

    async def wait(self, request_id: str) -> None:
        raise RuntimeError("a colocated worker receives no KV: the router must send prefill_locally "
                           "(route to it with --mode colocated or --conditional-disagg auto)")

    def release(self, request_id: str) -> None:
        return None


async def _router(settings: ServeSettings, server: GrpcServer, keys=None):
    from pdserve.v1 import router_pb2_grpc
    from router.bootstrap import build_router

    holder = _Late()
    router_pb2_grpc.add_RouterServicer_to_server(_Delegate(holder, router_pb2_grpc.RouterServicer),
                                                 server.server)

    async def finish(settings: ServeSettings) -> None:
        holder.target, stop = await build_router(settings)
        server.on_stop(stop)
        if settings.http_port:  # the OpenAI-compatible door, on this loop, over the same servicer
            from router.http.server import serve_http

            http = await serve_http(holder.target, settings, keys=keys, healthy=lambda: server.serving)
            server.on_stop(http.stop)  # runs before `stop`: HTTP requests end while the router stands
            print(f"pdserve router {settings.worker_id} http on {settings.advertise_host}:{http.port}",
                  flush=True)

    return finish


async def _worker_extras(settings: ServeSettings, server: GrpcServer, engine, aengine) -> None:
    """Prometheus gauges (--metrics-port) and a Redis lease (--redis) for a prefill/decode worker; the
    GIL stall watch when PDSERVE_STALL_WATCH_MS is set (pdserve/stall_watch.py)."""
    from pdserve.stall_watch import start_from_env

    runner = getattr(engine, "runner", None)
    import threading

    start_from_env((lambda: dict(runner.last_phases)) if runner is not None else None,
                   loop_thread=threading.get_ident())  # this coroutine runs on the event loop's thread
    if settings.metrics_port:
        from pdserve.app.worker_metrics import serve_worker_metrics

        serve_worker_metrics(settings, engine, aengine)
    if settings.redis:
        from pdserve.app.registration import WorkerRegistration
        from router.placement import WorkerLoad
        from router.state import make_store

        def load() -> WorkerLoad:
            s = aengine.snapshot
            return WorkerLoad(queue_depth=s.queue_depth, num_running=s.num_running, free_blocks=s.free_blocks,
                              total_blocks=s.total_blocks)

        reg = WorkerRegistration(make_store(settings.redis), worker_id=settings.worker_id, role=settings.role,
                                 address=settings.advertise_address,
                                 layout_hash=engine.kv_layout.compat_hash(),
                                 load_fn=load)
        await reg.start()
        server.on_stop(reg.stop)


def _Delegate(holder: _Late, base: type):
    """A servicer class instance whose RPC methods forward to ``holder.target`` once it is set."""
    import grpc

    methods = {}
    for name in dir(base):
        if name.startswith("_") or not callable(getattr(base, name)):
            continue

        def make(rpc: str):
            async def unary(self, request, context):
                if holder.target is None:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "server is starting")
                return await getattr(holder.target, rpc)(request, context)

            async def stream(self, request, context):
                if holder.target is None:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "server is starting")
                async for msg in getattr(holder.target, rpc)(request, context):
                    yield msg

            return stream if rpc in _STREAMING else unary

        methods[name] = make(name)
    return type(f"Late{base.__name__}", (base,), methods)()
