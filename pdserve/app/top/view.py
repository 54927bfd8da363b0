"""Drawing ``pdserve top``'s rows with ``rich`` (a routers' table, a workers' table) and the refresh loop."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from pdserve.app.top.stats import RouterRow, Row, WorkerRow

DASH = "-"


def _num(v: float | None, digits: int = 1) -> str:
    if v is None or not math.isfinite(v):
        return DASH
    if abs(v) >= 1e6:
        return f"{v / 1e6:.{digits}f}M"
    if abs(v) >= 1e4:
        return f"{v / 1e3:.{digits}f}k"
    return f"{v:.{digits}f}" if v != int(v) else f"{int(v)}"


def _ms(seconds: float | None) -> str:
    return DASH if seconds is None else f"{seconds * 1e3:.1f}"


def _pct(share: float | None) -> str:
    return DASH if share is None else f"{share * 100:.0f}%"


def _bytes_rate(v: float | None) -> str:
    if v is None:
        return DASH
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if v >= scale:
            return f"{v / scale:.1f} {unit}"
    return f"{v:.0f} B/s"


def _tiers(per_s: dict[str, float] | None) -> str:
    if not per_s:
        return DASH
    return " ".join(f"{tier} {_num(v)}" for tier, v in per_s.items())


def _down(row: Row) -> Text:
    return Text("down", style="bold red")


def router_table(rows: list[RouterRow | Row]) -> Table:
    t = Table(title="router", title_justify="left", expand=False)
    for name in ("process", "address", "state", "req/s", "in flight", "TTFT p50 ms", "TTFT p90 ms",
                 "TPOT p50 ms", "TPOT p90 ms", "KV sent", "failures"):
        t.add_column(name, justify="left" if name in ("process", "address", "state") else "right")
    for r in rows:
        if not r.up or not isinstance(r, RouterRow):
            t.add_row(r.process or DASH, r.address, _down(r), *[DASH] * 8)
            continue
        t.add_row(r.process or "router", r.address, Text("up", style="green"), _num(r.requests_per_s, 2),
                  _num(r.inflight, 0), _ms(r.ttft_p50_s), _ms(r.ttft_p90_s), _ms(r.tpot_p50_s),
                  _ms(r.tpot_p90_s), _bytes_rate(r.kv_bytes_per_s), _num(r.failures, 0))
    return t


def worker_table(rows: list[WorkerRow | Row]) -> Table:
    t = Table(title="workers", title_justify="left", expand=False)
    for name in ("process", "role", "address", "state", "queue", "running", "KV used", "prompt tok/s",
                 "gen tok/s", "step p50 ms", "prefix hit tok/s"):
        t.add_column(name, justify="left" if name in ("process", "role", "address", "state",
                                                       "prefix hit tok/s") else "right")
    for r in rows:
        if not r.up or not isinstance(r, WorkerRow):
            state = _down(r) if not r.up else Text(r.error or "?", style="yellow")
            t.add_row(r.process or DASH, r.role or "?", r.address, state, *[DASH] * 7)
            continue
        t.add_row(r.process or DASH, r.role or "?", r.address, Text("up", style="green"), _num(r.queue, 0),
                  _num(r.running, 0), _pct(r.kv_used), _num(r.prompt_tokens_per_s),
                  _num(r.generated_tokens_per_s), _ms(r.step_p50_s), _tiers(r.prefix_hit_tokens_per_s))
    return t


def render(rows: list[Row], source: str, interval: float) -> Group:
    """The whole screen: a header line, the routers' table and the workers' table."""
    routers = [r for r in rows if r.role == "router"]
    workers = [r for r in rows if r.role != "router"]
    spans = [r.interval_s for r in rows if r.interval_s is not None]
    over = f"rates over the last {max(spans):.1f} s" if spans else "since start (no earlier scrape yet)"
    up = sum(r.up for r in rows)
    every = f"every {interval:g} s  " if interval > 0 else ""
    header = Text.assemble(("pdserve top", "bold"), f"  {source}  {up}/{len(rows)} up  {over}  {every}"
                           f"{time.strftime('%H:%M:%S')}")
    if not rows:
        return Group(header, Text("no targets yet", style="yellow"))
    tables = ([router_table(routers)] if routers else []) + ([worker_table(workers)] if workers else [])
    return Group(header, *tables)


def live(poll: Callable[[], list[Row]], source: str, interval: float, console: Console | None = None) -> int:
    """Refresh every ``interval`` seconds until interrupted (Ctrl-C: exit 0)."""
    console = console or Console()
    try:
        with Live(render(poll(), source, interval), console=console, auto_refresh=False,
                  transient=False) as screen:
            while True:
                time.sleep(interval)
                screen.update(render(poll(), source, interval), refresh=True)
    except KeyboardInterrupt:
        return 0
