"""Run the whole test suite N times, each in a fresh random order, and report every run:
``make test-repeat N=10`` (or ``python tests/repeat.py --runs 10 -- [pytest args]``).

A test that depends on timing, on the order tests run in or on another test's leftovers fails in
some orders only; one green run says little about that, N runs with N seeds say more. Per run: its
index, the pytest-randomly seed, passed / failed / errors / skipped (from pytest's JUnit XML), the
seconds it took and the ids of the tests that failed; then a summary with the replay command of
every red run. Exits 1 if any run was red. Logs and XML stay under ``--out`` (default
``.run/test-repeat``).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

_SEED = re.compile(r"Using --randomly-seed=(\d+)")


@dataclass
class Run:
    index: int
    seed: str = "?"
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    seconds: float = 0.0
    returncode: int = 0
    bad: list[str] = field(default_factory=list)

    @property
    def green(self) -> bool:
        return self.returncode == 0 and not self.failed and not self.errors and self.passed > 0

    def row(self) -> str:
        return (f"{self.index:>3}  {self.seed:>10}  {self.passed:>6}  {self.failed:>6}  {self.errors:>6}  "
                f"{self.skipped:>7}  {self.seconds:>8.1f}  {'ok' if self.green else 'RED'}")


HEADER = (f"{'run':>3}  {'seed':>10}  {'passed':>6}  {'failed':>6}  {'errors':>6}  {'skipped':>7}  "
          f"{'seconds':>8}")


def _read_junit(path: Path, run: Run) -> None:
    """Counts and failing test ids from pytest's JUnit XML (one <testcase> per test outcome)."""
    if not path.exists():
        return
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None:
            run.failed += 1
            run.bad.append(f"FAILED {name}")
        elif case.find("error") is not None:
            run.errors += 1
            run.bad.append(f"ERROR {name}")
        elif case.find("skipped") is not None:
            run.skipped += 1
        else:
            run.passed += 1


def run_once(index: int, pytest_args: list[str], out: Path) -> Run:
    run = Run(index)
    log, xml = out / f"run-{index:02d}.log", out / f"run-{index:02d}.xml"
    xml.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "randomly", f"--junitxml={xml}", *pytest_args]
    start = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False)
    run.seconds = time.monotonic() - start
    run.returncode = proc.returncode
    m = _SEED.search(log.read_text(errors="replace"))
    run.seed = m.group(1) if m else "?"
    _read_junit(xml, run)
    if proc.returncode not in (0, 1) and not run.bad:  # usage error, interrupted, collection failed
        run.bad.append(f"pytest exited {proc.returncode}: see {log}")
    if proc.returncode == 5:  # no tests collected: nothing was checked
        run.bad.append("no tests were collected")
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--out", default=".run/test-repeat", help="per-run logs and JUnit XML")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: passed to every pytest run")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be >= 1")
    pytest_args = [a for a in args.pytest_args if a != "--"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{args.runs} runs of: pytest -q -p randomly {' '.join(pytest_args)} (logs in {out}/)")
    print(HEADER, flush=True)
    runs = []
    for i in range(1, args.runs + 1):
        run = run_once(i, pytest_args, out)
        runs.append(run)
        print(run.row(), flush=True)
        for line in run.bad:
            print(f"       {line}", flush=True)
        if run.returncode in (2, 3, 4):  # a collection, internal or usage error: each run would repeat it
            print(f"pytest exited {run.returncode} (not a test outcome): stopping; see {out}/run-{i:02d}.log")
            break
    red = [r for r in runs if not r.green]
    total = sum(r.seconds for r in runs)
    print(f"\n{len(runs) - len(red)}/{len(runs)} runs green, {total:.0f} s in all "
          f"(min {min(r.seconds for r in runs):.0f} s, max {max(r.seconds for r in runs):.0f} s)")
    print("seeds: " + " ".join(r.seed for r in runs))
    for r in red:
        print(f"run {r.index} red; replay: make test PYTEST_ARGS=\"-p randomly --randomly-seed={r.seed}\"")
    return 1 if red else 0


if __name__ == "__main__":
    raise SystemExit(main())
