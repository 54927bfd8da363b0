"""Print an image's layers (the instruction that made each and its size) and its total size, and write
them with the build time as JSON:

    python image_report.py IMAGE [--docker DOCKER] [--build-seconds S] [--base IMAGE] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

UNITS = {"B": 1, "kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def _bytes(text: str) -> float:
    if text.strip().isdigit():
        return float(text)
    m = re.fullmatch(r"([\d.]+)\s*([kKMG]?B)", text.strip())
    return float(m.group(1)) * UNITS[m.group(2)] if m else 0.0


def _instruction(created_by: str) -> str:
    text = re.sub(r"^/bin/sh -c (#\(nop\)\s*)?", "", created_by.strip())
    text = re.sub(r"\s+", " ", text)
    return text if len(text) <= 90 else text[:87] + "..."


def layers(image: str, docker: str) -> list[dict]:
    out = subprocess.run([docker, "history", "--no-trunc", "--human=false", "--format", "{{json .}}", image],
                         check=True, capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    rows.reverse()  # oldest first, as the Dockerfile reads
    return [{"instruction": _instruction(r.get("CreatedBy", "")) or r.get("Comment", ""),
             "bytes": int(_bytes(r.get("Size", "0B")))} for r in rows]


def venv_breakdown(image: str, docker: str, top: int = 12) -> list[dict]:
    """The largest entries of the image's site-packages (what the venv layer is made of)."""
    script = f"du -sk /opt/venv/lib/python3*/site-packages/* | sort -rn | head -n {top}"
    out = subprocess.run([docker, "run", "--rm", "--entrypoint", "sh", image, "-c", script], check=True,
                         capture_output=True, text=True).stdout
    rows = [line.split(None, 1) for line in out.splitlines() if line.strip()]
    return [{"path": path.rsplit("/", 1)[-1], "bytes": int(kb) * 1024} for kb, path in rows]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("image")
    ap.add_argument("--docker", default="docker")
    ap.add_argument("--build-seconds", type=float)
    ap.add_argument("--cached-steps", type=int)
    ap.add_argument("--base")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = layers(args.image, args.docker)
    total = int(subprocess.run([args.docker, "image", "inspect", "-f", "{{.Size}}", args.image], check=True,
                               capture_output=True, text=True).stdout.strip())
    print(f"{'size':>10}  layer")
    for r in rows:
        if r["bytes"]:
            print(f"{r['bytes'] / 1e6:8.1f}MB  {r['instruction']}")
    print(f"{total / 1e6:8.1f}MB  total ({args.image})")
    breakdown = venv_breakdown(args.image, args.docker)
    print("largest in /opt/venv: " + ", ".join(f"{b['path']} {b['bytes'] / 1e6:.0f}MB" for b in breakdown))
    if args.json:
        args.json.write_text(json.dumps({"image": args.image, "base": args.base, "total_bytes": total,
                                         "build_seconds": args.build_seconds,
                                         "cached_steps": args.cached_steps, "layers": rows,
                                         "venv_largest": breakdown}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
