"""engine.tp_allreduce: setting up the one-shot all-reduce is collective, and a rank that cannot makes
every rank fall back to NCCL instead of leaving the others waiting in a rendezvous (CPU ranks as
threads; the kernel itself needs GPUs with peer access: bench/gpu_tp.py ``--runs llama3-8b:2:symm``)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
from torch._C._distributed_c10d import _SymmetricMemory
from tp_testkit import TIMEOUT_S, run_ranks, run_threads

from engine import tp_allreduce
from engine.tp_allreduce import SymmAllReduce
from engine.tp_group import TPGroup


def _setup_on_ranks(size: int, monkeypatch, *, empty_fails_on=(), rendezvous_fails_on=(),
                    check_fails_on=()):
    """SymmAllReduce.setup on ``size`` CPU ranks; allocation / rendezvous raise, and the check of a known
    sum fails, on the ranks named (``check_fails_on=None``: the real check, which cannot run on CPU).
    Returns (each rank's result, the ranks that entered the rendezvous, the (name, rank, size) each rank
    registered)."""
    store = dist.HashStore()
    entered = []
    rank_of = {}

    def fake_empty(nbytes, dtype, device):
        if rank_of[threading.get_ident()] in empty_fails_on:
            raise RuntimeError("no symmetric memory allocator for this device")
        return torch.empty(nbytes, dtype=dtype)

    def fake_rendezvous(buffer, name):
        rank = rank_of[threading.get_ident()]
        entered.append(rank)
        if rank in rendezvous_fails_on:
            raise RuntimeError("peer access refused")

    def fake_group_info(name, rank, size, store):  # process-wide in torch: these ranks share a process
        registered.append((name, rank, size))

    registered: list = []
    monkeypatch.setattr(_SymmetricMemory, "set_group_info", staticmethod(fake_group_info))
    monkeypatch.setattr(tp_allreduce, "_register_group", lambda name, rank, size, store, ctrl: object())
    monkeypatch.setattr(symm_mem, "empty", fake_empty)
    monkeypatch.setattr(symm_mem, "rendezvous", fake_rendezvous)
    if check_fails_on is not None:  # the kernel cannot run on CPU: its check is what the test says
        monkeypatch.setattr(SymmAllReduce, "check", lambda self, rank, size, device:
                            "sum 1.0 != 3.0" if rank in check_fails_on else "")

    def body(rank: int):
        rank_of[threading.get_ident()] = rank
        group = TPGroup(rank=rank, size=size, store=store, device="cpu", timeout_s=TIMEOUT_S)
        return SymmAllReduce.setup(rank=rank, size=size, store=store, ctrl=group.ctrl,
                                   device=torch.device("cpu"), max_bytes=4096)

    results = run_threads(size, body)
    return results, sorted(entered), sorted(registered, key=lambda r: r[1])


def test_every_rank_sets_up_the_one_shot_path_together(monkeypatch):
    results, entered, registered = _setup_on_ranks(2, monkeypatch)
    assert entered == [0, 1] and all(isinstance(r, SymmAllReduce) for r in results)
    assert results[0].name == results[1].name  # one group name, agreed through the store
    assert registered == [(results[0].name, 0, 2), (results[0].name, 1, 2)]
    assert results[0].max_bytes == 4096


@pytest.mark.parametrize("size", [2, 4])
def test_a_rank_that_cannot_allocate_sends_every_rank_to_nccl_without_a_rendezvous(monkeypatch, size):
    results, entered, _ = _setup_on_ranks(size, monkeypatch, empty_fails_on={size - 1})
    assert results == [None] * size and entered == []


def test_a_failed_rendezvous_on_one_rank_sends_every_rank_to_nccl(monkeypatch):
    results, entered, _ = _setup_on_ranks(2, monkeypatch, rendezvous_fails_on={0})
    assert results == [None, None] and entered == [0, 1]


def test_what_takes_the_one_shot_path():
    ar = SymmAllReduce("g", torch.empty(4096, dtype=torch.uint8))
    cpu = torch.empty(8, 64, dtype=torch.bfloat16)
    assert not ar.takes(cpu)  # CPU tensors never (gloo sums them)
    meta = torch.empty(8, 64, dtype=torch.bfloat16, device="meta")
    assert not ar.takes(meta)


def test_cpu_groups_sum_with_gloo_whatever_the_setting(monkeypatch):
    monkeypatch.setenv("PDSERVE_TP_ALLREDUCE", "symm")
    out = run_ranks(2, lambda g: (g.allreduce_mode, g.all_reduce(torch.full((4,), g.rank + 1.0)).tolist()))
    assert out == [("gloo", [3.0] * 4)] * 2


def test_a_wrong_sum_on_one_rank_sends_every_rank_to_nccl(monkeypatch):
    results, entered, _ = _setup_on_ranks(2, monkeypatch, check_fails_on={1})
    assert results == [None, None] and entered == [0, 1]


def test_the_check_itself_fails_on_cpu_where_the_kernel_cannot_run(monkeypatch):
    results, _, _ = _setup_on_ranks(2, monkeypatch, check_fails_on=None)  # the real check
    assert results == [None, None]


def test_the_group_torch_looks_up_by_name_is_registered():
    """torch's rendezvous resolves the group by name (its store, rank and size); the worker's groups are
    not made by init_process_group, so setup registers one (real registry, one rank, a unique name)."""
    import datetime
    import uuid

    from torch._C._distributed_c10d import _resolve_process_group

    store = dist.HashStore()
    ctrl = dist.ProcessGroupGloo(dist.PrefixStore("ctrl", store), 0, 1, datetime.timedelta(seconds=10))
    name = f"pdserve-tp-test-{uuid.uuid4().hex[:8]}"
    kept = tp_allreduce._register_group(name, 0, 1, dist.PrefixStore("symm", store), ctrl)
    group = _resolve_process_group(name)  # alive while ``kept`` is (the registry holds it weakly)
    assert group is kept
    assert (group.rank(), group.size(), group.group_name) == (0, 1, name)
    flag = torch.ones(2)
    group.allreduce([flag]).wait()  # its collectives go to the ranks' gloo group
    assert flag.tolist() == [1.0, 1.0]
