import pytest
import torch

from engine.kv_layout import KVLayout
from engine.prefix_hash import block_hashes, hash_block


def make_layout(**kw):
    base = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
    base.update(kw)
    return KVLayout(**base)


def test_offsets_match_tensor_layout():
    layout = make_layout()
    cache = layout.allocate(num_blocks=5)
    flat = cache.view(-1).view(torch.uint8)
    cache[1, 3].fill_(7.0)
    off = layout.block_offset(1, 3, num_blocks=5)
    block = flat[off:off + layout.block_bytes].view(torch.float32)
    assert torch.all(block == 7.0)
    assert int((flat.view(torch.float32) == 7.0).sum()) == layout.block_numel


def test_hash_covers_every_field_and_roundtrips():
    layout = make_layout()
    assert KVLayout.from_dict(layout.to_dict()) == layout
    for change in ({"dtype": "bfloat16"}, {"block_size": 8}, {"num_layers": 3}, {"num_kv_heads": 4},
                   {"head_dim": 16}, {"memory": "cuda"}, {"model_fingerprint": "x"}):
        assert make_layout(**change).compat_hash() != layout.compat_hash(), change


@pytest.mark.parametrize("bad", [{"block_size": 0}, {"dtype": "int8"}, {"memory": "tpu"}, {"num_layers": -1}])
def test_invalid_layout_rejected(bad):
    with pytest.raises(ValueError):
        make_layout(**bad)


def test_unknown_field_rejected():
    with pytest.raises(ValueError, match="unknown"):
        KVLayout.from_dict({**make_layout().to_dict(), "extra": 1})


def test_prefix_hash_chains_and_is_stable():
    toks = list(range(10))
    hs = block_hashes(toks, 4)
    assert len(hs) == 2  # the partial tail block has no hash
    assert hs[1] == hash_block(hs[0], toks[4:8])
    assert block_hashes([99] + toks[1:], 4)[1] != hs[1]  # a change early changes every later hash
    # Pinned value: the hash is a cross-process protocol, so it must never drift silently.
    assert block_hashes([1, 2, 3, 4], 4) == [hash_block(0, [1, 2, 3, 4])]
    assert hash_block(0, [1, 2, 3, 4]) == 0x2728AB4454AAA05B


@pytest.mark.parametrize("prompt_len,answer_len", [(0, 5), (15, 1), (16, 0), (16, 16), (37, 30), (64, 3)])
def test_the_routers_held_hashes_extend_the_prompts_as_if_hashed_whole(prompt_len, answer_len):
    """router.pipeline._held_hashes (what the decode worker holds after a turn), hashed from the prompt's
    hashes and only the tail on, equals hashing prompt + answer from scratch."""
    from router.pipeline import _held_hashes

    prompt, answer = list(range(prompt_len)), list(range(1000, 1000 + answer_len))
    assert _held_hashes(block_hashes(prompt, 16), prompt, answer, 16) == block_hashes(prompt + answer, 16)
