"""``pdserve generate``: run one prompt through the colocated engine in this process.

    pdserve generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3) --max-tokens N
                     [--temperature T] [--top-p P] [--top-k K] [--seed S] [--stop STR ...] [--json]
                     [--json-schema S | --json-object | --regex R | --choice C ... | --grammar G]

Prints the generated text (or, without a tokenizer, the generated ids). ``--json`` prints one JSON
object instead: ``token_ids`` (generated ids, prompt excluded), ``text`` (when the model directory has
a tokenizer), ``finish_reason``, ``num_prompt_tokens``. ``--prompt-ids`` needs no tokenizer files.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from pdserve.app import constraint_flags, penalty_flags


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate from one prompt with the local engine",
                              description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face-style model directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs tokenizer.json in the model directory)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="per-request seed: same seed, same tokens")
    p.add_argument("--stop", nargs="+", action="extend", default=[], metavar="STR",
                   help="stop when the text contains any of these strings (needs a tokenizer)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    penalty_flags.add(p)
    constraint_flags.add(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (default: the checkpoint's)")
    p.set_defaults(func=run)


def _fail(message: str, code: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    from engine.engine import EngineConfig, LLMEngine
    from engine.errors import EngineError, ModelLoadError
    from pdserve.sampling import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
                                ignore_eos=args.ignore_eos, **penalty_flags.values(args),
                                **constraint_flags.values(args))
    except ValueError as exc:
        return _fail(str(exc))
    prompt_ids = None
    if args.prompt_ids is not None:
        try:
            prompt_ids = [int(t) for t in args.prompt_ids.replace(" ", "").split(",") if t]
        except ValueError:
            return _fail(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}")
        if not prompt_ids:
            return _fail("--prompt-ids is empty")
    try:
        engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                        max_num_seqs=1, max_num_batched_tokens=2048))
    except ModelLoadError as exc:
        return _fail(str(exc), code=1)
    tok = engine.tokenizer
    if prompt_ids is None:
        if tok is None:
            return _fail(f"--prompt needs a tokenizer, but {args.model} has no tokenizer.json; "
                         f"use --prompt-ids instead")
        prompt_ids = tok.encode(args.prompt)

    start = time.perf_counter()
    try:
        engine.add_request("cli", prompt_ids, params)
    except (EngineError, ValueError) as exc:
        return _fail(str(exc))
    token_ids: list[int] = []
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            token_ids.extend(out.new_token_ids)
            if out.finished:
                final = out
    elapsed = time.perf_counter() - start
    if final is None or final.error:
        return _fail(final.error if final else "the engine stopped without finishing the request", code=1)
    text = None
    if tok is not None:
        text = final.text if final.text is not None else tok.decode(token_ids)

    if args.json:
        result = {"token_ids": token_ids, "finish_reason": final.finish_reason,
                  "num_prompt_tokens": len(prompt_ids)}
        if text is not None:
            result["text"] = text
        print(json.dumps(result))
    else:
        print(text if text is not None else ",".join(map(str, token_ids)))
        print(f"[{len(token_ids)} tokens, {final.finish_reason}, {elapsed:.2f}s]", file=sys.stderr)
    return 0
