"""The engine's value types: how to run a model (``EngineConfig``) and what a step returns
(``StepOutput``, ``Reservation``). Re-exported by ``engine.engine``; see docs/engine-contract.md."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import KVCacheFull
from engine.kv_layout import dtype_name
from engine.kv_tiers.config import TierConfig
from engine.model_runner import TokenLogprob
from pdserve.settings import GPU_WAITS

DEFAULT_CPU_KV_BYTES = 1 << 30  # a CPU engine's cache without num_blocks / kv_cache_bytes: at most this


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How to run a model. ``model`` is a Hugging Face-style directory (or None with ``LLMEngine(model=)``).

    KV cache size: ``num_blocks`` if given, else ``kv_cache_bytes``, else on CUDA
    ``gpu_memory_utilization`` of the device minus what is in use after loading, else (CPU) enough for
    ``max_num_seqs`` full-context sequences capped at 1 GiB.
    """

    model: str | None = None
    dtype: str | None = None  # None: the checkpoint's
    device: str = "auto"  # "auto": cuda when available
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_queue: int = 1024
    attention_backend: str = "auto"
    # CUDA, eager steps of at least LAUNCH_THROTTLE_MIN_TOKENS: launch at most this many layers ahead of
    # the GPU (0: no limit). A whole prefill queued at once fills the device's launch queue, and every
    # other CUDA call of the process -- the KV sender's NIXL posts on the event loop -- then blocks
    # until the forward drains (measured on an H200: 80-210 ms per post, the loop frozen meanwhile).
    launch_ahead_layers: int = 4
    enable_prefix_caching: bool = True
    # host-memory and local-disk tiers behind the KV cache (engine.kv_tiers); off by default here,
    # sized by `pdserve serve --kv-host-gb / --kv-disk-dir / --kv-disk-gb`
    tiers: TierConfig = TierConfig()
    seed: int | None = None  # for requests without their own seed
    # decode CUDA graphs (engine.cuda_graphs) where the backend supports them; a prefill worker, which
    # never runs a decode step, turns them off
    cuda_graphs: bool = True
    # decode steps launched before the previous one's tokens are read (engine.step_ahead). None:
    # PDSERVE_OVERLAP_STEPS, else on CUDA at tensor parallel size 1
    overlap_steps: bool | None = None
    # CUDA: how the host waits for a step's sampled tokens and a prefill's layers (the KV push's
    # events). "blocking": the thread sleeps until the GPU is done (cudaEventBlockingSync; with steps
    # launched ahead the GPU is busy with the next step meanwhile, so the wake-up is off the critical
    # path); "spin": it polls, one core busy per waiting thread while the GPU computes (CUDA's default);
    # "auto": blocking where decode steps are launched ahead, spin where steps are synchronous (tensor
    # parallelism), whose wait is on the step's critical path (measured: +0.16-0.29 ms a step asleep)
    gpu_wait: str = "auto"

    def blocking_wait(self, overlap_steps: bool) -> bool:
        """Whether GPU waits sleep (``gpu_wait``; auto: where decode steps are launched ahead)."""
        return self.gpu_wait == "blocking" or (self.gpu_wait == "auto" and overlap_steps)

    def kv_blocks(self, per_block: int, device, max_model_len: int) -> int:
        """How many KV blocks of ``per_block`` bytes this rank's cache holds (see the class docstring)."""
        if self.num_blocks is not None:
            return self.num_blocks
        if self.kv_cache_bytes is not None:
            budget = self.kv_cache_bytes
        elif device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = int(free - (1 - self.gpu_memory_utilization) * total)
        else:
            want = self.max_num_seqs * -(-max_model_len // self.block_size) * per_block
            budget = min(want, DEFAULT_CPU_KV_BYTES)
        blocks = budget // per_block
        if blocks < 1:
            raise KVCacheFull(f"no memory left for the KV cache ({budget} bytes for blocks of {per_block})")
        return int(blocks)

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_queue"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if self.gpu_wait not in GPU_WAITS:
            raise ValueError(f"EngineConfig.gpu_wait must be one of {list(GPU_WAITS)}, got {self.gpu_wait!r}")
        if not isinstance(self.launch_ahead_layers, int) or self.launch_ahead_layers < 0:
            raise ValueError(f"EngineConfig.launch_ahead_layers must be an int >= 0, got "
                             f"{self.launch_ahead_layers!r}")
        for name in ("num_blocks", "kv_cache_bytes", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"EngineConfig.{name} must be a positive int or None, got {value!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({self.max_num_seqs})")
        if self.dtype is not None:
            object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if isinstance(self.tiers, dict):  # from JSON: a tensor-parallel rank's config (app/tp_ranks.py)
            object.__setattr__(self, "tiers", TierConfig(**self.tiers))
        if not isinstance(self.tiers, TierConfig):
            raise TypeError(f"EngineConfig.tiers must be a TierConfig, got {type(self.tiers).__name__}")


@dataclass(frozen=True, kw_only=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "prefilled" | "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_tier_tokens: int = 0  # of num_cached_tokens, loaded back from the host or disk tier
    error: str | None = None
    # "error" caused by the request itself (its constraint refused a token, or hit a grammar limit):
    # services answer INVALID_ARGUMENT (``failure``), and the router does not retry it elsewhere
    invalid: bool = False
    # Finished requests with stop strings: the output text cut before the matched stop string.
    text: str | None = None
    # "prefilled" outputs: the pinned block table, read on the engine thread as the output is made, so
    # the caller needs no second engine-thread round trip (which would wait out the next forward pass).
    block_ids: list[int] | None = None
    # "prefilled" outputs: time.monotonic() of the step that first scheduled the prompt (queue vs compute)
    first_scheduled_at: float | None = None


@dataclass(frozen=True)
class Reservation:
    block_ids: list[int]
    num_cached_tokens: int  # leading prompt tokens whose KV is already in those blocks (or is loading)
    num_tier_tokens: int = 0  # of those, tokens being loaded back from the host or disk tier


def failure(out: StepOutput) -> Exception:
    """The exception a service raises for an output finished with "error": ValueError (INVALID_ARGUMENT)
    when the request caused it, RuntimeError (INTERNAL) otherwise."""
    message = out.error or "generation failed"
    return ValueError(message) if out.invalid else RuntimeError(message)
