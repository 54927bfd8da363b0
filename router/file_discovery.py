"""File discovery: the router follows a JSON membership file ``{"prefill": [...], "decode": [...]}``.

The launcher (`pdserve up`) owns the file and rewrites it atomically (write + rename) when `pdserve
scale` changes a pool; the router re-reads it whenever its mtime changes. A missing or malformed file
keeps the last good membership (logged), so a half-written file can never empty the cluster.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os

log = logging.getLogger(__name__)


def read_workers_file(path: str) -> dict[str, list[str]]:
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError("workers file must hold a JSON object")
    out = {}
    for role in ("prefill", "decode"):
        addrs = data.get(role, [])
        if not isinstance(addrs, list) or not all(isinstance(a, str) and a for a in addrs):
            raise ValueError(f"workers file: {role!r} must be a list of HOST:PORT strings")
        out[role] = addrs
    return out


async def watch_workers_file(path: str, directory, interval: float) -> None:
    last_mtime = None
    while True:
        try:
            mtime = os.stat(path).st_mtime_ns
            if mtime != last_mtime:
                members = read_workers_file(path)
                for role, addrs in members.items():
                    await directory.set_addresses(role, addrs)
                last_mtime = mtime
                log.info("workers file %s: %d prefill, %d decode", path, len(members["prefill"]),
                         len(members["decode"]))
        except (OSError, ValueError) as exc:
            log.warning("workers file %s unusable, keeping the last membership: %s", path, exc)
        await asyncio.sleep(interval)


def write_workers_file(path: str, members: dict[str, list[str]]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(members, f)
    os.replace(tmp, path)
