"""The locks (locks/*.txt) hold what pyproject.toml asks for, and `make setup` installs exactly one of them.

The drift check is shown failing on purpose: a pyproject.toml with a requirement no lock holds, and one
whose range excludes the locked version, must both be reported.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from locks import check

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("spec", check.LOCKS, ids=lambda s: s.name)
def test_every_lock_holds_every_requirement_in_range(spec: check.LockSpec) -> None:
    assert check.drift(spec) == []


def test_each_lock_pins_hashes_and_names_make_lock() -> None:
    for spec in check.LOCKS:
        text = (ROOT / "locks" / spec.name).read_text()
        pins = check.read_lock(ROOT / "locks" / spec.name)
        assert text.count("--hash=sha256:") >= len(pins), spec.name
        assert "#    make lock" in text, f"{spec.name} was not written by `make lock`"
        assert {"pip", "setuptools"} <= set(pins), spec.name


def _pyproject_with(tmp_path: Path, extra_dependency: str) -> Path:
    text = (ROOT / "pyproject.toml").read_text()
    marker = "dependencies = [\n"
    assert marker in text
    out = tmp_path / "pyproject.toml"
    out.write_text(text.replace(marker, marker + f'    "{extra_dependency}",\n', 1))
    return out


def test_drift_reports_a_requirement_no_lock_holds(tmp_path: Path) -> None:
    pyproject = _pyproject_with(tmp_path, "left-pad-never-locked>=1.0")
    for spec in check.LOCKS:
        problems = check.drift(spec, pyproject=pyproject)
        assert problems == [f"{spec.name}: left-pad-never-locked>=1.0 is required but not locked "
                            "(run `make lock`)"]


def test_drift_reports_a_locked_version_outside_the_range(tmp_path: Path) -> None:
    numpy = check.read_lock(ROOT / "locks" / "dev-cpu.txt")["numpy"]
    pyproject = _pyproject_with(tmp_path, "numpy>=999")
    problems = check.drift(check.LOCKS[0], pyproject=pyproject)
    assert problems == [f"dev-cpu.txt: numpy>=999 is required but numpy=={numpy} is locked (run `make lock`)"]


def test_markers_are_evaluated_for_the_lock_python(tmp_path: Path) -> None:
    # A requirement for another platform is not demanded of a Linux lock; one for its Python is.
    pyproject = _pyproject_with(tmp_path, "pywin32>=300; sys_platform == 'win32'")
    assert check.drift(check.LOCKS[0], pyproject=pyproject) == []
    pyproject = _pyproject_with(tmp_path, "tomli>=2; python_version >= '3.12'")
    assert check.drift(check.LOCKS[0], pyproject=pyproject) == []
    assert check.drift(check.LOCKS[2], pyproject=pyproject) == [
        "image-cuda.txt: tomli>=2; python_version >= \"3.12\" is required but not locked (run `make lock`)"]


def test_this_environment_is_the_dev_lock() -> None:
    # make test runs in the .venv that make setup installed from locks/dev-cpu.txt: nothing more, nothing
    # less, no other version (pdserve itself is the editable install beside it).
    assert Path(sys.prefix).resolve() == (ROOT / ".venv").resolve(), "run the tests from make setup's .venv"
    assert check.venv_diff(ROOT / "locks" / "dev-cpu.txt") == []


def test_venv_diff_names_what_differs(tmp_path: Path) -> None:
    lock = tmp_path / "lock.txt"
    pins = check.read_lock(ROOT / "locks" / "dev-cpu.txt")
    pins.pop("numpy")
    lines = [f"{n}=={v}" for n, v in pins.items()] + ["not-installed-anywhere==1.0", "pytest==0.0.1"]
    lock.write_text("\n".join(lines) + "\n")
    from importlib import metadata
    diff = check.venv_diff(lock)
    assert f"not in the lock: numpy=={metadata.version('numpy')}" in diff
    assert "missing: not-installed-anywhere==1.0" in diff
    assert f"pytest: installed {metadata.version('pytest')}, locked 0.0.1" in diff
    assert len(diff) == 3


def test_what_others_put_on_sys_path_is_not_the_environment() -> None:
    # ray, once imported, puts its vendored psutil and colorama (ray/thirdparty_files) on sys.path: they
    # are ray's files, not packages installed beside the lock's.
    import ray

    vendored = Path(ray.__file__).parent / "thirdparty_files"
    assert str(vendored) in sys.path and any(vendored.glob("psutil*"))
    assert check.venv_diff(ROOT / "locks" / "dev-cpu.txt") == []
