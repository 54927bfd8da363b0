"""Where worker processes run: plain subprocesses on this host, or inside Ray actors.

Both backends start a `pdserve serve` process through ``procs.spawn`` and return a ``WorkerHandle``
with its role, worker id, address and a ``stop()`` that drains it (SIGTERM). The Ray backend wraps
each serve process in a ``ServeActor`` (``num_cpus=0``: the actor only supervises; the process does
the work), so pools can be placed on any node of a Ray cluster; the embedded local Ray is started
with a small ``num_cpus`` so it fits a laptop or a 2-core CI box.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.app.launcher.procs import ServeProcess, spawn
from pdserve.app.launcher.zygote import Zygote, ZygoteSlot
from pdserve.settings import environ

log = logging.getLogger(__name__)


@dataclass
class WorkerHandle:
    role: str
    worker_id: str
    address: str
    pid: int
    backend: Any
    ref: Any  # ServeProcess (process backend) or an actor handle (ray backend)
    devices: str = ""  # CUDA_VISIBLE_DEVICES given to it ("ray:N" when Ray picked N GPUs)
    restarts: int = 0  # how often the supervisor restarted it (launcher/supervisor.py)

    def stop(self, timeout: float = 30.0) -> None:
        self.backend.stop(self, timeout)

    def alive(self) -> bool:
        return self.backend.alive(self)

    def exit_status(self) -> int | None:
        """The exit status of its process once it exited (negative: killed by that signal)."""
        return self.backend.exit_status(self)

    def adopt(self, other: WorkerHandle) -> None:
        """Become the restarted process ``other`` (same worker id): callers keep their handle."""
        self.address, self.pid, self.ref = other.address, other.pid, other.ref
        self.restarts += 1


def device_env(env: dict[str, str], devices: tuple[str, ...]) -> dict[str, str]:
    """The worker's environment: ``env`` with its own CUDA_VISIBLE_DEVICES when it was given devices."""
    out = dict(env)
    if devices:
        out["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    return out


class ProcessBackend:
    """Plain processes on this host; with ``zygote`` (the default of ``pdserve up``) each is forked from
    one process that imported torch and pdserve once (launcher/zygote.py), so a restart or a scale-up
    skips the imports. The zygote starts beside the first processes (which start plain meanwhile) and
    is started again if it died."""

    name = "process"
    host = "127.0.0.1"  # every listener of the cluster binds this (`pdserve up --host`)

    def __init__(self, run_dir: Path, env: dict[str, str] | None = None, *, zygote: bool = False) -> None:
        self.run_dir = run_dir
        self.env = env or {}
        self.zygotes = (ZygoteSlot(lambda: {**environ(), **self.env}, run_dir / "logs" / "zygote.log")
                        if zygote else None)

    def start(self, role: str, args: list[str], name: str, *, devices: tuple[str, ...] = (),
              num_gpus: int = 0) -> WorkerHandle:
        env = device_env(self.env, devices)
        p = spawn(role, args, self.run_dir / "logs" / f"{name}.log", env=env, host=self.host,
                  zygote=self.zygotes.ready() if self.zygotes else None)
        return WorkerHandle(role=role, worker_id=p.worker_id, address=p.address, pid=p.pid, backend=self,
                            ref=p, devices=",".join(devices))

    def stop(self, h: WorkerHandle, timeout: float) -> None:
        h.ref.stop(timeout)

    def alive(self, h: WorkerHandle) -> bool:
        return h.ref.alive()

    def kill(self, h: WorkerHandle) -> None:
        h.ref.kill(group=True)

    def exit_status(self, h: WorkerHandle) -> int | None:
        return h.ref.exit_status()

    def restart(self, h: WorkerHandle, role: str, args: list[str]) -> WorkerHandle:
        return self.start(role, args, h.worker_id, devices=tuple(d for d in h.devices.split(",") if d))

    def close(self) -> None:
        if self.zygotes is not None:
            self.zygotes.close()


PLACEMENT_TIMEOUT_S = 120.0


class RayBackend:
    name = "ray"
    host = ""  # bind address of every process; "" = its node's IP (one interface, reachable by the others)

    def __init__(self, run_dir: Path, env: dict[str, str] | None = None, address: str | None = None,
                 num_cpus: int = 2, *, zygote: bool = False) -> None:
        import ray

        self.ray = ray
        self.run_dir = run_dir
        self.env = env or {}
        self.zygote = zygote  # each actor forks its process from a zygote of its own (ServeActor)
        if not ray.is_initialized():
            if address:
                ray.init(address=address, namespace="pdserve", log_to_driver=False)
            else:
                ray.init(num_cpus=num_cpus, include_dashboard=False, namespace="pdserve", log_to_driver=False)
        self.address = ray.get_runtime_context().gcs_address
        self._actor_cls = ray.remote(num_cpus=0)(ServeActor)
        self._groups: dict[str, Any] = {}  # worker id -> the placement group holding its GPUs

    def start(self, role: str, args: list[str], name: str, *, devices: tuple[str, ...] = (),
              num_gpus: int = 0) -> WorkerHandle:
        env = device_env(self.env, devices)
        if num_gpus:
            # Ray reserves the GPUs and sets CUDA_VISIBLE_DEVICES in the actor; the serve process
            # inherits it, so the driver's own value must not be passed over it.
            env.pop("CUDA_VISIBLE_DEVICES", None)
        options: dict[str, Any] = {"name": f"pdserve-{name}", "max_concurrency": 4, "num_gpus": num_gpus}
        if num_gpus > 1:  # a tensor-parallel worker: its ranks are child processes on these GPUs
            options["scheduling_strategy"] = self.gpu_bundle(name, num_gpus)
        actor = self._actor_cls.options(**options).remote()
        info = self.ray.get(actor.start.remote(role, args, str(self.run_dir / "logs" / f"{name}.log"), env,
                                                host=self.host, zygote=self.zygote))
        return WorkerHandle(role=role, worker_id=info["worker_id"], address=info["address"], pid=info["pid"],
                            backend=self, ref=actor,
                            devices=info.get("devices") or ",".join(devices))

    def gpu_bundle(self, name: str, num_gpus: int) -> Any:
        """A worker's GPUs as one placement-group bundle (STRICT_PACK: one node, reserved together before its
        actor starts; the ranks rendezvous on 127.0.0.1); removed when the worker stops."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        old = self._groups.pop(name, None)
        if old is not None:
            self.ray.util.remove_placement_group(old)
        group = placement_group([{"GPU": num_gpus}], strategy="STRICT_PACK", name=f"pdserve-{name}")
        self.ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        self._groups[name] = group
        return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=0)

    def stop(self, h: WorkerHandle, timeout: float) -> None:
        try:
            self.ray.get(h.ref.stop.remote(timeout), timeout=timeout + 15)
        except Exception:
            log.warning("stopping %s through its actor failed; killing the actor", h.worker_id, exc_info=True)
        self.ray.kill(h.ref)
        group = self._groups.pop(h.worker_id, None)
        if group is not None:
            self.ray.util.remove_placement_group(group)

    def alive(self, h: WorkerHandle) -> bool:
        try:
            return bool(self.ray.get(h.ref.alive.remote(), timeout=10))
        except Exception:
            return False

    def kill(self, h: WorkerHandle) -> None:
        try:
            self.ray.get(h.ref.kill.remote(), timeout=30)
        except Exception:  # the actor is gone with it: the next alive() says so
            log.warning("killing %s through its actor failed", h.worker_id, exc_info=True)

    def exit_status(self, h: WorkerHandle) -> int | None:
        try:
            return self.ray.get(h.ref.exit_status.remote(), timeout=10)
        except Exception:  # the actor itself is gone (its node died)
            return None

    def restart(self, h: WorkerHandle, role: str, args: list[str]) -> WorkerHandle:
        """A new process in the same actor (same node, same GPUs); a new actor if the actor is gone."""
        try:
            log_path = str(self.run_dir / "logs" / f"{h.worker_id}.log")
            info = self.ray.get(h.ref.start.remote(role, args, log_path, dict(self.env), host=self.host,
                                                   zygote=self.zygote))
        except Exception:
            log.warning("actor of %s is gone; starting a new one", h.worker_id, exc_info=True)
            with contextlib.suppress(Exception):
                self.ray.kill(h.ref)
            return self.start(role, args, h.worker_id)
        return WorkerHandle(role=h.role, worker_id=info["worker_id"], address=info["address"],
                            pid=info["pid"], backend=self, ref=h.ref, devices=h.devices)

    def close(self) -> None:
        self.ray.shutdown()


class ServeActor:
    """A Ray actor supervising one `pdserve serve` process on its node."""

    def __init__(self) -> None:
        self.proc: ServeProcess | None = None
        self._zygotes: ZygoteSlot | None = None  # this actor's, made at its first start that wants one

    def start(self, role: str, args: list[str], log_path: str, env: dict[str, str], host: str = "",
              zygote: bool = False) -> dict:
        import ray

        # Bind the node's IP (not every interface) unless told otherwise, advertise what others dial:
        # pools may live on different Ray nodes.
        node_ip = ray.util.get_node_ip_address()
        bind = host or node_ip
        self.proc = spawn(role, args, log_path, env=env, host=bind,
                          advertise_host=node_ip if bind in ("0.0.0.0", "::") else bind,
                          zygote=self._zygote(env, log_path) if zygote else None)
        return {"worker_id": self.proc.worker_id, "address": self.proc.address, "pid": self.proc.pid,
                "devices": env.get("CUDA_VISIBLE_DEVICES", environ().get("CUDA_VISIBLE_DEVICES", ""))}

    def _zygote(self, env: dict[str, str], log_path: str) -> Zygote | None:
        if self._zygotes is None:
            self._zygotes = ZygoteSlot(lambda: {**environ(), **env},
                                       Path(log_path).with_suffix(".zygote.log"))
        return self._zygotes.ready()

    def stop(self, timeout: float) -> int:
        return self.proc.stop(timeout) if self.proc else 0

    def alive(self) -> bool:
        return bool(self.proc and self.proc.alive())

    def kill(self) -> None:
        if self.proc:
            self.proc.kill(group=True)

    def exit_status(self) -> int | None:
        return self.proc.exit_status() if self.proc else None
