"""Transport configuration: one frozen dataclass, validated up front, passed down explicitly."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

KINDS = ("auto", "nixl", "tcp")


def default_tls_procs() -> int:
    """TLS relay helpers by default: a quarter of the cores, 1..8 (8: one per connection to a peer)."""
    return max(1, min(8, (os.cpu_count() or 4) // 4))


@dataclass(frozen=True, kw_only=True)
class TransportConfig:
    # Which backend(s) this side offers and uses. "auto": NIXL when it imports, its agent starts and the
    # per-peer handshake (metadata exchange + a notification round trip) succeeds, else TCP.
    kind: str = "auto"
    # Side channel (and TCP data) listener. port 0 = pick a free one; endpoint() reports the real port.
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    # Host written into endpoint(); defaults to listen_host (must be set when listening on 0.0.0.0).
    advertise_host: str | None = None
    connect_timeout_s: float = 5.0
    # Covers HELLO + (for NIXL) loading the peer's metadata and the notification probe.
    handshake_timeout_s: float = 10.0
    # Default per-transfer deadline on the sending side (start_send(timeout=...) overrides it).
    send_timeout_s: float = 60.0
    # How long a receiver-side abort waits for the sender to confirm it stopped writing.
    abort_ack_timeout_s: float = 2.0
    # TCP: payload bytes per DATA frame (frames of different requests interleave at this granularity).
    max_frame_bytes: int = 16 << 20
    # TCP: a transfer that starts while others to the same receiver are in flight sends frames this many
    # times max_frame_bytes (1: the same for all). Each frame costs the event loop a fixed number of
    # hand-offs, each waiting for the GIL beside the I/O threads; when transfers queue behind each other
    # that per-frame cost is what bounds them, and larger frames pay it less often. A transfer alone keeps
    # max_frame_bytes: its frames pipeline (one staged while another is on the socket) over its lanes.
    # One H200, both sides in one process, 2k-token transfers of the 8B layout (docs/kvtransfer.md
    # "Larger frames behind other transfers"): 32 MiB frames for every transfer moved 1.07-1.40x the
    # bytes of 16 MiB ones at 4 and 16 in flight but a lone transfer 0.60-0.71x; this factor 1.07x at 4
    # and 16 (8 rounds), a lone transfer unchanged. Between two GPUs (prefill and decode processes each
    # on its own H200) the same 2x frames collapsed the bytes moved at 4 and 16 in flight to 2.0-2.4
    # GB/s against 10.9-14.5 with 1 (kvtransfer-concurrency-2xh200-2026-11-29-*.json), so it is 1 by
    # default and 2 stays an option for the case it was measured on.
    tcp_busy_frame_factor: int = 1
    # TCP: SO_SNDBUF/SO_RCVBUF; 0 keeps kernel autotuning (usually best on Linux).
    socket_buffer_bytes: int = 0
    # TCP: a write of at most this many bytes is tried at once on the event-loop thread (small frames:
    # no thread hop); a larger one goes whole to an I/O thread. Copying into the socket (on loopback: the
    # whole TCP path up to the receiver's queue) is then never done on the one loop thread that every
    # connection shares.
    inline_write_max_bytes: int = 256 << 10
    # Device memory over TCP: wait for a frame's staging copies with a blocking-sync CUDA event (the
    # waiting thread sleeps) instead of the default spin-wait, which keeps one core busy per transfer
    # waiting on the copy stream.
    staging_blocking_sync: bool = True
    # Device memory over TCP: a frame of several block runs is staged with one gather on the device and
    # one copy (receiving: one copy and one scatter), a constant number of CUDA calls per frame (memory.py).
    # False: one copy per run (each a GIL hand-off on the event loop; kept for comparison).
    staging_gather: bool = True
    # TCP: CRC32 of every DATA frame's payload, verified by the receiver (costs a pass over the bytes).
    checksum: bool = False
    # TCP: connections a sender opens to one receiver. Each transfer rides one of them (the least loaded
    # when it starts) from BEGIN to END, so transfers in flight spread over this many sockets and kernel
    # copies (one TCP stream is bounded by one core's copy rate); on one connection they interleave frame
    # by frame. A NIXL peer uses one (the side channel carries no bulk data). 8: one connection moves
    # ~2 GB/s of staged GPU memory, below a raw socket's ~3 (the gaps between frames), so 16 transfers in
    # flight reached 0.60-0.69 of a raw socket over 4 connections and 0.91-0.98 over 8 (2x H200,
    # docs/kvtransfer.md).
    tcp_connections: int = 8
    # TCP: a transfer of more than one frame spreads its frames over all of those connections (to a
    # receiver that advertises it, protocol.CAP_STRIPE), so one transfer is not bounded by one
    # connection's rate. False: each transfer rides one connection (for comparison).
    tcp_stripe: bool = True
    # TCP receiving: a receive thread that has read a DATA payload also takes the next frame's header and
    # metadata off the socket when they are already there (never waiting for them), so the event loop's
    # one turn for the finished frame dispatches the next payload too. Without it each frame costs the
    # loop three turns before its payload is on a thread; in a serving decode worker, whose loop also
    # runs every token stream, the connection sat idle ~12 ms per 16 MiB frame at 10 req/s.
    tcp_rx_chain: bool = True
    # TCP from device memory: DATA frames of one transfer whose device->host staging copies are queued
    # ahead of the frame being handed to a lane. 1 staged frame i+1 only once frame i had a lane, so the
    # copy stream idled between frames and a lone striped transfer waited ~0.9 ms per 16 MiB frame before
    # its last lanes started (kvtrace tx-frames). 2 keeps the copy stream busy (a 16 MiB copy takes
    # longer than handing a frame to a lane); each one more costs a frame of page-locked memory per
    # transfer in flight, beside the frames already in lanes.
    tcp_stage_ahead: int = 2
    # TCP from or into device memory: each connection's own I/O threads stage its frames. Sending, the
    # lane's writer thread issues a frame's device->host copies (and those of up to tcp_stage_ahead - 1
    # frames queued behind it), waits for them and writes the frame; a transfer queues all its frames at
    # once. Receiving, the thread that reads a payload allocates its staging buffer and issues the
    # host->device copies. The event loop then makes no CUDA call and no hand-off per frame: with them on
    # the loop, 16 transfers in flight kept each connection's threads busy only 27-48% of the time, each
    # waiting for the loop's turn. Measured slower on one H200 (off by default): every torch call of a
    # frame then waits for the GIL among 16 busy I/O threads, 47-93 ms of staging per 16 MiB frame at 4
    # and 16 in flight against 4-24 on the loop (bench/lane_staging_probe.py, docs/kvtransfer.md
    # "Staging on the lanes' threads"); two GPUs not measured yet.
    tcp_lane_staging: bool = False
    # The process's GIL switch interval (sys.setswitchinterval), lowered to this when the transport
    # starts (never raised; 0 leaves it). A TCP I/O thread takes the GIL back after every socket call;
    # while the engine's thread runs Python (a decode step's host work, an eager prefill's launches) it
    # waits up to the interval for it, Python's default 5 ms, and meanwhile the socket buffer fills and
    # the sender stalls. A receiving thread beside a busy Python thread moved 0.66-0.67 GB/s at 5 ms and
    # 2.06-2.23 GB/s at 0.5 ms (bench/gil_probe.py); in a serving decode worker (1P1D over
    # TCP, 10 req/s) a receive thread took a median 6.8 ms per 16 MiB frame, 4.3 ms with this and
    # whole-frame socket calls (docs/kvtransfer.md, "The GIL in a serving worker").
    gil_switch_interval_s: float = 0.0005
    # A TCP transfer past its deadline (receiver: the expect() deadline; sender: start_send's timeout) is
    # failed only when its connection has moved no byte for this long: one queued behind others' frames
    # is making progress, and the deadline is for a sender that never came or stalled.
    stall_timeout_s: float = 10.0
    # Mutual TLS on every KV connection (side channel and TCP data): PEM paths of the cluster CA, this
    # process's certificate and its key. All three or none. A peer whose certificate is not signed by the
    # CA is refused during the handshake, on both sides.
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    # With TLS, the record work of every TCP connection runs in this many helper processes
    # (tls_relay.py), connections given out round robin: CPython's ssl holds one process's TLS at
    # ~1.3-1.5 GB/s however many threads decrypt (one GIL round trip per 16 KiB record), and each helper
    # has a GIL of its own. 0: in this process, on the connections' I/O threads (tls.TlsChannel).
    tls_procs: int = field(default_factory=default_tls_procs)
    # Log each finished transfer's timeline (trace.py); pdserve/settings.py reads PDSERVE_KV_TRACE.
    trace: bool = False
    # NIXL: UCX variables set in this process before the agent is created (UCX reads them then), as
    # (name, value) pairs; pdserve/settings.py derives them (UCX_PROTO_INFO so the log names UCX's
    # protocol choices, UCX_NET_DEVICES so UCX's TCP listeners bind the KV host's interface only).
    ucx_env: tuple[tuple[str, str], ...] = ()
    # NIXL backends to instantiate in the agent and how often pending transfers/notifications are polled.
    nixl_backends: tuple[str, ...] = ("UCX",)
    nixl_poll_interval_s: float = 0.0005
    # After a WRITE is posted (sender) or a NIXL transfer/handshake announced (receiver), poll without
    # sleeping for this long before falling back to nixl_poll_interval_s. Off by default: on a shared
    # 2-core box spinning made NIXL latency worse, not better (measured side by side, docs/kvtransfer.md);
    # try it (e.g. 0.002) where each worker has cores of its own.
    nixl_spin_s: float = 0.0
    # Between two polls of a pending NIXL transfer, block the event-loop thread in time.sleep for
    # nixl_poll_interval_s (then yield once) instead of awaiting asyncio.sleep: asyncio's epoll timer
    # rounds every wait up to a whole millisecond (CPython selectors.EpollSelector), so a 0.5 ms or 50 us
    # interval really polls every ~1.16 ms (measured), and each NIXL hop (WRITE done -> notification sent
    # -> notification seen) waits for one such poll. A nap costs no CPU (the thread sleeps) but delays
    # the loop's other tasks by up to the interval. Only used for intervals below 1 ms.
    nixl_poll_nap: bool = False
    # Sender, once its last WRITE is posted: poll its state every nixl_fast_wait_nap_s (a time.sleep in the
    # event-loop thread, so the GIL is released at every iteration and the engine thread can run, then
    # one bare yield to the loop's other tasks) instead of every ~1 ms (the asyncio timer floor), for at
    # most min(nixl_fast_wait_s, 2 ms + bytes / nixl_fast_wait_gbps) -- about the transfer's expected
    # duration on a slow link -- then the normal poll. Only while a WRITE is in flight, only for the
    # memory kinds in nixl_fast_wait_mem (VRAM: a GPU copy completes inside UCX progress calls, so the
    # poll floor was most of a small transfer's time; DRAM, CPU-only workers, is left out by default
    # though it helped small sends on the 2-core box too: docs/kvtransfer.md). 0 turns it off.
    nixl_fast_wait_s: float = 0.02
    nixl_fast_wait_gbps: float = 20.0
    nixl_fast_wait_nap_s: float = 2e-5
    nixl_fast_wait_mem: tuple[str, ...] = ("VRAM",)
    # Sender: once its WRITEs are DONE (NIXL's UCX backend flushes the endpoint before reporting DONE, so
    # the bytes are in the receiver's memory), tell the receiver with a WROTE frame on the side channel;
    # it wakes the receiver's loop through epoll at once, where the NIXL notification waits for its next
    # notification poll. The receiver completes on whichever arrives first. Only sent to receivers that
    # advertise it (protocol.CAP_WROTE); older ones get the notification alone, as before.
    nixl_tx_done_frame: bool = True
    # Descriptor lists prepared once per (agent, remote agent); a request posts by block index. False
    # builds descriptors per request (also the automatic fallback when NIXL cannot prepare lists).
    nixl_prepped: bool = True
    # Sender: make one WRITE per layer while BEGIN_OK is on its way (off the critical path: a streamed
    # prefill opens its send before the final chunk computes) and post a pushed layer's WRITE with one
    # call, so its bytes move at once. False: one WRITE made and posted per push (one make_prepped_xfer
    # over every (layer, block) index of the push before anything moves). Needs nixl_prepped.
    nixl_prebuild: bool = True
    # Linux: the transport's event-loop thread asks for a 1 ns timer slack (prctl PR_SET_TIMERSLACK), so
    # the fast wait's time.sleep(nixl_fast_wait_nap_s) naps about that long instead of the default 50 us
    # slack on top (a 20 us nap was really ~70 us, and a WRITE's completion was seen that much later).
    # Costs nothing while the thread is idle; only that thread's sleeps and timeouts are affected.
    fine_timer_slack: bool = True
    # NIXL's own progress thread spins (about a quarter of a core per idle agent, measured); without it
    # the transport's polling (state checks, notification polls) drives UCX progress instead.
    nixl_progress_thread: bool = False
    agent_name: str | None = None
    # Stage device memory through host buffers on the TCP path even for host tensors (tests the GPU path).
    force_staging: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"TransportConfig.kind must be one of {KINDS}, got {self.kind!r}")
        if not (0 <= self.listen_port <= 65535):
            raise ValueError(f"TransportConfig.listen_port out of range: {self.listen_port}")
        for name in ("connect_timeout_s", "handshake_timeout_s", "send_timeout_s", "abort_ack_timeout_s",
                     "nixl_poll_interval_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"TransportConfig.{name} must be > 0, got {value!r}")
        if not (isinstance(self.max_frame_bytes, int) and 4096 <= self.max_frame_bytes <= (1 << 30)):
            raise ValueError("TransportConfig.max_frame_bytes must be in [4 KiB, 1 GiB], "
                             f"got {self.max_frame_bytes}")
        if not (isinstance(self.nixl_spin_s, (int, float)) and 0 <= self.nixl_spin_s <= 10):
            raise ValueError(f"TransportConfig.nixl_spin_s must be in [0, 10], got {self.nixl_spin_s!r}")
        for name, lo, hi in (("nixl_fast_wait_s", 0, 10), ("nixl_fast_wait_nap_s", 0, 0.001),
                             ("nixl_fast_wait_gbps", 1e-3, 1e6)):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and lo <= value <= hi):
                raise ValueError(f"TransportConfig.{name} must be in [{lo}, {hi}], got {value!r}")
        object.__setattr__(self, "nixl_fast_wait_mem", tuple(self.nixl_fast_wait_mem))
        bad = [m for m in self.nixl_fast_wait_mem if m not in ("DRAM", "VRAM")]
        if bad:
            raise ValueError(f"TransportConfig.nixl_fast_wait_mem: unknown memory kinds {bad}")
        if not (isinstance(self.tcp_busy_frame_factor, int) and 1 <= self.tcp_busy_frame_factor <= 64
                and self.max_frame_bytes * self.tcp_busy_frame_factor <= (1 << 30)):
            raise ValueError("TransportConfig.tcp_busy_frame_factor must be in [1, 64] with "
                             f"max_frame_bytes x it <= 1 GiB, got {self.tcp_busy_frame_factor!r}")
        if not (isinstance(self.inline_write_max_bytes, int) and self.inline_write_max_bytes >= 0):
            raise ValueError("TransportConfig.inline_write_max_bytes must be an int >= 0, "
                             f"got {self.inline_write_max_bytes!r}")
        gil = self.gil_switch_interval_s
        if not (isinstance(gil, (int, float)) and 0 <= gil <= 1):
            raise ValueError("TransportConfig.gil_switch_interval_s must be in [0, 1] seconds, "
                             f"got {self.gil_switch_interval_s!r}")
        if self.socket_buffer_bytes < 0:
            raise ValueError("TransportConfig.socket_buffer_bytes must be >= 0")
        if self.listen_host in ("0.0.0.0", "::", "") and not self.advertise_host:
            raise ValueError("TransportConfig.advertise_host is required when listening on all interfaces")
        if not (isinstance(self.tcp_connections, int) and 1 <= self.tcp_connections <= 64):
            raise ValueError("TransportConfig.tcp_connections must be in [1, 64], "
                             f"got {self.tcp_connections!r}")
        if not (isinstance(self.tcp_stage_ahead, int) and 1 <= self.tcp_stage_ahead <= 64):
            raise ValueError("TransportConfig.tcp_stage_ahead must be in [1, 64], "
                             f"got {self.tcp_stage_ahead!r}")
        if not (isinstance(self.stall_timeout_s, (int, float)) and self.stall_timeout_s > 0):
            raise ValueError(f"TransportConfig.stall_timeout_s must be > 0, got {self.stall_timeout_s!r}")
        if not (isinstance(self.tls_procs, int) and 0 <= self.tls_procs <= 64):
            raise ValueError(f"TransportConfig.tls_procs must be in [0, 64], got {self.tls_procs!r}")
        tls = (self.tls_ca, self.tls_cert, self.tls_key)
        if any(tls) and not all(tls):
            raise ValueError("TransportConfig: tls_ca, tls_cert and tls_key go together (all three or none)")
        object.__setattr__(self, "nixl_backends", tuple(self.nixl_backends))
        env = self.ucx_env.items() if isinstance(self.ucx_env, dict) else self.ucx_env
        object.__setattr__(self, "ucx_env", tuple((str(k), str(v)) for k, v in env))
        if any(not k.startswith("UCX_") for k, _ in self.ucx_env):
            raise ValueError(f"TransportConfig.ucx_env: only UCX_* variables, got {self.ucx_env}")
        if not self.nixl_backends:
            raise ValueError("TransportConfig.nixl_backends must name at least one backend")

    @property
    def tls(self) -> bool:
        return self.tls_ca is not None

    @property
    def host_for_endpoint(self) -> str:
        return self.advertise_host or self.listen_host
