"""Serving settings: every `pdserve serve` flag, and its PDSERVE_* environment variable, in one place.

Precedence is flag > environment > default. Each flag ``--some-flag`` may also come from
``PDSERVE_SOME_FLAG`` (so a Helm chart or a Ray actor can configure a worker with env only).
``add_serve_arguments`` (pdserve/serve_flags.py) declares the flags with ``default=None`` so that "not
given" is visible; ``ServeSettings.from_args`` then fills in the environment and the defaults and
validates the whole.
Nothing else in the project reads PDSERVE_* variables.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

ROLES = ("prefill", "decode", "router", "colocated")
TRANSPORTS = ("auto", "nixl", "tcp")
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "none")  # router/http/tools.py PARSERS
DISCOVERY = ("static", "redis", "k8s", "file")
POLICIES = ("prefix", "session+prefix", "prefix_only", "round_robin", "least_loaded")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ROUTER_MODES = ("disagg", "colocated")
CONDITIONAL = ("off", "auto")
ON_OFF = ("on", "off")
EVENT_LOOPS = ("auto", "uvloop", "asyncio")  # the asyncio loop a serving process runs on (pdserve.event_loop)
GPU_WAITS = ("auto", "blocking", "spin")  # how an engine thread waits for the GPU (EngineConfig.gpu_wait)
# --admission-drain (router/shedding.py): the drain wait bounds the estimate, replaces the push wait, or
# is left out
ADMISSION_DRAIN = ("on", "replace", "off")
ENV_PREFIX = "PDSERVE_"
# Defaults more than one component needs: a decode reservation's lease (also how long a Decode waits
# for its KV) and the graceful drain of a serving process.
DEFAULT_LEASE_MS = 30_000
DEFAULT_DRAIN_TIMEOUT_S = 30.0


def _split_addrs(value: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = value.split(",")
    return tuple(v.strip() for v in value if v and v.strip())


def default_advertise_host() -> str:
    """This host's IP as others would dial it; loopback when the hostname does not resolve."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


@dataclass(frozen=True, kw_only=True)
class ServeSettings:
    role: str
    model: str | None = None
    host: str = "0.0.0.0"
    port: int = 50051
    metrics_port: int = 0
    # router: the OpenAI-compatible HTTP door beside gRPC (0 = off), and the model name it answers to
    # (default: the model directory's name)
    http_port: int = 0
    served_model_name: str = ""
    tool_call_parser: str = "auto"  # router: how chat answers' tool calls are read (router/http/tools.py)
    # router: keys clients must present on both doors (authorization: Bearer KEY); the file holds one
    # key a line and is re-read when it changes (rotation without a restart)
    api_key: tuple[str, ...] = ()
    api_keys_file: str | None = None
    advertise_host: str = ""
    worker_id: str = ""
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_gb: float | None = None
    # KV tiers behind the device cache (engine.kv_tiers): host memory in GiB (None: sized from the
    # machine, 0: off), and a local-disk directory with its size in GiB ("" / 0: off)
    kv_host_gb: float | None = None
    kv_disk_dir: str = ""
    kv_disk_gb: float = 0.0
    # tracing (pdserve/tracing.py): an OTLP/gRPC receiver ("" = off) and the share of new traces sampled
    otlp_endpoint: str = ""
    otlp_sampling: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    launch_ahead_layers: int | None = None  # None: the engine's default (EngineConfig)
    gpu_wait: str = "auto"  # CUDA: the engine's waits for the GPU sleep or spin (EngineConfig.gpu_wait)
    event_loop: str = "auto"  # uvloop where it is installed, else asyncio's own (pdserve.event_loop)
    # decode / colocated: a stream message goes out once it holds this many tokens (first and last at once)
    stream_interval: int = 1
    # worker roles: ranks of one worker (engine.tp_worker); on CUDA rank r uses cuda:r of the visible GPUs
    tensor_parallel_size: int = 1
    # decode: take KV from prefill workers of up to this TP size when it exceeds this worker's (each rank
    # then receives its heads in pieces of num_kv_heads / N heads, regrouped in place); 0 = this worker's
    kv_source_tp: int = 0
    # prefill: blocks of a rank's staging area for receivers holding fewer KV heads per rank, in cache
    # blocks' worth of memory (0: a quarter of the cache); made on first use
    kv_staging_blocks: int = 0
    transport: str = "auto"
    kv_port: int = 0
    # KV listeners (side channel, TCP data, NIXL/UCX's TCP listeners) bind this host; "" = --host
    kv_host: str = ""
    # TCP KV plane: connections a prefill worker opens to each decode worker (transfers spread over them)
    kv_connections: int = 8
    # TCP KV plane: spread a transfer of more than one frame over all of those connections
    kv_stripe: str = "on"
    # TCP KV plane: a receive thread takes the next frame's head off the socket when it is there
    kv_rx_chain: str = "on"
    # TCP KV plane from device memory: a frame of several block runs staged with one gather / one scatter
    # on the GPU ("gather"), or one copy per run ("runs", for comparison)
    kv_staging: str = "gather"
    # decode: the KV plane (rank 0's agent) on an event loop of its own thread, not the gRPC streams' loop
    # (off: measured slower on 2x H200, docs/kvtransfer.md "An event loop of its own")
    kv_own_loop: str = "off"
    # TLS on the TCP KV plane: helper processes doing the record work (-1: the transport's default)
    kv_tls_procs: int = -1
    # prefill: push each layer's KV while the next one computes (when the transport supports it)
    kv_stream_layers: str = "on"
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S
    # router only
    discovery: str = "static"
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    redis: str | None = None
    k8s_namespace: str | None = None
    prefill_selector: str | None = None
    decode_selector: str | None = None
    policy: str = "prefix"
    session_ttl: float = 600.0
    # router: bound on one shared-store (Redis) call on the placement path; past it the router
    # decides from its local view (replicas may then disagree for that turn)
    store_timeout: float = 0.05
    # router, discovery "file": JSON {"prefill": [addr..], "decode": [addr..]}, re-read when it changes
    # (the launcher's way of telling its router about `pdserve scale`)
    workers_file: str | None = None
    # how long a decode reservation waits for its KV before it is released
    lease_ms: int = DEFAULT_LEASE_MS
    stats_interval: float = 0.5
    # router: "colocated" fronts colocated workers (listed as --decode / the workers file's decode
    # pool) with no prefill pool: every request prefills on the worker that decodes it
    mode: str = "disagg"
    # router, conditional disaggregation (router/conditional.py): "auto" lets the decode worker
    # prefill a prompt itself when its uncached part is short or moving its KV would take longer
    # than recomputing it. Off by default: on CPU no benefit was measured (docs/cluster.md).
    conditional_disagg: str = "off"
    min_uncached_tokens: int = 256
    local_prefill_tokens_per_s: float = 30000.0
    # ... and when the prefill worker's queue is longer than this (s; 0 = never for that reason), within
    # a budget of local_prefill_duty of the decode worker's time, local_prefill_burst_s at once
    max_prefill_wait_s: float = 0.5
    local_prefill_duty: float = 0.25
    local_prefill_burst_s: float = 0.25
    # ... and, while the decode worker runs streams, no single local prefill costing more than this (s)
    local_prefill_max_stall_s: float = 0.05
    # ... and a spill off a busy prefill queue saving less TTFT than this x the streams' summed delay
    local_prefill_stall_weight: float = 1.0
    # router, admission control (router/shedding.py): refuse (RESOURCE_EXHAUSTED, retry-after-ms) a
    # request whose estimated wait to start exceeds this many seconds (0: only its deadline); a decode
    # Allocate without free blocks waits in a queue of at most allocate_queue_size per decode worker,
    # at most allocate_queue_wait_s
    max_queue_wait_s: float = 0.0
    # ... the estimate is at least the prefill worker's tokens ahead over the rate its answers came (on),
    # or that in place of the push wait (replace), or neither (off): router/shedding.py
    admission_drain: str = "on"
    allocate_queue_size: int = 64
    # router: a decode worker's Allocates and Decode streams share one DecodeMany call
    # (router/decode_mux.py)
    decode_mux: str = "on"
    allocate_queue_wait_s: float = 10.0
    # router / colocated: the largest GenerateRequest accepted on the public port, in bytes; gRPC
    # refuses a larger one (RESOURCE_EXHAUSTED) before it is read into memory or tokenized
    max_request_bytes: int = 16 * 1024 * 1024
    # TLS on every gRPC port (pdserve/tls.py): ca.crt + <role>.crt/.key; workers require client certs
    tls_dir: str | None = None
    # router: continue a request on another worker when its worker dies (router/migration.py): at most
    # this many failed attempts per request, and this long waiting for a usable worker
    migration: str = "on"
    max_request_retries: int = 3
    retry_wait_s: float = 30.0
    extra: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _one_of("role", self.role, ROLES)
        _one_of("transport", self.transport, TRANSPORTS)
        _one_of("tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        _one_of("discovery", self.discovery, DISCOVERY)
        _one_of("policy", self.policy, POLICIES)
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("device", self.device, DEVICES)
        _one_of("mode", self.mode, ROUTER_MODES)
        _one_of("conditional_disagg", self.conditional_disagg, CONDITIONAL)
        _one_of("kv_stream_layers", self.kv_stream_layers, ON_OFF)
        _one_of("gpu_wait", self.gpu_wait, GPU_WAITS)
        _one_of("event_loop", self.event_loop, EVENT_LOOPS)
        if self.min_uncached_tokens < 0 or not self.local_prefill_tokens_per_s > 0:
            raise ValueError("--min-uncached-tokens must be >= 0 and --local-prefill-tokens-per-s > 0")
        if (min(self.max_prefill_wait_s, self.local_prefill_burst_s, self.local_prefill_max_stall_s,
                self.local_prefill_stall_weight) < 0 or not 0 < self.local_prefill_duty <= 1):
            raise ValueError("--max-prefill-wait-s, --local-prefill-burst-s, --local-prefill-max-stall-s and "
                             "--local-prefill-stall-weight must be >= 0 and --local-prefill-duty in (0, 1]")
        for name in ("port", "metrics_port", "kv_port", "http_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ValueError(f"--{name.replace('_', '-')} must be in 0..65535, got {value}")
        for name in ("block_size", "max_num_seqs", "lease_ms", "tensor_parallel_size", "stream_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.kv_source_tp < 0 or self.kv_staging_blocks < 0:
            raise ValueError("--kv-source-tp and --kv-staging-blocks must be >= 0")
        if not 1 <= self.kv_connections <= 64:
            raise ValueError(f"--kv-connections must be in 1..64, got {self.kv_connections}")
        if not -1 <= self.kv_tls_procs <= 64:
            raise ValueError(f"--kv-tls-procs must be in 0..64 (or -1: default), got {self.kv_tls_procs}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"--num-blocks must be >= 1, got {self.num_blocks}")
        if self.num_blocks is not None and self.kv_memory_gb is not None:
            raise ValueError("give either --num-blocks or --kv-memory-gb, not both")
        if self.kv_memory_gb is not None and not self.kv_memory_gb > 0:
            raise ValueError(f"--kv-memory-gb must be > 0, got {self.kv_memory_gb}")
        if self.kv_host_gb is not None and not self.kv_host_gb >= 0:
            raise ValueError(f"--kv-host-gb must be >= 0 (0: no host tier), got {self.kv_host_gb}")
        if not 0.0 <= self.otlp_sampling <= 1.0:
            raise ValueError(f"--otlp-sampling must be in [0, 1], got {self.otlp_sampling}")
        if bool(self.kv_disk_dir) != (self.kv_disk_gb > 0) or self.kv_disk_gb < 0:
            raise ValueError("a disk KV tier needs both --kv-disk-dir DIR and --kv-disk-gb N > 0")
        _one_of("migration", self.migration, ON_OFF)
        _one_of("admission_drain", self.admission_drain, ADMISSION_DRAIN)
        _one_of("decode_mux", self.decode_mux, ON_OFF)
        if self.max_request_retries < 0 or self.retry_wait_s < 0:
            raise ValueError("--max-request-retries and --retry-wait-s must be >= 0")
        if not 1024 <= self.max_request_bytes <= 1 << 30:
            raise ValueError(f"--max-request-bytes must be in 1024..{1 << 30}, got {self.max_request_bytes}")
        if self.max_queue_wait_s < 0 or self.allocate_queue_size < 0 or self.allocate_queue_wait_s < 0:
            raise ValueError("--max-queue-wait-s, --allocate-queue-size and --allocate-queue-wait-s must be "
                             ">= 0")
        if self.store_timeout <= 0:
            raise ValueError(f"--store-timeout must be > 0, got {self.store_timeout}")
        if self.drain_timeout < 0 or self.session_ttl <= 0 or self.stats_interval <= 0:
            raise ValueError("--drain-timeout must be >= 0 and --session-ttl / stats interval > 0")
        if self.role != "router" and (self.http_port or self.api_key or self.api_keys_file):
            raise ValueError("--http-port, --api-key and --api-keys-file are router flags")
        if self.http_port and self.http_port == self.port:
            raise ValueError(f"--http-port {self.http_port} is the gRPC --port as well")
        if self.role != "router" and not self.model:
            raise ValueError(f"--model DIR is required for role {self.role!r} (or PDSERVE_MODEL)")
        if self.role == "router":
            if self.discovery == "static" and self.mode == "colocated" and not self.decode:
                raise ValueError("router with --mode colocated needs --decode ADDR[,..] (the colocated "
                                 "workers)")
            if self.discovery == "static" and self.mode == "disagg" and not (self.prefill and self.decode):
                raise ValueError("router with --discovery static needs --prefill ADDR[,..] and "
                                 "--decode ADDR[,..]")
            if self.discovery == "redis" and not self.redis:
                raise ValueError("--discovery redis needs --redis URL")
            if self.discovery == "file" and not self.workers_file:
                raise ValueError("--discovery file needs --workers-file PATH")
        if not self.advertise_host:
            object.__setattr__(self, "advertise_host", default_advertise_host())
        if not self.worker_id:
            object.__setattr__(self, "worker_id", f"{self.role}-{uuid.uuid4().hex[:8]}")

    @property
    def advertise_address(self) -> str:
        return f"{self.advertise_host}:{self.port}"

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] | None = None) -> ServeSettings:
        """Merge parsed flags (None = not given) with PDSERVE_* env vars and the defaults."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        for f in fields(cls):
            if f.name == "extra":
                continue
            given = getattr(args, f.name, None)
            if given is None:
                raw = env.get(ENV_PREFIX + f.name.upper())
                if raw is None or raw == "":
                    continue
                given = _parse(f.name, raw)
            if f.name in ("prefill", "decode", "api_key"):
                given = _split_addrs(given)  # type: ignore[arg-type]
            values[f.name] = given
        if "role" not in values:
            raise ValueError("--role is required (or PDSERVE_ROLE)")
        return cls(**values)  # type: ignore[arg-type]


_INT = {"port", "metrics_port", "http_port", "block_size", "num_blocks", "max_num_seqs", "stream_interval",
        "max_num_batched_tokens",
        "launch_ahead_layers", "tensor_parallel_size", "kv_source_tp", "kv_staging_blocks",
        "kv_port", "kv_connections", "kv_tls_procs", "lease_ms", "min_uncached_tokens",
        "allocate_queue_size", "max_request_bytes", "max_request_retries"}
_FLOAT = {"retry_wait_s", "kv_memory_gb", "kv_host_gb", "kv_disk_gb", "otlp_sampling",
          "drain_timeout", "session_ttl", "stats_interval", "store_timeout",
          "local_prefill_tokens_per_s", "max_prefill_wait_s", "local_prefill_duty", "local_prefill_burst_s",
          "local_prefill_max_stall_s", "local_prefill_stall_weight",
          "max_queue_wait_s", "allocate_queue_wait_s"}


def _parse(name: str, raw: str) -> object:
    try:
        if name in _INT:
            return int(raw)
        if name in _FLOAT:
            return float(raw)
    except ValueError:
        raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a number") from None
    return raw


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"--{name.replace('_', '-')} must be one of {list(allowed)}, got {value!r}")


# ---- the process environment beyond the serve flags ---------------------------------------------------
# Debugging switches and what launchers hand on to their children. Read here so that every variable the
# project looks at is listed in one file; callers get plain values.


def environ() -> dict[str, str]:
    """A copy of this process's environment (launchers start children with it)."""
    return dict(os.environ)


def replace_environ(env: Mapping[str, str]) -> None:
    """This process's environment becomes exactly ``env`` (a child forked by the launcher's zygote
    taking the environment its start asked for, as a fresh process would have been given it)."""
    os.environ.clear()
    os.environ.update(env)


def env_switch(name: str, default: bool = True) -> bool:
    """An on/off debugging switch: ``0`` turns it off, ``1`` on; unset keeps ``default``.

    Used for ``PDSERVE_CUDA_GRAPHS``, ``PDSERVE_FUSED_OPS``, ``PDSERVE_GEMV``, ``PDSERVE_FLASHINFER_LEAN``,
    ``PDSERVE_BOOT_PREFETCH``,
    ``PDSERVE_READAHEAD``, ``PDSERVE_KV_TRACE`` and ``PDSERVE_UCX_PROTO_INFO`` (docs/gpu.md lists what
    each does).
    """
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    return raw != "0"


def bench_command() -> str:
    """The command a benchmark result records: ``PDSERVE_BENCH_COMMAND`` (``bench/device_run.sh`` sets
    it to its own command line), else this process's command line."""
    import shlex
    import sys

    return os.environ.get("PDSERVE_BENCH_COMMAND") or shlex.join([sys.executable, *sys.argv])


def bench_commit() -> str:
    """The commit a benchmark result records when the tree has no git (a device machine's copy):
    ``PDSERVE_COMMIT``, else empty."""
    return os.environ.get("PDSERVE_COMMIT", "")


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` set in this process's environment, and so in every child it starts, while the body
    runs; what was there before is put back after (benchmarks comparing worker settings side by side)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def overlap_steps() -> bool | None:
    """``PDSERVE_OVERLAP_STEPS``: ``1`` launches decode steps before the previous one's tokens are read
    (engine.step_ahead) everywhere (CPU, tensor parallelism), ``0`` never; unset: None (the engine's
    default: on CUDA at tensor parallel size 1)."""
    raw = os.environ.get("PDSERVE_OVERLAP_STEPS", "")
    return None if raw == "" else raw != "0"


TP_SYMM_DEFAULT_KIB = 2048  # batch x hidden in bf16 up to here: decode at batch 256 of a 4096-wide model


def tp_allreduce() -> tuple[str, int]:
    """``PDSERVE_TP_ALLREDUCE``: how a tensor-parallel worker sums activations over its ranks on CUDA.
    ``nccl`` (or unset) for all of them; ``symm`` for a one-shot kernel over symmetric memory up to
    2 MiB, NCCL above (engine.tp_allreduce); ``symm:<KiB>`` sets that size. Returns (mode, max bytes)."""
    raw = os.environ.get("PDSERVE_TP_ALLREDUCE", "").strip()
    if raw in ("", "nccl"):
        return "nccl", 0
    mode, _, kib = raw.partition(":")
    if mode != "symm" or (kib and not (kib.isdigit() and 0 < int(kib) <= 1 << 20)):
        raise ValueError(f"PDSERVE_TP_ALLREDUCE must be nccl, symm or symm:<KiB> (1..1048576), got {raw!r}")
    return "symm", (int(kib) if kib else TP_SYMM_DEFAULT_KIB) * 1024


def cuda_graphs_at_start(default: int) -> int:
    """``PDSERVE_CUDA_GRAPHS_AT_START``: decode CUDA graphs for batch sizes up to this are captured
    before a worker turns SERVING (the others while it is idle, engine.cuda_graphs); unset keeps
    ``default``. Raises ValueError for anything but a positive integer."""
    raw = os.environ.get("PDSERVE_CUDA_GRAPHS_AT_START", "")
    if raw == "":
        return default
    value = int(raw) if raw.strip().lstrip("-").isdigit() else 0
    if value <= 0:
        raise ValueError(f"PDSERVE_CUDA_GRAPHS_AT_START must be a positive integer, got {raw!r}")
    return value


EARLY_UPLOAD_MODES = ("auto", "mapped", "register", "read", "off")


def early_upload_mode() -> str:
    """``PDSERVE_EARLY_UPLOAD``: how a one-GPU worker puts its checkpoint on the GPU while it imports
    torch (engine.early_upload). ``read`` reads every file in pieces into page-locked buffers, in
    lanes; ``auto`` (unset, ``1``) does so for the files the page cache holds and reads the others in
    one lane; ``mapped`` hands each file's mapping to the driver as pageable memory; ``register`` pins
    the page cache's pages of each file and copies the file in one piece; ``off`` (or ``0``) leaves it
    to the load."""
    raw = os.environ.get("PDSERVE_EARLY_UPLOAD", "").strip() or "auto"
    mode = {"1": "auto", "0": "off"}.get(raw, raw)
    if mode not in EARLY_UPLOAD_MODES:
        raise ValueError(f"PDSERVE_EARLY_UPLOAD must be one of {', '.join(EARLY_UPLOAD_MODES)}, 0 or 1, "
                         f"got {raw!r}")
    return mode


def bytecode_cache() -> str:
    """``PDSERVE_BYTECODE_CACHE`` (pdserve.bytecode): ``auto`` (unset), ``off`` (or ``0``), or a directory."""
    raw = os.environ.get("PDSERVE_BYTECODE_CACHE", "").strip() or "auto"
    return {"0": "off"}.get(raw, raw)


def cache_home() -> Path:
    """``$XDG_CACHE_HOME``, else ``~/.cache``: where a user's caches go."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def early_upload_threads() -> int:
    """``PDSERVE_EARLY_UPLOAD_THREADS``: lanes of the early upload's copies (engine.early_upload);
    unset: 4, fewer where this process may use fewer CPUs (one is left to the imports)."""
    raw = os.environ.get("PDSERVE_EARLY_UPLOAD_THREADS", "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"PDSERVE_EARLY_UPLOAD_THREADS must be a positive integer, got {raw!r}")
        return int(raw)
    return max(1, min(4, len(os.sched_getaffinity(0)) - 1))


def stall_watch_ms() -> float:
    """``PDSERVE_STALL_WATCH_MS`` (0 = off); a value that is not a number is off, with ValueError's text."""
    raw = os.environ.get("PDSERVE_STALL_WATCH_MS", "0") or "0"
    return float(raw)


def grammar_compile_timeout_s() -> float:
    """``PDSERVE_GRAMMAR_COMPILE_TIMEOUT_S`` (default 10): how long a router or worker waits for a
    structured-output constraint to compile before refusing it (engine.grammar; the compilation runs off
    the event loop and the engine thread, and llguidance's limits bound it as well)."""
    raw = os.environ.get("PDSERVE_GRAMMAR_COMPILE_TIMEOUT_S", "") or "10"
    value = float(raw)
    if not value > 0:
        raise ValueError(f"PDSERVE_GRAMMAR_COMPILE_TIMEOUT_S must be > 0, got {raw!r}")
    return value


def ucx_tls_for_tests() -> str:
    """UCX transports for NIXL in local test clusters (``PDSERVE_TEST_UCX_TLS``, default ``tcp``)."""
    return os.environ.get("PDSERVE_TEST_UCX_TLS", "tcp")


# ---- the KV transport (kvtransfer.TransportConfig) ------------------------------------------------------


def kv_transport_options(settings: ServeSettings, env: Mapping[str, str] | None = None) -> dict:
    """TransportConfig keyword arguments for a worker: the KV host, connections, tracing, mutual TLS (the
    cluster's certificates, ``<tls_dir>/ca.crt`` and ``<tls_dir>/<role>.crt|.key``, when a TLS directory
    is configured) and the UCX variables the NIXL agent sets in its process (``ucx_env``)."""
    env = os.environ if env is None else env
    host = settings.kv_host or settings.host
    opts: dict = {"listen_host": host, "listen_port": settings.kv_port,
                  "tcp_connections": settings.kv_connections, "tcp_stripe": settings.kv_stripe == "on",
                  "tcp_rx_chain": settings.kv_rx_chain == "on",
                  "staging_gather": settings.kv_staging == "gather",
                  "trace": env_switch("PDSERVE_KV_TRACE", False)}
    if host in ("0.0.0.0", "::", ""):
        opts["advertise_host"] = settings.advertise_host
    tls_dir = getattr(settings, "tls_dir", None)
    if tls_dir:
        role = settings.role
        opts.update(tls_ca=os.path.join(tls_dir, "ca.crt"), tls_cert=os.path.join(tls_dir, f"{role}.crt"),
                    tls_key=os.path.join(tls_dir, f"{role}.key"))
        if settings.kv_tls_procs >= 0:
            opts["tls_procs"] = settings.kv_tls_procs
    ucx: dict[str, str] = {}
    if env_switch("PDSERVE_UCX_PROTO_INFO", True) and "UCX_PROTO_INFO" not in env:
        ucx["UCX_PROTO_INFO"] = "y"
    if "UCX_NET_DEVICES" not in env:
        devices = ucx_net_devices(host)
        if devices:
            ucx["UCX_NET_DEVICES"] = devices
    opts["ucx_env"] = tuple(ucx.items())
    return opts


def ucx_net_devices(host: str) -> str:
    """UCX_NET_DEVICES for a KV host, so UCX's TCP listeners bind its interface only: the interface that
    holds the address (``lo`` for loopback) plus every RDMA port (``mlx5_0:1``: not a TCP listener, and
    the one to keep for bandwidth); "" (UCX's default, every device) for all interfaces or an address no
    interface holds."""
    import ipaddress  # noqa: PLC0415
    import socket as sock  # noqa: PLC0415

    if host in ("0.0.0.0", "::", ""):
        return ""
    try:
        addr = sock.gethostbyname(host)
    except OSError:
        return ""
    name = "lo" if ipaddress.ip_address(addr).is_loopback else _interface_of(addr)
    if not name:
        return ""
    rdma = []
    ib = "/sys/class/infiniband"
    if os.path.isdir(ib):
        for dev in sorted(os.listdir(ib)):
            ports = os.path.join(ib, dev, "ports")
            rdma += [f"{dev}:{p}" for p in sorted(os.listdir(ports))] if os.path.isdir(ports) else []
    return ",".join([name, *rdma])


def _interface_of(addr: str) -> str:
    """The network interface holding an IPv4 address (Linux SIOCGIFADDR), "" if none."""
    import fcntl  # noqa: PLC0415
    import socket as sock  # noqa: PLC0415
    import struct  # noqa: PLC0415

    with sock.socket(sock.AF_INET, sock.SOCK_DGRAM) as s:
        for _index, name in sock.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if sock.inet_ntoa(raw[20:24]) == addr:
                return name
    return ""
