"""The lease table: decode-side reservations waiting for their KV.

Lifecycle of one entry::

    Allocate ──add──▶ leased (blocks reserved in the engine, receiver expecting KV)
                         │ Decode starts ──take──▶ gone from the table (the Decode stream owns it)
                         │ Release/Abort ──pop──▶ gone (caller frees engine blocks + receiver)
                         └ deadline passes ──expired()──▶ gone (the reaper frees them)

The table itself only tracks ids and deadlines; freeing engine blocks and receiver registrations
is the worker's job, so this file stays free of I/O and is trivially testable.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True)
class Lease:
    request_id: str
    block_ids: list[int]
    num_cached_tokens: int
    num_prompt_tokens: int
    expects_kv: bool
    deadline: float
    created: float = field(default_factory=time.monotonic)
    # Kept so a lease can become a full local request (conditional disaggregation / colocated).
    prompt_ids: list[int] = field(default_factory=list)
    params: Any = None


class LeaseTable:
    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leases

    def add(self, lease: Lease) -> None:
        if lease.request_id in self._leases:
            raise ValueError(f"request {lease.request_id!r} already holds a reservation")
        self._leases[lease.request_id] = lease

    def take(self, request_id: str) -> Lease | None:
        """Remove and return the lease (Decode started, or Release); None if unknown/expired."""
        return self._leases.pop(request_id, None)

    def expired(self, now: float | None = None) -> list[Lease]:
        """Remove and return every lease past its deadline."""
        now = time.monotonic() if now is None else now
        gone = [lease for lease in self._leases.values() if lease.deadline <= now]
        for lease in gone:
            del self._leases[lease.request_id]
        return gone

    def ids(self) -> list[str]:
        return list(self._leases)
