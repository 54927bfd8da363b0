"""Merge the JSON of several ``bench/gpu.py`` runs on one machine into the one result file of a lease.

    python3 bench/merge_results.py OUT.json RUN1.json RUN2.json ...

A device call may run 10 minutes at most, so a lease's full benchmark is two calls on the same warm
machine (``--items roofline,transfer,transformers`` and ``--items disagg``). Every ratio is still
measured within one run (roofline and transfer against that run's own ceilings, disaggregated
against colocated in the same call); this only puts the items side by side in the file the issue
asks for, ``gpu-<device>-<date>.json`` with ``device``, ``command``, ``roofline``, ``transfer``,
``disagg_vs_colocated`` and ``transformers``. Each item keeps the command and ceilings of its own
run (``commands``, ``ceilings_by_item``); a later run's item replaces an earlier one's. An earlier
merged file may be one of the inputs (its items keep their own commands and ceilings). Writes the
markdown tables beside it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ITEMS = ("roofline", "transfer", "disagg_vs_colocated", "transformers")


def merge(runs: list[dict]) -> dict:
    if not runs:
        raise ValueError("nothing to merge")
    slugs = {r["device"].get("slug") for r in runs}
    if len(slugs) != 1:
        raise ValueError(f"runs come from different devices: {sorted(map(str, slugs))}")
    out = {"device": runs[0]["device"], "command": " ; ".join(r["command"] for r in runs),
           "date": runs[-1]["date"], "commands": {}, "ceilings_by_item": {}}
    out.update({item: None for item in ITEMS})
    for r in runs:
        for key, value in r.items():
            if key in ("device", "command", "date") or value is None:
                continue
            if key in ("commands", "ceilings_by_item", "merged_from"):
                continue  # an earlier merge as input: its per-item records are taken below
            out[key] = value
            if key in ITEMS:
                out["commands"][key] = (r.get("commands") or {}).get(key, r["command"])
                out["ceilings_by_item"][key] = (r.get("ceilings_by_item") or {}).get(key, r.get("ceilings"))
    # The roofline's ratios are the ones taken against the ceilings: show those at the top.
    out["ceilings"] = out["ceilings_by_item"].get("roofline") or out.get("ceilings")
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    target, sources = Path(argv[1]), [Path(p) for p in argv[2:]]
    merged = merge([json.loads(p.read_text()) for p in sources])
    merged["merged_from"] = [p.name for p in sources]
    target.write_text(json.dumps(merged, indent=1, default=str) + "\n")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_tables import markdown

    target.with_suffix(".md").write_text(markdown(merged) + "\n")
    print(f"wrote {target} and {target.with_suffix('.md').name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
