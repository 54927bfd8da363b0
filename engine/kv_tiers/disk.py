"""The local-disk KV tier: one file per block under a directory of the KV identity, LRU by bytes.

Files live at ``<root>/<identity>/<hash:016x>.kv``, where ``identity`` is the KV layout's compatibility
hash (model fingerprint, dtype, block size, layers, KV heads, head dim): a worker started on another
model, dtype or tensor-parallel shape looks in another directory and never sees these blocks. Each file
is a header and the block's bytes::

    magic "PDSKV001" | identity (16 ASCII) | block hash (u64) | payload bytes (u64) | crc32 (u32) | payload

``read`` checks all of it: a missing, truncated, foreign or corrupted file is a miss (the file is
removed and the block recomputed), never half a block. Writes go to a temporary name and are renamed
into place by one writer thread, so a reader sees a whole file or none; the engine thread only queues
them (a full queue drops the block: the disk tier is a cache, and an offload never waits for a disk).
A queued block is already held: a read takes its bytes from the queue until the file is written.

Restart: the index is rebuilt from the identity's directory, oldest modification first, so a worker
restarted with the same ``--kv-disk-dir`` and model serves its old blocks. The directory is bounded
by ``capacity_bytes``: adding past it removes the least recently used files.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
import zlib
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = b"PDSKV001"
_HEADER = struct.Struct("<8s16sQQI")
HEADER_BYTES = _HEADER.size
_WRITE_QUEUE_BYTES = 256 << 20  # bytes waiting for the writer (at least 16 blocks) before new ones drop


class DiskTier:
    """Blocks of one KV identity as files under ``root``, at most ``capacity_bytes`` of them."""

    def __init__(self, root: str | os.PathLike, identity: str, block_bytes: int, capacity_bytes: int) -> None:
        if len(identity) != 16 or not identity.isalnum():
            raise ValueError(f"identity must be the layout's 16-character compatibility hash, got "
                             f"{identity!r}")
        if capacity_bytes < block_bytes + HEADER_BYTES:
            raise ValueError(f"--kv-disk-gb holds not even one block ({capacity_bytes} bytes < "
                             f"{block_bytes + HEADER_BYTES})")
        self.identity = identity
        self.block_bytes = block_bytes
        self.file_bytes = block_bytes + HEADER_BYTES
        self.capacity_blocks = capacity_bytes // self.file_bytes
        self.dir = Path(root) / identity
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.lock = threading.Lock()
        self._index: OrderedDict[int, None] = OrderedDict()  # block hash, least recently used first
        self.dropped = 0  # offloads dropped because the writer was behind
        self.corrupt = 0  # files that failed their checks
        self.evictions = 0
        self.events = None  # engine.kv_events.KVEvents ("disk" tier); set before the first write
        self._rebuild()
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(
            maxsize=max(16, _WRITE_QUEUE_BYTES // block_bytes))
        self._queued: dict[int, bytes] = {}  # block hash -> payload, queued and not yet written
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    # ---- queries ----------------------------------------------------------------------------------
    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._index or block_hash in self._queued

    def __len__(self) -> int:
        return len(self._index)

    @property
    def nbytes(self) -> int:
        return len(self._index) * self.file_bytes

    def path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:016x}.kv"

    # ---- writes -----------------------------------------------------------------------------------
    def put(self, block_hash: int, payload: bytes) -> bool:
        """Queue ``payload`` (one block, ``block_bytes`` long) for writing; False when dropped."""
        if len(payload) != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes, got {len(payload)}")
        with self.lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                return True
            if block_hash in self._queued:
                return True
            try:
                self._queue.put_nowait((block_hash, payload))
            except queue.Full:
                self.dropped += 1
                return False
            self._queued[block_hash] = payload
        return True

    def flush(self) -> None:
        """Wait until every queued block is on disk (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(timeout=30)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except OSError:
                log.warning("KV disk tier: writing a block failed; it is not cached", exc_info=True)
            finally:
                if item is not None:
                    with self.lock:
                        self._queued.pop(item[0], None)
                self._queue.task_done()

    def _write(self, block_hash: int, payload: bytes) -> None:
        header = _HEADER.pack(MAGIC, self.identity.encode(), block_hash, len(payload), zlib.crc32(payload))
        final = self.path(block_hash)
        tmp = final.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, final)
        with self.lock:
            self._index[block_hash] = None
            self._index.move_to_end(block_hash)
            victims = []
            while len(self._index) > self.capacity_blocks:
                victim, _ = self._index.popitem(last=False)
                self.evictions += 1
                self.path(victim).unlink(missing_ok=True)
                victims.append(victim)
            if self.events is not None:
                self.events.stored("disk", [block_hash])
                self.events.removed("disk", victims)

    # ---- reads ------------------------------------------------------------------------------------
    def read(self, block_hash: int) -> bytes | None:
        """The block's bytes, or None (missing, truncated, foreign or corrupted: the file is removed)."""
        with self.lock:
            queued = self._queued.get(block_hash)
        if queued is not None:
            return queued
        try:
            with open(self.path(block_hash), "rb") as f:
                data = f.read(self.file_bytes + 1)
        except OSError:
            self.forget(block_hash)
            return None
        problem = self._check(block_hash, data)
        if problem is not None:
            log.warning("KV disk tier: %s (%s); the block is recomputed", problem, self.path(block_hash))
            self.corrupt += 1
            self.forget(block_hash, unlink=True)
            return None
        with self.lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        return data[HEADER_BYTES:]

    def _check(self, block_hash: int, data: bytes) -> str | None:
        if len(data) != self.file_bytes:
            return f"{len(data)} bytes, a block file is {self.file_bytes}"
        magic, identity, stored_hash, size, crc = _HEADER.unpack_from(data)
        if magic != MAGIC:
            return "not a pdserve KV block file"
        if identity.decode(errors="replace") != self.identity or stored_hash != block_hash:
            return "the file belongs to another model, layout or block"
        if size != self.block_bytes or zlib.crc32(memoryview(data)[HEADER_BYTES:]) != crc:
            return "checksum mismatch"
        return None

    def forget(self, block_hash: int, *, unlink: bool = False) -> None:
        with self.lock:
            held = self._index.pop(block_hash, 0) is None
            if held and self.events is not None:
                self.events.removed("disk", [block_hash])
        if unlink:
            self.path(block_hash).unlink(missing_ok=True)

    def hashes(self) -> list[int]:
        """Every hash held, least recently used first (a snapshot for the router)."""
        with self.lock:
            return list(self._index)

    def _rebuild(self) -> None:
        """Index the files a previous process left (names only; contents are checked when read)."""
        found = []
        for entry in os.scandir(self.dir):
            name = entry.name
            if name.endswith(".tmp"):
                Path(entry.path).unlink(missing_ok=True)  # a write cut short by a crash
                continue
            if not name.endswith(".kv") or len(name) != 19:
                continue
            try:
                found.append((entry.stat().st_mtime_ns, int(name[:16], 16)))
            except (ValueError, OSError):
                continue
        for _, block_hash in sorted(found):
            self._index[block_hash] = None
        while len(self._index) > self.capacity_blocks:
            victim, _ = self._index.popitem(last=False)
            self.path(victim).unlink(missing_ok=True)
        if found:
            log.info("KV disk tier: %d blocks of %s found in %s", len(self._index), self.identity, self.dir)
