"""A small run of the affinity benchmark (pdserve/app/loadgen/affinity.py) on real workers: 1 prefill +
2 decode, a ``session+prefix`` router and a ``round_robin`` router on the same workers, each named
explicitly (the test does not depend on the default policy).

Structural facts only (no timings, nothing that depends on the order requests reach the router):

* **What affinity guarantees**, with sessions started at once: every turn of a session stays on
  one decode worker and turn >= 2 ships only the new blocks -- the decode worker reuses every full
  block of the previous turn's prompt + answer (``kv_blocks_reused``), and ``kv_blocks_sent`` is
  exactly the rest of the prompt. Fewer sessions than ``PlacerConfig.session_min_load``, so the
  only rule that may move a session (its worker overloaded) cannot fire, whatever the arrival order.
* **Affinity vs round robin**, on a workload where keeping a session cannot happen by accident: one
  session, one turn at a time, so round robin hands consecutive turns to alternate decode workers
  and each turn finds at most the turn before last on its worker, while affinity finds the last
  one. (With several sessions at once round robin can keep every session by luck; how much
  affinity saves on such traffic is the benchmark's job, not this test's.)

The report's byte totals add up. Ends with the leak checks.
"""

from __future__ import annotations

import pytest

from pdserve.app.loadgen.affinity import chat, chat_report, format_report, policy_routers
from router.placement.config import PlacerConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
BS = 16
SESSIONS = 3
TURNS = 4
WORKLOAD = {"turns": TURNS, "system_len": 48, "user_len": "20", "output_len": "12"}


def _by_session(samples) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in samples:
        out.setdefault(s.session, []).append(s)
    for turns in out.values():
        turns.sort(key=lambda s: s.turn)
        assert [s.turn for s in turns] == list(range(TURNS))
    return out


def _held(s) -> int:
    """Full blocks whose KV the decode worker holds after turn ``s`` (the last token has none)."""
    return (s.prompt_tokens + s.output_tokens - 1) // BS


def test_affinity_keeps_sessions_ships_only_new_blocks_and_beats_round_robin(make_checkpoint,
                                                                             tmp_path) -> None:
    assert SESSIONS < PlacerConfig().session_min_load, "a bound worker could count as overloaded"
    model = make_checkpoint("llama")
    with policy_routers(str(model), ("session+prefix", "round_robin"), prefill=1, decode=2,
                        run_dir=tmp_path, num_blocks=512) as (cluster, routers):
        start = cluster.free_blocks()
        together = chat(routers["session+prefix"], sessions=SESSIONS, seed=0, label="together", **WORKLOAD)
        alone = {policy: chat(routers[policy], sessions=1, seed=10 + i, label=f"alone-{i}", **WORKLOAD)
                 for i, policy in enumerate(("session+prefix", "round_robin"))}
        stats = cluster.wait_idle(start)
        assert {w: s.free_blocks for w, s in stats.items()} == start
    runs = {"session+prefix (sessions at once)": together,
            **{f"{policy} (one session)": samples for policy, samples in alone.items()}}
    assert all(s.ok for samples in runs.values() for s in samples)
    reports = {p: {"chat": {"requests": len(s), **chat_report(s, BS)}} for p, s in runs.items()}
    print(format_report({"policies": reports}))

    for samples in (together, alone["session+prefix"]):
        sessions = _by_session(samples)
        for turns in sessions.values():
            assert len({s.final["decode_worker"] for s in turns}) == 1, [s.final for s in turns]
            for prev, cur in zip(turns, turns[1:], strict=False):
                assert cur.final["session_hit"] and not cur.final.get("session_moved"), cur.final
                assert cur.final["kv_blocks_reused"] == _held(prev), (prev.prompt_tokens, prev.output_tokens,
                                                                      cur.final)
                assert cur.final["kv_blocks_sent"] == -(-cur.prompt_tokens // BS) - _held(prev)
    assert len(_by_session(together)) == SESSIONS
    for samples in runs.values():
        for s in samples:  # every prompt block is either reused on decode or sent
            assert s.final["kv_blocks_sent"] + s.final["kv_blocks_reused"] == -(-s.prompt_tokens // BS)

    (rr,) = _by_session(alone["round_robin"]).values()
    workers = [s.final["decode_worker"] for s in rr]
    assert all(a != b for a, b in zip(workers, workers[1:], strict=False)), workers
    for prev, cur in zip(rr, rr[1:], strict=False):  # the worker never saw the previous turn
        assert cur.final["kv_blocks_reused"] < _held(prev), (workers, cur.final)
    on = reports["session+prefix (one session)"]["chat"]
    off = reports["round_robin (one session)"]["chat"]
    assert on["prompt_tokens"] == off["prompt_tokens"]  # the same turns, token for token in length
    assert on["turn2plus"]["decode_hit_ratio"] > off["turn2plus"]["decode_hit_ratio"]
    assert on["kv_blocks_sent"] < off["kv_blocks_sent"] <= off["no_reuse_blocks"]
    for label, samples in runs.items():
        assert reports[label]["chat"]["kv_bytes_sent"] == sum(s.final["kv_bytes_sent"] for s in samples)
    assert reports["session+prefix (sessions at once)"]["chat"]["session_moves"] == 0
    assert reports["session+prefix (sessions at once)"]["chat"]["turn2plus"]["session_hits"] == \
        SESSIONS * (TURNS - 1)
