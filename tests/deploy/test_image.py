"""Static checks of the Dockerfile (no Docker engine needed): one image for every role, CPU and CUDA
variants, pinned bases, non-root user, no model baked in, and a build context that leaves local state out."""

from __future__ import annotations

import re

from chart_helpers import REPO

DOCKERFILE = (REPO / "Dockerfile").read_text()
INSTRUCTIONS = [ln.strip() for ln in re.sub(r"\\\n", " ", DOCKERFILE).splitlines()
                if ln.strip() and not ln.lstrip().startswith("#")]


def _args() -> dict[str, str]:
    out = {}
    for ln in INSTRUCTIONS:
        m = re.match(r"ARG (\w+)=(\S+)", ln)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def test_cpu_and_cuda_variants_from_pinned_bases() -> None:
    args = _args()
    assert args["VARIANT"] == "cpu"
    stages = {m.group(2): m.group(1) for ln in INSTRUCTIONS if (m := re.match(r"FROM (\S+) AS (\S+)", ln))}
    assert {"base-cpu", "base-cuda", "build", "runtime"} <= set(stages)
    assert stages["build"] == stages["runtime"] == "base-${VARIANT}"
    for var in ("CPU_BASE", "CUDA_BASE"):
        image = args[var]
        assert ":" in image and not image.endswith(":latest"), image
    assert "cuda" in args["CUDA_BASE"] and "slim" in args["CPU_BASE"]
    assert "latest" not in " ".join(ln for ln in INSTRUCTIONS if ln.startswith("FROM"))


def test_runtime_is_non_root_and_serves_every_role() -> None:
    runtime = DOCKERFILE.split("AS runtime", 1)[1]
    users = re.findall(r"^USER (\S+)", runtime, flags=re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert users[-1].startswith("10001")  # matches podSecurityContext.runAsUser in values.yaml
    assert re.search(r'^ENTRYPOINT \["pdserve"\]', runtime, flags=re.M)
    assert "--role" not in runtime  # the role is chosen at run time, one image for all pools


def test_no_model_baked_in() -> None:
    copies = [ln for ln in INSTRUCTIONS if ln.startswith(("COPY", "ADD"))]
    assert copies
    for ln in copies:
        assert not re.search(r"\.models|safetensors|model init|/models", ln), ln
    assert "model init" not in DOCKERFILE.split("AS runtime", 1)[1]


def test_dockerignore_keeps_local_state_out() -> None:
    ignored = {ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")}
    assert {".git", ".venv", ".tools", ".models", "*.safetensors"} <= ignored
