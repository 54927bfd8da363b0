"""Serve settings: flag > PDSERVE_* env > default, validation messages."""

from __future__ import annotations

import argparse

import pytest

from pdserve.serve_flags import add_serve_arguments
from pdserve.settings import ServeSettings


def parse(argv: list[str], env: dict[str, str] | None = None) -> ServeSettings:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return ServeSettings.from_args(parser.parse_args(argv), env=env or {})


def test_defaults_env_and_flag_precedence() -> None:
    s = parse(["--role", "decode"], {"PDSERVE_MODEL": "/m", "PDSERVE_PORT": "6000",
                                     "PDSERVE_KV_PORT": "7000"})
    assert (s.model, s.port, s.kv_port, s.block_size, s.transport) == ("/m", 6000, 7000, 16, "auto")
    assert s.worker_id.startswith("decode-") and s.advertise_host
    s = parse(["--role", "decode", "--model", "/flag", "--port", "1"], {"PDSERVE_MODEL": "/env"})
    assert s.model == "/flag" and s.port == 1
    r = parse([], {"PDSERVE_ROLE": "router", "PDSERVE_PREFILL": "a:1, b:2", "PDSERVE_DECODE": "c:3",
                   "PDSERVE_POLICY": "least_loaded", "PDSERVE_DRAIN_TIMEOUT": "2.5"})
    assert r.prefill == ("a:1", "b:2") and r.decode == ("c:3",)
    assert r.policy == "least_loaded" and r.drain_timeout == 2.5
    assert r.decode_mux == "on"  # a decode worker's streams share one DecodeMany call by default
    off = parse(["--role", "router", "--prefill", "a:1", "--decode", "b:2", "--decode-mux", "off"])
    assert off.decode_mux == "off"
    p = parse(["--role", "prefill", "--model", "/m"])
    assert p.kv_stream_layers == "on"  # layer-wise KV push by default
    p = parse(["--role", "prefill", "--model", "/m"], {"PDSERVE_KV_STREAM_LAYERS": "off"})
    assert p.kv_stream_layers == "off"
    assert parse(["--role", "prefill", "--model", "/m", "--kv-stream-layers", "on"],
                 {"PDSERVE_KV_STREAM_LAYERS": "off"}).kv_stream_layers == "on"


def test_kv_staging_flag_reaches_the_transport() -> None:
    from pdserve.settings import kv_transport_options

    d = parse(["--role", "decode", "--model", "/m"])
    assert d.kv_staging == "gather" and kv_transport_options(d, env={})["staging_gather"] is True
    d = parse(["--role", "decode", "--model", "/m", "--kv-staging", "runs"])
    assert kv_transport_options(d, env={})["staging_gather"] is False
    with pytest.raises(SystemExit):
        parse(["--role", "decode", "--model", "/m", "--kv-staging", "maybe"])


@pytest.mark.parametrize("argv,env,needle", [
    ([], {}, "--role"),
    (["--role", "prefill"], {}, "--model"),
    (["--role", "router"], {}, "--prefill"),
    (["--role", "router", "--discovery", "redis"], {}, "--redis"),
    (["--role", "router", "--discovery", "file"], {}, "--workers-file"),
    (["--role", "decode", "--model", "m", "--num-blocks", "0"], {}, "--num-blocks"),
    (["--role", "decode", "--model", "m", "--num-blocks", "4", "--kv-memory-gb", "1"], {}, "not both"),
    (["--role", "decode", "--model", "m"], {"PDSERVE_PORT": "abc"}, "not a number"),
    (["--role", "decode", "--model", "m"], {"PDSERVE_TRANSPORT": "rdma"}, "--transport"),
    (["--role", "prefill", "--model", "m"], {"PDSERVE_KV_STREAM_LAYERS": "maybe"}, "--kv-stream-layers"),
    (["--role", "decode", "--model", "m", "--port", "70000"], {}, "--port"),
    (["--role", "router", "--prefill", "a:1", "--decode", "b:2"], {"PDSERVE_DECODE_MUX": "maybe"},
     "--decode-mux"),
])
def test_invalid_settings_name_the_problem(argv, env, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        parse(argv, env)


def test_overlap_steps_and_bench_command(monkeypatch) -> None:
    """PDSERVE_OVERLAP_STEPS is three-way (unset: the engine decides), and a benchmark records the
    command device_run.sh names, else its own command line."""
    import shlex
    import sys

    import torch

    from engine.step_ahead import overlap_by_default
    from pdserve.settings import bench_command, overlap_steps

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("PDSERVE_OVERLAP_STEPS", raising=False)
    assert overlap_steps() is None
    assert overlap_by_default(None, cuda, None) and not overlap_by_default(None, cpu, None)
    assert not overlap_by_default(None, cuda, tp=object()) and overlap_by_default(True, cpu, tp=object())
    monkeypatch.setenv("PDSERVE_OVERLAP_STEPS", "1")
    assert overlap_steps() is True and overlap_by_default(None, cpu, None)
    assert not overlap_by_default(False, cpu, None)  # the config wins over the environment
    monkeypatch.setenv("PDSERVE_OVERLAP_STEPS", "0")
    assert overlap_steps() is False and not overlap_by_default(None, cuda, None)
    monkeypatch.setenv("PDSERVE_BENCH_COMMAND", "bash bench/device_run.sh step-ahead")
    assert bench_command() == "bash bench/device_run.sh step-ahead"
    monkeypatch.delenv("PDSERVE_BENCH_COMMAND")
    assert shlex.split(bench_command()) == [sys.executable, *sys.argv]


def test_cuda_graphs_at_start(monkeypatch) -> None:
    from pdserve.settings import cuda_graphs_at_start

    monkeypatch.delenv("PDSERVE_CUDA_GRAPHS_AT_START", raising=False)
    assert cuda_graphs_at_start(1) == 1 and cuda_graphs_at_start(8) == 8
    monkeypatch.setenv("PDSERVE_CUDA_GRAPHS_AT_START", "16")
    assert cuda_graphs_at_start(1) == 16
    for bad in ("0", "-2", "eight"):
        monkeypatch.setenv("PDSERVE_CUDA_GRAPHS_AT_START", bad)
        with pytest.raises(ValueError, match="PDSERVE_CUDA_GRAPHS_AT_START must be a positive integer"):
            cuda_graphs_at_start(1)


def test_tp_allreduce(monkeypatch) -> None:
    from pdserve.settings import tp_allreduce

    monkeypatch.delenv("PDSERVE_TP_ALLREDUCE", raising=False)
    assert tp_allreduce() == ("nccl", 0)
    cases = (("nccl", ("nccl", 0)), ("symm", ("symm", 2048 * 1024)), ("symm:512", ("symm", 512 * 1024)))
    for raw, want in cases:
        monkeypatch.setenv("PDSERVE_TP_ALLREDUCE", raw)
        assert tp_allreduce() == want
    for bad in ("gloo", "symm:0", "symm:x", "symm:-4"):
        monkeypatch.setenv("PDSERVE_TP_ALLREDUCE", bad)
        with pytest.raises(ValueError, match="PDSERVE_TP_ALLREDUCE"):
            tp_allreduce()


def test_environment_sets_for_the_body_and_puts_back(monkeypatch) -> None:
    import os

    from pdserve.settings import environment

    monkeypatch.setenv("PDSERVE_TEST_KEPT", "before")
    monkeypatch.delenv("PDSERVE_TEST_NEW", raising=False)
    with environment({"PDSERVE_TEST_KEPT": "inside", "PDSERVE_TEST_NEW": "1"}):
        assert (os.environ["PDSERVE_TEST_KEPT"], os.environ["PDSERVE_TEST_NEW"]) == ("inside", "1")
    assert os.environ["PDSERVE_TEST_KEPT"] == "before" and "PDSERVE_TEST_NEW" not in os.environ
