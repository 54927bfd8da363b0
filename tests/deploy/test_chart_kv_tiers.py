"""The chart's KV tiers (<pool>.kvTiers): the host tier's size and a disk tier on its own volume reach each
pool's workers as the `pdserve serve` settings (PDSERVE_KV_HOST_GB, PDSERVE_KV_DISK_DIR, PDSERVE_KV_DISK_GB);
at their defaults nothing is rendered; one pool's tiers never touch the other pool; the two pools take the
same keys and render the same way; a tensor-parallel pool refuses tiers (the workers do not support them
yet)."""

from __future__ import annotations

import argparse

import kubernetes_validate
import pytest
import yaml
from chart_helpers import (
    CHART,
    RELEASE,
    VALUES,
    deployment,
    render,
    render_fails,
    run_helm,
    template_args,
)
from test_chart_render import K8S_VERSIONS

DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
TIER_ENV = ("PDSERVE_KV_HOST_GB", "PDSERVE_KV_DISK_DIR", "PDSERVE_KV_DISK_GB")
DISK = ("kvTiers.disk.enabled=true",)


def pod(docs: list[dict], role: str) -> dict:
    return deployment(docs, role)["spec"]["template"]["spec"]


def env_of(spec: dict) -> dict[str, object]:
    (c,) = spec["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def kv_volume(spec: dict) -> dict | None:
    found = [v for v in spec["volumes"] if v["name"] == "kv-disk"]
    return found[0] if found else None


def kv_mount(spec: dict) -> dict | None:
    (c,) = spec["containers"]
    found = [m for m in c["volumeMounts"] if m["name"] == "kv-disk"]
    return found[0] if found else None


def render_with(tmp_path, values: dict) -> list[dict]:
    """Render with a values file (floats: `helm --set` passes 1.5 as a string, which the schema refuses)."""
    f = tmp_path / "values.yaml"
    f.write_text(yaml.safe_dump(values))
    return [d for d in yaml.safe_load_all(run_helm(*template_args(), "-f", str(f)).stdout) if d]


def on(pool: str, *sets: str) -> tuple[str, ...]:
    return tuple(f"{pool}.{s}" for s in sets)


@pytest.mark.parametrize("preset", sorted(VALUES))
def test_defaults_render_no_tiers(preset: str) -> None:
    """kvTiers at its defaults adds nothing: the worker sizes its host tier itself, no disk tier."""
    docs = render(preset)
    for role in ("prefill", "decode"):
        spec = pod(docs, role)
        assert not set(TIER_ENV) & set(env_of(spec)), role
        assert kv_volume(spec) is None and kv_mount(spec) is None


def test_pools_have_the_same_kv_tier_defaults() -> None:
    assert DEFAULTS["prefill"]["kvTiers"] == DEFAULTS["decode"]["kvTiers"] == {
        "hostGb": None,
        "disk": {"enabled": False, "sizeGb": 20, "mountPath": "/var/cache/pdserve/kv", "volume": {}},
    }
    from test_values_schema import SCHEMA

    pools = SCHEMA["properties"]
    assert pools["prefill"]["properties"]["kvTiers"] == pools["decode"]["properties"]["kvTiers"]


def test_disk_tier_on_decode_only() -> None:
    base = render("default")
    docs = render("default", on("decode", *DISK, "kvTiers.hostGb=16"))
    spec = pod(docs, "decode")
    env = env_of(spec)
    assert env["PDSERVE_KV_HOST_GB"] == "16"
    assert env["PDSERVE_KV_DISK_DIR"] == "/var/cache/pdserve/kv"
    assert env["PDSERVE_KV_DISK_GB"] == "20"
    # its own volume: an emptyDir bounded a little above the tier's own bound (20 GiB + 1Gi)
    assert kv_volume(spec) == {"name": "kv-disk", "emptyDir": {"sizeLimit": "21504Mi"}}
    assert kv_mount(spec) == {"name": "kv-disk", "mountPath": env["PDSERVE_KV_DISK_DIR"]}
    # writable by the pod's user on a read-only root filesystem: a volume, and fsGroup = the user's group
    (c,) = spec["containers"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert spec["securityContext"]["runAsUser"] == 10001 and spec["securityContext"]["fsGroup"] == 10001
    # prefill untouched, and nothing else either
    assert deployment(docs, "prefill") == deployment(base, "prefill")
    changed = [(a["kind"], a["metadata"]["name"]) for a, b in zip(base, docs, strict=True) if a != b]
    assert changed == [("Deployment", f"{RELEASE}-decode")]
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(deployment(docs, "decode"), version, strict=True)


@pytest.mark.parametrize("pool,other", [("decode", "prefill"), ("prefill", "decode")])
def test_tiers_are_per_pool_and_mirror_images(pool: str, other: str) -> None:
    """Like replicas: a pool's tiers re-render only its Deployment, and both pools render them alike."""
    for preset in ("default", "kind", "gpu"):
        base = render(preset)
        docs = render(preset, on(pool, *DISK, "kvTiers.hostGb=0", "kvTiers.disk.sizeGb=50"))
        assert len(base) == len(docs)
        changed = [(a["kind"], a["metadata"]["name"]) for a, b in zip(base, docs, strict=True) if a != b]
        assert changed == [("Deployment", f"{RELEASE}-{pool}")], (preset, changed)
        assert deployment(docs, other) == deployment(base, other)
        spec = pod(docs, pool)
        assert [env_of(spec)[k] for k in TIER_ENV] == ["0", "/var/cache/pdserve/kv", "50"]
        assert kv_volume(spec) == {"name": "kv-disk", "emptyDir": {"sizeLimit": "53760Mi"}}
        assert kv_mount(spec) == {"name": "kv-disk", "mountPath": "/var/cache/pdserve/kv"}


def test_host_tier_alone_adds_only_its_variable() -> None:
    base = env_of(pod(render("default"), "prefill"))
    for given, value in (("0", "0"), ("24", "24")):
        spec = pod(render("default", (f"prefill.kvTiers.hostGb={given}",)), "prefill")
        env = env_of(spec)
        assert env.pop("PDSERVE_KV_HOST_GB") == value and env == base
        assert kv_volume(spec) is None and kv_mount(spec) is None


@pytest.mark.parametrize("size_gb,limit", [
    (0.5, "1536Mi"),   # 512Mi + the 1Gi floor
    (1, "2048Mi"),
    (1.5, "2560Mi"),
    (20, "21504Mi"),   # 5% = 1Gi
    (100, "107520Mi"),  # 100Gi + 5%
    (1000, "1075200Mi"),
])
def test_empty_dir_size_limit_covers_the_tier(tmp_path, size_gb: float, limit: str) -> None:
    docs = render_with(tmp_path, {"decode": {"kvTiers": {"disk": {"enabled": True, "sizeGb": size_gb}}}})
    spec = pod(docs, "decode")
    assert kv_volume(spec)["emptyDir"] == {"sizeLimit": limit}
    mib = int(limit.removesuffix("Mi"))
    assert mib >= size_gb * 1024 + 1024 and mib >= size_gb * 1024 * 1.05
    assert env_of(spec)["PDSERVE_KV_DISK_GB"] == str(size_gb)


def test_a_given_volume_is_used_as_is(tmp_path) -> None:
    host_path = {"path": "/mnt/nvme/pdserve-kv", "type": "DirectoryOrCreate"}
    claim = {"volumeClaimTemplate": {"spec": {"accessModes": ["ReadWriteOnce"],
                                              "storageClassName": "local-nvme",
                                              "resources": {"requests": {"storage": "250Gi"}}}}}
    for source in ({"hostPath": host_path}, {"ephemeral": claim}):
        docs = render_with(tmp_path, {"prefill": {"kvTiers": {"hostGb": 8.5, "disk": {
            "enabled": True, "sizeGb": 200, "mountPath": "/nvme/kv", "volume": source}}}})
        spec = pod(docs, "prefill")
        assert kv_volume(spec) == {"name": "kv-disk", **source}
        assert kv_mount(spec) == {"name": "kv-disk", "mountPath": "/nvme/kv"}
        env = env_of(spec)
        assert (env["PDSERVE_KV_HOST_GB"], env["PDSERVE_KV_DISK_DIR"], env["PDSERVE_KV_DISK_GB"]) == (
            "8.5", "/nvme/kv", "200")
        assert kv_volume(pod(docs, "decode")) is None
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(deployment(docs, "prefill"), version, strict=True)


def test_rendered_tier_env_is_what_serve_reads() -> None:
    """The contract with `pdserve serve`: the variables parse into ServeSettings' tier fields and pass its
    checks (a disk tier needs both its directory and its size)."""
    from pdserve.settings import ServeSettings

    def settings(docs: list[dict]) -> ServeSettings:
        spec = pod(docs, "decode")
        (c,) = spec["containers"]
        assert c["args"] == ["serve", "--role", "decode"]
        env = {k: v for k, v in env_of(spec).items() if isinstance(v, str)}  # not the fieldRefs
        return ServeSettings.from_args(argparse.Namespace(role="decode"), env=env)

    s = settings(render("default", on("decode", *DISK, "kvTiers.hostGb=16")))
    assert (s.kv_host_gb, s.kv_disk_dir, s.kv_disk_gb) == (16.0, "/var/cache/pdserve/kv", 20.0)
    s = settings(render("default"))
    assert (s.kv_host_gb, s.kv_disk_dir, s.kv_disk_gb) == (None, "", 0.0)  # the worker's defaults


@pytest.mark.parametrize("sets", [
    ("decode.kvTiers.hostGb=4",),
    ("decode.kvTiers.disk.enabled=true",),
])
def test_tensor_parallel_pools_refuse_tiers(sets: tuple[str, ...]) -> None:
    err = render_fails("default", ("decode.tensorParallelSize=2", *sets))
    assert "decode.kvTiers" in err and "tensor parallel" in err


def test_tensor_parallel_pools_take_the_default_or_off() -> None:
    for sets in ((), ("decode.kvTiers.hostGb=0",), ("prefill.kvTiers.disk.enabled=true",)):
        docs = render("default", ("decode.tensorParallelSize=2", *sets))
        assert env_of(pod(docs, "decode")).get("PDSERVE_KV_HOST_GB") in (None, "0")
