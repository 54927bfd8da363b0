"""``SymmAllReduce``: a one-shot all-reduce over symmetric memory for a tensor-parallel worker's small
activations (``PDSERVE_TP_ALLREDUCE=symm``); NCCL keeps the larger ones.

Why: a decode step makes two all-reduces per layer of ``batch x hidden`` values (at TP 2 on the 8B shape,
64 of 512 KiB at batch 64), and on 2x H200 NCCL spent ~1.5 ms of an 8.5 ms step on them
(bench/results/tp-2xh200-2026-11-28-8590937.md): at these sizes an all-reduce is latency, not bandwidth.
torch's symmetric memory (``torch.distributed._symmetric_memory``) maps every rank's buffer into each
rank's address space over NVLink; ``one_shot_all_reduce_copy_out`` copies this rank's input into its
buffer, meets its peers at a signal pad and sums every rank's buffer in rank order, in one kernel. Every
rank adds the same values in the same order, so the ranks hold identical sums, as the model needs.

No multicast (NVLS) is used: one-shot reads the peers' buffers with ordinary loads (shared hosts keep
multicast off). The kernel runs on the current stream and is captured in CUDA graphs like NCCL's.

Setting up is collective: every rank allocates its buffer, the ranks agree on the group's name and that
all of them succeeded (the ``ctrl`` gloo group), and only then rendezvous; then one small all-reduce of
a known sum is checked on every rank. A rank that cannot (no peer access, a torch without the op, a
wrong sum) makes every rank fall back to NCCL, with a warning, rather than hang or compute wrongly.
"""

from __future__ import annotations

import logging
import uuid

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Inputs of these dtypes and at most ``max_bytes`` take the one-shot path (the symmetric buffer's size).
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class SymmAllReduce:
    def __init__(self, name: str, buffer: torch.Tensor, group=None) -> None:
        self.name, self.buffer = name, buffer
        self.group = group  # the registry holds it weakly: it lives as long as this object
        self.max_bytes = buffer.numel()

    @classmethod
    def setup(cls, *, rank: int, size: int, store: dist.Store, ctrl: dist.ProcessGroup,
              device: torch.device, max_bytes: int) -> SymmAllReduce | None:
        """Every rank of the group calls this together; returns None on every rank when any cannot."""
        keys = dist.PrefixStore("tp-symm", store)
        if rank == 0:
            keys.set("name", f"pdserve-tp-{uuid.uuid4().hex[:12]}")
        name = keys.get("name").decode()
        buffer, group, why = None, None, ""
        try:
            import torch.distributed._symmetric_memory as symm_mem
            from torch._C._distributed_c10d import _SymmetricMemory

            group_store = dist.PrefixStore(f"tp-symm-{name}", store)
            _SymmetricMemory.set_group_info(name, rank, size, group_store)
            group = _register_group(name, rank, size, group_store, ctrl)
            buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        except Exception as exc:  # noqa: BLE001 -- any failure means NCCL, decided by all ranks together
            why = f"{type(exc).__name__}: {exc}"
        if not _all_ok(ctrl, buffer is not None):
            log.warning("tensor parallel all-reduce: symmetric memory unavailable on a rank (%s); using NCCL",
                        why or "another rank failed")
            return None
        try:
            symm_mem.rendezvous(buffer, name)
            ok = True
        except Exception as exc:  # noqa: BLE001
            ok, why = False, f"{type(exc).__name__}: {exc}"
        if not _all_ok(ctrl, ok):
            log.warning("tensor parallel all-reduce: symmetric memory rendezvous failed (%s); using NCCL",
                        why or "on another rank")
            return None
        made = cls(name, buffer, group)
        why = made.check(rank, size, device)
        if not _all_ok(ctrl, not why):
            log.warning("tensor parallel all-reduce: the one-shot kernel failed its check (%s); using NCCL",
                        why or "on another rank")
            return None
        log.info("tensor parallel all-reduce: one-shot over symmetric memory up to %d KiB, NCCL above",
                 max_bytes // 1024)
        return made

    def check(self, rank: int, size: int, device: torch.device) -> str:
        """One small all-reduce whose sum is known (every rank adds rank + 1): "" when it came out right,
        else why not (the op missing from this torch, a peer not reachable, a wrong sum)."""
        try:
            got = self(torch.full((256,), float(rank + 1), device=device))
            want = size * (size + 1) / 2
            return "" if bool((got == want).all().item()) else f"sum {got[0].item()} != {want}"
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"

    def takes(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (x.is_cuda and x.dtype in _DTYPES and x.is_contiguous() and 0 < nbytes <= self.max_bytes
                and nbytes % 16 == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks, as a new tensor (``x`` is left as it was)."""
        nbytes = x.numel() * x.element_size()
        mine = self.buffer[:nbytes].view(x.dtype).view(x.shape)
        out = torch.empty_like(x)
        return torch.ops.symm_mem.one_shot_all_reduce_copy_out(mine, x, "sum", self.name, out)


def _register_group(name: str, rank: int, size: int, store: dist.Store, ctrl):
    """Register a c10d process group under ``name``: torch's rendezvous of symmetric memory looks the
    group up by name and takes its store, rank and size from it (torch 2.11 on an H200 host:
    "Could not resolve the process group registered under the name ..."; older versions read what
    ``set_group_info`` recorded instead, which is set too). The worker's groups are built directly,
    not through ``init_process_group`` (engine.tp_group), so none is registered until this; its
    collectives, if torch's rendezvous calls any, go to the ranks' gloo group. The registry holds the
    group weakly: the caller keeps the returned group alive."""
    from torch._C._distributed_c10d import ProcessGroup, _register_process_group

    group = ProcessGroup(store, rank, size)
    group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, ctrl)
    group._set_default_backend(ProcessGroup.BackendType.GLOO)
    group._set_group_name(name)
    _register_process_group(name, group)
    return group


def _all_ok(ctrl: dist.ProcessGroup, ok: bool) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    ctrl.allreduce([flag], opts).wait()
    return bool(flag.item())
