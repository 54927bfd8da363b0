"""Start one `pdserve serve` process and learn its address.

``spawn(role, args, log_path)`` runs ``python -m pdserve.app.cli serve --role ROLE --port 0 ...`` in its own
process group, waits for the line ``pdserve <role> <id> listening on HOST:PORT`` that the server
prints once it is SERVING, and returns a ``ServeProcess``. ``stop()`` sends SIGTERM (graceful
drain) and escalates to SIGKILL after a timeout. Used directly by the process launcher and the
tests, and inside each Ray actor by the Ray launcher.

With a ``zygote`` (launcher/zygote.py) the process is forked from it instead, its imports already
done; where the zygote cannot fork it (``ZygoteUnusable``: gone, or an environment it cannot give),
the process is started the plain way and the reason logged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.app.launcher.zygote import ForkedProcess, Zygote, ZygoteUnusable
from pdserve.settings import environ

log = logging.getLogger(__name__)
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
    proc: subprocess.Popen | ForkedProcess
    log_path: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def forked(self) -> bool:
        """Forked from a zygote (launcher/zygote.py) rather than started as a fresh interpreter."""
        return isinstance(self.proc, ForkedProcess)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_status(self) -> int | None:
        return self.proc.poll()

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
            self.proc.kill()  # also when a child just forked has no session of its own yet
            self.proc.wait(10)


def _start(role: str, argv: list[str], env: dict[str, str], log_path: Path,
           zygote: Zygote | None) -> subprocess.Popen | ForkedProcess:
    """The process, its stdout a pipe to read and its stderr the log: forked if ``zygote`` can."""
    with open(log_path, "ab") as log_file:
        if zygote is not None:
            read, write = os.pipe()
            try:
                proc = zygote.fork(argv, env, stdout=write, stderr=log_file.fileno())
            except ZygoteUnusable as exc:
                os.close(read)
                log.warning("starting the %s without the zygote: %s", role, exc)
            else:
                proc.stdout = os.fdopen(read, "rb")
                return proc
            finally:
                os.close(write)
        return subprocess.Popen([sys.executable, "-m", "pdserve.app.cli", *argv], stdout=subprocess.PIPE,
                                stderr=log_file, env=env, start_new_session=True)


def spawn(role: str, args: list[str], log_path: str | Path, *, host: str = "127.0.0.1",
          advertise_host: str | None = None, env: dict[str, str] | None = None,
          timeout: float = 180.0, zygote: Zygote | None = None) -> ServeProcess:
    argv = ["--log-level", "INFO", "serve", "--role", role, "--host", host,
            "--advertise-host", advertise_host or host, *args]
    if "--port" not in args:
        argv += ["--port", "0"]
    full_env = {**environ(), **(env or {})}
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    proc = _start(role, argv, full_env, log_path, zygote)
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
