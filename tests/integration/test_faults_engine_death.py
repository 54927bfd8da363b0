"""A worker whose engine thread dies stops serving for good and exits with status 1, so the launcher's
supervisor (or the kubelet) starts it again, instead of staying up NOT_SERVING a pool member short.

In-process: a colocated server (the full role wiring, no KV plane) whose engine's ``step`` is made to
raise once it serves; the request in flight fails with a clear status, and ``run_role`` returns 1
after its drain.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import process_stats
from pdserve.app.roles import run_role
from pdserve.probe import free_port
from pdserve.settings import ServeSettings
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.timeout(180)


def test_a_worker_whose_engine_thread_died_exits_with_status_1(make_checkpoint, monkeypatch) -> None:
    from engine.engine import LLMEngine

    model = make_checkpoint("llama")
    port = free_port()
    # the role marks this (the test's) process SERVING in its boot record: put it back afterwards, for
    # the tests that read the record of a process that never served
    monkeypatch.setattr(process_stats.BOOT, "serving_after_s", process_stats.BOOT.serving_after_s)
    monkeypatch.setattr(process_stats.BOOT, "_phases", list(process_stats.BOOT._phases))

    def crash(self):
        raise RuntimeError("injected: the device fell off the bus")

    async def main() -> int:
        settings = ServeSettings(role="colocated", model=str(model), host="127.0.0.1", port=port,
                                 device="cpu", num_blocks=64, drain_timeout=2.0)
        role = asyncio.create_task(run_role(settings))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            while True:
                assert not role.done(), role.exception()
                try:
                    got = await health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    if got.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(0.2)
            monkeypatch.setattr(LLMEngine, "step", crash)
            stub = router_pb2_grpc.RouterStub(ch)
            request = router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[5, 6, 7]), max_tokens=4)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Generate(request, timeout=60):
                    pass
            assert info.value.code() != grpc.StatusCode.DEADLINE_EXCEEDED, info.value.details()
        return await asyncio.wait_for(role, 60)

    assert asyncio.run(main()) == 1
