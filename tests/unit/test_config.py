"""ModelConfig: parsing real-world config.json shapes, and clear errors for what we cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import ModelConfig, RopeScaling
from engine.errors import ModelLoadError

# The config.json of Llama-3.1-8B-Instruct as published (transformers 4.x key spelling).
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}
QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 896, "intermediate_size": 4864, "max_position_embeddings": 32768,
    "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
}
MISTRAL = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 32000,
}


def write_dir(tmp_path: Path, config: dict | str, generation: dict | None = None) -> Path:
    (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def test_llama31_8b_config(tmp_path):
    cfg = ModelConfig.from_pretrained(write_dir(tmp_path, LLAMA31_8B, {"eos_token_id": [128001, 128009]}))
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == \
        ("llama", 32, 4096, 32, 8)
    assert cfg.head_dim == 128 and cfg.intermediate_size == 14336 and cfg.vocab_size == 128256
    assert cfg.rope_theta == 500000.0 and cfg.rms_norm_eps == 1e-5 and cfg.dtype == "bfloat16"
    assert cfg.rope_scaling == RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)
    assert cfg.bos_token_id == 128000
    assert cfg.eos_token_ids == (128001, 128008, 128009)  # union, config order first, no duplicates
    assert not cfg.qkv_bias and not cfg.tie_word_embeddings and cfg.sliding_window is None


def test_qwen2_and_mistral_configs(tmp_path):
    q = ModelConfig.from_hf_dict(QWEN2)
    assert q.architecture == "qwen2" and q.qkv_bias and q.tie_word_embeddings and q.head_dim == 64
    assert q.sliding_window is None  # use_sliding_window=false
    assert ModelConfig.from_hf_dict({**QWEN2, "use_sliding_window": True, "max_window_layers": 0}
                                    ).sliding_window == 32768
    with pytest.raises(ModelLoadError, match="only some layers"):
        ModelConfig.from_hf_dict({**QWEN2, "use_sliding_window": True, "max_window_layers": 12})
    m = ModelConfig.from_hf_dict(MISTRAL)
    assert m.architecture == "mistral" and m.sliding_window == 4096 and not m.qkv_bias
    assert m.eos_token_ids == (2,)


def test_transformers5_spelling_dtype_and_rope_parameters():
    hf = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    hf["dtype"] = "float16"
    hf["rope_parameters"] = {**LLAMA31_8B["rope_scaling"], "rope_theta": 500000.0}
    cfg = ModelConfig.from_hf_dict(hf)
    assert cfg.dtype == "float16" and cfg.rope_theta == 500000.0 and cfg.rope_scaling.rope_type == "llama3"
    plain = {**hf, "rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}}
    cfg = ModelConfig.from_hf_dict(plain)
    assert cfg.rope_theta == 1234.0 and cfg.rope_scaling is None
    linear = ModelConfig.from_hf_dict({**plain, "rope_parameters": {"type": "linear", "factor": 2.0}})
    assert linear.rope_scaling == RopeScaling(rope_type="linear", factor=2.0) and linear.rope_theta == 10000.0


def test_defaults_head_dim_and_kv_heads():
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    cfg = ModelConfig.from_hf_dict(hf)
    assert cfg.head_dim == 16 and cfg.num_kv_heads == 4 and cfg.dtype == "float32"
    assert cfg.max_position_embeddings == 2048 and cfg.rope_theta == 10000.0 and cfg.eos_token_ids == ()
    explicit = ModelConfig.from_hf_dict({**hf, "head_dim": 32})  # Mistral-Nemo style: heads*dim != hidden
    assert explicit.head_dim == 32 and explicit.q_size == 128


def test_round_trip_and_fingerprint():
    cfg = ModelConfig.from_hf_dict(LLAMA31_8B)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    for hf in (QWEN2, MISTRAL, {**QWEN2, "use_sliding_window": True, "max_window_layers": 0}):
        c = ModelConfig.from_hf_dict(hf)
        assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c
    fp = cfg.fingerprint()
    assert fp == ModelConfig.from_hf_dict(dict(LLAMA31_8B)).fingerprint() and len(fp) == 16
    assert ModelConfig.from_hf_dict({**LLAMA31_8B, "torch_dtype": "float32"}).fingerprint() == fp
    assert ModelConfig.from_hf_dict({**LLAMA31_8B, "num_key_value_heads": 4}).fingerprint() != fp
    assert ModelConfig.from_hf_dict({**LLAMA31_8B, "rope_scaling": None}).fingerprint() != fp


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'"),
    ({"architectures": None, "model_type": "gpt2"}, "unsupported or missing model type"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs 'low_freq_factor'"),
    ({"num_key_value_heads": 5}, "multiple of num_kv_heads"),
    ({"num_hidden_layers": 0}, "num_layers must be a positive int"),
    ({"vocab_size": "many"}, "vocab_size must be a positive int"),
    ({"hidden_size": 4000, "num_attention_heads": 48}, "not divisible"),
    ({"torch_dtype": "float64"}, "dtype 'float64' is not supported"),
    ({"bos_token_id": 999999}, "bos_token_id 999999 is not a token id"),
    ({"intermediate_size": None}, "missing required keys \\['intermediate_size'\\]"),
])
def test_bad_configs_name_the_problem(tmp_path, change, message):
    with pytest.raises(ModelLoadError, match=message) as info:
        ModelConfig.from_pretrained(write_dir(tmp_path, {**LLAMA31_8B, **change}))
    assert str(tmp_path / "config.json") in str(info.value)


def test_bad_directories(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        ModelConfig.from_pretrained(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelLoadError, match="not a directory"):
        ModelConfig.from_pretrained(tmp_path / "file")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        ModelConfig.from_pretrained(write_dir(tmp_path, '{"architectures": ["LlamaForCausalLM"],'))
    with pytest.raises(ModelLoadError, match="must hold a JSON object"):
        ModelConfig.from_pretrained(write_dir(tmp_path, "[1, 2]"))
    write_dir(tmp_path, LLAMA31_8B)
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(ModelLoadError, match="generation_config.json is not valid JSON"):
        ModelConfig.from_pretrained(tmp_path)


def test_direct_construction_validates():
    base = dict(architecture="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=1,
                num_heads=2, num_kv_heads=1)
    assert ModelConfig(**base).head_dim == 4
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        ModelConfig(**{**base, "architecture": "gpt2"})
    with pytest.raises(ValueError, match="eos_token_ids 10 is not a token id"):
        ModelConfig(**base, eos_token_ids=(1, 10))
    with pytest.raises(ValueError, match="must be even"):
        ModelConfig(**base, head_dim=3)
    with pytest.raises(TypeError):
        ModelConfig("llama", 10, 8, 16, 1, 2, 1)  # keyword-only


def test_rope_inv_freq_matches_transformers():
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for hf in (LLAMA31_8B, {**LLAMA31_8B, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
               {**LLAMA31_8B, "rope_scaling": None}):
        ours = torch.tensor(ModelConfig.from_hf_dict(hf).rope_inv_freq(), dtype=torch.float64)
        tcfg = LlamaConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "torch_dtype",
                                                                       "transformers_version")})
        kind = tcfg.rope_parameters["rope_type"]
        if kind == "default":
            ref = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
        else:
            ref = ROPE_INIT_FUNCTIONS[kind](tcfg, "cpu")[0].double()
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=0)
