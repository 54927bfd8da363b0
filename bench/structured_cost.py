"""What structured output costs a decode step, one engine (engine.grammar).

    bash bench/device_run.sh structured                    # llama3-8b shape on one GPU
    python3 -m bench.structured_cost --out DIR [--preset P] [--batches 1,16,64] [--context 1024]
    python3 -m bench.structured_cost --out DIR --batches 1,16,64 --context 256   # CPU: the tiny model

``B`` running decodes of ``--context`` tokens of KV each, then ``--steps`` greedy decode steps in the
engine's default step mode (launched ahead on a GPU: a step whose constrained rows wait for their
tokens samples once they are read, bench/penalty_cost.py's harness). Configurations, alternated over
``--rounds`` rounds in the same process:

* ``none``: no constraint (0% constrained rows);
* ``half``: every other row under ``SCHEMA`` (50%);
* ``all``: every row under it (100%).

``SCHEMA`` is an array of at least 1,000 objects with a bounded string, a number and an enum array, so
no answer completes within the steps and every row decodes throughout; the mask is computed from real
JSON states (inside keys, strings, numbers). In steady decode every running request gets one token a
step, so ms per step is the TPOT. Writes ``structured-cost-<device>-<date>.json`` and a table.
"""

from __future__ import annotations

import json

from bench.penalty_cost import run
from pdserve.sampling import Constraint

SCHEMA = {"type": "array", "minItems": 1000,
          "items": {"type": "object", "additionalProperties": False, "required": ["name", "score", "tags"],
                    "properties": {"name": {"type": "string", "maxLength": 16}, "score": {"type": "number"},
                                   "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}}}}}
CONSTRAINED = {"constraint": Constraint("json_schema", json.dumps(SCHEMA))}
CONFIGS = {"none": lambda i: {}, "half": lambda i: CONSTRAINED if i % 2 else {}, "all": lambda i: CONSTRAINED}


def first_token(engine):
    """The decode side joins with the prefill worker's first token: ``[`` for a constrained row (the one
    opening the schema's array allows), any token for the others."""
    bracket = engine.tokenizer.encode("[", add_special_tokens=False)[0]
    return lambda extra: bracket if extra else 5


def main() -> None:
    run(CONFIGS, name="structured-cost", description=__doc__.split("\n")[0], first_token=first_token,
        what="decode step with 0% / 50% / 100% of the rows under a JSON-schema constraint, one engine, "
             "rounds alternated")


if __name__ == "__main__":
    main()
