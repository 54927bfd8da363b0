"""KV tiers in a real cluster (router + 1 prefill + 1 decode worker, processes on loopback), over TCP and
over NIXL (UCX's TCP transport): conversations whose working set is several times the workers' device
caches come back from the host and disk tiers, token-exact against a plain single-process engine; the
decode worker's Allocate counts its tier blocks as cached (the path report says how many), its metrics
count the hits by tier, every block comes back to the pools, and the router's prefix index follows
the workers' cache events (what it predicted for the decode side is what the decode worker held)."""

from __future__ import annotations

import random

import pytest

from pdserve.app.launcher.local import LocalCluster, ucx_tcp_env
from pdserve.client import Client
from pdserve.probe import free_port, scrape_metrics

pytestmark = pytest.mark.slow
BLOCK_BYTES = 16384  # the tiny preset: 4 layers x (K, V) x 16 tokens x 2 KV heads x 16 dims x fp32


def gb(blocks: int) -> str:
    return repr(blocks * BLOCK_BYTES / 2**30)


def conversations(answer, sessions=12, turns=4, seed=0):
    """Sessions taking turns round robin, each turn the whole conversation so far plus new user tokens."""
    rng = random.Random(seed)
    history = {f"s{i}": [rng.randrange(5, 1000) for _ in range(40)] for i in range(sessions)}
    out = []
    for _ in range(turns):
        for sid in history:
            tokens = answer(sid, history[sid])
            out.append(tokens)
            history[sid] = history[sid] + tokens + [rng.randrange(5, 1000) for _ in range(10)]
    return out


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_conversations_come_back_from_the_tiers_token_exact(make_checkpoint, tmp_path, transport):
    from engine.engine import EngineConfig, LLMEngine
    from pdserve.sampling import SamplingParams

    model = make_checkpoint("llama")
    engine = LLMEngine(EngineConfig(model=str(model), num_blocks=512, device="cpu"))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = conversations(lambda sid, prompt: engine.generate([prompt], params)[0])

    metrics = free_port()
    facts = []
    with LocalCluster(model, transport=transport, env=ucx_tcp_env() if transport == "nixl" else {},
                      run_dir=tmp_path / "run", policy="session+prefix", worker_args=("--num-blocks", "40"),
                      prefill_args=("--kv-host-gb", gb(64)),
                      decode_args=("--kv-host-gb", gb(12), "--kv-disk-dir", str(tmp_path / "kv"),
                                   "--kv-disk-gb", gb(400), "--metrics-port", str(metrics))) as c:
        start = c.free_blocks()

        def answer(sid, prompt):
            with Client(c.router, timeout=120) as client:
                r = client.generate(prompt_ids=prompt, max_tokens=6, ignore_eos=True, session_id=sid)
            facts.append(r.final)
            return list(r.token_ids)

        assert conversations(answer) == expected
        stats = c.wait_idle(start)
        assert {w: s.free_blocks for w, s in stats.items()} == start
        got = scrape_metrics(metrics)
    tier_hits = sum(v for k, v in got.items() if k.startswith("pdserve_worker_prefix_cache_hit_tokens_total")
                    and ('tier="host"' in k or 'tier="disk"' in k))
    assert tier_hits > 0, {k: v for k, v in got.items() if "tier" in k}
    returning = facts[12:]  # every turn after each session's first
    assert sum(f.get("decode_tier_tokens", 0) for f in returning) > 0
    # the router's index follows the decode worker's events: what it predicted it held, it held
    # (within what a poll interval can miss: the events of the turn just before)
    right = sum(f.get("predicted_decode_blocks", 0) == f.get("kv_blocks_reused", 0) for f in returning)
    assert right >= len(returning) // 2, [(f.get("predicted_decode_blocks"), f.get("kv_blocks_reused"))
                                         for f in returning]
