"""The KV layout's model fingerprint must tell apart checkpoints that share a shape."""

import shutil

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
