"""pdserve.bytecode: a process whose install ships no bytecode compiles once into a private cache and loads
from it afterwards; an install with bytecode, ``off`` and a prefix the user set are left alone.

Each case runs in a fresh interpreter with ``PYTHONDONTWRITEBYTECODE=1`` (what the images that ship no
bytecode set), a throwaway package on its path, and ``XDG_CACHE_HOME`` in a temporary directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
from pdserve import bytecode
used = bytecode.enable(probes=("pdprobe_pkg",))
import pdprobe_pkg.mod
print(json.dumps({"used": used, "prefix": sys.pycache_prefix, "cached": pdprobe_pkg.mod.__cached__,
                  "loaded_from_bytecode": type(pdprobe_pkg.mod.__loader__).__name__,
                  "dont_write": sys.dont_write_bytecode}))
"""


def _package(tmp_path: Path, with_bytecode: bool) -> Path:
    src = tmp_path / "src"
    pkg = src / "pdprobe_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("VALUE = 42\n")
    if with_bytecode:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(pkg)], check=True)
    return src


def _run(tmp_path: Path, src: Path, **env: str) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", "PDSERVE_BYTECODE_CACHE")}
    full.update(PYTHONDONTWRITEBYTECODE="1", XDG_CACHE_HOME=str(tmp_path / "xdg"),
                PYTHONPATH=os.pathsep.join([str(src), str(ROOT)]), **env)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=full, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_no_bytecode_installed_compiles_once_into_the_private_cache(tmp_path: Path) -> None:
    src = _package(tmp_path, with_bytecode=False)
    cache = tmp_path / "xdg" / "pdserve" / "bytecode"
    first = _run(tmp_path, src)
    assert first["used"] == str(cache) == first["prefix"]
    assert first["dont_write"] is False
    cached = Path(first["cached"])
    assert cached.is_relative_to(cache) and cached.exists(), first
    assert not (src / "pdprobe_pkg" / "__pycache__").exists()  # nothing written beside the sources
    assert (cache.stat().st_mode & 0o777) == 0o700
    mtime = cached.stat().st_mtime_ns
    second = _run(tmp_path, src)
    assert second["cached"] == first["cached"]
    assert cached.stat().st_mtime_ns == mtime  # read, not written again


def test_an_install_with_bytecode_is_left_alone(tmp_path: Path) -> None:
    src = _package(tmp_path, with_bytecode=True)
    got = _run(tmp_path, src)
    assert got["used"] is None and got["prefix"] is None and got["dont_write"] is True
    assert Path(got["cached"]).is_relative_to(src / "pdprobe_pkg" / "__pycache__")
    assert not (tmp_path / "xdg").exists()


def test_off_and_the_users_own_prefix_win(tmp_path: Path) -> None:
    src = _package(tmp_path, with_bytecode=False)
    off = _run(tmp_path, src, PDSERVE_BYTECODE_CACHE="off")
    assert off["used"] is None and off["prefix"] is None and off["dont_write"] is True
    own = tmp_path / "own"
    mine = _run(tmp_path, src, PYTHONPYCACHEPREFIX=str(own))
    assert mine["used"] is None and mine["prefix"] == str(own)


def test_a_named_directory_is_used_whatever_the_install_holds(tmp_path: Path) -> None:
    src = _package(tmp_path, with_bytecode=True)
    volume = tmp_path / "volume" / "bytecode"
    got = _run(tmp_path, src, PDSERVE_BYTECODE_CACHE=str(volume))
    assert got["used"] == str(volume) and Path(got["cached"]).is_relative_to(volume)
    assert Path(got["cached"]).exists()


def test_a_directory_another_user_owns_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve import bytecode

    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    monkeypatch.setattr(os, "getuid", lambda: theirs.stat().st_uid + 1)  # someone else's directory
    assert bytecode.enable(str(theirs)) is None
    assert sys.pycache_prefix is None and sys.dont_write_bytecode is True


def test_the_cli_turns_it_on_before_the_commands_import(tmp_path: Path) -> None:
    cache = tmp_path / "cli-cache"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PDSERVE_BYTECODE_CACHE": str(cache),
           "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONPYCACHEPREFIX", None)
    code = "import sys; from pdserve.app.cli import main; sys.exit(main(['--help']))"
    subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=True)
    written = {p.name.split(".")[0] for p in cache.rglob("*.pyc")}
    assert {"serve", "up", "serve_flags"} <= written, sorted(written)
