"""router.conditional.decide: the local-vs-remote rules over the cost model's path estimates."""

import pytest

from router.conditional import ConditionalConfig, Paths, decide
from router.costs import CostConfig, CostModel

CFG = ConditionalConfig(min_uncached_tokens=256)


def paths(prompt: int, cached: int = 0, *, link_Bps: float | None = None, running: int = 0, capacity: int = 1,
          prefill_wait_s: float = 0.0, decode_wait_s: float = 0.0, local_rate: float = 30000.0,
          remote_rate: float = 30000.0, others: int = 0) -> Paths:
    """The estimates a router with llama3-8b's KV size (128 KiB/token) would make. The clock stands
    still: a learned rate decays with the time since it was observed, and two calls on a busy machine
    must estimate the same."""
    costs = CostModel(CostConfig(prefill_tokens_per_s=remote_rate, bandwidth_ewma_alpha=1.0,
                                 min_bandwidth_sample_bytes=1), clock=lambda: 0.0)
    costs.observe_prefill("d", tokens=local_rate, compute_s=1.0)
    if link_Bps is not None:
        costs.observe_transfer("p", "d", bytes_sent=int(link_Bps), seconds=1.0, blocks_sent=0)
    cached = min(cached, prompt - 1)
    return Paths(uncached_tokens=prompt - cached, local_s=costs.prefill_s("d", prompt - cached, cached),
                 remote_s=costs.prefill_s("p", prompt),
                 transfer_s=costs.transfer_s("p", "d", prompt - cached),
                 prefill_wait_s=prefill_wait_s, decode_wait_s=decode_wait_s, decode_running=running,
                 decode_capacity=capacity, other_streams=others)


def test_short_prompt_prefills_locally():
    d = decide(paths(200), CFG)
    assert (d.local, d.reason, d.uncached_tokens) == (True, "short_suffix", 200)


def test_long_history_cached_on_decode_leaves_a_short_suffix():
    d = decide(paths(4096, 3900), CFG)
    assert (d.local, d.reason, d.uncached_tokens) == (True, "short_suffix", 196)


def test_long_uncached_prompt_disaggregates():
    d = decide(paths(4096), CFG)
    assert (d.local, d.reason) == (False, "disaggregate")
    assert d.transfer_s < d.recompute_s and d.remote_path_s > 0


def test_slow_link_makes_transfer_slower_than_recompute():
    d = decide(paths(4096, link_Bps=0.5e9), CFG)  # ~1 s of transfer
    assert (d.local, d.reason) == (True, "transfer_slower") and d.transfer_s > d.recompute_s


def test_busy_decode_worker_makes_local_prefill_costlier():
    idle = decide(paths(1024, link_Bps=2.5e9), CFG)
    busy = decide(paths(1024, link_Bps=2.5e9, running=64, capacity=64), CFG)
    assert busy.recompute_s == pytest.approx(2 * idle.recompute_s)
    assert idle.reason == "transfer_slower" and busy.reason == "disaggregate"


def test_threshold_is_inclusive_and_configurable_and_disable_wins():
    assert decide(paths(256), CFG).local
    assert not decide(paths(257), CFG).local
    d = decide(paths(10), ConditionalConfig(enabled=False))
    assert (d.local, d.reason) == (False, "disabled")
    assert decide(paths(300), ConditionalConfig(min_uncached_tokens=512)).local


@pytest.mark.parametrize("kw", [dict(min_uncached_tokens=-1), dict(load_weight=-1.0),
                                dict(local_duty=0.0), dict(local_duty=1.5), dict(max_prefill_wait_s=-0.1),
                                dict(local_burst_s=-1.0), dict(max_local_stall_s=-0.01),
                                dict(stall_weight=-1.0)])
def test_config_validation(kw):
    with pytest.raises(ValueError):
        ConditionalConfig(**kw)


def test_bad_inputs():
    with pytest.raises(ValueError):
        decide(Paths(uncached_tokens=0, local_s=0.0, remote_s=0.0, transfer_s=0.0), CFG)


def test_long_prefill_queue_sends_the_prompt_local():
    # 4096 tokens: ~0.14 s of compute on either side; the queue rule fires past max_prefill_wait_s
    calm = decide(paths(4096, prefill_wait_s=0.4), CFG)
    busy = decide(paths(4096, prefill_wait_s=0.8), CFG)
    assert (calm.local, calm.reason) == (False, "disaggregate")
    assert (busy.local, busy.reason) == (True, "prefill_busy") and busy.prefill_wait_s == 0.8
    off = ConditionalConfig(max_prefill_wait_s=0.0)
    assert decide(paths(4096, prefill_wait_s=60.0), off).reason == "disaggregate"


def test_prefill_busy_still_weighs_the_local_cost():
    # a decode batch at capacity doubles the local cost: a slow local prefill (4 s) stays remote
    # behind 0.6 s of queue
    d = decide(paths(4096, prefill_wait_s=0.6, running=64, capacity=64, link_Bps=400e9, local_rate=1000.0),
               CFG)
    assert d.recompute_s > d.remote_path_s
    assert (d.local, d.reason) == (False, "disaggregate")


def test_decode_workers_own_queue_keeps_a_local_choice_from_losing():
    # a short suffix is cheaper locally, unless the decode worker's own local prefills queue ahead of
    # it for longer than the whole remote path takes
    assert decide(paths(200, decode_wait_s=0.002), CFG).reason == "short_suffix"  # 8.7 ms < 10.7 ms
    d = decide(paths(200, decode_wait_s=0.5), CFG)
    assert (d.local, d.reason) == (False, "decode_busy") and d.local_path_s > d.remote_path_s
    # the queue rule fires only when the local path (its queue included) beats the remote one
    assert decide(paths(4096, prefill_wait_s=0.8, decode_wait_s=0.9), CFG).reason == "disaggregate"
    # with the load rule off, queues are not weighed at all
    off = ConditionalConfig(max_prefill_wait_s=0.0)
    assert decide(paths(200, decode_wait_s=5.0), off).reason == "short_suffix"


def test_every_local_reason_needs_the_budget():
    spent = dict(local_budget_s=0.001)  # less than even the 200-token prompt costs (6.7 ms)
    for p, reason in ((paths(200), "short_suffix"), (paths(4096, link_Bps=0.5e9), "transfer_slower"),
                      (paths(4096, prefill_wait_s=2.0), "prefill_busy")):
        assert decide(p, CFG).reason == reason
        d = decide(p, CFG, **spent)
        assert (d.local, d.reason) == (False, "local_budget")
    # enough left for this prompt, or a full bucket for one larger than the burst
    p = paths(4096, prefill_wait_s=2.0)
    assert decide(p, CFG, local_budget_s=p.local_s).local
    assert decide(p, ConditionalConfig(local_burst_s=0.05), local_budget_s=0.05).local


def test_a_long_local_prefill_never_stalls_running_streams():
    # 4096 tokens cost 0.137 s locally: behind a long prefill queue that goes local while the decode
    # worker is idle, but not while other streams would each wait the whole 0.137 s for it
    assert decide(paths(4096, prefill_wait_s=2.0), CFG).reason == "prefill_busy"
    d = decide(paths(4096, prefill_wait_s=2.0, others=3), CFG)
    assert (d.local, d.reason) == (False, "decode_stall")
    # a prompt that costs less than the cap (1024 tokens: 34 ms) still goes local under load, and so
    # does a short suffix
    assert decide(paths(1024, prefill_wait_s=2.0, others=3), CFG).reason == "prefill_busy"
    # ... unless the streams' summed wait (100 x 34 ms) exceeds the ~2 s of queue it skips
    d = decide(paths(1024, prefill_wait_s=2.0, others=100), CFG)
    assert (d.local, d.reason) == (False, "decode_stall") and d.remote_path_s - d.local_path_s < 3.4
    assert decide(paths(200, others=50), CFG).reason == "short_suffix"
    # the cap is configurable; with the load rule off nothing is weighed
    assert decide(paths(4096, prefill_wait_s=2.0, others=3), ConditionalConfig(max_local_stall_s=0.2)).local
    off = ConditionalConfig(max_prefill_wait_s=0.0, min_uncached_tokens=8192)
    assert decide(paths(4096, others=3), off).reason == "short_suffix"
