"""Capacity is not sickness: a full decode KV cache refuses with RESOURCE_EXHAUSTED, never UNAVAILABLE.

1 prefill + 1 decode worker whose KV cache holds 64 blocks (1024 tokens). 300 concurrent requests of
~3 blocks each cannot all fit: the ones that find the cache full are refused with
RESOURCE_EXHAUSTED (full, try later), the others are served. None may read "no healthy decode
worker": a refusal for capacity must not mark the worker unhealthy, or an idle cluster would refuse
everything for the cooldown that follows. A request sent right after the burst is served, and every
block comes back.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.app.launcher.local import LocalCluster
from pdserve.client import AsyncClient, Client, build_request

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
N = 300


@pytest.fixture(scope="module")
def cluster(make_checkpoint, tmp_path_factory):
    model = make_checkpoint("llama")
    with LocalCluster(model, prefill=1, decode=1, transport="tcp",
                      run_dir=tmp_path_factory.mktemp("capacity"),
                      decode_args=("--num-blocks", "64")) as c:
        c.start_free = c.free_blocks()
        yield c


async def _burst(router: str) -> list[object]:
    client = AsyncClient(router, timeout=120)

    async def one(i: int) -> object:
        req = build_request(prompt_ids=[(i * 31 + k * 7) % 1000 + 5 for k in range(33)], max_tokens=8,
                            ignore_eos=True)
        try:
            return await client.generate(req)
        except grpc.aio.AioRpcError as exc:
            return exc

    try:
        return await asyncio.gather(*(one(i) for i in range(N)))
    finally:
        await client.close()


def test_full_cache_refuses_with_resource_exhausted_and_stays_healthy(cluster) -> None:
    results = asyncio.run(_burst(cluster.router))
    errors = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    served = [r for r in results if not isinstance(r, grpc.aio.AioRpcError)]
    codes = {e.code() for e in errors}
    assert codes <= {grpc.StatusCode.RESOURCE_EXHAUSTED}, \
        f"only RESOURCE_EXHAUSTED may refuse a full cache: {[(e.code(), e.details()) for e in errors][:5]}"
    assert served and all(len(r.token_ids) == 8 for r in served)
    print(f"\n{len(served)} served, {len(errors)} RESOURCE_EXHAUSTED of {N}")
    # Right after the burst, with nothing running, the worker takes the next request.
    with Client(cluster.router, timeout=60) as c:
        r = c.generate(prompt_ids=[5, 6, 7, 8], max_tokens=4, ignore_eos=True)
        assert len(r.token_ids) == 4
        assert all(w["healthy"] for w in c.list_workers())
    stats = cluster.wait_idle(cluster.start_free)
    assert {w: s.free_blocks for w, s in stats.items()} == cluster.start_free
    assert all(s.num_leased == 0 and s.num_running == 0 for s in stats.values())
