"""``pdserve serve --role prefill|decode|router|colocated ...``: run one service of the cluster.

Every flag may also come from ``PDSERVE_<FLAG>`` (see pdserve/settings.py). The process prints one
line ``pdserve <role> <worker_id> listening on <host:port>`` once it is SERVING (launchers and tests
wait for it), and exits 0 after a graceful drain on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pdserve import event_loop
from pdserve.serve_flags import add_serve_arguments
from pdserve.settings import ServeSettings

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="run a prefill, decode, router or colocated server")
    add_serve_arguments(parser)
    parser.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    try:
        settings = ServeSettings.from_args(args)
    except ValueError as exc:
        print(f"pdserve serve: {exc}", file=sys.stderr)
        return 2
    if settings.role != "router":  # the disk starts on the checkpoint while the imports below run
        from engine import compile_key, early_upload, readahead

        # and its bytes go to the GPU meanwhile (CUDA driver only, no torch; see the module)
        early_upload.start(settings.model, early_upload.wanted(
            role=settings.role, device=settings.device, tensor_parallel_size=settings.tensor_parallel_size))
        readahead.start(settings.model)
        if compile_key.wanted(role=settings.role, device=settings.device):  # hashed beside import torch
            compile_key.start()
    from pdserve.app.roles import run_role

    try:
        factory = event_loop.loop_factory(settings.event_loop)
    except ValueError as exc:
        print(f"pdserve serve: {exc}", file=sys.stderr)
        return 2
    log.info("event loop: %s", "asyncio" if factory is None else factory.__module__.split(".")[0])
    status = 0
    try:
        status = event_loop.run(run_role(settings), settings.event_loop)
    except KeyboardInterrupt:
        pass
    # Every stop callback has run (drained, transport closed, engine thread joined): skip the slow
    # interpreter teardown of torch / gRPC / UCX globals, which can take seconds on a busy host.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
