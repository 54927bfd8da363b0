"""The GPU transfer benchmark (``bench/gpu.py``'s transfer item): a KV of ``tokens`` tokens GPU0 -> GPU1
through ``kvtransfer`` (NIXL, TCP; variants), raw NIXL (``gpu_nixl_raw``) and a direct copy, all in one
run. The two-process harness is ``gpu_transfer_pair.TransferPair``.

``pair.transfer(..., preopened=True)`` (rows ``nixl_preopened``, ``tcp_preopened``) measures what the
cluster's prefill worker pays after its prefill when it streams layers (prefill_service/layer_stream.py):
the send is opened first (``start_send(layers=())``, as ``KVLink.open_stream`` does when the final
prompt chunk starts) and awaited until open (``SendHandle.begun()``: NIXL's BEGIN_OK, TCP's BEGIN
written), so the handshake is out of the measurement; then the clock starts, all layers are pushed at
once with ``final=True`` (the worst case of streaming: every layer ready at the prefill's end, none sent
during it), and it stops when the sender sees the receiver's DONE (``tx_acked``). Its timeline is in ms
after that push (``tx_push`` 0; ``tx_start`` / ``tx_begin_ok`` are negative), and its data phase is
``tx_push -> rx_complete`` instead of ``tx_begin_ok -> rx_complete``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from gpu_transfer_pair import TransferPair  # noqa: F401  (tests/gpu use it from here too)

ROOT = str(Path(__file__).resolve().parents[1])


def ucx_transports(log_dir: str | Path, kind: str = "nixl") -> list[str]:
    """UCX's protocol choices (UCX_PROTO_INFO tables) for operations that touch GPU memory, both sides:
    ``"<operation> :: <size range> <protocol> <transport>"``."""
    out, title = [], None
    for role in ("tx", "rx"):
        path = Path(log_dir) / f"transfer-{kind}-{role}.log"
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            cells = [c.strip() for c in line.split("|")[1:-1] if c.strip()]
            if len(cells) == 1 and "ucp_" in cells[0]:
                title = cells[0] if "cuda" in cells[0] else None
            elif title and len(cells) == 3 and cells[0] != "Range":
                entry = f"{role}: {title} :: {' '.join(cells)}"
                if entry not in out:
                    out.append(entry)
    return out[:40]


# (key, kind, TransportConfig overrides, extra env): fresh processes each, after the default "nixl"
# pair, each timed one-shot and preopened. The default makes one WRITE per layer while BEGIN_OK travels
# and posts each with one call (nixl_prebuild) and gives the transport thread a 1 ns timer slack so the
# sender's fast-wait naps last ~20 us, not ~70 (fine_timer_slack); each _no_ row turns one of them off
# (the before of the same run). nixl_nap_0 polls with time.sleep(0) (GIL released, no timer at all).
# Earlier variant rows (poll floor, WROTE only, spin, progress thread) are in the result files of
# commit c3291d1 (git history).
KV_VARIANTS = [
    ("nixl_no_prebuild", "nixl", {"nixl_prebuild": False}, {}),
    ("nixl_no_fine_slack", "nixl", {"fine_timer_slack": False}, {}),
    ("nixl_no_prebuild_no_fine_slack", "nixl", {"nixl_prebuild": False, "fine_timer_slack": False}, {}),
    ("nixl_nap_0", "nixl", {"nixl_fast_wait_nap_s": 0.0}, {}),
]
# UCX environments for the raw rows (fresh processes each; a subset of the raw variants). CACHE=n:
# cuda_ipc opens (maps) the target's IPC handle on every put instead of once -- what first use costs.
# Tried on CPU and dropped: UCX_TLS without tcp (NIXL's UCX backend then fails to create its loopback
# endpoint, "Destination is unreachable") and UCX_PROTO_ENABLE=n (NIXL_ERR_BACKEND on every post).
RAW_ENVS = [
    ("raw_ipc_cache_off", {"UCX_CUDA_IPC_CACHE": "n"}),
]
RAW_ENV_SUBSET = ("1desc", "32desc")


def _row(runs: list[dict], nbytes: int, direct_s: float, exact: dict, overrides: dict, env: dict) -> dict:
    import statistics

    sec = statistics.median(r["seconds"] for r in runs)
    row = {
        "seconds": sec,
        "GBps": nbytes / sec / 1e9,
        "runs": len(runs),
        "rx_seconds": statistics.median(r["rx_seconds"] for r in runs),
        "rx_done_after_start_s": statistics.median(r["rx_done_after_start_s"] for r in runs),
        "wall_seconds": statistics.median(r["wall_seconds"] for r in runs),
        "backend": runs[0]["backend"],
        "byte_exact": exact["digest"],
        "others_zero": exact["others_zero"],
        "fraction_of_direct_copy": direct_s / sec,
        "config_overrides": overrides,
        "env": env,
        "steps_ms": _steps_ms(runs),
    }
    st = row["steps_ms"]
    done = st.get("rx_complete", st.get("rx_notif"))
    begin = "tx_push" if "tx_push" in st else "tx_begin_ok"  # preopened: BEGIN_OK came before the clock
    if begin in st and done is not None:
        # The data movement alone (BEGIN_OK in -> WRITE posted -> receiver completed it: its NIXL
        # notification, rx_notif, or the sender's WROTE frame, rx_wrote), without
        # the BEGIN round trip before and the DONE frame after (what layer-wise streaming can hide). On a
        # GPU the post returns at once (cuMemcpyDtoDAsync); on CPU (CMA) the copy happens inside it.
        row["data_ms"] = done - st[begin]
        row["data_from"] = begin
        row["data_fraction_of_direct_copy"] = direct_s * 1e3 / max(row["data_ms"], 1e-9)
    return row


def _steps_ms(runs: list[dict]) -> dict:
    """Median instant of each step after start_send (preopened: after the push, tx_push) in ms
    (tx_begin_ok, tx_posted, tx_xfers_done, rx_notif or rx_wrote, rx_complete, tx_acked, ...), in time
    order."""
    import statistics

    keys = set().union(*(r.get("steps", {}) for r in runs))
    med = {k: 1e3 * statistics.median(r["steps"][k] for r in runs if k in r.get("steps", {})) for k in keys}
    return dict(sorted(med.items(), key=lambda kv: kv[1]))


def _print_row(key: str, x: dict, nbytes: int, direct_s: float) -> None:
    if "error" in x:
        print(f"  {key}: error {x['error'][:200]}", flush=True)
        return
    sec = x["seconds"]
    print(f"  {key}: {nbytes / 2**20:.0f} MiB in {sec * 1e3:.2f} ms = {nbytes / sec / 1e9:.1f} GB/s "
          f"({direct_s / sec:.1%} of the direct copy), byte-exact={x['byte_exact']}", flush=True)


def _kv_pair(res: dict, key: str, kind: str, overrides: dict, env: dict, patterns: dict, *, layout, rx_dev,
             tx_dev, num_blocks: int, reps: int, out, nbytes: int, direct_s: float) -> None:
    """One TransferPair; a row per id pattern (the first pattern's row is ``key`` itself). A pattern is
    (src, dst) or (src, dst, "preopened"): the latter times a preopened send (module docstring)."""
    try:
        pair = TransferPair(layout, rx_device=rx_dev, tx_device=tx_dev, num_blocks=num_blocks, kind=kind,
                            log_dir=out, overrides=overrides, tag=key, env=env)
    except Exception as exc:
        res[key] = {"error": f"{type(exc).__name__}: {exc}"}
        return
    try:
        for pname, (src, dst, *mode) in patterns.items():
            rkey = key if pname == "contiguous" else f"{key}_{pname}"
            pre = mode == ["preopened"]
            try:
                pair._call("rx", op="zero")
                for i in range(2):
                    pair.transfer(f"{rkey}-warm-{i}", src, dst, preopened=pre)
                runs = [pair.transfer(f"{rkey}-{i}", src, dst, preopened=pre) for i in range(reps)]
                want, have = pair.digest("tx", src), pair.digest("rx", dst)
                exact = {"digest": want["digest"] == have["digest"], "others_zero": have["others_zero"]}
                res[rkey] = {**_row(runs, nbytes, direct_s, exact, overrides, env),
                             "ids": "contiguous" if pre else pname, "preopened": pre}
            except Exception as exc:
                res[rkey] = {"error": f"{type(exc).__name__}: {exc}"}
            _print_row(rkey, res[rkey], nbytes, direct_s)
    finally:
        res.setdefault("stats", {})[key] = pair.close()


def _direct_copy(nbytes: int, tx: str, rx: str) -> float:
    import statistics

    import torch

    cuda = tx != "cpu"
    src_t = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=tx)
    dst_t = torch.empty(nbytes, dtype=torch.uint8, device=rx)

    def sync():
        if cuda:
            torch.cuda.synchronize(torch.device(tx))
            torch.cuda.synchronize(torch.device(rx))

    times = []
    for i in range(25):
        sync()
        t0 = time.perf_counter()
        dst_t.copy_(src_t)
        sync()
        if i >= 5:
            times.append(time.perf_counter() - t0)
    del src_t, dst_t
    if cuda:
        torch.cuda.empty_cache()
    return statistics.median(times)


def bench_transfer(out: str | Path, *, quick: bool = False, tokens: int = 4096,
                   transfer_variants: bool = False, cpu: bool = False) -> dict:
    """A ``tokens``-token KV of the llama3-8b shape (512 MiB at 4k) GPU0 -> GPU1 (or GPU0 -> GPU0 on a
    one-GPU machine; host memory with ``cpu=True``, the dry run for a machine without CUDA), each side
    its own process, against a plain copy of the same bytes measured in the same run (median):

    * ``raw`` (gpu_nixl_raw): NIXL WRITEs with no kvtransfer -- one descriptor, N descriptors, K xfers --
      and ``ipc_copy``, a copy_ into the receiver's tensor mapped through torch CUDA IPC;
    * ``nixl`` (contiguous ids, as the bench always did), ``nixl_scattered``, ``nixl_same_ids``: kvtransfer
      as the services use it; ``tcp``: the TCP fallback staged through host memory;
    * ``nixl_preopened``, ``tcp_preopened`` (same pairs, contiguous ids): the send opened and its
      handshake done before the clock, then all layers pushed at once -- what the prefill worker pays
      after its prefill when it streams layers (module docstring);
    * with ``transfer_variants``: kvtransfer configs (KV_VARIANTS) and UCX environments for the raw
      rows (RAW_ENVS), each in fresh processes.
    """
    import random

    import torch
    from gpu_nixl_raw import VARIANTS, bench_raw

    from engine.kv_layout import KVLayout

    t_start = time.perf_counter()
    layout = KVLayout(
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype="bfloat16",
        memory="cpu" if cpu else "cuda",
        model_fingerprint="bench-llama3-8b",
    )
    blocks = tokens // layout.block_size
    nbytes = layout.num_layers * blocks * layout.block_bytes
    rx_dev = "cpu" if cpu else (1 if torch.cuda.device_count() > 1 else 0)
    tx_dev = "cpu" if cpu else 0
    dev_name = (lambda d: "cpu" if d == "cpu" else f"cuda:{d}")
    direct_s = _direct_copy(nbytes, dev_name(tx_dev), dev_name(rx_dev))
    res = {
        "tokens": tokens,
        "bytes": nbytes,
        "src_device": tx_dev,
        "dst_device": rx_dev,
        "direct_copy": {
            "seconds": direct_s,
            "GBps": nbytes / direct_s / 1e9,
            "what": f"torch copy_ {dev_name(tx_dev)} -> {dev_name(rx_dev)}, contiguous, same process",
        },
    }
    print(f"  direct copy: {direct_s * 1e3:.2f} ms = {nbytes / direct_s / 1e9:.1f} GB/s", flush=True)
    reps = 5 if quick else 15
    raw = bench_raw(out, nbytes=nbytes, device_tx=dev_name(tx_dev), device_rx=dev_name(rx_dev), tag="raw",
                    reps=5 if quick else 10)
    res["raw"] = raw
    for name, x in raw.get("rows", {}).items():
        if "error" not in x:
            x["fraction_of_direct_copy"] = direct_s / x["seconds"]
            if "notif_s" in x:
                x["notif_fraction_of_direct_copy"] = direct_s / x["notif_s"]
        _print_row(f"raw {name}", x, nbytes, direct_s)
    if "error" in raw:
        print(f"  raw: error {raw['error'][:300]}", flush=True)
    num_blocks = blocks + 16
    rng = random.Random(11)
    patterns = {  # (src ids, dst ids); contiguous = what this bench always measured
        "contiguous": (list(range(blocks)), list(range(8, 8 + blocks))),
        "scattered": (list(range(blocks)), rng.sample(range(num_blocks), blocks)),
        "same_ids": (list(range(blocks)), list(range(blocks))),
    }
    patterns["preopened"] = (*patterns["contiguous"], "preopened")
    kw = dict(layout=layout, rx_dev=rx_dev, tx_dev=tx_dev, num_blocks=num_blocks, reps=reps, out=out,
              nbytes=nbytes, direct_s=direct_s)
    _kv_pair(res, "nixl", "nixl", {}, {}, patterns, **kw)
    if transfer_variants:
        for key, kind, overrides, env in KV_VARIANTS:
            _kv_pair(res, key, kind, overrides, env,
                     {k: patterns[k] for k in ("contiguous", "preopened")}, **kw)
        subset = [v for v in VARIANTS if v[0] in RAW_ENV_SUBSET]
        for key, env in RAW_ENVS:
            r = bench_raw(out, nbytes=nbytes, device_tx=dev_name(tx_dev), device_rx=dev_name(rx_dev), env=env,
                          tag=key, reps=5, variants=subset, ipc=False)
            res[key] = r
            for name, x in r.get("rows", {}).items():
                if "error" not in x:
                    x["fraction_of_direct_copy"] = direct_s / x["seconds"]
                _print_row(f"{key} {name}", x, nbytes, direct_s)
            if "error" in r:
                print(f"  {key}: error {r['error'][:300]}", flush=True)
    tcp_patterns = {k: patterns[k] for k in ("contiguous", "preopened")}
    _kv_pair(res, "tcp", "tcp", {}, {}, tcp_patterns,
             **{**kw, "reps": 2 if quick else 3})
    res["ucx_transports"] = ucx_transports(out, "nixl")
    res["ucx_transports_raw"] = ucx_transports(out, "raw")
    one = raw.get("rows", {}).get("1desc", {})
    res["goal"] = {
        "nixl_fraction_of_direct_copy": res.get("nixl", {}).get("fraction_of_direct_copy"),
        "nixl_preopened_fraction_of_direct_copy":
            res.get("nixl_preopened", {}).get("fraction_of_direct_copy"),
        # the receiver's expectation complete (the KV is in place and the decode side knows it), from the
        # push: what the decode worker waits for; the sender's figure adds the DONE frame back to it
        "nixl_preopened_rx_fraction_of_direct_copy":
            _rx_fraction(res.get("nixl_preopened"), direct_s),
        "raw_1desc_fraction_of_direct_copy": one.get("fraction_of_direct_copy"),
        "target": 0.85,
    }
    res["section_wall_s"] = time.perf_counter() - t_start
    print(f"  transfer section: {res['section_wall_s']:.0f} s", flush=True)
    return res


def _rx_fraction(x: dict | None, direct_s: float) -> float | None:
    t = (x or {}).get("rx_done_after_start_s")
    return direct_s / t if t else None


def _ms(x: dict | None, key: str = "seconds") -> str:
    return "-" if not x or x.get(key) is None else f"{x[key] * 1e3:.2f}"


def transfer_markdown(t: dict) -> list[str]:
    """The transfer section of the GPU report (bench/gpu_tables.py)."""
    direct = t["direct_copy"]["seconds"]
    nb = t["bytes"]
    where = [f"GPU{d}" if isinstance(d, int) else str(d) for d in (t["src_device"], t["dst_device"])]
    out = [
        f"## Transfer: {t['tokens']}-token KV ({nb / 2**20:.0f} MiB) {where[0]} -> {where[1]}",
        "",
        "kvtransfer rows: start_send -> receiver's DONE seen by the sender (`rx ms`: -> receiver's "
        "expectation complete); `_preopened` rows: send opened and BEGIN_OK (TCP: BEGIN written) awaited "
        "first, then all layers pushed at once -> DONE (what the prefill worker pays after its prefill "
        "when it streams layers). Raw rows: post -> all xfers DONE on the initiator (`notif ms`: -> target "
        "saw the notification).",
        "",
        "| path | ms | GB/s | vs direct copy | rx / notif ms | rx vs direct copy | byte-exact |",
        "|---|---:|---:|---:|---:|---:|---|",
        f"| direct copy (one process) | {direct * 1e3:.2f} | {nb / direct / 1e9:.1f} | 100% | - | - | - |",
    ]

    def line(name: str, x: dict, second: str) -> None:
        if "error" in x:
            out.append(f"| {name} | error: {x['error'][:100]} | | | | | |")
        elif x:
            rx = f"{direct / x[second]:.1%}" if x.get(second) else "-"
            out.append(f"| {name} | {x['seconds'] * 1e3:.2f} | {nb / x['seconds'] / 1e9:.1f} | "
                       f"{direct / x['seconds']:.1%} | {_ms(x, second)} | {rx} | {x.get('byte_exact')} |")

    raw = t.get("raw") or {}
    if "error" in raw:
        out.append(f"| raw nixl | error: {raw['error'][:100]} | | | | | |")
    for name, x in (raw.get("rows") or {}).items():
        line(f"raw {name}", x, "notif_s")
    for key, x in t.items():
        if isinstance(x, dict) and ("seconds" in x or "error" in x) and key not in ("direct_copy", "raw"):
            if "rows" not in x and "nbytes" not in x:
                line(key, x, "rx_done_after_start_s")
    for key, x in t.items():
        if key.startswith("raw_") and isinstance(x, dict) and ("rows" in x or "error" in x):
            if "error" in x:
                out.append(f"| {key} | error: {x['error'][:100]} | | | | | |")
            for name, y in (x.get("rows") or {}).items():
                line(f"{key} {name}", y, "notif_s")
    out.append("")
    steps = [(k, x["steps_ms"]) for k, x in t.items() if isinstance(x, dict) and x.get("steps_ms")]
    if steps:
        out += ["Where a kvtransfer send's time goes (median ms after start_send, `_preopened` rows: after "
                "the push, tx_push; tx_ sender, rx_ receiver):", ""]
        for k, st in steps:
            x = t[k]
            wire = (f" -- {x.get('data_from', 'tx_begin_ok')} -> rx_complete {x['data_ms']:.2f} ms = "
                    f"{x['data_fraction_of_direct_copy']:.1%} of the direct copy" if "data_ms" in x else "")
            out.append(f"- {k}: " + ", ".join(f"{s} {v:.2f}" for s, v in st.items()) + wire)
        out.append("")
    tel = [(n, x["telemetry"]) for n, x in (raw.get("rows") or {}).items() if x.get("telemetry")]
    if tel:
        out += ["NIXL telemetry of the last raw post (descriptors as NIXL counted them, post/xfer us):", ""]
        out += [f"- {n}: {x}" for n, x in tel] + [""]
    for title, key in (("kvtransfer", "ucx_transports"), ("raw", "ucx_transports_raw")):
        if t.get(key):
            out += [f"UCX protocol choices for GPU memory ({title} processes, UCX_PROTO_INFO):", ""]
            out += [f"- `{line_}`" for line_ in t[key][:10]] + [""]
    if t.get("section_wall_s") is not None:
        out += [f"Transfer section wall time: {t['section_wall_s']:.0f} s.", ""]
    return out


def main() -> None:
    """CPU dry run (host memory, DRAM registration): ``python bench/gpu_transfer.py --cpu --out DIR``."""
    import argparse
    import json

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu", action="store_true", help="host memory (no CUDA needed)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--variants", action="store_true")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    res = bench_transfer(args.out, quick=args.quick, tokens=args.tokens, transfer_variants=args.variants,
                         cpu=args.cpu)
    (Path(args.out) / "transfer.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    text = "\n".join(transfer_markdown(res))
    (Path(args.out) / "transfer.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    sys.path[:0] = [ROOT, str(Path(__file__).resolve().parent)]
    main()
