"""Which GPUs each worker of `pdserve up` gets (CUDA_VISIBLE_DEVICES, or Ray's num_gpus).

On a multi-GPU host every worker must own its device(s); without a plan all of them would see every
GPU and use cuda:0. Workers are numbered in launch order (the whole prefill pool first, then decode
or colocated), and ``DeviceAssigner.next(role)`` hands out, per worker:

    explicit pool list   --prefill-gpus 0 --decode-gpus 1,2   the pool's ids, ``per_worker`` at a
                         time (default 1), in order; colocated workers use the decode list
    round robin          --gpus-per-worker N                  N ids at a time from ``visible``
                         (CUDA_VISIBLE_DEVICES of `pdserve up`, else 0..count-1), one cursor shared
                         by both pools, so 1P1D on 2 GPUs = prefill on 0, decode on 1
    nothing              ()                                   the worker inherits the environment

A tensor-parallel pool (``pdserve up --prefill-tp N --decode-tp M``) takes N (M) GPUs per worker
(``prefill_per_worker`` / ``decode_per_worker``, over ``gpus_per_worker``): the worker's ranks run on
``cuda:0..N-1`` of its CUDA_VISIBLE_DEVICES (pdserve/app/tp_ranks.py). Under Ray such a worker's GPUs
are one placement-group bundle (launcher/backends.py), so they are reserved together on one node.

With ``peers`` (``--gpu-peers``) a worker sees its own device(s) first and then every other visible
GPU (``CUDA_VISIBLE_DEVICES=1,0`` for the worker on GPU1): it still computes on its own (cuda:0),
while UCX's cuda_ipc can map a peer GPU's memory for NIXL, which needs the peer to be visible.

A list that runs out wraps around (workers then share a device) with a warning: on purpose for a
small model, a mistake for a big one. Under Ray with round robin the launcher asks for
``num_gpus=N`` instead and lets Ray pick (Ray sets CUDA_VISIBLE_DEVICES in the actor); explicit ids
are passed as CUDA_VISIBLE_DEVICES whatever the launcher. Scaling a pool continues the cursors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


def parse_ids(value: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = value.split(",")
    return tuple(v.strip() for v in value if v.strip())  # indices or GPU-<uuid>, as CUDA takes them


@dataclass(frozen=True, kw_only=True)
class DevicePlan:
    gpus_per_worker: int = 0
    prefill_gpus: tuple[str, ...] = ()
    decode_gpus: tuple[str, ...] = ()
    visible: tuple[str, ...] = ()  # what round robin draws from
    peers: bool = False  # append every other visible GPU after the worker's own
    prefill_per_worker: int = 0  # GPUs per prefill worker (its TP size); 0: gpus_per_worker
    decode_per_worker: int = 0  # GPUs per decode / colocated worker; 0: gpus_per_worker

    def __post_init__(self) -> None:
        if min(self.gpus_per_worker, self.prefill_per_worker, self.decode_per_worker) < 0:
            raise ValueError(f"--gpus-per-worker must be >= 0, got {self.gpus_per_worker}")
        if (self.prefill_per_worker or self.decode_per_worker) and not (self.visible or self.prefill_gpus):
            raise ValueError("GPUs per tensor-parallel worker need GPUs: none visible")
        if bool(self.prefill_gpus) != bool(self.decode_gpus) and not self.gpus_per_worker:
            raise ValueError("give both --prefill-gpus and --decode-gpus, or --gpus-per-worker N")
        if self.gpus_per_worker and not (self.prefill_gpus and self.decode_gpus) and not self.visible:
            raise ValueError("--gpus-per-worker needs GPUs: none visible (CUDA_VISIBLE_DEVICES / torch)")
        if self.peers and not self.visible:
            raise ValueError("--gpu-peers needs the visible GPUs (CUDA_VISIBLE_DEVICES / torch)")
        for pool, ids in (("prefill", self.prefill_gpus), ("decode", self.decode_gpus)):
            if ids and len(ids) < self.per(pool):
                raise ValueError(f"a pool list of {len(ids)} GPU(s) cannot give {self.per(pool)} per worker")

    @property
    def enabled(self) -> bool:
        return bool(self.gpus_per_worker or self.prefill_gpus or self.decode_gpus or self.prefill_per_worker
                    or self.decode_per_worker)

    def per(self, role: str) -> int:
        """GPUs per worker of ``role``'s pool."""
        pool = self.prefill_per_worker if role == "prefill" else self.decode_per_worker
        return pool or self.gpus_per_worker or 1

    def explicit(self, role: str) -> tuple[str, ...]:
        return self.prefill_gpus if role == "prefill" else self.decode_gpus

    def ray_num_gpus(self, role: str) -> int:
        """GPUs to request from Ray for a worker of ``role`` (0: pass explicit ids, or none)."""
        if self.explicit(role) or self.peers or not (self.gpus_per_worker or self.prefill_per_worker
                                                     or self.decode_per_worker):
            return 0
        return self.per(role)


class DeviceAssigner:
    """Hands out device ids per worker in launch order; the cursors persist across scale-ups."""

    def __init__(self, plan: DevicePlan) -> None:
        self.plan = plan
        self._cursor = {"prefill": 0, "decode": 0, "shared": 0}
        self._warned = False

    def next(self, role: str) -> tuple[str, ...]:
        plan = self.plan
        if not plan.enabled:
            return ()
        pool = "prefill" if role == "prefill" else "decode"
        ids = plan.explicit(pool)
        key = pool if ids else "shared"
        if not ids:
            ids = plan.visible
        n = plan.per(pool)
        start = self._cursor[key]
        self._cursor[key] = start + n
        if start + n > len(ids) and not self._warned:
            self._warned = True
            log.warning("more workers than GPUs (%d id(s), %d per worker): workers now share devices",
                        len(ids), n)
        own = tuple(ids[(start + i) % len(ids)] for i in range(n))
        if plan.peers:
            return own + tuple(v for v in plan.visible if v not in own)
        return own


def assign(plan: DevicePlan, roles: list[str]) -> list[tuple[str, ...]]:
    """Device ids for workers launched in this order (pure: a fresh assigner)."""
    a = DeviceAssigner(plan)
    return [a.next(r) for r in roles]


def visible_gpus(env: dict[str, str]) -> tuple[str, ...]:
    """GPU ids this launcher may hand out: CUDA_VISIBLE_DEVICES when set, else every CUDA device."""
    if env.get("CUDA_VISIBLE_DEVICES") is not None:
        return parse_ids(env["CUDA_VISIBLE_DEVICES"])
    try:
        import torch

        return tuple(str(i) for i in range(torch.cuda.device_count()))
    except Exception:  # no torch / no driver: nothing to hand out
        return ()
