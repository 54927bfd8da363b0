"""A whole cluster on this host as plain processes, for tests and benchmarks.

    with LocalCluster(model_dir, prefill=1, decode=1, transport="tcp", run_dir=tmp) as c:
        Client(c.router).generate(prompt="hi")
        assert c.free_blocks() == start

Wraps ``Cluster`` + ``ProcessBackend`` (the same code `pdserve up --launcher process` runs) and adds
direct GetStats access to every worker for leak checks. ``colocated(...)`` starts one colocated
server the same way.
"""

from __future__ import annotations

import time
from pathlib import Path

from pdserve.app.launcher.backends import ProcessBackend, WorkerHandle
from pdserve.app.launcher.cluster import Cluster, ClusterSpec
from pdserve.app.launcher.procs import ServeProcess, spawn
from pdserve.app.launcher.supervisor import RestartPolicy
from pdserve.settings import ucx_tls_for_tests
from pdserve.tls import TlsDir, open_channel
from pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

QUIET_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def get_stats(address: str, role: str, timeout: float = 10.0, tls_dir: str = "") -> common_pb2.WorkerStats:
    tls = TlsDir(tls_dir) if tls_dir else None
    with open_channel(address, tls=tls, identity="client", server_role=role) as ch:
        stub = prefill_pb2_grpc.PrefillStub(ch) if role == "prefill" else decode_pb2_grpc.DecodeStub(ch)
        return stub.GetStats(common_pb2.StatsRequest(), timeout=timeout)


class LocalCluster:
    def __init__(self, model: str | Path, *, prefill: int = 1, decode: int = 1, transport: str = "tcp",
                 run_dir: str | Path, worker_args: tuple[str, ...] = ("--num-blocks", "256"),
                 env: dict[str, str] | None = None, policy: str = "round_robin",
                 drain_timeout: float = 10.0, router_args: tuple[str, ...] = (),
                 colocated: bool = False, prefill_args: tuple[str, ...] = (),
                 decode_args: tuple[str, ...] = (), http_port: int = 0, api_keys: tuple[str, ...] = (),
                 api_keys_file: str = "", restart: RestartPolicy | None = None, tls_dir: str = "",
                 zygote: bool = False, metrics_port: int = 0) -> None:
        # colocated=True: ``decode`` colocated workers behind the router (``prefill`` must be 0)
        self.spec = ClusterSpec(model=str(model), num_prefill=prefill, num_decode=decode, transport=transport,
                                worker_args=tuple(worker_args), policy=policy, drain_timeout=drain_timeout,
                                router_args=("--stats-interval", "0.2", *router_args), colocated=colocated,
                                prefill_args=tuple(prefill_args), decode_args=tuple(decode_args),
                                http_port=http_port, api_keys=tuple(api_keys), api_keys_file=api_keys_file,
                                restart=restart or RestartPolicy(), tls_dir=str(tls_dir or ""),
                                metrics_port=metrics_port)
        self.env = {**QUIET_ENV, **(env or {})}
        # zygote: fork every process from one that imported torch and pdserve (`pdserve up`'s default)
        self.cluster = Cluster(spec=self.spec, backend=ProcessBackend(Path(run_dir), self.env, zygote=zygote),
                               run_dir=Path(run_dir))
        self.router = ""
        self.http = ""  # HOST:PORT of the router's HTTP door, when http_port is set

    def __enter__(self) -> LocalCluster:
        try:
            self.router = self.cluster.up()
            self.http = self.cluster.http_address
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self.cluster.down()

    @property
    def workers(self) -> list[WorkerHandle]:
        return [h for hs in self.cluster.workers.values() for h in hs]

    def stats(self) -> dict[str, common_pb2.WorkerStats]:
        return {h.worker_id: get_stats(h.address, self.cluster._serve_role(h.role), tls_dir=self.spec.tls_dir)
                for h in self.workers if h.alive()}

    def free_blocks(self) -> dict[str, int]:
        return {wid: s.free_blocks for wid, s in self.stats().items()}

    def wait_idle(self, expected_free: dict[str, int],
                  timeout: float = 30.0) -> dict[str, common_pb2.WorkerStats]:
        """Poll until every worker is back to ``expected_free`` with nothing running/leased; return stats."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            ok = all(stats[w].free_blocks == n and stats[w].num_running == 0 and stats[w].num_leased == 0
                     and stats[w].queue_depth == 0 for w, n in expected_free.items() if w in stats)
            if ok or time.monotonic() > deadline:
                return stats
            time.sleep(0.2)

    def kill(self, worker: WorkerHandle) -> None:
        """SIGKILL a worker (no drain): simulates a crashed process."""
        worker.ref.kill()


def colocated(model: str | Path, *, log_path: str | Path, args: tuple[str, ...] = ("--num-blocks", "256"),
              env: dict[str, str] | None = None) -> ServeProcess:
    return spawn("colocated", ["--model", str(model), *args], log_path, env={**QUIET_ENV, **(env or {})})


def ucx_tcp_env() -> dict[str, str]:
    """NIXL over UCX restricted to TCP: simulated RDMA on a machine without an RDMA NIC."""
    return {"UCX_TLS": ucx_tls_for_tests()}
