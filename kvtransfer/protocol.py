"""Wire format of the side channel (and of the TCP data path).

Every frame is a fixed 20-byte header, a JSON metadata object and, for DATA frames only, raw bytes::

    magic "PDKV" | version u8 | type u8 | flags u16 | meta_len u32 | payload_len u64   (network order)
    meta:    meta_len bytes of UTF-8 JSON, always an object, at most 1 MiB
    payload: payload_len raw KV bytes (DATA only; every other type must carry 0)

JSON is only ever parsed into plain dicts/lists/ints/strs; nothing on the wire is unpickled or
evaluated. Lengths are validated against the receiver's own bookkeeping before a single payload byte
is placed into KV memory (see receiver.py).
"""

from __future__ import annotations

import json
import struct
from enum import IntEnum

from .errors import ProtocolError

PROTOCOL_VERSION = 1
MAGIC = b"PDKV"
HEADER = struct.Struct("!4sBBHIQ")
HEADER_SIZE = HEADER.size
MAX_META_BYTES = 1 << 20
# A DATA frame never carries more than this, whatever the sender's max_frame_bytes says.
MAX_PAYLOAD_BYTES = 1 << 30


class Msg(IntEnum):
    HELLO = 1  # s->r  {version, layout, layout_hash, want, agent, caps?, sender?}
    HELLO_OK = 2  # r->s  {version, layout_hash, num_blocks, backend, nixl?}
    PROBE = 3  # s->r  {nonce}: "I sent you a NIXL notification with this nonce"
    PROBE_OK = 4  # r->s  {nonce}
    BEGIN = 5  # s->r  {rid, dst, layers, backend, nbytes, agent?, stripe?}
    BEGIN_OK = 6  # r->s  {rid}
    DATA = 7  # s->r  {rid, segs: [[layer, dst_block, n], ...], crc?} + payload
    END = 8  # s->r  {rid, nbytes}
    DONE = 9  # r->s  {rid}
    ERROR = 10  # either {rid?, kind, message}
    ABORT = 11  # either {rid, reason}
    ABORT_ACK = 12  # either {rid}
    WROTE = 13  # s->r  {rid, n, layers, xid?}: the NIXL WRITEs of rid are complete (CAP_WROTE only)


# Capabilities, exchanged in HELLO ("caps", sender's) / HELLO_OK ("caps", receiver's). A frame type that
# is not in version 1's original set (an older peer's decode_header rejects it and closes the connection)
# is only sent to a peer that advertised it, so PROTOCOL_VERSION stays 1 and old peers keep working.
CAP_WROTE = "wrote"
# A TCP transfer may spread its DATA frames over every connection of its sender (BEGIN {stripe: true},
# answered with BEGIN_OK; END may then arrive before frames still on other connections). Only sent to a
# receiver that advertised it; the connections say whose they are in HELLO ("sender": the instance).
CAP_STRIPE = "stripe"
CAPS = (CAP_WROTE, CAP_STRIPE)


def meta_caps(meta: dict) -> frozenset[str]:
    caps = meta.get("caps")
    if not isinstance(caps, list):
        return frozenset()
    return frozenset(c for c in caps[:64] if isinstance(c, str) and len(c) <= 64)


def encode(msg: Msg, meta: dict, payload_len: int = 0, flags: int = 0) -> bytes:
    """Header + metadata of one frame (the payload, if any, is sent separately, zero-copy)."""
    body = json.dumps(meta, separators=(",", ":")).encode()
    if len(body) > MAX_META_BYTES:
        raise ProtocolError(f"frame metadata too large ({len(body)} bytes)")
    if payload_len and msg != Msg.DATA:
        raise ProtocolError(f"{msg.name} frames carry no payload")
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, int(msg), flags, len(body), payload_len) + body


def decode_header(buf: bytes | bytearray | memoryview) -> tuple[Msg, int, int, int]:
    """(type, flags, meta_len, payload_len) of a header, or ProtocolError."""
    magic, version, mtype, flags, meta_len, payload_len = HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {bytes(magic)!r} (not a kvtransfer peer?)")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"frame protocol version {version}, this side speaks {PROTOCOL_VERSION}")
    try:
        msg = Msg(mtype)
    except ValueError:
        raise ProtocolError(f"unknown frame type {mtype}") from None
    if meta_len > MAX_META_BYTES:
        raise ProtocolError(f"frame metadata length {meta_len} exceeds {MAX_META_BYTES}")
    if payload_len and msg != Msg.DATA:
        raise ProtocolError(f"{msg.name} frame with a {payload_len}-byte payload")
    if payload_len > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"frame payload length {payload_len} exceeds {MAX_PAYLOAD_BYTES}")
    return msg, flags, meta_len, payload_len


def decode_meta(buf: bytes | bytearray | memoryview) -> dict:
    try:
        meta = json.loads(bytes(buf))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"frame metadata is not JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise ProtocolError("frame metadata must be a JSON object")
    return meta


def meta_str(meta: dict, key: str, max_len: int = 512) -> str:
    value = meta.get(key)
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise ProtocolError(f"frame field {key!r} must be a non-empty string, got {value!r:.80}")
    return value


def meta_int(meta: dict, key: str, lo: int = 0, hi: int = 1 << 62) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not (lo <= value <= hi):
        raise ProtocolError(f"frame field {key!r} must be an int in [{lo}, {hi}], got {value!r:.80}")
    return value


def meta_int_list(meta: dict, key: str, max_len: int = 1 << 20) -> list[int]:
    value = meta.get(key)
    if not isinstance(value, list) or len(value) > max_len:
        raise ProtocolError(f"frame field {key!r} must be a list of ints")
    for v in value:
        if not isinstance(v, int) or isinstance(v, bool):
            raise ProtocolError(f"frame field {key!r} must be a list of ints, found {v!r:.40}")
    return value


def notif_message(kind: str, **fields) -> bytes:
    """A NIXL notification body: small JSON, parsed by the receiver's poller."""
    return json.dumps({"pdkv": PROTOCOL_VERSION, "t": kind, **fields}, separators=(",", ":")).encode()


def parse_notif(raw: bytes) -> dict | None:
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("pdkv") != PROTOCOL_VERSION:
        return None
    return meta
