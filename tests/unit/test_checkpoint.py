"""Random checkpoints: `pdserve model init`, HF layout, determinism, sharding, presets."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import engine.checkpoint as ckpt
from engine.checkpoint import parameter_shapes, preset_config, write_random_checkpoint
from engine.config import HF_ARCHITECTURE, ModelConfig, RopeScaling
from engine.tokenizer import Tokenizer
from pdserve.app.cli import main


def test_cli_init_writes_a_complete_hf_directory(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert main(["model", "init", "--preset", "tiny", "--out", str(out), "--seed", "3"]) == 0
    assert "wrote tiny llama" in capsys.readouterr().out
    names = {p.name for p in out.iterdir()}
    assert names == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"}
    cfg = ModelConfig.from_pretrained(out)
    assert cfg == preset_config("tiny", arch="llama")
    assert cfg.num_heads > cfg.num_kv_heads  # GQA
    tok = Tokenizer.from_dir(out)
    assert tok.vocab_size == cfg.vocab_size and tok.bos_token_id == cfg.bos_token_id
    assert tok.eos_token_id in cfg.eos_token_ids
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == list(cfg.eos_token_ids)

    assert main(["model", "info", "--model", str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["fingerprint"] == cfg.fingerprint() and info["tokenizer_vocab_size"] == cfg.vocab_size
    assert main(["model", "info", "--model", str(tmp_path / "nope")]) == 1
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("arch, dtype", [("mistral", "bfloat16"), ("qwen2", "float16")])
def test_cli_arch_and_dtype_load_in_transformers(tmp_path, arch, dtype):
    out = tmp_path / arch
    argv = ["model", "init", "--preset", "tiny", "--out", str(out), "--arch", arch, "--dtype", dtype]
    assert main(argv) == 0
    cfg = ModelConfig.from_pretrained(out)
    assert cfg.architecture == arch and cfg.dtype == dtype and cfg.qkv_bias == (arch == "qwen2")
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert type(model).__name__ == HF_ARCHITECTURE[arch]
    assert model.dtype == getattr(torch, dtype)
    ours = load_file(str(out / "model.safetensors"))
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), ours[name]), name
    hf_tok = AutoTokenizer.from_pretrained(str(out))
    assert hf_tok("fox").input_ids == Tokenizer.from_dir(out).encode("fox")


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    cfg = preset_config("tiny", arch="qwen2")
    a = write_random_checkpoint(tmp_path / "a", cfg, seed=7)
    b = write_random_checkpoint(tmp_path / "b", cfg, seed=7)
    c = write_random_checkpoint(tmp_path / "c", cfg, seed=8)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    wa, wc = load_file(str(a / "model.safetensors")), load_file(str(c / "model.safetensors"))
    assert not torch.equal(wa["lm_head.weight"], wc["lm_head.weight"])
    # Weights depend on (seed, name) only, so sharding does not change them.
    sharded = write_random_checkpoint(tmp_path / "s", cfg, seed=7, max_shard_bytes=100_000)
    merged = {}
    for f in sharded.glob("model-*.safetensors"):
        merged.update(load_file(str(f)))
    assert merged.keys() == wa.keys() and all(torch.equal(merged[k], wa[k]) for k in wa)
    # Rewriting a directory with fewer shards leaves no stale shard behind.
    write_random_checkpoint(tmp_path / "s", cfg, seed=7)
    assert sorted(p.name for p in (tmp_path / "s").glob("model*")) == ["model.safetensors"]


def test_writes_shard_by_shard(tmp_path, monkeypatch):
    """Each save_file call holds at most one shard's tensors: the llama3-8b writer never holds 16 GB."""
    calls = []
    real_save = ckpt.save_file

    def spy(tensors, path, metadata=None):
        calls.append(sum(t.numel() * t.element_size() for t in tensors.values()))
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(ckpt, "save_file", spy)
    cfg = preset_config("tiny", arch="llama")
    limit = 150_000
    out = write_random_checkpoint(tmp_path / "x", cfg, max_shard_bytes=limit)
    biggest = max(math.prod(s) * 4 for _, s in parameter_shapes(cfg))
    assert len(calls) > 3 and max(calls) <= max(limit, biggest)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(calls) == cfg.num_parameters() * 4
    assert set(index["weight_map"].values()) == {p.name for p in out.glob("model-*.safetensors")}


def test_presets(tmp_path):
    small = preset_config("small")
    assert 10e6 < small.num_parameters() < 60e6 and small.vocab_size > ckpt.TOKENIZER_VOCAB
    big = preset_config("llama3-8b")
    assert (big.num_layers, big.hidden_size, big.num_heads, big.num_kv_heads, big.intermediate_size,
            big.vocab_size, big.head_dim) == (32, 4096, 32, 8, 14336, 128256, 128)
    assert big.rope_theta == 500000.0 and big.dtype == "bfloat16" and big.max_position_embeddings == 131072
    assert big.rope_scaling == RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)
    assert big.num_parameters() == 8_030_261_248  # Llama-3.1-8B exactly
    shards = ckpt._plan_shards(parameter_shapes(big), torch.bfloat16, ckpt.DEFAULT_MAX_SHARD_BYTES)
    assert len(shards) == 4
    assert preset_config("llama3-8b", arch="qwen2").qkv_bias
    with pytest.raises(ValueError, match="unknown preset"):
        preset_config("huge")
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        write_random_checkpoint(tmp_path / "never", preset_config("tiny", vocab_size=100))
    assert not (tmp_path / "never").exists()


def test_padded_vocab_loads_and_generates_in_transformers(make_checkpoint):
    path = make_checkpoint("llama", vocab_size=ckpt.TOKENIZER_VOCAB + 128)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert model.lm_head.weight.shape[0] == ckpt.TOKENIZER_VOCAB + 128
    tok = Tokenizer.from_dir(path)
    out = model.generate(torch.tensor([tok.encode("The fox")]), max_new_tokens=8, do_sample=False)
    assert out.shape[1] > len(tok.encode("The fox"))
    assert isinstance(tok.decode(out[0].tolist()), str)  # ids past the tokenizer do not break decoding
