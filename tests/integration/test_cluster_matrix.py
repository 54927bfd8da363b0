"""The remaining transport x shape combinations: 1P1D over NIXL and 2P2D over TCP (greedy parity).

(1P1D over TCP and 2P2D over NIXL are covered, with much more, in test_cluster_1p1d / _2p2d.)
"""

from __future__ import annotations

import pytest
from test_cluster_1p1d import MAX_TOKENS, prompts, reference, run_concurrently

from pdserve.launcher.local import LocalCluster, ucx_tcp_env

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("n,transport", [(1, "nixl"), (2, "tcp")], ids=["1p1d-nixl", "2p2d-tcp"])
def test_greedy_parity(make_checkpoint, tmp_path, n, transport) -> None:
    model = make_checkpoint("llama")
    env = ucx_tcp_env() if transport == "nixl" else {}
    ps, mt = prompts()[1:], MAX_TOKENS[1:]
    want = reference(model, ps, mt)
    with LocalCluster(model, prefill=n, decode=n, transport=transport, env=env, run_dir=tmp_path) as c:
        start = c.free_blocks()
        got = run_concurrently(c.router, ps, mt)
        assert [r.token_ids for r in got] == want
        assert {r.final["transport"] for r in got} == {transport}
        assert len({r.final["decode_worker"] for r in got}) == n
        stats = c.wait_idle(start)
        assert {w: s.free_blocks for w, s in stats.items()} == start
