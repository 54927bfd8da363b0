"""Shared fixtures: small random checkpoints in Hugging Face layout, written once per test session.

``make_checkpoint(arch="llama", **overrides) -> Path`` writes (or returns the cached) directory of a
``tiny`` preset checkpoint: float32, GQA (4 heads / 2 KV heads), 4 layers, hidden 64, vocab 1024,
with ``tokenizer.json``. ``overrides`` are ``ModelConfig`` fields (``tie_word_embeddings=True``,
``rope_scaling=RopeScaling(...)``, ``sliding_window=8``, ``dtype="bfloat16"``, ``vocab_size=1100``
...) plus three writer options: ``seed`` (default 0), ``max_shard_bytes`` (small values give a
sharded checkpoint with an index) and ``with_tokenizer`` (default True). The same arguments return
the same directory, so tests must treat it as read-only (copy it before breaking it on purpose).

Fixtures ``tiny_llama_dir``, ``tiny_mistral_dir`` and ``tiny_qwen2_dir`` are the three families with
default settings (Qwen2 has q/k/v biases by construction).

Test order is random (pytest-randomly, loaded by ``addopts`` in pyproject.toml) so that a test leaning
on another one's leftovers fails where it is written, not on some later submission. The seed is
printed first and last in every run, ``-q`` included (which hides pytest's header); replay a run with
``make test PYTEST_ARGS="-p randomly --randomly-seed=N"``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.checkpoint import preset_config, write_random_checkpoint

MakeCheckpoint = Callable[..., Path]


def _seed_line(config: pytest.Config) -> str | None:
    seed = getattr(config.option, "randomly_seed", None)
    if not isinstance(seed, int) or not config.getoption("randomly_reorganize", True):
        return None
    replay = f'make test PYTEST_ARGS="-p randomly --randomly-seed={seed}"'
    return f"Using --randomly-seed={seed} (replay: {replay})"


def pytest_sessionstart(session: pytest.Session) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    line = _seed_line(session.config)
    if reporter is not None and line and reporter.verbosity < 0:  # else pytest's header has it
        reporter.write_line(line)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    line = _seed_line(config)
    if line:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> MakeCheckpoint:
    root = tmp_path_factory.mktemp("checkpoints")
    cache: dict[str, Path] = {}

    def make(arch: str = "llama", *, seed: int = 0, max_shard_bytes: int = 5 * 1024**3,
             with_tokenizer: bool = True, preset: str = "tiny", **overrides) -> Path:
        key = repr((arch, seed, max_shard_bytes, with_tokenizer, preset, sorted(overrides.items())))
        if key not in cache:
            config = preset_config(preset, arch=arch, **overrides)
            name = f"{preset}-{arch}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
            cache[key] = write_random_checkpoint(root / name, config, seed=seed,
                                                 max_shard_bytes=max_shard_bytes,
                                                 with_tokenizer=with_tokenizer)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(make_checkpoint: MakeCheckpoint) -> Path:
    return make_checkpoint("llama")


@pytest.fixture(scope="session")
def tiny_mistral_dir(make_checkpoint: MakeCheckpoint) -> Path:
    return make_checkpoint("mistral")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(make_checkpoint: MakeCheckpoint) -> Path:
    return make_checkpoint("qwen2")
