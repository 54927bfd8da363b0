"""``pdserve planner explain``'s output: the capacity model, the knobs, what a steady load needs, and a
recorded trace's decisions step by step with their reasons (``rich`` tables; ``as_json`` for scripts).
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass

from rich.console import Group
from rich.table import Table
from rich.text import Text

from pdserve.app.planner.capacity import CapacityModel
from pdserve.app.planner.policy import Decision, Planner, PlannerConfig
from pdserve.app.planner.signals import POOLS, Signals

STEADY_WINDOW_S = 60.0


@dataclass(frozen=True)
class Load:
    """A steady load: requests per second with prompts and outputs of these many tokens."""

    rate: float
    prompt_tokens: float
    output_tokens: float

    @classmethod
    def parse(cls, spec: str) -> Load:
        """``RATE:PROMPT:OUTPUT``, e.g. ``4:2000:200``."""
        try:
            rate, prompt, output = (float(x) for x in spec.split(":"))
        except ValueError:
            raise ValueError(f"--load wants RATE:PROMPT_TOKENS:OUTPUT_TOKENS (e.g. 4:2000:200), "
                             f"got {spec!r}") from None
        if not all(math.isfinite(v) and v >= 0 for v in (rate, prompt, output)):
            raise ValueError(f"--load {spec!r}: numbers must be finite and >= 0")
        return cls(rate, prompt, output)


def steady(config: PlannerConfig, capacity: CapacityModel, load: Load) -> dict[str, tuple[float, int, str]]:
    """Per pool, what ``load`` held steady needs: ``(required, replicas within the bounds, what binds)``
    (no backlog; the decode batch by Little's law at the TPOT target: each sequence lives its output
    tokens x TPOT). Nothing is learned: the planner works on a copy of ``capacity``."""
    w = STEADY_WINDOW_S
    s = Signals(at=w, window_s=w, prompt_tokens=load.rate * load.prompt_tokens * w, requests=load.rate * w,
                output_tokens=load.rate * load.output_tokens * w,
                decode_running=load.rate * load.output_tokens * config.tpot_s)
    d = Planner(config, copy.deepcopy(capacity), clock=lambda: w).observe(s)
    out = {}
    for p in d.pools:
        lo, hi = config.bounds(p.pool)
        out[p.pool] = (p.required, min(max(math.ceil(p.required), lo), hi),
                       str(p.inputs.get("binding", "prompt tokens/s")))
    return out


def model_table(config: PlannerConfig, capacity: CapacityModel, title: str = "capacity per worker") -> Table:
    t = Table(title=title, title_justify="left")
    for name in ("pool", "what", "per worker", "planned at", "samples", "source"):
        t.add_column(name, justify="right" if name in ("per worker", "planned at", "samples") else "left")
    u = config.utilisation
    for pool, what, est in (("prefill", f"prompt tokens/s within TTFT {config.ttft_s * 1e3:g} ms",
                             capacity.prefill),
                            ("decode", f"output tokens/s within TPOT {config.tpot_s * 1e3:g} ms",
                             capacity.decode_tokens),
                            ("decode", "sequences in the batch at once", capacity.decode_sequences)):
        t.add_row(pool, what, f"{est.value:,.1f}", f"{est.value * u:,.1f}", str(est.samples), est.source)
    kv = capacity.kv_blocks_per_worker
    if kv is None:
        t.add_row("decode", "KV blocks", "-", "-", "-", "not seen yet (no trace)")
    else:
        t.add_row("decode", "KV blocks", f"{kv:,.0f}", f"{kv * u:,.0f}", "-",
                  "measured from the workers' metrics")
    return t


def knobs_text(config: PlannerConfig) -> Text:
    c = config
    return Text(
        f"SLOs: TTFT {c.ttft_s * 1e3:g} ms, TPOT {c.tpot_s * 1e3:g} ms; utilisation {c.utilisation:g}; band "
        f"{c.band:g} (up above n x {1 + c.band:g}, down below (n - 1) x {1 - c.band:g}); cool-downs up "
        f"{c.up_cooldown_s:g} s, down {c.down_cooldown_s:g} s; backlog drained within "
        f"{c.drain_horizon:g} s; demand half-life {c.demand_half_life_s:g} s; steps up <= {c.max_step_up}, "
        f"down <= {c.max_step_down}; prefill {c.min_prefill}..{c.max_prefill}, "
        f"decode {c.min_decode}..{c.max_decode}\n"
        "required = (demand + backlog / drain horizon) / (capacity per worker x utilisation); decode takes "
        "the largest of output tokens/s, sequences and KV blocks")


def steady_table(config: PlannerConfig, capacity: CapacityModel, loads: list[Load]) -> Table:
    t = Table(title="steady loads", title_justify="left")
    for name in ("req/s", "prompt", "output", "prefill needs", "prefill", "decode needs", "decode",
                 "decode bound by"):
        t.add_column(name, justify="left" if name == "decode bound by" else "right")
    for load in loads:
        need = steady(config, capacity, load)
        (p_req, p_n, _), (d_req, d_n, binding) = need["prefill"], need["decode"]
        t.add_row(f"{load.rate:g}", f"{load.prompt_tokens:g}", f"{load.output_tokens:g}", f"{p_req:.2f}",
                  str(p_n), f"{d_req:.2f}", str(d_n), binding)
    return t


def replay(config: PlannerConfig, capacity: CapacityModel, trace: list[Signals]) -> list[Decision]:
    """The decisions of a planner fed ``trace`` in order, its clock at each window's end."""
    now = [trace[0].at if trace else 0.0]
    planner = Planner(config, capacity, clock=lambda: now[0])
    out = []
    for s in trace:
        now[0] = s.at
        out.append(planner.observe(s))
    return out


def trace_table(trace: list[Signals], decisions: list[Decision], *, changes_only: bool = False) -> Table:
    t = Table(title="decisions", title_justify="left")
    for name in ("t s", "pool", "seen", "needs", "target", "why"):
        t.add_column(name, justify="left" if name in ("pool", "why") else "right", overflow="fold")
    start = trace[0].at - trace[0].window_s if trace else 0.0  # the first window ends at its length
    for s, d in zip(trace, decisions, strict=True):
        if changes_only and not d.changed():
            continue
        for p in d.pools:
            style = {"up": "bold green", "down": "bold yellow"}.get(p.direction, "")
            moved = f"{p.current} -> {p.target}" if p.direction != "hold" else str(p.target)
            t.add_row(f"{s.at - start:,.0f}", p.pool, str(s.replicas(p.pool)), f"{p.required:.2f}",
                      Text(moved, style=style), p.reason)
    return t


def summary_text(decisions: list[Decision]) -> Text:
    parts = []
    for pool in POOLS:
        dirs = [d.pool(pool).direction for d in decisions]
        final = decisions[-1].pool(pool).target if decisions else "-"
        parts.append(f"{pool}: {dirs.count('up')} up, {dirs.count('down')} down, ends at {final}")
    return Text(f"{len(decisions)} windows; " + "; ".join(parts))


def render(config: PlannerConfig, seeded: CapacityModel, *, loads: list[Load], trace: list[Signals],
           decisions: list[Decision], learned: CapacityModel | None = None,
           changes_only: bool = False) -> Group:
    """The whole explanation: knobs, the seeded model, steady loads, then the trace's decisions and the
    model as the trace left it (``learned``)."""
    parts = [knobs_text(config), model_table(config, seeded)]
    if loads:
        parts.append(steady_table(config, seeded, loads))
    if trace:
        parts += [trace_table(trace, decisions, changes_only=changes_only), summary_text(decisions)]
    if learned is not None and trace:
        parts.append(model_table(config, learned, "capacity per worker after the trace"))
    return Group(*parts)


def as_json(config: PlannerConfig, seeded: CapacityModel, *, loads: list[Load], trace: list[Signals],
            decisions: list[Decision], learned: CapacityModel | None = None) -> dict:
    return {"config": asdict(config), "capacity": seeded.to_dict(),
            "steady": [{"load": asdict(load), **{pool: dict(zip(("required", "replicas", "binding"), v,
                                                                strict=True))
                                                 for pool, v in steady(config, seeded, load).items()}}
                       for load in loads],
            "trace": [{"signals": s.to_dict(), "decision": d.to_dict()} for s, d in zip(trace, decisions,
                                                                                         strict=True)],
            "capacity_after_trace": learned.to_dict() if learned is not None and trace else None}
