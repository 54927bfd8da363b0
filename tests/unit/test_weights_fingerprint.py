"""The KV layout's model fingerprint must tell apart checkpoints that share a shape."""

import shutil

import torch

from engine.engine import EngineConfig, LLMEngine
from engine.weights import weights_fingerprint


def _engine(path):
    return LLMEngine(EngineConfig(model=str(path), device="cpu", num_blocks=8))


def test_same_checkpoint_same_fingerprint_other_seed_differs(make_checkpoint, tmp_path):
    a = make_checkpoint("llama")
    b = make_checkpoint("llama", seed=1)
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    ea, eb, ec = _engine(a), _engine(b), _engine(copy)
    assert ea.model_config.fingerprint() == eb.model_config.fingerprint()  # same architecture ...
    assert ea.kv_layout.model_fingerprint != eb.kv_layout.model_fingerprint  # ... other weights
    assert ea.kv_layout.compat_hash() != eb.kv_layout.compat_hash()
    assert ea.kv_layout.model_fingerprint == ec.kv_layout.model_fingerprint  # same weights, other path
    assert weights_fingerprint(ea.model) == weights_fingerprint(ec.model)


def test_sample_indices_are_exact_past_float32_precision():
    from engine.weights import sample_indices

    # Llama-3's embedding: a float32 linspace rounds n - 1 up to n here (an out-of-bounds gather).
    n = 128256 * 4096
    idx = sample_indices(n, 16)
    assert idx.dtype == torch.int64 and idx[0] == 0 and idx[-1] == n - 1 and len(set(idx.tolist())) == 16
    assert bool((idx[1:] > idx[:-1]).all())
    assert sample_indices(5, 16).tolist() == [0, 1, 2, 3, 4]
    assert sample_indices(1, 16).tolist() == [0] and sample_indices(0, 16).numel() == 0
