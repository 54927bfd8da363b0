"""Build a package index for torch out of the wheels this machine's pip can get, for machines where the
PyTorch index the Dockerfile defaults to is unreachable:

    python local-torch-index.py OUT_DIR TORCH_SPEC PYTHON_VERSION

`pip download` (with this machine's pip configuration: find-links, mirrors) fetches TORCH_SPEC and its
dependencies as manylinux x86_64 wheels for PYTHON_VERSION; they are laid out as a PEP 503 "simple" index
in OUT_DIR/simple/<project>/, which `python -m http.server` can serve to `docker build` as
TORCH_INDEX_URL. Refuses a CUDA build of torch (one that pulls nvidia-* / cuda-* packages): the CPU image
must not carry several GB of CUDA libraries.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path


def main(out: Path, spec: str, python_version: str) -> int:
    wheels = out / ("wheels-" + re.sub(r"[^A-Za-z0-9.+=]+", "_", spec) + f"-py{python_version}")
    simple = out / "simple"
    shutil.rmtree(simple, ignore_errors=True)
    wheels.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(wheels),
                           "--only-binary=:all:", "--python-version", python_version,
                           "--platform", "manylinux_2_28_x86_64", spec], capture_output=True, text=True)
    # pip warns about every configured index that lacks a project; keep only what matters.
    noise = re.compile(r"WARNING: Location .* is ignored")
    sys.stderr.write("".join(ln for ln in proc.stderr.splitlines(keepends=True) if not noise.search(ln)))
    if proc.returncode != 0:
        return proc.returncode
    cuda = sorted(p.name for p in wheels.glob("*.whl") if re.match(r"(nvidia|cuda)[-_]", p.name))
    if cuda:
        print(f"{spec} resolved to a CUDA build here (it needs {', '.join(cuda[:3])}, ...); give the CPU "
              "build's index as TORCH_INDEX_URL instead", file=sys.stderr)
        return 1
    for wheel in sorted(wheels.glob("*.whl")):
        project = re.sub(r"[-_.]+", "-", wheel.name.split("-", 1)[0]).lower()
        (simple / project).mkdir(parents=True, exist_ok=True)
        try:
            (simple / project / wheel.name).hardlink_to(wheel)
        except OSError:
            shutil.copy2(wheel, simple / project / wheel.name)
    print(simple)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2], sys.argv[3]))
