"""1P1D greedy parity with layer-wise KV push set explicitly (PDSERVE_KV_STREAM_LAYERS), both ways, and with
the decode worker's KV plane on an event loop of its own thread (PDSERVE_KV_OWN_LOOP).

The default (on) over TCP is test_cluster_1p1d, and over NIXL test_cluster_matrix; here streaming on
over NIXL (UCX_TLS=tcp) and off over TCP, each ending with every KV block back on both workers. That
the worker really streams (not silently one piece) is asserted in tests/unit/test_prefill_stream.py.
"""

from __future__ import annotations

import pytest
from test_cluster_1p1d import MAX_TOKENS, prompts, reference, run_concurrently

from pdserve.app.launcher.local import LocalCluster, ucx_tcp_env

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("transport,stream,own_loop", [("nixl", "on", "off"), ("tcp", "off", "off"),
                                                       ("tcp", "on", "on"), ("nixl", "on", "on")],
                         ids=["nixl-stream-on", "tcp-stream-off", "tcp-own-loop", "nixl-own-loop"])
def test_greedy_parity_with_layer_stream_setting(make_checkpoint, tmp_path, transport, stream,
                                                 own_loop) -> None:
    """Also with the decode worker's KV plane on an event loop of its own (PDSERVE_KV_OWN_LOOP=on)."""
    model = make_checkpoint("llama")
    env = {**(ucx_tcp_env() if transport == "nixl" else {}), "PDSERVE_KV_STREAM_LAYERS": stream,
           "PDSERVE_KV_OWN_LOOP": own_loop}
    ps, mt = prompts(), MAX_TOKENS
    want = reference(model, ps, mt)
    with LocalCluster(model, prefill=1, decode=1, transport=transport, env=env, run_dir=tmp_path) as c:
        start = c.free_blocks()
        got = run_concurrently(c.router, ps, mt)
        assert [r.token_ids for r in got] == want
        assert {r.final["transport"] for r in got} == {transport}
        assert got[-1].final["kv_blocks_sent"] == 7  # the 100-token prompt
        stats = c.wait_idle(start)
        assert {w: s.free_blocks for w, s in stats.items()} == start
