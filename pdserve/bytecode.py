"""A bytecode cache of our own for installs that ship none.

Python compiles every module it imports from source unless a ``.pyc`` for it is found, and it writes
none back when ``PYTHONDONTWRITEBYTECODE`` is set or the package's directory is not writable. pip
compiles bytecode at install time; ``uv pip install`` and many image recipes do not, and those
images also set ``PYTHONDONTWRITEBYTECODE=1``. Such a process recompiles torch's ~2,000 modules at
every start: on an H200 host ``import torch`` took 4.2-5.1 s that way and 1.8-2.4 s with bytecode
(docs/gpu.md, "Boot"), most of a fresh worker's start.

``enable`` runs first thing in every ``pdserve`` process (the CLI's ``main`` and the launcher's zygote).
With the default ``auto`` it looks whether the heaviest package it will import (torch, else grpc) has
bytecode beside its sources; only where it has none does it point ``sys.pycache_prefix`` at a private
cache directory and let Python write there (``sys.dont_write_bytecode = False``). Where bytecode is
installed nothing changes: a prefix would make Python ignore the installed ``__pycache__`` folders.
Python checks each cached file against its source's size and modification time, so a cache outlives
upgrades safely, and writes each one atomically, so processes starting together do not clash.

``PDSERVE_BYTECODE_CACHE``: ``auto`` (unset), ``off`` (or ``0``), or a directory used whatever the
install holds (a Kubernetes volume kept across restarts). The directory is made ``0700``, and one
owned by another user is not used: whoever can write it could change the code this process runs.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

from pdserve import settings

log = logging.getLogger(__name__)

PROBES = ("torch", "grpc")  # the first one installed decides whether the install ships bytecode


def enable(setting: str | None = None, probes: tuple[str, ...] = PROBES) -> str | None:
    """Turn the cache on where it is wanted (see the module). Returns its directory, or None."""
    setting = settings.bytecode_cache() if setting is None else setting
    if setting == "off" or sys.pycache_prefix:  # a prefix the user set wins
        return None
    if setting == "auto" and not _ships_no_bytecode(probes):
        return None
    root = Path(setting)
    try:
        if setting == "auto":
            root = settings.cache_home() / "pdserve" / "bytecode"
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        if root.stat().st_uid != os.getuid() or not os.access(root, os.W_OK):
            log.warning("bytecode cache %s: not owned and writable by this user, not used", root)
            return None
    except (OSError, RuntimeError) as exc:  # RuntimeError: no home directory to be found
        log.warning("bytecode cache %s: %s; modules are compiled from source at every start", root, exc)
        return None
    sys.pycache_prefix = str(root)
    sys.dont_write_bytecode = False
    return str(root)


def _ships_no_bytecode(probes: tuple[str, ...]) -> bool:
    for name in probes:
        try:
            spec = importlib.util.find_spec(name)  # a top-level name: found, not imported
        except (ImportError, ValueError):
            continue
        if spec is None or not (spec.origin or "").endswith(".py"):
            continue
        return not Path(importlib.util.cache_from_source(spec.origin)).exists()
    return False
