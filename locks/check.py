"""The locks against what they must agree with: pyproject.toml's requirements, and an installed environment.

    python -m locks.check drift            every lock holds every requirement it must, inside its range
    python -m locks.check venv [LOCK]      this interpreter's environment is exactly LOCK (default dev-cpu)

`make setup` runs `venv` after installing, `make lock` and the tests run `drift` (tests/unit/test_locks.py).
A lock is what `uv pip compile --generate-hashes` writes: `name==version \\` lines with hashes under them.
Which requirements each lock must hold is the table `LOCKS` below, the same inputs `locks/compile.sh`
gives uv; markers are evaluated for the lock's own Python on Linux x86_64.
"""

from __future__ import annotations

import re
import sys
import sysconfig
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
LOCK_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")


@dataclass(frozen=True, kw_only=True)
class LockSpec:
    """One lock: its file, the Python it is for, and where its requirements come from."""

    name: str
    python: str  # "3.11": markers are evaluated for this version on Linux x86_64
    extras: tuple[str, ...] = ()  # pyproject optional-dependencies groups included whole
    inputs: tuple[str, ...] = ()  # locks/*.in files (requirements, one per line)
    picked: tuple[str, ...] = ()  # single packages of an optional group, held to pyproject's range

    def __post_init__(self) -> None:
        if not re.fullmatch(r"3\.\d+", self.python):
            raise ValueError(f"python must look like 3.11, got {self.python!r}")


LOCKS = (
    LockSpec(name="dev-cpu.txt", python="3.11", extras=("dev", "cluster", "nixl"), inputs=("tools.in",)),
    LockSpec(name="image-cpu.txt", python="3.11", extras=("nixl",), inputs=("image.in", "tools.in"),
             picked=("kubernetes",)),
    # nixl-cu13 (image-cuda.in) stands in for the nixl extra's nixl-cu12.
    LockSpec(name="image-cuda.txt", python="3.12", inputs=("image.in", "image-cuda.in", "tools.in"),
             picked=("kubernetes",)),
)


def read_lock(path: Path) -> dict[str, str]:
    """{canonical name: version} of a lock file."""
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        m = LOCK_LINE.match(line)
        if m:
            pins[canonicalize_name(m.group(1))] = m.group(2)
    if not pins:
        raise ValueError(f"{path}: no name==version lines")
    return pins


def _requirements(spec: LockSpec, pyproject: Path, locks_dir: Path) -> list[Requirement]:
    project = tomllib.loads(pyproject.read_text())["project"]
    lines = list(project["dependencies"])
    for extra in spec.extras:
        lines += project["optional-dependencies"][extra]
    for name in spec.inputs:
        for raw in (locks_dir / name).read_text().splitlines():
            line = raw.split("#", 1)[0].strip()
            if line:
                lines.append(line)
    for group in project["optional-dependencies"].values():
        lines += [r for r in group if canonicalize_name(Requirement(r).name) in spec.picked]
    return [Requirement(line) for line in lines]


def drift(spec: LockSpec, *, pyproject: Path = ROOT / "pyproject.toml",
          locks_dir: Path = ROOT / "locks") -> list[str]:
    """What `spec`'s lock lacks: requirements it does not hold, or holds at a version out of range."""
    pins = read_lock(locks_dir / spec.name)
    env = default_environment()
    env.update(python_version=spec.python, python_full_version=f"{spec.python}.0",
               sys_platform="linux", platform_system="Linux", platform_machine="x86_64",
               os_name="posix", implementation_name="cpython", platform_python_implementation="CPython")
    problems = []
    for req in _requirements(spec, pyproject, locks_dir):
        name = canonicalize_name(req.name)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        if name not in pins:
            problems.append(f"{spec.name}: {req} is required but not locked (run `make lock`)")
        elif not req.specifier.contains(Version(pins[name]), prereleases=True):
            problems.append(f"{spec.name}: {req} is required but {name}=={pins[name]} is locked "
                            "(run `make lock`)")
    return problems


def venv_diff(lock: Path, *, exclude: tuple[str, ...] = ("pdserve",)) -> list[str]:
    """Differences between this interpreter's installed distributions and `lock` (empty: equal)."""
    pins = read_lock(lock)
    # The environment's own site-packages, not all of sys.path: ray, once imported, puts its vendored
    # psutil and colorama (ray/thirdparty_files) on sys.path.
    paths = sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions(path=paths)}
    for name in exclude:
        installed.pop(name, None)
    out = [f"missing: {n}=={v}" for n, v in sorted(pins.items()) if n not in installed]
    out += [f"not in the lock: {n}=={v}" for n, v in sorted(installed.items()) if n not in pins]
    out += [f"{n}: installed {installed[n]}, locked {v}" for n, v in sorted(pins.items())
            if n in installed and installed[n] != v]
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["drift"]:
        problems = [p for spec in LOCKS for p in drift(spec)]
    elif argv[:1] == ["venv"]:
        lock = Path(argv[1]) if len(argv) > 1 else ROOT / "locks" / "dev-cpu.txt"
        problems = venv_diff(lock)
        if problems:
            problems.append(f"{sys.prefix} is not {lock}: `rm -rf .venv && make setup` makes it again")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
