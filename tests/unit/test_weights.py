"""engine.weights: single-file and sharded loading, dtype conversion, strict name/shape checks."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine.checkpoint import parameter_shapes, preset_config
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.model import build_model
from engine.weights import checkpoint_files, iter_tensors, load_weights


def reference_state(path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def hf_module(path, dtype=torch.float32):
    """transformers' own model class: its parameter names are the HF names by definition."""
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)


def test_load_into_meta_model_single_file(tiny_qwen2_dir):
    config = ModelConfig.from_pretrained(tiny_qwen2_dir)
    model = build_model(config, init="meta")
    stats = load_weights(model, tiny_qwen2_dir, dtype="float32", device="cpu")
    ref = reference_state(tiny_qwen2_dir)
    assert stats.files == ("model.safetensors",) and stats.num_tensors == len(ref)
    params = dict(model.named_parameters())
    assert not any(p.is_meta for p in params.values())
    assert set(params) == set(ref) and any(n.endswith("q_proj.bias") for n in params)
    for name, tensor in ref.items():
        assert torch.equal(params[name], tensor), name


def test_sharded_equals_single_and_matches_transformers(make_checkpoint):
    single = make_checkpoint("llama")
    sharded = make_checkpoint("llama", max_shard_bytes=200_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and all((sharded / s).is_file() for s in shards)
    assert not (sharded / "model.safetensors").exists()
    assert set(checkpoint_files(sharded)) == set(checkpoint_files(single))
    hf = hf_module(sharded)  # transformers follows the same index
    ours = hf_module(single)
    with torch.no_grad():
        for p in ours.parameters():
            p.zero_()
    stats = load_weights(ours, sharded)
    assert set(stats.files) == set(shards)
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(p, hf_params[name]), name
    streamed = dict(iter_tensors(sharded))
    assert set(streamed) == set(hf_params) and torch.equal(streamed["lm_head.weight"], hf.lm_head.weight)


def test_tied_embeddings_stay_tied(make_checkpoint):
    path = make_checkpoint("llama", tie_word_embeddings=True)
    assert "lm_head.weight" not in checkpoint_files(path)
    model = build_model(ModelConfig.from_pretrained(path), init="meta")
    load_weights(model, path, dtype="float32", device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.lm_head.weight.is_meta


@pytest.mark.parametrize("stored, target", [("float32", torch.bfloat16), ("bfloat16", torch.float32),
                                            ("float16", torch.float16)])
def test_dtype_conversion(make_checkpoint, stored, target):
    path = make_checkpoint("mistral", dtype=stored)
    ref = reference_state(path)
    assert ref["model.norm.weight"].dtype == getattr(torch, stored)
    model = build_model(ModelConfig.from_pretrained(path), init="meta")
    stats = load_weights(model, path, dtype=target, device="cpu")
    params = dict(model.named_parameters())
    assert all(p.dtype == target for p in params.values())
    assert stats.num_bytes == sum(p.numel() * p.element_size() for p in params.values())
    for name, tensor in ref.items():
        assert torch.equal(params[name], tensor.to(target)), name


def test_in_place_load_keeps_parameter_objects(tiny_llama_dir):
    model = build_model(ModelConfig.from_pretrained(tiny_llama_dir), init="random")
    before = {n: p for n, p in model.named_parameters()}
    load_weights(model, tiny_llama_dir)  # same dtype/device: copy_ into the existing tensors
    ref = reference_state(tiny_llama_dir)
    for name, p in model.named_parameters():
        assert p is before[name] and torch.equal(p, ref[name])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"], ids=["stored-dtype", "converted"])
def test_load_into_preallocated_fused_projections(tiny_qwen2_dir, dtype):
    """``allocate_fused`` on a meta model: q/k/v (with biases) and gate/up load in place into their
    concatenated weights, which ``fuse_projections`` then keeps; the values equal the checkpoint's."""
    config = ModelConfig.from_pretrained(tiny_qwen2_dir)
    model = build_model(config, init="meta")
    target = getattr(torch, dtype)
    model.allocate_fused(torch.device("cpu"), target)
    layer = model.model.layers[0]
    fused_qkv, fused_mlp = layer.self_attn.fused, layer.mlp.fused
    q_before = layer.self_attn.q_proj.weight
    load_weights(model, tiny_qwen2_dir, dtype=dtype, device="cpu")
    assert layer.self_attn.q_proj.weight is q_before  # filled in place, not replaced
    model.fuse_projections(False)
    assert layer.self_attn.fused is fused_qkv and layer.mlp.fused is fused_mlp
    ref = reference_state(tiny_qwen2_dir)
    pre = "model.layers.0."
    qkv = [ref[pre + f"self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(fused_qkv.weight, torch.cat(qkv).to(target))
    qkv_bias = [ref[pre + f"self_attn.{p}_proj.bias"] for p in "qkv"]
    assert torch.equal(fused_qkv.bias, torch.cat(qkv_bias).to(target))
    assert torch.equal(fused_mlp.weight, torch.cat([ref[pre + "mlp.gate_proj.weight"],
                                                    ref[pre + "mlp.up_proj.weight"]]).to(target))
    for name, p in model.named_parameters():
        assert torch.equal(p, ref[name].to(target)), name


def broken_copy(src, tmp_path, edit):
    """Copy a checkpoint, apply ``edit(tensors) -> tensors`` to its single weights file."""
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    save_file(edit(tensors), str(dst / "model.safetensors"))
    return dst


def test_missing_unexpected_and_misshaped_are_named(tiny_llama_dir, tmp_path):
    def edit(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        t["model.layers.9.self_attn.q_proj.weight"] = torch.zeros(2, 2)
        t["model.norm.weight"] = torch.ones(65)
        return t

    path = broken_copy(tiny_llama_dir, tmp_path, edit)
    model = build_model(ModelConfig.from_pretrained(tiny_llama_dir), init="random")
    snapshot = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ModelLoadError) as info:
        load_weights(model, path)
    msg = str(info.value)
    assert "missing tensors [model.layers.1.mlp.up_proj.weight]" in msg
    assert "unexpected tensors [model.layers.9.self_attn.q_proj.weight]" in msg
    assert "model.norm.weight: checkpoint [65] vs model [64]" in msg
    # Nothing was loaded: the checks run on headers before any tensor is copied.
    assert all(torch.equal(p, snapshot[n]) for n, p in model.named_parameters())


def test_tolerated_extras(tiny_llama_dir, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # old Llama checkpoints
        return t

    path = broken_copy(tiny_llama_dir, tmp_path, edit)
    cfg = ModelConfig.from_pretrained(path)
    load_weights(build_model(cfg, init="meta"), path, device="cpu")
    # A tied model reading a checkpoint that stores lm_head anyway ignores the copy, like transformers.
    tied = build_model(preset_config("tiny", arch="llama", tie_word_embeddings=True), init="meta")
    load_weights(tied, path, device="cpu")
    assert torch.equal(tied.lm_head.weight, load_file(str(path / "model.safetensors"))[
        "model.embed_tokens.weight"])


def test_bad_files_raise_model_load_error(make_checkpoint, tmp_path):
    model = build_model(preset_config("tiny", arch="llama"), init="meta")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weights"):
        load_weights(model, tmp_path)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_weights(model, tmp_path / "absent")
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match="cannot read safetensors file .*model.safetensors"):
        load_weights(model, tmp_path)

    sharded = make_checkpoint("llama", max_shard_bytes=200_000)
    dst = tmp_path / "sharded"
    shutil.copytree(sharded, dst)
    index_file = dst / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (dst / victim).unlink()
    with pytest.raises(ModelLoadError, match=f"names shard '{victim}'.* is missing"):
        load_weights(model, dst)
    shutil.copy(sharded / victim, dst / victim)
    first = sorted(index["weight_map"].values())[0]
    index["weight_map"]["lm_head.weight"] = first
    index_file.write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="places 'lm_head.weight' in .* does not hold it"):
        load_weights(model, dst)
    index_file.write_text("{")
    with pytest.raises(ModelLoadError, match="index.json is not valid JSON"):
        load_weights(model, dst)


def test_parameter_shapes_match_the_model():
    for arch in ("llama", "mistral", "qwen2"):
        for tie in (False, True):
            cfg = preset_config("tiny", arch=arch, tie_word_embeddings=tie)
            model = build_model(cfg, init="meta")
            assert {n: tuple(p.shape) for n, p in model.named_parameters()} == dict(parameter_shapes(cfg))
