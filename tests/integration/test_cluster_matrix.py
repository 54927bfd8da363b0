"""The remaining transport x shape combinations: 1P1D over NIXL and 2P2D over TCP (greedy parity).

(1P1D over TCP and 2P2D over NIXL are covered, with much more, in test_cluster_1p1d / _2p2d.)
"""

from __future__ import annotations

import pytest
from test_cluster_1p1d import MAX_TOKENS, prompts, reference, run_concurrently

from pdserve.app.launcher.local import LocalCluster, ucx_tcp_env
from pdserve.client import Client

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("n,transport,policy", [(1, "nixl", "round_robin"), (2, "tcp", "session+prefix")],
                         ids=["1p1d-nixl", "2p2d-tcp-sessions"])
def test_greedy_parity(make_checkpoint, tmp_path, n, transport, policy) -> None:
    model = make_checkpoint("llama")
    env = ucx_tcp_env() if transport == "nixl" else {}
    ps, mt = prompts()[1:], MAX_TOKENS[1:]
    want = reference(model, ps, mt)
    with LocalCluster(model, prefill=n, decode=n, transport=transport, env=env, run_dir=tmp_path,
                      policy=policy) as c:
        start = c.free_blocks()
        got = run_concurrently(c.router, ps, mt)
        assert [r.token_ids for r in got] == want
        assert {r.final["transport"] for r in got} == {transport}
        if policy == "session+prefix":
            check_session_turns(c.router)
        stats = c.wait_idle(start)
        assert {w: s.free_blocks for w, s in stats.items()} == start


def check_session_turns(router: str) -> None:
    """Turn 2 of a session (turn 1's prompt + answer + more) lands on turn 1's decode worker, which
    already holds the shared prefix: only the new blocks move."""
    with Client(router, timeout=60) as c:
        for k in range(3):
            history = [11 + k + 3 * i for i in range(70)]
            first = c.generate(prompt_ids=history, max_tokens=8, session_id=f"conv-{k}", ignore_eos=True)
            history = history + first.token_ids + [17 + k] * 20
            second = c.generate(prompt_ids=history, max_tokens=4, session_id=f"conv-{k}", ignore_eos=True)
            assert second.final["decode_worker"] == first.final["decode_worker"]
            assert second.final["kv_blocks_reused"] >= 70 // 16
            assert second.final["kv_blocks_sent"] == -(-len(history) // 16) - second.final["kv_blocks_reused"]
