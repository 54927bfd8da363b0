"""Length distributions for the load generator, and traces of (input, output) lengths.

Specs (``parse_dist``)::

    512                          fixed
    uniform:LO:HI                integers in [LO, HI]
    normal:MEAN:STD              rounded, clipped to [1, MEAN + 4 STD]
    lognormal:MEDIAN:SIGMA       exp(N(ln MEDIAN, SIGMA)), rounded, clipped to [1, MEDIAN * e^(4 SIGMA)]
    lognormal:MEDIAN:SIGMA:LO:HI the same clipped to [LO, HI] (a mixed workload: median 2k, 256..8k)

A log-normal is the usual shape of real prompt lengths (many short, a long tail); the median, not the
mean, is the parameter because that is what a trace's summary reports. ``load_trace(path)`` reads a
JSONL file of ``{"input": N, "output": M}`` lines (``input_len``/``output_len`` and
``prompt_tokens``/``output_tokens`` are accepted too): the runner replays those pairs in order,
cycling, so the lengths of a production log keep their correlation.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

KINDS = ("const", "uniform", "normal", "lognormal")


@dataclass(frozen=True, kw_only=True)
class Dist:
    kind: str
    a: float
    b: float = 0.0
    lo: int = 1
    hi: int = 0  # 0: the kind's own bound (see ``max``)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown distribution kind {self.kind!r}")
        if self.kind == "const" and self.a < 1:
            raise ValueError(f"length must be >= 1, got {self.a:g}")
        if self.kind == "uniform" and not 1 <= self.a <= self.b:
            raise ValueError(f"uniform:LO:HI needs 1 <= LO <= HI, got {self.a:g}, {self.b:g}")
        if self.kind == "normal" and (self.a < 1 or self.b < 0):
            raise ValueError(f"normal:MEAN:STD needs MEAN >= 1 and STD >= 0, got {self.a:g}, {self.b:g}")
        if self.kind == "lognormal" and (self.a < 1 or self.b < 0):
            raise ValueError(f"lognormal:MEDIAN:SIGMA needs MEDIAN >= 1 and SIGMA >= 0, got {self.a:g}, "
                             f"{self.b:g}")
        if self.lo < 1 or (self.hi and self.hi < self.lo):
            raise ValueError(f"clip bounds need 1 <= LO <= HI, got {self.lo}, {self.hi}")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "const":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        if self.kind == "normal":
            value = rng.gauss(self.a, self.b)
        else:
            value = rng.lognormvariate(math.log(self.a), self.b)
        return int(min(max(self.lo, round(value)), self.max))

    @property
    def max(self) -> int:
        if self.hi:
            return self.hi
        if self.kind == "lognormal":
            return int(self.a * math.exp(4 * self.b))
        return int({"const": self.a, "uniform": self.b, "normal": self.a + 4 * self.b}[self.kind])


USAGE = "use N, uniform:LO:HI, normal:MEAN:STD or lognormal:MEDIAN:SIGMA[:LO:HI]"


def parse_dist(spec: str) -> Dist:
    parts = spec.strip().split(":")
    try:
        if len(parts) == 1:
            return Dist(kind="const", a=float(int(parts[0])))
        if parts[0] in ("uniform", "normal") and len(parts) == 3:
            return Dist(kind=parts[0], a=float(parts[1]), b=float(parts[2]))
        if parts[0] == "lognormal" and len(parts) in (3, 5):
            clip = {"lo": int(parts[3]), "hi": int(parts[4])} if len(parts) == 5 else {}
            return Dist(kind="lognormal", a=float(parts[1]), b=float(parts[2]), **clip)
    except ValueError as exc:
        raise ValueError(f"bad length distribution {spec!r}: {exc}") from None
    raise ValueError(f"bad length distribution {spec!r}; {USAGE}")


_KEYS = (("input", "output"), ("input_len", "output_len"), ("prompt_tokens", "output_tokens"))


def load_trace(path: str | Path) -> tuple[tuple[int, int], ...]:
    """(input, output) token counts, one pair per JSONL line (blank lines skipped); ValueError names
    the line of anything else."""
    pairs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                keys = next(k for k in _KEYS if k[0] in row and k[1] in row)
                inp, out = int(row[keys[0]]), int(row[keys[1]])
            except (json.JSONDecodeError, StopIteration, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{n}: want {{\"input\": N, \"output\": M}}, got "
                                 f"{line.strip()[:80]!r} ({type(exc).__name__})") from None
            if inp < 1 or out < 1:
                raise ValueError(f"{path}:{n}: lengths must be >= 1, got input {inp}, output {out}")
            pairs.append((inp, out))
    if not pairs:
        raise ValueError(f"{path}: no (input, output) pairs")
    return tuple(pairs)
