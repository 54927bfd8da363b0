"""Run the Helm chart's pods as plain Docker containers: the rendered chart, translated field by field.

The container lane (tests/container) renders the chart with `helm template` and starts every workload's
pod template through this module, so the containers get exactly the chart's image, args, environment,
probes, security context, resources, volumes and grace period, with no second copy to drift. Anything the
translation does not know is an error (``Unsupported``), never silently dropped: a chart change that
Docker cannot express fails the lane and tests/deploy/test_image.py.

How Kubernetes concepts map onto one Docker host (user-defined bridge network):

* pod -> one container named after the pod; its hostname is the pod name; it gets a fixed IP on the
  network (``status.podIP``) and the Service names of its component as network aliases (DNS).
* env ``value`` -> as is; ``fieldRef`` metadata.name / metadata.namespace / status.podIP -> the pod's
  name / the namespace / its IP; ``secretKeyRef`` -> the rendered Secret; ``$(VAR)`` references in env
  values, command and args are expanded as the kubelet does.
* probes -> Docker's health check runs the readiness probe (gRPC probes through the image's
  ``pdserve-healthcheck``, exec probes as given) at its period / timeout / failure threshold, with the
  startup probe's budget (period x threshold) as the start period. Docker does not restart unhealthy
  containers, so the liveness probe is kept on the spec (``probes``) for callers to run.
* securityContext -> ``--user`` uid:gid, fsGroup -> ``--group-add``, readOnlyRootFilesystem ->
  ``--read-only``, allowPrivilegeEscalation: false -> ``no-new-privileges``, capabilities -> ``--cap-drop`` /
  ``--cap-add``; runAsNonRoot with uid 0 is refused. RuntimeDefault seccomp is Docker's default.
* resources -> limits as ``--cpus`` / ``--memory``, requests as ``--cpu-shares`` / ``--memory-reservation``.
* volumes -> an emptyDir at /dev/shm is ``--shm-size``; other emptyDirs are tmpfs mounts (world-writable,
  as emptyDirs are), except those named in ``shared_volumes``, which mount a Docker volume (the model
  volume the init container fills). hostPath / PVC volumes are not supported.
* restartPolicy (Always by default) -> ``--restart always``: a container that exits by itself is started
  again; `docker stop` / `docker kill` (a deleted pod) are not undone.
* lifecycle preStop exec -> ``pre_stop`` (the caller runs it with ``docker exec`` before ``docker stop``);
  terminationGracePeriodSeconds -> ``--stop-timeout``, so a plain ``docker stop`` gives the chart's grace.
* scheduling fields (node selectors, affinity, tolerations, spread, priority), service-account token
  mounting and imagePullSecrets mean nothing on one Docker host and are ignored.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field

POD_FIELDS_IGNORED = {"automountServiceAccountToken", "enableServiceLinks", "serviceAccountName",
                      "nodeSelector", "affinity", "tolerations", "topologySpreadConstraints",
                      "priorityClassName", "imagePullSecrets"}
POD_FIELDS = {"terminationGracePeriodSeconds", "securityContext", "initContainers", "containers", "volumes",
              "restartPolicy", *POD_FIELDS_IGNORED}
CONTAINER_FIELDS = {"name", "image", "imagePullPolicy", "command", "args", "env", "ports", "startupProbe",
                    "livenessProbe", "readinessProbe", "lifecycle", "securityContext", "resources",
                    "volumeMounts"}
PULL = {"Never": "never", "IfNotPresent": "missing", "Always": "always"}
# Docker's "always" is not applied after `docker stop` / `docker kill`, as Kubernetes does not restart
# a deleted pod; a container that exits by itself is restarted, as the kubelet would.
RESTART = {"Always": "always", "OnFailure": "on-failure", "Never": "no"}
HEALTHCHECK = "pdserve-healthcheck"


class Unsupported(ValueError):
    """A rendered field the Docker translation cannot express."""


@dataclass(frozen=True, kw_only=True)
class Probe:
    command: tuple[str, ...]  # run inside the container; exit 0 = success
    period_s: int
    timeout_s: int
    failure_threshold: int


@dataclass(frozen=True, kw_only=True)
class ContainerSpec:
    """One container of one pod, ready for ``docker run`` (see ``run_args``)."""

    pod: str
    name: str
    image: str
    pull: str
    entrypoint: str | None
    args: tuple[str, ...]
    env: dict[str, str]
    user: str
    group_add: tuple[str, ...] = ()
    read_only: bool = False
    no_new_privileges: bool = False
    cap_drop: tuple[str, ...] = ()
    cap_add: tuple[str, ...] = ()
    cpus: str | None = None
    memory: int | None = None
    cpu_shares: int | None = None
    memory_reservation: int | None = None
    shm_size: int | None = None
    tmpfs: dict[str, int | None] = field(default_factory=dict)  # path -> size in bytes (None: unlimited)
    volumes: tuple[tuple[str, str, bool], ...] = ()  # (docker volume, path, read-only)
    probes: dict[str, Probe] = field(default_factory=dict)  # startup / liveness / readiness
    stop_timeout: int | None = None
    pre_stop: tuple[str, ...] | None = None
    restart: str = "no"


@dataclass(frozen=True, kw_only=True)
class PodTemplate:
    """A workload's pod template plus what the render says about it."""

    workload: str  # Deployment / StatefulSet name
    kind: str
    component: str
    replicas: int
    labels: dict[str, str]
    spec: dict
    services: tuple[str, ...]  # Service names selecting these pods (network aliases)


def pod_templates(docs: list[dict]) -> dict[str, PodTemplate]:
    """Every Deployment / StatefulSet in the render, by component label."""
    services = [d for d in docs if d["kind"] == "Service"]
    out: dict[str, PodTemplate] = {}
    for d in docs:
        if d["kind"] not in ("Deployment", "StatefulSet"):
            continue
        labels = d["spec"]["template"]["metadata"]["labels"]
        selecting = tuple(s["metadata"]["name"] for s in services
                          if s["spec"].get("selector") and s["spec"]["selector"].items() <= labels.items())
        comp = labels["app.kubernetes.io/component"]
        out[comp] = PodTemplate(workload=d["metadata"]["name"], kind=d["kind"], component=comp,
                                replicas=int(d["spec"].get("replicas", 1)), labels=dict(labels),
                                spec=d["spec"]["template"]["spec"], services=selecting)
    return out


def secrets(docs: list[dict]) -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in (d.get("data") or {}).items()}
            | dict(d.get("stringData") or {}) for d in docs if d["kind"] == "Secret"}


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: known variables are replaced, $$ escapes, unknown ones stay."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def _quantity(text: str | int | float) -> float:
    units = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text))
    if not m or m.group(2) not in units:
        raise Unsupported(f"resource quantity {text!r}")
    return float(m.group(1)) * units[m.group(2)]


def _probe(probe: dict, ports: dict[str, int]) -> Probe:
    unknown = set(probe) - {"grpc", "exec", "tcpSocket", "periodSeconds", "timeoutSeconds",
                            "failureThreshold"}
    if unknown:
        raise Unsupported(f"probe fields {sorted(unknown)}")
    if "grpc" in probe:
        grpc = probe["grpc"]
        cmd = (HEALTHCHECK, "--port", str(grpc["port"]), "--service", grpc.get("service", ""),
               "--timeout", str(probe.get("timeoutSeconds", 1)))
    elif "exec" in probe:
        cmd = tuple(probe["exec"]["command"])
    elif "tcpSocket" in probe:
        port = probe["tcpSocket"]["port"]
        port = ports[port] if isinstance(port, str) else port
        cmd = ("bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port}")
    else:
        raise Unsupported(f"probe without a handler: {probe}")
    return Probe(command=cmd, period_s=int(probe.get("periodSeconds", 10)),
                 timeout_s=int(probe.get("timeoutSeconds", 1)),
                 failure_threshold=int(probe.get("failureThreshold", 3)))


def container_spec(tpl: PodTemplate, container: dict, *, pod: str, pod_ip: str, namespace: str,
                   secret_data: dict[str, dict[str, str]], shared_volumes: dict[str, str]) -> ContainerSpec:
    """Translate one rendered container of ``tpl`` into a ContainerSpec for the pod named ``pod``."""
    unknown_pod = set(tpl.spec) - POD_FIELDS
    if unknown_pod:
        raise Unsupported(f"{tpl.workload}: pod spec fields {sorted(unknown_pod)}")
    unknown = set(container) - CONTAINER_FIELDS
    if unknown:
        raise Unsupported(f"{tpl.workload}/{container['name']}: container fields {sorted(unknown)}")
    field_refs = {"metadata.name": pod, "metadata.namespace": namespace, "status.podIP": pod_ip}
    env: dict[str, str] = {}
    for e in container.get("env") or []:
        if "value" in e:
            env[e["name"]] = _expand(str(e["value"]), env)
        elif "fieldRef" in e.get("valueFrom", {}):
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            if path not in field_refs:
                raise Unsupported(f"{tpl.workload}: env {e['name']} fieldRef {path}")
            env[e["name"]] = field_refs[path]
        elif "secretKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secret_data[ref["name"]][ref["key"]]
        else:
            raise Unsupported(f"{tpl.workload}: env {e['name']} {e.get('valueFrom')}")

    command = [_expand(c, env) for c in container.get("command") or []]
    args = [_expand(a, env) for a in container.get("args") or []]
    entrypoint = command[0] if command else None
    args = command[1:] + args

    pod_sc = tpl.spec.get("securityContext") or {}
    sc = container.get("securityContext") or {}
    unknown_sc = set(sc) - {"allowPrivilegeEscalation", "readOnlyRootFilesystem", "capabilities", "runAsUser",
                            "runAsGroup", "runAsNonRoot"}
    unknown_sc |= set(pod_sc) - {"runAsNonRoot", "runAsUser", "runAsGroup", "fsGroup", "seccompProfile"}
    if unknown_sc:
        raise Unsupported(f"{tpl.workload}: securityContext fields {sorted(unknown_sc)}")
    if (pod_sc.get("seccompProfile") or {}).get("type", "RuntimeDefault") != "RuntimeDefault":
        raise Unsupported(f"{tpl.workload}: seccompProfile {pod_sc['seccompProfile']}")
    uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
    gid = sc.get("runAsGroup", pod_sc.get("runAsGroup"))
    if uid is None:
        raise Unsupported(f"{tpl.workload}: no runAsUser (the image's user would apply unseen)")
    if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) and int(uid) == 0:
        raise Unsupported(f"{tpl.workload}: runAsNonRoot with runAsUser 0")
    caps = sc.get("capabilities") or {}

    res = container.get("resources") or {}
    limits, requests = res.get("limits") or {}, res.get("requests") or {}
    unknown_res = (set(limits) | set(requests)) - {"cpu", "memory"}
    if unknown_res:
        raise Unsupported(f"{tpl.workload}: resources {sorted(unknown_res)} (devices are not mapped)")

    volumes = {v["name"]: v for v in tpl.spec.get("volumes") or []}
    shm_size, tmpfs, mounts = None, {}, []
    for m in container.get("volumeMounts") or []:
        v = volumes[m["name"]]
        if set(m) - {"name", "mountPath", "readOnly"}:
            raise Unsupported(f"{tpl.workload}: volumeMount fields {sorted(set(m))}")
        if m["name"] in shared_volumes:
            mounts.append((shared_volumes[m["name"]], m["mountPath"], bool(m.get("readOnly"))))
        elif "emptyDir" in v:
            size = (v["emptyDir"] or {}).get("sizeLimit")
            size = int(_quantity(size)) if size else None
            if m["mountPath"] == "/dev/shm":
                shm_size = size
            else:
                tmpfs[m["mountPath"]] = size
        else:
            raise Unsupported(f"{tpl.workload}: volume {m['name']} {sorted(set(v) - {'name'})} (only "
                              "emptyDir, or a volume named in shared_volumes)")

    ports = {p["name"]: int(p["containerPort"]) for p in container.get("ports") or [] if "name" in p}
    probes = {kind: _probe(container[f"{kind}Probe"], ports) for kind in ("startup", "liveness", "readiness")
              if f"{kind}Probe" in container}
    pre_stop = None
    if container.get("lifecycle"):
        hooks = container["lifecycle"]
        if set(hooks) - {"preStop"} or set(hooks["preStop"]) - {"exec"}:
            raise Unsupported(f"{tpl.workload}: lifecycle {hooks}")
        pre_stop = tuple(hooks["preStop"]["exec"]["command"])
    grace = tpl.spec.get("terminationGracePeriodSeconds")
    return ContainerSpec(
        pod=pod, name=container["name"], image=container["image"],
        pull=PULL[container.get("imagePullPolicy", "IfNotPresent")], entrypoint=entrypoint, args=tuple(args),
        env=env, user=f"{uid}:{gid}" if gid is not None else str(uid),
        group_add=(str(pod_sc["fsGroup"]),) if "fsGroup" in pod_sc else (),
        read_only=bool(sc.get("readOnlyRootFilesystem")),
        no_new_privileges=sc.get("allowPrivilegeEscalation") is False,
        cap_drop=tuple(caps.get("drop") or ()), cap_add=tuple(caps.get("add") or ()),
        cpus=f"{_quantity(limits['cpu']):g}" if "cpu" in limits else None,
        memory=int(_quantity(limits["memory"])) if "memory" in limits else None,
        cpu_shares=max(2, int(_quantity(requests["cpu"]) * 1024)) if "cpu" in requests else None,
        memory_reservation=int(_quantity(requests["memory"])) if "memory" in requests else None,
        shm_size=shm_size, tmpfs=tmpfs, volumes=tuple(mounts), probes=probes,
        stop_timeout=int(grace) if grace is not None else None, pre_stop=pre_stop,
        restart=RESTART[tpl.spec.get("restartPolicy", "Always")])


def health_args(spec: ContainerSpec) -> list[str]:
    """Docker health check flags: the readiness probe, with the startup probe's budget as start period."""
    ready = spec.probes.get("readiness")
    if ready is None:
        return ["--no-healthcheck"]
    start = spec.probes.get("startup")
    start_period = start.period_s * start.failure_threshold if start else 0
    # --health-cmd is run by a shell: quote each word.
    cmd = " ".join("'" + w.replace("'", "'\"'\"'") + "'" for w in ready.command)
    return ["--health-cmd", cmd, "--health-interval", f"{ready.period_s}s",
            "--health-timeout", f"{ready.timeout_s}s", "--health-retries", str(ready.failure_threshold),
            "--health-start-period", f"{start_period}s"]


def run_args(spec: ContainerSpec, *, container_name: str, network: str, ip: str | None,
             aliases: tuple[str, ...] = (), labels: dict[str, str] | None = None,
             detach: bool = True, health: bool = True) -> list[str]:
    """``docker run`` arguments (without the leading ``docker run``) for ``spec``."""
    a = ["--name", container_name, "--hostname", spec.pod, "--pull", spec.pull, "--network", network]
    if detach:  # a foreground run is a one-shot (an init container): no restarts
        a += ["--detach", "--restart", spec.restart]
    if ip:
        a += ["--ip", ip]
    for alias in aliases:
        a += ["--network-alias", alias]
    for k, v in (labels or {}).items():
        a += ["--label", f"{k}={v}"]
    a += ["--user", spec.user]
    for g in spec.group_add:
        a += ["--group-add", g]
    if spec.read_only:
        a.append("--read-only")
    if spec.no_new_privileges:
        a += ["--security-opt", "no-new-privileges"]
    for c in spec.cap_drop:
        a += ["--cap-drop", c]
    for c in spec.cap_add:
        a += ["--cap-add", c]
    if spec.cpus:
        a += ["--cpus", spec.cpus]
    if spec.memory:
        a += ["--memory", str(spec.memory)]
    if spec.cpu_shares:
        a += ["--cpu-shares", str(spec.cpu_shares)]
    if spec.memory_reservation:
        a += ["--memory-reservation", str(spec.memory_reservation)]
    if spec.shm_size:
        a += ["--shm-size", str(spec.shm_size)]
    for path, size in spec.tmpfs.items():
        opts = f"type=tmpfs,destination={path},tmpfs-mode=1777"
        a += ["--mount", opts + (f",tmpfs-size={size}" if size else "")]
    for volume, path, ro in spec.volumes:
        a += ["--mount", f"type=volume,source={volume},destination={path}" + (",readonly" if ro else "")]
    for k, v in spec.env.items():
        a += ["--env", f"{k}={v}"]
    if spec.stop_timeout is not None:
        a += ["--stop-timeout", str(spec.stop_timeout)]
    a += health_args(spec) if health else ["--no-healthcheck"]
    if spec.entrypoint is not None:
        a += ["--entrypoint", spec.entrypoint]
    return [*a, spec.image, *spec.args]
