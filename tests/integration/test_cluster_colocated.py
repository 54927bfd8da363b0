"""The colocated baseline behind the same Router API, the AsyncEngine driver, and `pdserve bench`."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from test_cluster_1p1d import MAX_TOKENS, prompts, reference, run_concurrently

from pdserve.app.launcher.local import colocated, get_stats
from pdserve.client import Client

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(make_checkpoint, tmp_path_factory):
    model = make_checkpoint("llama")
    proc = colocated(model, log_path=tmp_path_factory.mktemp("coloc") / "colocated.log")
    proc.model = model
    proc.start_free = get_stats(proc.address, "decode").free_blocks
    yield proc
    assert proc.stop(30) == 0  # graceful drain exits 0
    assert "draining" in open(proc.log_path).read()


def test_colocated_greedy_matches_engine(server) -> None:
    ps = prompts()
    want = reference(server.model, ps, MAX_TOKENS)
    got = run_concurrently(server.address, ps, MAX_TOKENS)
    assert [r.token_ids for r in got] == want
    assert {r.final["transport"] for r in got} == {"local"}
    assert get_stats(server.address, "decode").free_blocks == server.start_free


def test_colocated_validation_and_cancel(server) -> None:
    with Client(server.address, timeout=30) as c:
        with pytest.raises(grpc.RpcError) as info:
            c.generate(prompt_ids=[1, 2], temperature=-0.5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        call = c.stream(prompt_ids=prompts()[5], max_tokens=1000, ignore_eos=True)
        next(call)
        call.cancel()
    deadline = time.monotonic() + 60  # the cancel reaches the engine at once; a loaded machine is slow
    while True:
        s = get_stats(server.address, "decode")
        if (s.free_blocks == server.start_free and s.num_running == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert s.free_blocks == server.start_free and s.num_running == 0


def test_bench_against_colocated(server, tmp_path, capsys) -> None:
    from pdserve.app.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "--router", server.address, "--rate", "50", "--num-requests", "6", "--input-len",
                 "uniform:8:40", "--output-len", "4", "--ttft-slo-ms", "60000", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["num_ok"] == 6 and summary["goodput"] > 0
    assert summary["output_token_throughput"] > 0 and summary["ttft_ms"]["p50"] > 0
    assert "ttft_ms" in capsys.readouterr().out
    assert main(["bench", "--router", server.address, "--sessions", "2", "--turns", "2", "--input-len", "10",
                 "--output-len", "3", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["num_ok"] == 4


def test_async_engine_stream_cancel_and_idle(make_checkpoint) -> None:
    from engine.async_engine import AsyncEngine
    from engine.engine import EngineConfig, LLMEngine
    from pdserve.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(make_checkpoint("llama")), num_blocks=64, device="cpu"))
    start_free = engine.num_free_blocks
    want = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=5))[0]

    async def scenario() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        got = []
        async for out in ae.generate("a", [5, 6, 7], SamplingParams(max_tokens=5)):
            got.extend(out.new_token_ids)
        assert got == want
        # consumer goes away after one token: the request is aborted and its blocks come back
        agen = ae.generate("b", [5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True))
        await agen.__anext__()
        await agen.aclose()
        out, table = await ae.prefill("c", list(range(5, 40)), SamplingParams(max_tokens=4))
        assert out.finish_reason == "prefilled" and len(table) == 3
        await ae.release("c")
        # The engine thread refreshes its snapshot after the release's future resolves: wait for it.
        deadline = time.monotonic() + 30
        while (ae.snapshot.num_streams or engine.has_unfinished()) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert ae.snapshot.num_streams == 0 and not engine.has_unfinished()
        assert engine.num_free_blocks == start_free
        await ae.stop()

    asyncio.run(scenario())
    assert engine.leak_report() is None


def test_sigterm_drains_in_flight_request_then_exits_0(make_checkpoint, tmp_path) -> None:
    """SIGTERM while a request streams; it still completes, exit code 0. Its own server: the module's
    one serves the other tests in whatever order they run."""
    import signal

    proc = colocated(make_checkpoint("llama"), log_path=tmp_path / "colocated.log")
    try:
        with Client(proc.address, timeout=120) as c:
            stream = c.stream(prompt_ids=prompts()[3], max_tokens=200, ignore_eos=True)
            got = len(next(stream).token_ids)
            proc.proc.send_signal(signal.SIGTERM)
            for msg in stream:
                got += len(msg.token_ids)
                last = msg
        assert got == 200 and last.final.finish_reason == "length"
        assert proc.proc.wait(60) == 0
        assert "draining" in open(proc.log_path).read()
    finally:
        proc.kill()


def test_boot_report_every_phase_serving_last(server) -> None:
    """The worker's own boot report (Process/GetProcessStats): every phase timed, and SERVING marked
    only after the weights and the KV cache were ready (the other tests serve from it then)."""
    from pdserve.v1 import process_pb2, process_pb2_grpc

    with grpc.insecure_channel(server.address) as ch:
        s = process_pb2_grpc.ProcessStub(ch).GetProcessStats(process_pb2.ProcessStatsRequest(), timeout=10)
    phases = {p.name: p for p in s.boot}
    assert {"start_to_first_phase", "load_weights", "kv_cache_alloc", "serving"} <= set(phases)
    timed = [p for n, p in phases.items() if n not in ("serving", "start_to_first_phase")]
    assert phases["start_to_first_phase"].seconds == pytest.approx(min(p.start_s for p in timed), abs=1e-3)
    assert phases["serving"].start_s >= max(p.start_s + p.seconds for p in timed)
    assert s.serving_after_s == pytest.approx(phases["serving"].start_s, abs=1e-3)
    assert s.cpu_seconds > 0 and s.uptime_s >= s.serving_after_s
