"""Length distributions for the load generator: ``512``, ``uniform:128:512``, ``normal:MEAN:STD``.

``parse_dist(spec)`` returns a ``Dist`` whose ``sample(rng)`` yields an int >= 1 (normal samples are
rounded and clipped to [1, mean + 4 std]).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Dist:
    kind: str
    a: float
    b: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("const", "uniform", "normal"):
            raise ValueError(f"unknown distribution kind {self.kind!r}")
        if self.kind == "const" and self.a < 1:
            raise ValueError(f"length must be >= 1, got {self.a:g}")
        if self.kind == "uniform" and not 1 <= self.a <= self.b:
            raise ValueError(f"uniform:LO:HI needs 1 <= LO <= HI, got {self.a:g}, {self.b:g}")
        if self.kind == "normal" and (self.a < 1 or self.b < 0):
            raise ValueError(f"normal:MEAN:STD needs MEAN >= 1 and STD >= 0, got {self.a:g}, {self.b:g}")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "const":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        value = round(rng.gauss(self.a, self.b))
        return int(min(max(1, value), self.a + 4 * self.b))

    @property
    def max(self) -> int:
        return int({"const": self.a, "uniform": self.b, "normal": self.a + 4 * self.b}[self.kind])


def parse_dist(spec: str) -> Dist:
    parts = spec.strip().split(":")
    try:
        if len(parts) == 1:
            return Dist(kind="const", a=float(int(parts[0])))
        if parts[0] in ("uniform", "normal") and len(parts) == 3:
            return Dist(kind=parts[0], a=float(parts[1]), b=float(parts[2]))
    except ValueError as exc:
        raise ValueError(f"bad length distribution {spec!r}: {exc}") from None
    raise ValueError(f"bad length distribution {spec!r}; use N, uniform:LO:HI or normal:MEAN:STD")
