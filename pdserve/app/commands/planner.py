"""``pdserve planner``: the SLO-driven planner that sets the prefill and decode pools' replicas.

``planner explain`` prints the capacity model (seeded from a ``pdserve bench --sweep --json`` profile, or
built-in guesses), the knobs, what steady loads need (``--load RATE:PROMPT:OUTPUT``) and, for a recorded
trace of windows (``--trace FILE.jsonl``, one ``Signals`` per line, as ``planner run --record`` writes
them), each window's decision and why. ``planner run --dry-run`` scrapes a local cluster's processes
every ``--interval`` (``RUN_DIR/prometheus-targets.json``: ``pdserve up --metrics-port P``) and prints
and logs each decision without acting; to act on a local cluster, ``pdserve up --autoscale`` runs the same
loop and resizes the pools as ``pdserve scale`` does. ``planner run --actuator kubernetes --release NAME``
plans a chart release from its pods' metrics and sizes its prefill and decode Deployments through their
scale subresource, one replica acting at a time under a Lease (``--dry-run``: it only reports)
(docs/planner.md). The policy lives in ``pdserve/app/planner/``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _add_policy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("policy (pdserve/app/planner/policy.py)")
    g.add_argument("--ttft-slo-ms", type=float, help="TTFT target (default: the profile's, else 2000)")
    g.add_argument("--tpot-slo-ms", type=float, help="TPOT target (default: the profile's, else 25)")
    g.add_argument("--min-prefill", type=int, default=1)
    g.add_argument("--max-prefill", type=int, default=8)
    g.add_argument("--min-decode", type=int, default=1)
    g.add_argument("--max-decode", type=int, default=8)
    g.add_argument("--utilisation", type=float, default=0.8, help="share of a worker's capacity to plan "
                   "for (default 0.8)")
    g.add_argument("--band", type=float, default=0.1, help="hysteresis: up above n x (1 + band), down below "
                   "(n - 1) x (1 - band) (default 0.1)")
    g.add_argument("--up-cooldown", type=float, default=60.0, metavar="S", help="seconds after a change "
                   "before a pool may grow (default 60)")
    g.add_argument("--down-cooldown", type=float, default=300.0, metavar="S", help="seconds a pool must "
                   "have been over-provisioned, and unchanged, before it shrinks a step (default 300)")
    g.add_argument("--drain-horizon", type=float, metavar="S", help="a backlog is planned to be gone within "
                   "this (default: the TTFT target)")
    g.add_argument("--half-life", type=float, default=60.0, metavar="S", help="of the demand's weighted "
                   "mean (default 60)")
    g.add_argument("--max-step-up", type=int, default=4)
    g.add_argument("--max-step-down", type=int, default=1)
    g.add_argument("--profile", metavar="SWEEP.json", help="seed the capacity model from a "
                   "`pdserve bench --sweep --json` result")
    g.add_argument("--profile-mode", help="the profile's mode to read (when it holds several)")
    g.add_argument("--profile-prefill", type=int, metavar="N", help="prefill workers of the swept cluster "
                   "(default: from the profile)")
    g.add_argument("--profile-decode", type=int, metavar="N", help="decode workers of the swept cluster")


def _add_kubernetes_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("kubernetes (--actuator kubernetes; pdserve/app/planner/k8s.py)")
    g.add_argument("--namespace", help="the release's namespace (default: the pod's own)")
    g.add_argument("--release", metavar="FULLNAME", help="the chart's full name (the release name when it "
                   "contains 'pdserve'): Deployments FULLNAME-prefill and -decode, metrics from the "
                   "Endpoints of Services FULLNAME-router, -prefill and -decode")
    g.add_argument("--kubeconfig", help="kubeconfig file (default: the pod's service account, else "
                   "~/.kube/config)")
    g.add_argument("--context", help="kubeconfig context")
    g.add_argument("--scrape-port-name", default="metrics", help="the Services' port to scrape (default "
                   "metrics)")
    g.add_argument("--lease", help="the Lease the replicas elect a leader on (default FULLNAME-planner)")
    g.add_argument("--identity", help="this replica's name in the Lease (default: host name + a random "
                   "suffix)")
    g.add_argument("--lease-duration", type=int, default=15, metavar="S", help="a silent leader's lease "
                   "expires after this (default 15)")
    g.add_argument("--renew-deadline", type=float, default=10.0, metavar="S", help="a leader that could not "
                   "renew for this long stops acting (default 10; < --lease-duration)")
    g.add_argument("--retry-period", type=float, default=2.0, metavar="S", help="between renewals and a "
                   "follower's checks (default 2)")
    g.add_argument("--settle-timeout", type=float, default=600.0, metavar="S", help="after a resize, wait "
                   "this long at most for the pool's pods to be ready before the next window (default 600; "
                   "0: do not wait)")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("planner", help="SLO-driven replicas of the prefill and decode pools "
                                              "(explain; run --dry-run | --actuator kubernetes)")
    sub = p.add_subparsers(dest="planner_command", metavar="{explain,run}")
    e = sub.add_parser("explain", help="print the capacity model and, for a recorded trace, every decision "
                                       "and why")
    _add_policy_args(e)
    e.add_argument("--trace", metavar="FILE.jsonl", help="recorded windows (planner run --record)")
    e.add_argument("--load", action="append", default=[], metavar="RATE:PROMPT:OUTPUT",
                   help="a steady load to size the pools for (repeatable), e.g. 4:2000:200")
    e.add_argument("--changes", action="store_true",
                   help="with --trace: only the windows that changed a pool")
    e.add_argument("--json", action="store_true", help="the same as one JSON object")
    e.set_defaults(func=_explain)
    r = sub.add_parser("run", help="scrape a cluster every interval and print each decision (--dry-run: "
                                   "it never acts; --actuator kubernetes: it sizes a chart release's pools)")
    _add_policy_args(r)
    r.add_argument("--run-dir", default=".run/cluster", help="the cluster's run directory: its "
                   "prometheus-targets.json lists every process (pdserve up --metrics-port P)")
    r.add_argument("--dry-run", action="store_true", help="decide and report, never act (required without "
                   "--actuator: `pdserve up --autoscale` is the planner that acts on a local cluster)")
    r.add_argument("--actuator", choices=("none", "kubernetes"), default="none", help="what applies the "
                   "decisions: none, or kubernetes (a chart release's Deployments, by their scale "
                   "subresource)")
    r.add_argument("--interval", type=float, default=10.0, metavar="S",
                   help="seconds per window (default 10)")
    r.add_argument("--timeout", type=float, default=2.0, metavar="S", help="per scrape (default 2)")
    r.add_argument("--windows", type=int, metavar="N", help="stop after N windows (default: until Ctrl-C)")
    r.add_argument("--record", metavar="FILE.jsonl",
                   help="append each window's signals (a trace for explain)")
    r.add_argument("--metrics-port", type=int, default=0, help="serve the planner's metrics here (0: off)")
    r.add_argument("--metrics-host", default="127.0.0.1")
    r.add_argument("--json", action="store_true", help="a JSON line per window (signals and decision)")
    _add_kubernetes_args(r)
    r.set_defaults(func=_run)
    p.set_defaults(func=lambda _args: (p.print_help(), 2)[1])


def _setup(args: argparse.Namespace):
    """The config and the seeded capacity model from the flags (``ValueError`` with what is wrong)."""
    from pdserve.app.planner.capacity import CapacityModel, Seed, seed_from_sweep
    from pdserve.app.planner.policy import PlannerConfig

    seed, slo = Seed(), {}
    if args.profile:
        data = json.loads(Path(args.profile).read_text())
        seed = seed_from_sweep(data, mode=args.profile_mode, prefill_workers=args.profile_prefill,
                               decode_workers=args.profile_decode, label=Path(args.profile).name)
        results = data["results"]
        slo = results[args.profile_mode or next(iter(results))].get("slo") or {}
    ttft_ms = args.ttft_slo_ms or slo.get("ttft_ms") or 2000.0
    tpot_ms = args.tpot_slo_ms or slo.get("tpot_ms") or 25.0
    config = PlannerConfig(ttft_s=ttft_ms / 1e3, tpot_s=tpot_ms / 1e3, min_prefill=args.min_prefill,
                           max_prefill=args.max_prefill, min_decode=args.min_decode,
                           max_decode=args.max_decode,
                           utilisation=args.utilisation, band=args.band, up_cooldown_s=args.up_cooldown,
                           down_cooldown_s=args.down_cooldown, drain_horizon_s=args.drain_horizon,
                           demand_half_life_s=args.half_life, max_step_up=args.max_step_up,
                           max_step_down=args.max_step_down)
    return config, CapacityModel(seed=seed)


def _console():
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, 200))


def _explain(args: argparse.Namespace) -> int:
    import copy

    from pdserve.app.planner import explain
    from pdserve.app.planner.signals import load_trace

    try:
        config, seeded = _setup(args)
        loads = [explain.Load.parse(spec) for spec in args.load]
        trace = load_trace(args.trace) if args.trace else []
    except (ValueError, OSError, KeyError) as exc:
        print(f"pdserve planner explain: {exc}", file=sys.stderr)
        return 2
    learned = copy.deepcopy(seeded)
    decisions = explain.replay(config, learned, trace)
    if args.json:
        print(json.dumps(explain.as_json(config, seeded, loads=loads, trace=trace, decisions=decisions,
                                         learned=learned)))
    else:
        _console().print(explain.render(config, seeded, loads=loads, trace=trace, decisions=decisions,
                                        learned=learned, changes_only=args.changes))
    return 0


def _run(args: argparse.Namespace) -> int:
    import logging

    from pdserve.app.launcher.metrics_ports import PROMETHEUS_TARGETS
    from pdserve.app.planner.live import SignalSource, run
    from pdserve.app.planner.metrics import planner_registry
    from pdserve.app.planner.policy import Planner
    from pdserve.app.top.scrape import run_dir_targets

    if not args.dry_run and args.actuator == "none":
        print("pdserve planner run: give --dry-run (it decides and reports) or --actuator kubernetes; to act "
              "on a local cluster, start it with `pdserve up --autoscale` (docs/planner.md)", file=sys.stderr)
        return 2
    if not args.interval > 0 or (args.windows is not None and args.windows < 1):
        print("pdserve planner run: --interval must be > 0 and --windows >= 1", file=sys.stderr)
        return 2
    try:
        config, capacity = _setup(args)
    except (ValueError, OSError, KeyError) as exc:
        print(f"pdserve planner run: {exc}", file=sys.stderr)
        return 2
    if args.actuator == "kubernetes":
        return _run_kubernetes(args, config, capacity)
    read = run_dir_targets(Path(args.run_dir))
    if not read():
        print(f"pdserve planner run: no targets in {Path(args.run_dir) / PROMETHEUS_TARGETS} (was the "
              "cluster started with `pdserve up --metrics-port P`?)", file=sys.stderr)
        return 1
    import time

    metrics = planner_registry()
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_host, registry=metrics.registry)
    log = logging.getLogger("pdserve.planner")
    record = open(args.record, "a") if args.record else None  # closed in the finally below
    source = SignalSource(read, timeout=args.timeout)
    planner = Planner(config, capacity, clock=time.monotonic)

    def on_window(signals, decision) -> None:
        metrics.record(decision)
        log.info("planner decision (dry run): %s", json.dumps({"signals": signals.to_dict(),
                                                               "decision": decision.to_dict()}))
        if record is not None:
            record.write(json.dumps(signals.to_dict()) + "\n")
            record.flush()
        if args.json:
            print(json.dumps({"signals": signals.to_dict(), "decision": decision.to_dict(), "dry_run": True}),
                  flush=True)
            return
        stamp = time.strftime("%H:%M:%S")
        for p in decision.pools:
            print(f"{stamp} [dry run] {p.pool:<7} {p.reason}", flush=True)

    print(f"planner (dry run): {args.run_dir}, a window every {args.interval:g} s; nothing is scaled",
          file=sys.stderr)
    try:
        run(source, planner, interval=args.interval, on_window=on_window, windows=args.windows)
    except KeyboardInterrupt:
        pass
    finally:
        source.close()
        if record is not None:
            record.close()
    return 0


def _run_kubernetes(args: argparse.Namespace, config, capacity) -> int:
    """``planner run --actuator kubernetes``: the loop in a thread (``actuator.Autoscaler``) acting on a
    chart release while this replica leads; SIGTERM or Ctrl-C stop the loop first, then release the Lease."""
    import signal
    import threading
    import time

    from kubernetes.client import CoreV1Api
    from kubernetes.config import ConfigException
    from prometheus_client import Gauge

    from pdserve.app.planner import k8s
    from pdserve.app.planner.actuator import Autoscaler
    from pdserve.app.planner.lease import LeaseConfig, default_identity
    from pdserve.app.planner.live import SignalSource
    from pdserve.app.planner.metrics import planner_registry
    from pdserve.app.planner.policy import Planner

    namespace = args.namespace or k8s.in_cluster_namespace()
    if not (namespace and args.release) or args.json:
        print("pdserve planner run --actuator kubernetes: needs --release (and --namespace outside a pod); "
              "--json is not for it (each decision and action is logged as JSON at INFO)", file=sys.stderr)
        return 2
    try:
        release = k8s.Release(namespace=namespace, fullname=args.release)
        lease = None if args.dry_run else LeaseConfig(
            namespace=namespace, name=args.lease or release.lease,
            identity=args.identity or default_identity(), lease_duration_s=args.lease_duration,
            renew_deadline_s=args.renew_deadline, retry_period_s=args.retry_period)
        if args.settle_timeout < 0:
            raise ValueError("--settle-timeout must be >= 0")
    except ValueError as exc:
        print(f"pdserve planner run: {exc}", file=sys.stderr)
        return 2
    try:
        api = k8s.api_client(args.kubeconfig, args.context)
    except (OSError, ConfigException) as exc:
        where = f"kubeconfig {args.kubeconfig or '~/.kube/config'}"
        where += f", context {args.context}" if args.context else ""
        print(f"pdserve planner run: no Kubernetes API to use ({where}; not in a pod): {exc}",
              file=sys.stderr)
        return 2
    metrics = planner_registry()
    leader = Gauge("pdserve_planner_leader", "1 while this planner replica holds the Lease and acts",
                   registry=metrics.registry)
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_host, registry=metrics.registry)

    def on_leader_change(leading: bool) -> None:
        leader.set(1 if leading else 0)
        state = "leads: it scales the pools" if leading else "does not lead: it decides, the leader scales"
        print(f"{time.strftime('%H:%M:%S')} planner {lease.identity} {state}", flush=True)

    actuator = k8s.KubernetesActuator(api, release, Planner(config, capacity, clock=time.monotonic),
                                      lease=lease, dry_run=args.dry_run, settle_timeout_s=args.settle_timeout,
                                      on_leader_change=on_leader_change)
    record = open(args.record, "a") if args.record else None  # closed in the finally below
    source = SignalSource(k8s.endpoint_targets(CoreV1Api(api), namespace, release.services(),
                                               args.scrape_port_name), timeout=args.timeout)
    autoscaler = Autoscaler(actuator, source, interval=args.interval, windows=args.windows, metrics=metrics,
                            record=record, echo=lambda line: print(line, flush=True))
    stopping = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    who = "dry run: nothing is scaled" if lease is None else f"lease {lease.name} as {lease.identity}"
    print(f"planner (kubernetes): {namespace}/{release.deployment('prefill')} {config.min_prefill}.."
          f"{config.max_prefill}, {release.deployment('decode')} {config.min_decode}..{config.max_decode}, "
          f"a window every {args.interval:g} s; {who}", file=sys.stderr, flush=True)
    try:
        actuator.start()
        autoscaler.start()
        while autoscaler.running() and not stopping.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        actuator.interrupt()  # a wait for a pool to settle ends now
        autoscaler.stop()  # the loop ends (a PATCH in progress completes) before the Lease is let go
        actuator.close(release=True)
        signal.signal(signal.SIGTERM, previous)
        if record is not None:
            record.close()
    return 0
