"""Structured output on the GPU: the masks (built on the host into pinned memory, copied and unpacked on the
device) hold every constraint, and an engine launching its steps ahead -- where a constrained row's
sampling waits for the token of the step before, queued behind the step's forward -- gives exactly the
synchronous engine's tokens, constrained and unconstrained rows mixed, with CUDA graphs on. Float32, as
tests/gpu/test_kv_tiers_gpu.py says why."""

from __future__ import annotations

import json
import re

import pytest

from engine.engine import EngineConfig, LLMEngine
from pdserve.sampling import Constraint, SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "tags"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "bb", "ccc"]}}}}
CONSTRAINTS = [Constraint("json_schema", json.dumps(SCHEMA)), Constraint("regex", "[a-z]{3}-[0-9]{2}"),
               Constraint("choice", choices=("left", "right")), None]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "ahead"])
def test_constraints_hold_and_steps_ahead_match_sync(make_checkpoint, overlap):
    path = make_checkpoint(preset="small")
    results = {}
    for ahead in (False, overlap):
        engine = LLMEngine(EngineConfig(model=str(path), device="cuda", num_blocks=256, max_num_seqs=16,
                                        overlap_steps=ahead))
        prompts = [engine.tokenizer.encode(f"request number {i}") for i in range(12)]
        params = [SamplingParams(max_tokens=48, constraint=CONSTRAINTS[i % 4],
                                 temperature=0.0 if i % 3 else 0.9, seed=i) for i in range(12)]
        results[ahead] = engine.generate(prompts, params)
        for i, ids in enumerate(results[ahead]):
            text = engine.tokenizer.decode(ids, skip_special_tokens=True)
            c = CONSTRAINTS[i % 4]
            if c is None:
                continue
            if c.kind == "json_schema":  # (no jsonschema on the device image: the schema's rules by hand)
                value = json.loads(text)
                assert set(value) == {"n", "tags"} and 0 <= value["n"] <= 99 and len(value["tags"]) <= 3
                assert set(value["tags"]) <= {"a", "bb", "ccc"}
            elif c.kind == "regex":
                assert re.fullmatch(c.text, text), text
            else:
                assert text in c.choices
        assert engine.leak_report() is None
        engine.close()
    assert results[overlap] == results[False]
