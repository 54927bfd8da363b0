"""Admission control on a live 1P1D cluster (router/shedding.py, router/allocate_queue.py).

* A decode worker whose KV cache holds two requests at a time gets twelve at once: the Allocates that
  find no free blocks wait in the router's queue and are served as blocks come back, so every request
  succeeds (none refused, none failed) and the queue metrics say they waited.
* A router with ``--max-queue-wait-s`` of a microsecond refuses at once every request that would
  queue behind another's prompt: RESOURCE_EXHAUSTED with a ``retry-after-ms`` trailing entry, counted
  in ``pdserve_router_admission_refused_total``; the admitted ones are served.

Both end with leak checks: every block back on both workers, nothing queued, no placement open, and
a lone request afterwards is admitted (no prompt tokens left counted against the prefill worker).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.app.launcher.local import LocalCluster
from pdserve.client import AsyncClient, Client, build_request
from pdserve.probe import free_port, scrape_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
N = 12
PROMPT = 96      # 6 blocks of 16; + 16 generated tokens = 7 blocks: two requests fit in 16 blocks
MAX_TOKENS = 16


def _prompt(i: int) -> list[int]:
    return [(i * 37 + k * 11) % 900 + 7 for k in range(PROMPT)]


async def _burst(router: str) -> list[object]:
    client = AsyncClient(router, timeout=120)

    async def one(i: int) -> object:
        req = build_request(prompt_ids=_prompt(i), max_tokens=MAX_TOKENS, ignore_eos=True)
        try:
            return await client.generate(req)
        except grpc.aio.AioRpcError as exc:
            return exc

    try:
        return await asyncio.gather(*(one(i) for i in range(N)))
    finally:
        await client.close()


def _retry_after_ms(exc: grpc.aio.AioRpcError) -> float | None:
    for key, value in exc.trailing_metadata() or ():
        if key == "retry-after-ms":
            return float(value)
    return None


def _metric(port: int, name: str) -> float:
    return scrape_metrics(port).get(name, 0.0)


def _leak_check(c: LocalCluster, port: int) -> None:
    stats = c.wait_idle(c.start_free)
    assert {w: s.free_blocks for w, s in stats.items()} == c.start_free
    assert all(s.num_leased == 0 and s.num_running == 0 and s.queue_depth == 0 for s in stats.values())
    assert _metric(port, "pdserve_router_allocate_queue_waiting") == 0
    assert _metric(port, "pdserve_router_inflight_requests") == 0


@pytest.fixture(scope="module")
def queued(make_checkpoint, tmp_path_factory):
    port = free_port()
    with LocalCluster(make_checkpoint("llama"), prefill=1, decode=1, transport="tcp",
                      run_dir=tmp_path_factory.mktemp("admission-queue"), decode_args=("--num-blocks", "16"),
                      router_args=("--metrics-port", str(port), "--allocate-queue-wait-s", "120")) as c:
        c.start_free = c.free_blocks()
        c.metrics_port = port
        yield c


def test_allocates_wait_for_blocks_instead_of_failing(queued) -> None:
    results = asyncio.run(_burst(queued.router))
    errors = [(r.code(), r.details()) for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert errors == []
    assert all(len(r.token_ids) == MAX_TOKENS for r in results)
    port = queued.metrics_port
    waited = _metric(port, 'pdserve_router_allocate_queue_wait_seconds_count{outcome="allocated"}')
    assert waited >= 1  # twelve at once on a cache that holds two: some had to wait
    assert _metric(port, 'pdserve_router_admission_refused_total{reason="queue_full"}') == 0
    print(f"\n{int(waited)} of {N} Allocates waited in the router's queue, all served")
    _leak_check(queued, port)


@pytest.fixture(scope="module")
def shedding(make_checkpoint, tmp_path_factory):
    port = free_port()
    with LocalCluster(make_checkpoint("llama"), prefill=1, decode=1, transport="tcp",
                      run_dir=tmp_path_factory.mktemp("admission-shed"), worker_args=("--num-blocks", "512"),
                      router_args=("--metrics-port", str(port), "--max-queue-wait-s", "0.000001")) as c:
        c.start_free = c.free_blocks()
        c.metrics_port = port
        yield c


def test_refuses_at_once_what_would_queue_with_a_retry_hint(shedding) -> None:
    results = asyncio.run(_burst(shedding.router))
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    served = [r for r in results if not isinstance(r, grpc.aio.AioRpcError)]
    assert {e.code() for e in refused} <= {grpc.StatusCode.RESOURCE_EXHAUSTED}, \
        [(e.code(), e.details()) for e in refused]
    assert served and all(len(r.token_ids) == MAX_TOKENS for r in served)
    assert refused, "twelve prompts at once: some must queue behind another's and be refused"
    for e in refused:
        assert "would wait" in e.details() and "budget" in e.details()
        hint = _retry_after_ms(e)
        assert hint is not None and hint >= 100
    port = shedding.metrics_port
    assert _metric(port, 'pdserve_router_admission_refused_total{reason="prefill_wait"}') == len(refused)
    print(f"\n{len(served)} served, {len(refused)} refused at once with a retry hint")
    _leak_check(shedding, port)
    with Client(shedding.router, timeout=60) as c:  # nothing queued now: admitted
        assert len(c.generate(prompt_ids=_prompt(99), max_tokens=4, ignore_eos=True).token_ids) == 4
    _leak_check(shedding, port)
