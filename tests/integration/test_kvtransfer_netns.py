"""KV transfer between two network namespaces joined by a veth pair (10.77.x.1 <-> 10.77.x.2): TCP and
NIXL with UCX_TLS=tcp (simulated RDMA), byte-exact. Needs root and `ip netns`; skips -- saying why --
only when the namespaces cannot be created (the two-process tests elsewhere never skip)."""

import asyncio
import os
import shutil
import subprocess

import pytest

from bench.kv_peers import PeerClient
from engine.kv_layout import KVLayout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

LAYOUT = KVLayout(num_layers=6, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")


def _ip(*args):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


@pytest.fixture
def namespaces():
    if shutil.which("ip") is None:
        pytest.skip("network namespaces unavailable: no `ip` command")
    tag = f"{os.getpid() % 100000}"
    ns_a, ns_b, veth_a, veth_b = f"kvt{tag}a", f"kvt{tag}b", f"kv{tag}a", f"kv{tag}b"
    subnet = f"10.77.{os.getpid() % 250}"
    steps = [("netns", "add", ns_a), ("netns", "add", ns_b),
             ("link", "add", veth_a, "type", "veth", "peer", "name", veth_b),
             ("link", "set", veth_a, "netns", ns_a), ("link", "set", veth_b, "netns", ns_b),
             ("-n", ns_a, "addr", "add", f"{subnet}.1/24", "dev", veth_a),
             ("-n", ns_b, "addr", "add", f"{subnet}.2/24", "dev", veth_b),
             ("-n", ns_a, "link", "set", veth_a, "up"), ("-n", ns_b, "link", "set", veth_b, "up"),
             ("-n", ns_a, "link", "set", "lo", "up"), ("-n", ns_b, "link", "set", "lo", "up")]
    try:
        for step in steps:
            res = _ip(*step)
            if res.returncode != 0:
                pytest.skip(f"network namespaces cannot be created here: `ip {' '.join(step)}` -> "
                            f"{res.stderr.strip() or res.returncode}")
        yield ns_a, ns_b, f"{subnet}.1"
    finally:
        for ns in (ns_a, ns_b):
            _ip("netns", "del", ns)
        _ip("link", "del", veth_a)


def test_tcp_and_simulated_rdma_across_network_namespaces(namespaces):
    ns_a, ns_b, addr_a = namespaces

    async def main():
        env = {"UCX_TLS": "tcp"}
        rx = await PeerClient.spawn(env=env, prefix=["ip", "netns", "exec", ns_a])
        tx = await PeerClient.spawn(env=env, prefix=["ip", "netns", "exec", ns_b])
        try:
            for n, kind in enumerate(("tcp", "nixl")):
                r = await rx.call("init", kind=kind, layout=LAYOUT.to_dict(), num_blocks=32,
                                  config={"listen_host": addr_a})
                t = await tx.call("init", kind=kind, layout=LAYOUT.to_dict(), num_blocks=16,
                                  config={"listen_host": "127.0.0.1"})
                await tx.call("fill", tid=t["tid"], seed=11 + n)
                ep = r["endpoint"]
                assert ep["host"] == addr_a
                src, dst = [3, 4, 5, 9, 0, 15], [30, 31, 2, 17, 8, 9]
                await rx.call("expect", tid=r["tid"], rid=f"ns-{kind}", dst=dst, timeout=60)
                await tx.call("send", tid=t["tid"], rid=f"ns-{kind}", endpoint=ep, src=src, dst=dst)
                sent, got = await asyncio.gather(tx.call("send_wait", tid=t["tid"], rid=f"ns-{kind}"),
                                                 rx.call("wait", tid=r["tid"], rid=f"ns-{kind}"))
                assert sent["result"]["backend"] == got["result"]["backend"] == kind
                want = await tx.call("digest", tid=t["tid"], blocks=src)
                have = await rx.call("digest", tid=r["tid"], blocks=dst)
                assert have["digest"] == want["digest"] and have["others_zero"]
                for peer, tid in ((tx, t["tid"]), (rx, r["tid"])):
                    closed = (await peer.call("close", tid=tid))["stats"]
                    assert all(v == 0 for v in closed.values()), closed
        finally:
            await tx.close()
            await rx.close()

    asyncio.run(asyncio.wait_for(main(), 160))
