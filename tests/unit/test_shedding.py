"""Admission control (router/shedding.py) and the decode Allocate queue (router/allocate_queue.py):
decisions against a hand-moved clock, waiting Allocates served in order once blocks come free, a full
queue refusing at once and clearly, and every waiter gone afterwards."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from prometheus_client import CollectorRegistry

from router.allocate_queue import AllocateQueue, QueueRefused
from router.shedding import Admission, AdmissionConfig, Refused, budget_s, decide, prefill_wait_s
from tests.unit.fake_clock import Clock


def exhausted() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                details="no free KV blocks")


class Worker:
    """A decode worker's Allocate: succeeds while it has free blocks, else RESOURCE_EXHAUSTED."""

    def __init__(self, free: int = 0) -> None:
        self.free = free
        self.served: list[str] = []
        self.calls = 0

    def attempt(self, name: str):
        async def call() -> str:
            self.calls += 1
            if self.free <= 0:
                raise exhausted()
            self.free -= 1
            self.served.append(name)
            return name
        return call


class _View:
    def __init__(self, tokens: dict[str, int], own: int = 0, inflight: dict[str, int] | None = None) -> None:
        self.tokens, self.own, self.counts = tokens, own, inflight or {}

    def inflight(self, worker_id: str) -> int:
        return self.counts.get(worker_id, 0)

    def prefill_of(self, request_id: str) -> str | None:
        return "p" if self.own else None

    def outstanding_tokens(self, worker_id: str) -> int:
        return self.tokens.get(worker_id, 0)

    def own_prefill_tokens(self, request_id: str) -> int:
        return self.own


class _Costs:
    def __init__(self, push: float = 0.0, drain_rate: float = 0.0) -> None:
        self.push, self.drain_rate = push, drain_rate

    def queue_s(self, worker_id: str, tokens: int) -> float:
        return max(tokens, 0) / 10_000.0  # 10k tokens/s

    def push_wait_s(self, worker_id: str) -> float:
        return self.push

    def drain_s(self, worker_id: str, tokens: int) -> float:
        return max(tokens, 0) / self.drain_rate if self.drain_rate else 0.0


class _Placer:
    def __init__(self, tokens: dict[str, int], own: int = 0, inflight: dict[str, int] | None = None,
                 push: float = 0.0, drain_rate: float = 0.0) -> None:
        self.view, self.costs = _View(tokens, own, inflight), _Costs(push, drain_rate)


class _W:
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id


class _Placement:
    def __init__(self, prefill_id: str | None, decode_id: str) -> None:
        self.prefill_id, self.decode = prefill_id, _W(decode_id)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def sample(registry: CollectorRegistry, name: str, **labels) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_budget_and_decision() -> None:
    assert budget_s(None, 0.0) == float("inf")
    assert budget_s(5.0, 0.0) == 5.0 and budget_s(5.0, 1.5) == 1.5 and budget_s(0.5, 1.5) == 0.5
    assert budget_s(None, 2.0) == 2.0
    assert decide(1.0, 1.0, 100) is None  # exactly the budget: admitted
    assert decide(1.3, 1.0, 100) == pytest.approx(300.0)
    assert decide(1.01, 1.0, 100) == 100.0  # at least the minimum hint


def test_prefill_wait_reads_the_cluster_picture() -> None:
    placer = _Placer({"p1": 25_000, "d1": 4_000}, own=5_000)
    assert prefill_wait_s(placer, _Placement("p1", "d1"), "r") == pytest.approx(2.0)  # 20k ahead of it
    # no prefill pool (colocated): the decode worker prefills, nothing of this request counted yet
    placer.view.own = 0
    assert prefill_wait_s(placer, _Placement(None, "d1"), "r") == pytest.approx(0.4)
    assert prefill_wait_s(object(), _Placement("p1", "d1"), "r") == 0.0  # no picture: no estimate


def test_sheds_what_would_wait_past_its_budget() -> None:
    reg = CollectorRegistry()
    placer = _Placer({"p1": 5_000})
    adm = Admission(AdmissionConfig(max_queue_wait_s=1.0), placer, registry=reg, clock=Clock())
    pl = _Placement("p1", "d1")
    # 0.5 s queued ahead, budget 1 s: admitted, and the estimate returned
    assert adm.check("a", pl, deadline_s=None) == pytest.approx(0.5)
    adm.check("b", pl, deadline_s=30.0)
    with pytest.raises(Refused) as info:
        adm.check("c", pl, deadline_s=0.2)  # the client's deadline is the tighter budget
    assert info.value.reason == "prefill_wait" and info.value.retry_after_ms == pytest.approx(300.0)
    placer.view.tokens["p1"] = 25_000
    with pytest.raises(Refused) as info:
        adm.check("d", pl, deadline_s=None)
    assert info.value.trailing_metadata() == (("retry-after-ms", "1500"),)
    assert "would wait ~2.50 s" in info.value.message and "retry in 1.5 s" in info.value.message
    assert sample(reg, "pdserve_router_admission_refused_total", reason="prefill_wait") == 2
    assert sample(reg, "pdserve_router_admission_wait_estimate_seconds_count") == 4
    # no bound configured and no deadline: nothing is refused for waiting
    Admission(AdmissionConfig(), placer).check("e", pl, deadline_s=None)


def test_allocate_waits_then_succeeds_in_fifo_order() -> None:
    asyncio.run(_allocate_waits_then_succeeds_in_fifo_order())


async def _allocate_waits_then_succeeds_in_fifo_order() -> None:
    reg = CollectorRegistry()
    clock = Clock()
    adm = Admission(AdmissionConfig(allocate_queue_size=8, allocate_queue_wait_s=30.0), registry=reg,
                    clock=clock)
    adm.queue.poll_s = adm.queue.max_poll_s = 3600.0  # only wake() lets the head retry here
    w = Worker(free=0)
    tasks = [asyncio.create_task(adm.allocate("d1", w.attempt(n), deadline_s=None)) for n in "abc"]
    await settle()
    assert adm.queue.waiting("d1") == 3 and sample(reg, "pdserve_router_allocate_queue_waiting") == 3
    assert w.calls == 1  # only the first tried; the others queued behind it without trying
    late = asyncio.create_task(adm.allocate("d1", w.attempt("late"), deadline_s=None))
    await settle()
    assert w.calls == 1 and adm.queue.waiting("d1") == 4  # a newcomer does not jump the queue
    for _ in range(4):
        w.free += 1
        clock.t += 0.5
        adm.freed("d1")
        await settle()
    assert await asyncio.gather(*tasks, late) == ["a", "b", "c", "late"]
    assert w.served == ["a", "b", "c", "late"]
    assert adm.queue.waiting() == 0 and adm.queue._queues == {}
    assert sample(reg, "pdserve_router_allocate_queue_wait_seconds_count", outcome="allocated") == 4
    assert adm.queue.expected_wait_s("d1") == 0.0  # nobody waiting
    assert adm.queue._interval["d1"] == pytest.approx(0.5)  # one dequeue per 0.5 s


def test_two_freed_blocks_serve_two_waiters_at_once() -> None:
    asyncio.run(_two_freed_blocks_serve_two_waiters_at_once())


async def _two_freed_blocks_serve_two_waiters_at_once() -> None:
    q = AllocateQueue(max_waiters=8, max_wait_s=30.0, poll_s=3600.0, max_poll_s=3600.0, clock=Clock())
    w = Worker(free=0)
    tasks = [asyncio.create_task(q.call("d1", w.attempt(n))) for n in "ab"]
    await settle()
    w.free = 2
    q.wake("d1")  # one wake: the head is served, then wakes the next itself
    assert await asyncio.gather(*tasks) == ["a", "b"]
    assert q.waiting() == 0


def test_full_queue_refuses_at_once_and_clearly() -> None:
    asyncio.run(_full_queue_refuses_at_once_and_clearly())


async def _full_queue_refuses_at_once_and_clearly() -> None:
    reg = CollectorRegistry()
    adm = Admission(AdmissionConfig(allocate_queue_size=2, allocate_queue_wait_s=30.0), registry=reg,
                    clock=Clock())
    adm.queue.poll_s = adm.queue.max_poll_s = 3600.0
    w = Worker(free=0)
    waiting = [asyncio.create_task(adm.allocate("d1", w.attempt(n), deadline_s=None)) for n in "ab"]
    await settle()
    with pytest.raises(Refused) as info:
        await adm.allocate("d1", w.attempt("c"), deadline_s=None)
    assert info.value.reason == "queue_full" and "2 requests already wait" in info.value.message
    assert info.value.retry_after_ms >= 100.0
    assert sample(reg, "pdserve_router_admission_refused_total", reason="queue_full") == 1
    assert await adm.allocate("d2", Worker(free=1).attempt("x"), deadline_s=None) == "x"  # per worker
    for t in waiting:  # the clients go away: both leave the queue
        t.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert adm.queue.waiting() == 0 and adm.queue._queues == {}
    assert sample(reg, "pdserve_router_allocate_queue_wait_seconds_count", outcome="cancelled") == 2


def test_no_blocks_within_the_budget_is_refused() -> None:
    asyncio.run(_no_blocks_within_the_budget_is_refused())


async def _no_blocks_within_the_budget_is_refused() -> None:
    clock = Clock()
    q = AllocateQueue(max_waiters=8, max_wait_s=5.0, poll_s=3600.0, max_poll_s=3600.0, clock=clock)
    w = Worker(free=0)
    first = asyncio.create_task(q.call("d1", w.attempt("a"), timeout=2.0))  # the deadline is shorter
    second = asyncio.create_task(q.call("d1", w.attempt("b")))
    await settle()
    clock.t += 2.5
    q.wake("d1")
    with pytest.raises(QueueRefused, match="no free KV blocks for 2.0 s") as info:
        await first
    assert info.value.reason == "no_blocks"
    await settle()
    assert q.waiting("d1") == 1  # the next one is now the head, still within its 5 s
    w.free = 1
    q.wake("d1")
    assert await second == "b" and q.waiting() == 0


def test_other_errors_pass_through_and_leave_no_waiter() -> None:
    asyncio.run(_other_errors_pass_through_and_leave_no_waiter())


async def _other_errors_pass_through_and_leave_no_waiter() -> None:
    q = AllocateQueue(max_waiters=8, max_wait_s=5.0, clock=Clock())

    async def dead():
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata())

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await q.call("d1", dead)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and q.waiting() == 0
    calls = []

    async def full_then_dead():
        calls.append(1)
        if len(calls) == 1:
            raise exhausted()
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata())

    task = asyncio.create_task(q.call("d1", full_then_dead))
    await settle()
    q.wake("d1")
    with pytest.raises(grpc.aio.AioRpcError):
        await task
    assert q.waiting() == 0 and q._queues == {}
    off = AllocateQueue(max_waiters=8, max_wait_s=0.0)  # no waiting configured: the worker's answer stands
    with pytest.raises(grpc.aio.AioRpcError):
        await off.call("d1", Worker(free=0).attempt("a"))


def test_config_validation() -> None:
    for kw in ({"max_queue_wait_s": -1}, {"allocate_queue_size": -1}, {"allocate_queue_wait_s": -0.1},
               {"min_retry_ms": -5}, {"drain": "sometimes"}):
        with pytest.raises(ValueError):
            AdmissionConfig(**kw)
    with pytest.raises(ValueError):
        AllocateQueue(poll_s=0)


def test_push_wait_counts_only_while_others_are_in_flight_at_the_prefill_worker():
    """The prefill worker's recent push wait joins the estimate while other requests are there (their
    transfers are the queue); alone there, or with no prefill pool, it does not: an idle worker always
    admits the next request, which measures the link anew."""
    pl = _Placement("p", "d")
    busy = _Placer({"p": 12_000}, own=2_000, inflight={"p": 3}, push=0.8)
    assert prefill_wait_s(busy, pl, "r") == pytest.approx(1.0 + 0.8)
    alone = _Placer({"p": 2_000}, own=2_000, inflight={"p": 1}, push=0.8)
    assert prefill_wait_s(alone, pl, "r") == pytest.approx(0.0)
    local = _Placer({"d": 5_000}, inflight={"d": 4}, push=0.8)
    assert prefill_wait_s(local, _Placement(None, "d"), "r") == pytest.approx(0.5)


def test_cost_model_push_wait_is_an_ewma_that_fades_and_is_forgotten():
    from router.costs import CostConfig, CostModel

    clock = Clock()
    costs = CostModel(CostConfig(push_wait_alpha=0.5, push_wait_decay_per_s=0.5), clock=clock)
    assert costs.push_wait_s("p") == 0.0
    costs.observe_push_wait("p", 1.0)
    costs.observe_push_wait("p", -1.0)  # no sample (the answer carried none)
    assert costs.push_wait_s("p") == pytest.approx(1.0)
    costs.observe_push_wait("p", 3.0)
    assert costs.push_wait_s("p") == pytest.approx(2.0)
    clock.t += 2.0
    assert costs.push_wait_s("p") == pytest.approx(2.0 * math.exp(-1.0))
    costs.forget("p")  # a restarted worker: nothing learnt about its predecessor holds
    assert costs.push_wait_s("p") == 0.0
    with pytest.raises(ValueError):
        CostConfig(push_wait_alpha=0.0)


def test_drain_wait_bounds_the_estimate_below_when_on():
    """Tokens ahead over the prefill worker's answered rate: the estimate is at least that (with the
    option on), whatever the compute rate and push wait say; never for the decode worker's own queue."""
    pl = _Placement("p", "d")
    slow_link = _Placer({"p": 12_000}, own=2_000, inflight={"p": 5}, push=0.2, drain_rate=4_000.0)
    assert prefill_wait_s(slow_link, pl, "r") == pytest.approx(10_000 / 4_000)
    assert prefill_wait_s(slow_link, pl, "r", drain="off") == pytest.approx(1.0 + 0.2)
    assert prefill_wait_s(slow_link, pl, "r", drain="replace") == pytest.approx(10_000 / 4_000)
    fast_link = _Placer({"p": 12_000}, own=2_000, inflight={"p": 5}, push=0.2, drain_rate=40_000.0)
    assert prefill_wait_s(fast_link, pl, "r") == pytest.approx(1.0 + 0.2)  # compute is the bottleneck
    # replace: the drain wait stands in for the push wait (computed tokens being pushed are in the
    # compute queue already), so the compute queue alone when it is the larger
    assert prefill_wait_s(fast_link, pl, "r", drain="replace") == pytest.approx(1.0)
    local = _Placer({"d": 5_000}, inflight={"d": 4}, drain_rate=1_000.0)
    assert prefill_wait_s(local, _Placement(None, "d"), "r") == pytest.approx(0.5)


def test_cost_model_drain_rate_is_a_ratio_of_ewmas_and_is_forgotten():
    from router.costs import CostConfig, CostModel

    costs = CostModel(CostConfig(drain_alpha=0.5))
    assert costs.drain_s("p", 1_000) == 0.0  # nothing learnt: no term
    costs.observe_answer("p", 2_000, 1.0)
    costs.observe_answer("p", 0, 1.0)  # no sample: nothing queued was answered
    costs.observe_answer("p", 2_000, 0.0)  # no sample: no busy time
    assert costs.drain_s("p", 4_000) == pytest.approx(2.0)
    # A burst: two answers 10 ms apart. The ratio of sums moves by what they carried, not by 1/0.01 s.
    costs.observe_answer("p", 2_000, 0.01)
    assert costs.drain_s("p", 2_000) == pytest.approx(0.505 / 2_000 * 2_000)
    assert costs.drain_s("p", 0) == 0.0
    costs.forget("p")
    assert costs.drain_s("p", 1_000) == 0.0
    with pytest.raises(ValueError):
        CostConfig(drain_alpha=1.5)
