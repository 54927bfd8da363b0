"""The processes of a tensor-parallel worker (``pdserve serve --tensor-parallel-size N``).

The serve process is rank 0: it owns gRPC, the KV link and the ``LLMEngine``. ``start_ranks``
hosts the group's rendezvous (a ``TCPStore`` on 127.0.0.1, all ranks run on this host) and starts
ranks 1..N-1 as child processes running this module's ``main``: each builds its ``TPGroup``, loads
its slice of the checkpoint and follows rank 0's steps (``engine.tp_worker.TPFollower``) until rank 0's
``LLMEngine.close()``. On CUDA rank r computes on ``cuda:r`` of the GPUs the launcher made visible
to the worker. A child whose parent dies exits by itself; ``TPRanks.stop`` waits for them (and
kills what does not leave).

The engine configuration travels to the children as JSON on the command line (plain values only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time

log = logging.getLogger(__name__)


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device for a worker's ``device`` setting (``cpu``, ``cuda``, ``auto``)."""
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    return f"cuda:{rank}"


@dataclasses.dataclass
class TPRanks:
    """Rank 0's group and the child processes of ranks 1..N-1."""

    group: object  # engine.tp_group.TPGroup
    procs: list[subprocess.Popen]
    store: object  # keeps the rendezvous alive while the group lives

    def stop(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor parallel rank (pid %d) did not stop: killing it", proc.pid)
                proc.kill()
                proc.wait()


def start_ranks(engine_config, size: int) -> TPRanks:
    """Host the rendezvous, start ranks 1..size-1, return rank 0's ``TPGroup`` (blocks until every
    rank has joined the group)."""
    from engine.tp_group import TPGroup

    store = TPGroup.tcp_store(host="127.0.0.1", port=0, rank=0, size=size)
    payload = json.dumps(dataclasses.asdict(engine_config))
    procs = [subprocess.Popen([sys.executable, "-m", "pdserve.app.tp_ranks", "--rank", str(r), "--size",
                               str(size), "--store-port", str(store.port), "--parent-pid", str(os.getpid()),
                               "--engine-config", payload])
             for r in range(1, size)]
    try:
        group = TPGroup(rank=0, size=size, store=store, device=rank_device(engine_config.device, 0))
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    return TPRanks(group=group, procs=procs, store=store)


def _exit_with_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.app.tp_ranks")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--engine-config", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s tp-rank{args.rank} %(levelname)s %(message)s")
    threading.Thread(target=_exit_with_parent, args=(args.parent_pid,), daemon=True).start()

    from engine.engine_types import EngineConfig
    from engine.tp_group import TPGroup
    from engine.tp_worker import TPFollower

    fields = json.loads(args.engine_config)
    config = EngineConfig(**{**fields, "device": rank_device(fields["device"], args.rank)})
    store = TPGroup.tcp_store(host="127.0.0.1", port=args.store_port, rank=args.rank, size=args.size)
    group = TPGroup(rank=args.rank, size=args.size, store=store, device=config.device)
    TPFollower(config, group).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
