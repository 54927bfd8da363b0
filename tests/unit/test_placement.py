"""Placer unit tests: policies, scoring, bounded load, affinity, moves, incarnation fencing, the one
picture of open placements (every test ends with nothing open)."""

from __future__ import annotations

import dataclasses

import pytest
from fake_clock import Clock

from bench.placement_fakes import request, workers
from router.costs import CostConfig
from router.placement import (
    NoWorkersAvailable,
    Outcome,
    Placer,
    PlacerConfig,
    WorkerInfo,
    WorkerLoad,
)
from router.placement.scoring import load_cap


def make(policy="prefix", n_p=2, n_d=3, clock=None, **kw) -> Placer:
    clock = clock or Clock(1000.0)
    pl = Placer(PlacerConfig(policy=policy, **kw), clock=clock, wall=clock)
    pl.update_workers(workers(n_p, n_d))
    return pl


def toks(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 32000 for i in range(n)]


def finish(pl: Placer) -> None:
    """Leak check: nothing left in flight."""
    assert pl.inflight_total == 0
    assert all(pl.view.inflight(w) == 0 and pl.view.outstanding_tokens(w) == 0 for w in pl.view.workers)


def test_round_robin_cycles_and_skips_excluded():
    pl = make("round_robin")
    seen = [pl.place(request(f"r{i}", toks(40))) for i in range(6)]
    assert [s.decode.worker_id for s in seen] == ["d0", "d1", "d2", "d0", "d1", "d2"]
    assert [s.prefill.worker_id for s in seen] == ["p0", "p1"] * 3
    s = pl.place(request("rx", toks(40)), exclude={"d0", "d1"})
    assert s.decode.worker_id == "d2" and s.policy == "round_robin"
    for i, pm in enumerate(seen):
        pl.on_result(request(f"r{i}", toks(40)), pm, Outcome(success=True))
    pl.on_result(request("rx", toks(40)), s, Outcome(success=True))
    finish(pl)


def test_least_loaded_uses_reports_and_inflight():
    pl = make("least_loaded")
    pl.update_load("d0", WorkerLoad(queue_depth=5, num_running=3, free_blocks=10, total_blocks=100))
    pl.update_load("d1", WorkerLoad(queue_depth=0, num_running=1, free_blocks=90, total_blocks=100))
    pl.update_load("d2", WorkerLoad(queue_depth=2, num_running=2, free_blocks=50, total_blocks=100))
    first = pl.place(request("a", toks(32)))
    assert first.decode.worker_id == "d1"
    # d1 now has max(1 reported, 1 own) = 1 -> a second request still goes there (1 < 4), a load
    # report raising it moves the next one.
    pl.update_load("d1", WorkerLoad(queue_depth=9, num_running=1, free_blocks=90, total_blocks=100))
    assert pl.place(request("b", toks(32))).decode.worker_id == "d2"


def test_no_workers_available():
    pl = make()
    with pytest.raises(NoWorkersAvailable):
        pl.place(request("r", toks(32)), exclude={"d0", "d1", "d2"})
    pl.update_workers([w for w in workers(2, 3) if w.role == "decode"])
    with pytest.raises(NoWorkersAvailable, match="prefill"):
        pl.place(request("r", toks(32)))
    assert pl.metrics.no_workers.labels(pool="prefill")._value.get() == 1


def test_prefix_overlap_attracts_pair_and_predicts_cached_blocks():
    pl = make()
    shared = toks(160, seed=1)
    r1 = request("r1", shared + toks(20, seed=2))
    a = pl.place(r1)
    pl.on_result(r1, a, Outcome(success=True, decode_block_hashes=r1.block_hashes,
                                prefill_block_hashes=r1.block_hashes))
    r2 = request("r2", shared + toks(40, seed=3))
    b = pl.place(r2)
    assert (b.prefill.worker_id, b.decode.worker_id) == (a.prefill.worker_id, a.decode.worker_id)
    assert b.predicted_prefill_cached_blocks == 10 and b.predicted_decode_cached_blocks == 10
    pl.on_result(r2, b, Outcome(success=True))
    finish(pl)


def test_reusable_prefix_len_limits_what_is_indexed():
    pl = make()
    t = toks(320, seed=4)
    r = request("r", t, reusable_prefix_len=64)  # 4 blocks of 20 worth caching
    a = pl.place(r)
    assert pl.index.blocks_of(a.prefill.worker_id) == 4
    pl.on_result(r, a, Outcome(success=True))
    b = pl.place(request("r2", t))
    assert b.predicted_prefill_cached_blocks == 4


def test_bounded_load_spreads_a_shared_system_prompt():
    pl = make(n_p=4, n_d=8, epsilon=0.25)
    system = toks(1024, seed=5)
    reqs = [request(f"r{i}", system + toks(64, seed=100 + i)) for i in range(64)]
    placed = [pl.place(r) for r in reqs]  # nothing finishes: in-flight only grows
    per_d: dict[str, int] = {}
    for p in placed:
        per_d[p.decode.worker_id] = per_d.get(p.decode.worker_id, 0) + 1
    # no worker past the bound, so the 64 requests spread over at least ceil(64 / 11) = 6 workers
    assert max(per_d.values()) <= load_cap([64 // 8] * 8, 0.25) == 11 and len(per_d) >= 6
    for r, p in zip(reqs, placed, strict=True):
        pl.on_result(r, p, Outcome(success=True))
    finish(pl)


def test_kv_headroom_avoids_full_decode_worker():
    pl = make(n_p=1, n_d=2)
    t = toks(320, seed=6)
    r = request("r", t)
    first = pl.place(r)
    pl.on_result(r, first, Outcome(success=True, decode_block_hashes=r.block_hashes))
    held = first.decode.worker_id
    other = "d1" if held == "d0" else "d0"
    pl.update_load(held, WorkerLoad(free_blocks=0, total_blocks=100))
    pl.update_load(other, WorkerLoad(free_blocks=100, total_blocks=100))
    r2 = request("r2", t + toks(320, seed=7))  # needs 20 more blocks on the holder: it has none free
    assert pl.place(r2).decode.worker_id == other


def test_measured_slow_link_is_avoided():
    pl = make(n_p=2, n_d=1, costs=CostConfig(kv_bytes_per_token=1 << 16, default_bandwidth_Bps=1e10))
    r = request("r", toks(640, seed=8))
    first = pl.place(r)
    slow = first.prefill.worker_id
    pl.on_result(r, first, Outcome(success=True, blocks_sent=40, bytes_sent=40 << 20, transfer_s=4.0))
    assert pl.costs.bandwidth(slow, "d0") < 1e8
    r2 = request("r2", toks(640, seed=9))
    assert pl.place(r2).prefill.worker_id != slow


def test_session_affinity_sticks_then_moves_when_decode_fails():
    pl = make("session+prefix")
    history: list[int] = toks(64, seed=10)
    pairs = []
    for turn in range(5):
        r = request(f"s1-t{turn}", history, session_id="s1")
        p = pl.place(r)
        pairs.append((p.prefill.worker_id, p.decode.worker_id))
        assert p.session_hit == (turn > 0) and not p.session_moved
        pl.on_result(r, p, Outcome(success=True, decode_block_hashes=r.block_hashes))
        history = history + toks(48, seed=20 + turn)
    assert len(set(pairs)) == 1
    bound = pairs[0]
    pl.mark_unhealthy(bound[1])
    r = request("s1-t5", history, session_id="s1")
    moved = pl.place(r)
    assert moved.session_moved and moved.moved_from == bound and moved.decode.worker_id != bound[1]
    assert moved.move_reason == f"{bound[1]} unhealthy" and moved.moved_from_str == "/".join(bound)
    pl.on_result(r, moved, Outcome(success=True, decode_block_hashes=r.block_hashes))
    nxt = pl.place(request("s1-t6", history + toks(16, seed=99), session_id="s1"))
    assert nxt.session_hit and nxt.decode.worker_id == moved.decode.worker_id
    assert pl.metrics.session_moves.labels(reason="unhealthy")._value.get() == 1
    assert pl.metrics.affinity_hits._value.get() == 5


def test_failed_outcome_marks_worker_unhealthy_and_cooldown_expires():
    clock = Clock(1000.0)
    pl = make("session+prefix", clock=clock, unhealthy_cooldown_s=5.0)
    r = request("a", toks(64), session_id="s")
    p = pl.place(r)
    pl.on_result(r, p, Outcome(success=False, error="UNAVAILABLE", failed_worker_id=p.decode.worker_id))
    assert not pl.view.healthy(p.decode.worker_id)
    assert pl.index.match(r.block_hashes).get(p.decode.worker_id, 0) == 0
    clock.t += 6
    assert pl.view.healthy(p.decode.worker_id)
    finish(pl)


def test_worker_back_under_a_new_incarnation_is_placeable_at_once():
    # A worker killed -9 leaves the view (its poll failed), polls keep failing and marking it while it
    # is down, then its restarted process answers: placeable at once, not after the cooldown. The same
    # process back (a network blip) keeps the cooldown its failures earned.
    clock = Clock(1000.0)
    pl = make("prefix", clock=clock, unhealthy_cooldown_s=5.0)
    everyone = workers(2, 3)
    d = everyone[-1].worker_id
    pl.mark_unhealthy(d)
    pl.update_workers([w for w in everyone if w.worker_id != d])
    pl.mark_unhealthy(d)  # a later poll of the dead process
    clock.t += 1
    pl.update_workers([dataclasses.replace(w, incarnation="i2") if w.worker_id == d else w for w in everyone])
    assert pl.view.healthy(d) and d in {w.worker_id for w in pl.view.pool("decode")}
    pl.mark_unhealthy(d)
    pl.update_workers([w for w in pl.view.workers.values() if w.worker_id != d])
    pl.mark_unhealthy(d)
    pl.update_workers([dataclasses.replace(w, incarnation="i2") if w.worker_id == d else w for w in everyone])
    assert not pl.view.healthy(d)
    clock.t += 6
    assert pl.view.healthy(d)


def test_overloaded_bound_worker_moves_session():
    pl = make("session+prefix", session_epsilon=0.5)
    r = request("a", toks(64), session_id="s")
    p = pl.place(r)
    pl.on_result(r, p, Outcome(success=True))
    busy = WorkerLoad(queue_depth=30, num_running=8, free_blocks=5, total_blocks=100)
    pl.update_load(p.decode.worker_id, busy)
    q = pl.place(request("b", toks(80), session_id="s"))
    assert q.session_moved and q.move_reason.startswith(f"{p.decode.worker_id} overloaded (")
    assert q.move_kind == "overloaded"
    assert q.decode.worker_id != p.decode.worker_id


def test_restart_with_new_incarnation_fences_old_state():
    pl = make("session+prefix")
    r = request("a", toks(96), session_id="s")
    p = pl.place(r)
    d = p.decode.worker_id
    assert pl.index.blocks_of(d) == 6
    restarted = [dataclasses.replace(w, incarnation="i2") if w.worker_id == d else w for w in workers(2, 3)]
    pl.update_workers(restarted)
    assert pl.index.blocks_of(d) == 0  # a new process holds nothing
    # The old incarnation's late report and late outcome teach nothing.
    pl.update_load(d, WorkerLoad(queue_depth=50, free_blocks=0, total_blocks=10, incarnation="i1"))
    assert pl.view.fresh_load(d) is None
    pl.on_result(r, p, Outcome(success=True, decode_block_hashes=r.block_hashes))
    assert pl.index.blocks_of(d) == 0
    q = pl.place(request("b", toks(112), session_id="s"))
    assert q.decode.incarnation == "i2" or q.decode.worker_id != d
    assert q.session_moved and q.move_reason == f"{d} restarted" and q.moved_from[1] == d
    # Whatever the new pair is, it is bound under current incarnations only.
    b = pl.sessions.get("s")
    assert b is not None and pl.view.workers[b.decode_id].incarnation == b.decode_incarnation


def test_removed_worker_moves_session_and_is_never_chosen():
    pl = make("session+prefix")
    r = request("a", toks(64), session_id="s")
    p = pl.place(r)
    pl.on_result(r, p, Outcome(success=True))
    pl.update_workers([w for w in workers(2, 3) if w.worker_id != p.decode.worker_id])
    for i in range(10):
        r = request(f"b{i}", toks(64), session_id="s")
        q = pl.place(r)
        assert q.decode.worker_id != p.decode.worker_id
        assert q.session_moved == (i == 0) and q.move_kind == ("gone" if i == 0 else "")
        pl.on_result(r, q, Outcome(success=True))
    finish(pl)


def test_session_ttl_expiry_forgets_binding():
    clock = Clock(1000.0)
    pl = make("session+prefix", clock=clock, session_ttl_s=10)
    p = pl.place(request("a", toks(64), session_id="s"))
    clock.t += 5
    assert pl.place(request("b", toks(64), session_id="s")).session_hit  # refreshes TTL to t+15
    clock.t += 9
    assert pl.place(request("c", toks(64), session_id="s")).session_hit
    clock.t += 11
    q = pl.place(request("d", toks(64), session_id="s"))
    assert not q.session_hit and not q.session_moved
    assert p.decode.worker_id  # the first placement was valid


def test_prefix_only_policy_ignores_sessions_but_follows_kv():
    pl = make("prefix_only")
    r = request("a", toks(128, seed=3), session_id="s")
    p = pl.place(r)
    pl.on_result(r, p, Outcome(success=True, decode_block_hashes=r.block_hashes))
    q = pl.place(request("b", toks(160, seed=3), session_id="s"))
    assert not q.session_hit and q.decode.worker_id == p.decode.worker_id
    assert len(pl.sessions) == 0


def test_worker_info_and_config_validation():
    with pytest.raises(ValueError):
        WorkerInfo("w", "router", "x")
    with pytest.raises(ValueError):
        PlacerConfig(policy="random")
    with pytest.raises(ValueError):
        PlacerConfig(epsilon=-1)
    with pytest.raises(ValueError):
        WorkerLoad(free_blocks=5, total_blocks=4)
    with pytest.raises(ValueError):
        make().update_workers([WorkerInfo("w", "prefill", "a"), WorkerInfo("w", "decode", "b")])


def test_metrics_exposed_in_prometheus_text():
    pl = make("session+prefix")
    r = request("a", toks(64), session_id="s")
    p = pl.place(r)
    pl.on_result(r, p, Outcome(success=True, prefill_cached_blocks=2, decode_cached_blocks=3, bytes_sent=4096,
                               fallback="tcp"))
    pl.place(request("b", toks(64), session_id="s"))
    text = pl.metrics.render().decode()
    assert 'pdserve_router_placements_total{policy="session+prefix",pool="decode"' in text
    assert "pdserve_router_affinity_hits_total 1.0" in text
    assert 'pdserve_router_cache_hit_tokens_total{pool="decode"} 48.0' in text
    assert 'pdserve_router_fallbacks_total{kind="tcp"} 1.0' in text
    assert "pdserve_router_kv_bytes_sent_total 4096.0" in text
    assert 'pdserve_router_workers{pool="prefill"} 2.0' in text


def test_default_policy_binds_session_ids():
    pl = make()  # the default policy
    r = request("a", toks(64), session_id="s")
    p = pl.place(r)
    pl.on_result(r, p, Outcome(success=True))
    q = pl.place(request("b", toks(80), session_id="s"))
    assert q.session_hit and q.decode.worker_id == p.decode.worker_id and pl.sessions.get("s") is not None


@pytest.mark.parametrize("late_report", [False, True])
def test_warm_decode_worker_wins_at_equal_load_whatever_the_last_report_says(late_report):
    # Turn by turn, nothing else in flight: the worker that served turn 1 holds its KV and must win,
    # also when its last load report (taken while turn 1 ran, or just after) still counts turn 1.
    pl = make("prefix_only", n_p=1, n_d=2)
    history, first = toks(200, seed=40), ""
    for turn in range(6):
        r = request(f"t{turn}", history)
        p = pl.place(r)
        if turn:
            assert p.decode.worker_id == first and p.predicted_decode_cached_blocks > 0, turn
        else:
            first = p.decode.worker_id
        busy = WorkerLoad(num_running=1, free_blocks=50, total_blocks=100)
        if not late_report:
            pl.update_load(first, busy)  # arrives while the turn runs: our own request, not another's
        pl.on_result(r, p, Outcome(success=True, decode_block_hashes=r.block_hashes))
        if late_report:
            pl.update_load(first, busy)  # taken before the worker dropped the finished turn
        pl.update_load("d1" if first == "d0" else "d0", WorkerLoad(free_blocks=100, total_blocks=100))
        history = history + toks(40, seed=50 + turn)
    finish(pl)


def test_no_prefill_pool_places_a_decode_worker_alone_and_keeps_it_warm():
    pl = Placer(PlacerConfig(prefill_pool=False), clock=Clock(), wall=Clock())
    pl.update_workers([w for w in workers(0, 2)])
    history = toks(160, seed=60)
    r = request("a", history)
    p = pl.place(r)
    assert p.prefill is None and p.prefill_id == ""
    pl.on_result(r, p, Outcome(success=True, decode_block_hashes=r.block_hashes))
    r2 = request("b", history + toks(32, seed=61))
    q = pl.place(r2)  # the warm worker computes only the new tokens: it costs less
    assert q.decode.worker_id == p.decode.worker_id and q.predicted_decode_cached_blocks == 10
    pl.on_result(r2, q, Outcome(success=True))
    s = pl.place(request("c", toks(64, seed=62), session_id="s"))
    assert pl.sessions.get("s").prefill_id == "" and s.prefill is None
    pl.forget_request("c")
    finish(pl)
