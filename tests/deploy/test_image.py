"""The image and the container lane, checked without a Docker engine.

1. The Dockerfile: one image for every role, CPU and CUDA variants from pinned base images given as build
   arguments, torch from a named index, cache-friendly layer order, a non-root runtime without build
   leftovers, a health check, no model inside; a build context that leaves local state out.
2. The container lane (tests/container, `make container-test`) against the chart: the lane renders the
   chart with the kind preset plus an overlay that may only switch discovery to Redis, and its Docker
   translation (deploy/container/chart_docker.py) carries every rendered setting or refuses the render.
   A chart change that the lane would run differently from kind fails here, in `make test`.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys

import pytest
import yaml
from chart_helpers import REPO, ROLES, deployment, render

sys.path.insert(0, str(REPO / "tests" / "container"))

import lane  # noqa: E402
from chart_docker import Unsupported, container_spec, pod_templates, run_args, secrets  # noqa: E402

DOCKERFILE = (REPO / "Dockerfile").read_text()
INSTRUCTIONS = [ln.strip() for ln in re.sub(r"\\\n", " ", DOCKERFILE).splitlines()
                if ln.strip() and not ln.lstrip().startswith("#")]
IMAGE = "pdserve:0.1.0-cpu"
# Env that differs between the kind preset (k8s discovery) and the lane (Redis-lease discovery).
DISCOVERY_ENV = {"PDSERVE_DISCOVERY", "PDSERVE_K8S_NAMESPACE", "PDSERVE_PREFILL_SELECTOR",
                 "PDSERVE_DECODE_SELECTOR", "PDSERVE_REDIS", "PDSERVE_REDIS_PASSWORD"}


def _args() -> dict[str, str]:
    out = {}
    for ln in INSTRUCTIONS:
        m = re.match(r"ARG (\w+)=(\S*)", ln)
        if m:
            out[m.group(1)] = m.group(2).strip('"')
    return out


def _stages() -> dict[str, str]:
    return {m.group(2): m.group(1) for ln in INSTRUCTIONS if (m := re.match(r"FROM (\S+) AS (\S+)", ln))}


def _stage(name: str) -> str:
    """The Dockerfile text of one stage."""
    return re.split(r"^FROM ", DOCKERFILE.split(f" AS {name}\n", 1)[1], flags=re.M)[0]


# ----------------------------------------------------------------------------------------------- Dockerfile
def test_cpu_and_cuda_variants_from_pinned_base_arguments() -> None:
    args = _args()
    assert args["VARIANT"] == "cpu"
    stages = _stages()
    assert stages["base-cpu"] == "${CPU_BASE}" and stages["base-cuda"] == "${CUDA_BASE}"
    assert stages["deps"] == stages["runtime"] == stages["lock"] == "base-${VARIANT}"
    assert stages["wheel"] == "deps"
    for var in ("CPU_BASE", "CUDA_BASE"):
        image = args[var]
        assert ":" in image and not image.endswith(":latest"), image
    assert "cuda" in args["CUDA_BASE"] and "slim" in args["CPU_BASE"]
    assert "latest" not in " ".join(ln for ln in INSTRUCTIONS if ln.startswith("FROM"))


def test_every_package_comes_from_the_variant_lock_with_hashes() -> None:
    lock, deps = _stage("lock"), _stage("deps")
    assert "COPY locks/image-${VARIANT}.txt /lock/all.txt" in lock
    installs = [ln for ln in deps.splitlines() if "pip install" in ln]
    assert len(installs) == 2 and all("--require-hashes --no-deps" in ln for ln in installs), installs
    assert "-r /tmp/lock/torch.txt" in installs[0] and "-r /tmp/lock/all.txt" in installs[1]
    assert "pyproject.toml" not in deps and "pip check" in deps
    # torch's extra index: the builder's, else PyTorch's CPU index for cpu and none for cuda (PyPI's torch)
    assert re.search(r"^ARG TORCH_INDEX_URL", deps, flags=re.M) and 'index="${TORCH_INDEX_URL}"' in deps
    assert 'cpu) index=https://download.pytorch.org/whl/cpu' in deps and 'cuda) index=""' in deps
    # a proxy CA reaches pip as a build secret, never as a layer
    assert deps.count("--mount=type=secret,id=pip_cert") == 2


def test_the_lock_stage_keeps_torch_entry_alone() -> None:
    # The awk of the lock stage, run on each image lock: exactly torch's line and its hashes.
    awk = re.search(r"awk '([^']+)'", _stage("lock")).group(1)
    for variant in ("cpu", "cuda"):
        lock = REPO / "locks" / f"image-{variant}.txt"
        out = subprocess.run(["awk", awk, str(lock)], check=True, capture_output=True, text=True).stdout
        lines = out.splitlines()
        assert lines[0].startswith("torch==") and lines[0].endswith("\\"), lines[0]
        hashes = [ln for ln in lines[1:] if "--hash=sha256:" in ln]
        assert hashes and all(ln.startswith("    ") for ln in lines[1:])
        assert not any(re.match(r"^[a-z]", ln) for ln in lines[1:])


def test_layers_are_ordered_for_the_build_cache() -> None:
    deps = _stage("deps")
    torch_at = deps.index("COPY --from=lock /lock/torch.txt")
    all_at = deps.index("COPY --from=lock /lock/all.txt")
    assert torch_at < deps.index("-r /tmp/lock/torch.txt") < all_at < deps.index("-r /tmp/lock/all.txt")
    assert "COPY . " not in deps  # source changes leave torch and the dependencies cached
    assert "COPY . /src" in _stage("wheel")
    runtime = _stage("runtime")
    assert runtime.index("COPY --from=deps /opt/venv") < runtime.index("from=wheel")


def test_runtime_is_non_root_small_and_serves_every_role() -> None:
    runtime = _stage("runtime")
    users = re.findall(r"^USER (\S+)", runtime, flags=re.M)
    assert users and users[-1] == "10001:10001"  # podSecurityContext.runAsUser/runAsGroup in values.yaml
    values = yaml.safe_load((REPO / "deploy/helm/pdserve/values.yaml").read_text())["podSecurityContext"]
    assert users[-1] == f"{values['runAsUser']}:{values['runAsGroup']}"
    # tini as PID 1 (reaps what killed health checks leave behind, forwards SIGTERM), then pdserve
    assert re.search(r'^ENTRYPOINT \["tini", "--", "pdserve"\]', runtime, flags=re.M)
    assert "--role" not in runtime  # the role is chosen at run time, one image for all pools
    # no sources, build tools or pip caches: only the venv and a wheel mounted for one RUN
    assert "COPY . " not in runtime and "build-essential" not in DOCKERFILE
    apt = [ln for ln in runtime.splitlines() if "apt-get install" in ln]
    assert apt == [" && apt-get install -y --no-install-recommends tini \\"], apt
    assert "rm -rf /var/lib/apt/lists/*" in runtime
    assert "PIP_NO_CACHE_DIR=1" in runtime and "PIP_NO_CACHE_DIR=1" in _stage("deps")
    assert "--mount=type=bind,from=wheel" in runtime


def test_health_check_script_is_in_the_image() -> None:
    runtime = _stage("runtime")
    assert re.search(r'^HEALTHCHECK .*CMD \["pdserve-healthcheck"\]', runtime, flags=re.M)
    script = REPO / "deploy" / "container" / "pdserve-healthcheck"
    assert os.access(script, os.X_OK) and script.read_text().startswith("#!/opt/venv/bin/python3")
    assert "COPY deploy/container/pdserve-healthcheck /opt/venv/bin/pdserve-healthcheck" in runtime


def test_no_model_baked_in() -> None:
    copies = [ln for ln in INSTRUCTIONS if ln.startswith(("COPY", "ADD"))]
    assert copies
    for ln in copies:
        assert not re.search(r"\.models|safetensors|model init|/models", ln), ln
    assert "model init" not in _stage("runtime")


def test_dockerignore_keeps_local_state_out() -> None:
    lines = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert {".git", ".venv", ".tools", ".models", ".run", "*.safetensors", "tests", "deploy"} <= set(lines)
    # the one file of deploy/ the image needs is let back in, after deploy/ is left out
    assert lines.index("!deploy/container/pdserve-healthcheck") > lines.index("deploy")


# ----------------------------------------------------------------------------------- the lane vs the chart
def test_lane_overlay_only_switches_discovery_to_redis() -> None:
    overlay = yaml.safe_load(lane.LANE_VALUES.read_text())
    assert set(overlay) == {"router", "redis"}
    assert overlay["router"] == {"discovery": "redis"}
    assert overlay["redis"]["mode"] == "bundled"


def test_lane_renders_the_kind_preset_plus_overlay_image_and_transport() -> None:
    args = lane.helm_template_args(IMAGE, "tcp")
    files = [args[i + 1] for i, a in enumerate(args) if a == "-f"]
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    assert files == [str(REPO / "deploy/helm/values-kind.yaml"), str(lane.LANE_VALUES)]
    assert sets == ["image.repository=pdserve", "image.tag=0.1.0-cpu", "kvTransport.type=tcp"]


@pytest.mark.parametrize("transport", lane.TRANSPORTS)
def test_lane_pods_are_the_kind_presets_pods(transport: str) -> None:
    """Per role: args, probes, lifecycle, security, resources, volumes, grace and replicas are identical to
    the kind preset's render; env differs only in how the router finds workers."""
    mine = lane.render(IMAGE, transport)
    kind = render("kind", (f"kvTransport.type={transport}", "image.repository=pdserve",
                           "image.tag=0.1.0-cpu"))
    for role in ROLES:
        ours, theirs = deployment(mine, role), deployment(kind, role)
        assert ours["spec"]["replicas"] == theirs["spec"]["replicas"]
        pod_o, pod_t = ours["spec"]["template"]["spec"], theirs["spec"]["template"]["spec"]
        for key in ("securityContext", "terminationGracePeriodSeconds", "volumes", "initContainers"):
            assert pod_o.get(key) == pod_t.get(key), (role, key)
        (c_o,), (c_t,) = pod_o["containers"], pod_t["containers"]
        env_o = {e["name"]: e for e in c_o["env"] if e["name"] not in DISCOVERY_ENV}
        env_t = {e["name"]: e for e in c_t["env"] if e["name"] not in DISCOVERY_ENV}
        assert env_o == env_t, role
        for key in set(c_o) | set(c_t):
            if key != "env":
                assert c_o.get(key) == c_t.get(key), (role, key)


def _field_value(e: dict, pod: str, ip: str) -> str:
    ref = e["valueFrom"]["fieldRef"]["fieldPath"]
    return {"metadata.name": pod, "status.podIP": ip, "metadata.namespace": lane.NAMESPACE}[ref]


@pytest.mark.parametrize("transport", lane.TRANSPORTS)
def test_docker_translation_carries_every_rendered_setting(transport: str) -> None:
    docs = lane.render(IMAGE, transport)
    templates, secret_data = pod_templates(docs), secrets(docs)
    assert set(templates) == {*ROLES, "redis"}
    for comp, tpl in templates.items():
        (c,) = tpl.spec["containers"]
        pod, ip = f"{tpl.workload}-x-0", "172.30.64.9"
        spec = container_spec(tpl, c, pod=pod, pod_ip=ip, namespace=lane.NAMESPACE, secret_data=secret_data,
                              shared_volumes={"model": "vol"})
        want_env = {}
        for e in c["env"]:
            if "value" in e:
                want_env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m, env=want_env: env[m.group(1)],
                                             e["value"])
            elif "fieldRef" in e["valueFrom"]:
                want_env[e["name"]] = _field_value(e, pod, ip)
            else:
                ref = e["valueFrom"]["secretKeyRef"]
                assert secret_data[ref["name"]][ref["key"]] == "container-lane"
                want_env[e["name"]] = "container-lane"
        assert spec.env == want_env, comp
        assert "$(" not in " ".join([*spec.env.values(), *spec.args]), comp
        for kind in ("startup", "liveness", "readiness"):
            rendered = c.get(f"{kind}Probe")
            assert (kind in spec.probes) == (rendered is not None), (comp, kind)
            if rendered is None:
                continue
            p = spec.probes[kind]
            assert (p.period_s, p.timeout_s, p.failure_threshold) == (
                rendered["periodSeconds"], rendered["timeoutSeconds"], rendered.get("failureThreshold", 3))
            if "grpc" in rendered:
                assert p.command[0] == "pdserve-healthcheck"
                assert p.command[p.command.index("--port") + 1] == str(rendered["grpc"]["port"])
                assert p.command[p.command.index("--service") + 1] == rendered["grpc"]["service"]
        sc, pod_sc = c["securityContext"], tpl.spec["securityContext"]
        assert spec.user == f"{pod_sc['runAsUser']}:{pod_sc['runAsGroup']}" and spec.user != "0:0"
        assert spec.read_only is sc["readOnlyRootFilesystem"] is True
        assert spec.no_new_privileges and spec.cap_drop == ("ALL",) and spec.cap_add == ()
        assert spec.stop_timeout == tpl.spec.get("terminationGracePeriodSeconds")
        assert spec.restart == "always"  # restartPolicy: Always, the default of Deployments / StatefulSets
        hooks = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
        assert spec.pre_stop == (tuple(hooks) if hooks else None)
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        shm = {"/dev/shm"} if spec.shm_size else set()
        assert mounts == set(spec.tmpfs) | {p for _, p, _ in spec.volumes} | shm
        assert spec.cpus and spec.memory  # the chart's limits
        run = run_args(spec, container_name=pod, network="n", ip=ip)
        assert "--read-only" in run and run[run.index("--user") + 1] == spec.user
        if spec.stop_timeout is not None:  # the Redis StatefulSet keeps Kubernetes' default
            assert run[run.index("--stop-timeout") + 1] == str(spec.stop_timeout)
    grace = deployment(docs, "decode")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace == yaml.safe_load((REPO / "deploy/helm/values-kind.yaml").read_text())["drain"][
        "terminationGracePeriodSeconds"]


@pytest.mark.parametrize("change", ["hostPath volume", "configMap env", "unknown container field",
                                    "unknown pod field", "device resource", "root user"])
def test_docker_translation_refuses_what_it_cannot_express(change: str) -> None:
    docs = lane.render(IMAGE, "nixl")
    tpl = pod_templates(docs)["decode"]
    spec = copy.deepcopy(tpl.spec)
    (c,) = spec["containers"]
    if change == "hostPath volume":
        spec["volumes"].append({"name": "host", "hostPath": {"path": "/srv"}})
        c["volumeMounts"].append({"name": "host", "mountPath": "/srv"})
    elif change == "configMap env":
        c["env"].append({"name": "X", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "x"}}})
    elif change == "unknown container field":
        c["workingDir"] = "/srv"
    elif change == "unknown pod field":
        spec["hostNetwork"] = True
    elif change == "device resource":
        c["resources"]["limits"]["nvidia.com/gpu"] = 1
    elif change == "root user":
        spec["securityContext"]["runAsUser"] = 0
    changed = type(tpl)(**{**tpl.__dict__, "spec": spec})
    with pytest.raises(Unsupported):
        container_spec(changed, c, pod="p", pod_ip="172.30.64.9", namespace=lane.NAMESPACE,
                       secret_data=secrets(docs), shared_volumes={"model": "vol"})
