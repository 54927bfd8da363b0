"""Worker discovery: sources that yield the current ``list[WorkerInfo]`` to the Placer.

Every source has ``async run(on_update)`` which calls ``on_update(workers)`` with the *whole*
current list whenever it changes (and once at start), and keeps the last good list when its
backend is unreachable. ``make_discovery`` builds one from the router's serve flags:
``--discovery static|redis|k8s``.
"""

from __future__ import annotations

import asyncio

from router.discovery.static import StaticDiscovery, parse_static

__all__ = ["StaticDiscovery", "addresses_by_role", "feed_directory", "make_discovery", "parse_static"]


def addresses_by_role(workers) -> dict[str, list[str]]:
    """``{"prefill": [addr..], "decode": [addr..]}`` for an address-keyed directory."""
    out: dict[str, list[str]] = {"prefill": [], "decode": []}
    for w in workers:
        out[w.role].append(w.address)
    return out


async def feed_directory(source, directory) -> None:
    """Run ``source`` and mirror each list into an address-keyed directory that has
    ``async set_addresses(role, addrs)``. Only the newest list is applied if several arrive
    while one is being applied. Runs until cancelled."""
    latest: list = []
    ready = asyncio.Event()

    def on_update(workers) -> None:
        latest[:] = [list(workers)]
        ready.set()

    async def apply() -> None:
        while True:
            await ready.wait()
            ready.clear()
            by_role = addresses_by_role(latest[0])
            for role in ("prefill", "decode"):
                await directory.set_addresses(role, by_role[role])

    applier = asyncio.ensure_future(apply())
    try:
        await source.run(on_update)
    finally:
        applier.cancel()
        await asyncio.gather(applier, return_exceptions=True)


def make_discovery(mode: str, *, prefill: str | list[str] = "", decode: str | list[str] = "",
                   store=None, k8s_namespace: str = "default", prefill_selector: str = "",
                   decode_selector: str = "", expected_layout_hash: str = "", k8s_api_client=None,
                   k8s_port_name: str = "grpc", kubeconfig: str = "", metrics=None):
    """Discovery source for ``--discovery``; imports the backend lazily (kubernetes only for k8s).
    ``metrics`` (RouterMetrics) counts list/watch failures in ``discovery_errors``."""
    on_error = None
    if metrics is not None:
        on_error = lambda src: metrics.discovery_errors.labels(source=src).inc()
    if mode == "static":
        return StaticDiscovery(prefill=prefill, decode=decode)
    if mode == "redis":
        from router.discovery.redis_leases import RedisLeaseDiscovery

        if store is None or not getattr(store, "shared", False):
            raise ValueError("--discovery redis needs --redis URL")
        return RedisLeaseDiscovery(store, expected_layout_hash=expected_layout_hash, on_error=on_error)
    if mode == "k8s":
        from router.discovery.k8s import K8sDiscovery, K8sDiscoveryConfig

        cfg = K8sDiscoveryConfig(namespace=k8s_namespace, prefill_selector=prefill_selector,
                                 decode_selector=decode_selector, port_name=k8s_port_name,
                                 kubeconfig=kubeconfig)
        return K8sDiscovery(cfg, api_client=k8s_api_client, on_error=on_error)
    raise ValueError(f"unknown discovery mode {mode!r} (static, redis, k8s)")
