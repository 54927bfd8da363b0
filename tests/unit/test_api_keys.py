"""router/api_keys.py: which keys are accepted, the keys file's rotation (on a hand-moved clock), what an
unreadable file does, Bearer parsing; and the router flags' validation in pdserve/settings.py."""

from __future__ import annotations

import os

import pytest

from pdserve.settings import ServeSettings
from router.api_keys import MISSING_KEY, WRONG_KEY, ApiKeys, bearer_token


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_static_keys_and_refusal_messages() -> None:
    keys = ApiKeys(["k1", "k2"])
    assert keys.enabled and keys.allows("k1") and keys.allows("k2")
    assert not keys.allows("k3") and not keys.allows("") and not keys.allows(None)
    assert keys.refusal(None) == MISSING_KEY and keys.refusal("k3") == WRONG_KEY
    assert not ApiKeys().enabled and ApiKeys().allows(None)  # no keys configured: the door is open


def test_keys_file_rotates_without_restart(tmp_path) -> None:
    f = tmp_path / "keys"
    f.write_text("# comment\n\nold\n")
    clock = Clock()
    keys = ApiKeys(file=str(f), check_interval_s=1.0, clock=clock)
    assert keys.allows("old") and not keys.allows("new")
    f.write_text("old\nnew\n")
    os.utime(f, ns=(1, 2_000_000_000))  # a changed mtime, whatever the file system's resolution
    assert not keys.allows("new")  # looked at most once a second
    clock.t = 1.5
    assert keys.allows("new") and keys.allows("old")
    f.write_text("new\n")
    os.utime(f, ns=(1, 3_000_000_000))
    clock.t = 3.0
    assert keys.allows("new") and not keys.allows("old")
    f.unlink()  # unreadable: the last good set stays
    clock.t = 5.0
    assert keys.allows("new") and not keys.allows("old")


def test_empty_file_refuses_everyone_and_missing_file_is_an_error(tmp_path) -> None:
    f = tmp_path / "keys"
    f.write_text("# nobody yet\n")
    keys = ApiKeys(file=str(f))
    assert keys.enabled and not keys.allows("anything")
    with pytest.raises(ValueError, match="api-keys-file"):
        ApiKeys(file=str(tmp_path / "absent"))


@pytest.mark.parametrize("header,key", [("Bearer abc", "abc"), ("bearer  abc ", "abc"), ("Basic abc", None),
                                        ("Bearer", None), ("", None), (None, None)])
def test_bearer_token(header, key) -> None:
    assert bearer_token(header) == key


def test_router_flags() -> None:
    s = ServeSettings.from_args(_args(role="router", prefill="a:1", decode="b:2", http_port=8000,
                                      api_key=["k1"]), env={"PDSERVE_API_KEY": "ignored"})
    assert s.http_port == 8000 and s.api_key == ("k1",)
    s = ServeSettings.from_args(_args(role="router", prefill="a:1", decode="b:2"),
                                env={"PDSERVE_API_KEY": "k1, k2", "PDSERVE_HTTP_PORT": "8001"})
    assert s.api_key == ("k1", "k2") and s.http_port == 8001
    with pytest.raises(ValueError, match="router flags"):
        ServeSettings(role="decode", model="m", http_port=8000)
    with pytest.raises(ValueError, match="gRPC --port"):
        ServeSettings(role="router", prefill=("a:1",), decode=("b:2",), port=8000, http_port=8000)
    with pytest.raises(ValueError, match="http-port"):
        ServeSettings(role="router", prefill=("a:1",), decode=("b:2",), http_port=70000)


def _args(**given):
    import argparse

    from pdserve.serve_flags import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    ns = parser.parse_args([])
    for k, v in given.items():
        setattr(ns, k, v)
    return ns
