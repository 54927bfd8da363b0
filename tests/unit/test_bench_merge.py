"""bench/merge_results.py: the runs of one lease become the one result file the GPU issue asks for."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def mr():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("merge_results")
    finally:
        sys.path.remove(str(BENCH))


def _run(cmd: str, **items) -> dict:
    device = {"name": "NVIDIA H200", "count": 2, "driver": "580", "torch": "2.11", "cuda": "13.0",
              "slug": "2xh200"}
    base = {"device": device, "command": cmd, "date": f"d-{cmd}", "ceilings": {"copy_GBps": len(cmd)},
            "roofline": None, "transfer": None, "disagg_vs_colocated": None, "transformers": None}
    return {**base, **items}


def test_items_keep_their_own_run_and_later_runs_win(mr, tmp_path) -> None:
    roof = {"decode": [], "prefill": {"tokens": 4096, "ms": 130.0, "TFLOPs": 470.0,
                                      "fraction_of_matmul_peak": 0.6}}
    a = _run("a", roofline=roof, transformers=None)
    b = _run("bb", disagg_vs_colocated={"markdown": ["| row |"]})
    m = mr.merge([a, b])
    assert m["roofline"] == roof and m["disagg_vs_colocated"] == {"markdown": ["| row |"]}
    assert m["transfer"] is None
    assert m["commands"] == {"roofline": "a", "disagg_vs_colocated": "bb"}
    assert m["ceilings_by_item"]["roofline"] == {"copy_GBps": 1}
    assert m["ceilings_by_item"]["disagg_vs_colocated"] == {"copy_GBps": 2}
    again = mr.merge([a, _run("c", roofline={**roof, "decode": [1]})])
    assert again["roofline"]["decode"] == [1] and again["commands"]["roofline"] == "c"
    assert m["command"] == "a ; bb" and m["date"] == "d-bb"
    paths = []
    for i, r in enumerate((a, b)):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(r))
    assert mr.main(["x", str(tmp_path / "out.json"), *map(str, paths)]) == 0
    assert json.loads((tmp_path / "out.json").read_text())["merged_from"] == ["r0.json", "r1.json"]
    assert "| row |" in (tmp_path / "out.md").read_text()


def test_runs_of_different_machines_are_refused(mr) -> None:
    other = _run("c")
    other["device"] = {**other["device"], "slug": "h100"}
    with pytest.raises(ValueError, match="different devices"):
        mr.merge([_run("a"), other])
    with pytest.raises(ValueError, match="nothing"):
        mr.merge([])


def test_an_earlier_merge_as_input_keeps_each_items_own_command(mr) -> None:
    roof = {"decode": [], "prefill": {}}
    first = mr.merge([_run("a", roofline=roof), _run("bb", transfer={"x": 1})])
    later = mr.merge([first, _run("ccc", transfer={"x": 2})])
    assert later["commands"] == {"roofline": "a", "transfer": "ccc"}
    assert later["ceilings_by_item"] == {"roofline": {"copy_GBps": 1}, "transfer": {"copy_GBps": 3}}
    assert later["transfer"] == {"x": 2} and later["roofline"] == roof
