"""Chained prefix hashes: the identity of a full KV block.

A block's hash covers its own token ids *and* the hash of the block before it, so two blocks
are "the same" exactly when the whole prefix up to and including them is the same. The router,
the prefill workers and the decode workers all compute these independently and agree without
talking, so the function must be stable across processes, machines and Python versions: it uses
BLAKE2b over little-endian int64 token ids, never Python's salted ``hash()``.

Only *full* blocks get a hash; a trailing partial block is never shared.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# The hash "before" the first block. Part of the protocol: changing it invalidates every cache.
ROOT_HASH = 0
_HASH_BYTES = 8


def hash_block(parent: int, token_ids: Sequence[int]) -> int:
    """Hash of one full block given its parent's hash; a non-negative int below 2**64."""
    h = hashlib.blake2b(digest_size=_HASH_BYTES)
    h.update(struct.pack("<Q", parent))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Hashes of every *full* block of ``token_ids``; ``len(result) == len(token_ids) // block_size``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        out.append(parent)
    return out
