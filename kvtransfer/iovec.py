"""Scatter-gather bookkeeping shared by every socket path (sendmsg / readv over lists of views), and the
blocking mode the I/O threads move whole frames in."""

from __future__ import annotations

import socket
import struct
import zlib

IOV_MAX = 512  # buffers per sendmsg / readv call (Linux allows 1024)
IO_TIMEOUT_S = 0.1  # the longest a blocking socket call of an I/O thread runs before it checks ``stop``


def whole_frame_io(sock: socket.socket) -> None:
    """Make ``sock`` blocking, each send and receive bounded by IO_TIMEOUT_S (SO_SNDTIMEO / SO_RCVTIMEO:
    a partial count comes back, or EAGAIN when nothing moved), so an I/O thread moves a whole frame per
    call with the GIL released throughout. Every call made on the event loop then passes
    ``socket.MSG_DONTWAIT``. Why: a thread that returns from the kernel after each socket-buffer fill
    waits for the GIL each time (up to the switch interval while another thread runs Python), with the
    buffer full and the other end stalled (TransportConfig.gil_switch_interval_s)."""
    timeval = struct.pack("ll", 0, int(IO_TIMEOUT_S * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setblocking(True)


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


def crc32_of(views) -> int:
    """CRC32 of the views' bytes in order (a DATA frame's ``crc``, TransportConfig.checksum)."""
    crc = 0
    for view in views:
        crc = zlib.crc32(view, crc)
    return crc
