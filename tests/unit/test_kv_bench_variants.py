"""kv_bench's ``--variant``: TransportConfig overrides for both processes, or for one (``rx.`` / ``tx.``)."""

import pytest

from bench.kv_concurrency import _parse_variant, _side


def test_variant_overrides_for_both_sides_and_for_one():
    name, over = _parse_variant("txinproc=tls=true,tx.tls_procs=0,tcp_connections=4,rx.kv_label=x")
    assert name == "txinproc"
    assert over == {"tls": True, "tx.tls_procs": 0, "tcp_connections": 4, "rx.kv_label": "x"}
    assert _side(over, "tx") == {"tls_procs": 0} and _side(over, "rx") == {"kv_label": "x"}
    assert _side({"tls": True}, "tx") == {}


@pytest.mark.parametrize("text", ["tcp=tls=true", "noflags=", "=a=1"])
def test_variant_names_must_be_new_and_carry_overrides(text):
    with pytest.raises(SystemExit):
        _parse_variant(text)
