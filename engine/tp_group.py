"""``TPGroup``: the collectives of one worker's tensor-parallel ranks.

Two process groups over one ``torch.distributed`` store: ``data`` carries the model's tensors
(NCCL on CUDA, gloo on CPU) and ``ctrl`` (always gloo, CPU tensors) carries rank 0's step plans to
the other ranks (``engine.tp_plan``). The groups are built directly as ``ProcessGroupGloo`` /
``ProcessGroupNCCL`` objects rather than through ``init_process_group``, so nothing global is set:
tests run a whole group as threads of one process (over a ``HashStore``), workers as processes
(over a ``TCPStore`` that rank 0 hosts). Only ``tensor_parallel_size > 1`` creates one; a TP=1
engine never touches ``torch.distributed``.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from engine.tp_allreduce import SymmAllReduce

DEFAULT_TIMEOUT_S = 600.0


class TPGroup:
    def __init__(self, *, rank: int, size: int, store: dist.Store, device: torch.device | str,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside a tensor parallel group of {size}")
        self.rank, self.size = rank, size
        self.device = torch.device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.ctrl = dist.ProcessGroupGloo(dist.PrefixStore("tp-ctrl", store), rank, size, timeout)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.data = dist.ProcessGroupNCCL(dist.PrefixStore("tp-nccl", store), rank, size, opts)
        else:
            self.data = self.ctrl
        self.symm: SymmAllReduce | None = None
        if self.device.type == "cuda" and size > 1:
            from pdserve.settings import tp_allreduce

            mode, max_bytes = tp_allreduce()
            if mode == "symm":
                self.symm = SymmAllReduce.setup(rank=rank, size=size, store=store, ctrl=self.ctrl,
                                                device=self.device, max_bytes=max_bytes)

    @staticmethod
    def tcp_store(*, host: str, port: int, rank: int, size: int,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
        """The rendezvous of a worker's ranks: rank 0 listens on ``host:port``, the others connect."""
        return dist.TCPStore(host, port, size, rank == 0, datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False)

    # ---- model tensors (data group) -------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks: ``x`` itself, summed in place (NCCL, gloo), or a new tensor
        (the one-shot path of ``PDSERVE_TP_ALLREDUCE=symm``, engine.tp_allreduce). Use what it returns."""
        if self.symm is not None and self.symm.takes(x):
            return self.symm(x)
        self.data.allreduce([x]).wait()
        return x

    @property
    def allreduce_mode(self) -> str:
        if self.symm is not None:
            return f"symm<={self.symm.max_bytes // 1024}KiB"
        return "nccl" if self.device.type == "cuda" else "gloo"

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., n]`` from every rank -> ``[..., size * n]`` in rank order, on every rank."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.data.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` into ``x`` on every rank (the data group: on the device with NCCL)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.data.broadcast([x], opts).wait()
        return x

    # ---- control (CPU, gloo) --------------------------------------------------------------------
    def broadcast_cpu(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s CPU tensor into ``x`` on every rank (same shape and dtype everywhere)."""
        self.broadcast_cpu_async(x, src).wait()
        return x

    def broadcast_cpu_async(self, x: torch.Tensor, src: int = 0):
        """``broadcast_cpu`` posted, not waited for: returns the work (``wait()`` it; keep ``x`` alive
        until then)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self.ctrl.broadcast([x], opts)

    def barrier(self) -> None:
        self.ctrl.allreduce([torch.zeros(1)]).wait()

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, size={self.size}, device={self.device})"
