"""The kind lane's target: the Helm chart installed on a kind cluster, reached through `kubectl port-forward`.

deploy/kind/lib.sh decides the cluster (k8s-local's ``kp``, or the lane's own ``pdserve-e2e``), the tools
and the kubeconfig; ``lane_env()`` asks it, so the scripts and the tests always agree. deploy/kind/up.sh
builds, loads and installs a release; ``KindTarget`` forwards its router Service's gRPC, HTTP and metrics
ports to this machine. Scaling is `kubectl scale` of a pool's Deployment (the ``scale`` subresource, as
`pdserve scale` and the planner use it); losing a decode worker is `kubectl delete pod --grace-period=0
--force` (the object goes at once and the kubelet kills the container two seconds later: the nearest thing
to the up lane's SIGKILL). A worker's id is its pod name (PDSERVE_WORKER_ID from the downward API).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from e2e_targets import REPO, Target, _Proc, run

from pdserve.probe import scrape_metrics

KIND_DIR = REPO / "deploy" / "kind"
_LANE_VARS = ("KIND_CLUSTER", "NAMESPACE", "HELM", "KUBECONFIG", "PATH", "STATE")


def lane_env() -> dict[str, str]:
    """os.environ plus what deploy/kind/lib.sh sets (cluster, namespace, helm, kubeconfig, PATH)."""
    script = f'source "{KIND_DIR / "lib.sh"}" && printf "%s\\0" ' + " ".join(f'"${v}"' for v in _LANE_VARS)
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                         check=True).stdout
    return {**os.environ, **dict(zip(_LANE_VARS, out.split("\0"), strict=False))}


def kind_unusable_reason() -> str | None:
    """Why the kind lane cannot run here (lib.sh's kind_unusable: docker, kind, kubectl, helm), or None."""
    script = f'source "{KIND_DIR / "lib.sh"}" && kind_unusable'
    try:
        proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"deploy/kind/lib.sh could not be run: {exc}"
    return proc.stdout.strip() or None


class KindTarget(Target):
    name = "kind"

    def __init__(self, workdir: Path, *, release: str = "pdserve", helm_args: tuple[str, ...] = (),
                 build: bool = True, transport: str = "nixl") -> None:
        self.release, self.transport = release, transport  # values-kind.yaml: NIXL, UCX_TLS=tcp
        self.env = {**lane_env(), "RELEASE": release, "SKIP_BUILD": "0" if build else "1"}
        self.namespace, self.context = self.env["NAMESPACE"], f"kind-{self.env['KIND_CLUSTER']}"
        self.state = Path(self.env["STATE"])
        self.decode_replicas = 2
        run([str(KIND_DIR / "up.sh"), *helm_args], timeout=1800, env=self.env)
        self.forward = _Proc(["kubectl", "--context", self.context, "-n", self.namespace, "port-forward",
                              f"svc/{release}-router", ":50051", ":8000", ":9090"],
                             env=self.env, log=workdir / f"port-forward-{release}.log")
        ports = {}
        for remote in ("50051", "8000", "9090"):
            m = self.forward.wait_for(rf"Forwarding from 127\.0\.0\.1:(\d+) -> {remote}", timeout=60)
            ports[remote] = m.group(1)
        self.router, self.http = f"127.0.0.1:{ports['50051']}", f"127.0.0.1:{ports['8000']}"
        self.metrics_port = int(ports["9090"])

    def kubectl(self, *args: str, timeout: float = 120) -> str:
        return run(["kubectl", "--context", self.context, "-n", self.namespace, *args], timeout=timeout,
                   env=self.env).stdout

    def kubectl_json(self, *args: str) -> dict:
        return json.loads(self.kubectl(*args, "-o", "json"))

    def pods(self, component: str) -> list[dict]:
        """The component's pods that are not being deleted, oldest first."""
        items = self.kubectl_json("get", "pods", "-l", f"app.kubernetes.io/instance={self.release},"
                                  f"app.kubernetes.io/component={component}")["items"]
        live = [p for p in items if not p["metadata"].get("deletionTimestamp")]
        return sorted(live, key=lambda p: p["metadata"]["creationTimestamp"])

    def scale(self, component: str, n: int) -> None:
        deploy = f"deploy/{self.release}-{component}"
        self.kubectl("scale", deploy, f"--replicas={n}")
        self.kubectl("rollout", "status", deploy, "--timeout=600s", timeout=620)

    def scale_decode(self, n: int) -> None:
        self.scale("decode", n)
        self.decode_replicas = n

    def kill_decode_worker(self, worker_id: str) -> None:
        self.kubectl("delete", "pod", worker_id, "--grace-period=0", "--force", "--wait=false")

    def metrics(self) -> dict[str, float]:
        return scrape_metrics(self.metrics_port)

    def manifest(self) -> list[dict]:
        """The release's objects as Helm rendered them against this cluster (`helm get manifest`)."""
        import yaml

        text = run([self.env["HELM"], "get", "manifest", self.release, "--kube-context", self.context,
                    "-n", self.namespace], timeout=60, env=self.env).stdout
        return [d for d in yaml.safe_load_all(text) if d]

    def uninstall(self) -> None:
        run([self.env["HELM"], "uninstall", self.release, "--kube-context", self.context,
             "-n", self.namespace], timeout=180, env=self.env, check=False)

    def close(self) -> None:
        self.forward.stop(10)
        if self.release != "pdserve":
            self.uninstall()
        elif os.environ.get("PDSERVE_KIND_KEEP") != "1":
            run([str(KIND_DIR / "down.sh")], timeout=300, env=self.env, check=False)
