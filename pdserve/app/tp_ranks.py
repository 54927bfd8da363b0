"""The processes of a tensor-parallel worker (``pdserve serve --tensor-parallel-size N``).

The serve process is rank 0: it owns gRPC, the KV link and the ``LLMEngine``. ``start_ranks``
hosts the group's rendezvous (a ``TCPStore`` on 127.0.0.1, all ranks run on this host) and starts
ranks 1..N-1 as child processes running this module's ``main``: each builds its ``TPGroup``, loads
its slice of the checkpoint and follows rank 0's steps (``engine.tp_worker.TPFollower``) until rank 0's
``LLMEngine.close()``. On CUDA rank r computes on ``cuda:r`` of the GPUs the launcher made visible
to the worker. A child whose parent dies exits by itself; ``TPRanks.stop`` waits for them (and
kills what does not leave).

The engine configuration travels to the children as JSON on the command line (plain values only).

Prefill and decode workers move KV per rank (kvtransfer/ranks): with a ``KVRankConfig`` every child
also starts its rank's ``RankAgent`` (its own transports over its own KV heads) and the KVRank
control service on 127.0.0.1, on an event loop thread beside the follower, and publishes both in the
rendezvous store (``kvrank/<r>``: control address, transport endpoints). Rank 0 builds its own agent,
reads the others' from the store and presents the worker as one KV link (``make_rank_link``). Under
``--tls-dir`` the config carries the directory and the worker's identity (its role) to every rank, and
each control service speaks mutual TLS with the cluster's CA (kvtransfer/ranks/control.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVRankConfig:
    """What every rank of a prefill / decode worker needs to run its KV agent (JSON-able)."""

    kind: str = "auto"
    options: dict = dataclasses.field(default_factory=dict)  # TransportConfig fields (kv_transport_options)
    source_tp: int = 0  # decode: the largest sender TP (WorkerShape.receiving)
    staging_blocks: int = 0
    # The cluster's TLS directory (--tls-dir; "" = plaintext) and the identity every rank's KVRank control
    # service presents and rank 0's client presents to it: the worker's role, as on its gRPC port
    tls_dir: str = ""
    tls_identity: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("auto", "nixl", "tcp") or self.source_tp < 0 or self.staging_blocks < 0:
            raise ValueError(f"bad KVRankConfig {self}")
        if bool(self.tls_dir) != bool(self.tls_identity):
            raise ValueError(f"KVRankConfig: tls_dir and tls_identity go together, got {self.tls_dir!r} and "
                             f"{self.tls_identity!r}")

    @classmethod
    def from_settings(cls, settings) -> KVRankConfig:
        from pdserve.settings import kv_transport_options

        options = kv_transport_options(settings)
        options["ucx_env"] = [list(kv) for kv in options.get("ucx_env", ())]
        tls_dir = str(settings.tls_dir or "")
        return cls(kind=settings.transport, options=options, source_tp=settings.kv_source_tp,
                   staging_blocks=settings.kv_staging_blocks, tls_dir=tls_dir,
                   tls_identity=settings.role if tls_dir else "")

    def control_tls(self) -> dict:
        """``serve_agent`` / ``RankClient`` keyword arguments: the cluster's TLS for the KVRank control
        service, or none (plaintext) without a TLS directory."""
        if not self.tls_dir:
            return {}
        from pdserve.tls import TlsDir

        return {"tls": TlsDir(self.tls_dir), "identity": self.tls_identity}

    def rank_options(self, rank: int) -> dict:
        """A fixed --kv-port P is rank 0's; rank r listens on P + r (0 stays 0: any free port)."""
        base = int(self.options.get("listen_port", 0))
        return {**self.options, "listen_port": base + rank if base else 0}

    def piece_port(self, rank: int, size: int) -> int:
        """Rank r's piece transport (a receiver taking pieces): P + size + r, so a worker's KV ports are
        the range [P, P + 2 * size) (what the chart's NetworkPolicy opens)."""
        base = int(self.options.get("listen_port", 0))
        return base + size + rank if base else 0

    def agent(self, *, layout, num_kv_heads: int, tp: int, rank: int, cache):
        from kvtransfer.ranks.agent import RankAgent
        from kvtransfer.ranks.shape import WorkerShape

        shape = WorkerShape.receiving(num_kv_heads=num_kv_heads, tp=tp, source_tp=self.source_tp)
        return RankAgent(layout=layout, shape=shape, rank=rank, cache=cache, kind=self.kind,
                         options=self.rank_options(rank), staging_blocks=self.staging_blocks,
                         piece_port=self.piece_port(rank, tp))


def pool_tp_args(*, prefill_tp: int, decode_tp: int, colocated: bool = False) -> tuple[list[str], list[str]]:
    """`pdserve serve` flags for a prefill pool and a decode (or colocated) pool of these TP sizes. A
    decode pool narrower than its prefill pool takes KV in pieces (``--kv-source-tp``,
    docs/tensor-parallel.md)."""
    if prefill_tp < 1 or decode_tp < 1:
        raise ValueError(f"tensor parallel sizes must be >= 1, got prefill {prefill_tp}, decode {decode_tp}")
    if colocated and prefill_tp != 1:
        raise ValueError("--prefill-tp needs a prefill pool; colocated workers take --decode-tp")
    prefill = ["--tensor-parallel-size", str(prefill_tp)] if prefill_tp > 1 else []
    decode = ["--tensor-parallel-size", str(decode_tp)] if decode_tp > 1 else []
    if prefill_tp > decode_tp and not colocated:
        decode += ["--kv-source-tp", str(prefill_tp)]
    return prefill, decode


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device for a worker's ``device`` setting (``cpu``, ``cuda``, ``auto``)."""
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    return f"cuda:{rank}"


@dataclasses.dataclass
class TPRanks:
    """Rank 0's group and the child processes of ranks 1..N-1."""

    group: object  # engine.tp_group.TPGroup
    procs: list[subprocess.Popen]
    store: object  # keeps the rendezvous alive while the group lives

    def kv_agent_info(self, rank: int) -> dict:
        """Rank ``rank``'s published KV agent: {"control": host:port, "endpoint", "view"} (blocks until
        the rank has started it)."""
        return json.loads(self.store.get(f"kvrank/{rank}"))

    def stop(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor parallel rank (pid %d) did not stop: killing it", proc.pid)
                proc.kill()
                proc.wait()


def start_ranks(engine_config, size: int, kv: KVRankConfig | None = None) -> TPRanks:
    """Host the rendezvous, start ranks 1..size-1 (each with its KV agent when ``kv`` is given), return
    rank 0's ``TPGroup`` (blocks until every rank has joined the group)."""
    from engine.tp_group import TPGroup

    store = TPGroup.tcp_store(host="127.0.0.1", port=0, rank=0, size=size)
    payload = json.dumps(dataclasses.asdict(engine_config))
    extra = ["--kv-config", json.dumps(dataclasses.asdict(kv))] if kv is not None else []
    procs = [subprocess.Popen([sys.executable, "-m", "pdserve.app.tp_ranks", "--rank", str(r), "--size",
                               str(size), "--store-port", str(store.port), "--parent-pid", str(os.getpid()),
                               "--engine-config", payload, *extra])
             for r in range(1, size)]
    try:
        group = TPGroup(rank=0, size=size, store=store, device=rank_device(engine_config.device, 0))
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    return TPRanks(group=group, procs=procs, store=store)


async def make_rank_link(settings, engine, *, own_loop: bool = False):
    """Rank 0's KV link (kvtransfer.ranks.link.RankedLink) for a prefill / decode worker at any TP size:
    its own agent over ``engine.kv_cache``, the other ranks' through their control services.

    ``own_loop``: rank 0's agent (and its control service) runs on an event loop of its own thread
    (kvtransfer/ranks/agent_thread.py), not on this one, which serves the worker's gRPC streams."""
    from kvtransfer.ranks.agent_thread import ThreadedAgent, own_copy_stream
    from kvtransfer.ranks.control import RankClient, serve_agent
    from kvtransfer.ranks.link import RankedLink

    kv = KVRankConfig.from_settings(settings)
    tls = kv.control_tls()
    ranks: TPRanks | None = getattr(engine, "tp_ranks", None)
    size = ranks.group.size if ranks is not None else 1
    layout = engine.kv_layout

    made: dict = {}

    async def setup():  # on the loop the agent lives on
        cache = engine.kv_cache
        if own_loop:
            own_copy_stream(cache.device)
        agent = kv.agent(layout=layout, num_kv_heads=layout.num_kv_heads, tp=size, rank=0, cache=cache)
        await agent.start()
        try:
            server, made["port"] = await serve_agent(agent, **tls)
        except BaseException:
            await agent.close()
            raise
        return agent, [lambda: server.stop(0)]

    if own_loop:
        local = await ThreadedAgent.start(setup, name="kv-rank0")
        agent, closers = local.agent, []  # the control service stops on the agent's loop, at its close
    else:
        agent, closers = await setup()
        local = agent
    endpoint, view = agent.endpoints()
    members, endpoints, views = [local], [endpoint], [view]
    controls = [f"127.0.0.1:{made['port']}"]
    for r in range(1, size):
        info = await asyncio.to_thread(ranks.kv_agent_info, r)
        members.append(RankClient(r, info["control"], **tls))
        endpoints.append(info["endpoint"])
        views.append(info.get("view"))
        controls.append(info["control"])
    link = RankedLink(ranks=members, layout=layout, shape=agent.shape, lease_s=settings.lease_ms / 1000.0)
    link.set_rank_endpoints(endpoints, views)
    link.closers.extend(closers)
    log.info("KV ranks: %s; control %s (%s); rank 0 on %s", agent.shape.describe(), " ".join(controls),
             "mutual TLS" if tls else "plaintext",
             "an event loop of its own" if own_loop else "the worker's event loop")
    return link


def _serve_kv_rank(follower, group, kv: KVRankConfig, store):
    """Start this rank's KV agent and KVRank service on an event loop thread and publish them in the
    store; returns a function that stops them (after the follower left its loop)."""
    from kvtransfer.ranks.agent_thread import own_copy_stream
    from kvtransfer.ranks.control import serve_agent

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict = {}
    layout = follower.kv_layout

    async def start() -> None:
        own_copy_stream(follower.kv_cache.device)
        agent = kv.agent(layout=layout, num_kv_heads=layout.num_kv_heads, tp=group.size, rank=group.rank,
                         cache=follower.kv_cache)
        await agent.start()
        state["agent"] = agent
        state["server"], state["port"] = await serve_agent(agent, **kv.control_tls())

    async def stop() -> None:
        await state["server"].stop(0)
        await state["agent"].close()

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(start())
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            state["error"] = exc
            ready.set()
            return
        ready.set()
        loop.run_forever()
        loop.run_until_complete(stop())
        loop.close()

    thread = threading.Thread(target=run, name=f"kv-rank{group.rank}", daemon=True)
    thread.start()
    ready.wait()
    if "error" in state:
        raise state["error"]
    endpoint, view = state["agent"].endpoints()
    control = f"127.0.0.1:{state['port']}"
    store.set(f"kvrank/{group.rank}", json.dumps({"control": control, "endpoint": endpoint, "view": view}))
    log.info("KV rank %d: control %s (%s)", group.rank, control, "mutual TLS" if kv.tls_dir else "plaintext")

    def stop_all() -> None:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)

    return stop_all


def _exit_with_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.app.tp_ranks")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--engine-config", required=True)
    parser.add_argument("--kv-config", default="")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s tp-rank{args.rank} %(levelname)s %(message)s")
    threading.Thread(target=_exit_with_parent, args=(args.parent_pid,), daemon=True).start()

    from engine.engine_types import EngineConfig
    from engine.tp_group import TPGroup
    from engine.tp_worker import TPFollower

    fields = json.loads(args.engine_config)
    config = EngineConfig(**{**fields, "device": rank_device(fields["device"], args.rank)})
    store = TPGroup.tcp_store(host="127.0.0.1", port=args.store_port, rank=args.rank, size=args.size)
    group = TPGroup(rank=args.rank, size=args.size, store=store, device=config.device)
    follower = TPFollower(config, group)
    stop_kv = _serve_kv_rank(follower, group, KVRankConfig(**json.loads(args.kv_config)), store) \
        if args.kv_config else None
    try:
        follower.run()
    finally:
        if stop_kv is not None:
            stop_kv()
    # Rank 0 sent the stop and every step is done: leave without the interpreter's teardown. With decode
    # graphs captured, a rank on 2x H200 did not exit within TPRanks.stop's 30 s wait and was killed
    # (suspected: the NCCL communicator's teardown); nothing is left to flush but the logs.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
