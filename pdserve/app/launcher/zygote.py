"""A zygote: one process that has imported torch and pdserve already, forking `pdserve serve` processes.

Why: a worker spends its first seconds importing (``import torch`` alone is 3-4 s on a GPU host,
~1 s on a small CPU box; docs/gpu.md "Boot"), before it reads a byte of its checkpoint. Under
``pdserve up --launcher process`` that is paid again by every restart after a crash and by every
``pdserve scale`` step. Forked from a process that paid it once, a worker starts with its modules in
place and goes straight to its weights: failover and scale-up are only as fast as that start.

How: ``Zygote.start(env)`` runs ``python -m pdserve.app.launcher.zygote_proc`` in its own session with a
``SOCK_SEQPACKET`` socketpair as its control channel. The zygote imports ``PRELOAD`` (and, on a GPU
host, computes Triton's compiler key: engine/fork_preload.py), checks that it is still safe to fork (no
Python thread beside its own; CUDA usable in a probe child: the driver cannot be used in a child of a
process that initialised it, which flashinfer's import does, so workers import that themselves),
freezes its objects out of the garbage collector (so children share its pages
instead of copying them as refcounts change) and says ready. ``fork(argv, env, stdout, stderr)``
sends one JSON request with the two descriptors (SCM_RIGHTS); the zygote forks, and the child starts
a session of its own (``killpg`` reaches it and whatever it starts), takes the descriptors as 1 and
2, takes the request's environment and working directory, restarts its boot clock (process_stats
registers that at fork) and runs ``pdserve.app.cli.main(argv)``. The zygote answers with the pid
and a pidfd of the child (signals reach exactly that process, never a reused pid), then reaps it
when it exits and reports the exit status.

A fork is refused (``ZygoteUnusable``; the caller starts a plain process instead) when the child's
environment differs from the zygote's in anything but ``FORK_ENV``'s names (read only after the
fork: by the CUDA driver, UCX, NCCL and pdserve's settings), since a library imported here may have
read the rest at load (OpenMP's thread count, a preloaded library path), or when the zygote is gone.
A child whose zygote died goes on running; its exit is then seen through its pidfd, with no status
(``ForkedProcess.returncode`` ``UNKNOWN_STATUS``).
"""

from __future__ import annotations

import array
import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pdserve.app.launcher.zygote_proc import PRELOAD, recv

log = logging.getLogger(__name__)

# Names a child's environment may set differently from the zygote's: each is read after the fork.
FORK_ENV = ("CUDA_VISIBLE_DEVICES", "PDSERVE_", "UCX_", "NCCL_", "PYTHONUNBUFFERED")
UNKNOWN_STATUS = 255  # a child's exit status when its zygote was gone before reporting it
READY_TIMEOUT_S = 120.0


class ZygoteUnusable(RuntimeError):
    """This zygote cannot fork the process asked for; start it the plain way."""


def env_difference(zygote_env: dict[str, str], child_env: dict[str, str]) -> list[str]:
    """Variables the child would see differently from the zygote, other than ``FORK_ENV``'s."""
    names = set(zygote_env) | set(child_env)
    return sorted(n for n in names if zygote_env.get(n) != child_env.get(n) and not n.startswith(FORK_ENV))


# -- the owner's side ---------------------------------------------------------------------------------
class ForkedProcess:
    """What ``subprocess.Popen`` offers the launcher (pid, poll, wait, signals, stdout), for a child of
    the zygote: its exit status comes from the zygote, its signals go through a pidfd."""

    def __init__(self, pid: int, pidfd: int, stdout, zygote: Zygote) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._pidfd = pidfd
        self._zygote = zygote
        self._done = threading.Event()

    def _exited(self, status: int) -> None:
        if self.returncode is None:
            self.returncode = status
        self._done.set()
        fd, self._pidfd = self._pidfd, -1
        if fd >= 0:
            os.close(fd)

    def poll(self) -> int | None:
        if self.returncode is None and not self._zygote.alive() and self._pidfd >= 0:
            # No zygote to report it: the pidfd turns readable once the process has exited.
            if select.select([self._pidfd], [], [], 0)[0]:
                self._exited(UNKNOWN_STATUS)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            self._done.wait(0.1 if left is None else min(0.1, left))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None and self._pidfd >= 0:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    def __init__(self, proc: subprocess.Popen, ctrl: socket.socket, env: dict[str, str], ready: dict) -> None:
        self.proc = proc
        self.env = env
        self.ready = ready  # what it preloaded and how long that took
        self._ctrl = ctrl
        self._lock = threading.Lock()  # one request at a time
        self._replies: list[tuple[dict, list[int]]] = []
        self._reply = threading.Condition()
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}
        threading.Thread(target=self._read, daemon=True, name="zygote-reader").start()

    @classmethod
    def start(cls, env: dict[str, str], *, preload: tuple[str, ...] = PRELOAD,
              log_path: str | Path | None = None, timeout: float = READY_TIMEOUT_S) -> Zygote:
        """Start a zygote with this environment and wait until it has imported ``preload``."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**env, "PYTHONUNBUFFERED": "1"}  # its children's stdout reaches the launcher at once
        root = str(Path(__file__).resolve().parents[3])
        if log_path:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed below
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pdserve.app.launcher.zygote_proc", "--ctrl-fd", str(theirs.fileno()),
                 "--preload", ",".join(preload)],
                pass_fds=(theirs.fileno(),), env=env, cwd=root, stdin=subprocess.DEVNULL,
                stdout=log, stderr=log, start_new_session=True)
        finally:
            theirs.close()
            if log_path:
                log.close()
        mine.settimeout(timeout)
        try:
            msg, _ = recv(mine)
        except (OSError, ValueError) as exc:
            proc.kill()
            proc.wait(10)
            mine.close()
            raise ZygoteUnusable(f"the zygote did not start: {exc}") from exc
        mine.settimeout(None)
        if not msg.get("ready"):
            proc.wait(10)
            mine.close()
            raise ZygoteUnusable(f"the zygote cannot fork workers: {msg.get('error', msg)}")
        return cls(proc, mine, env, msg)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, argv: list[str], env: dict[str, str], *, stdout: int, stderr: int, cwd: str | None = None,
             timeout: float = 30.0) -> ForkedProcess:
        """Fork ``pdserve <argv>`` with this environment; ``stdout``/``stderr``: descriptors it takes."""
        differ = env_difference(self.env, env)
        if differ:
            raise ZygoteUnusable(f"the worker's environment differs from the zygote's in {', '.join(differ)}")
        if not self.alive():
            raise ZygoteUnusable(f"the zygote exited with status {self.proc.returncode}")
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd or os.getcwd()}).encode()
        with self._lock:
            try:
                self._ctrl.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                array.array("i", [stdout, stderr]))])
            except OSError as exc:
                raise ZygoteUnusable(f"the zygote is gone: {exc}") from exc
            msg, fds = self._next_reply(timeout)
        if "pid" not in msg or not fds:
            for fd in fds:
                os.close(fd)
            raise ZygoteUnusable(f"the zygote did not fork: {msg.get('error', msg)}")
        return self._watch(ForkedProcess(msg["pid"], fds[0], None, self))

    def _watch(self, child: ForkedProcess) -> ForkedProcess:
        """Deliver this child's exit to it (an exit reported before it was registered included)."""
        with self._reply:
            self._children[child.pid] = child
            status = self._early_exits.pop(child.pid, None)
        if status is not None:
            child._exited(status)
        return child

    def _next_reply(self, timeout: float) -> tuple[dict, list[int]]:
        deadline = time.monotonic() + timeout
        with self._reply:
            while not self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or not self.alive():
                    raise ZygoteUnusable("the zygote did not answer a fork request")
                self._reply.wait(min(left, 0.2))
            return self._replies.pop(0)

    def _read(self) -> None:
        while True:
            try:
                msg, fds = recv(self._ctrl)
            except (OSError, ValueError):
                break
            if "exit" in msg:
                with self._reply:
                    child = self._children.pop(msg["exit"], None)
                    if child is None:
                        self._early_exits[msg["exit"]] = msg["status"]
                if child is not None:
                    child._exited(msg["status"])
            else:
                with self._reply:
                    self._replies.append((msg, fds))
                    self._reply.notify_all()
        with self._reply:
            self._reply.notify_all()

    def close(self) -> None:
        """Stop the zygote (its children run on: they are the cluster's processes)."""
        with contextlib.suppress(OSError):
            self._ctrl.shutdown(socket.SHUT_RDWR)
        self._ctrl.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


class ZygoteSlot:
    """The zygote a launcher forks from, started in the background.

    ``ready()`` is the running zygote, or None while one starts or when none can run here. The caller
    starts a plain process on None, so a cluster's first processes start as fresh interpreters (where
    the early upload hides the import of torch) while the zygote imports beside them, and the restarts
    and scale-ups after them fork. A zygote that died is started again at the next ``ready()``; one that
    cannot run here (``ZygoteUnusable``) is not tried again (``disabled`` says why)."""

    def __init__(self, env: Callable[[], dict[str, str]], log_path: str | Path) -> None:
        self._env = env
        self._log_path = log_path
        self._lock = threading.Lock()
        self._zygote: Zygote | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self.disabled = ""

    def ready(self) -> Zygote | None:
        with self._lock:
            if self.disabled or self._closed:
                return None
            z = self._zygote
            if z is not None and z.alive():
                return z
            if z is not None:
                log.warning("the zygote exited with status %s; starting it again", z.proc.returncode)
                self._zygote = None
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._start, daemon=True, name="zygote-start")
                self._thread.start()
            return None

    def wait(self, timeout: float = READY_TIMEOUT_S) -> Zygote | None:
        """``ready()`` once the start under way (if any) has ended."""
        if self.ready() is None and self._thread is not None:
            self._thread.join(timeout)
        return self.ready()

    def _start(self) -> None:
        try:
            z = Zygote.start(self._env(), log_path=self._log_path)
        except ZygoteUnusable as exc:
            log.warning("%s; starting plain processes instead", exc)
            with self._lock:
                self.disabled = str(exc)
            return
        with self._lock:
            if not self._closed:
                self._zygote = z
                log.info("zygote %d ready: %s", z.proc.pid, z.ready.get("modules"))
                return
        z.close()  # closed while it started

    def close(self) -> None:
        with self._lock:
            self._closed = True
            z, self._zygote = self._zygote, None
        if z is not None:
            z.close()
