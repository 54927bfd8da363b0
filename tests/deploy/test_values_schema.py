"""values.yaml is fully documented and typed: every key carries a comment, values.schema.json types every
value (unknown keys rejected), the preset files validate, and bad values are refused both by the schema
(checked here with jsonschema, fast) and by `helm template` itself (helm applies the same schema)."""

from __future__ import annotations

import copy
import json
import re

import jsonschema
import pytest
import yaml
from chart_helpers import CHART, VALUES, render_fails

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())


def merged(*overrides: dict) -> dict:
    def deep(a: dict, b: dict) -> dict:
        out = copy.deepcopy(a)
        for k, v in b.items():
            if v is None:  # helm semantics: null deletes the key
                out.pop(k, None)
            elif isinstance(v, dict) and isinstance(out.get(k), dict):
                out[k] = deep(out[k], v)
            else:
                out[k] = v
        return out

    result = DEFAULTS
    for o in overrides:
        result = deep(result, o)
    return _drop_nulls(result)


def _drop_nulls(d: object) -> object:
    if isinstance(d, dict):
        return {k: _drop_nulls(v) for k, v in d.items() if v is not None}
    return d


def errors(values: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(SCHEMA)
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(values)]


@pytest.mark.parametrize("preset", sorted(VALUES))
def test_presets_validate(preset: str) -> None:
    overrides = [yaml.safe_load(f.read_text()) for f in VALUES[preset]]
    assert errors(merged(*overrides)) == []


def test_schema_types_every_value() -> None:
    """Walk values.yaml: every key has a schema node with a type (so nothing is untyped or unknown)."""

    def walk(value: object, node: dict, path: str) -> int:
        assert "type" in node or "anyOf" in node, f"{path} has no type in values.schema.json"
        if isinstance(value, dict) and "properties" in node:
            assert node.get("additionalProperties") is False, f"{path} accepts unknown keys"
            count = 0
            for k, v in value.items():
                assert k in node["properties"], f"{path}.{k} missing from values.schema.json"
                count += 1 + walk(v, node["properties"][k], f"{path}.{k}")
            return count
        return 0

    assert walk(DEFAULTS, SCHEMA, "values") > 100


def test_every_value_is_documented() -> None:
    """Each key in values.yaml has a comment right above it (or inline), or sits inside a documented
    value (e.g. the fields of a documented `resources:` or `securityContext:` object)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    stack: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    for n, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z][\w.-]*):", line)
        if not m:
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        own = (n > 0 and lines[n - 1].strip().startswith("#")) or "#" in line.split(":", 1)[1]
        inherited = any(doc for _, doc in stack)
        is_section = line.rstrip().endswith(":") and n + 1 < len(lines) and (
            len(lines[n + 1]) - len(lines[n + 1].lstrip()) > indent)
        if not (own or inherited or is_section):
            undocumented.append(f"{n + 1}: {line.strip()}")
        stack.append((indent, own or inherited))
    assert undocumented == []


BAD_VALUES = [
    ({"decode": {"replicas": -1}}, "decode.replicas"),
    ({"prefill": {"replicas": "two"}}, "prefill.replicas"),
    ({"kvTransport": {"type": "rdma"}}, "kvTransport.type"),
    ({"image": {"tag": "latest"}}, "image.tag"),
    ({"image": {"variant": "rocm"}}, "image.variant"),
    ({"router": {"policy": "random"}}, "router.policy"),
    ({"router": {"discovery": "static"}}, "router.discovery"),
    ({"engine": {"dtype": "int8"}}, "engine.dtype"),
    ({"ports": {"grpc": 70000}}, "ports.grpc"),
    ({"drain": {"timeoutSeconds": -5}}, "drain.timeoutSeconds"),
    ({"redis": {"mode": "cluster"}}, "redis.mode"),
    ({"redis": {"external": {"url": "http://redis:6379"}}}, "redis.external.url"),
    ({"model": {"source": "s3"}}, "model.source"),
    ({"model": {"source": "pvc"}}, "model.pvc.claimName"),
    ({"decode": {"resources": {"limits": {"cpu": "lots"}}}}, "decode.resources.limits.cpu"),
    ({"decode": {"autoscaling": {"targetCPUUtilizationPercentage": 150}}}, "decode.autoscaling"),
    ({"kvTransport": {"ucx": {"extraEnv": {"PATH": "/x"}}}}, "kvTransport.ucx.extraEnv"),
    ({"decode": {"kvTiers": {"disk": {"sizeGb": -5}}}}, "decode.kvTiers.disk.sizeGb"),
    ({"prefill": {"kvTiers": {"disk": {"sizeGb": 0}}}}, "prefill.kvTiers.disk.sizeGb"),
    ({"decode": {"kvTiers": {"hostGb": -1}}}, "decode.kvTiers.hostGb"),
    ({"decode": {"kvTiers": {"hostGb": "16Gi"}}}, "decode.kvTiers.hostGb"),
    ({"prefill": {"kvTiers": {"hostGB": 4}}}, "prefill.kvTiers"),  # typo: unknown key
    ({"decode": {"kvTiers": {"disk": {"sizeLimit": "20Gi"}}}}, "decode.kvTiers.disk"),  # unknown key
    ({"decode": {"kvTiers": {"disk": {"enabled": "yes"}}}}, "decode.kvTiers.disk.enabled"),
    ({"decode": {"kvTiers": {"disk": {"mountPath": "var/cache/kv"}}}}, "decode.kvTiers.disk.mountPath"),
    ({"decode": {"kvTiers": {"disk": {"volume": {"emptyDir": {}, "hostPath": {"path": "/x"}}}}}},
     "decode.kvTiers.disk.volume"),  # one volume source
    ({"decode": {"replica": 2}}, "decode"),  # typo: unknown key
    ({"prefil": {"replicas": 2}}, ""),  # typo: unknown top-level key
]


@pytest.mark.parametrize("override,where", BAD_VALUES, ids=[w or "root" for _, w in BAD_VALUES])
def test_schema_rejects_bad_values(override: dict, where: str) -> None:
    errs = errors(merged(override))
    assert errs, f"schema accepted {override}"
    assert any(e.startswith(where.split(".")[0]) for e in errs), errs


@pytest.mark.parametrize("sets,needle", [
    (("decode.replicas=-1",), "decode.replicas"),
    (("kvTransport.type=infiniband",), "kvTransport.type"),
    (("prefill.unknownKey=1",), "unknownKey"),
    (("decode.kvTiers.disk.sizeGb=-1",), "sizeGb"),
    (("prefill.kvTiers.disk.sizeMb=5",), "sizeMb"),
])
def test_helm_enforces_the_schema(sets: tuple[str, ...], needle: str) -> None:
    assert needle in render_fails("default", sets)
