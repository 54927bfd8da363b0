"""`pdserve` console entry point.

Subcommands live one per module in ``pdserve.app.commands``; each module exposes
``register(subparsers)`` which adds its parser and sets ``func`` (called with the parsed args,
returning an exit code). Discovery keeps this file free of per-command edits.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys

from pdserve import __version__, bytecode
from pdserve.app import commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    parser.add_argument("--log-level", default="WARNING", help="python logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    cache = bytecode.enable()  # before the commands' imports (torch): see pdserve/bytecode.py
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cache:
        logging.getLogger("pdserve.bytecode").info("this install ships no bytecode: compiled modules are "
                                                   "cached in %s", cache)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
