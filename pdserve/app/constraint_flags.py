"""The structured-output flags `pdserve generate` and `pdserve client` share (docs/structured-output.md)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="SCHEMA", help="hold the answer to this JSON schema (JSON text, "
                   "or @FILE)")
    g.add_argument("--json-object", action="store_true", help="the answer is a JSON object")
    g.add_argument("--regex", help="the whole answer matches this regular expression")
    g.add_argument("--choice", action="append", metavar="STR", help="the answer is one of these (repeatable)")
    g.add_argument("--grammar", metavar="GRAMMAR", help="a Lark or GBNF grammar (text, or @FILE)")


def _text(value: str) -> str:
    return Path(value[1:]).read_text() if value.startswith("@") else value


def values(args: argparse.Namespace) -> dict:
    """``{"constraint": Constraint | None}`` for SamplingParams / build_request; ValueError on a bad one
    (an unreadable @FILE included)."""
    from pdserve.sampling import Constraint

    try:
        if args.json_schema is not None:
            return {"constraint": Constraint("json_schema", _text(args.json_schema))}
        if args.grammar is not None:
            return {"constraint": Constraint("grammar", _text(args.grammar))}
    except OSError as exc:
        raise ValueError(f"cannot read {exc.filename}: {exc.strerror}") from None
    if args.json_object:
        return {"constraint": Constraint("json_object")}
    if args.regex is not None:
        return {"constraint": Constraint("regex", args.regex)}
    if args.choice:
        return {"constraint": Constraint("choice", choices=tuple(args.choice))}
    return {"constraint": None}
