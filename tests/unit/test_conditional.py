"""router.conditional: when the decode worker prefills locally instead of disaggregating."""

import pytest

from router.conditional import ConditionalConfig, decide

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
    assert set(d.to_dict()) == {"local", "reason", "uncached_tokens", "transfer_s", "recompute_s"}


@pytest.mark.parametrize("kw", [dict(min_uncached_tokens=-1), dict(kv_bytes_per_token=0),
                                dict(default_link_gbps=0), dict(local_prefill_tokens_per_s=-5),
                                dict(load_weight=-1)])
def test_config_validation(kw):
    with pytest.raises(ValueError):
        ConditionalConfig(**kw)


def test_bad_inputs():
    with pytest.raises(ValueError):
        decide(prompt_tokens=0, cached_tokens=0, config=CFG)
