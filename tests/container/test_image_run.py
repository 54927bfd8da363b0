"""The image on its own, with nothing but its defaults: `docker run IMAGE --help`, the user it runs as, what
it leaves out, and a worker that serves from a read-only root filesystem and turns healthy by the image's
own HEALTHCHECK, then drains and exits 0 on `docker stop`."""

from __future__ import annotations

import json
import uuid

import pytest
from lane import docker, logs_tail, wait_healthy

pytestmark = pytest.mark.timeout(900)


def test_docker_run_help(image: str) -> None:
    p = docker("run", "--rm", image, "--help", timeout=300)
    assert "serve" in p.stdout and "model" in p.stdout, p.stdout
    default = docker("run", "--rm", image, timeout=300)  # CMD is --help as well
    assert default.stdout == p.stdout
    version = docker("run", "--rm", image, "--version", timeout=300)
    assert version.stdout.startswith("pdserve "), version.stdout


def test_non_root_without_build_tools_or_caches(image: str) -> None:
    config = json.loads(docker("image", "inspect", image).stdout)[0]["Config"]
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"] == ["tini", "--", "pdserve"]
    assert config["Healthcheck"]["Test"] == ["CMD", "pdserve-healthcheck"]
    ids = docker("run", "--rm", "--entrypoint", "sh", image, "-c", "id -u; id -g", timeout=300).stdout.split()
    assert ids == ["10001", "10001"], ids
    # Looked for as root, so that nothing is hidden by permissions.
    script = ("for t in gcc cc c++ make ld as git; do command -v $t; done; "
              "for d in /root/.cache /home/pdserve/.cache /var/lib/apt/lists /src /wheels /tmp; do "
              "[ -n \"$(ls -A $d 2>/dev/null)\" ] && echo $d; done; "
              "find /opt /home /root /tmp -name '*.whl' 2>/dev/null | head -5; true")
    as_root = ["run", "--rm", "--user", "0", "--entrypoint", "sh", image, "-c", script]
    found = docker(*as_root, timeout=300).stdout
    assert found.split() == [], f"build tools, caches or build leftovers in the runtime image: {found}"


def test_worker_serves_from_a_read_only_root_and_drains(image: str, tmp_path) -> None:
    """Only /tmp is writable; the model goes into a fresh Docker volume (owned by the image's user)."""
    name = f"pdserve-image-{uuid.uuid4().hex[:6]}"
    volume = f"{name}-model"
    common = ["--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
              "--label", f"pdserve.lane={name}",
              "--mount", f"type=volume,source={volume},destination=/models"]
    try:
        init = docker("run", "--rm", *common, image, "model", "init", "--preset", "tiny", "--seed", "0",
                      "--out", "/models/tiny", timeout=600, check=False)
        assert init.returncode == 0, init.stdout + init.stderr
        docker("run", "--detach", "--name", name, *common, image, "serve", "--role", "colocated",
               "--model", "/models/tiny", "--device", "cpu", "--num-blocks", "64", "--drain-timeout", "5")
        wait_healthy(name, timeout=600)  # the image's HEALTHCHECK: grpc.health.v1 "" is SERVING
        docker("stop", "--time", "30", name, timeout=120)
        state = json.loads(docker("inspect", "--format", "{{json .State}}", name).stdout)
        assert state["ExitCode"] == 0, f"exit {state['ExitCode']}:\n{logs_tail(name)}"
    finally:
        (tmp_path / f"{name}.log").write_text(logs_tail(name, 400))
        docker("rm", "--force", name, check=False)
        docker("volume", "rm", volume, check=False)
