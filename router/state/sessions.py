"""SessionTable: the local copy of session -> (prefill, decode) bindings, with TTL and a size bound.

A binding names both workers *and their incarnations*: a worker that restarts comes back with an
empty KV cache, so a binding to its old incarnation is treated as gone (the session moves).
Every turn refreshes the TTL. With a shared store (Redis) this table is a cache in front of it;
the store is the truth for cross-replica agreement, this table keeps serving when it is down.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass


@dataclass(frozen=True, kw_only=True)
class SessionBinding:
    prefill_id: str
    prefill_incarnation: str
    decode_id: str
    decode_incarnation: str
    expires_at: float  # wall clock (time.time()) so replicas agree

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> SessionBinding:
        d = json.loads(raw)
        return cls(
            prefill_id=str(d["prefill_id"]),
            prefill_incarnation=str(d["prefill_incarnation"]),
            decode_id=str(d["decode_id"]),
            decode_incarnation=str(d["decode_incarnation"]),
            expires_at=float(d["expires_at"]),
        )


class SessionTable:
    def __init__(self, max_sessions: int, clock=time.time) -> None:
        self.max_sessions = max_sessions
        self._clock = clock
        self._table: OrderedDict[str, SessionBinding] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def get(self, session_id: str) -> SessionBinding | None:
        b = self._table.get(session_id)
        if b is None:
            return None
        if b.expires_at <= self._clock():
            del self._table[session_id]
            return None
        return b

    def put(self, session_id: str, binding: SessionBinding) -> None:
        self._table[session_id] = binding
        self._table.move_to_end(session_id)
        while len(self._table) > self.max_sessions:
            self._table.popitem(last=False)

    def delete(self, session_id: str) -> None:
        self._table.pop(session_id, None)

    def purge_expired(self) -> int:
        now = self._clock()
        dead = [k for k, b in self._table.items() if b.expires_at <= now]
        for k in dead:
            del self._table[k]
        return len(dead)
