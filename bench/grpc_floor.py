"""The gRPC floor under the router: what a bare relay of the same RPCs costs, with none of our logic.

Per client ``Generate`` the relay does what the router's request path does on the wire: ``Allocate``
(unary) and ``Decode`` (a server stream) on a decode worker, ``Prefill`` (unary) on a prefill worker,
and it streams to the client one message per message the decode stream sends (first token first, the
last with ``FinalInfo``). The workers answer at once from another process; the client runs in a third,
at a fixed rate (Poisson arrivals) or flat out. The relay's own CPU seconds (all threads: the event
loop, gRPC's C-core ``event_engine`` threads, the asyncio poller), read from /proc before and after
the load, divided by the requests and by the relayed messages, are the floor that
``bench.relay_cpu``'s router figures compare with: the router's CPU per request minus this is what our
code costs on top of gRPC.

    python -m bench.grpc_floor [--rates 40,200,0] [--tokens 2,129] [--requests 300] [--relays aio,uvloop,sync]
                               [--json OUT]

``--rates 0`` is flat out (8 requests in flight). ``--relays aio,sync`` runs the same relay on grpc's
asyncio server (the router's) and on its synchronous thread-pool server, side by side at each rate.
Two ``--tokens`` values give the per-message cost: (CPU at the larger - CPU at the smaller) / (the
difference in messages). ``--rpc-shapes`` also times
the client side of single RPC shapes flat out (a unary call, a one-message server stream, a
bidirectional stream of one and of two exchanges) against grpc's health and reflection services: what
merging two calls into one stream would save.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import time

import grpc

from bench.relay_cpu import proc_cpu_s, thread_cpu_s
from pdserve import event_loop
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)


class _Decode(decode_pb2_grpc.DecodeServicer):
    async def Allocate(self, request, context):
        return decode_pb2.AllocateResponse(worker_id="d", block_ids=list(range(8)), transports=["tcp"])

    async def Decode(self, request, context):
        n = int(request.kv_wait_ms)  # (the relay passes the answer's length here)
        for i in range(1, n):
            last = i == n - 1
            yield decode_pb2.DecodeResponse(token_ids=[i], completion_tokens=i + 1,
                                            finish_reason="length" if last else "")


class _Prefill(prefill_pb2_grpc.PrefillServicer):
    async def Prefill(self, request, context):
        return prefill_pb2.PrefillResponse(first_token_id=0)


class _Relay(router_pb2_grpc.RouterServicer):
    def __init__(self, port: int) -> None:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.decode = decode_pb2_grpc.DecodeStub(channel)
        self.prefill = prefill_pb2_grpc.PrefillStub(channel)

    async def Generate(self, request, context):
        rid, ids = request.request_id, list(request.token_ids.ids)
        alloc = await self.decode.Allocate(decode_pb2.AllocateRequest(request_id=rid, prompt_ids=ids),
                                           timeout=30)
        first = await self.prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id=rid, prompt_ids=ids, target=prefill_pb2.KVTarget(block_ids=list(alloc.block_ids))),
            timeout=30)
        yield router_pb2.GenerateResponse(request_id=rid, token_ids=[first.first_token_id])
        call = self.decode.Decode(decode_pb2.DecodeRequest(
            request_id=rid, first_token_id=first.first_token_id, kv_wait_ms=request.max_tokens), timeout=30)
        async for msg in call:
            out = router_pb2.GenerateResponse(request_id=rid, token_ids=list(msg.token_ids))
            if msg.finish_reason:
                out.final.finish_reason = msg.finish_reason
                out.final.usage.completion_tokens = msg.completion_tokens
            yield out


class _SyncRelay(router_pb2_grpc.RouterServicer):
    """The same relay on grpc's synchronous server (a thread per call from a pool) and stubs."""

    def __init__(self, port: int) -> None:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.decode = decode_pb2_grpc.DecodeStub(channel)
        self.prefill = prefill_pb2_grpc.PrefillStub(channel)

    def Generate(self, request, context):
        rid, ids = request.request_id, list(request.token_ids.ids)
        alloc = self.decode.Allocate(decode_pb2.AllocateRequest(request_id=rid, prompt_ids=ids), timeout=30)
        first = self.prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id=rid, prompt_ids=ids, target=prefill_pb2.KVTarget(block_ids=list(alloc.block_ids))),
            timeout=30)
        yield router_pb2.GenerateResponse(request_id=rid, token_ids=[first.first_token_id])
        stream = self.decode.Decode(decode_pb2.DecodeRequest(
            request_id=rid, first_token_id=first.first_token_id, kv_wait_ms=request.max_tokens), timeout=30)
        for msg in stream:
            out = router_pb2.GenerateResponse(request_id=rid, token_ids=list(msg.token_ids))
            if msg.finish_reason:
                out.final.finish_reason = msg.finish_reason
                out.final.usage.completion_tokens = msg.completion_tokens
            yield out


def _serve(kind: str, arg: int, ports: multiprocessing.Queue) -> None:
    if kind == "sync-relay":
        from concurrent import futures  # noqa: PLC0415

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        router_pb2_grpc.add_RouterServicer_to_server(_SyncRelay(arg), server)
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        server.start()
        server.wait_for_termination()
        return

    async def main() -> None:
        server = grpc.aio.server()
        if kind == "workers":
            decode_pb2_grpc.add_DecodeServicer_to_server(_Decode(), server)
            prefill_pb2_grpc.add_PrefillServicer_to_server(_Prefill(), server)
        else:
            router_pb2_grpc.add_RouterServicer_to_server(_Relay(arg), server)
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    # the uvloop relay: the same code on the loop the router runs on by default (pdserve/event_loop.py)
    event_loop.run(main(), "uvloop" if kind == "uvloop-relay" else "asyncio")


async def _load(port: int, rate: float, requests: int, tokens: int, relay_pid: int) -> dict:
    stub = router_pb2_grpc.RouterStub(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
    got = [0]

    async def one(i: int) -> None:
        req = router_pb2.GenerateRequest(request_id=f"r{i}", max_tokens=tokens,
                                         token_ids=common_pb2.TokenIds(ids=list(range(64))))
        async for msg in stub.Generate(req):
            got[0] += len(msg.token_ids)

    for i in range(50):  # warm-up: channels, first-call costs
        await one(-i - 1)
    got[0] = 0
    cpu0, threads0, t0 = proc_cpu_s(relay_pid), thread_cpu_s(relay_pid), time.monotonic()
    if rate:
        rng, tasks = random.Random(0), []
        for i in range(requests):
            tasks.append(asyncio.ensure_future(one(i)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    else:
        requests -= requests % 8

        async def worker(k: int) -> None:
            for j in range(requests // 8):
                await one(k * requests + j)
        await asyncio.gather(*(worker(k) for k in range(8)))
    wall = time.monotonic() - t0
    cpu, threads = proc_cpu_s(relay_pid) - cpu0, thread_cpu_s(relay_pid)
    if got[0] != requests * tokens:
        raise RuntimeError(f"relayed {got[0]} tokens, expected {requests * tokens}")
    return {"rate": rate, "tokens": tokens, "requests": requests, "achieved_rate": round(requests / wall, 1),
            "cpu_ms_per_request": round(cpu / requests * 1e3, 3),
            "threads_ms_per_request": {k: round((v - threads0.get(k, 0.0)) / requests * 1e3, 3)
                                       for k, v in sorted(threads.items()) if v - threads0.get(k, 0.0) > 0}}


def _shapes_server(ports: multiprocessing.Queue) -> None:
    from grpc_health.v1 import health, health_pb2_grpc  # noqa: PLC0415
    from grpc_reflection.v1alpha import reflection  # noqa: PLC0415

    async def main() -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        reflection.enable_server_reflection(["grpc.health.v1.Health", reflection.SERVICE_NAME], server)
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


async def _rpc_shapes(port: int, n: int) -> dict:
    """Client CPU per call of each RPC shape, 8 in flight (this process's CPU: the server is another)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc  # noqa: PLC0415

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    hc, rs = health_pb2_grpc.HealthStub(channel), reflection_pb2_grpc.ServerReflectionStub(channel)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")

    async def unary() -> None:
        await hc.Check(health_pb2.HealthCheckRequest())

    async def stream_one() -> None:
        call = hc.Watch(health_pb2.HealthCheckRequest())
        await call.read()
        call.cancel()

    async def bidi(exchanges: int) -> None:
        call = rs.ServerReflectionInfo()
        for _ in range(exchanges):
            await call.write(ask)
            await call.read()
        await call.done_writing()
        await call.code()

    shapes = {"unary": unary, "server_stream_1": stream_one,
              "bidi_1_exchange": lambda: bidi(1), "bidi_2_exchanges": lambda: bidi(2)}
    out = {}
    for name, fn in shapes.items():
        for _ in range(50):
            await fn()
        cpu0 = proc_cpu_s(os.getpid())

        async def worker(fn=fn) -> None:
            for _ in range(n // 8):
                await fn()
        await asyncio.gather(*(worker() for _ in range(8)))
        out[name] = round((proc_cpu_s(os.getpid()) - cpu0) / (n // 8 * 8) * 1e3, 3)
    return out



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="40,200,0", help="requests/s per row; 0 = flat out (8 in flight)")
    ap.add_argument("--tokens", default="2,129", help="tokens per answer (one message each)")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--json", default="")
    ap.add_argument("--relays", default="aio",
                    help="which relays, side by side: aio (grpc.aio on asyncio's loop), uvloop (grpc.aio "
                    "on uvloop, as the router by default) and/or sync (grpc's thread-pool server and "
                    "blocking stubs)")
    ap.add_argument("--rpc-shapes", type=int, default=0, metavar="N",
                    help="also time N calls of each single RPC shape (client CPU ms per call)")
    args = ap.parse_args()
    ports: multiprocessing.Queue = multiprocessing.Queue()
    procs = [multiprocessing.Process(target=_serve, args=("workers", 0, ports), daemon=True)]
    procs[0].start()
    workers_port = ports.get(timeout=30)
    relays = {}
    for name in args.relays.split(","):
        kind = {"aio": "relay", "uvloop": "uvloop-relay", "sync": "sync-relay"}[name]
        procs.append(multiprocessing.Process(target=_serve, args=(kind, workers_port, ports), daemon=True))
        procs[-1].start()
        relays[name] = (ports.get(timeout=30), procs[-1].pid)
    rows = []
    try:
        for rate in (float(r) for r in args.rates.split(",")):
            for name, (relay_port, relay_pid) in relays.items():  # side by side at each rate
                level = [asyncio.run(_load(relay_port, rate, args.requests, int(t), relay_pid))
                         for t in args.tokens.split(",")]
                lo, hi = level[0], level[-1]
                for row in level:
                    row["relay"] = name
                if hi["tokens"] > lo["tokens"]:
                    per = ((hi["cpu_ms_per_request"] - lo["cpu_ms_per_request"])
                           / (hi["tokens"] - lo["tokens"]))
                    for row in level:
                        row["cpu_us_per_relayed_message"] = round(per * 1e3, 1)
                rows.extend(level)
    finally:
        for p in procs:
            p.terminate()
    shapes = None
    if args.rpc_shapes:
        proc = multiprocessing.Process(target=_shapes_server, args=(ports,), daemon=True)
        proc.start()
        try:
            shapes = asyncio.run(_rpc_shapes(ports.get(timeout=30), args.rpc_shapes))
        finally:
            proc.terminate()
        print("client CPU ms per call, 8 in flight: " + ", ".join(f"{k} {v}" for k, v in shapes.items()))
    print(f"{'relay':>5} {'rate':>6} {'tokens':>6} {'req/s':>7} {'ms/req':>7} {'us/msg':>7}  "
          "by thread (ms/req)")
    for r in rows:
        print(f"{r['relay']:>5} {r['rate'] or 'max':>6} {r['tokens']:>6} {r['achieved_rate']:>7} "
              f"{r['cpu_ms_per_request']:>7} {r.get('cpu_us_per_relayed_message', '-'):>7}  "
              + ", ".join(f"{k} {v}" for k, v in r["threads_ms_per_request"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python -m bench.grpc_floor " + " ".join(
                f"--{k} {v}" for k, v in vars(args).items() if k != "json"), "cpus": os.cpu_count(),
                "rows": rows, **({"rpc_shapes_client_ms": shapes} if shapes else {})}, f, indent=1)


if __name__ == "__main__":
    main()
