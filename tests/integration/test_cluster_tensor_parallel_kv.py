"""Prefill and decode pools of different tensor-parallel sizes, as real processes (ranks over gloo, one KV
agent per rank): each decode rank receives exactly its KV heads from the prefill ranks that hold them.
Greedy output through the router is token-identical to a single TP-1 engine; afterwards every block is
back and every rank of every worker holds no transfer, expectation or staging block (asked through each
rank's KVRank control service, whose addresses the worker logs)."""

from __future__ import annotations

import re

import grpc
import pytest
from test_cluster_1p1d import MAX_TOKENS, prompts, reference, run_concurrently

from pdserve.app.launcher.local import LocalCluster, ucx_tcp_env
from pdserve.v1 import kvrank_pb2, kvrank_pb2_grpc

pytestmark = pytest.mark.slow
ARGS = ("--num-blocks", "128", "--device", "cpu")


def rank_stats(log_path) -> list[dict[str, int]]:
    """Every rank's KV agent counts, from the KVRank services the worker's rank 0 logged."""
    text = open(log_path).read()
    found = re.findall(r"KV ranks: .*; control ((?:127\.0\.0\.1:\d+ ?)+)", text)
    assert found, f"no KV ranks line in {log_path}"
    out = []
    for address in found[-1].split():
        with grpc.insecure_channel(address) as ch:
            stats = kvrank_pb2_grpc.KVRankStub(ch).Stats(kvrank_pb2.RankStatsRequest(), timeout=10)
            out.append(dict(stats.counts))
    return out


@pytest.mark.parametrize("prefill_tp,decode_tp,transport", [(2, 1, "tcp"), (1, 2, "nixl"), (2, 4, "nixl")],
                         ids=["p2-d1-tcp", "p1-d2-nixl", "p2-d4-replicated-nixl"])
def test_heterogeneous_tp_pools_match_engine(make_checkpoint, tmp_path, prefill_tp, decode_tp,
                                              transport) -> None:
    model = make_checkpoint("llama")  # 2 KV heads: TP 4 replicates each on two ranks
    ps, mt = prompts()[2:], MAX_TOKENS[2:]  # 16..100 tokens: every request moves full blocks
    want = reference(model, ps, mt)
    env = ucx_tcp_env() if transport == "nixl" else {}
    with LocalCluster(model, prefill=1, decode=1, transport=transport, env=env, run_dir=tmp_path,
                      worker_args=ARGS, prefill_args=("--tensor-parallel-size", str(prefill_tp)),
                      decode_args=("--tensor-parallel-size", str(decode_tp), "--kv-source-tp",
                                   str(prefill_tp))) as c:
        start = c.free_blocks()
        got = run_concurrently(c.router, ps, mt)
        assert [r.token_ids for r in got] == want
        assert {r.final["transport"] for r in got} == {transport}
        assert all(r.final["kv_blocks_sent"] > 0 for r in got)
        stats = c.wait_idle(start)
        assert {w: s.free_blocks for w, s in stats.items()} == start
        for h in c.workers:
            ranks = rank_stats(tmp_path / "logs" / f"{h.worker_id}.log")
            assert len(ranks) == (prefill_tp if h.role == "prefill" else decode_tp)
            assert all(s == dict.fromkeys(s, 0) for s in ranks), (h.worker_id, ranks)
