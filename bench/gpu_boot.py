"""Boot time on one GPU: process start -> SERVING for the llama3-8b shape, each phase timed, beside the
raw read time of the same checkpoint measured in the same run.

    python3 bench/gpu_boot.py --out DIR [--disk-dir /var/tmp/pdserve-boot] [--skip-roofline]

Sources: the checkpoint on a RAM-backed tmpfs (/dev/shm), and a copy on local disk read cold (every
file evicted from the page cache with posix_fadvise(DONTNEED) first, no root needed) and warm (page
cache). Layouts on ONE GPU: ``colocated`` (one worker) and ``1p1d`` (a prefill and a decode worker
started together, both on GPU 0; boot = until both are SERVING). Each boot is timed from Popen to
health SERVING by this script, and each worker reports its own phases and process start -> SERVING
(``pdserve.v1.Process/GetProcessStats``). Raw read: every checkpoint file read sequentially into one
reused buffer (the floor a loader that reads each byte once can reach from that source).

A first colocated boot from tmpfs comes before the measured ones and is reported apart (``first_start``):
it compiles the Triton kernels, and any flashinfer JIT module not carried, into the machine's caches
(``--no-first-start`` skips it). Goals: <= 5 s start -> SERVING from page cache; cold from disk within
1.5x of the raw cold read. Then decode at batch 1, 1k context, next to the HBM bound (bench/gpu.py's
roofline item, the same function). Writes boot-<device>.json and prints a table.

``--variant NAME=ENV=VALUE[,ENV=VALUE]`` adds colocated boots with worker environment variables,
rounds alternated with the default (``--variant-rounds``), from the page cache or, with
``--variant-source disk-cold``, evicted before each boot. Each boot's phases are read once no new one
has appeared for a second, so the decode graphs captured while idle after SERVING are in
(``graphs_done_s``: when the last one ended).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from pdserve.app.launcher.procs import spawn  # noqa: E402
from pdserve.v1 import process_pb2, process_pb2_grpc  # noqa: E402

SHM = Path("/dev/shm/pdserve-llama3-8b")


def files_of(model: Path) -> list[Path]:
    return sorted(model.glob("*.safetensors"))


def evict(model: Path) -> None:
    """Drop the checkpoint's pages from the page cache (what a first start after boot sees)."""
    for f in files_of(model):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(model: Path) -> dict:
    buf = bytearray(64 << 20)
    view = memoryview(buf)
    total, t0 = 0, time.monotonic()
    for f in files_of(model):
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(view):
                total += n
    s = time.monotonic() - t0
    return {"seconds": s, "bytes": total, "GBps": total / s / 1e9}


def fs_type(path: Path) -> str:
    out = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True)
    return out.stdout.strip()


def wait_serving(address: str, deadline: float) -> None:
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.02)
    raise TimeoutError(f"{address} not SERVING in time")


def process_stats(address: str) -> dict:
    with grpc.insecure_channel(address) as ch:
        s = process_pb2_grpc.ProcessStub(ch).GetProcessStats(process_pb2.ProcessStatsRequest(), timeout=10)
    return {"serving_after_s": s.serving_after_s, "rss_GB": s.rss_bytes / 1e9,
            "phases": [{"name": p.name, "start_s": round(p.start_s, 3), "seconds": round(p.seconds, 3)}
                       for p in s.boot]}


def settled_stats(address: str, quiet_s: float = 1.0, limit_s: float = 15.0) -> dict:
    """``process_stats`` once no new phase has appeared for ``quiet_s``: the decode CUDA graphs a
    worker captures while idle after SERVING (``cuda_graph_idle_capture``) are then all in, and
    ``graphs_done_s`` says when the last one ended (process start = 0)."""
    seen, t = -1, time.monotonic()
    quiet_since = t
    while True:
        stats = process_stats(address)
        now = time.monotonic()
        if len(stats["phases"]) != seen:
            seen, quiet_since = len(stats["phases"]), now
        if now - quiet_since >= quiet_s or now - t >= limit_s:
            break
        time.sleep(0.1)
    idle = [p for p in stats["phases"] if p["name"] == "cuda_graph_idle_capture"]
    stats["graphs_done_s"] = round(max((p["start_s"] + p["seconds"] for p in idle),
                                       default=stats["serving_after_s"]), 3)
    stats["idle_captures"] = len(idle)
    return stats


def boot(model: Path, layout: str, logs: Path, kv_gb: float, gpu: str, extra_env: dict | None = None,
         zygote=None) -> dict:
    """Start the layout's workers at once on one GPU; seconds until every one is SERVING. With ``zygote``
    they are forked from it (already started: the restart and scale-up case)."""
    roles = ["colocated"] if layout == "colocated" else ["prefill", "decode"]
    env = {"CUDA_VISIBLE_DEVICES": gpu, **(extra_env or {})}
    args = ["--model", str(model), "--device", "cuda", "--kv-memory-gb", str(kv_gb)]
    t0 = time.monotonic()
    procs = []

    def start(role: str):
        p = spawn(role, [*args, *(["--transport", "tcp"] if role != "colocated" else [])],
                  logs / f"{layout}-{role}-{int(t0)}.log", env=env, timeout=300, zygote=zygote)
        procs.append(p)
        return p

    try:
        # spawn() returns at the listening line: start every worker at once, then wait for all
        with ThreadPoolExecutor(len(roles)) as pool:
            started = list(pool.map(start, roles))
        for p in started:
            wait_serving(p.address, t0 + 300)
        wall = time.monotonic() - t0
        workers = {r: settled_stats(p.address) for r, p in zip(roles, started, strict=True)}
        return {"wall_s": wall, "workers": workers}
    finally:
        for p in procs:
            p.stop()


def _line(r: dict) -> str:
    if "wall_s" not in r:
        return r["error"]
    per = "; ".join(f"{w}: " + ", ".join(f"{p['name']} {p['seconds']:.2f}" for p in s["phases"]
                                         if p["seconds"] > 0.05 and p["name"] != "cuda_graph_idle_capture")
                    + f"; {s['idle_captures']} graphs captured idle, all by {s['graphs_done_s']:.2f}"
                    for w, s in r["workers"].items())
    return f"{r['wall_s']:6.2f}s to SERVING  {per}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--disk-dir", default="/var/tmp/pdserve-boot", help="local disk copy of the checkpoint")
    ap.add_argument("--kv-gb", type=float, default=8.0, help="KV cache per worker (two share one GPU)")
    ap.add_argument("--layouts", default="colocated,1p1d")
    ap.add_argument("--gpu", default="0", help="the one GPU every worker runs on")
    ap.add_argument("--skip-roofline", action="store_true")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ENV=VALUE[,ENV=VALUE]",
                    help="colocated boots from the page cache with these worker environment variables, "
                    "beside the same boot without them, rounds interleaved (e.g. "
                    "nograph=PDSERVE_CUDA_GRAPHS=0)")
    ap.add_argument("--zygote", action="store_true",
                    help="add the variant `zygote`: colocated boots forked from a zygote started once before "
                    "the rounds (launcher/zygote.py; what a restart or scale-up under pdserve up does)")
    ap.add_argument("--variant-rounds", type=int, default=3)
    ap.add_argument("--variant-source", choices=("disk-page-cache", "disk-cold"), default="disk-page-cache",
                    help="where the variants' checkpoint is read from (disk-cold: evicted before each boot)")
    ap.add_argument("--no-first-start", action="store_true",
                    help="skip the first boot (reported apart) that compiles the Triton kernels, and any "
                    "flashinfer JIT module not carried, into this machine's caches before the measured boots")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "boot-logs"
    logs.mkdir(exist_ok=True)
    import torch
    from gpu_disagg import write_checkpoint

    t = time.monotonic()
    write_checkpoint(SHM, "llama3-8b")
    torch.cuda.empty_cache()  # the weights were drawn on the GPU: give the workers that memory back
    disk = Path(args.disk_dir)
    if not (disk / "config.json").exists():
        shutil.copytree(SHM, disk, dirs_exist_ok=True)
    print(f"checkpoints ready in {time.monotonic() - t:.0f}s: {SHM} ({fs_type(SHM)}), "
          f"{disk} ({fs_type(disk)})", flush=True)
    name = torch.cuda.get_device_name(0)
    result: dict = {"device": name, "command": " ".join(sys.argv), "sources": {}, "boots": []}
    raw_tmpfs = raw_read(SHM)
    evict(disk)
    raw_cold = raw_read(disk)
    raw_warm = raw_read(disk)
    result["sources"] = {"tmpfs": {"path": str(SHM), "fs": fs_type(SHM), "raw_read": raw_tmpfs},
                         "disk": {"path": str(disk), "fs": fs_type(disk), "raw_read_cold": raw_cold,
                                  "raw_read_page_cache": raw_warm}}
    print(f"raw read: tmpfs {raw_tmpfs['seconds']:.2f}s ({raw_tmpfs['GBps']:.1f} GB/s), disk cold "
          f"{raw_cold['seconds']:.2f}s ({raw_cold['GBps']:.1f} GB/s), "
          f"disk page cache {raw_warm['seconds']:.2f}s", flush=True)
    if not args.no_first_start:
        # The first start on a machine compiles kernels (docs/gpu.md, "Boot"): measured once, on its own,
        # so that the first measured boot below does not carry it.
        try:
            first = boot(SHM, "colocated", logs, args.kv_gb, args.gpu)
        except Exception as exc:
            first = {"error": str(exc)}
        result["first_start"] = first
        print(f"  first start on this machine (compiles kernels): {_line(first)}", flush=True)
    runs = [("tmpfs", SHM, False), ("disk-cold", disk, True), ("disk-page-cache", disk, False)]
    for layout in filter(None, args.layouts.split(",")):
        for label, path, cold in runs:
            if cold:
                evict(path)
            try:
                r = boot(path, layout, logs, args.kv_gb, args.gpu)
            except Exception as exc:  # one failed boot must not lose the others
                r = {"error": str(exc)}
            r.update(layout=layout, source=label)
            if cold and "wall_s" in r:
                r["vs_raw_cold_read"] = r["wall_s"] / raw_cold["seconds"]
            result["boots"].append(r)
            (out / "boot.json").write_text(json.dumps(result, indent=1))
            print(f"  {layout:<10} {label:<16} {_line(r)}", flush=True)
    zygote = None
    if args.variant or args.zygote:
        variants = {"default": {}}
        for text in args.variant:
            vname, _, rest = text.partition("=")
            variants[vname] = dict(item.split("=", 1) for item in rest.split(",") if item)
        if args.zygote:
            from pdserve.app.launcher.zygote import Zygote
            from pdserve.settings import environ

            t = time.monotonic()
            zygote = Zygote.start(environ(), log_path=logs / "zygote.log")
            result["zygote"] = {"ready_s": round(time.monotonic() - t, 3), **zygote.ready}
            print(f"  zygote ready in {result['zygote']['ready_s']:.2f}s: {zygote.ready['modules']}",
                  flush=True)
            variants["zygote"] = {}
        cold = args.variant_source == "disk-cold"
        raw_read(disk)  # in the page cache (evicted again before each boot when cold)
        result["variant_source"] = args.variant_source
        result["variants"] = {v: [] for v in variants}
        for _round in range(args.variant_rounds):
            for vname, extra in variants.items():
                if cold:
                    evict(disk)
                try:
                    r = boot(disk, "colocated", logs, args.kv_gb, args.gpu, extra,
                             zygote=zygote if vname == "zygote" else None)
                except Exception as exc:
                    r = {"error": str(exc)}
                r.update(variant=vname, env=extra)
                if cold and "wall_s" in r:
                    r["vs_raw_cold_read"] = r["wall_s"] / raw_cold["seconds"]
                result["variants"][vname].append(r)
                print(f"  variant {vname:<12} {_line(r)}", flush=True)
        if zygote is not None:
            zygote.close()
        for vname, rs in result["variants"].items():
            walls = sorted(r["wall_s"] for r in rs if "wall_s" in r)
            if walls:
                median = walls[len(walls) // 2]
                print(f"  variant {vname:<12} median {median:.2f}s to SERVING over {len(walls)}")
    if not args.skip_roofline:
        from gpu import ceilings, random_model, roofline

        from engine.checkpoint import preset_config

        cfg = preset_config("llama3-8b")
        ceil = ceilings(True)
        result["decode_b1_1k"] = roofline(random_model(cfg), cfg, ceil, True, with_prefill=False,
                                          batches=[1], contexts=[1024])
        print(f"decode batch 1, 1k context: {json.dumps(result['decode_b1_1k'])[:400]}", flush=True)
    slug = name.replace(" ", "-").lower()
    path = out / f"boot-{slug}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    (out / "boot.json").unlink(missing_ok=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
