"""Scatter-gather bookkeeping shared by every socket path (sendmsg / readv over lists of views)."""

from __future__ import annotations

IOV_MAX = 512  # buffers per sendmsg / readv call (Linux allows 1024)


def advance(views: list[memoryview], i: int, n: int) -> int:
    """After a sendmsg or readv over views[i:] moved n bytes: the index of the first view not done (a
    partly done one is cut to its rest in place)."""
    while n:
        head = views[i]
        if n >= len(head):
            n -= len(head)
            i += 1
        else:
            views[i] = head[n:]
            n = 0
    return i
