"""Paged, batched attention equals a straightforward dense forward, for every kind of batch.

The reference below is written independently of ``engine.attention``: one sequence at a time, the
whole sequence at once, dense K/V with ``repeat_interleave`` for GQA and an explicit causal (and
sliding-window) mask. The paged side runs mixed steps — decodes, fresh prompts of different
lengths, later chunks of prompts attending to KV cached by earlier steps — over shuffled block
tables, and every logit it produces must match the reference at the same position.
"""

import random

import pytest
import torch

from engine.attention import BatchSpec, get_backend
from engine.checkpoint import preset_config
from engine.config import RopeScaling
from engine.kv_layout import KVLayout
from engine.model import build_model

BLOCK = 4
CONFIGS = {
    "llama-gqa-tied-llama3rope": dict(arch="llama", tie_word_embeddings=True, rope_scaling=RopeScaling(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16)),
    "mistral-mha-window": dict(arch="mistral", num_kv_heads=4, sliding_window=6),
    "qwen2-bias-linear-rope": dict(arch="qwen2", rope_scaling=RopeScaling(rope_type="linear", factor=2.0)),
}
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def make_model(name: str, device: str = "cpu"):
    kw = dict(CONFIGS[name])
    cfg = preset_config("tiny", arch=kw.pop("arch"), **kw)
    torch.manual_seed(0)
    return build_model(cfg, device=device)


@torch.no_grad()
def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """Dense forward of one whole sequence: ``[len(ids), vocab]``."""
    cfg = model.config
    dev = model.lm_head.weight.device
    n, h, kvh, d = len(ids), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = model.model.embed_tokens(torch.tensor(ids, device=dev))
    pos = torch.arange(n, device=dev)
    cos, sin = (torch.cat([t, t], -1) for t in model.rope(pos, x.dtype))  # [n, 1, d]
    i, j = pos[:, None], pos[None, :]
    allowed = j <= i
    if cfg.sliding_window is not None:
        allowed &= i - j < cfg.sliding_window
    for layer in model.model.layers:
        att = layer.self_attn
        hs = layer.input_layernorm(x)
        q = att.q_proj(hs).view(n, h, d)
        k = att.k_proj(hs).view(n, kvh, d)
        v = att.v_proj(hs).view(n, kvh, d)
        q = q * cos + torch.cat([-q[..., d // 2:], q[..., :d // 2]], -1) * sin
        k = k * cos + torch.cat([-k[..., d // 2:], k[..., :d // 2]], -1) * sin
        k = k.repeat_interleave(h // kvh, dim=1)
        v = v.repeat_interleave(h // kvh, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, h * d)
        x = x + att.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.model.norm(x)).float()


class PagedRunner:
    """Drives the model step by step over a shared paged cache, like the engine does."""

    def __init__(self, model, seqs: dict[str, list[int]], num_blocks: int = 96, seed: int = 0):
        cfg = model.config
        self.model, self.seqs = model, seqs
        self.device = model.lm_head.weight.device
        layout = KVLayout(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                          block_size=BLOCK)
        self.cache = layout.allocate(num_blocks, device=self.device)
        self.cache.normal_()  # stale garbage in unused slots must never leak into results
        self.backend = get_backend("torch", device=self.device, num_heads=cfg.num_heads,
                                   num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, block_size=BLOCK,
                                   sliding_window=cfg.sliding_window)
        free = list(range(num_blocks))
        random.Random(seed).shuffle(free)  # non-contiguous, interleaved block tables
        self.tables = {name: [free.pop() for _ in range(-(-len(ids) // BLOCK))] for name, ids in seqs.items()}
        self.done = {name: 0 for name in seqs}

    @torch.no_grad()
    def step(self, plan: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
        """``plan``: (sequence, number of new tokens) in batch order -> logits of those tokens."""
        ids, spec = [], BatchSpec(query_lens=[n for _, n in plan],
                                  context_lens=[self.done[s] for s, _ in plan],
                                  block_tables=[self.tables[s] for s, _ in plan])
        for s, n in plan:
            ids += self.seqs[s][self.done[s]:self.done[s] + n]
        meta = self.backend.plan(spec)
        hidden = self.model(torch.tensor(ids, device=self.device), meta.positions, self.cache, meta)
        logits = self.model.compute_logits(hidden)
        out, off = {}, 0
        for s, n in plan:
            out[s] = logits[off:off + n]
            off += n
            self.done[s] += n
        return out


def check_against_reference(model, runner: PagedRunner, steps: list[list[tuple[str, int]]]) -> None:
    refs = {name: reference_logits(model, ids) for name, ids in runner.seqs.items()}
    for plan in steps:
        starts = {s: runner.done[s] for s, _ in plan}
        got = runner.step(plan)
        for s, n in plan:
            want = refs[s][starts[s]:starts[s] + n]
            diff = (got[s] - want).abs().max().item()
            assert diff <= 1e-4, f"{s} tokens {starts[s]}..{starts[s] + n}: max abs logit diff {diff}"
    assert all(runner.done[s] == len(ids) for s, ids in runner.seqs.items())


def random_seqs(lengths: dict[str, int], vocab: int, seed: int = 1) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {name: [rng.randrange(vocab) for _ in range(n)] for name, n in lengths.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_mixed_prefill_chunk_and_decode_steps_match_dense_reference(name, device):
    model = make_model(name, device)
    seqs = random_seqs(dict(a=24, b=12, c=3, d=41, e=17), model.config.vocab_size)
    runner = PagedRunner(model, seqs)
    steps = [
        [("a", 10), ("d", 16), ("b", 9)],  # fresh prompts of different lengths (padded causal path)
        [("b", 1), ("c", 1), ("a", 13), ("d", 24), ("e", 17)],  # decodes + chunks with context + fresh
        [("a", 1), ("b", 1), ("c", 1), ("d", 1)],  # pure decode
        [("b", 1), ("c", 1)],  # decode group only, short contexts
    ]
    check_against_reference(model, runner, steps)


@pytest.mark.parametrize("name", ["llama-gqa-tied-llama3rope", "mistral-mha-window"])
def test_any_batch_order_and_single_sequence_paths(name):
    model = make_model(name)
    seqs = random_seqs(dict(a=20, b=6, c=9, d=7), model.config.vocab_size, seed=2)
    runner = PagedRunner(model, seqs, seed=3)
    steps = [
        [("a", 7)],  # one fresh prompt alone: no padding
        [("b", 5), ("a", 1), ("c", 4)],  # a decode that is not at the front of the batch
        [("a", 11)],  # one chunk alone, with context
        [("c", 5), ("b", 1), ("d", 7), ("a", 1)],  # chunk first, decodes in between
    ]
    check_against_reference(model, runner, steps)


def test_plan_rejects_a_short_block_table():
    backend = get_backend("torch", device="cpu", num_heads=4, num_kv_heads=2, head_dim=8, block_size=4)
    with pytest.raises(ValueError, match="need 2"):
        backend.plan(BatchSpec(query_lens=[3], context_lens=[2], block_tables=[[0]]))
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("nope", device="cpu", num_heads=4, num_kv_heads=2, head_dim=8, block_size=4)


def test_fused_projections_keep_hf_names_and_results():
    model = make_model("qwen2-bias-linear-rope")
    names = {k: v.clone() for k, v in model.state_dict().items()}
    seqs = random_seqs(dict(a=13, b=5), model.config.vocab_size, seed=4)
    steps = [[("a", 13), ("b", 5)]]
    plain = PagedRunner(model, seqs).step(steps[0])
    model.fuse_projections()
    assert model.model.layers[0].self_attn.fused is not None
    fused_state = model.state_dict()
    assert fused_state.keys() == names.keys()
    assert all(torch.equal(fused_state[k], names[k]) for k in names)
    fused = PagedRunner(model, seqs).step(steps[0])
    for s in seqs:
        assert (plain[s] - fused[s]).abs().max().item() <= 1e-5
    check_against_reference(model, PagedRunner(model, seqs), steps)
    model.to(dtype=torch.bfloat16)  # moving parameters drops the fused copies instead of going stale
    assert all(layer.self_attn.fused is None and layer.mlp.fused is None for layer in model.model.layers)
