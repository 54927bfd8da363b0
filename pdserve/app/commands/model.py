"""``pdserve model ...``: model directory utilities.

``pdserve model init --preset PRESET --out DIR [--seed S] [--arch A] [--dtype D]`` (PRESET: tiny, small,
llama3-8b, llama3-70b, llama3-70b-short)
writes a random-weight checkpoint in Hugging Face layout (see engine/checkpoint.py).
``pdserve model info --model DIR`` prints the parsed config of any supported checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
               "GIB": 2**30}


class _Presets:
    """The checkpoint presets, looked up only when ``model init`` checks one or lists them: importing
    engine.checkpoint imports torch (seconds), which every other command -- the router's ``serve``,
    ``bench``, ``client`` -- would otherwise pay while building the parser."""

    def __contains__(self, name: object) -> bool:
        from engine.checkpoint import PRESETS

        return name in PRESETS

    def __iter__(self):
        from engine.checkpoint import PRESETS

        return iter(PRESETS)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="create or inspect model directories")
    sub = parser.add_subparsers(dest="model_command", metavar="ACTION")

    init = sub.add_parser("init", help="write a random-weight checkpoint (HF layout)")
    init.add_argument("--preset", required=True, choices=_Presets(), metavar="PRESET",
                      help="tiny, small, llama3-8b, ... (engine/checkpoint.py PRESETS)")
    init.add_argument("--out", required=True, help="directory to write (created if missing)")
    init.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    init.add_argument("--arch", default="llama", choices=["llama", "mistral", "qwen2"])
    init.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                      help="stored dtype (default: float32 for tiny/small, bfloat16 for the llama3 shapes)")
    init.add_argument("--max-shard-size", default="5GB", type=_parse_size,
                      help="split weights into shards of at most this size (default 5GB)")
    init.set_defaults(func=_init)

    info = sub.add_parser("info", help="print the parsed config of a model directory")
    info.add_argument("--model", required=True)
    info.set_defaults(func=_info)
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])


def _init(args: argparse.Namespace) -> int:
    from engine.checkpoint import preset_config, write_random_checkpoint

    config = preset_config(args.preset, arch=args.arch, dtype=args.dtype)
    start = time.monotonic()
    out = write_random_checkpoint(args.out, config, seed=args.seed, max_shard_bytes=args.max_shard_size)
    print(f"wrote {args.preset} {args.arch} ({config.num_parameters() / 1e6:.1f}M params, {config.dtype}, "
          f"seed {args.seed}) to {out} in {time.monotonic() - start:.1f}s")
    return 0


def _info(args: argparse.Namespace) -> int:
    from engine.config import ModelConfig
    from engine.errors import ModelLoadError
    from engine.tokenizer import Tokenizer

    try:
        config = ModelConfig.from_pretrained(args.model)
        tok = Tokenizer.from_dir(args.model)
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    data = config.to_dict()
    data["num_parameters"] = config.num_parameters()
    data["fingerprint"] = config.fingerprint()
    data["tokenizer_vocab_size"] = tok.vocab_size if tok else None
    print(json.dumps(data, indent=2, default=str))
    return 0


def _parse_size(text: str) -> int:
    t = text.strip().upper().replace(" ", "")
    for unit in sorted(_SIZE_UNITS, key=len, reverse=True):
        if unit and t.endswith(unit):
            number, scale = t[: -len(unit)], _SIZE_UNITS[unit]
            break
    else:
        number, scale = t, 1
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 5GB, 200MiB, 1000000)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value
