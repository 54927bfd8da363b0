"""pdserve/server.py's keepalive settings: a frozen peer (SIGSTOP) is noticed by the ping, not waited on.

A frozen process keeps its TCP connection, so a call to it fails only when a keepalive ping goes
unanswered. With gRPC's defaults that took ~70 s (the ping's ack timeout is its own 1-minute default,
and an idle server answers pings it finds too frequent with GOAWAY "too_many_pings", after which the
client doubles its interval). Here a call to a frozen server, on a channel that was idle first, must
end UNAVAILABLE by the ping well before its own 40 s deadline.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.server import CHANNEL_OPTIONS

pytestmark = pytest.mark.timeout(120)

SERVER = textwrap.dedent("""
    import asyncio
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from pdserve.server import GRPC_OPTIONS

    class Slow(health_pb2_grpc.HealthServicer):
        async def Check(self, request, context):
            await asyncio.sleep(float(request.service or 0))
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def main():
        server = grpc.aio.server(options=GRPC_OPTIONS)
        health_pb2_grpc.add_HealthServicer_to_server(Slow(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(main())
""")


def test_a_call_to_a_frozen_server_ends_by_the_keepalive_ping_not_its_deadline():
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())

        async def main() -> grpc.aio.AioRpcError:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                await stub.Check(health_pb2.HealthCheckRequest(service="0"), timeout=30)
                await asyncio.sleep(12)  # idle past one keepalive interval: its pings must be accepted

                async def call():
                    return await stub.Check(health_pb2.HealthCheckRequest(service="1000"), timeout=40)

                pending = asyncio.create_task(call())
                await asyncio.sleep(0.5)
                os.kill(proc.pid, signal.SIGSTOP)
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await pending
                return exc.value

        err = asyncio.run(main())
        assert err.code() == grpc.StatusCode.UNAVAILABLE, (err.code(), err.details())
        assert "ping" in err.details()
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()
