"""Block-id validation and coalescing shared by both backends.

A (layer, block) is one contiguous run of ``block_bytes`` (engine/kv_layout.py); consecutive block ids
within one layer are one contiguous region, so a transfer is planned as runs where both the source and
the destination ids are consecutive. NIXL gets one descriptor per run (adjacent runs that also touch in
memory are merged further); TCP packs runs as segments into DATA frames.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .errors import InvalidTransfer


def validate_block_ids(ids: Iterable[int], num_blocks: int, what: str) -> tuple[int, ...]:
    """ids as a tuple of ints, each in [0, num_blocks) and distinct; InvalidTransfer otherwise."""
    out: list[int] = []
    for b in ids:
        if isinstance(b, bool) or not isinstance(b, int):
            try:
                if int(b) != b:
                    raise ValueError
                b = int(b)
            except (TypeError, ValueError):
                raise InvalidTransfer(f"{what} block id {b!r} is not an integer") from None
        out.append(b)
    bad = [b for b in out if not (0 <= b < num_blocks)]
    if bad:
        raise InvalidTransfer(f"{what} block ids out of range [0, {num_blocks}): {bad[:8]}")
    if len(set(out)) != len(out):
        seen: set[int] = set()
        dups = sorted({b for b in out if b in seen or seen.add(b)})
        raise InvalidTransfer(f"duplicate {what} block ids: {dups[:8]}")
    return tuple(out)


def validate_layers(layers: Iterable[int] | None, num_layers: int) -> tuple[int, ...]:
    if layers is None:
        return tuple(range(num_layers))
    out = tuple(int(x) for x in layers)
    bad = [x for x in out if not (0 <= x < num_layers)]
    if bad:
        raise InvalidTransfer(f"layers out of range [0, {num_layers}): {bad[:8]}")
    if len(set(out)) != len(out):
        raise InvalidTransfer(f"duplicate layers in {list(out)[:16]}")
    return out


def pair_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal (src_start, dst_start, count) runs where both id sequences advance by one."""
    if len(src) != len(dst):
        raise InvalidTransfer(f"{len(src)} source blocks but {len(dst)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def merge_regions(regions: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge (local_offset, remote_offset, length) regions that continue each other on both sides."""
    out: list[tuple[int, int, int]] = []
    for lo, ro, n in regions:
        if out:
            plo, pro, pn = out[-1]
            if plo + pn == lo and pro + pn == ro:
                out[-1] = (plo, pro, pn + n)
                continue
        out.append((lo, ro, n))
    return out


def plan_segments(layers: Sequence[int], runs: Sequence[tuple[int, int, int]], block_bytes: int,
                  max_frame_bytes: int) -> list[list[tuple[int, int, int, int]]]:
    """Group (layer, src_start, dst_start, count) segments into frames of at most max_frame_bytes.

    A run larger than one frame is split; a frame always carries at least one block.
    """
    per_frame = max(1, max_frame_bytes // block_bytes)
    frames: list[list[tuple[int, int, int, int]]] = []
    cur: list[tuple[int, int, int, int]] = []
    cur_blocks = 0
    for layer in layers:
        for s, d, n in runs:
            while n:
                take = min(n, per_frame - cur_blocks)
                cur.append((layer, s, d, take))
                cur_blocks += take
                s, d, n = s + take, d + take, n - take
                if cur_blocks == per_frame:
                    frames.append(cur)
                    cur, cur_blocks = [], 0
    if cur:
        frames.append(cur)
    return frames
