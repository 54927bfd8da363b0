"""KV tiers (engine.kv_tiers) in one engine: blocks evicted from the (small) device cache come back from
host memory or disk, token-exact against tiers off; a damaged disk block is recomputed; a restart serves
the old disk blocks only to the same model and layout; every tier stays within its size.

Every engine ends with the leak check of ``engine_factory`` (no block referenced, no request held, no
tier load running, no host slot pinned).
"""

from __future__ import annotations

import random

import pytest

from engine.checkpoint import preset_config
from engine.model import build_model
from pdserve.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("torch_single_thread")

BLOCK = 4
ANSWER = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return build_model(preset_config("tiny"), seed=0)


@pytest.fixture(params=[False, True], ids=["sync", "ahead"])
def make(engine_factory, request):
    def make(model, **overrides):
        cfg = dict(device="cpu", num_blocks=40, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=64,
                   overlap_steps=request.param)
        return engine_factory(model, **{**cfg, **overrides})

    return make


def tiers(host_blocks=0, disk_dir=None, disk_blocks=0):
    """Tiers of so many blocks of the tiny model (float32) at ``BLOCK`` tokens a block."""
    from engine.kv_layout import KVLayout
    from engine.kv_tiers import TierConfig

    layout = KVLayout.for_model(preset_config("tiny"), block_size=BLOCK)
    per_block = layout.num_layers * layout.block_bytes
    return TierConfig(host_bytes=host_blocks * per_block, disk_bytes=disk_blocks * (per_block + 64),
                      disk_dir=None if disk_dir is None else str(disk_dir))


def conversations(engine, sessions=6, turns=4, seed=0):
    """Sessions taking turns round robin: each turn's prompt is the whole conversation so far plus new
    user tokens, so a returning turn's prefix is the previous turn's prompt and answer. Their working set
    (6 x ~70 tokens) is several times the engine's 40 blocks of 4 tokens."""
    rng = random.Random(seed)
    history = [[rng.randrange(3, 1000) for _ in range(12)] for _ in range(sessions)]
    answers = []
    for _ in range(turns):
        for s in range(sessions):
            out = engine.generate([history[s]], ANSWER)[0]
            answers.append(out)
            history[s] = history[s] + out + [rng.randrange(3, 1000) for _ in range(5)]
    return answers


def test_blocks_come_back_from_host_and_disk_token_exact(make, model, tmp_path):
    reference = conversations(make(model))
    host = make(model, tiers=tiers(host_blocks=64))
    assert conversations(host) == reference
    assert host.tiers.stats.hit_blocks["host"] > 0 and host.tiers.stats.hit_blocks["disk"] == 0
    both = make(model, tiers=tiers(host_blocks=8, disk_dir=tmp_path, disk_blocks=200))
    assert conversations(both) == reference
    stats = both.tiers.stats
    assert stats.hit_blocks["host"] > 0 and stats.hit_blocks["disk"] > 0, stats
    assert stats.load_failures == 0
    # the prompts computed: fewer with tiers (the returning turns' prefixes were loaded, not recomputed)
    assert host.stats.prompt_tokens < make_reference_prompt_tokens(make, model)


def make_reference_prompt_tokens(make, model) -> int:
    engine = make(model)
    conversations(engine)
    return engine.stats.prompt_tokens


def test_disk_only_tier(make, model, tmp_path):
    reference = conversations(make(model), seed=3)
    disk = make(model, tiers=tiers(disk_dir=tmp_path, disk_blocks=300))
    assert conversations(disk, seed=3) == reference
    assert disk.tiers.stats.hit_blocks["disk"] > 0


def _evict_everything(engine, seed=9):
    """Prompts unrelated to anything before, enough to push every cached block out of the device."""
    rng = random.Random(seed)
    for _ in range(8):
        engine.generate([[rng.randrange(3, 1000) for _ in range(40)]], ANSWER)
    engine.tiers.flush()


def test_a_damaged_disk_block_is_recomputed(make, model, tmp_path):
    rng = random.Random(5)
    prompt = [rng.randrange(3, 1000) for _ in range(41)]  # 10 full blocks
    expected = make(model).generate([prompt], ANSWER)[0]
    engine = make(model, tiers=tiers(disk_dir=tmp_path, disk_blocks=300))
    assert engine.generate([prompt], ANSWER)[0] == expected
    _evict_everything(engine)
    files = sorted(engine.tiers.disk.dir.glob("*.kv"), key=lambda p: p.stat().st_mtime_ns)
    assert len(files) >= 10
    from engine.prefix_hash import block_hashes

    hashes = block_hashes(prompt, BLOCK)
    third, sixth = engine.tiers.disk.path(hashes[2]), engine.tiers.disk.path(hashes[5])
    data = bytearray(third.read_bytes())
    data[-7] ^= 0x40  # one bit of the payload
    third.write_bytes(bytes(data))
    sixth.write_bytes(sixth.read_bytes()[:100])  # truncated
    before = engine.tiers.stats.hit_blocks["disk"]
    assert engine.generate([prompt], ANSWER)[0] == expected
    # the first two blocks loaded; the third failed its checksum, so it and everything after it were
    # computed (and published again), never taken half
    assert engine.tiers.stats.hit_blocks["disk"] - before == 2
    assert engine.tiers.disk.corrupt == 1 and engine.tiers.stats.load_failures >= 1
    assert not third.exists()


def test_restart_serves_old_disk_blocks_to_the_same_model_only(make, model, tmp_path):
    rng = random.Random(7)
    prompt = [rng.randrange(3, 1000) for _ in range(33)]
    first = make(model, tiers=tiers(disk_dir=tmp_path, disk_blocks=300))
    expected = first.generate([prompt], ANSWER)[0]
    _evict_everything(first)
    first.close()

    again = make(model, tiers=tiers(disk_dir=tmp_path, disk_blocks=300))
    assert again.generate([prompt], ANSWER)[0] == expected
    assert again.tiers.stats.hit_blocks["disk"] == 8  # 32 of the 33 tokens: all but the sampled one

    other = build_model(preset_config("tiny"), seed=1)  # same shapes, other weights
    stranger = make(other, tiers=tiers(disk_dir=tmp_path, disk_blocks=300))
    assert stranger.tiers.identity != again.tiers.identity
    stranger.generate([prompt], ANSWER)
    assert stranger.tiers.stats.hit_blocks["disk"] == 0
    wider = make(model, block_size=8, tiers=tiers(disk_dir=tmp_path, disk_blocks=300))
    wider.generate([prompt], ANSWER)
    assert wider.tiers.stats.hit_blocks["disk"] == 0


def test_every_tier_stays_within_its_size(make, model, tmp_path):
    engine = make(model, tiers=tiers(host_blocks=6, disk_dir=tmp_path, disk_blocks=20))
    conversations(engine, sessions=6, turns=4, seed=11)
    engine.tiers.flush()
    t = engine.tiers
    assert t.host.capacity == 6 and len(t.host) <= 6
    assert t.host.nbytes == 6 * t.block_bytes
    assert len(t.disk) <= t.disk.capacity_blocks and t.disk.capacity_blocks == 20
    assert len(list(t.disk.dir.glob("*.kv"))) <= 20
    assert t.disk.evictions > 0 and t.host.evictions > 0
    used = t.occupancy()
    assert used["host"][0] <= used["host"][1] and used["disk"][0] <= used["disk"][1]


def test_recompute_wins_when_loading_is_slower(make, model):
    engine = make(model, tiers=tiers(host_blocks=64))
    cost = engine.tiers.cost
    conversations(engine, seed=13)
    assert cost.prefill_tokens_per_s is not None  # measured on the real steps
    assert engine.tiers.stats.hit_blocks["host"] > 0
    # a host tier measured 1000x slower than it is: now recomputing is cheaper, nothing is loaded
    cost.bandwidth["host"] = cost.block_bytes * cost.prefill_tokens_per_s / cost.block_tokens / 1000
    cost.record_load = lambda *a: None  # keep the slow figure
    hits = engine.tiers.stats.hit_blocks["host"]
    reference = conversations(make(model), seed=13)
    assert conversations(engine, seed=13) == reference
    assert engine.tiers.stats.hit_blocks["host"] == hits and engine.tiers.stats.declined_blocks > 0


def test_disaggregated_turns_load_tier_blocks_on_both_sides(make, model, tmp_path):
    """Prefill in one engine, decode in another (the KV of the blocks the decode side lacks copied
    between their caches, as the transfer does): the decode side counts its tier hits as cached at
    reserve time, so fewer blocks travel, and loads them while the prefill side computes."""
    import torch

    reference = conversations(make(model), seed=17)
    prefill = make(model, tiers=tiers(host_blocks=64))
    decode = make(model, tiers=tiers(host_blocks=8, disk_dir=tmp_path, disk_blocks=200))
    shipped = {"blocks": 0}

    class Disaggregated:
        """Just enough of an engine for ``conversations``: generate one prompt over both engines."""

        def generate(self, prompts, params):
            (prompt,) = prompts
            rid = f"r{shipped.setdefault('n', 0)}"
            shipped["n"] += 1
            prefill.add_prefill_request(rid, prompt, params)
            outs = []
            while prefill.has_unfinished():
                outs += prefill.step()
            (first,) = outs
            src = prefill.block_table(rid)
            res = decode.reserve(rid, prompt, params)
            skip = res.num_cached_tokens // BLOCK
            with torch.no_grad():
                decode.kv_cache[:, res.block_ids[skip:]] = prefill.kv_cache[:, src[skip:]]
            shipped["blocks"] += len(src) - skip
            prefill.release(rid)
            decode.commit_prefilled(rid, first.new_token_ids[0])
            rest = []
            while decode.has_unfinished():
                rest += [t for o in decode.step() for t in o.new_token_ids]
            return [[first.new_token_ids[0]] + rest]

    assert conversations(Disaggregated(), seed=17) == reference
    assert prefill.tiers.stats.hit_blocks["host"] > 0
    hits = decode.tiers.stats.hit_blocks
    assert hits["host"] > 0 and hits["disk"] > 0, decode.tiers.stats


def test_a_reservation_whose_tier_load_fails_recomputes_the_gap(make, model, tmp_path):
    """A block counted as cached at reserve time that then fails to load (its disk file damaged) is
    computed by the decode engine itself: the prefill side never sent it."""
    import torch

    from engine.prefix_hash import block_hashes

    rng = random.Random(21)
    prompt = [rng.randrange(3, 1000) for _ in range(30)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = make(model).generate([prompt], params)[0]
    prefill = make(model)
    decode = make(model, tiers=tiers(disk_dir=tmp_path, disk_blocks=200))
    decode.generate([prompt[:24]], SamplingParams(max_tokens=1, ignore_eos=True))  # 6 blocks cached
    _evict_everything(decode)
    hashes = block_hashes(prompt, BLOCK)
    damaged = decode.tiers.disk.path(hashes[3])
    damaged.write_bytes(damaged.read_bytes()[:-1])

    prefill.add_prefill_request("r", prompt, params)
    (first,) = [o for _ in range(100) if prefill.has_unfinished() for o in prefill.step()]
    src = prefill.block_table("r")
    res = decode.reserve("r", prompt, params)
    assert res.num_cached_tokens == 24  # the 6 blocks on disk, counted before they are read
    with torch.no_grad():
        decode.kv_cache[:, res.block_ids[6:]] = prefill.kv_cache[:, src[6:]]
    prefill.release("r")
    decode.commit_prefilled("r", first.new_token_ids[0])
    rest = []
    while decode.has_unfinished():
        rest += [t for o in decode.step() for t in o.new_token_ids]
    assert [first.new_token_ids[0]] + rest == expected
    assert decode.tiers.stats.hit_blocks["disk"] == 3 and decode.tiers.disk.corrupt == 1


def test_consecutive_host_slots_load_in_one_copy():
    """The CUDA load copies a run of consecutive host slots as one view (engine/kv_tiers/tiers._runs);
    any other source alone. Every source lands where it belongs either way."""
    import torch

    from engine.kv_tiers.tiers import _runs

    slots = torch.arange(10 * 6, dtype=torch.float32).view(10, 2, 3)
    sources = [slots[2], slots[3], slots[4], torch.zeros(2, 3), slots[7], slots[6], slots[8], slots[9]]
    runs = list(_runs(sources, slots))
    assert [(i, n) for i, n, _ in runs] == [(0, 3), (3, 1), (4, 1), (5, 1), (6, 2)]
    staging = torch.empty(len(sources), 2, 3)
    for i, n, src in runs:
        staging[i:i + n].copy_(src)
    assert all(torch.equal(staging[k], sources[k]) for k in range(len(sources)))
    assert [(i, n) for i, n, _ in _runs(sources[:2], None)] == [(0, 1), (1, 1)]  # no host tier: one by one


def test_an_engine_config_with_tiers_survives_json():
    """A tensor-parallel rank gets its EngineConfig as JSON (pdserve/app/tp_ranks.py): the tiers come back
    a TierConfig."""
    import json
    from dataclasses import asdict

    from engine.engine_types import EngineConfig
    from engine.kv_tiers import TierConfig

    config = EngineConfig(tiers=TierConfig(host_auto=True, disk_dir="/kv", disk_bytes=1 << 30))
    assert EngineConfig(**json.loads(json.dumps(asdict(config)))) == config
