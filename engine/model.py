"""The decoder-only transformer (Llama 2/3, Mistral, Qwen2) over a flat token batch and a paged KV cache.

Parameter names are exactly the Hugging Face ones (``model.layers.{i}.self_attn.q_proj.weight`` ...),
so ``engine.weights.load_weights`` fills the module straight from a checkpoint, and the arithmetic
follows ``transformers`` op for op (RMSNorm in float32, RoPE cos/sin computed in float32 and cast,
SiLU-gated MLP) so float32 logits match it to rounding.

There is no batch dimension: a step is ``T`` tokens from any mix of sequences (decode tokens, whole
prompts, chunks of prompts), each with its absolute ``position``. Where a token's keys/values go and
which cached tokens it attends to is the attention backend's business (``engine.attention``); the
model only calls ``backend.forward`` once per layer with the step's planned metadata. Nothing in
``forward`` depends on tensor *values* on the host, so it can be ``torch.compile``d.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionMetadata
from engine.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim // 2]`` in float32, computed like ``transformers`` does."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv = 1.0 / (config.rope_theta ** exponents)
    rs = config.rope_scaling
    if rs is None:
        return inv
    if rs.rope_type == "linear":
        return inv / rs.factor
    # llama3: keep high frequencies, divide low ones by factor, blend in between.
    old_ctx = rs.original_max_position_embeddings
    low_wavelen = old_ctx / rs.low_freq_factor
    high_wavelen = old_ctx / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (old_ctx / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        h, bias = config.hidden_size, config.qkv_bias
        self.q_proj = nn.Linear(h, config.q_size, bias=bias)
        self.k_proj = nn.Linear(h, config.kv_size, bias=bias)
        self.v_proj = nn.Linear(h, config.kv_size, bias=bias)
        self.o_proj = nn.Linear(config.q_size, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        # x: [T, hidden]; cos/sin: [T, 1, head_dim]; kv_layer: [num_blocks, 2, block_size, kv_heads, head_dim]
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = attn.backend.forward(q, k, v, kv_layer, attn)  # [T, heads, head_dim]
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_layer, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """``model.*`` of the HF checkpoint: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """``*ForCausalLM`` for llama / mistral / qwen2 (they differ only in config: GQA, qkv bias, RoPE)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Not a buffer: it must survive meta-device construction and never appears in a state dict.
        self._inv_freq = rope_inv_freq(config)
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, head_dim]`` for absolute ``positions [T]``, float32 math then cast."""
        inv = self._inv_freq_on.get(positions.device)
        if inv is None:
            inv = self._inv_freq_on[positions.device] = self._inv_freq.to(positions.device)
        freqs = positions[:, None].float() * inv  # [T, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` for a flat batch.

        ``input_ids``, ``positions``: ``[T]`` int64. ``kv_cache``: ``[layers, blocks, 2, block_size,
        kv_heads, head_dim]`` (``engine.kv_layout``); this step's keys/values are written into it.
        """
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, kv_cache[i], attn)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` (already normed) -> ``[n, vocab]`` float32 logits."""
        return self.lm_head(hidden).float()


def build_model(config: ModelConfig, *, device: torch.device | str = "cpu",
                dtype: torch.dtype | None = None, init: str = "random", seed: int = 0) -> CausalLM:
    """A ``CausalLM`` on ``device`` in ``dtype`` (default: the config's), in eval mode.

    ``init="random"``: the weights ``engine.checkpoint.write_random_checkpoint(config, seed=seed)``
    would write, so a test gets the same model with or without a checkpoint directory.
    ``init="meta"``: nothing allocated, for ``engine.weights.load_weights`` to fill.
    """
    dtype = dtype or config.torch_dtype
    with torch.device("meta"):
        model = CausalLM(config)
    if init == "meta":
        return model.to(dtype=dtype).eval()
    if init != "random":
        raise ValueError(f"init must be 'random' or 'meta', got {init!r}")
    from engine.checkpoint import random_tensor

    model = model.to_empty(device=device).to(dtype=dtype)
    if config.tie_word_embeddings:  # to_empty may have replaced the shared parameter
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(random_tensor(name, tuple(p.shape), seed, dtype))
    return model.eval()
