"""The local control channel between rank 0 of a tensor-parallel worker and its other ranks.

Each rank serves ``pdserve.v1.KVRank`` over its ``RankAgent`` on 127.0.0.1 (``serve_agent``); rank 0
reaches it through ``RankClient``, which has the agent's own async methods, so rank 0 drives its
local agent and the remote ones alike (``link.RankedLink``). The servicer only translates: errors
travel as gRPC statuses (the ``code`` of kvtransfer's errors) and come back as the same
``TransferError`` classes. Every call carries a deadline; a waiting call (WaitReceived, WaitSent)
gets the transfer's own plus a margin.

Under the cluster's TLS (``--tls-dir``, pdserve/tls.py) the service is mutual TLS like every other
internal port, though it binds loopback: otherwise any local process could drive a rank's agent (send
its KV blocks anywhere, abort transfers). The server presents the worker's certificate
(``<role>.crt``, the KV plane's too) and requires a client certificate signed by the cluster CA; rank 0's
client presents the same identity and asks for it as the server's name (``ssl_target_name_override``).
A plaintext client, or one with another CA's certificate, is refused in the handshake (UNAVAILABLE).
"""

from __future__ import annotations

import json

import grpc

from pdserve.tls import TlsDir, open_channel
from pdserve.v1 import kvrank_pb2 as pb
from pdserve.v1 import kvrank_pb2_grpc as pb_grpc

from ..errors import (
    InvalidTransfer,
    LayoutMismatch,
    PeerUnavailable,
    TransferAborted,
    TransferError,
    TransferTimeout,
    UnknownRequest,
)
from .agent import Order, RankAgent, order_from_wire

CALL_TIMEOUT_S = 30.0
WAIT_MARGIN_S = 30.0
_BY_CODE = {grpc.StatusCode.INVALID_ARGUMENT: InvalidTransfer,
            grpc.StatusCode.FAILED_PRECONDITION: LayoutMismatch,
            grpc.StatusCode.NOT_FOUND: UnknownRequest,
            grpc.StatusCode.UNAVAILABLE: PeerUnavailable,
            grpc.StatusCode.DEADLINE_EXCEEDED: TransferTimeout,
            grpc.StatusCode.ABORTED: TransferAborted}


class KVRankServicer(pb_grpc.KVRankServicer):
    def __init__(self, agent: RankAgent) -> None:
        self.agent = agent

    async def _run(self, context, coro):
        try:
            return await coro
        except TransferError as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INTERNAL), str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def Expect(self, request, context):
        await self._run(context, self.agent.expect(request.request_id, list(request.block_ids),
                                                   request.timeout_s or CALL_TIMEOUT_S))
        return pb.RankAck()

    async def WaitReceived(self, request, context):
        info = await self._run(context, self.agent.wait_received(request.request_id))
        return pb.RankDone(bytes=info["bytes"], backend=info["backend"])

    async def Release(self, request, context):
        self.agent.release(request.request_id)
        return pb.RankAck()

    async def Abort(self, request, context):
        safe = await self.agent.abort(request.request_id, request.reason or "aborted")
        return pb.RankAbortResponse(safe=safe)

    async def Send(self, request, context):
        orders = [order_from_wire(p.endpoint, p.key, list(p.dst), (p.head_start, p.head_end))
                  for p in request.pieces]
        await self._run(context, self.agent.send(request.request_id, list(request.src), orders,
                                                 streamed=request.streamed,
                                                 timeout_s=request.timeout_s or CALL_TIMEOUT_S))
        return pb.RankAck()

    async def Push(self, request, context):
        await self._run(context, self.agent.push(request.request_id, list(request.layers), request.final))
        return pb.RankAck()

    async def WaitSent(self, request, context):
        info = await self._run(context, self.agent.wait_sent(request.request_id))
        return pb.RankDone(bytes=info["bytes"], backend=info["backend"])

    async def CloseSend(self, request, context):
        await self.agent.close_send(request.request_id, request.reason or "closed")
        return pb.RankAck()

    async def Stats(self, request, context):
        return pb.RankStats(counts=self.agent.stats())


async def serve_agent(agent: RankAgent, host: str = "127.0.0.1", *, tls: TlsDir | None = None,
                      identity: str = "") -> tuple[grpc.aio.Server, int]:
    """Start the KVRank service over ``agent`` on ``host`` (a free port); returns (server, port). With
    ``tls``: presents ``identity``'s certificate and admits only clients with one of the cluster CA."""
    if tls is not None and not identity:
        raise ValueError("a KVRank service under TLS needs the worker's identity (its role)")
    server = grpc.aio.server()
    pb_grpc.add_KVRankServicer_to_server(KVRankServicer(agent), server)
    if tls is None:
        port = server.add_insecure_port(f"{host}:0")
    else:
        port = server.add_secure_port(f"{host}:0", tls.server_credentials(identity, require_client_cert=True))
    await server.start()
    return server, port


class RankClient:
    """Another rank's agent, through its KVRank service (the agent's async surface). With ``tls``: mutual
    TLS, presenting ``identity`` and expecting the service to hold a certificate for it too."""

    def __init__(self, rank: int, address: str, *, tls: TlsDir | None = None, identity: str = "") -> None:
        if tls is not None and not identity:
            raise ValueError("a KVRank client under TLS needs the worker's identity (its role)")
        self.rank = rank
        self.address = address
        self.channel = open_channel(address, tls=tls, identity=identity or None, server_role=identity,
                                    aio=True)
        self.stub = pb_grpc.KVRankStub(self.channel)

    async def _call(self, method, request, timeout: float = CALL_TIMEOUT_S):
        try:
            return await method(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            cls = _BY_CODE.get(exc.code(), TransferError)
            raise cls(f"rank {self.rank}: {exc.details()}") from None

    async def expect(self, request_id: str, block_ids: list[int], timeout_s: float) -> None:
        await self._call(self.stub.Expect, pb.RankExpectRequest(request_id=request_id, block_ids=block_ids,
                                                                timeout_s=timeout_s))

    async def wait_received(self, request_id: str, timeout_s: float = CALL_TIMEOUT_S) -> dict:
        done = await self._call(self.stub.WaitReceived, pb.RankRequestId(request_id=request_id),
                                timeout_s + WAIT_MARGIN_S)
        return {"bytes": done.bytes, "backend": done.backend}

    async def release(self, request_id: str) -> None:
        await self._call(self.stub.Release, pb.RankRequestId(request_id=request_id))

    async def abort(self, request_id: str, reason: str = "aborted") -> bool:
        res = await self._call(self.stub.Abort, pb.RankAbortRequest(request_id=request_id, reason=reason))
        return res.safe

    async def send(self, request_id: str, src: list[int], orders: list[Order], *, streamed: bool,
                   timeout_s: float) -> None:
        pieces = [pb.RankPiece(endpoint=json.dumps(o.endpoint, separators=(",", ":")).encode(), key=o.key,
                               dst=o.dst, head_start=o.heads[0], head_end=o.heads[1]) for o in orders]
        await self._call(self.stub.Send, pb.RankSendRequest(request_id=request_id, src=src, pieces=pieces,
                                                            streamed=streamed, timeout_s=timeout_s),
                         timeout_s + WAIT_MARGIN_S)

    async def push(self, request_id: str, layers: list[int], final: bool) -> None:
        await self._call(self.stub.Push, pb.RankPushRequest(request_id=request_id, layers=layers,
                                                            final=final))

    async def wait_sent(self, request_id: str, timeout_s: float = CALL_TIMEOUT_S) -> dict:
        done = await self._call(self.stub.WaitSent, pb.RankRequestId(request_id=request_id),
                                timeout_s + WAIT_MARGIN_S)
        return {"bytes": done.bytes, "backend": done.backend}

    async def close_send(self, request_id: str, reason: str = "closed") -> None:
        await self._call(self.stub.CloseSend, pb.RankAbortRequest(request_id=request_id, reason=reason))

    async def stats(self) -> dict[str, int]:
        return dict((await self._call(self.stub.Stats, pb.RankStatsRequest())).counts)

    async def close(self) -> None:
        await self.channel.close()
