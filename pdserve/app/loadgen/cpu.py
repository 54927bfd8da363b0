"""CPU cost of a load, per process of the cluster, read from the processes themselves.

``read(router)`` asks the router for its workers (ListWorkers) and every process -- the router and
each worker -- for its own CPU seconds (``Process/GetProcessStats``: user + system of all its
threads, gRPC's C-core threads included). ``report(before, after, summary)`` turns two reads around a
load into CPU seconds per request and per output token for each process and role, and the whole
cluster's CPU cores per 1k output tokens/s at that load: the figure a platform team multiplies by
its traffic. A process that restarted between the reads (another pid) is left out and named.
"""

from __future__ import annotations

import grpc

from pdserve.v1 import process_pb2, process_pb2_grpc, router_pb2, router_pb2_grpc


def read(router: str, *, api_key: str = "", timeout: float = 5.0) -> dict[str, dict]:
    """{process name: {role, pid, cpu_seconds}} of the router and every worker it lists."""
    md = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    out: dict[str, dict] = {}
    with grpc.insecure_channel(router) as ch:
        workers = router_pb2_grpc.RouterStub(ch).ListWorkers(router_pb2.ListWorkersRequest(), timeout=timeout,
                                                             metadata=md).workers
        out["router"] = _stats(ch, "router", md, timeout)
    for w in workers:
        try:
            with grpc.insecure_channel(w.address) as ch:
                out[w.worker_id] = _stats(ch, w.role, (), timeout)
        except grpc.RpcError:  # gone meanwhile: the report names what it could read
            continue
    return out


def try_read(router: str, *, backend: str = "grpc", api_key: str = "") -> dict[str, dict] | None:
    """``read``, or None where it cannot be had (the HTTP door, a process without the service):
    the latency report never fails for want of the CPU one."""
    if backend != "grpc":
        return None
    try:
        return read(router, api_key=api_key)
    except grpc.RpcError:
        return None


def _stats(ch: grpc.Channel, role: str, md, timeout: float) -> dict:
    s = process_pb2_grpc.ProcessStub(ch).GetProcessStats(process_pb2.ProcessStatsRequest(), timeout=timeout,
                                                         metadata=md)
    return {"role": role, "pid": s.pid, "cpu_seconds": s.cpu_seconds}


def report(before: dict[str, dict], after: dict[str, dict], summary: dict) -> dict:
    """CPU per request / per output token of each process and role over the load of ``summary``."""
    duration = max(float(summary.get("duration_s", 0.0)), 1e-9)
    requests = int(summary.get("num_ok", 0))
    tokens = float(summary.get("output_token_throughput", 0.0)) * duration

    def row(role: str, cpu_s: float) -> dict:
        return {"role": role, "cpu_s": cpu_s, "cores": cpu_s / duration,
                "cpu_ms_per_request": cpu_s / requests * 1e3 if requests else float("nan"),
                "cpu_us_per_output_token": cpu_s / tokens * 1e6 if tokens else float("nan")}

    processes, skipped = {}, []
    for name, a in after.items():
        b = before.get(name)
        if b is None or b["pid"] != a["pid"]:
            skipped.append(name)
            continue
        processes[name] = row(a["role"], a["cpu_seconds"] - b["cpu_seconds"])
    roles: dict[str, float] = {}
    for p in processes.values():
        roles[p["role"]] = roles.get(p["role"], 0.0) + p["cpu_s"]
    total = sum(roles.values())
    tok_s = tokens / duration
    per_1k = total / duration / (tok_s / 1e3) if tok_s else float("nan")
    return {"processes": processes, "roles": {r: row(r, v) for r, v in roles.items()},
            "cluster": {**row("cluster", total), "cores_per_1k_output_tok_s": per_1k},
            "not_measured": skipped}


def format_table(cpu: dict) -> str:
    lines = [f"{'CPU (own, per process)':<24} {'cores':>6} {'ms/req':>8} {'us/out tok':>10}"]
    for name, r in [*cpu["processes"].items(), ("cluster", cpu["cluster"])]:
        label = name if name in ("router", "cluster") else f"{name} ({r['role']})"
        lines.append(f"{label:<24} {r['cores']:>6.2f} {r['cpu_ms_per_request']:>8.2f} "
                     f"{r['cpu_us_per_output_token']:>10.1f}")
    per_1k = cpu["cluster"]["cores_per_1k_output_tok_s"]
    lines.append(f"cluster CPU cores per 1k output tokens/s: {per_1k:.2f}")
    if cpu["not_measured"]:
        lines.append(f"not measured (restarted or gone): {', '.join(cpu['not_measured'])}")
    return "\n".join(lines)


def format_sweep(results: dict[str, dict]) -> str:
    """One row per (mode, rate point) of a sweep: output tokens/s beside the CPU each role kept busy,
    the router's CPU per request and per output token, and the cluster's cores per 1k tokens/s."""
    head = (f"{'mode':<20}{'rate':>7}{'out tok/s':>10}{'router us/tok':>14}{'router ms/req':>14}"
            f"{'cores by role':>44}{'cores/1k tok/s':>16}")
    lines = [head, "-" * len(head)]
    for mode, res in results.items():
        for p in [*res.get("points", ()), *([res["overload"]] if "overload" in res else [])]:
            c = p.get("cpu")
            if not c:
                continue
            r = c["roles"].get("router", {})
            roles = " ".join(f"{role} {v['cores']:.2f}" for role, v in sorted(c["roles"].items()))
            lines.append(f"{mode:<20}{p['rate']:>7g}{p.get('output_token_throughput', 0.0):>10.0f}"
                         f"{r.get('cpu_us_per_output_token', float('nan')):>14.1f}"
                         f"{r.get('cpu_ms_per_request', float('nan')):>14.2f}{roles:>44}"
                         f"{c['cluster']['cores_per_1k_output_tok_s']:>16.2f}")
    return "\n".join(lines) if len(lines) > 2 else ""
