"""pdserve.event_loop: which loop a serving process runs on, and a clear refusal when the one asked for
is not installed. The cluster tests run on the default (uvloop, a dependency); ``--event-loop asyncio``
is served the same (tests/integration/test_cluster_1p1d.py runs a request on each)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve import event_loop

ROOT = Path(__file__).resolve().parents[2]


def test_auto_and_uvloop_take_uvloop_and_asyncio_keeps_the_standard_loop() -> None:
    import uvloop

    assert event_loop.loop_factory("auto") is uvloop.new_event_loop
    assert event_loop.loop_factory("uvloop") is uvloop.new_event_loop
    assert event_loop.loop_factory("asyncio") is None
    with asyncio.Runner(loop_factory=event_loop.loop_factory("auto")) as runner:
        assert isinstance(runner.get_loop(), uvloop.Loop)


def test_without_uvloop_auto_falls_back_and_uvloop_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop -> ImportError
    assert event_loop.loop_factory("auto") is None
    with pytest.raises(ValueError, match="uvloop is not installed"):
        event_loop.loop_factory("uvloop")


def test_serve_refuses_a_missing_uvloop_with_exit_status_2(tmp_path: Path) -> None:
    (tmp_path / "uvloop.py").write_text("raise ImportError('not here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "pdserve.app.cli", "serve", "--role", "router",
                           "--event-loop", "uvloop", "--host", "127.0.0.1", "--port", "0",
                           "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "uvloop is not installed" in proc.stderr and "Traceback" not in proc.stderr


def test_run_gives_the_coroutines_result_on_the_chosen_loop() -> None:
    async def which() -> str:
        return type(asyncio.get_running_loop()).__module__.split(".")[0]

    assert event_loop.run(which()) == "uvloop"
    assert event_loop.run(which(), "asyncio") == "asyncio"
