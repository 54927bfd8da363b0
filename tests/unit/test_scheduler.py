"""Scheduler policy without a model: the 'forward pass' just marks tokens computed and appends one."""

import pytest

from engine.block_manager import BlockManager
from engine.scheduler import Scheduler
from engine.sequence import Sequence, Status
from pdserve.sampling import SamplingParams

BS = 4


def make(num_blocks=64, max_num_seqs=8, budget=16, **kw):
    bm = BlockManager(num_blocks, BS)
    return bm, Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, watermark=0.0, **kw)


def seq(rid, n, max_tokens=4, start=None):
    """Distinct request ids get distinct tokens (no accidental prefix sharing) unless ``start`` says so."""
    start = 1000 * sum(map(ord, rid)) if start is None else start
    return Sequence(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens), arrival=0)


def fake_step(sched: Scheduler, out) -> None:
    """What the engine does after a forward pass (tokens computed, one sampled per finished prompt)."""
    for s in out.scheduled:
        s.seq.num_computed += s.num_tokens
        sched.register_computed(s.seq)
        if s.samples:
            s.seq.tokens.append(7)
            if s.seq.num_output_tokens >= s.seq.params.max_tokens:
                sched.remove(s.seq)


def plan(out):
    return [(s.seq.request_id, s.context_len, s.num_tokens) for s in out.scheduled]


def drain(sched, limit=200):
    for _ in range(limit):
        if not sched.has_work():
            return
        fake_step(sched, sched.schedule())
    raise AssertionError("scheduler did not finish")


def assert_no_leaks(bm, sched):
    assert not sched.has_work() and not sched.held
    assert bm.leak_report() is None


def test_chunked_prefill_under_the_token_budget_then_decode():
    bm, sched = make(budget=16)
    a = seq("a", 50, max_tokens=3)
    sched.add(a)
    steps = []
    while sched.has_work():
        out = sched.schedule()
        steps.append(plan(out))
        fake_step(sched, out)
    assert steps == [[("a", 0, 16)], [("a", 16, 16)], [("a", 32, 16)], [("a", 48, 2)],
                     [("a", 50, 1)], [("a", 51, 1)]]
    assert_no_leaks(bm, sched)


def test_decodes_first_then_chunks_then_admissions_within_budget():
    bm, sched = make(budget=16)
    a, b = seq("a", 3), seq("b", 30)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert plan(out) == [("a", 0, 3), ("b", 0, 13)]
    fake_step(sched, out)
    c = seq("c", 9)
    sched.add(c)
    out = sched.schedule()
    # a decodes (1), b continues its prompt (15 of the remaining 17), nothing left for c.
    assert plan(out) == [("a", 3, 1), ("b", 13, 15)]
    assert out.num_tokens == 16 and c.status is Status.WAITING
    fake_step(sched, out)
    out = sched.schedule()
    assert plan(out) == [("a", 4, 1), ("b", 28, 2), ("c", 0, 9)]
    fake_step(sched, out)
    drain(sched)
    assert_no_leaks(bm, sched)


def test_max_num_seqs_bounds_the_running_set():
    bm, sched = make(max_num_seqs=2, budget=64)
    for i in range(4):
        sched.add(seq(f"s{i}", 5))
    out = sched.schedule()
    assert [r for r, _, _ in plan(out)] == ["s0", "s1"] and len(sched.waiting) == 2
    drain(sched)
    assert_no_leaks(bm, sched)


def test_admission_is_bounded_by_free_blocks_and_first_come_first_served():
    bm, sched = make(num_blocks=10, budget=64)
    a, b, c = seq("a", 30, max_tokens=2), seq("b", 12), seq("c", 4)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    # a takes 8 of 10 blocks; b needs 3 and waits; c would fit but must not jump the queue.
    assert plan(out) == [("a", 0, 30)] and len(a.block_table) == 8
    assert [s.request_id for s in sched.waiting] == ["b", "c"]
    drain(sched)
    assert_no_leaks(bm, sched)


def test_a_decode_that_needs_a_block_preempts_the_newest_sequence():
    bm, sched = make(num_blocks=4, budget=64)
    a, b = seq("a", 8, max_tokens=6), seq("b", 8, max_tokens=6)
    sched.add(a)
    sched.add(b)
    fake_step(sched, sched.schedule())  # both prompts: 2 blocks each, cache full
    assert bm.num_free_blocks == 0
    out = sched.schedule()  # a's 9th token starts a third block: b (newest) is preempted
    assert plan(out) == [("a", 8, 1)]
    assert out.num_preempted == 1 and b.status is Status.WAITING and b.num_computed == 0
    assert b.block_table == [] and sched.waiting[0] is b and len(b.tokens) == 9  # keeps its sampled token
    drain(sched)
    assert b.num_preemptions == 1 and b.num_output_tokens == 6
    assert_no_leaks(bm, sched)


def test_a_lone_sequence_that_cannot_grow_preempts_itself_and_resumes():
    bm, sched = make(num_blocks=3, budget=64)
    a = seq("a", 8, max_tokens=3)
    sched.add(a)
    fake_step(sched, sched.schedule())
    held = bm.allocate(1)  # another owner (e.g. a pinned prefill) takes the last block
    sched.held["other"] = Sequence("other", [1], SamplingParams(), arrival=0)
    out = sched.schedule()
    assert plan(out) == [] and a.status is Status.WAITING  # waits instead of failing or crashing
    bm.release(held)
    del sched.held["other"]
    drain(sched)
    assert a.num_output_tokens == 3
    assert_no_leaks(bm, sched)


def test_request_that_can_never_be_admitted_is_rejected_with_a_clear_error():
    bm, sched = make(num_blocks=4, budget=64)
    leaked = bm.allocate(3)  # blocks held outside the scheduler's knowledge
    s = seq("x", 8)
    sched.add(s)
    out = sched.schedule()
    assert out.rejected == [s] and s.finish_reason == "error"
    assert "KV cache exhausted" in s.error and "needs 2 blocks" in s.error and "1 of 4" in s.error
    bm.release(leaked)
    assert_no_leaks(bm, sched)


def test_prefix_hit_shares_blocks_and_skips_their_compute():
    bm, sched = make(budget=64)
    a = seq("a", 18, max_tokens=1, start=0)
    sched.add(a)
    fake_step(sched, sched.schedule())  # a finished: its 4 full blocks stay cached
    assert a.status is Status.FINISHED and bm.num_cached_free_blocks == 4
    b, c = seq("b", 18, max_tokens=2, start=0), seq("c", 16, max_tokens=2, start=0)
    sched.add(b)
    sched.add(c)
    out = sched.schedule()
    # b hits all 4 full blocks; c's prompt is exactly 4 blocks, so it reuses 3 and recomputes the last.
    assert plan(out) == [("b", 16, 2), ("c", 12, 4)]
    assert b.block_table[:3] == c.block_table[:3] and bm.ref_count(b.block_table[0]) == 2
    assert b.num_cached_tokens == 16 and c.num_cached_tokens == 12
    drain(sched)
    assert_no_leaks(bm, sched)


def test_prefix_caching_off_never_hits():
    bm, sched = make(budget=64, enable_prefix_caching=False)
    for rid in ("a", "b"):
        s = seq(rid, 18, max_tokens=1, start=0)
        sched.add(s)
        out = sched.schedule()
        assert plan(out) == [(rid, 0, 18)]
        fake_step(sched, out)
    assert bm.num_cached_free_blocks == 0
    assert_no_leaks(bm, sched)


def test_budget_must_cover_every_running_decode():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make(max_num_seqs=32, budget=16)
