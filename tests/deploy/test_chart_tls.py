"""The chart with `tls.enabled`: every pdserve pod mounts its role's kubernetes.io/tls Secret read-only,
laid out as `pdserve certs init` writes it (ca.crt, <role>.crt, <role>.key), PDSERVE_TLS_DIR points at
that mount, and no probe uses the kubelet's plaintext gRPC check: each runs pdserve-healthcheck over TLS
with the pod's own identity, readiness still asking for the role's service."""

from __future__ import annotations

import pytest
from chart_helpers import ROLES, deployment, pod_specs, render
from test_chart_invariants import SERVICE_NAMES, container, env_of

MOUNT = "/etc/pdserve/tls"


def _tls_volume(pod: dict) -> dict:
    (mount_name,) = [m["name"] for c in pod["containers"] for m in c["volumeMounts"]
                     if m["mountPath"] == MOUNT]
    (vol,) = [v for v in pod["volumes"] if v["name"] == mount_name]
    return vol


def _arg(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


@pytest.mark.parametrize("sets", [(), ("tls.secrets.decode=decode-from-cert-manager",
                                       "tls.mountPath=/etc/pdserve/tls")])
def test_every_pod_mounts_its_roles_secret_and_points_the_env_at_it(sets: tuple[str, ...]) -> None:
    docs = render("tls", sets)
    for role in ROLES:
        pod = deployment(docs, role)["spec"]["template"]["spec"]
        c = container(docs, role)
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == MOUNT]
        assert mount["readOnly"] is True
        secret = _tls_volume(pod)["secret"]
        want = "decode-from-cert-manager" if sets and role == "decode" else f"pdserve-{role}-tls"
        assert secret["secretName"] == want
        # the kubernetes.io/tls keys mapped onto the --tls-dir layout, this role's identity only
        assert {i["key"]: i["path"] for i in secret["items"]} == {
            "ca.crt": "ca.crt", "tls.crt": f"{role}.crt", "tls.key": f"{role}.key"}
        assert secret["defaultMode"] & 0o007 == 0  # the key is not world-readable
        assert env_of(c)["PDSERVE_TLS_DIR"] == MOUNT


def test_probes_are_tls_health_checks_not_kubelet_grpc() -> None:
    docs = render("tls")
    for role in ROLES:
        c = container(docs, role)
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            p = c[probe]
            assert "grpc" not in p and "tcpSocket" not in p and "httpGet" not in p, (role, probe)
            cmd = p["exec"]["command"]
            assert cmd[0] == "pdserve-healthcheck"
            assert _arg(cmd, "--tls-dir") == MOUNT and _arg(cmd, "--tls-name") == role
            assert _arg(cmd, "--port") == "50051"
            assert float(_arg(cmd, "--timeout")) <= p["timeoutSeconds"]
        assert _arg(c["readinessProbe"]["exec"]["command"], "--service") == SERVICE_NAMES[role]
        assert _arg(c["livenessProbe"]["exec"]["command"], "--service") == ""


def test_tls_off_mounts_nothing_and_sets_no_env() -> None:
    docs = render("default")
    for role in ROLES:
        c = container(docs, role)
        assert "PDSERVE_TLS_DIR" not in env_of(c)
        assert all(m["mountPath"] != MOUNT for m in c["volumeMounts"])
        assert "grpc" in c["readinessProbe"]


def test_helm_test_pod_verifies_the_router_with_the_ca() -> None:
    (pod,) = [p for _, p in pod_specs(render("tls")) if p["containers"][0]["name"] == "client"]
    args = pod["containers"][0]["args"]
    assert _arg(args, "--tls-dir") == MOUNT
    secret = _tls_volume(pod)["secret"]
    assert secret["secretName"] == "pdserve-router-tls"
    assert [i["key"] for i in secret["items"]] == ["ca.crt"]  # no key leaves the router's Secret
