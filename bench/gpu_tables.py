"""Tables of a ``bench/gpu.py`` result: printed, and written as markdown next to the JSON."""

from __future__ import annotations


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def markdown(r: dict) -> str:
    d = r["device"]
    c = r.get("ceilings") or {}
    out = [
        f"# GPU benchmark: {d['name']} x{d['count']}",
        "",
        f"driver {d['driver']}, torch {d['torch']} (CUDA {d['cuda']}), date {r['date']}",
        "",
        *([f"command: `{r['command']}`"] if not r.get("commands") else
          ["commands (one device lease; each item's ratios come from its own run):", ""]
          + [f"- {item}: `{cmd}`" for item, cmd in r["commands"].items()]),
        "",
        f"ceilings ({'roofline run' if r.get('commands') else 'same run'}):"
        f" copy {_f(c.get('copy_GBps'), '{:.0f}')} GB/s (read+write), "
        f"bf16 matmul {_f(c.get('matmul_bf16_TFLOPs'), '{:.0f}')} TFLOP/s",
        "",
    ]
    rf = r.get("roofline")
    if rf:
        out += [
            "## Roofline: decode step (CUDA graph) vs HBM bound",
            "",
            "| batch | context | step ms | HBM bound ms | fraction | graph replayed alone ms (fraction) "
            "| wall ms | eager ms | tok/s |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for x in rf["decode"]:
            replay = (f"{x['replay_ms']:.2f} ({x['replay_fraction_of_bound']:.1%})" if "replay_ms" in x
                      else "-")
            out.append(
                f"| {x['batch']} | {x['context']} | {x['step_ms']:.2f} | {x['hbm_bound_ms']:.2f} | "
                f"{x['fraction_of_bound']:.1%} | {replay} | {x['step_wall_ms']:.2f} | "
                f"{_f(x.get('eager_step_ms'))} | {x['tokens_per_s']:.0f} |"
            )
        p = rf["prefill"]
        out += [
            "",
            f"Prefill {p['tokens']} tokens: {p['ms']:.1f} ms, {p['TFLOPs']:.0f} TFLOP/s = "
            f"{p['fraction_of_matmul_peak']:.1%} of the measured matmul rate (goal 55%).",
            "",
        ]
    t = r.get("transfer")
    if t:
        from gpu_transfer import transfer_markdown

        out += transfer_markdown(t)
    v = r.get("decode_tensor_core_variant")
    if v:
        out += ["## Variant: tensor-core decode kernel (same run)", "",
                "| batch | context | step ms | HBM bound ms | fraction |", "|---:|---:|---:|---:|---:|"]
        out += [f"| {x['batch']} | {x['context']} | {x['step_ms']:.2f} | {x['hbm_bound_ms']:.2f} | "
                f"{x['fraction_of_bound']:.1%} |" for x in v["decode"]]
        out.append("")
    fv = r.get("decode_fused_ops_variant")
    if fv:
        out += ["## Variant: decode with torch ops, engine.fused_ops, and engine.fused_ops + engine.gemv "
                "(same run, alternated rounds, medians)", ""]
        if fv.get("status") == "not run":
            out += [f"not run: {fv.get('reason')}", ""]
        elif "configs" in fv:
            names = list(fv["configs"])
            out += ["| batch | context | HBM bound ms | " + " | ".join(f"{n} ms (fraction)" for n in names)
                    + " |",
                    "|---:|---:|---:|" + "---:|" * len(names)]
            out += [f"| {x['batch']} | {x['context']} | {x['hbm_bound_ms']:.2f} | "
                    + " | ".join(f"{x[f'{n}_step_ms']:.2f} ({x[f'{n}_fraction_of_bound']:.1%})"
                                 for n in names)
                    + " |" for x in fv["decode"]]
            out.append("")
    h = r.get("transformers")
    if h:
        out += [
            "## Single-request decode vs transformers",
            "",
            f"pdserve {h['pdserve_tokens_per_s']:.1f} tok/s, "
            f"transformers {h['transformers_version']} generate "
            f"({h['transformers_attn']}) {h['transformers_tokens_per_s']:.1f} tok/s: "
            f"{h['ratio_pdserve_over_transformers']:.2f}x",
            "",
        ]
    dv = r.get("disagg_vs_colocated")
    if dv:
        out += ["## Disaggregated vs colocated", ""]
        if dv.get("status") == "not run":
            out.append(f"not run: {dv.get('reason')}")
        else:
            out += dv.get("markdown", [])
        out.append("")
    return "\n".join(out)


def print_tables(r: dict) -> str:
    text = markdown(r)
    print(text)
    return text
