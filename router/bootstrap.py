"""Build a router from its serve settings: limits, store, Placer, discovery, directory, pipeline.

Discovery feeds *addresses* into the ``WorkerDirectory``; the directory learns each worker's id,
incarnation and load from GetStats and is the only thing that tells the Placer who is healthy, so a
worker that a discovery source still lists but that does not answer is never placed on.

    static  --prefill/--decode lists          file   --workers-file (pdserve up / scale)
    redis   worker leases in --redis           k8s    EndpointSlices (--*-selector)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from pdserve.settings import ServeSettings

log = logging.getLogger(__name__)


async def build_router(settings: ServeSettings) -> tuple[object, Callable[[], Awaitable[None]]]:
    """(RouterServicer, async stop) for ``settings``."""
    from router.admission import limits_from_model_dir
    from router.conditional import ConditionalConfig
    from router.costs import CostConfig
    from router.decode_mux import MuxMetrics
    from router.directory import WorkerDirectory
    from router.lifecycle import WorkerLifecycle
    from router.metrics import RouterMetrics, serve_metrics
    from router.migration import Migration, MigrationConfig
    from router.pipeline import Pipeline
    from router.placement import Placer, PlacerConfig
    from router.service import RouterServicer
    from router.shedding import Admission, AdmissionConfig
    from router.state import make_store

    if not settings.model:
        raise SystemExit("pdserve serve --role router needs --model DIR (tokenizer and context length)")
    limits = await asyncio.to_thread(limits_from_model_dir, settings.model)
    metrics = RouterMetrics()
    if settings.metrics_port:
        serve_metrics(metrics.registry, settings.metrics_port, addr=settings.host)
    store = make_store(settings.redis, metrics=metrics)
    # --mode colocated: the router fronts colocated workers, there is no prefill pool.
    prefill_pool = settings.mode != "colocated"
    costs = CostConfig(prefill_tokens_per_s=settings.local_prefill_tokens_per_s)
    placer = Placer(PlacerConfig(policy=settings.policy, session_ttl_s=settings.session_ttl,
                                 block_size=settings.block_size, store_timeout_s=settings.store_timeout,
                                 prefill_pool=prefill_pool, costs=costs),
                    store, metrics=metrics)
    metrics.inflight.set_function(lambda: placer.inflight_total)
    await placer.start()
    directory = WorkerDirectory(placer, interval=settings.stats_interval,
                                drain_timeout_s=max(settings.drain_timeout, 1.0) * 4,
                                decode_mux=settings.decode_mux == "on")
    directory.lifecycle = WorkerLifecycle(metrics.registry)
    directory.mux_metrics = MuxMetrics(metrics.registry)
    if settings.tls_dir:  # mutual TLS to every worker: present router.crt, check the worker's role
        from pdserve.server import CHANNEL_OPTIONS
        from pdserve.tls import TlsDir, open_channel

        tls = TlsDir(settings.tls_dir)
        served_as = {"prefill": "prefill", "decode": "decode" if prefill_pool else "colocated"}
        directory.open_channel = lambda addr, role: open_channel(
            addr, tls=tls, identity="router", server_role=served_as[role], options=CHANNEL_OPTIONS, aio=True)
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(directory.poll_forever())]
    if settings.discovery == "static":
        await directory.set_addresses("prefill", settings.prefill if prefill_pool else ())
        await directory.set_addresses("decode", settings.decode)
    elif settings.discovery == "file":
        from router.file_discovery import watch_workers_file

        tasks.append(loop.create_task(watch_workers_file(settings.workers_file, directory,
                                                         settings.stats_interval)))
    else:
        from router.discovery import addresses_by_role, make_discovery

        source = make_discovery(settings.discovery, store=store,
                                k8s_namespace=settings.k8s_namespace or "default",
                                prefill_selector=settings.prefill_selector or "",
                                decode_selector=settings.decode_selector or "", metrics=metrics)
        pending: list[asyncio.Task] = []

        def on_update(workers) -> None:
            members = addresses_by_role(workers)

            async def apply() -> None:
                for role, addrs in members.items():
                    await directory.set_addresses(role, addrs)

            pending.append(loop.create_task(apply()))
            del pending[:-4]

        tasks.append(loop.create_task(source.run(on_update)))
    conditional = None
    if settings.conditional_disagg == "auto":
        conditional = ConditionalConfig(min_uncached_tokens=settings.min_uncached_tokens,
                                        max_prefill_wait_s=settings.max_prefill_wait_s,
                                        local_duty=settings.local_prefill_duty,
                                        local_burst_s=settings.local_prefill_burst_s,
                                        max_local_stall_s=settings.local_prefill_max_stall_s,
                                        stall_weight=settings.local_prefill_stall_weight)
    pipeline = Pipeline(directory, placer, block_size=settings.block_size, lease_ms=settings.lease_ms,
                        conditional=conditional)
    pipeline.admission = Admission(AdmissionConfig(max_queue_wait_s=settings.max_queue_wait_s,
                                                   allocate_queue_size=settings.allocate_queue_size,
                                                   allocate_queue_wait_s=settings.allocate_queue_wait_s,
                                                   drain=settings.admission_drain),
                                   placer, registry=metrics.registry)
    pipeline.migration = Migration(MigrationConfig(enabled=settings.migration == "on",
                                                   max_retries=settings.max_request_retries,
                                                   wait_s=settings.retry_wait_s), metrics.registry)
    servicer = RouterServicer(pipeline=pipeline, directory=directory, limits=limits)

    async def stop() -> None:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await directory.close()
        await placer.close()
        servicer.close()

    return servicer, stop
