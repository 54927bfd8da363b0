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
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionMetadata
from engine.config import ModelConfig
from engine.fused_linears import FusedLinears
from engine.tp_shard import TensorSlice, TPShard

if TYPE_CHECKING:
    from engine.tp_group import TPGroup


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` by ``cos``/``sin [T, 1, head_dim / 2]``.

    transformers' ``x * cos + rotate_half(x) * sin`` with ``cos = cat(c, c)``, written half by half:
    the same products and sums (so the same rounding) with two temporaries instead of five.
    """
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty_like(x)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1).sub_(x2 * sin)
    torch.mul(x2, cos, out=o2).add_(x1 * sin)
    return out


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.kernels: ModuleType | None = None  # engine.fused_ops when CausalLM.set_fused_ops chose it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:  # one kernel, same rounding
            return self.kernels.rms_norm(x, self.weight, self.eps)
        # Normalise in float32, cast back, then scale: the order transformers uses.
        return _rms_norm(x.float(), self.eps).to(x.dtype).mul_(self.weight)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``x.add_(delta)`` (``x``: the running residual, updated in place), then the norm of ``x``."""
        if self.kernels is not None:
            return self.kernels.add_rms_norm(x, delta, self.weight, self.eps)
        return self(x.add_(delta))


if hasattr(F, "rms_norm"):  # torch >= 2.4: one fused op
    def _rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), eps=eps)
else:  # pragma: no cover - older torch
    def _rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def fused_kernels_for(device: torch.device, dtype: torch.dtype):
    """``engine.fused_ops`` when its kernels run for weights on ``device`` in ``dtype``, else None;
    CPU and float32 models never import triton."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    from engine import fused_ops

    return fused_ops if fused_ops.available(device, dtype) else None


class Attention(nn.Module):
    """Self-attention; under tensor parallelism (``tp``) this rank's query/KV heads only, and
    ``o_proj``'s partial sums all-reduced (the block's one collective)."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        shard = None if tp is None else TPShard.for_model(config, rank=tp.rank, size=tp.size)
        self.tp = tp
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads if shard is None else shard.local_heads
        self.num_kv_heads = config.num_kv_heads if shard is None else shard.local_kv_heads
        self.head_dim = config.head_dim
        h, bias = config.hidden_size, config.qkv_bias
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(h, q_size, bias=bias)
        self.k_proj = nn.Linear(h, kv_size, bias=bias)
        self.v_proj = nn.Linear(h, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, h, bias=False)
        self.fused: FusedLinears | None = None
        self.kernels: ModuleType | None = None  # engine.fused_ops when CausalLM.set_fused_ops chose it
        self.linear: Callable = F.linear  # engine.gemv.linear when CausalLM.set_fused_ops chose it

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        # x: [T, hidden]; cos/sin: [T, 1, head_dim / 2]; kv_layer: [blocks, 2, block_size, kv_heads, head_dim]
        t = x.shape[0]
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if self.fused is not None and self.fused.matches(projs):
            q, k, v = self.fused(x, self.linear)
        else:
            q, k, v = (proj(x) for proj in projs)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)  # a strided view when fused
        store = None if self.kernels is None else attn.backend.kv_store_target(kv_layer, attn)
        if store is not None:  # RoPE and the cache write in one launch; the backend only attends
            q, k, v = self.kernels.rope_store_kv(q, k, v, cos, sin, *store), None, None
        elif self.kernels is not None:
            q, k = self.kernels.rope_qk(q, k, cos, sin)  # one launch for both, same rounding
        else:
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
        out = attn.backend.forward(q, k, v, kv_layer, attn)  # [T, heads, head_dim]
        out = out.reshape(t, self.num_heads * self.head_dim)
        out = self.linear(out, self.o_proj.weight, self.o_proj.bias)
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    """SiLU-gated MLP; under ``tp`` this rank's intermediate rows, ``down_proj`` all-reduced."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        h, i = config.hidden_size, config.intermediate_size // (1 if tp is None else tp.size)
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.fused: FusedLinears | None = None
        self.kernels: ModuleType | None = None  # engine.fused_ops when CausalLM.set_fused_ops chose it
        self.linear: Callable = F.linear  # engine.gemv.linear when CausalLM.set_fused_ops chose it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projs = (self.gate_proj, self.up_proj)
        if self.fused is not None and self.fused.matches(projs):
            if self.kernels is not None:  # silu(gate) * up straight from the [T, 2 * I] output
                return self._down(self.kernels.silu_mul(self.fused.matmul(x, self.linear)))
            gate, up = self.fused(x, self.linear)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        # gate is this call's own matmul output: activate and gate it in place.
        return self._down(F.silu(gate, inplace=True).mul_(up))

    def _down(self, h: torch.Tensor) -> torch.Tensor:
        out = self.linear(h, self.down_proj.weight, self.down_proj.bias)
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, tp)
        self.mlp = MLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_layer: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """``x``: the model's own running residual (never a caller's tensor), updated in place;
        ``pending``: the previous layer's MLP output, not yet added to ``x`` (None for the first layer).
        Returns this layer's MLP output, which the next layer's input norm (or the final norm) adds:
        each residual add is fused into the norm that follows it when the fused kernels are on, and
        the values are the same as adding at the end of the layer."""
        if pending is None:
            h = self.input_layernorm(x)
        else:
            h = self.input_layernorm.add_forward(x, pending)
        h = self.post_attention_layernorm.add_forward(x, self.self_attn(h, cos, sin, kv_layer, attn))
        return self.mlp(h)


def _uninitialised(rows: int, cols: int) -> torch.Tensor:
    """An embedding's weight without nn.Embedding's random init: the module is built on the meta device
    and filled by the checkpoint or build_model's own init, and normal_ on meta imports torch._dynamo
    (~2 s of a worker's start, bench/boot_profile.py) where Linear's uniform_ does not."""
    return torch.empty(rows, cols)


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows ``[start, start + rows)`` of the embedding (rows past the vocabulary are
    zero padding); other rows read as zeros and one all-reduce assembles every token's vector.
    Adding zeros is exact, so the result equals the unsplit lookup bit for bit."""

    def __init__(self, shard: TPShard, hidden_size: int, tp: TPGroup) -> None:
        rows = shard.vocab_per_rank
        super().__init__(rows, hidden_size, _weight=_uninitialised(rows, hidden_size))
        self.start, self.tp = shard.vocab_start, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        return self.tp.all_reduce(out.mul_(mine.unsqueeze(-1).to(out.dtype)))


class DecoderModel(nn.Module):
    """``model.*`` of the HF checkpoint: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        if tp is None:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                             _weight=_uninitialised(config.vocab_size, config.hidden_size))
        else:
            shard = TPShard.for_model(config, rank=tp.rank, size=tp.size)
            self.embed_tokens = VocabParallelEmbedding(shard, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """``*ForCausalLM`` for llama / mistral / qwen2 (they differ only in config: GQA, qkv bias, RoPE).

    ``tp``: this module is one tensor-parallel rank's share (``engine.tp_shard``); every rank runs
    ``forward`` on the same inputs and ends with the same hidden states.
    """

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.shard = None if tp is None else TPShard.for_model(config, rank=tp.rank, size=tp.size)
        self.model = DecoderModel(config, tp)
        vocab = config.vocab_size if self.shard is None else self.shard.vocab_per_rank
        self.lm_head = nn.Linear(config.hidden_size, vocab, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Not a buffer: it must survive meta-device construction and never appears in a state dict.
        self._inv_freq = rope_inv_freq(config)
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}
        self.linear: Callable = F.linear  # lm_head's; engine.gemv.linear when set_fused_ops chose it

    def fuse_projections(self, fused_ops: bool | None = None) -> None:
        """Fuse q/k/v and gate/up into one matmul each (call once the weights are in place; groups
        ``allocate_fused`` laid out already stay as they are), and pick the element-wise kernels
        (``set_fused_ops(fused_ops)``)."""
        self._fuse(None)
        self.set_fused_ops(fused_ops)

    def allocate_fused(self, device: torch.device, dtype: torch.dtype) -> None:
        """Before loading a meta-built model: q/k/v and gate/up get their concatenated weights on
        ``device`` (uninitialised), the named parameters views into them, for the loader to fill."""
        self._fuse((device, dtype))

    def _fuse(self, empty_on: tuple[torch.device, torch.dtype] | None) -> None:
        for layer in self.model.layers:
            att, mlp = layer.self_attn, layer.mlp
            groups = ((att, (att.q_proj, att.k_proj, att.v_proj)), (mlp, (mlp.gate_proj, mlp.up_proj)))
            for owner, group in groups:
                if owner.fused is None or not owner.fused.matches(group):
                    owner.fused = FusedLinears(list(group), empty_on=empty_on)

    def set_fused_ops(self, enabled: bool | None = None, gemv: bool | None = None) -> bool:
        """Use ``engine.fused_ops`` (Triton: add+RMSNorm, RoPE of q and k with the KV cache write, silu*up)
        and ``engine.gemv`` (the projections at batch 1), or torch ops.

        ``None``: when ``engine.fused_ops.available`` says so for the weights' device and dtype (CUDA,
        fp16/bf16, triton importable, ``PDSERVE_FUSED_OPS`` not 0); CPU and float32 models never
        import triton. ``True`` forces them (tests: CPU tensors under ``TRITON_INTERPRET=1``).
        ``gemv``: the batch-1 products with them (``None``: with them unless ``PDSERVE_GEMV`` is 0).
        Decided here once, not per step; ``.to()`` turns them off again. Returns whether they are on.
        """
        kernels = None
        if enabled is None:
            p = self.model.embed_tokens.weight
            kernels = fused_kernels_for(p.device, p.dtype)
        elif enabled:
            from engine import fused_ops

            if fused_ops.triton is None:
                raise RuntimeError("set_fused_ops(True): triton is not installed")
            kernels = fused_ops
        linear = F.linear
        if kernels is not None and gemv is not False:
            from engine import gemv as batch1

            if gemv or batch1.enabled():
                linear = batch1.linear
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.kernels = kernels
            if isinstance(module, (Attention, MLP, CausalLM)):
                module.linear = linear
        return kernels is not None

    def _apply(self, fn, recurse: bool = True):
        # .to()/.half()/... move the named parameters; the fused copies would go stale, and the
        # fused kernels' choice depends on the new device and dtype.
        for module in self.modules():
            if getattr(module, "fused", None) is not None:
                module.fused = None
            if getattr(module, "kernels", None) is not None:
                module.kernels = None
            if isinstance(module, (Attention, MLP, CausalLM)):
                module.linear = F.linear
        return super()._apply(fn, recurse)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, head_dim / 2]`` for absolute ``positions [T]``, float32 math then cast."""
        inv = self._inv_freq_on.get(positions.device)
        if inv is None:
            inv = self._inv_freq_on[positions.device] = self._inv_freq.to(positions.device)
        freqs = positions[:, None].float() * inv  # [T, head_dim/2]
        freqs = freqs[:, None, :]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attn: AttentionMetadata, after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` for a flat batch.

        ``input_ids``, ``positions``: ``[T]`` int64. ``kv_cache``: ``[layers, blocks, 2, block_size,
        kv_heads, head_dim]`` (``engine.kv_layout``); this step's keys/values are written into it.
        ``after_layer(i)`` (eager steps only, never inside a captured graph) is called once layer
        ``i``'s work has been issued, i.e. its keys/values are queued for writing on the current
        stream: a KV sender records a CUDA event there to start shipping layer ``i`` early.
        """
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        pending = None  # the last MLP output, added to x by the next norm
        for i, layer in enumerate(self.model.layers):
            pending = layer(x, pending, cos, sin, kv_cache[i], attn)
            if after_layer is not None:
                after_layer(i)
        if pending is None:
            return self.model.norm(x)
        return self.model.norm.add_forward(x, pending)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` (already normed) -> ``[n, vocab]`` float32 logits (on every rank)."""
        logits = self.linear(hidden, self.lm_head.weight, self.lm_head.bias)
        if self.tp is None:
            return logits.float()
        full = self.tp.all_gather_last(logits.float())  # [n, size * vocab_per_rank]
        return full[:, :self.config.vocab_size]

    def tp_slices(self) -> dict[str, TensorSlice]:
        """Parameter name -> this rank's slice of the checkpoint tensor (empty without ``tp``)."""
        if self.shard is None:
            return {}
        names = dict(self.named_parameters())
        every = self.shard.slices(self.config.num_layers, qkv_bias=self.config.qkv_bias)
        return {n: s for n, s in every.items() if n in names}


def build_model(config: ModelConfig, *, device: torch.device | str = "cpu",
                dtype: torch.dtype | None = None, init: str = "random", seed: int = 0,
                tp: TPGroup | None = None) -> CausalLM:
    """A ``CausalLM`` on ``device`` in ``dtype`` (default: the config's), in eval mode.

    ``init="random"``: the weights ``engine.checkpoint.write_random_checkpoint(config, seed=seed)``
    would write, so a test gets the same model with or without a checkpoint directory (with ``tp``:
    this rank's slices of them).
    ``init="meta"``: nothing allocated, for ``engine.weights.load_weights`` to fill.
    """
    dtype = dtype or config.torch_dtype
    with torch.device("meta"):
        model = CausalLM(config, tp)
    if init == "meta":
        return model.to(dtype=dtype).eval()
    if init != "random":
        raise ValueError(f"init must be 'random' or 'meta', got {init!r}")
    from engine.checkpoint import random_tensor
    from engine.weights import slice_of

    model = model.to_empty(device=device).to(dtype=dtype)
    if config.tie_word_embeddings:  # to_empty may have replaced the shared parameter
        model.lm_head.weight = model.model.embed_tokens.weight
    slices = model.tp_slices()
    with torch.no_grad():
        for name, p in model.named_parameters():
            sl = slices.get(name)
            if sl is None:
                p.copy_(random_tensor(name, tuple(p.shape), seed, dtype))
            else:
                full = list(p.shape)
                full[sl.dim] = sl.full
                p.copy_(slice_of(random_tensor(name, tuple(full), seed, dtype), sl))
    return model.eval()
