"""The decode kernel variants of ``bench/gpu.py --kernel-variants``: torch's element-wise ops, the
Triton kernels of ``engine.fused_ops``, and those plus ``engine.gemv``'s batch-1 products, each through
freshly captured graphs, rounds alternated in one run (docs/gpu.md "Decode at batch 1")."""

from __future__ import annotations

import statistics

import torch.nn.functional as F

from engine.gemv import LONG_ROW
from engine.model import CausalLM

# The decode kernel configurations the variant compares: CausalLM.set_fused_ops arguments, and
# "long_rows": False for engine.gemv without its long-row configuration (the down product).
KERNEL_CONFIGS = {
    "torch": {"enabled": False},  # torch element-wise ops, cuBLAS products
    "fused": {"enabled": True, "gemv": False},  # engine.fused_ops, cuBLAS products
    "fused+gemv": {"enabled": True, "gemv": True},  # engine.fused_ops, engine.gemv at batch 1 (default)
    "fused+gemv-short-rows": {"enabled": True, "gemv": True, "long_rows": False},
}
DEFAULT_KERNEL_CONFIGS = ("torch", "fused", "fused+gemv")


def _kernel_config(model: CausalLM, spec: dict) -> None:
    """Put ``model`` in one of ``KERNEL_CONFIGS`` (``_kernel_config_reset`` undoes it)."""
    from engine import gemv

    gemv.LONG_ROW = LONG_ROW  # the previous configuration's tweak, if any, undone

    kw = {k: spec[k] for k in ("enabled", "gemv") if k in spec}
    if model.set_fused_ops(**kw) is not spec["enabled"]:
        raise RuntimeError(f"set_fused_ops({kw}) did not take")
    if (model.linear is not F.linear) is not spec.get("gemv", False):
        raise RuntimeError(f"set_fused_ops({kw}): the batch-1 product did not follow")
    if not spec.get("long_rows", True):
        gemv.LONG_ROW = 1 << 62


def _kernel_config_reset(model: CausalLM) -> None:
    from engine import gemv

    gemv.LONG_ROW = LONG_ROW
    model.set_fused_ops()  # back to the engine's own choice


def fused_ops_variant(roofline, model: CausalLM, cfg, ceil: dict, quick: bool, rounds: int = 2,
                      configs: tuple[str, ...] = DEFAULT_KERNEL_CONFIGS) -> dict:
    """Decode steps under each of ``configs`` (``KERNEL_CONFIGS``: torch ops; ``engine.fused_ops``' Triton
    kernels; the kernels plus ``engine.gemv``'s batch-1 products, with or without its long-row
    configuration), each through freshly captured graphs, alternated over ``rounds`` in one run; each
    cell is the median of its rounds. ``roofline``: bench/gpu.py's decode measurement."""
    batches, contexts = ([1, 64], [1024]) if quick else ([1, 16, 64], [1024, 4096])
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    try:
        for turn in range(rounds):
            for name in configs:
                _kernel_config(model, KERNEL_CONFIGS[name])
                print(f"  decode, {name} (round {turn + 1}/{rounds}):", flush=True)
                runs[name].append(roofline(model, cfg, ceil, quick, with_prefill=False, batches=batches,
                                           contexts=contexts))
    except Exception as exc:  # a variant must not cost the rest of the run
        return {"status": "not run", "reason": f"{type(exc).__name__}: {exc}"}
    finally:
        _kernel_config_reset(model)
    rows = []
    for i, cell in enumerate(runs[configs[0]][0]["decode"]):
        row = {"batch": cell["batch"], "context": cell["context"], "hbm_bound_ms": cell["hbm_bound_ms"]}
        for name in configs:
            step = statistics.median(run["decode"][i]["step_ms"] for run in runs[name])
            row[f"{name}_step_ms"] = step
            row[f"{name}_fraction_of_bound"] = cell["hbm_bound_ms"] / step
            row[f"{name}_rounds_ms"] = [run["decode"][i]["step_ms"] for run in runs[name]]
            row[f"{name}_replay_ms"] = statistics.median(run["decode"][i]["replay_ms"]
                                                         for run in runs[name])
        rows.append(row)
        print(f"  b={row['batch']:3d} ctx={row['context']:5d}: "
              + ", ".join(f"{name} {row[f'{name}_step_ms']:.2f} ms ({row[f'{name}_fraction_of_bound']:.1%})"
                          for name in configs), flush=True)
    return {"decode": rows, "configs": {name: KERNEL_CONFIGS[name] for name in configs}, "rounds": rounds,
            "runs": runs}
