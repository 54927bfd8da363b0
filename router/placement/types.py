"""Value types of the placement interface: what the router servicer hands the Placer and gets back.

Everything here is a plain frozen dataclass so it can be logged, compared in tests and copied
between threads without locks. Nothing here talks to the network.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

ROLES = ("prefill", "decode")
# prefix (default): a request with a session id goes to its session's pair while that pair is usable,
# any other by the cost model (prefix overlap on both sides, load, links); session+prefix: the same;
# prefix_only: the cost model alone, session ids ignored; round_robin / least_loaded: each pool alone.
POLICIES = ("prefix", "session+prefix", "prefix_only", "round_robin", "least_loaded")


class NoWorkersAvailable(RuntimeError):
    """No healthy, non-excluded worker in the prefill or the decode pool (map to UNAVAILABLE)."""


@dataclass(frozen=True)
class WorkerInfo:
    """One worker process. ``incarnation`` changes on every restart; ``layout_hash`` is its KV layout."""

    worker_id: str
    role: str
    address: str
    incarnation: str = ""
    layout_hash: str = ""
    # From its GetStats (0 = not reported): the cost model's KV size per token, the batch capacity
    # the conditional decision weighs a decode worker's running requests by.
    kv_bytes_per_block: int = 0
    block_size: int = 0
    max_num_seqs: int = 0

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must be non-empty")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load report. ``incarnation`` (when set) fences stale reports from a dead process."""

    queue_depth: int = 0
    num_running: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    incarnation: str = ""
    reported_at: float = 0.0  # time.time() of the report; 0 = "now" when applied

    def __post_init__(self) -> None:
        if min(self.queue_depth, self.num_running, self.free_blocks, self.total_blocks) < 0:
            raise ValueError("load counters must be >= 0")
        if self.total_blocks and self.free_blocks > self.total_blocks:
            raise ValueError(f"free_blocks {self.free_blocks} > total_blocks {self.total_blocks}")


@dataclass(frozen=True)
class PlacementRequest:
    """What placement needs to know about a prompt. ``block_hashes`` come from
    ``engine.prefix_hash.block_hashes(prompt_token_ids, block_size)``."""

    request_id: str
    session_id: str | None
    block_hashes: Sequence[int]
    prompt_len: int
    reusable_prefix_len: int | None = None

    def __post_init__(self) -> None:
        if self.prompt_len < 0:
            raise ValueError("prompt_len must be >= 0")
        if self.reusable_prefix_len is not None and self.reusable_prefix_len < 0:
            raise ValueError("reusable_prefix_len must be >= 0")


@dataclass(frozen=True)
class Placement:
    """Where a request runs and why. ``prefill`` is None when the router has no prefill pool (it fronts
    colocated workers: the decode worker prefills). ``moved_from`` is ``(old_prefill_id,
    old_decode_id)`` on a session move, ``move_kind`` its bounded label (metrics), ``move_reason`` the
    sentence the path report carries."""

    prefill: WorkerInfo | None
    decode: WorkerInfo
    policy: str
    reason: str
    session_hit: bool = False
    session_moved: bool = False
    moved_from: tuple[str, str] | None = None
    predicted_prefill_cached_blocks: int = 0
    predicted_decode_cached_blocks: int = 0
    score: float = 0.0
    move_reason: str = ""  # e.g. "d1 unhealthy", "p0 restarted", "d2 overloaded (load 7 > bound 6)"
    move_kind: str = ""  # gone | restarted | unhealthy | excluded | overloaded
    decode_load: int = 0  # the decode worker's requests in flight as it was chosen, this one included
    decode_load_cap: int = 0  # the bounded-load cap the choice kept to (0: none applied)

    @property
    def prefill_id(self) -> str:
        return self.prefill.worker_id if self.prefill is not None else ""

    @property
    def moved_from_str(self) -> str:
        """``"prefill_id/decode_id"`` of the previous binding, or ``""`` (handy for gRPC metadata)."""
        return "/".join(self.moved_from) if self.moved_from else ""


@dataclass(frozen=True)
class Outcome:
    """What actually happened, fed back through ``Placer.on_result``.

    ``decode_block_hashes``: hashes the decode worker holds for this sequence after the turn
    (typically ``block_hashes(prompt + generated[:-1])``); ``None`` = unknown, then the router assumes
    the prompt's reusable blocks. ``prefill_block_hashes`` likewise for the prefill worker.
    """

    success: bool
    decode_block_hashes: Sequence[int] | None = None
    decode_cached_blocks: int = 0
    prefill_block_hashes: Sequence[int] | None = None
    prefill_cached_blocks: int = 0
    blocks_sent: int = 0
    bytes_sent: int = 0
    transfer_s: float = 0.0
    transport: str = ""
    fallback: str = ""
    error: str = ""
    failed_worker_id: str = ""  # which side failed, when known; it is marked unhealthy
    extra: dict = field(default_factory=dict, hash=False, compare=False)
