"""Start one `pdserve serve` process and learn its address.

``spawn(role, args, log_path)`` runs ``python -m pdserve.app.cli serve --role ROLE --port 0 ...`` in its own
process group, waits for the line ``pdserve <role> <id> listening on HOST:PORT`` that the server
prints once it is SERVING, and returns a ``ServeProcess``. ``stop()`` sends SIGTERM (graceful
drain) and escalates to SIGKILL after a timeout. Used directly by the process launcher and the
tests, and inside each Ray actor by the Ray launcher.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.settings import environ

_READY = re.compile(r"^pdserve (\w+) (\S+) listening on (\S+):(\d+)\s*$")


class StartFailed(RuntimeError):
    def __init__(self, message: str, exit_status: int | None = None) -> None:
        super().__init__(message)
        self.exit_status = exit_status  # None: it did not exit (killed for not becoming ready)


@dataclass
class ServeProcess:
    role: str
    worker_id: str
    address: str
    proc: subprocess.Popen
    log_path: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def kill(self, *, group: bool = False) -> None:
        """SIGKILL the process; ``group``: its whole process group (a TP worker's ranks, anything it ran)."""
        if self.proc.poll() is None:
            if group:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: pgid == pid
            else:
                self.proc.kill()
            self.proc.wait(10)


def spawn(role: str, args: list[str], log_path: str | Path, *, host: str = "127.0.0.1",
          advertise_host: str | None = None, env: dict[str, str] | None = None,
          timeout: float = 180.0) -> ServeProcess:
    cmd = [sys.executable, "-m", "pdserve.app.cli", "--log-level", "INFO", "serve", "--role", role,
           "--host", host, "--advertise-host", advertise_host or host, *args]
    if "--port" not in args:
        cmd += ["--port", "0"]
    full_env = {**environ(), **(env or {})}
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_file, env=full_env,
                            start_new_session=True)
    log_file.close()
    found: list[re.Match] = []
    done = threading.Event()

    def pump() -> None:
        # Copy stdout into the log; note the ready line. Runs for the life of the process.
        assert proc.stdout is not None
        with open(log_path, "ab") as out:
            for raw in proc.stdout:
                out.write(raw)
                out.flush()
                m = _READY.match(raw.decode(errors="replace"))
                if m and not found:
                    found.append(m)
                    done.set()
        done.set()

    threading.Thread(target=pump, daemon=True, name=f"pump-{role}").start()
    deadline = time.monotonic() + timeout
    while not done.wait(0.2):
        if time.monotonic() > deadline:
            proc.kill()
            raise StartFailed(f"{role} did not become ready in {timeout:.0f}s; see {log_path}")
    if not found:
        proc.wait(10)
        tail = log_path.read_text(errors="replace")[-2000:]
        raise StartFailed(f"{role} exited with {proc.returncode} before serving; log {log_path}:\n{tail}",
                          proc.returncode)
    m = found[0]
    return ServeProcess(role=role, worker_id=m.group(2), address=f"{m.group(3)}:{m.group(4)}", proc=proc,
                        log_path=str(log_path))
