"""What the early upload costs the imports beside it, per way of uploading (engine/early_upload.py).

    python3 bench/early_upload_probe.py --out DIR [--model DIR] [--modes off,read,register] [--rounds 3]
        [--cold]

Each round starts one fresh process per mode, in alternating order, that does what ``pdserve serve``
does first: starts the upload (``PDSERVE_EARLY_UPLOAD=<mode>``), then imports torch and initialises
CUDA, then waits for the upload. It reports the import's wall time (the main thread, which the
upload must not slow), the upload's own time and way, and how long the process still waited for it
after the imports. ``--cold`` evicts the checkpoint from the page cache before each process. Prints a
table, writes early-upload-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

CHILD = r"""
import json, sys, time
t0 = time.monotonic()
from engine import early_upload
up = early_upload.start(sys.argv[1],
                        early_upload.wanted(role="colocated", device="auto", tensor_parallel_size=1))
t1 = time.monotonic()
import torch
t2 = time.monotonic()
torch.zeros(1, device="cuda")
t3 = time.monotonic()
ok = up.wait() if up is not None else None
t4 = time.monotonic()
print(json.dumps({"import_torch_s": t2 - t1, "cuda_init_s": t3 - t2, "waited_after_s": t4 - t3,
                  "to_ready_s": t4 - t0, "ok": ok, "method": up.method if up else "",
                  "upload_s": up.seconds if up else 0.0, "bytes": up.num_bytes if up else 0,
                  "error": up.error if up else None}))
"""


def main() -> None:
    from gpu_boot import SHM, evict

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="/var/tmp/pdserve-boot")
    ap.add_argument("--modes", default="off,read,register")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cold", action="store_true")
    args = ap.parse_args()
    model = Path(args.model)
    if not (model / "config.json").exists():
        model = SHM
    modes = args.modes.split(",")
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    for r in range(args.rounds):
        order = modes if r % 2 == 0 else modes[::-1]
        for mode in order:
            if args.cold:
                evict(model)
            out = subprocess.run([sys.executable, "-c", CHILD, str(model)], capture_output=True, text=True,
                                 env={**env, "PDSERVE_EARLY_UPLOAD": mode}, timeout=300)
            try:
                row = json.loads(out.stdout.strip().splitlines()[-1])
            except (IndexError, ValueError):
                row = {"error": out.stderr[-2000:]}
            rows[mode].append(row)
            print(f"  {mode:<9} " + "  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                               for k, v in row.items()), flush=True)
    import torch

    name = torch.cuda.get_device_name(0)
    summary = {}
    for mode, rs in rows.items():
        good = [x for x in rs if "import_torch_s" in x]
        if good:
            med = {k: sorted(x[k] for x in good)[len(good) // 2]
                   for k in ("import_torch_s", "upload_s", "waited_after_s", "to_ready_s")}
            summary[mode] = med
            print(f"{mode:<9} median: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()))
    result = {"device": name, "model": str(model), "cold": args.cold, "command": " ".join(sys.argv),
              "rows": rows, "median": summary}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = "-cold" if args.cold else ""
    path = out_dir / f"early-upload{tag}-{name.lower().replace(' ', '-')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
