"""Model configuration: what the transformer looks like, parsed from a Hugging Face ``config.json``.

``ModelConfig.from_pretrained(dir)`` reads ``config.json`` (and ``generation_config.json`` for extra
eos ids) of a Llama 2/3, Mistral or Qwen2 checkpoint. Everything the runtime cannot run faithfully is
refused with a ``ModelLoadError`` naming the file and the problem, rather than silently computing
something the reference implementation would not: other activations, MLP or output biases, RoPE
scaling kinds other than ``llama3``/``linear``, per-layer sliding windows.

Both spellings ``transformers`` has used are accepted: ``torch_dtype`` (4.x) / ``dtype`` (5.x), and
``rope_theta`` + ``rope_scaling`` (4.x) / ``rope_parameters`` (5.x, carrying ``rope_theta`` inside).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError
from engine.kv_layout import dtype_name

# HF class name -> our architecture name (and back, for writing config.json).
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
HF_ARCHITECTURE = {arch: cls for cls, arch in ARCHITECTURES.items()}
# transformers' defaults for keys a config.json may leave out (per its config classes).
_MAX_POSITIONS_DEFAULT = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768}
_ROPE_TYPES = ("llama3", "linear")


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling. ``llama3`` needs all four numbers; ``linear`` only ``factor``."""

    rope_type: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in _ROPE_TYPES:
            raise ValueError(f"rope_scaling type {self.rope_type!r} is not supported "
                             f"(supported: {_ROPE_TYPES})")
        _positive("rope_scaling.factor", self.factor, float)
        if self.rope_type == "llama3":
            for name in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                if getattr(self, name) is None:
                    raise ValueError(f"rope_scaling type 'llama3' needs {name!r}")
            _positive("rope_scaling.low_freq_factor", self.low_freq_factor, float)
            _positive("rope_scaling.original_max_position_embeddings",
                      self.original_max_position_embeddings, int)
            if not self.high_freq_factor > self.low_freq_factor:
                raise ValueError(f"rope_scaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                                 f"low_freq_factor ({self.low_freq_factor})")

    def to_hf_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor,
                       original_max_position_embeddings=self.original_max_position_embeddings)
        return out

    def scale_inv_freq(self, inv_freq: list[float]) -> list[float]:
        """Apply the scaling to RoPE inverse frequencies (same arithmetic as ``transformers``)."""
        if self.rope_type == "linear":
            return [f / self.factor for f in inv_freq]
        old_ctx = self.original_max_position_embeddings
        low_wavelen = old_ctx / self.low_freq_factor
        high_wavelen = old_ctx / self.high_freq_factor
        out = []
        for f in inv_freq:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:  # high frequency: untouched
                out.append(f)
            elif wavelen > low_wavelen:  # low frequency: fully interpolated
                out.append(f / self.factor)
            else:  # in between: smooth blend of the two
                smooth = (old_ctx / wavelen - self.low_freq_factor) / (self.high_freq_factor
                                                                        - self.low_freq_factor)
                out.append((1 - smooth) * f / self.factor + smooth * f)
        return out


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The shape of a decoder-only transformer; see docs/engine-contract.md for the field list."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None  # None: hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    sliding_window: int | None = None
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.architecture not in HF_ARCHITECTURE:
            raise ValueError(f"architecture {self.architecture!r} is not supported "
                             f"(supported: {sorted(HF_ARCHITECTURE)})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "max_position_embeddings"):
            _positive(name, getattr(self, name), int)
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size ({self.hidden_size}) is not divisible by num_heads "
                                 f"({self.num_heads}) and head_dim is not given")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        _positive("head_dim", self.head_dim, int)
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        _positive("rms_norm_eps", self.rms_norm_eps, float)
        _positive("rope_theta", self.rope_theta, float)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling must be a RopeScaling or None, got {type(self.rope_scaling)}")
        if self.sliding_window is not None:
            _positive("sliding_window", self.sliding_window, int)
        for name in ("tie_word_embeddings", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        for name, tok in [("bos_token_id", self.bos_token_id)] + [("eos_token_ids", t) for t in
                                                                   self.eos_token_ids]:
            if tok is not None and (not isinstance(tok, int) or isinstance(tok, bool)
                                    or not 0 <= tok < self.vocab_size):
                raise ValueError(f"{name} {tok!r} is not a token id in [0, {self.vocab_size})")

    # -- derived -----------------------------------------------------------------------------
    @property
    def torch_dtype(self):
        import torch  # local: keeps config parsing importable without touching torch state

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def rope_inv_freq(self) -> list[float]:
        """RoPE inverse frequencies (head_dim // 2 of them), scaling applied, in float64 math."""
        # transformers computes base ** (arange(0, dim, 2) / dim) in float32; callers that need
        # bit-parity should do the same from rope_theta (this is the exact-math version).
        inv = [1.0 / (self.rope_theta ** (i / self.head_dim)) for i in range(0, self.head_dim, 2)]
        return self.rope_scaling.scale_inv_freq(inv) if self.rope_scaling else inv

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        per_layer = attn + 3 * h * i + 2 * h
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + h

    def fingerprint(self) -> str:
        """Stable short hash of what determines the network's function and KV shape (not dtype, ids)."""
        arch = {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("dtype", "bos_token_id", "eos_token_ids")}
        arch["rope_scaling"] = self.rope_scaling.to_hf_dict() if self.rope_scaling else None
        canonical = json.dumps(arch, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    # -- Hugging Face config.json ------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Parse ``path/config.json`` (+ optional ``generation_config.json``); ModelLoadError on problems."""
        path = Path(path)
        if not path.exists():
            raise ModelLoadError(f"model directory {path} does not exist")
        if not path.is_dir():
            raise ModelLoadError(f"model path {path} is not a directory")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelLoadError(f"no config.json in model directory {path}")
        hf = _read_json(cfg_file)
        gen_file = path / "generation_config.json"
        gen = _read_json(gen_file) if gen_file.is_file() else None
        try:
            return cls.from_hf_dict(hf, generation_config=gen)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{cfg_file}: {exc}") from None
        except (ValueError, TypeError, KeyError) as exc:
            raise ModelLoadError(f"{cfg_file}: {exc}") from None

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], *, generation_config: dict[str, Any] | None = None,
                     ) -> ModelConfig:
        arch = _architecture(hf)
        if hf.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
        if arch == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
            raise ModelLoadError("Llama attention_bias/mlp_bias=true is not supported")
        if hf.get("pretraining_tp", 1) not in (1, None):
            raise ModelLoadError(f"pretraining_tp={hf['pretraining_tp']} is not supported (only 1)")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if hf.get(k) is None]
        if missing:
            raise ModelLoadError(f"missing required keys {missing}")
        num_heads = hf["num_attention_heads"]
        theta, scaling = _rope(hf)
        gen = generation_config or {}
        bos = hf.get("bos_token_id")
        if bos is None:
            bos = gen.get("bos_token_id")
        eos: list[int] = []
        for source in (hf.get("eos_token_id"), gen.get("eos_token_id")):
            for tok in source if isinstance(source, list) else [source]:
                if tok is not None and tok not in eos:
                    eos.append(tok)
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim"),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", _MAX_POSITIONS_DEFAULT[arch]),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2",
            sliding_window=_sliding_window(hf, arch),
            dtype=_dtype(hf),
            bos_token_id=bos,
            eos_token_ids=tuple(eos),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict that both this module and ``transformers`` load back to the same model."""
        hf: dict[str, Any] = {
            "architectures": [HF_ARCHITECTURE[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.to_hf_dict() if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (self.eos_token_ids[0] if len(self.eos_token_ids) == 1
                             else list(self.eos_token_ids) or None),
            "use_cache": True,
        }
        if self.architecture == "llama":
            hf.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
        elif self.architecture == "mistral":
            hf["sliding_window"] = self.sliding_window
        else:  # qwen2: a global window is "every layer from layer 0 slides"
            hf.update(use_sliding_window=self.sliding_window is not None,
                      sliding_window=self.sliding_window, max_window_layers=0 if self.sliding_window
                      else self.num_layers)
        return hf

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- helpers ---------------------------------------------------------------------------------
def _positive(name: str, value: Any, kind: type) -> None:
    ok_type = isinstance(value, (int, float)) if kind is float else isinstance(value, int)
    if isinstance(value, bool) or not ok_type or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive {kind.__name__}, got {value!r}")


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{file} is not valid JSON: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read {file}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def _architecture(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures")
    if archs:
        if not isinstance(archs, list) or len(archs) != 1:
            raise ModelLoadError(f"'architectures' must list exactly one class, got {archs!r}")
        if archs[0] not in ARCHITECTURES:
            raise ModelLoadError(f"unsupported architecture {archs[0]!r} "
                                 f"(supported: {', '.join(sorted(ARCHITECTURES))})")
        return ARCHITECTURES[archs[0]]
    model_type = hf.get("model_type")
    if model_type in HF_ARCHITECTURE:
        return model_type
    raise ModelLoadError(f"unsupported or missing model type (architectures={archs!r}, "
                         f"model_type={model_type!r}); supported: {', '.join(sorted(ARCHITECTURES))}")


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    params = hf.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ModelLoadError(f"rope_parameters must be an object, got {params!r}")
    params = dict(params or {})
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = hf.get("rope_theta", 10000.0)
    scaling = hf.get("rope_scaling")
    if scaling is None and params:
        scaling = params  # transformers 5: one dict holds theta and the scaling kind
    if scaling is None:
        return theta, None
    if not isinstance(scaling, dict):
        raise ModelLoadError(f"rope_scaling must be an object or null, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in _ROPE_TYPES:
        raise ModelLoadError(f"rope_scaling type {kind!r} is not supported (supported: {_ROPE_TYPES})")
    orig = scaling.get("original_max_position_embeddings")
    if kind == "llama3" and orig is None:  # transformers falls back to max_position_embeddings
        orig = hf.get("max_position_embeddings")
    return theta, RopeScaling(
        rope_type=kind, factor=scaling.get("factor"),
        low_freq_factor=scaling.get("low_freq_factor") if kind == "llama3" else None,
        high_freq_factor=scaling.get("high_freq_factor") if kind == "llama3" else None,
        original_max_position_embeddings=orig if kind == "llama3" else None)


def _sliding_window(hf: dict[str, Any], arch: str) -> int | None:
    if arch == "llama":
        return None
    window = hf.get("sliding_window")
    if arch == "mistral" or window is None:
        return window
    # Qwen2: the window applies only with use_sliding_window, and only to layers >= max_window_layers.
    if not hf.get("use_sliding_window", False):
        return None
    layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types:
        sliding = [t == "sliding_attention" for t in layer_types]
    else:
        first = hf.get("max_window_layers", 28)
        sliding = [i >= first for i in range(layers)]
    if all(sliding):
        return window
    if not any(sliding):
        return None
    raise ModelLoadError("Qwen2 sliding window on only some layers (max_window_layers/layer_types) "
                         "is not supported")


def _dtype(hf: dict[str, Any]) -> str:
    raw = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    try:
        return dtype_name(str(raw))
    except ValueError:
        raise ModelLoadError(f"dtype {raw!r} is not supported (float32, bfloat16, float16)") from None
