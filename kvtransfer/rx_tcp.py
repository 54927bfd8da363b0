"""Receiving side, TCP half: DATA frames into the expected blocks, END, and completion after the
host->device copies of staged frames. A mixin of ``Receiver`` (receiver.py owns the table of expected
transfers and the lifecycle; rx_nixl.py the NIXL half): ``RxConnection`` (rx_conn.py) calls ``on_data``
once a DATA frame's metadata is parsed, before a byte of its payload is accepted, and
``on_data_complete`` once the payload is in."""

from __future__ import annotations

import time
from dataclasses import dataclass

from .errors import InvalidTransfer
from .expectation import Expectation
from .iovec import crc32_of
from .protocol import meta_int


@dataclass
class _DataCtx:
    exp: Expectation
    segments: list[tuple[int, int, int]]
    views: list[memoryview]
    staging: object | None  # host staging buffer (device memory), flushed once the payload is in
    crc: int | None
    # Lane staging (TransportConfig.tcp_lane_staging): the receive thread allocated the staging buffer
    # (stage_in), then checked the payload and issued its host->device copies (land).
    landed: bool = False
    event: object | None = None  # the CUDA event after those copies
    crc_bad: bool = False


class TcpReceiving:
    """The TCP frame handlers of ``Receiver`` (which provides expectations, memory, loop, _bound, _fail,
    _complete)."""

    def on_data(self, conn, meta: dict, payload_len: int,
                threaded: bool = False) -> tuple[_DataCtx, list[memoryview] | None]:
        """Check a DATA frame's metadata; returns its context and where its payload goes. ``threaded``: a
        receive thread reads the payload; with device memory and tcp_lane_staging that thread also
        allocates the staging buffer (the targets returned are None: ``stage_in``) and copies it to the
        device (``land``), so the event loop makes no CUDA call for the frame."""
        exp = self._bound(conn, meta, "tcp")
        try:
            segs = meta.get("segs")
            if not isinstance(segs, list) or not segs or len(segs) > (1 << 20):
                raise InvalidTransfer("DATA frame without segments")
            bb = self.memory.block_bytes
            blocks = _mark(exp, segs)
            planned = [(self.memory.offset(layer, start), count * bb, layer) for layer, start, count in segs]
            if payload_len != blocks * bb:
                raise InvalidTransfer(f"DATA frame of {exp.request_id!r} carries {payload_len} bytes for "
                                      f"{blocks} blocks of {bb} bytes ({blocks * bb})")
            crc = meta.get("crc")
            if crc is not None and not isinstance(crc, int):
                raise InvalidTransfer("crc must be an int")
        except InvalidTransfer as exc:
            self._fail(exp, exc, notify=False)
            raise
        if threaded and self.memory.staged and self.config.tcp_lane_staging:
            views = staging = None
        else:
            views, staging = self.memory.recv_views(planned)
        exp.reading.add(conn)
        return _DataCtx(exp, planned, views, staging, crc), views

    # -- on the receive thread (lane staging) ------------------------------------------------------
    def stage_in(self, ctx: _DataCtx) -> list[memoryview]:
        """The staging buffer a deferred frame's payload is read into."""
        ctx.views, ctx.staging = self.memory.recv_views(ctx.segments)
        return ctx.views

    def land(self, ctx: _DataCtx) -> None:
        """The payload is in: check it and issue its host->device copies. Skipped once the request failed
        (read racily: a flush that still happens is waited for before the failure is told)."""
        if ctx.crc is not None:
            ctx.crc_bad = crc32_of(ctx.views) != ctx.crc
        if not ctx.crc_bad and ctx.staging is not None and ctx.exp.state != "failed":
            ctx.event = self.memory.flush(ctx.segments, ctx.staging)
        ctx.landed = True

    # -- on the event loop -------------------------------------------------------------------------
    def on_data_dropped(self, conn, ctx: _DataCtx) -> None:
        """A DATA frame's payload stopped arriving (its connection broke or was closed): nothing more of it
        lands; the connection's loss fails the request."""
        if ctx.event is not None:
            ctx.exp.flushing.append(ctx.event)
        ctx.exp.reading.discard(conn)
        self._settle_if_quiet(ctx.exp)

    def on_data_complete(self, conn, ctx: _DataCtx) -> None:
        exp = ctx.exp
        exp.reading.discard(conn)
        if ctx.event is not None:
            exp.flushing.append(ctx.event)
        if exp.state == "failed":  # failed while the payload arrived: it must not reach the blocks
            self._settle_if_quiet(exp)
            return
        if ctx.crc_bad or (ctx.crc is not None and not ctx.landed and crc32_of(ctx.views) != ctx.crc):
            err = InvalidTransfer(f"checksum mismatch in a DATA frame of {exp.request_id!r}")
            self._fail(exp, err, notify=True)
            return
        if ctx.staging is not None and not ctx.landed:
            event = self.memory.flush(ctx.segments, ctx.staging)
            if event is not None:
                exp.flushing.append(event)
        if len(exp.flushing) > 8:  # keep only copies that may still run
            exp.flushing = [e for e in exp.flushing if not e.query()]
        exp.received += sum(n for _, n, _ in ctx.segments)
        if exp.end_seen and exp.received == exp.nbytes and self.expectations.get(exp.request_id) is exp:
            self._end(exp)  # a striped transfer's last frame after its END

    def _on_end(self, conn, meta: dict) -> None:
        exp = self._bound(conn, meta, "tcp")
        if exp.striped and exp.received < exp.nbytes and not exp.end_seen:
            # Frames still on the sender's other connections (or being read): they complete it.
            if meta_int(meta, "nbytes") != exp.nbytes:
                raise InvalidTransfer(f"END of {exp.request_id!r} announces {meta.get('nbytes')} bytes, "
                                      f"expected {exp.nbytes}")
            exp.end_seen = True
            return
        self._end(exp)

    def _end(self, exp: Expectation) -> None:
        missing = exp.written.count(0)
        if missing or exp.received != exp.nbytes:
            raise InvalidTransfer(f"END of {exp.request_id!r} before all KV arrived: {missing} "
                                  f"(layer, block) pairs missing, {exp.received}/{exp.nbytes} bytes")
        exp.timeline["end"] = time.monotonic()
        # kept: a failure meanwhile is told only once they have landed (_settle_if_quiet)
        exp.flushing = [e for e in exp.flushing if not e.query()]
        if not exp.flushing:
            self._complete(exp)
            return
        # Staged device memory: complete once this request's host->device copies have landed, waited for
        # off the loop.
        exp.state = "flushing"
        self.loop.create_task(self._complete_after(exp, list(exp.flushing)))

    async def _complete_after(self, exp: Expectation, events: list) -> None:
        await self.memory.all_ready(events)
        if self.expectations.get(exp.request_id) is exp:  # not failed or released meanwhile
            self._complete(exp)


def _mark(exp: Expectation, segs: list) -> int:
    """Mark in ``exp.written`` the (layer, block)s a DATA frame's segments fill and return how many,
    each checked first: well-formed, inside the layers, reserved for the request, not written by an
    earlier frame or an earlier segment of this one (else InvalidTransfer; the caller then fails the
    whole transfer, so marks already set do not matter). A segment whose blocks are consecutive in the
    reservation too (the block manager hands out runs) is checked and marked as one slice."""
    n_dst, written, index, total = len(exp.dst), exp.written, exp.index, 0
    for seg in segs:
        if (not isinstance(seg, list) or len(seg) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in seg)):
            raise InvalidTransfer(f"malformed segment {seg!r:.80}")
        layer, start, count = seg
        if not (0 <= layer < exp.num_layers) or count < 1:
            raise InvalidTransfer(f"segment {seg} outside {exp.num_layers} layers")
        first = index.get(start) if count > 1 else None
        # (a count past the reservation's end takes the block-by-block path, which refuses it at the
        # first block not reserved, before anything of that size is built)
        if (first is not None and count <= n_dst - first
                and exp.dst[first:first + count] == tuple(range(start, start + count))):
            mark = layer * n_dst + first
            at = written.find(1, mark, mark + count)
            if at >= 0:
                raise InvalidTransfer(f"(layer {layer}, block {start + at - mark}) of {exp.request_id!r} "
                                      f"sent twice")
            written[mark:mark + count] = b"\x01" * count
        else:
            for b in range(start, start + count):
                i = index.get(b)
                if i is None:
                    raise InvalidTransfer(f"block {b} is not reserved for request {exp.request_id!r}")
                mark = layer * n_dst + i
                if written[mark]:
                    raise InvalidTransfer(f"(layer {layer}, block {b}) of {exp.request_id!r} sent twice")
                written[mark] = 1
        total += count
    return total
