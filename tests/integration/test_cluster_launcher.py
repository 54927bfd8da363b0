"""`pdserve up` on an embedded local Ray, `pdserve scale` while requests flow, `pdserve down`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from pdserve.client import Client

pytestmark = pytest.mark.slow


def test_ray_up_scale_down(make_checkpoint, tmp_path) -> None:
    model = make_checkpoint("llama")
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "up.log", "w")
    up = subprocess.Popen([sys.executable, "-m", "pdserve.app.cli", "up", "--model", str(model),
                           "--prefill", "1",
                           "--decode", "1", "--transport", "tcp", "--num-blocks", "128",
                           "--run-dir", str(run_dir),
                           "--launcher", "ray", "--ray-num-cpus", "2", "--drain-timeout", "10"],
                          stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        router = None
        deadline = time.monotonic() + 240
        for line in up.stdout:
            if line.startswith("router: "):
                router = line.split()[1]
                break
            assert time.monotonic() < deadline
        assert router, open(tmp_path / "up.log").read()[-3000:]
        state = json.loads((run_dir / "state.json").read_text())
        assert state["backend"] == "ray" and len(state["workers"]) == 2

        errors: list = []
        done = threading.Event()
        served: list[str] = []

        def traffic() -> None:
            with Client(router, timeout=60) as c:
                i = 0
                while not done.is_set():
                    try:
                        r = c.generate(prompt_ids=[5 + i % 50, 6, 7, 8], max_tokens=3)
                        served.append(r.final["decode_worker"])
                    except Exception as exc:  # collected and asserted below
                        errors.append(exc)
                    i += 1

        t = threading.Thread(target=traffic)
        t.start()
        scale = subprocess.run([sys.executable, "-m", "pdserve.app.cli", "scale", "decode", "2", "--run-dir",
                                str(run_dir)], capture_output=True, text=True, env=env, timeout=240)
        assert scale.returncode == 0, scale.stderr
        with Client(router, timeout=10) as c:
            workers = c.list_workers()
        assert sorted(w["role"] for w in workers) == ["decode", "decode", "prefill"]
        time.sleep(1.0)
        scale = subprocess.run([sys.executable, "-m", "pdserve.app.cli", "scale", "decode", "1", "--run-dir",
                                str(run_dir)], capture_output=True, text=True, env=env, timeout=240)
        assert scale.returncode == 0, scale.stderr
        done.set()
        t.join(60)
        assert not errors, errors[:3]
        assert len(served) > 0
        down = subprocess.run([sys.executable, "-m", "pdserve.app.cli", "down", "--run-dir", str(run_dir)],
                              capture_output=True, text=True, env=env, timeout=180)
        assert down.returncode == 0, down.stderr
        assert up.wait(60) == 0
        assert not (run_dir / "state.json").exists()
        for w in state["workers"]:  # every serve process is gone
            with pytest.raises(ProcessLookupError):
                os.kill(int(w["pid"]), 0)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(30)
        log.close()
