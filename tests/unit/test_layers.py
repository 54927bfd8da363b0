"""The package layout of docs/architecture.md, checked against the code.

import-linter (``make lint``, contracts in pyproject.toml) holds the layers; these tests hold what its
contracts cannot say: no import cycle anywhere in the library, every floor module listed in the floor
contract, and the process environment read in ``pdserve/settings.py`` only.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import grimp

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("pdserve", "router", "prefill_service", "decode_service", "kvtransfer", "engine")


def _graph() -> grimp.ImportGraph:
    return grimp.build_graph(*LIBRARY, cache_dir=None)


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    modules = sorted(graph.modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in modules:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        comp.append(member)
                        if member == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_cycles_in_the_library() -> None:
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles (break them; docs/architecture.md): {cycles}"


def test_every_floor_module_is_in_the_floor_contract() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    floor = next(c for c in config if c["name"].startswith("floor"))
    listed = set(floor["source_modules"])
    top_level = {p.stem if p.is_file() else p.name for p in (ROOT / "pdserve").iterdir()
                 if (p.suffix == ".py" and p.stem != "__init__")
                 or (p.is_dir() and (p / "__init__.py").exists())}
    actual = {f"pdserve.{name}" for name in top_level} - {"pdserve.app"}
    assert actual == listed, (
        f"pyproject.toml's floor contract must list every pdserve module but pdserve.app: "
        f"missing {sorted(actual - listed)}, stale {sorted(listed - actual)}")


def _environ_reads(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), filename=str(path))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                lines.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            if any(alias.name in ("environ", "getenv") for alias in node.names):
                lines.append(node.lineno)
    return lines


def test_environment_is_read_in_settings_only() -> None:
    offenders = []
    for package in LIBRARY:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "pdserve/settings.py" or rel.startswith("pdserve/v1/"):
                continue
            offenders += [f"{rel}:{line}" for line in _environ_reads(path)]
    assert not offenders, f"os.environ outside pdserve/settings.py (add an accessor there): {offenders}"
