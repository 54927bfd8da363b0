"""Random-weight checkpoints in Hugging Face layout (``pdserve model init``).

``write_random_checkpoint(out, config, seed=...)`` writes ``config.json``, ``generation_config.json``,
``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``
when the weights exceed ``max_shard_bytes``), ``tokenizer.json`` and ``tokenizer_config.json``. The
directory loads with our loader and with ``transformers`` (``AutoModelForCausalLM`` /
``AutoTokenizer``), which is what the reference-parity tests rely on.

Memory: shards are generated and written one at a time, so the llama3-8b preset (~16 GB in
bfloat16) peaks at one shard (plus one float32 tensor while it is drawn), never the whole model.

Determinism: every tensor is drawn from its own generator seeded by ``(seed, tensor name)``, so the
same seed gives the same weights whatever the shard size or the order of writing. The tokenizer is
a byte-level BPE trained on the embedded ``engine.bpe_corpus`` text, deterministic as well.

Initialisation is chosen so that a random model is a useful test subject: linear weights have
standard deviation 1/sqrt(fan_in) (activations keep unit scale, attention is far from uniform and
the logits are peaked enough that greedy decoding does not hinge on float rounding), RMSNorm weights
are 1 + noise and biases are noise (so a runtime that ignored them would disagree with the reference).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.bpe_corpus import CORPUS
from engine.config import ModelConfig, RopeScaling

BOS_TOKEN, EOS_TOKEN, EOT_TOKEN = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, EOT_TOKEN)  # trained first, so their ids are 0, 1, 2
BOS_ID, EOS_ID, EOT_ID = 0, 1, 2
TOKENIZER_VOCAB = 1024
# Meta's Llama 3 Instruct chat template, so `/v1/chat/completions` works on random presets, with Llama
# 3.1's tool use: the tools in a system turn ahead of the conversation, an assistant's calls as
# {"name": ..., "parameters": ...} JSON (router/http/tools.py reads them back: "llama3_json"), a tool's
# answer as an "ipython" turn. The random tokenizer has no header specials: <|start_header_id|> /
# <|end_header_id|> encode as ordinary text.
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|start_header_id|>system<|end_header_id|>\n\nYou have access to the following "
    "functions. To call one, respond with JSON in the format {\"name\": function name, \"parameters\": "
    "dictionary of argument name and its value}.\n\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}{{ '<|eot_id|>' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] is defined %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% for call in message['tool_calls'] %}{% if not loop.first %}{{ '; ' }}{% endif %}"
    "{{ '{\"name\": ' + (call['function']['name'] | tojson) + ', \"parameters\": '"
    " + (call['function']['arguments'] | tojson) + '}' }}{% endfor %}{{ '<|eot_id|>' }}"
    "{% else %}"
    "{% set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
PRESETS = ("tiny", "small", "llama3-8b", "llama3-70b", "llama3-70b-short")
SHORT_70B_LAYERS = 16  # llama3-70b-short: the 70B widths, few enough layers for one 2-GPU lease
ARCHES = ("llama", "mistral", "qwen2")


def preset_config(preset: str, *, arch: str = "llama", dtype: str | None = None, **overrides) -> ModelConfig:
    """The ModelConfig of a preset for one architecture family; ``overrides`` replace fields."""
    if arch not in ARCHES:
        raise ValueError(f"unknown arch {arch!r} (choose from {ARCHES})")
    common = dict(architecture=arch, bos_token_id=BOS_ID, eos_token_ids=(EOS_ID, EOT_ID),
                  qkv_bias=arch == "qwen2", rms_norm_eps=1e-6,
                  rope_theta=1_000_000.0 if arch in ("mistral", "qwen2") else 10000.0)
    if preset == "tiny":
        fields = dict(vocab_size=TOKENIZER_VOCAB, hidden_size=64, intermediate_size=192, num_layers=4,
                      num_heads=4, num_kv_heads=2, max_position_embeddings=2048, dtype="float32")
    elif preset == "small":
        # ~25M parameters; vocab padded to a multiple of 128 beyond the tokenizer, as real models do.
        fields = dict(vocab_size=TOKENIZER_VOCAB + 128, hidden_size=512, intermediate_size=1408,
                      num_layers=8, num_heads=8, num_kv_heads=4, max_position_embeddings=4096,
                      dtype="float32")
    elif preset == "llama3-8b":  # the Llama-3.1-8B shape
        fields = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                      num_heads=32, num_kv_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                      rope_theta=500000.0, dtype="bfloat16",
                      rope_scaling=RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0, original_max_position_embeddings=8192))
    elif preset in ("llama3-70b", "llama3-70b-short"):  # the Llama-3.1-70B shape (short: fewer layers)
        fields = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                      num_layers=80 if preset == "llama3-70b" else SHORT_70B_LAYERS,
                      num_heads=64, num_kv_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                      rope_theta=500000.0, dtype="bfloat16",
                      rope_scaling=RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0, original_max_position_embeddings=8192))
    else:
        raise ValueError(f"unknown preset {preset!r} (choose from {PRESETS})")
    merged = {**common, **fields, **overrides}
    if dtype is not None:
        merged["dtype"] = dtype
    return ModelConfig(**merged)


def parameter_shapes(config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face tensor names and shapes of a model, in checkpoint order."""
    h, i, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (config.vocab_size, h))]
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        out += [(p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (q, h)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h))]
        if config.qkv_bias:
            out += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                    (p + "self_attn.v_proj.bias", (kv,))]
        out += [(p + "self_attn.o_proj.weight", (h, q)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (i, h)),
                (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i))]
    out.append(("model.norm.weight", (h,)))
    if not config.tie_word_embeddings:
        out.append(("lm_head.weight", (config.vocab_size, h)))
    return out


def random_tensor(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """One tensor of a random checkpoint; depends only on (name, shape, seed)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    t = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith("norm.weight"):
        t = 1.0 + 0.1 * t
    elif name.endswith(".bias"):
        t = 0.1 * t
    elif name != "model.embed_tokens.weight":  # linear [out, in]: unit-scale activations
        t = t / math.sqrt(shape[1])
    return t.to(dtype)


def write_random_checkpoint(out: str | Path, config: ModelConfig, *, seed: int = 0,
                            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                            with_tokenizer: bool = True) -> Path:
    """Write a complete random checkpoint directory; returns its path."""
    out = Path(out)
    if with_tokenizer and config.vocab_size < TOKENIZER_VOCAB:
        raise ValueError(f"vocab_size {config.vocab_size} is smaller than the tokenizer's {TOKENIZER_VOCAB}")
    out.mkdir(parents=True, exist_ok=True)
    dtype = config.torch_dtype
    shapes = parameter_shapes(config)
    shards = _plan_shards(shapes, dtype, max_shard_bytes)
    for stale in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        stale.unlink()  # rewriting a directory must not leave old shards the loader would pick up
    weight_map: dict[str, str] = {}
    total = 0
    for idx, shard in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else \
            f"model-{idx + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: random_tensor(name, shape, seed, dtype) for name, shape in shard}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({name: fname for name in tensors})
        del tensors
    if len(shards) > 1:
        _write_json(out / "model.safetensors.index.json",
                    {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(out / "config.json", config.to_hf_dict())
    gen: dict = {"bos_token_id": config.bos_token_id}
    if config.eos_token_ids:
        gen["eos_token_id"] = list(config.eos_token_ids)
    _write_json(out / "generation_config.json", gen)
    if with_tokenizer:
        write_tokenizer(out, max_length=config.max_position_embeddings)
    return out


def write_tokenizer(out: str | Path, *, max_length: int = 2048) -> None:
    """Write tokenizer.json + tokenizer_config.json (loadable by engine.tokenizer and AutoTokenizer), the
    config with a Llama-3 chat template."""
    out = Path(out)
    (out / "tokenizer.json").write_text(trained_tokenizer_json(), encoding="utf-8")
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": True,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": LLAMA3_CHAT_TEMPLATE,
    })


@functools.lru_cache(maxsize=1)
def trained_tokenizer_json() -> str:
    """The byte-level BPE (TOKENIZER_VOCAB ids, specials 0..2) trained on the embedded corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, min_frequency=1)
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    if tok.get_vocab_size() != TOKENIZER_VOCAB or tok.token_to_id(BOS_TOKEN) != BOS_ID \
            or tok.token_to_id(EOS_TOKEN) != EOS_ID or tok.token_to_id(EOT_TOKEN) != EOT_ID:
        raise RuntimeError("BPE training did not produce the expected vocabulary")  # corpus edited?
    # Llama-3 style: byte-level offsets, then "<|begin_of_text|> $A" on every encode.
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
                                      special_tokens=[(BOS_TOKEN, BOS_ID)]),
    ])
    return tok.to_str()


def _plan_shards(shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                 max_shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")
