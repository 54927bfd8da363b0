"""router.conditional: when the decode worker prefills locally instead of disaggregating."""

import pytest

from router.conditional import ConditionalConfig, decide, local_cost_s

CFG = ConditionalConfig(min_uncached_tokens=256, kv_bytes_per_token=131072, default_link_gbps=25.0,
                        transfer_latency_s=0.003, local_prefill_tokens_per_s=30000.0)


def test_short_prompt_prefills_locally():
    d = decide(prompt_tokens=200, cached_tokens=0, config=CFG)
    assert d.local and d.reason == "short_suffix" and d.uncached_tokens == 200


def test_long_history_cached_on_decode_leaves_a_short_suffix():
    d = decide(prompt_tokens=4096, cached_tokens=3900, config=CFG)
    assert d.local and d.reason == "short_suffix" and d.uncached_tokens == 196


def test_long_uncached_prompt_disaggregates():
    d = decide(prompt_tokens=4096, cached_tokens=0, config=CFG)
    assert not d.local and d.reason == "disaggregate"
    assert d.transfer_s < d.recompute_s


def test_slow_link_makes_transfer_slower_than_recompute():
    d = decide(prompt_tokens=4096, cached_tokens=0, config=CFG, link_gbps=0.5)  # ~1 s of transfer
    assert d.local and d.reason == "transfer_slower" and d.transfer_s > d.recompute_s


def test_measured_link_overrides_default_and_zero_falls_back():
    fast = decide(prompt_tokens=2048, cached_tokens=0, config=CFG, link_gbps=200.0)
    default = decide(prompt_tokens=2048, cached_tokens=0, config=CFG, link_gbps=0.0)
    assert fast.transfer_s < default.transfer_s
    assert default.transfer_s == pytest.approx(0.003 + 2048 * 131072 / 25e9)


def test_busy_decode_worker_makes_local_prefill_costlier():
    idle = decide(prompt_tokens=1024, cached_tokens=0, config=CFG, link_gbps=2.5)
    busy = decide(prompt_tokens=1024, cached_tokens=0, config=CFG, link_gbps=2.5, decode_running=64,
                  decode_capacity=64)
    assert busy.recompute_s == pytest.approx(2 * idle.recompute_s)
    assert idle.local and not busy.local


def test_threshold_is_inclusive_and_configurable_and_disable_wins():
    assert decide(prompt_tokens=256, cached_tokens=0, config=CFG).local
    assert not decide(prompt_tokens=257, cached_tokens=0, config=CFG).local
    off = ConditionalConfig(enabled=False)
    d = decide(prompt_tokens=10, cached_tokens=0, config=off)
    assert not d.local and d.reason == "disabled"
    assert decide(prompt_tokens=300, cached_tokens=0, config=ConditionalConfig(min_uncached_tokens=512)).local


def test_fully_cached_prompt_still_computes_its_last_token():
    d = decide(prompt_tokens=64, cached_tokens=64, config=CFG)
    assert d.uncached_tokens == 1 and d.local
    assert set(d.to_dict()) == {"local", "reason", "uncached_tokens", "transfer_s", "recompute_s",
                                "prefill_wait_s"}


@pytest.mark.parametrize("kw", [dict(min_uncached_tokens=-1), dict(kv_bytes_per_token=0),
                                dict(default_link_gbps=0), dict(local_prefill_tokens_per_s=-5),
                                dict(load_weight=-1), dict(max_prefill_wait_s=-0.1), dict(local_duty=0),
                                dict(local_duty=1.5), dict(local_burst_s=-1)])
def test_config_validation(kw):
    with pytest.raises(ValueError):
        ConditionalConfig(**kw)


def test_bad_inputs():
    with pytest.raises(ValueError):
        decide(prompt_tokens=0, cached_tokens=0, config=CFG)


def test_long_prefill_queue_sends_the_prompt_local():
    # 4096 uncached tokens: ~0.14 s to recompute; behind 0.4 s of queue the remote path is slower
    calm = decide(prompt_tokens=4096, cached_tokens=0, config=CFG, prefill_wait_s=0.4)
    busy = decide(prompt_tokens=4096, cached_tokens=0, config=CFG, prefill_wait_s=0.8)
    assert (calm.local, calm.reason) == (False, "disaggregate")  # under max_prefill_wait_s (0.5)
    assert (busy.local, busy.reason, busy.prefill_wait_s) == (True, "prefill_busy", 0.8)
    off = ConditionalConfig(max_prefill_wait_s=0.0)
    d = decide(prompt_tokens=4096, cached_tokens=0, config=off, prefill_wait_s=60.0)
    assert d.reason == "disaggregate"


def test_prefill_busy_still_weighs_the_local_cost():
    # a decode batch at capacity doubles the local cost; 0.6 s of queue still beats 2 x 0.14 s locally,
    # but a prompt whose local recompute is far longer than queue + remote compute stays remote
    slow_local = ConditionalConfig(local_prefill_tokens_per_s=1000.0, attention_s_per_token_pair=0.0)
    d = decide(prompt_tokens=4096, cached_tokens=0, config=slow_local, prefill_wait_s=0.6, decode_running=64,
               decode_capacity=64, link_gbps=400.0)
    assert d.recompute_s > d.prefill_wait_s + d.recompute_s / 2 + d.transfer_s
    assert (d.local, d.reason) == (False, "disaggregate")


def test_every_local_reason_needs_the_budget():
    cost = local_cost_s(4096, 0, CFG)  # 4096 / 30000 tok/s + the attention term
    spent = dict(local_budget_s=0.001)  # less than even the 200-token prompt costs (6.7 ms)
    for kw, reason in ((dict(prompt_tokens=200), "short_suffix"),
                       (dict(prompt_tokens=4096, link_gbps=0.5), "transfer_slower"),
                       (dict(prompt_tokens=4096, prefill_wait_s=2.0), "prefill_busy")):
        assert decide(cached_tokens=0, config=CFG, **kw).reason == reason
        d = decide(cached_tokens=0, config=CFG, **kw, **spent)
        assert (d.local, d.reason) == (False, "local_budget")
    # enough left for this prompt, or a full bucket for one larger than the burst
    assert decide(prompt_tokens=4096, cached_tokens=0, config=CFG, prefill_wait_s=2.0,
                  local_budget_s=cost).local
    small_burst = ConditionalConfig(local_burst_s=0.05)
    assert decide(prompt_tokens=4096, cached_tokens=0, config=small_burst, prefill_wait_s=2.0,
                  local_budget_s=0.05).local
