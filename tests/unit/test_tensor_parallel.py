"""Tensor parallelism on CPU (gloo; ranks are threads of the test process, see ``tp_testkit``).

* Shard arithmetic: query/KV head ranges, replicated KV heads when ranks outnumber them, refusals.
* Loading: each rank reads only its slices of the checkpoint (also from a sharded checkpoint with an
  index); no rank holds the whole model.
* Logits: TP 2 and 4 float32 logits over a paged cache (a prompt in two chunks, then decode tokens)
  equal TP 1's within 1e-4, for Llama (GQA 4/2), Qwen2 (q/k/v bias) and models with fewer KV heads
  than ranks (2 KV heads at TP 4; multi-query, 1 KV head, at TP 2 and 4).
* Engine: greedy continuous-batch generation at TP 2 and 4 is token-identical to TP 1 and to
  ``transformers``; the followers run every step rank 0 runs; the KV layout fingerprint does not
  depend on TP; rank 0's leak check passes and ``close()`` releases the followers.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from tp_testkit import run_ranks, tp_engine_run
from transformers import AutoModelForCausalLM

from engine.attention import BatchSpec, get_backend
from engine.config import ModelConfig
from engine.engine import EngineConfig, LLMEngine
from engine.kv_layout import KVLayout
from engine.model import build_model
from engine.tp_shard import TPShard, check_tp, kv_head_range
from engine.weights import load_weights
from pdserve.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("torch_single_thread")
BLOCK = 4
MODELS = {
    "llama-gqa": dict(arch="llama"),
    "qwen2-bias": dict(arch="qwen2"),
    "llama-mqa": dict(arch="llama", num_kv_heads=1),
}


def test_head_ranges_split_or_replicate_kv_heads():
    assert [kv_head_range(8, 2, r) for r in range(2)] == [(0, 4), (4, 8)]
    assert [kv_head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_range(1, 4, r) for r in range(4)] == [(0, 1)] * 4
    shards = [TPShard(rank=r, size=4, num_heads=8, num_kv_heads=2, head_dim=16, intermediate_size=64,
                      vocab_size=10) for r in range(4)]
    assert [s.kv_owner for s in shards] == [True, False, True, False]
    assert [(s.vocab_start, s.vocab_per_rank) for s in shards] == [(0, 3), (3, 3), (6, 3), (9, 3)]
    with pytest.raises(ValueError, match="does not divide the 6 attention heads"):
        check_tp(num_heads=6, num_kv_heads=2, size=4)
    with pytest.raises(ValueError, match="neither divides nor is a multiple of the 6 KV heads"):
        check_tp(num_heads=12, num_kv_heads=6, size=4)
    with pytest.raises(ValueError, match="intermediate size"):
        TPShard(rank=0, size=2, num_heads=4, num_kv_heads=2, head_dim=4, intermediate_size=5, vocab_size=8)


def _sharded_model(path, group):
    config = ModelConfig.from_pretrained(path)
    model = build_model(config, init="meta", tp=group)
    load_weights(model, path, dtype=torch.float32, device="cpu", slices=model.tp_slices())
    return model.eval()


@torch.inference_mode()
def _paged_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits of every position: the prompt's first 7 tokens, then the next 6, then one at a time."""
    cfg, shard = model.config, model.shard
    heads = cfg.num_heads if shard is None else shard.local_heads
    kv_heads = cfg.num_kv_heads if shard is None else shard.local_kv_heads
    layout = KVLayout(num_layers=cfg.num_layers, num_kv_heads=kv_heads, head_dim=cfg.head_dim,
                      block_size=BLOCK)
    cache = layout.allocate(16)
    table = random.Random(3).sample(range(16), -(-len(tokens) // BLOCK))
    backend = get_backend("torch", device="cpu", num_heads=heads, num_kv_heads=kv_heads,
                          head_dim=cfg.head_dim, block_size=BLOCK, sliding_window=cfg.sliding_window)
    bounds = [0, 7, 13] + list(range(14, len(tokens) + 1))
    rows = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        meta = backend.plan(BatchSpec(query_lens=[end - start], context_lens=[start], block_tables=[table]))
        hidden = model(torch.tensor(tokens[start:end]), meta.positions, cache, meta)
        rows.append(model.compute_logits(hidden))
    return torch.cat(rows)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_tp_logits_equal_tp1(make_checkpoint, name):
    path = make_checkpoint(**MODELS[name])
    tokens = [random.Random(7).randrange(3, 1024) for _ in range(18)]
    ref = _paged_logits(build_model(ModelConfig.from_pretrained(path), init="random"), tokens)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        assert (hf(torch.tensor([tokens])).logits[0] - ref).abs().max().item() <= 1e-4
    for size in (2, 4):
        got = run_ranks(size, lambda g: _paged_logits(_sharded_model(path, g), tokens))
        for rank, logits in enumerate(got):  # every rank ends with the whole vocabulary's logits
            assert logits.shape == ref.shape
            diff = (logits - ref).abs().max().item()
            assert diff <= 1e-4, f"{name} TP {size} rank {rank}: max |logits diff| {diff}"


def test_no_rank_holds_the_whole_model(make_checkpoint):
    path = make_checkpoint("llama", max_shard_bytes=200_000)  # several files + an index
    full = sum(p.numel() for p in build_model(ModelConfig.from_pretrained(path), init="random").parameters())

    def held(group):
        model = _sharded_model(path, group)
        attn = model.model.layers[0].self_attn
        return (sum(p.numel() for p in model.parameters()), tuple(attn.q_proj.weight.shape),
                tuple(attn.k_proj.weight.shape), tuple(model.model.embed_tokens.weight.shape))

    two = run_ranks(2, held)
    assert [h[1:] for h in two] == [((32, 64), (16, 64), (512, 64))] * 2
    norms = 64 * 9  # 2 per layer + the final norm: the only replicated parameters
    assert all(h[0] == (full - norms) // 2 + norms for h in two)


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 1024) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def _hf_greedy(path, prompts, max_tokens):
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                              do_sample=False, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_tp_engine_greedy_matches_tp1_and_transformers(make_checkpoint, name):
    path = make_checkpoint(**MODELS[name])
    # A small batch budget: prompts are chunked and queue behind each other; prefix hits in round 2.
    config = EngineConfig(model=str(path), device="cpu", num_blocks=96, block_size=BLOCK, max_num_seqs=4,
                          max_num_batched_tokens=24)
    prompts = _prompts(5)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    tp1 = LLMEngine(config)
    ref = tp1.generate(prompts, params)
    assert ref == _hf_greedy(path, prompts, 8)
    assert tp1.leak_report() is None
    for size in (2, 4):
        (first, second, compat), follower_steps, steps = tp_engine_run(
            size, config, lambda e: (e.generate(prompts, params), e.generate(prompts, params),
                                     e.kv_layout.compat_hash()))
        assert first == ref and second == ref, f"{name} TP {size}"
        assert compat == tp1.kv_layout.compat_hash()  # TP does not change which KV is interchangeable
        assert follower_steps == [steps] * (size - 1)


def test_tp_engine_steps_launched_ahead_match_tp1(make_checkpoint):
    """Decode steps launched ahead under TP (engine.step_ahead, engine.tp_plan FLAG_TOKENS): every rank
    receives rank 0's sampled ids and feeds the next step from them; greedy tokens with stops read one step
    late and seeded tokens equal a synchronous TP 1 engine's, and every rank ran the same steps."""
    path = make_checkpoint(**MODELS["llama-gqa"])
    base = dict(model=str(path), device="cpu", num_blocks=96, block_size=BLOCK, max_num_seqs=4,
                max_num_batched_tokens=24)
    prompts = _prompts(5)
    prompts[3] = prompts[3] + list(range(40, 100))  # chunks of 24 tokens, some steps sample nothing
    ref_engine = LLMEngine(EngineConfig(**base, overlap_steps=False))
    free = ref_engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    params = [SamplingParams(max_tokens=12, stop_token_ids=[out[5]]) for out in free[:3]]
    params += [SamplingParams(max_tokens=10, temperature=0.9, seed=i, ignore_eos=True) for i in range(2)]
    ref = ref_engine.generate(prompts, params)
    assert any(len(r) < 12 for r in ref[:3])
    fed = []

    def body(engine):
        launch = engine.runner.launch

        def counted(batch, prev=None, **kw):
            fed.append(prev is not None)
            return launch(batch, prev, **kw)

        engine.runner.launch = counted
        assert engine.overlap_steps
        out = engine.generate(prompts, params)
        # one long prompt alone: its first chunks are launched ahead and sample nothing
        alone = engine.generate([prompts[3]], SamplingParams(max_tokens=4, ignore_eos=True))
        return out, alone

    (got, alone), follower_steps, steps = tp_engine_run(2, EngineConfig(**base, overlap_steps=True), body)
    assert alone == ref_engine.generate([prompts[3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert got == ref
    assert sum(fed) > 5 and follower_steps == [steps]


def test_tp_engine_kv_cache_holds_the_ranks_heads(make_checkpoint):
    config = EngineConfig(model=str(make_checkpoint("llama")), device="cpu", num_blocks=32, block_size=BLOCK)

    def shapes(engine):
        return tuple(engine.kv_cache.shape), engine.rank_kv_layout.num_kv_heads, engine.kv_layout.num_kv_heads

    (shape, local, total), _, _ = tp_engine_run(2, config, shapes)
    assert shape == (4, 32, 2, BLOCK, 1, 16) and (local, total) == (1, 2)


def test_70b_presets_split_over_2_4_8_ranks():
    from engine.checkpoint import SHORT_70B_LAYERS, preset_config

    full, short = preset_config("llama3-70b"), preset_config("llama3-70b-short")
    assert full.num_parameters() == 70_553_706_496  # Llama-3.1-70B exactly
    assert (full.hidden_size, full.intermediate_size, full.num_heads, full.num_kv_heads, full.num_layers) == \
        (8192, 28672, 64, 8, 80)
    assert dataclasses.replace(full, num_layers=SHORT_70B_LAYERS) == short
    for size in (2, 4, 8):
        shard = TPShard.for_model(full, rank=size - 1, size=size)
        assert (shard.local_heads, shard.local_kv_heads, shard.local_intermediate) == \
            (64 // size, 8 // size, 28672 // size)


def test_step_plan_carries_rank_zeros_graph_decision(monkeypatch) -> None:
    """A follower replays its decode graph exactly when rank 0 does (FLAG_GRAPH travels in the plan); graphs
    at TP > 1 are on unless PDSERVE_TP_CUDA_GRAPHS=0 (and on CPU nothing is captured anyway)."""
    from engine.model_runner import tp_graphs
    from engine.tp_plan import FLAG_GRAPH, StepPlan, receive, send_step

    spec = BatchSpec(query_lens=[1, 1], context_lens=[5, 9], block_tables=[[3], [4, 7]])

    def rank(group):
        if group.rank == 0:
            send_step(group, StepPlan(input_ids=[11, 12], spec=spec, rows=[0, 1], flags=FLAG_GRAPH))
            return None
        return receive(group)

    got = run_ranks(2, rank)[1]
    assert got.flags == FLAG_GRAPH and got.input_ids == [11, 12] and got.rows == [0, 1]
    assert (got.spec.query_lens, got.spec.context_lens) == (spec.query_lens, spec.context_lens)
    assert [list(t) for t in got.spec.block_tables] == spec.block_tables
    monkeypatch.delenv("PDSERVE_TP_CUDA_GRAPHS", raising=False)
    assert tp_graphs()
    monkeypatch.setenv("PDSERVE_TP_CUDA_GRAPHS", "0")
    assert not tp_graphs()


def test_step_plans_posted_back_to_back_arrive_in_order_on_every_follower() -> None:
    """Rank 0 posts a plan's broadcasts without waiting (engine.tp_plan.PendingSend) and may post the next
    before the first was waited for: every follower receives each plan whole and in order, its block
    tables as numpy views (mixed prefill / decode shapes, 1..40 sequences, tables of 1..300 blocks)."""
    from engine.tp_plan import StepPlan, receive, send_step, send_stop

    rng = random.Random(7)
    plans = []
    for _ in range(12):
        seqs = rng.randint(1, 40)
        qlens = [rng.choice([1, 1, 1, rng.randint(2, 64)]) for _ in range(seqs)]
        tables = [[rng.randrange(10_000) for _ in range(rng.randint(1, 300))] for _ in range(seqs)]
        spec = BatchSpec(query_lens=qlens, context_lens=[rng.randint(0, 4000) for _ in range(seqs)],
                         block_tables=tables)
        fed = sorted(rng.sample(range(seqs), rng.randint(0, seqs)))
        plans.append(StepPlan(input_ids=[rng.randrange(32_000) for _ in range(sum(qlens))], spec=spec,
                              rows=sorted(rng.sample(range(sum(qlens)), min(seqs, sum(qlens)))),
                              flags=rng.randint(0, 3), fed_dst=fed, fed_src=[rng.randrange(64) for _ in fed]))

    def rank(group):
        if group.rank == 0:
            pending = [send_step(group, plan) for plan in plans]
            for p in pending:
                p.wait()
            send_stop(group)
            return None
        got = []
        while (plan := receive(group)) is not None:
            got.append(plan)
        return got

    for got in run_ranks(3, rank)[1:]:
        assert len(got) == len(plans)
        for want, plan in zip(plans, got, strict=True):
            assert (plan.input_ids, plan.rows, plan.flags) == (want.input_ids, want.rows, want.flags)
            assert (plan.fed_dst, plan.fed_src) == (want.fed_dst, want.fed_src)
            assert (plan.spec.query_lens, plan.spec.context_lens) == (want.spec.query_lens,
                                                                        want.spec.context_lens)
            assert [list(t) for t in plan.spec.block_tables] == want.spec.block_tables
