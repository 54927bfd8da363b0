"""The serving configurations the benchmarks compare, and how to start one: one catalogue for
``pdserve bench --sweep --modes``, ``python -m pdserve.app.loadgen.compare`` and bench/gpu_disagg.py.

Every mode is a ``pdserve up --launcher process`` cluster (``Cluster`` + ``ProcessBackend``), so the
router, placement, admission control and metrics are the same code in each; only the workers differ:

    1p1d           1 prefill + 1 decode, KV over ``opts.transport``
    1p1d-nixl      the same over NIXL            1p1d-tcp      the same over the TCP fallback
    1p1d-oneshot   1P1D over NIXL, KV sent in one piece after the prefill (not layer by layer)
    conditional    1P1D (``opts.transport``) with ``--conditional-disagg auto``
    colocated      ``opts.colocated_workers`` colocated workers behind the router (``--mode colocated``)
    colocated-chunk512   the same with a 512-token chunked-prefill budget (the latency-tuned setting)
    colocated-tp2  one colocated worker at tensor parallel size 2 (GPUs 0-1), behind the router
    1p1d-tp2       1 prefill at TP 2 (GPUs 0-1) + 1 decode at TP 2 (GPUs 2-3), KV rank to rank
    1p1d-tp1-tp2   1 prefill at TP 1 (GPU 0) + 1 decode at TP 2 (GPUs 1-2): each decode rank gets its
                   KV heads from the prefill rank's staging (docs/tensor-parallel.md)

A mode may carry a variant, ``MODE@TAG``: the same cluster with ``opts.variants[TAG]`` added to every
process's flags, workers' and router's (say ``1p1d-tcp@nochain`` with ``--kv-rx-chain off``, or
``1p1d-tcp@nodrain`` with ``--admission-drain off``; every role reads the one ``pdserve serve`` flag set
and uses its own), so two settings of one mode run side by side in one sweep.

``prefill_args`` go to the prefill pool only (compute-tuned, e.g. ``--max-num-batched-tokens 8192``);
``router_args`` to every mode's router (admission flags: the same in every mode). Devices: ``gpus=0``
runs everything on this host's CPU; 1 GPU shares GPU0 (a functional check); 2 or more put each worker
on its own GPU, seeing its peer after it for UCX's cuda_ipc (``DevicePlan(peers=True)``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pdserve.app.launcher.backends import ProcessBackend
from pdserve.app.launcher.cluster import Cluster, ClusterSpec
from pdserve.app.launcher.devices import DevicePlan, assign
from pdserve.app.launcher.local import QUIET_ENV, get_stats
from pdserve.settings import DEFAULT_DRAIN_TIMEOUT_S

MODES = ("1p1d", "1p1d-nixl", "1p1d-tcp", "1p1d-oneshot", "conditional", "colocated", "colocated-chunk512",
         "colocated-tp2", "1p1d-tp2", "1p1d-tp1-tp2")
# (prefill TP, decode TP) of the tensor-parallel modes; the prefill TP of a colocated mode is unused
TP_MODES = {"colocated-tp2": (1, 2), "1p1d-tp2": (2, 2), "1p1d-tp1-tp2": (1, 2)}


@dataclass(frozen=True, kw_only=True)
class ModeOptions:
    model: str
    worker_args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    gpus: int = 0
    colocated_workers: int = 2
    transport: str = "tcp"  # of "1p1d" and "conditional"
    policy: str = "prefix"
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S
    # TAG -> extra flags of every worker of a ``MODE@TAG``
    variants: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def __post_init__(self) -> None:
        if self.gpus < 0 or self.colocated_workers < 1:
            raise ValueError(f"need gpus >= 0 and colocated_workers >= 1, got {self.gpus}, "
                             f"{self.colocated_workers}")
        if self.transport not in ("auto", "nixl", "tcp"):
            raise ValueError(f"transport must be auto, nixl or tcp, got {self.transport!r}")


def check_modes(modes: list[str] | tuple[str, ...]) -> None:
    unknown = [m for m in modes if m.partition("@")[0] not in MODES]
    if unknown or not modes:
        raise ValueError(f"unknown modes {unknown}; choose from {', '.join(MODES)}")


def cluster_spec(mode: str, opts: ModeOptions) -> ClusterSpec:
    """The cluster of ``mode`` (no process started)."""
    check_modes([mode])
    mode, _, tag = mode.partition("@")
    if tag:
        flags = dict(opts.variants)
        if tag not in flags:
            raise ValueError(f"mode variant {tag!r} has no flags; known: {', '.join(flags) or 'none'}")
        opts = dataclasses.replace(opts, worker_args=(*opts.worker_args, *flags[tag]),
                                   router_args=(*opts.router_args, *flags[tag]))
    gpus = tuple(str(i) for i in range(opts.gpus))
    common = dict(model=opts.model, worker_args=opts.worker_args, policy=opts.policy,
                  drain_timeout=opts.drain_timeout, router_args=opts.router_args)
    if mode in TP_MODES:
        return _tp_spec(mode, opts, gpus, common)
    if mode.startswith("colocated"):
        n = min(opts.colocated_workers, len(gpus)) if gpus else opts.colocated_workers
        decode = (*opts.decode_args, *(("--max-num-batched-tokens", "512") if mode == "colocated-chunk512"
                                       else ()))
        devices = DevicePlan(gpus_per_worker=1, visible=gpus) if gpus else DevicePlan()
        return ClusterSpec(num_prefill=0, num_decode=n, colocated=True, transport="tcp", devices=devices,
                           decode_args=decode, **common)
    if len(gpus) >= 2:  # prefill on GPU0, decode on GPU1, each seeing the other after its own
        devices = DevicePlan(prefill_gpus=("0",), decode_gpus=("1",), visible=gpus[:2], peers=True)
    elif gpus:
        devices = DevicePlan(prefill_gpus=("0",), decode_gpus=("0",))
    else:
        devices = DevicePlan()
    transport = {"1p1d-nixl": "nixl", "1p1d-tcp": "tcp", "1p1d-oneshot": "nixl"}.get(mode, opts.transport)
    prefill = (*opts.prefill_args, *(("--kv-stream-layers", "off") if mode == "1p1d-oneshot" else ()))
    if mode == "conditional":
        common["router_args"] = (*opts.router_args, "--conditional-disagg", "auto")
    return ClusterSpec(num_prefill=1, num_decode=1, transport=transport, devices=devices,
                       prefill_args=prefill, decode_args=opts.decode_args, **common)


def _tp_spec(mode: str, opts: ModeOptions, gpus: tuple[str, ...], common: dict) -> ClusterSpec:
    """A tensor-parallel mode: each worker's ranks on consecutive GPUs of its own (each seeing the others
    after them, for UCX's cuda_ipc), or everything on this host's CPU (gloo) without GPUs."""
    from pdserve.app.tp_ranks import pool_tp_args

    p_tp, d_tp = TP_MODES[mode]
    colocated = mode.startswith("colocated")
    prefill, decode = pool_tp_args(prefill_tp=1 if colocated else p_tp, decode_tp=d_tp, colocated=colocated)
    need = d_tp + (0 if colocated else p_tp)
    if gpus and len(gpus) < need:
        raise ValueError(f"mode {mode} needs {need} GPUs, {len(gpus)} given")
    devices = DevicePlan()
    if gpus:
        devices = DevicePlan(prefill_gpus=gpus[:p_tp] if not colocated else gpus[:d_tp],
                             decode_gpus=gpus[0 if colocated else p_tp:need], visible=gpus[:need], peers=True,
                             prefill_per_worker=p_tp, decode_per_worker=d_tp)
    transport = "tcp" if colocated else opts.transport
    return ClusterSpec(num_prefill=0 if colocated else 1, num_decode=1, colocated=colocated,
                       transport=transport, devices=devices, prefill_args=(*prefill, *opts.prefill_args),
                       decode_args=(*decode, *opts.decode_args), **common)


def describe(specs: dict[str, ClusterSpec]) -> dict:
    """What each mode's cluster runs: (serve role, devices, pool flags) per worker in launch order,
    router flags, transport."""
    out = {}
    for mode, spec in specs.items():
        pools = ["prefill"] * spec.num_prefill + ["decode"] * spec.num_decode
        roles = ["colocated" if spec.colocated and r == "decode" else r for r in pools]
        out[mode] = {"workers": [{"role": r, "CUDA_VISIBLE_DEVICES": ",".join(d),
                                  "args": list(spec.prefill_args if r == "prefill" else spec.decode_args)}
                                 for r, d in zip(roles, assign(spec.devices, pools), strict=True)],
                     "router_args": [*spec.router_args, *(("--mode", "colocated") if spec.colocated else ())],
                     "transport": spec.transport}
    return out


class Started:
    """A running mode: its router address, and the workers' block counts for leak checks."""

    def __init__(self, cluster: Cluster, router: str) -> None:
        self.cluster = cluster
        self.router = router

    def stats(self) -> dict:
        return {h.worker_id: get_stats(h.address, h.role) for hs in self.cluster.workers.values()
                for h in hs if h.alive()}

    def free_blocks(self) -> dict[str, int]:
        return {w: s.free_blocks for w, s in self.stats().items()}

    def blocks_back(self, expected: dict[str, int], timeout: float = 30.0) -> dict:
        """Wait (bounded) until every worker is idle with ``expected`` free blocks; report per worker
        ``{free, expected, running, leased, queued, back}`` and ``all_back``."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            rows = {w: {"free": s.free_blocks, "expected": expected.get(w, s.free_blocks),
                        "running": s.num_running, "leased": s.num_leased, "queued": s.queue_depth}
                    for w, s in stats.items()}
            for r in rows.values():
                r["back"] = r["free"] == r["expected"] and not (r["running"] or r["leased"] or r["queued"])
            done = all(r["back"] for r in rows.values())
            if done or time.monotonic() > deadline:
                return {"workers": rows, "all_back": done}
            time.sleep(0.2)


@contextmanager
def started(spec: ClusterSpec, run_dir: str | Path, env: dict[str, str] | None = None) -> Iterator[Started]:
    """Bring ``spec`` up as local processes (logs under ``run_dir``), yield it, always bring it down."""
    run_dir = Path(run_dir)
    backend = ProcessBackend(run_dir, {**QUIET_ENV, **(env or {})})
    cluster = Cluster(spec=spec, backend=backend, run_dir=run_dir)
    try:
        router = cluster.up()
        yield Started(cluster, router)
    finally:
        cluster.down()
