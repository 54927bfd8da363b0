"""The process environment beyond the serve flags, and what the KV transport derives from it.

Debugging switches (``PDSERVE_CUDA_GRAPHS``, ``PDSERVE_KV_TRACE``, ...), what launchers hand on to their
children, and the KV transport's options for a worker (its settings plus UCX variables). Read here and
in settings.py (the serve flags' ``PDSERVE_*`` variables) only, so that every variable the project
looks at is listed in these two files; callers get plain values.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pdserve.settings import ServeSettings


def environ() -> dict[str, str]:
    """A copy of this process's environment (launchers start children with it)."""
    return dict(os.environ)


def env_switch(name: str, default: bool = True) -> bool:
    """An on/off debugging switch: ``0`` turns it off, ``1`` on; unset keeps ``default``.

    Used for ``PDSERVE_CUDA_GRAPHS``, ``PDSERVE_FUSED_OPS``, ``PDSERVE_KV_TRACE`` and
    ``PDSERVE_UCX_PROTO_INFO`` (docs/gpu.md lists what each does).
    """
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    return raw != "0"


def stall_watch_ms() -> float:
    """``PDSERVE_STALL_WATCH_MS`` (0 = off); a value that is not a number is off, with ValueError's text."""
    raw = os.environ.get("PDSERVE_STALL_WATCH_MS", "0") or "0"
    return float(raw)


def ucx_tls_for_tests() -> str:
    """UCX transports for NIXL in local test clusters (``PDSERVE_TEST_UCX_TLS``, default ``tcp``)."""
    return os.environ.get("PDSERVE_TEST_UCX_TLS", "tcp")


# ---- the KV transport (kvtransfer.TransportConfig) ------------------------------------------------------


def kv_transport_options(settings: ServeSettings, env: Mapping[str, str] | None = None) -> dict:
    """TransportConfig keyword arguments for a worker: the KV host, connections, tracing, mutual TLS (the
    cluster's certificates, ``<tls_dir>/ca.crt`` and ``<tls_dir>/<role>.crt|.key``, when a TLS directory
    is configured) and the UCX variables the NIXL agent sets in its process (``ucx_env``)."""
    env = os.environ if env is None else env
    host = settings.kv_host or settings.host
    opts: dict = {"listen_host": host, "listen_port": settings.kv_port,
                  "tcp_connections": settings.kv_connections, "tcp_stripe": settings.kv_stripe == "on",
                  "trace": env_switch("PDSERVE_KV_TRACE", False)}
    if host in ("0.0.0.0", "::", ""):
        opts["advertise_host"] = settings.advertise_host
    tls_dir = getattr(settings, "tls_dir", None)
    if tls_dir:
        role = settings.role
        opts.update(tls_ca=os.path.join(tls_dir, "ca.crt"), tls_cert=os.path.join(tls_dir, f"{role}.crt"),
                    tls_key=os.path.join(tls_dir, f"{role}.key"))
    ucx: dict[str, str] = {}
    if env_switch("PDSERVE_UCX_PROTO_INFO", True) and "UCX_PROTO_INFO" not in env:
        ucx["UCX_PROTO_INFO"] = "y"
    if "UCX_NET_DEVICES" not in env:
        devices = ucx_net_devices(host)
        if devices:
            ucx["UCX_NET_DEVICES"] = devices
    opts["ucx_env"] = tuple(ucx.items())
    return opts


def ucx_net_devices(host: str) -> str:
    """UCX_NET_DEVICES for a KV host, so UCX's TCP listeners bind its interface only: the interface that
    holds the address (``lo`` for loopback) plus every RDMA port (``mlx5_0:1``: not a TCP listener, and
    the one to keep for bandwidth); "" (UCX's default, every device) for all interfaces or an address no
    interface holds."""
    import ipaddress  # noqa: PLC0415
    import socket as sock  # noqa: PLC0415

    if host in ("0.0.0.0", "::", ""):
        return ""
    try:
        addr = sock.gethostbyname(host)
    except OSError:
        return ""
    name = "lo" if ipaddress.ip_address(addr).is_loopback else _interface_of(addr)
    if not name:
        return ""
    rdma = []
    ib = "/sys/class/infiniband"
    if os.path.isdir(ib):
        for dev in sorted(os.listdir(ib)):
            ports = os.path.join(ib, dev, "ports")
            rdma += [f"{dev}:{p}" for p in sorted(os.listdir(ports))] if os.path.isdir(ports) else []
    return ",".join([name, *rdma])


def _interface_of(addr: str) -> str:
    """The network interface holding an IPv4 address (Linux SIOCGIFADDR), "" if none."""
    import fcntl  # noqa: PLC0415
    import socket as sock  # noqa: PLC0415
    import struct  # noqa: PLC0415

    with sock.socket(sock.AF_INET, sock.SOCK_DGRAM) as s:
        for _index, name in sock.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if sock.inet_ntoa(raw[20:24]) == addr:
                return name
    return ""
