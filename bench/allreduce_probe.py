"""The tensor-parallel all-reduce paths side by side: NCCL and the one-shot kernel over symmetric memory
(engine.tp_allreduce), per message size, alone and inside a CUDA graph, each checked against the sum
the ranks' inputs must give.

    python -m bench.allreduce_probe --out bench/results                    # ranks on GPUs 0 and 1
    python -m bench.allreduce_probe --gpus 0,0 --out bench/results         # both ranks on one GPU

Each rank is a process (as a worker's ranks are) built around engine.tp_group.TPGroup's pieces: a gloo
group for the votes, ``SymmAllReduce.setup`` exactly as a worker runs it, and NCCL where the ranks sit on
distinct GPUs (NCCL refuses two ranks on one device, so ``--gpus 0,0`` checks the one-shot path alone:
its setup, its sums, its capture in a graph; its times there are two processes sharing one GPU, not a
link). For every size (bf16, ``batch x 4096`` rows of the 8B shape) it checks that every rank's result
equals ``sum(inputs)`` rounded once to bf16 (what two ranks give either way; with more ranks an order
of additions may differ), then times ``--calls`` back-to-back all-reduces inside one
CUDA graph (as a decode step replays them), median over ``--rounds`` replays, as microseconds per call.
Prints a table and writes ``allreduce-probe-<device>-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu import events_ms  # noqa: E402
from pdserve.probe import free_port  # noqa: E402
from pdserve.settings import bench_command, environment  # noqa: E402

HIDDEN = 4096


def _rank(rank: int, args, port: int, queue) -> None:
    from engine.tp_allreduce import SymmAllReduce

    gpus = [int(g) for g in args.gpus.split(",")]
    size = len(gpus)
    device = torch.device("cuda", gpus[rank])
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, wait_for_workers=False)
    ctrl = dist.ProcessGroupGloo(dist.PrefixStore("ctrl", store), rank, size, dt.timedelta(seconds=120))
    nccl = None
    if len(set(gpus)) == size:
        nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size)
    symm = SymmAllReduce.setup(rank=rank, size=size, store=store, ctrl=ctrl, device=device,
                               max_bytes=args.max_kib * 1024)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        parts = [torch.randn(batch, HIDDEN, device=device,
                             generator=torch.Generator(device=device).manual_seed(1000 * batch + r))
                 .to(torch.bfloat16) for r in range(size)]  # every rank's input, known to every rank
        x = parts[rank]
        want = torch.stack([p.float() for p in parts]).sum(0).to(torch.bfloat16)
        row = {"batch": batch, "bytes": x.numel() * x.element_size()}
        paths = {}
        if symm is not None and symm.takes(x):
            paths["symm"] = symm
        if nccl is not None:
            def nccl_sum(t, g=nccl):
                t = t.clone()
                g.allreduce([t]).wait()
                return t
            paths["nccl"] = nccl_sum
        for name, fn in paths.items():
            row[f"{name}_exact"] = bool(torch.equal(fn(x), want))
            row[f"{name}_us"] = _graph_us(fn, x, args.calls, args.rounds)
        rows.append(row)
    queue.put((rank, {"symm": symm is not None, "nccl": nccl is not None, "rows": rows}))
    ctrl.allreduce([torch.zeros(1)]).wait()  # leave together


def _graph_us(fn, x: torch.Tensor, calls: int, rounds: int) -> float:
    """Microseconds per call of ``calls`` chained all-reduces captured in one CUDA graph (median of
    ``rounds`` replays); the inputs chain so no call can be dropped."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        y = x
        for _ in range(2):  # warm-up outside the graph (allocations, first launches)
            y = fn(y).mul_(0.5)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(calls):
            y = fn(y).mul_(0.5)
    return round(events_ms(graph.replay, rounds, warmup=1) * 1e3 / calls, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default="0,1", help="each rank's GPU (0,0: two ranks on one GPU, no NCCL)")
    ap.add_argument("--batches", default="1,8,64,128,256", help="rows of 4096 bf16 values per message")
    ap.add_argument("--max-kib", type=int, default=2048,
                    help="the one-shot path's buffer (PDSERVE_TP_ALLREDUCE=symm:KiB)")
    ap.add_argument("--calls", type=int, default=64,
                    help="all-reduces per graph (a decode step of 32 layers: 64)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    size = len(args.gpus.split(","))
    port = free_port()
    # The ranks inherit this: NVLink multicast stays off (shared hosts), and ranks sharing a GPU are
    # refused by torch unless told.
    env = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    if len(set(args.gpus.split(","))) < size:
        env["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, port, queue)) for r in range(size)]
    with environment(env):
        for p in procs:
            p.start()
    results = dict(queue.get(timeout=600) for _ in range(size))
    for p in procs:
        p.join(60)
    r0 = results[0]
    print(f"ranks on GPUs {args.gpus}: one-shot path {'set up' if r0['symm'] else 'NOT set up (NCCL only)'}; "
          f"NCCL {'on' if r0['nccl'] else 'off (ranks share a GPU)'}")
    print(f"{'batch':>6} {'KiB':>7} {'symm us':>8} {'exact':>6} {'nccl us':>8} {'exact':>6}")
    for row in r0["rows"]:
        print(f"{row['batch']:>6} {row['bytes'] // 1024:>7} {row.get('symm_us', '-'):>8} "
              f"{str(row.get('symm_exact', '-')):>6} {row.get('nccl_us', '-'):>8} "
              f"{str(row.get('nccl_exact', '-')):>6}")
    checks = [v for res in results.values() for row in res["rows"]
              for k, v in row.items() if k.endswith("_exact")]
    exact = bool(checks) and all(checks)  # nothing measured is a failure, not a pass
    name = torch.cuda.get_device_name(0).replace("NVIDIA ", "").replace(" ", "-").lower()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"allreduce-probe-{name}-{dt.date.today().isoformat()}.json"
    path.write_text(json.dumps({"benchmark": "allreduce-probe", "command": bench_command(), "gpus": args.gpus,
                                "torch": torch.__version__, "settings": vars(args), "all_exact": exact,
                                "ranks": results}, indent=1) + "\n")
    print(f"wrote {path}; {len(checks)} results checked, every one exact: {exact}")
    sys.exit(0 if exact and all(p.exitcode == 0 for p in procs) else 1)


if __name__ == "__main__":
    main()
