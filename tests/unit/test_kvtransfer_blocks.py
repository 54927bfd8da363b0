"""kvtransfer pure pieces: block-id validation, run coalescing, frame planning, framing, config."""

import pytest

from kvtransfer.blocks import merge_regions, pair_runs, plan_segments, validate_block_ids, validate_layers
from kvtransfer.config import TransportConfig
from kvtransfer.errors import InvalidTransfer, ProtocolError
from kvtransfer.protocol import HEADER, MAGIC, Msg, decode_header, decode_meta, encode


def test_validate_block_ids_rejects_range_duplicates_and_non_ints():
    assert validate_block_ids([3, 0, 7], 8, "dst") == (3, 0, 7)
    with pytest.raises(InvalidTransfer, match=r"out of range \[0, 8\).*\[8, -1\]"):
        validate_block_ids([1, 8, -1], 8, "dst")
    with pytest.raises(InvalidTransfer, match=r"duplicate dst block ids: \[2\]"):
        validate_block_ids([2, 5, 2], 8, "dst")
    with pytest.raises(InvalidTransfer, match="not an integer"):
        validate_block_ids([1.5], 8, "src")
    with pytest.raises(InvalidTransfer):
        validate_layers([0, 4], 4)
    with pytest.raises(InvalidTransfer, match="duplicate layers"):
        validate_layers([1, 1], 4)
    assert validate_layers(None, 3) == (0, 1, 2)


def test_pair_runs_coalesce_only_when_both_sides_advance():
    assert pair_runs([4, 5, 6, 9], [0, 1, 2, 3]) == [(4, 0, 3), (9, 3, 1)]
    assert pair_runs([1, 2], [5, 3]) == [(1, 5, 1), (2, 3, 1)]
    assert pair_runs([], []) == []
    with pytest.raises(InvalidTransfer):
        pair_runs([1], [1, 2])


def test_merge_regions_joins_runs_contiguous_on_both_sides():
    assert merge_regions([(0, 100, 10), (10, 110, 5), (15, 200, 5)]) == [(0, 100, 15), (15, 200, 5)]


def test_plan_segments_bounds_frames_and_covers_every_block_once():
    runs = [(0, 10, 5), (7, 3, 2)]
    frames = plan_segments([0, 1], runs, block_bytes=100, max_frame_bytes=300)
    assert all(sum(seg[3] for seg in f) <= 3 for f in frames)
    covered = [(layer, d + i) for f in frames for layer, _s, d, n in f for i in range(n)]
    want = [(layer, d + i) for layer in (0, 1) for _s, d, n in runs for i in range(n)]
    assert sorted(covered) == sorted(want)


def test_framing_roundtrip_and_rejections():
    frame = encode(Msg.BEGIN, {"rid": "r", "dst": [1, 2]})
    msg, flags, meta_len, payload_len = decode_header(frame[:HEADER.size])
    assert (msg, flags, payload_len) == (Msg.BEGIN, 0, 0)
    assert decode_meta(frame[HEADER.size:HEADER.size + meta_len]) == {"rid": "r", "dst": [1, 2]}
    with pytest.raises(ProtocolError, match="magic"):
        decode_header(HEADER.pack(b"XXXX", 1, 5, 0, 2, 0))
    with pytest.raises(ProtocolError, match="version"):
        decode_header(HEADER.pack(MAGIC, 99, 5, 0, 2, 0))
    with pytest.raises(ProtocolError, match="carry no payload|payload"):
        decode_header(HEADER.pack(MAGIC, 1, int(Msg.BEGIN), 0, 2, 10))
    with pytest.raises(ProtocolError, match="unknown frame type"):
        decode_header(HEADER.pack(MAGIC, 1, 200, 0, 2, 0))
    with pytest.raises(ProtocolError, match="JSON object"):
        decode_meta(b"[1, 2]")


def test_config_validation():
    with pytest.raises(ValueError, match="kind"):
        TransportConfig(kind="rdma")
    with pytest.raises(ValueError, match="advertise_host"):
        TransportConfig(listen_host="0.0.0.0")
    with pytest.raises(ValueError, match="max_frame_bytes"):
        TransportConfig(max_frame_bytes=10)
    assert TransportConfig(listen_host="0.0.0.0", advertise_host="10.0.0.2").host_for_endpoint == "10.0.0.2"


@pytest.mark.parametrize("dtype,head_dim", [("float32", 8), ("bfloat16", 4), ("float16", 1)])
def test_staged_frames_gather_and_scatter_scattered_runs_in_order(dtype, head_dim):
    """A frame of many runs over several layers is staged as one gather and flushed as one scatter
    (kvtransfer/memory.py); the staged bytes are the segments' in order and flushing them back
    writes exactly those blocks (rows of 8- and 4-byte words)."""
    import torch

    from engine.kv_layout import KVLayout
    from kvtransfer import memory
    from kvtransfer.memory import KVMemory

    lay = KVLayout(num_layers=3, num_kv_heads=1, head_dim=head_dim, block_size=1, dtype=dtype, memory="cpu")
    src = torch.randn(lay.cache_shape(12)).to(lay.torch_dtype)
    mem = KVMemory(src, lay, force_staging=True)
    bb = mem.block_bytes
    segs = [(mem.offset(0, 7), 2 * bb, 0), (mem.offset(2, 1), bb, 2), (mem.offset(1, 4), 3 * bb, 1),
            (mem.offset(0, 0), bb, 0), (mem.offset(2, 9), 3 * bb, 2), (mem.offset(1, 11), bb, 1)]
    assert len(segs) > memory._COPY_MAX_SEGMENTS  # the gather/scatter path
    views, event = mem.stage_out(segs)
    assert event is None and [len(v) for v in views] == [n for _o, n, _l in segs]
    flat = src.view(-1).view(torch.uint8)
    assert b"".join(bytes(v) for v in views) == b"".join(bytes(flat[o:o + n].numpy()) for o, n, _l in segs)
    dst = torch.zeros_like(src)
    rx = KVMemory(dst, lay, force_staging=True)
    recv, staging = rx.recv_views(segs)
    for v, s in zip(recv, views, strict=True):
        v[:] = s
    assert rx.flush(segs, staging) is None
    got = dst.view(-1).view(torch.uint8)
    for o, n, _l in segs:
        assert torch.equal(got[o:o + n], flat[o:o + n])
    untouched = torch.ones(got.numel(), dtype=torch.bool)
    for o, n, _l in segs:
        untouched[o:o + n] = False
    assert not got[untouched].any()  # nothing else written
    assert rx._table.dtype == (torch.int64 if bb % 8 == 0 else torch.int32)
