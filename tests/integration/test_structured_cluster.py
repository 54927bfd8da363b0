"""Greedy constrained output is token-identical between one engine and the cluster in every shape: 1P1D
over TCP (decode steps launched ahead, so a constrained row's sampling waits for its token), 1P1D over
NIXL (UCX's TCP transport), colocated workers, and 1P1D with conditional disaggregation (short prompts
prefilled on the decode worker). The prefill worker samples the first token under the
constraint and the decode worker resumes the grammar from it. (A stream migrated after ``kill -9`` of
its decode worker: tests/integration/test_faults_migration.py.)"""

from __future__ import annotations

import json

import pytest
from test_cluster_1p1d import run_concurrently

from pdserve.app.launcher.local import LocalCluster, ucx_tcp_env
from pdserve.sampling import Constraint, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "tags", "ok"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"type": "string", "maxLength": 6}},
                         "ok": {"type": "boolean"}}}
CONSTRAINTS = [Constraint("json_schema", json.dumps(SCHEMA)), Constraint("regex", r"[a-f]{2,6}-[0-9]{2}"),
               Constraint("choice", choices=("alpha", "beta", "gamma")),
               Constraint("grammar", 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/')]
MAX_TOKENS = 60


def prompts() -> list[list[int]]:
    return [[(11 * i + 7 * n + 5) % 900 + 5 for i in range(n)] for n in (9, 23, 40, 17, 31, 5, 50, 12)]


def constraint_of(i: int) -> Constraint | None:
    return CONSTRAINTS[i % len(CONSTRAINTS)] if i % 4 != 3 else None  # one in four unconstrained


def reference(model_dir) -> list[list[int]]:
    from engine.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(model_dir), num_blocks=256, device="cpu"))
    ps = prompts()
    return engine.generate(ps, [SamplingParams(max_tokens=MAX_TOKENS, constraint=constraint_of(i))
                                for i in range(len(ps))])


@pytest.mark.parametrize("shape", ["1p1d-tcp-ahead", "1p1d-nixl", "colocated", "1p1d-conditional"])
def test_constrained_greedy_parity(make_checkpoint, tmp_path, shape) -> None:
    model = make_checkpoint("llama")
    want = reference(model)
    kw: dict = dict(prefill=1, decode=1, transport="tcp")
    if shape == "1p1d-tcp-ahead":
        kw["env"] = {"PDSERVE_OVERLAP_STEPS": "1"}
    elif shape == "1p1d-nixl":
        kw.update(transport="nixl", env=ucx_tcp_env())
    elif shape == "colocated":
        kw.update(prefill=0, decode=1, colocated=True)
    else:  # short prompts prefilled on the decode worker itself, the grammar started there
        kw["router_args"] = ("--conditional-disagg", "auto", "--min-uncached-tokens", "32")
    with LocalCluster(model, run_dir=tmp_path, **kw) as c:
        start = c.free_blocks()
        ps = prompts()
        got = run_concurrently(c.router, ps, [MAX_TOKENS] * len(ps),
                               each=lambda i: {"constraint": constraint_of(i)})
        assert [r.token_ids for r in got] == want
        assert all(r.finish_reason == "stop" for i, r in enumerate(got) if constraint_of(i) is not None)
        if shape == "1p1d-conditional":
            assert "local" in {r.final["prefill_mode"] for r in got}
        stats = c.wait_idle(start)
        assert {w: s.free_blocks for w, s in stats.items()} == start
