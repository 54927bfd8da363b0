"""``pdserve up --model DIR --prefill N --decode M ...``: start a cluster and keep it running.

Each pool runs as Ray actors (an embedded local Ray by default; ``--ray-address`` joins an existing
cluster) supervising `pdserve serve` processes; ``--launcher process`` starts plain subprocesses
instead (no Ray start-up cost; what `make run` uses). Prints ``router: HOST:PORT`` once every
worker is healthy and the router sees them all (and ``http: HOST:PORT`` once the OpenAI-compatible
door answers, with ``--http-port``), then runs until Ctrl-C / SIGTERM / `pdserve down`.
State lives in ``--run-dir`` (default .run/cluster) for `pdserve down` and `pdserve scale`.
``--autoscale`` runs the planner beside the cluster: each window it scrapes the processes' metrics (as
`pdserve planner run` does) and resizes the pools through ``Cluster.scale``, the call a `pdserve scale`
request ends in (``pdserve/app/planner/actuator.py``; ``--autoscale dry-run`` only logs and prints).
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path

from pdserve.settings import DEFAULT_DRAIN_TIMEOUT_S, POLICIES, environ

DEFAULT_RUN_DIR = ".run/cluster"
_PASS_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "UCX_TLS", "CUDA_VISIBLE_DEVICES", "PDSERVE_LEASE_MS")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("up", help="start a prefill pool, a decode pool and a router")
    p.add_argument("--model", required=True)
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    p.add_argument("--colocated", type=int, default=0, metavar="N",
                   help="N colocated workers behind the router instead of prefill/decode pools")
    p.add_argument("--conditional-disagg", choices=["off", "auto"],
                   help="router: let decode workers prefill short/cheap prompts locally (default off)")
    p.add_argument("--min-uncached-tokens", type=int, help="router, conditional: threshold (default 256)")
    p.add_argument("--prefill-tp", type=int, default=1, metavar="N",
                   help="tensor parallel size of each prefill worker: N ranks on N GPUs (default 1)")
    p.add_argument("--decode-tp", type=int, default=1, metavar="M",
                   help="tensor parallel size of each decode (or colocated) worker (default 1); KV moves "
                        "rank to rank between pools of different sizes")
    p.add_argument("--gpus-per-worker", type=int, default=0,
                   help="GPUs per worker, round robin over the visible GPUs in launch order (prefill first)")
    p.add_argument("--prefill-gpus", help="GPU ids for the prefill pool, e.g. 0 or 0,1 (with --decode-gpus)")
    p.add_argument("--decode-gpus", help="GPU ids for the decode (or colocated) pool, e.g. 1")
    p.add_argument("--gpu-peers", action="store_true",
                   help="each worker also sees the other GPUs after its own (NIXL cuda_ipc between GPUs)")
    p.add_argument("--transport", default="auto", choices=["auto", "nixl", "tcp"])
    p.add_argument("--router-port", type=int, default=0, help="router port (default: a free one)")
    p.add_argument("--http-port", type=int, default=0,
                   help="router: OpenAI-compatible HTTP API on this port (0 = off, default)")
    p.add_argument("--served-model-name",
                   help="router: model name of the HTTP API (default: the directory's)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="router: accept this key (authorization: Bearer KEY) on gRPC and HTTP; repeatable")
    p.add_argument("--api-keys-file",
                   help="router: file of accepted keys, one a line, re-read when it changes")
    p.add_argument("--policy", default="prefix", choices=POLICIES)
    p.add_argument("--ray-address", help="join this Ray cluster instead of starting a local one")
    p.add_argument("--launcher", default="ray", choices=["ray", "process"])
    p.add_argument("--ray-num-cpus", type=int, default=2, help="CPUs of the embedded local Ray (default 2)")
    p.add_argument("--num-blocks", type=int, help="KV blocks per worker")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--kv-host-gb", type=float,
                   help="every worker: host-memory KV tier in GiB (0: off; default: `pdserve serve`'s)")
    p.add_argument("--kv-disk-dir", help="every worker: a local-disk KV tier in DIR/<worker name> (with "
                   "--kv-disk-gb); a restarted worker finds its blocks there again")
    p.add_argument("--kv-disk-gb", type=float, help="every worker: size of its disk KV tier in GiB")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S)
    p.add_argument("--prefill-args", default="", metavar="FLAGS",
                   help="extra `pdserve serve` flags for prefill workers only, one quoted string "
                        "(e.g. \"--max-num-batched-tokens 8192\": a compute-tuned prefill pool)")
    p.add_argument("--decode-args", default="", metavar="FLAGS",
                   help="extra `pdserve serve` flags for decode (and colocated) workers only "
                        "(e.g. \"--kv-memory-gb 100\": a memory-tuned decode pool)")
    p.add_argument("--metrics-port", type=int, default=0, metavar="P",
                   help="the router's Prometheus metrics on P; every worker then serves its own on a free "
                        "port (printed, and listed for Prometheus' file_sd_configs in "
                        "RUN_DIR/prometheus-targets.json)")
    p.add_argument("--otlp-endpoint", metavar="HOST:PORT",
                   help="every process sends its spans to this OTLP/gRPC receiver (one trace per request "
                        "across router, prefill and decode; docs/observability.md)")
    p.add_argument("--otlp-sampling", type=float, default=1.0, help="share of new traces sampled (default 1)")
    p.add_argument("--router-args", default="", metavar="FLAGS",
                   help="extra `pdserve serve` flags for the router, one quoted string (e.g. "
                        "\"--max-request-bytes 8388608 --stats-interval 0.2\")")
    p.add_argument("--tls-dir", help="TLS from this directory (`pdserve certs init DIR`): the router's port "
                   "over TLS, mutual TLS on every worker port and internal channel (default: plaintext)")
    p.add_argument("--host", help="every listener of the cluster binds this address (default: 127.0.0.1 for "
                   "--launcher process, each Ray node's IP for ray)")
    p.add_argument("--zygote", choices=["on", "off"], default="on",
                   help="fork restarted and added processes from one that imported torch and pdserve "
                        "already (started beside the first processes), so restarts and scale-ups skip the "
                        "imports (one per host for --launcher process, one per Ray actor); off: a fresh "
                        "interpreter each time (default on)")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="restart a process that exits unexpectedly at most this often within 5 minutes, then "
                        "leave it down (crash loop); 0 = never restart (default 5)")
    p.add_argument("--restart-backoff-s", type=float, default=1.0, metavar="S",
                   help="wait before the first restart of a process; each further death within 5 minutes "
                        "doubles it, up to 30 s (default 1)")
    p.add_argument("--liveness-failures", type=int, default=6, metavar="N",
                   help="kill (and so restart) a process that is alive but has not answered N health "
                        "checks in a row, --liveness-period-s apart (a frozen or hung worker); 0 = never "
                        "(default 6, as the chart's liveness probe)")
    p.add_argument("--liveness-period-s", type=float, default=10.0, metavar="S",
                   help="seconds between liveness checks; each waits at most min(5, S) (default 10)")
    p.add_argument("--autoscale", nargs="?", const="on", choices=["on", "dry-run"],
                   help="run the planner in this process: every window it scrapes the cluster's metrics and "
                        "resizes the prefill and decode pools as `pdserve scale` does (scale-down by drain); "
                        "dry-run: decide, log and print only. Needs the metrics: without --metrics-port a "
                        "free port is picked (docs/planner.md)")
    p.add_argument("--planner-args", default="", metavar="FLAGS",
                   help="with --autoscale: `pdserve planner run` flags, one quoted string (e.g. "
                        "\"--min-prefill 1 --max-prefill 3 --interval 10 --profile sweep.json\"; its "
                        "--metrics-port serves the planner's own metrics)")
    p.add_argument("--run-dir", default=DEFAULT_RUN_DIR)
    p.add_argument("--detach", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from pdserve.app.launcher.backends import ProcessBackend, RayBackend
    from pdserve.app.launcher.cluster import Cluster, ClusterSpec
    from pdserve.app.launcher.devices import DevicePlan, parse_ids, visible_gpus
    from pdserve.app.launcher.supervisor import RestartPolicy
    from pdserve.app.tp_ranks import pool_tp_args

    worker_args = ["--device", args.device]
    if args.num_blocks:
        worker_args += ["--num-blocks", str(args.num_blocks)]
    if args.max_num_seqs:
        worker_args += ["--max-num-seqs", str(args.max_num_seqs)]
    tracing = (["--otlp-endpoint", args.otlp_endpoint, "--otlp-sampling", str(args.otlp_sampling)]
               if args.otlp_endpoint else [])
    worker_args += tracing
    if args.kv_host_gb is not None:
        worker_args += ["--kv-host-gb", str(args.kv_host_gb)]
    if bool(args.kv_disk_dir) != bool(args.kv_disk_gb):
        raise SystemExit("pdserve up: give --kv-disk-dir and --kv-disk-gb together")
    if args.kv_disk_gb:  # each worker in DIR/<its name> (launcher.cluster.per_worker_disk_dir)
        worker_args += ["--kv-disk-dir", str(Path(args.kv_disk_dir).resolve()),
                        "--kv-disk-gb", str(args.kv_disk_gb)]
    router_args: list[str] = list(tracing)
    if args.conditional_disagg:
        router_args += ["--conditional-disagg", args.conditional_disagg]
    if args.min_uncached_tokens is not None:
        router_args += ["--min-uncached-tokens", str(args.min_uncached_tokens)]
    if args.served_model_name:
        router_args += ["--served-model-name", args.served_model_name]
    router_args += shlex.split(args.router_args)  # last: the later flag wins
    planner = None
    if args.autoscale or args.planner_args:
        try:
            planner = _planner_options(args)
        except ValueError as exc:
            print(f"pdserve up: {exc}", file=sys.stderr)
            return 2
        if not args.metrics_port:  # the planner reads the cluster through its metrics
            from pdserve.probe import free_port

            args.metrics_port = free_port()
    try:
        prefill_tp_args, decode_tp_args = pool_tp_args(prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
                                                       colocated=bool(args.colocated))
        # A TP-N worker owns N GPUs (on a CUDA host): its ranks are cuda:0..N-1 of what it is given.
        visible = visible_gpus(environ()) if args.device != "cpu" else ()
        tp_gpus = bool(visible) and max(args.prefill_tp, args.decode_tp) > 1
        devices = DevicePlan(gpus_per_worker=args.gpus_per_worker, prefill_gpus=parse_ids(args.prefill_gpus),
                             decode_gpus=parse_ids(args.decode_gpus),
                             visible=visible if args.gpus_per_worker or args.gpu_peers or tp_gpus else (),
                             peers=args.gpu_peers,
                             prefill_per_worker=args.prefill_tp if tp_gpus else 0,
                             decode_per_worker=args.decode_tp if tp_gpus else 0)
        spec = ClusterSpec(model=str(Path(args.model).resolve()),
                           num_prefill=0 if args.colocated else args.prefill,
                           num_decode=args.colocated or args.decode, colocated=bool(args.colocated),
                           transport=args.transport, router_port=args.router_port,
                           worker_args=tuple(worker_args), policy=args.policy,
                           prefill_args=(*prefill_tp_args, *shlex.split(args.prefill_args)),
                           decode_args=(*decode_tp_args, *shlex.split(args.decode_args)),
                           drain_timeout=args.drain_timeout, router_args=tuple(router_args), devices=devices,
                           tls_dir=str(Path(args.tls_dir).resolve()) if args.tls_dir else "",
                           restart=RestartPolicy(enabled=args.max_restarts > 0,
                                                 max_restarts=max(args.max_restarts, 0),
                                                 backoff_s=args.restart_backoff_s,
                                                 liveness_failures=args.liveness_failures,
                                                 liveness_period_s=args.liveness_period_s,
                                                 liveness_timeout_s=min(5.0, args.liveness_period_s)),
                           http_port=args.http_port, api_keys=tuple(args.api_key),
                           metrics_port=args.metrics_port,
                           api_keys_file=(str(Path(args.api_keys_file).resolve())
                                          if args.api_keys_file else ""))
    except ValueError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir).resolve()
    # Ray actors do not inherit the driver's environment: pass on what tunes the workers.
    process_env = environ()
    env = {k: process_env[k] for k in _PASS_ENV if k in process_env}
    if args.launcher == "ray":
        backend = RayBackend(run_dir, env=env, address=args.ray_address, num_cpus=args.ray_num_cpus,
                             zygote=args.zygote == "on")
    else:
        backend = ProcessBackend(run_dir, env=env, zygote=args.zygote == "on")
    if args.host:
        backend.host = args.host
    cluster = Cluster(spec=spec, backend=backend, run_dir=run_dir)
    autoscaler = None
    try:
        address = cluster.up()
        print(f"router: {address}", flush=True)
        for group in cluster.metrics.targets(address, [(cluster._serve_role(h.role), h.worker_id, h.address)
                                                       for hs in cluster.workers.values() for h in hs]):
            print(f"metrics: {group['labels']['pdserve_process']} http://{group['targets'][0]}/metrics",
                  flush=True)
        if args.metrics_port:
            print(f"prometheus targets: {run_dir / 'prometheus-targets.json'}", flush=True)
        if cluster.http_address:
            _wait_http(cluster.http_address)
            print(f"http: {cluster.http_address}", flush=True)
        pools = (f"{spec.num_decode} colocated" if spec.colocated
                 else f"{spec.num_prefill} prefill, {spec.num_decode} decode")
        print(f"cluster up ({args.launcher}): {pools}; "
              f"`pdserve down --run-dir {args.run_dir}` stops it", flush=True)
        if planner is not None:
            autoscaler = _start_autoscaler(planner, cluster, run_dir)
        cluster.serve()
    except Exception as exc:
        logging.getLogger(__name__).exception("cluster failed")
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 1
    finally:
        if autoscaler is not None:
            autoscaler.stop()  # before down(): a scale in progress finishes, none starts after
        if planner is not None and planner.record_file is not None:
            planner.record_file.close()
        cluster.down()
        print("cluster down", flush=True)
    return 0


def _planner_options(args: argparse.Namespace) -> argparse.Namespace:
    """`pdserve planner run`'s flags from ``--planner-args``, parsed by that command's own parser, with
    ``config`` and ``capacity`` (its ``_setup``) and ``dry_run`` added. ``ValueError``: what is wrong."""
    from pdserve.app.commands import planner as planner_command

    if not args.autoscale:
        raise ValueError("--planner-args needs --autoscale")
    if args.colocated:
        raise ValueError("--autoscale plans prefill and decode pools; a colocated cluster has neither")
    parser = argparse.ArgumentParser(prog="pdserve up --planner-args", add_help=False)
    planner_command.register(parser.add_subparsers())
    try:
        opts = parser.parse_args(["planner", "run", *shlex.split(args.planner_args)])
    except SystemExit:  # argparse printed what it did not understand
        raise ValueError(f"--planner-args {args.planner_args!r}: not `pdserve planner run` flags") from None
    if opts.actuator != "none":
        raise ValueError(f"--planner-args: --actuator {opts.actuator} is `planner run`'s; pdserve up's "
                         "planner acts on the local cluster it runs")
    if opts.json or opts.run_dir != DEFAULT_RUN_DIR:
        raise ValueError("--planner-args: --json and --run-dir are `planner run`'s alone (the run directory "
                         "is pdserve up's --run-dir)")
    if not opts.interval > 0 or (opts.windows is not None and opts.windows < 1):
        raise ValueError("--planner-args: --interval must be > 0 and --windows >= 1")
    try:
        opts.config, opts.capacity = planner_command._setup(opts)
    except (OSError, KeyError) as exc:
        raise ValueError(f"--planner-args: {exc}") from None
    if opts.config.min_prefill < 1 or opts.config.min_decode < 1:
        raise ValueError("--planner-args: a pool of a local cluster keeps at least one worker (as `pdserve "
                         "scale`): --min-prefill and --min-decode must be >= 1")
    opts.dry_run = opts.dry_run or args.autoscale == "dry-run"
    opts.record_file = None
    return opts


def _start_autoscaler(opts: argparse.Namespace, cluster, run_dir: Path):
    """The planner's loop in a thread beside ``cluster.serve()`` (``pdserve/app/planner/actuator.py``)."""
    import time

    from pdserve.app.planner.actuator import Actuator, Autoscaler
    from pdserve.app.planner.live import SignalSource
    from pdserve.app.planner.metrics import planner_registry
    from pdserve.app.planner.policy import Planner
    from pdserve.app.top.scrape import run_dir_targets

    metrics = planner_registry()
    if opts.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(opts.metrics_port, addr=opts.metrics_host, registry=metrics.registry)
    if opts.record:
        opts.record_file = open(opts.record, "a")  # closed by _run
    actuator = Actuator(cluster, Planner(opts.config, opts.capacity, clock=time.monotonic),
                        dry_run=opts.dry_run)
    autoscaler = Autoscaler(actuator, SignalSource(run_dir_targets(run_dir), timeout=opts.timeout),
                            interval=opts.interval, windows=opts.windows, metrics=metrics,
                            record=opts.record_file, echo=lambda line: print(line, flush=True))
    c = opts.config
    print(f"autoscale{' (dry run: nothing is scaled)' if opts.dry_run else ''}: a window every "
          f"{opts.interval:g} s; prefill {c.min_prefill}..{c.max_prefill}, decode {c.min_decode}.."
          f"{c.max_decode}; cool-downs up {c.up_cooldown_s:g} s, down {c.down_cooldown_s:g} s", flush=True)
    autoscaler.start()
    return autoscaler


def _wait_http(address: str, timeout: float = 30.0) -> None:
    """Until the router's HTTP door answers GET /health with 200 (it opens with the gRPC port)."""
    import time
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://{address}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router's HTTP door at {address} did not answer /health")
        time.sleep(0.2)
