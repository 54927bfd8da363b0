"""Who sends which KV heads where between two tensor-parallel workers (pure; no I/O, no torch).

A worker's *shape* is (KV heads K, TP size N, piece size g). Rank r holds KV heads
``kv_head_range(K, N, r)`` (split, or replicated when N > K). A receiving rank takes its heads in
pieces of ``g`` heads: g equals its own head count (whole blocks, the default) or divides it, when
the sending worker's ranks each hold fewer heads than it does. A piece is one transfer from one
source rank into one destination rank, keyed ``<request>/<dst rank>`` (whole blocks) or
``<request>/<dst rank>.<j>`` (the j-th piece of the rank's heads)::

    prefill TP 1 (heads 0-1) -> decode TP 2 (0 | 1)     source rank 0 gathers head 0 and head 1
                                                        into staging, sends each to its rank
    prefill TP 2 (0 | 1)     -> decode TP 1 (0-1, g=1)  each source rank sends its blocks whole into
                                                        piece j of the destination blocks; rank 0 of
                                                        the decode worker regroups them in place
    prefill TP 2 (0 | 1)     -> decode TP 4 (0|0|1|1)   each source rank sends to both replicas

The endpoint a worker publishes (Allocate / GetStats / PrefillRequest.target, opaque bytes) lists
every rank's kvtransfer endpoint; its ``layout_hash`` covers the model's layout, TP size, head ranges
and piece size. A plain kvtransfer endpoint (a TP-1 worker with a single ``KVLink``) reads as TP 1.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

from engine.kv_layout import KVLayout
from engine.tp_shard import kv_head_range

from ..errors import InvalidTransfer, LayoutMismatch

PROTOCOL = "pdkv-tp"
VERSION = 1
MAX_RANKS = 64


@dataclass(frozen=True, kw_only=True)
class WorkerShape:
    num_kv_heads: int
    tp: int = 1
    piece_heads: int = 0  # 0: a rank's own head count (whole blocks)

    def __post_init__(self) -> None:
        k, n = self.num_kv_heads, self.tp
        if not isinstance(k, int) or k < 1 or not isinstance(n, int) or not 1 <= n <= MAX_RANKS:
            raise InvalidTransfer(f"bad worker shape: {k!r} KV heads, TP {n!r}")
        if k % n and n % k:
            raise InvalidTransfer(f"TP {n} neither divides nor is a multiple of the {k} KV heads")
        if self.piece_heads == 0:
            object.__setattr__(self, "piece_heads", self.rank_heads)
        g = self.piece_heads
        if not isinstance(g, int) or g < 1 or self.rank_heads % g:
            raise InvalidTransfer(f"piece size {g!r} does not divide a rank's {self.rank_heads} KV heads")

    @classmethod
    def receiving(cls, *, num_kv_heads: int, tp: int, source_tp: int = 0) -> WorkerShape:
        """A receiver's shape: pieces small enough that a sender at ``source_tp`` (default: ``tp``; any
        smaller one works too) holds each piece on one rank."""
        shape = cls(num_kv_heads=num_kv_heads, tp=tp)
        a = source_tp or tp
        if a < 1:
            raise InvalidTransfer(f"source TP must be >= 1, got {a}")
        per_source = num_kv_heads // a if a <= num_kv_heads else 1
        return cls(num_kv_heads=num_kv_heads, tp=tp, piece_heads=math.gcd(shape.rank_heads, per_source))

    @property
    def rank_heads(self) -> int:
        return max(1, self.num_kv_heads // self.tp)

    def heads(self, rank: int) -> tuple[int, int]:
        return kv_head_range(self.num_kv_heads, self.tp, rank)

    @property
    def pieces_per_rank(self) -> int:
        return self.rank_heads // self.piece_heads

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """(j, first head, end head) of each piece rank ``rank`` receives."""
        h0, _ = self.heads(rank)
        g = self.piece_heads
        return [(j, h0 + j * g, h0 + (j + 1) * g) for j in range(self.pieces_per_rank)]

    def describe(self) -> str:
        ranges = " ".join(f"[{a},{b})" for a, b in (self.heads(r) for r in range(self.tp)))
        whole = self.piece_heads == self.rank_heads
        return f"TP {self.tp}, KV heads {ranges}" + ("" if whole else f" in pieces of {self.piece_heads}")

    def layout_hash(self, base: KVLayout) -> str:
        """The base layout's hash extended with TP size, head ranges and piece size."""
        canonical = json.dumps({"base": base.compat_hash(), "tp": self.tp, "piece": self.piece_heads,
                                "heads": [self.heads(r) for r in range(self.tp)]}, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def piece_key(request_id: str, dst_rank: int, j: int | None) -> str:
    return f"{request_id}/{dst_rank}" if j is None else f"{request_id}/{dst_rank}.{j}"


def rank_layout(base: KVLayout, heads: int) -> KVLayout:
    """The layout of one rank's transfer units: the model's layout with ``heads`` KV heads per block."""
    from dataclasses import replace

    return replace(base, num_kv_heads=heads)


@dataclass(frozen=True, kw_only=True)
class RankedEndpoint:
    shape: WorkerShape
    layout: KVLayout
    endpoints: tuple[dict, ...]  # per rank: the kvtransfer endpoint of its cache
    views: tuple[dict | None, ...]  # per rank: the endpoint taking pieces (None: whole blocks only)

    @property
    def layout_hash(self) -> str:
        return self.shape.layout_hash(self.layout)

    def describe(self) -> str:
        return f"{self.shape.describe()}, hash {self.layout_hash} ({self.layout.describe()})"


def build_endpoint(layout: KVLayout, shape: WorkerShape, endpoints: list[dict],
                   views: list[dict | None]) -> dict:
    if len(endpoints) != shape.tp or len(views) != shape.tp:
        raise ValueError(f"{len(endpoints)} rank endpoints for TP {shape.tp}")
    return {"protocol": PROTOCOL, "version": VERSION, "tp": shape.tp, "num_kv_heads": shape.num_kv_heads,
            "piece_heads": shape.piece_heads, "layout": layout.to_dict(),
            "layout_hash": shape.layout_hash(layout),
            "ranks": [{"heads": list(shape.heads(r)), "endpoint": endpoints[r], "view": views[r]}
                      for r in range(shape.tp)]}


def parse_endpoint(raw: dict) -> RankedEndpoint:
    """A ranked endpoint (or a plain kvtransfer one, read as TP 1), validated; InvalidTransfer if bad."""
    if not isinstance(raw, dict):
        raise InvalidTransfer("not a KV endpoint description")
    try:
        if raw.get("protocol") == "pdkv":  # a plain kvtransfer endpoint: one rank, whole blocks
            layout = KVLayout.from_dict(raw["layout"])
            return RankedEndpoint(shape=WorkerShape(num_kv_heads=layout.num_kv_heads), layout=layout,
                                  endpoints=(raw,), views=(None,))
        if raw.get("protocol") != PROTOCOL or raw.get("version") != VERSION:
            raise InvalidTransfer(f"not a KV endpoint description (protocol {raw.get('protocol')!r}, "
                                  f"version {raw.get('version')!r})")
        layout = KVLayout.from_dict(raw["layout"])
        shape = WorkerShape(num_kv_heads=raw["num_kv_heads"], tp=raw["tp"], piece_heads=raw["piece_heads"])
        ranks = raw["ranks"]
        if layout.num_kv_heads != shape.num_kv_heads or not isinstance(ranks, list) or len(ranks) != shape.tp:
            raise InvalidTransfer(f"KV endpoint lists {len(ranks) if isinstance(ranks, list) else '?'} "
                                  f"ranks for {shape.describe()}")
        eps, views = [], []
        for r, entry in enumerate(ranks):
            if list(entry["heads"]) != list(shape.heads(r)):
                raise InvalidTransfer(f"KV endpoint rank {r} holds heads {entry['heads']}, expected "
                                      f"{list(shape.heads(r))}")
            if not isinstance(entry["endpoint"], dict):
                raise InvalidTransfer(f"KV endpoint rank {r} has no transport endpoint")
            view = entry.get("view")
            if shape.pieces_per_rank > 1 and not isinstance(view, dict):
                raise InvalidTransfer(f"KV endpoint rank {r} takes pieces but lists no endpoint for them")
            eps.append(entry["endpoint"])
            views.append(view if shape.pieces_per_rank > 1 else None)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, InvalidTransfer):
            raise
        raise InvalidTransfer(f"malformed KV endpoint: {exc!r}") from None
    if raw.get("layout_hash") != shape.layout_hash(layout):
        raise InvalidTransfer("KV endpoint's layout_hash does not match its layout, TP and head ranges")
    return RankedEndpoint(shape=shape, layout=layout, endpoints=tuple(eps), views=tuple(views))


@dataclass(frozen=True, kw_only=True)
class Piece:
    """Source rank ``src`` sends its KV heads ``heads`` of the request's blocks to rank ``dst``."""

    src: int
    dst: int
    heads: tuple[int, int]
    j: int | None  # which piece of the destination rank's heads; None: whole blocks

    def key(self, request_id: str) -> str:
        return piece_key(request_id, self.dst, self.j)

    def dst_ids(self, block_ids: list[int], pieces_per_rank: int) -> list[int]:
        """Destination ids in the receiving transport: the blocks, or piece j of each block in the view."""
        if self.j is None:
            return list(block_ids)
        return [b * pieces_per_rank + self.j for b in block_ids]


def plan_pieces(source: WorkerShape, layout: KVLayout, dest: RankedEndpoint) -> list[Piece]:
    """Every piece of a transfer from a worker of shape ``source`` (KV layout ``layout``, the model's
    whole layout) into ``dest``; LayoutMismatch naming both workers when they cannot be bridged."""
    mine = f"{source.describe()}, hash {source.layout_hash(layout)} ({layout.describe()})"
    if layout.compat_hash() != dest.layout.compat_hash() or source.num_kv_heads != dest.shape.num_kv_heads:
        raise LayoutMismatch(f"KV layout mismatch: receiver {dest.describe()} vs sender {mine}")
    pieces = []
    whole = dest.shape.pieces_per_rank == 1
    for d in range(dest.shape.tp):
        for j, h0, h1 in dest.shape.pieces(d):
            holders = [s for s in range(source.tp) if source.heads(s)[0] <= h0 and h1 <= source.heads(s)[1]]
            if not holders:
                raise LayoutMismatch(
                    f"KV heads [{h0},{h1}) of receiver rank {d} lie on several sender ranks: receiver "
                    f"{dest.describe()} cannot take KV from sender {mine}; start the receiving worker with "
                    f"--kv-source-tp {source.tp}")
            # replicas share the load: destination rank d takes its heads from holder d mod replicas
            pieces.append(Piece(src=holders[d % len(holders)], dst=d, heads=(h0, h1), j=None if whole else j))
    return pieces
