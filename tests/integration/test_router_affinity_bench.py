"""A small run of the affinity benchmark (pdserve/app/loadgen/affinity.py) on real workers: 1 prefill +
2 decode, a ``session+prefix`` router and a ``round_robin`` router on the same workers.

Structural facts only (no timings): with affinity every turn of a session stays on one decode
worker and turn >= 2 ships only the new blocks — the decode worker reuses every full block of the
previous turn's prompt + answer (``kv_blocks_reused``), and ``kv_blocks_sent`` is exactly the rest
of the prompt; the prompt-cache hit ratio with affinity is above round robin's on the same
workload; the report's byte totals add up. Ends with the leak checks.
"""

from __future__ import annotations

import pytest

from pdserve.app.loadgen.affinity import chat, chat_report, format_report, policy_routers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
BS = 16


def test_affinity_ships_only_new_blocks_and_beats_round_robin(make_checkpoint, tmp_path) -> None:
    model = make_checkpoint("llama")
    with policy_routers(str(model), ("session+prefix", "round_robin"), prefill=1, decode=2,
                        run_dir=tmp_path, num_blocks=512) as (cluster, routers):
        start = cluster.free_blocks()
        runs = {policy: chat(routers[policy], sessions=4, turns=4, system_len=48, user_len="20",
                             output_len="12", seed=seed, label=policy.replace("+", "-"))
                for seed, policy in enumerate(routers)}
        stats = cluster.wait_idle(start)
        assert {w: s.free_blocks for w, s in stats.items()} == start
    assert all(s.ok for samples in runs.values() for s in samples)
    reports = {p: {"chat": {"requests": len(s), **chat_report(s, BS)}} for p, s in runs.items()}
    print(format_report({"policies": reports}))

    by_session: dict[str, list] = {}
    for s in runs["session+prefix"]:
        by_session.setdefault(s.session, []).append(s)
    assert len(by_session) == 4
    for turns in by_session.values():
        turns.sort(key=lambda s: s.turn)
        assert [s.turn for s in turns] == [0, 1, 2, 3]
        assert len({s.final["decode_worker"] for s in turns}) == 1
        for prev, cur in zip(turns, turns[1:], strict=False):
            held = (prev.prompt_tokens + prev.output_tokens - 1) // BS  # full blocks with KV after a turn
            assert cur.final["session_hit"]
            assert cur.final["kv_blocks_reused"] == held, (prev.prompt_tokens, prev.output_tokens, cur.final)
            assert cur.final["kv_blocks_sent"] == -(-cur.prompt_tokens // BS) - held
    for samples in runs.values():
        for s in samples:  # every prompt block is either reused on decode or sent
            assert s.final["kv_blocks_sent"] + s.final["kv_blocks_reused"] == -(-s.prompt_tokens // BS)
    on, off = reports["session+prefix"]["chat"], reports["round_robin"]["chat"]
    assert on["decode_hit_ratio"] > off["decode_hit_ratio"]
    assert on["kv_blocks_sent"] < off["kv_blocks_sent"] <= off["no_reuse_blocks"]
    assert on["kv_bytes_sent"] == sum(s.final["kv_bytes_sent"] for s in runs["session+prefix"])
    assert on["session_moves"] == 0 and on["turn2plus"]["session_hits"] == 12
