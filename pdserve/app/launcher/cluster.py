"""The cluster controller behind `pdserve up`: pools of workers, a router, a state directory.

Lifecycle::

    up()      start N prefill + M decode workers (or M colocated workers, ``colocated=True``: the
              router then runs ``--mode colocated`` and every request prefills where it decodes)
              in parallel (Ray actors or processes), each on its own GPU(s) per ``devices``
              (launcher/devices.py); each is healthy once it prints its ready line (model loaded,
              KV transport up, SERVING). Write run_dir/workers.json, start the router with
              ``--discovery file`` on it, wait until the router sees every worker healthy
              (ListWorkers), write run_dir/state.json.
    serve()   loop until SIGTERM/SIGINT or `pdserve down`; apply scale requests that `pdserve scale`
              drops into run_dir/scale-request.json.
    scale()   grow: start workers, then add them to workers.json (the router picks them up);
              shrink: drop them from workers.json first, wait until the router no longer lists them
              and they are idle, then drain them (SIGTERM) — requests in flight are not cut.
    down()    stop the router, then every worker (graceful drain), shut Ray down, remove state.json.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.app.launcher.backends import WorkerHandle
from pdserve.app.launcher.devices import DeviceAssigner, DevicePlan
from pdserve.app.launcher.liveness import answers
from pdserve.app.launcher.metrics_ports import MetricsPorts
from pdserve.app.launcher.procs import StartFailed
from pdserve.app.launcher.supervisor import RestartPolicy, Supervisor
from pdserve.settings import DEFAULT_DRAIN_TIMEOUT_S
from pdserve.tls import TlsDir, open_channel
from pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc, router_pb2, router_pb2_grpc
from router.file_discovery import write_workers_file

log = logging.getLogger(__name__)
STATE_FILE = "state.json"
WORKERS_FILE = "workers.json"
SCALE_FILE = "scale-request.json"


def per_worker_disk_dir(args: list[str], name: str) -> list[str]:
    """In a cluster, ``--kv-disk-dir DIR`` names where every worker keeps its disk KV tier: each in
    ``DIR/<worker name>``, so workers on one host never share one, and a restarted worker (same name)
    finds its blocks again."""
    out = list(args)
    for i, arg in enumerate(out[:-1]):
        if arg == "--kv-disk-dir":
            out[i + 1] = str(Path(out[i + 1]) / name)
    return out


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    model: str
    num_prefill: int = 1
    num_decode: int = 1
    transport: str = "auto"
    router_port: int = 0
    worker_args: tuple[str, ...] = ()
    # Extra flags per pool, after worker_args (the later flag wins): a compute-tuned prefill pool and a
    # memory-tuned decode pool. Colocated workers take the decode pool's.
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    policy: str = "prefix"
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S
    # num_decode colocated workers behind the router, no prefill pool (the baseline, same router)
    colocated: bool = False
    devices: DevicePlan = field(default_factory=DevicePlan)
    # the router's OpenAI-compatible HTTP port (0 = off) and API keys; the launcher presents the first
    # key (or the keys file's first line, read at each call: rotation) to its router
    http_port: int = 0
    api_keys: tuple[str, ...] = ()
    api_keys_file: str = ""
    # restart a process that exits unexpectedly (launcher/supervisor.py)
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    # TLS on every gRPC port (pdserve/tls.py: `pdserve certs init DIR`); "" = plaintext
    tls_dir: str = ""
    # the router's Prometheus port (0 = no metrics); with it every worker serves its metrics on a port
    # of its own, kept across its restarts, and the run directory holds a Prometheus file-based
    # service-discovery file of them all (PROMETHEUS_TARGETS)
    metrics_port: int = 0

    def __post_init__(self) -> None:
        if self.colocated and (self.num_prefill != 0 or self.num_decode < 1):
            raise ValueError("a colocated cluster has 0 prefill workers and at least 1 colocated worker")
        if not self.colocated and (self.num_prefill < 1 or self.num_decode < 1):
            raise ValueError("a cluster needs at least 1 prefill and 1 decode worker")
        if self.transport not in ("auto", "nixl", "tcp"):
            raise ValueError(f"--transport must be auto, nixl or tcp, got {self.transport!r}")


@dataclass
class Cluster:
    spec: ClusterSpec
    backend: object
    run_dir: Path
    workers: dict[str, list[WorkerHandle]] = field(default_factory=lambda: {"prefill": [], "decode": []})
    router: WorkerHandle | None = None
    _seq: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _devices: DeviceAssigner | None = None
    _supervisor: Supervisor | None = None
    _lock: threading.RLock = field(default_factory=threading.RLock)  # the member lists
    _metrics: MetricsPorts | None = None  # every process's metrics port (spec.metrics_port)
    # one scale() at a time: `pdserve scale` requests (serve()), the autoscaler's thread (planner/actuator.py)
    _scaling: threading.Lock = field(default_factory=threading.Lock)

    # ---- bring-up -------------------------------------------------------------------------------
    def up(self) -> str:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Names and devices are handed out here in launch order (prefill pool first), on this thread.
        launches = [(role, self._next_name(role)) for role, n in (("prefill", self.spec.num_prefill),
                                                                  ("decode", self.spec.num_decode))
                    for _ in range(n)]
        with ThreadPoolExecutor(max_workers=8) as pool:
            futs = [pool.submit(self._start_worker, role, name, self._next_devices(role))
                    for role, name in launches]
            for f in futs:
                h = f.result()
                self.workers[h.role].append(h)
        self._write_members()
        self.router = self.backend.start("router", self._router_args(self.spec.router_port), "router")
        self.wait_router_sees(timeout=120)
        self.write_state()
        self._supervisor = Supervisor(self, self.spec.restart)
        self._supervisor.start()
        return self.router.address

    def _router_args(self, port: int) -> list[str]:
        return ["--discovery", "file", "--workers-file", str(self.run_dir / WORKERS_FILE), "--model",
                self.spec.model, "--policy", self.spec.policy, "--port", str(port),
                "--drain-timeout", str(self.spec.drain_timeout),
                *(("--mode", "colocated") if self.spec.colocated else ()), *self._http_args(),
                *self.metrics.router_args(), *self._tls_args(), *self.spec.router_args]

    @property
    def metrics(self) -> MetricsPorts:
        if self._metrics is None:
            self._metrics = MetricsPorts(self.spec.metrics_port)
        return self._metrics

    def _tls_args(self) -> list[str]:
        return ["--tls-dir", self.spec.tls_dir] if self.spec.tls_dir else []

    def channel(self, address: str, server_role: str) -> grpc.Channel:
        """The launcher's own channel to a process of the cluster (TLS as the client identity)."""
        tls = TlsDir(self.spec.tls_dir) if self.spec.tls_dir else None
        return open_channel(address, tls=tls, identity="client", server_role=server_role)

    def _http_args(self) -> list[str]:
        args = ["--http-port", str(self.spec.http_port)] if self.spec.http_port else []
        for key in self.spec.api_keys:
            args += ["--api-key", key]
        if self.spec.api_keys_file:
            args += ["--api-keys-file", self.spec.api_keys_file]
        return args

    @property
    def http_address(self) -> str:
        """HOST:PORT of the router's HTTP door ("" when off)."""
        if not (self.spec.http_port and self.router):
            return ""
        return f"{self.router.address.rsplit(':', 1)[0]}:{self.spec.http_port}"

    def auth_metadata(self) -> list[tuple[str, str]]:
        """gRPC metadata the launcher sends its router: the API key, when the router takes keys."""
        from router.api_keys import read_keys_file

        key = self.spec.api_keys[0] if self.spec.api_keys else ""
        if not key and self.spec.api_keys_file:
            keys = read_keys_file(self.spec.api_keys_file)
            key = keys[0] if keys else ""
        return [("authorization", f"Bearer {key}")] if key else []

    def _next_name(self, role: str) -> str:
        # Names (= worker ids) are handed out here, on the caller's thread, never in the pool threads.
        self._seq += 1
        return f"{self._serve_role(role)}-{self._seq}"

    def _serve_role(self, pool: str) -> str:
        return "colocated" if self.spec.colocated and pool == "decode" else pool

    def _next_devices(self, role: str) -> tuple[str, ...]:
        if self._devices is None:
            self._devices = DeviceAssigner(self.spec.devices)
        return self._devices.next(role)

    def _worker_args(self, role: str, name: str) -> list[str]:
        args = ["--model", self.spec.model, "--transport", self.spec.transport, "--worker-id", name,
                "--drain-timeout", str(self.spec.drain_timeout), *self._tls_args(),
                *self.metrics.worker_args(name), *self.spec.worker_args,
                *(self.spec.prefill_args if role == "prefill" else self.spec.decode_args)]
        return per_worker_disk_dir(args, name)

    def _start_worker(self, role: str, name: str, devices: tuple[str, ...] = ()) -> WorkerHandle:
        args = self._worker_args(role, name)
        # Under Ray, round robin becomes a num_gpus request (Ray picks and isolates the devices).
        gpus = self.spec.devices.ray_num_gpus(role) if getattr(self.backend, "name", "") == "ray" else 0
        h = self.backend.start(self._serve_role(role), args, name, devices=() if gpus else devices,
                               num_gpus=gpus)
        h.role = role  # the pool it belongs to (a colocated worker serves the decode pool)
        return h

    def _write_members(self) -> None:
        with self._lock:
            members = {role: [h.address for h in hs] for role, hs in self.workers.items()}
        write_workers_file(str(self.run_dir / WORKERS_FILE), members)

    # ---- supervision (launcher/supervisor.py) ---------------------------------------------------
    def supervised(self) -> list[WorkerHandle]:
        """The processes to keep running: the router and every pool member."""
        with self._lock:
            return [*([self.router] if self.router else []), *(h for hs in self.workers.values() for h in hs)]

    def log_path(self, h: WorkerHandle) -> Path:
        return self.run_dir / "logs" / f"{h.worker_id}.log"

    def restart(self, h: WorkerHandle) -> None:
        """Start ``h``'s process again, same worker id, at the same port if it is free."""
        if h not in self.supervised():
            return  # stopped on purpose meanwhile (scale-down, down)
        router = h is self.router
        role = "router" if router else self._serve_role(h.role)
        port = int(h.address.rsplit(":", 1)[1])

        def args(p: int) -> list[str]:
            if router:
                return self._router_args(p)
            return [*self._worker_args(h.role, h.worker_id), "--port", str(p)]

        try:
            new = self.backend.restart(h, role, args(port))
        except StartFailed as exc:
            if not port or "cannot bind" not in str(exc):
                raise
            log.warning("%s did not come back on port %d; trying a new port", h.worker_id, port)
            new = self.backend.restart(h, role, args(0))
        moved = new.address != h.address
        h.adopt(new)
        if moved and not router:
            self._write_members()  # the router's discovery learns the new address
        self.write_state()

    def answers(self, h: WorkerHandle, timeout: float) -> bool:
        """Whether ``h``'s process answered a health check within ``timeout`` (launcher/liveness.py)."""
        role = "router" if h is self.router else self._serve_role(h.role)
        with self.channel(h.address, role) as ch:
            return answers(ch, timeout)

    def kill_unresponsive(self, h: WorkerHandle) -> None:
        """SIGKILL a process that is alive but silent (and its children): the supervisor restarts it."""
        if h in self.supervised():
            self.backend.kill(h)

    def give_up(self, h: WorkerHandle, why: str) -> None:
        """Leave a crash-looping process down: out of the members (and the router's view)."""
        with self._lock:
            for hs in self.workers.values():
                if h in hs:
                    hs.remove(h)
        self._write_members()
        self.write_state()

    @property
    def gave_up(self) -> dict[str, str]:
        return dict(self._supervisor.gave_up) if self._supervisor else {}

    def list_workers(self) -> list[router_pb2.WorkerEntry]:
        assert self.router is not None
        with self.channel(self.router.address, "router") as ch:
            resp = router_pb2_grpc.RouterStub(ch).ListWorkers(router_pb2.ListWorkersRequest(), timeout=5,
                                                              metadata=self.auth_metadata() or None)
        return list(resp.workers)

    def wait_router_sees(self, timeout: float) -> None:
        want = {h.address for hs in self.workers.values() for h in hs}
        deadline = time.monotonic() + timeout
        while True:
            try:
                seen = {w.address for w in self.list_workers() if w.healthy}
                if seen == want:
                    return
            except grpc.RpcError:
                seen = set()
            if time.monotonic() > deadline:
                raise TimeoutError(f"router sees {sorted(seen)}, expected {sorted(want)}")
            time.sleep(0.2)

    def write_state(self) -> None:
        state = {"pid": os.getpid(), "backend": self.backend.name,
                 "ray_address": getattr(self.backend, "address", None),
                 "router": self.router.address if self.router else None, "http": self.http_address,
                 "workers": [{"role": h.role, "worker_id": h.worker_id, "address": h.address, "pid": h.pid,
                              "devices": getattr(h, "devices", "")}
                             for hs in self.workers.values() for h in hs],
                 "router_pid": self.router.pid if self.router else None, "gave_up": self.gave_up,
                 "restarts": {h.worker_id: h.restarts for h in self.supervised() if h.restarts},
                 "updated": time.time()}
        tmp = self.run_dir / f"{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, self.run_dir / STATE_FILE)
        with self._lock:
            members = [(self._serve_role(h.role), h.worker_id, h.address)
                       for hs in self.workers.values() for h in hs]
        self.metrics.write(self.run_dir, self.router.address if self.router else None, members)

    # ---- scaling --------------------------------------------------------------------------------
    def scale(self, role: str, n: int) -> None:
        if role not in self.workers or n < 1:
            raise ValueError(f"scale needs role prefill|decode and N >= 1, got {role} {n}")
        with self._scaling:
            current = self.workers[role]
            if n > len(current):
                with ThreadPoolExecutor(max_workers=8) as pool:
                    plan = [(self._next_name(role), self._next_devices(role))
                            for _ in range(n - len(current))]
                    new = list(pool.map(lambda nd: self._start_worker(role, *nd), plan))
                with self._lock:
                    current.extend(new)
                self._write_members()
                self.wait_router_sees(timeout=60)
            elif n < len(current):
                gone = current[n:]
                with self._lock:
                    del current[n:]
                self._write_members()
                self.wait_router_sees(timeout=60)
                for h in gone:
                    ch = self.channel(h.address, self._serve_role(h.role))
                    _wait_idle(h, ch, timeout=self.spec.drain_timeout)
                    h.stop(self.spec.drain_timeout)
            self.write_state()
            log.info("scaled %s to %d", role, n)

    # ---- run until stopped ----------------------------------------------------------------------
    def serve(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stop.set())
        req_path = self.run_dir / SCALE_FILE
        while not self._stop.wait(0.3):
            if req_path.exists():
                try:
                    req = json.loads(req_path.read_text())
                    req_path.unlink()
                    self.scale(req["role"], int(req["n"]))
                    (self.run_dir / f"scale-done-{req.get('id', '')}").write_text("ok")
                except Exception as exc:  # a bad request must not take the cluster down
                    log.exception("scale request failed")
                    (self.run_dir / f"scale-done-{req.get('id', '')}").write_text(f"error: {exc}")

    def down(self) -> None:
        if self._supervisor is not None:
            self._supervisor.stop()  # first: nothing stopped below is taken for a crash
        if self.router is not None:
            self.router.stop(10)
        hs = [h for hs in self.workers.values() for h in hs]
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(lambda h: h.stop(self.spec.drain_timeout), hs))
        self.backend.close()
        (self.run_dir / STATE_FILE).unlink(missing_ok=True)


def _wait_idle(h: WorkerHandle, channel: grpc.Channel, timeout: float) -> None:
    """Until a worker being removed has nothing running, queued or leased (or the timeout)."""
    stub_cls = prefill_pb2_grpc.PrefillStub if h.role == "prefill" else decode_pb2_grpc.DecodeStub
    deadline = time.monotonic() + timeout
    with channel as ch:
        stub = stub_cls(ch)
        while time.monotonic() < deadline:
            try:
                s = stub.GetStats(common_pb2.StatsRequest(), timeout=5)
            except grpc.RpcError:
                return
            if s.num_running == 0 and s.queue_depth == 0 and s.num_leased == 0:
                return
            time.sleep(0.2)
