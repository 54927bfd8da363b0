"""Every process reports its own CPU and boot phases over gRPC; `pdserve bench` turns two reads
around a load into CPU per request / per output token per process and role."""

import asyncio
import os

import grpc
import pytest

from pdserve import process_stats
from pdserve.app.loadgen import cpu
from pdserve.server import GrpcServer
from pdserve.v1 import process_pb2, process_pb2_grpc

pytestmark = pytest.mark.timeout(60)


def burn_cpu(seconds: float = 0.03) -> None:
    """Compute until the process's CPU clock (10 ms ticks) has moved by ``seconds``: a fixed amount of
    work can finish inside one tick on a fast machine, and then the CPU reads do not differ."""
    start = process_stats.cpu_seconds()
    while process_stats.cpu_seconds() < start + seconds:
        sum(i * i for i in range(20_000))


def test_get_process_stats_reports_cpu_phases_and_serving():
    async def main():
        server = GrpcServer(host="127.0.0.1", port=0, service_full_names=[])
        port = await server.start()
        try:
            with process_stats.BOOT.phase("test_phase"):
                burn_cpu()  # some CPU inside the phase
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = process_pb2_grpc.ProcessStub(ch)
                before = await stub.GetProcessStats(process_pb2.ProcessStatsRequest(), timeout=5)
                assert before.serving_after_s == 0  # not SERVING yet
                await server.set_serving(True)
                burn_cpu()
                after = await stub.GetProcessStats(process_pb2.ProcessStatsRequest(), timeout=5)
        finally:
            await server.server.stop(None)
        assert after.pid == os.getpid() and after.rss_bytes > 0 and after.num_threads >= 1
        assert after.cpu_seconds > before.cpu_seconds > 0
        names = [p.name for p in after.boot]
        assert "test_phase" in names and "serving" in names
        phase = next(p for p in after.boot if p.name == "test_phase")
        assert phase.seconds > 0 and 0 <= phase.start_s <= after.serving_after_s <= after.uptime_s

    asyncio.run(main())


def test_report_per_process_role_and_cluster():
    before = {"router": {"role": "router", "pid": 1, "cpu_seconds": 10.0},
              "p0": {"role": "prefill", "pid": 2, "cpu_seconds": 5.0},
              "d0": {"role": "decode", "pid": 3, "cpu_seconds": 7.0},
              "d1": {"role": "decode", "pid": 4, "cpu_seconds": 1.0}}
    after = {"router": {"role": "router", "pid": 1, "cpu_seconds": 12.0},
             "p0": {"role": "prefill", "pid": 2, "cpu_seconds": 6.0},
             "d0": {"role": "decode", "pid": 3, "cpu_seconds": 11.0},
             "d1": {"role": "decode", "pid": 99, "cpu_seconds": 0.5}}  # restarted: not comparable
    summary = {"duration_s": 10.0, "num_ok": 100, "output_token_throughput": 1000.0}
    rep = cpu.report(before, after, summary)
    assert rep["not_measured"] == ["d1"]
    r = rep["processes"]["router"]
    assert r["cpu_ms_per_request"] == pytest.approx(20.0)  # 2 s over 100 requests
    assert r["cpu_us_per_output_token"] == pytest.approx(200.0)  # 2 s over 10k tokens
    assert rep["roles"]["decode"]["cpu_s"] == pytest.approx(4.0)
    assert rep["cluster"]["cpu_s"] == pytest.approx(7.0)
    # 0.7 cores at 1k output tokens/s
    assert rep["cluster"]["cores_per_1k_output_tok_s"] == pytest.approx(0.7)
    assert "cluster CPU cores per 1k output tokens/s: 0.70" in cpu.format_table(rep)


def test_every_sweep_point_carries_its_cpu(monkeypatch):
    """run_point reads every process before and after its load; the sweep's CPU table shows each point."""
    from pdserve.app.loadgen import sweep as sweep_mod
    from pdserve.app.loadgen.dist import parse_dist
    from pdserve.app.loadgen.runner import RunConfig
    from pdserve.app.loadgen.stats import Sample

    reads = iter([{"router": {"role": "router", "pid": 1, "cpu_seconds": 1.0}},
                  {"router": {"role": "router", "pid": 1, "cpu_seconds": 1.5}}])
    monkeypatch.setattr(cpu, "try_read", lambda router, backend, api_key: next(reads))

    async def fake_run(cfg, on_done=None):
        return [Sample(ok=True, ttft_s=0.01, itl_s=[0.005] * 9, tpot_s=0.005, e2e_s=0.06, output_tokens=10,
                       prompt_tokens=8) for _ in range(cfg.num_requests)], 2.0

    monkeypatch.setattr(sweep_mod, "run", fake_run)
    base = RunConfig(router="r", rate=1.0, num_requests=1, input_len=parse_dist("8"),
                     output_len=parse_dist("10"))
    point = sweep_mod.run_point(base, sweep_mod.SweepConfig(rates=(5.0,), seconds_per_rate=2.0), 5.0)
    router = point["cpu"]["processes"]["router"]
    assert router["cpu_ms_per_request"] == pytest.approx(50.0)  # 0.5 s over 10 requests
    assert router["cpu_us_per_output_token"] == pytest.approx(5000.0)  # over 100 tokens
    text = cpu.format_sweep({"m": {"points": [point]}})
    assert "router 0.25" in text and "5000.0" in text
    assert cpu.format_sweep({"m": {"points": [{k: v for k, v in point.items() if k != "cpu"}]}}) == ""
