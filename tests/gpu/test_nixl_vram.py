"""NIXL moves KV blocks VRAM -> VRAM between two processes, byte-exact (kvtransfer, memory kind cuda).

Both processes register their whole KV tensor in GPU memory; the sender writes scattered and
contiguous blocks of random bytes into the receiver's blocks. Checked: the sha256 of the source
blocks equals that of the destination blocks, no other destination block changed, and both sides
are idle afterwards. With two GPUs the receiver is on the other GPU; with one, both share it. The TCP
backend (staged through host memory) is checked the same way.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from engine.kv_layout import KVLayout

# bench/ on sys.path (spawned peers inherit it) so the peer function pickles by module name.
sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import gpu_transfer  # noqa: E402

LAYOUT = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16", memory="cuda")


@pytest.mark.parametrize("kind", ["nixl", "tcp"])
def test_vram_to_vram_two_processes_byte_exact(kind, tmp_path):
    rx_dev = 1 if torch.cuda.device_count() > 1 else 0
    pair = gpu_transfer.TransferPair(
        LAYOUT, rx_device=rx_dev, tx_device=0, num_blocks=64, kind=kind, log_dir=tmp_path
    )
    try:
        assert kind in pair.backends["rx"]["backends"], pair.backends
        rng = random.Random(5)
        src = rng.sample(range(30), 8) + [40, 41, 42, 43]
        dst = rng.sample(range(50), 8) + [60, 61, 62, 63]
        res = pair.transfer("vram-1", src, dst)
        assert res["backend"] == kind, res
        assert res["bytes"] == LAYOUT.num_layers * len(dst) * LAYOUT.block_bytes
        want, have = pair.digest("tx", src), pair.digest("rx", dst)
        assert have["digest"] == want["digest"], "destination blocks differ from the source blocks"
        assert have["others_zero"], "blocks outside the destination were written"
    finally:
        stats = pair.close()
    for role in ("tx", "rx"):
        assert "error" not in stats[role], stats
        assert stats[role]["expectations"] == stats[role]["sends"] == stats[role]["nixl_xfers"] == 0, stats
    if kind == "nixl":
        print("\n".join(gpu_transfer.ucx_transports(tmp_path)))
