"""Where the e2e suite runs: one `Target` interface, two lanes.

A target gives the suite a router address plus hooks, so the same test functions run against

* ``up``   — `pdserve up` on this machine (2 prefill + 2 decode processes + a router, tiny random
             model, simulated RDMA: NIXL with UCX_TLS=tcp unless PDSERVE_E2E_TRANSPORT says otherwise);
             scaling is `pdserve scale decode N`, killing a worker is SIGKILL of its pid from the run
             directory's state.json.
* ``kind`` — the Helm chart on a kind cluster (kind_target.py).

Every process a target starts is recorded and stopped by its own pid / process group at close().
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PDSERVE = [sys.executable, "-m", "pdserve.app.cli"]
MODEL_PRESET = "tiny"
MODEL_SEED = 0  # the chart's model.init.seed default: pods and the local reference write the same weights


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_tiny_model(out: Path) -> Path:
    """The same checkpoint the chart's init container writes (`pdserve model init --preset tiny --seed 0`)."""
    if not (out / "config.json").exists():
        from pdserve.app.cli import main as cli_main  # in-process: torch is imported once per test session

        code = cli_main(["model", "init", "--preset", MODEL_PRESET, "--seed", str(MODEL_SEED),
                         "--out", str(out)])
        assert code == 0, f"pdserve model init exited {code}"
    return out


def run(cmd: list[str], *, timeout: float, env: dict | None = None, check: bool = True,
        cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if check and proc.returncode != 0:
        tail = proc.stderr[-3000:] + proc.stdout[-2000:]
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    return proc


class Target:
    """What the e2e tests need from a deployment."""

    name = "?"
    router: str = ""
    http: str = ""  # HOST:PORT of the router's OpenAI-compatible HTTP door
    transport: str = ""  # expected `transport` in responses ("nixl" | "tcp")

    def scale_decode(self, n: int) -> None:
        raise NotImplementedError

    def kill_decode_worker(self, worker_id: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _Proc:
    """A background process in its own session (so its whole group can be stopped by id) with its output
    collected line by line."""

    def __init__(self, cmd: list[str], *, env: dict | None = None, log: Path) -> None:
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.lines: list[str] = []
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            self._log.write(line)
            self._log.flush()

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while time.monotonic() < deadline:
            for line in list(self.lines):
                m = rx.search(line)
                if m:
                    return m
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the reader drain
                tail = "".join(self.lines[-40:])
                code = self.proc.returncode
                raise RuntimeError(f"process exited {code} before printing {pattern!r}:\n{tail}")
            time.sleep(0.1)
        raise TimeoutError(f"no {pattern!r} within {timeout}s; last output:\n{''.join(self.lines[-40:])}")

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        self._reader.join(timeout=5)
        self._log.close()


# ---------------------------------------------------------------------------------------------- up lane
class UpTarget(Target):
    name = "up"

    def __init__(self, workdir: Path, model: Path) -> None:
        self.run_dir = workdir / "cluster"
        self.transport = os.environ.get("PDSERVE_E2E_TRANSPORT", "nixl")
        env = dict(os.environ)
        if self.transport == "nixl":
            env["UCX_TLS"] = "tcp"  # simulated RDMA, as in the kind preset
        env.setdefault("OMP_NUM_THREADS", "1")
        self.env = env
        cmd = [*PDSERVE, "up", "--model", str(model), "--prefill", "2", "--decode", "2",
               "--transport", self.transport, "--policy", "session+prefix", "--device", "cpu",
               "--num-blocks", "256", "--drain-timeout", "10", "--run-dir", str(self.run_dir),
               "--launcher", os.environ.get("PDSERVE_E2E_LAUNCHER", "process"),
               "--http-port", str(_free_port())]
        self.proc = _Proc(cmd, env=env, log=workdir / "pdserve-up.log")
        try:
            up_timeout = float(os.environ.get("PDSERVE_E2E_UP_TIMEOUT", 150))
            m = self.proc.wait_for(r"router: (\S+:\d+)", timeout=up_timeout)
        except Exception:
            self.proc.stop(30)
            raise
        self.router = m.group(1)
        self.http = self.proc.wait_for(r"http: (\S+:\d+)", timeout=60).group(1)

    def state(self) -> dict:
        return json.loads((self.run_dir / "state.json").read_text())

    def scale_decode(self, n: int) -> None:
        run([*PDSERVE, "scale", "decode", str(n), "--run-dir", str(self.run_dir), "--timeout", "120"],
            timeout=150, env=self.env)

    def kill_decode_worker(self, worker_id: str) -> None:
        for w in self.state()["workers"]:
            if w["role"] == "decode" and worker_id in (w["worker_id"], w["address"]):
                os.kill(int(w["pid"]), signal.SIGKILL)
                return
        raise LookupError(f"decode worker {worker_id!r} not in {self.run_dir / 'state.json'}")

    def close(self) -> None:
        if (self.run_dir / "state.json").exists():
            run([*PDSERVE, "down", "--run-dir", str(self.run_dir), "--timeout", "60"], timeout=90,
                check=False, env=self.env)
        self.proc.stop(60)
