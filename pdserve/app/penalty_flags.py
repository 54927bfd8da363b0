"""The penalty and logit-bias flags `pdserve generate` and `pdserve client` share."""

from __future__ import annotations

import argparse


def add(p: argparse.ArgumentParser) -> None:
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="OpenAI's: subtracted from the logit of every token generated so far (-2..2)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="OpenAI's: subtracted once per time a token was generated (-2..2)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="transformers' / vLLM's, on prompt and generated tokens (> 0; 1 = off)")
    p.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN=BIAS",
                   help="add BIAS (-100..100) to token id TOKEN's logit (repeatable)")


def values(args: argparse.Namespace) -> dict:
    """SamplingParams / build_request keyword arguments; ValueError on a malformed --logit-bias."""
    bias = {}
    for item in args.logit_bias:
        token, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            bias[int(token)] = float(value)
        except ValueError:
            raise ValueError(f"--logit-bias takes TOKEN=BIAS (an id and a number), got {item!r}") from None
    return dict(presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                repetition_penalty=args.repetition_penalty, logit_bias=bias)
