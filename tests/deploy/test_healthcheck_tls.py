"""The image's health check over TLS: what the chart's exec probes run when `tls.enabled` (the kubelet's
gRPC probes speak plaintext only). Against a worker-style port that requires a client certificate of
the cluster CA: SERVING with the role's identity, refused without TLS or with another CA's files."""

from __future__ import annotations

import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.app.certs import init_certs
from pdserve.tls import TlsDir

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "container" / "pdserve-healthcheck"


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    cluster, stranger = tmp_path_factory.mktemp("tls"), tmp_path_factory.mktemp("tls-other")
    init_certs(cluster, days=2)
    init_certs(stranger, days=2)
    servicer = health.HealthServicer()
    servicer.set("pdserve.v1.Decode", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("pdserve.v1.Prefill", health_pb2.HealthCheckResponse.NOT_SERVING)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", TlsDir(cluster).server_credentials(
        "decode", require_client_cert=True))
    server.start()
    yield port, cluster, stranger
    server.stop(None).wait()


def _check(port: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-IS", str(SCRIPT), "--port", str(port), "--timeout", "20", *args],
                          capture_output=True, text=True, timeout=60)


def test_tls_check_reports_the_role_service(worker) -> None:
    port, cluster, _ = worker
    ok = _check(port, "--service", "pdserve.v1.Decode", "--tls-dir", str(cluster), "--tls-name", "decode")
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stdout + ok.stderr
    overall = _check(port, "--tls-dir", str(cluster), "--tls-name", "decode")
    assert overall.returncode == 0, overall.stdout
    not_serving = _check(port, "--service", "pdserve.v1.Prefill", "--tls-dir", str(cluster),
                         "--tls-name", "decode")
    assert not_serving.returncode == 1 and "NOT_SERVING" in not_serving.stdout


def test_tls_check_fails_without_the_cluster_files(worker) -> None:
    port, cluster, stranger = worker
    assert _check(port, "--service", "pdserve.v1.Decode").returncode == 1              # plaintext
    foreign = _check(port, "--tls-dir", str(stranger), "--tls-name", "decode")          # another CA
    assert foreign.returncode == 1, foreign.stdout
    wrong_name = _check(port, "--tls-dir", str(cluster), "--tls-name", "prefill")       # not a decode port
    assert wrong_name.returncode == 1, wrong_name.stdout
    assert _check(port, "--tls-dir", str(cluster)).returncode == 2                      # usage error
