"""The remaining transport x shape combinations: 1P1D over NIXL and 2P2D over TCP (greedy parity), and
workers launching steps ahead (engine.step_ahead, the GPU default) on CPU: 1P1D over TCP and two
colocated workers behind the router.

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


@pytest.mark.parametrize("shape", ["1p1d-tcp", "colocated-2"])
def test_greedy_parity_with_steps_launched_ahead(make_checkpoint, tmp_path, shape) -> None:
    """Decode and colocated workers launching each step before reading the last one's tokens (forced on
    CPU with PDSERVE_OVERLAP_STEPS=1; prompt chunks, admissions and stops all go through it): the
    cluster's greedy tokens equal a single engine's, and every block comes back."""
    model = make_checkpoint("llama")
    ps, mt = prompts(), MAX_TOKENS
    want = reference(model, ps, mt)
    kw = dict(prefill=0, decode=2, colocated=True) if shape == "colocated-2" else dict(prefill=1, decode=1)
    with LocalCluster(model, transport="tcp", env={"PDSERVE_OVERLAP_STEPS": "1"}, run_dir=tmp_path,
                      **kw) as c:
        start = c.free_blocks()
        got = run_concurrently(c.router, ps, mt)
        assert [r.token_ids for r in got] == want
        stats = c.wait_idle(start)
        assert {w: s.free_blocks for w, s in stats.items()} == start
    ready = [line for log in tmp_path.rglob("*.log") for line in log.read_text().splitlines()
             if "engine ready" in line]
    assert len(ready) == 2 and all("steps launched ahead" in line for line in ready), ready


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


def test_greedy_parity_with_one_decode_call_per_request(make_checkpoint, tmp_path) -> None:
    """``--decode-mux off``: every request's tokens on a Decode call of its own instead of a share of the
    decode worker's DecodeMany call (the default, which the other cluster tests run): the same tokens,
    every block back."""
    model = make_checkpoint("llama")
    ps, mt = prompts(), MAX_TOKENS
    want = reference(model, ps, mt)
    with LocalCluster(model, transport="tcp", run_dir=tmp_path, router_args=("--decode-mux", "off")) as c:
        start = c.free_blocks()
        got = run_concurrently(c.router, ps, mt)
        assert [r.token_ids for r in got] == want
        stats = c.wait_idle(start)
        assert {w: s.free_blocks for w, s in stats.items()} == start
