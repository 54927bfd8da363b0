"""PNG of a goodput-frontier sweep: p90 TTFT and p90 ITL against the offered rate, one line per mode.

The SLO targets are drawn as horizontal lines and each mode's SLO-goodput rate as a dotted vertical
one in its colour, so where a mode's curve crosses its target is visible at a glance. Needs
matplotlib (the ``dev`` extra); without it ``plot_frontier`` raises ImportError saying so.
"""

from __future__ import annotations

from pathlib import Path


def plot_frontier(results: dict[str, dict], path: str | Path, *, title: str = "") -> Path:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("the sweep's plots need matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    slo = next((r["slo"] for r in results.values() if "slo" in r), {})
    for ax, metric, target, name in ((axes[0], "ttft_ms", slo.get("ttft_ms"), "TTFT"),
                                     (axes[1], "itl_ms", slo.get("tpot_ms"), "ITL")):
        for mode, res in results.items():
            pts = sorted(res.get("points", []), key=lambda p: p["rate"])
            if not pts:
                continue
            (line,) = ax.plot([p["rate"] for p in pts], [p[metric]["p90"] for p in pts], "o-", label=mode)
            if res.get("slo_goodput_rps"):
                ax.axvline(res["slo_goodput_rps"], color=line.get_color(), linestyle=":", alpha=0.6)
        if target:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1,
                       label=f"target {target:g} ms" + (" (TPOT)" if name == "ITL" else ""))
        ax.set_yscale("log")
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel(f"p90 {name} (ms)")
        ax.set_title(f"p90 {name} vs rate")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
