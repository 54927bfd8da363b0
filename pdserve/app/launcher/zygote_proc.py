"""The zygote process itself (``python -m pdserve.app.launcher.zygote_proc``): its imports, the checks that
it is safe to fork, the fork of each requested `pdserve` process, the reaping of its children, and the
messages it exchanges with the launcher. The launcher's side and the why: ``launcher/zygote.py``.

Messages are one JSON object each on a ``SOCK_SEQPACKET`` socket, with descriptors as SCM_RIGHTS:
ready (or why not) once at start; per fork request (argv, env, cwd; stdout and stderr as descriptors)
the child's pid with its pidfd, or an error; an exit (pid, status) whenever a child was reaped.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import ctypes
import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback

from pdserve import bytecode
from pdserve.settings import replace_environ

PRELOAD = ("torch", "pdserve.app.cli", "pdserve.app.roles")
_MAX_MSG = 1 << 20


def recv(sock: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    data, ancdata, _, _ = sock.recvmsg(_MAX_MSG, socket.CMSG_SPACE(8 * fds.itemsize))
    if not data:
        raise ValueError("control socket closed")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return json.loads(data), list(fds)


def send(ctrl: socket.socket, msg: dict, fds: list[int] = ()) -> None:
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    ctrl.sendmsg([json.dumps(msg).encode()], anc)


def _preload(modules: list[str]) -> dict[str, float]:
    took: dict[str, float] = {}
    for name in modules:
        t = time.monotonic()
        importlib.import_module(name)
        took[name] = round(time.monotonic() - t, 3)
    from pdserve.app.cli import build_parser

    build_parser()  # every command module imported, as main() will do in the child
    if "torch" in sys.modules:
        from engine.fork_preload import preload

        took.update(preload())
    return took


def _no_pidfd() -> str:
    """Why this kernel cannot give pidfds (Linux >= 5.3), or ""."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError) as exc:
        return f"no pidfd on this system ({exc})"
    return ""


def _unsafe_to_fork() -> str:
    """Why a child of this process could not run as a fresh process would, or ""."""
    # Python threads only: a library's native pool may run (OpenBLAS starts one at numpy's import and
    # re-creates it in a forked child through its own at-fork handlers).
    if threading.active_count() != 1:
        return f"{threading.active_count()} Python threads run in the zygote after its imports"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised by an import"
    return ""


def _probe_child() -> str:
    """Fork once and ask the child whether CUDA is usable there: torch has not marked it a bad fork (an
    import asked the CUDA runtime for devices, which torch poisons forks for) and, where the driver is
    installed, ``cuInit`` succeeds (it fails in a child of a process that initialised the driver)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda._is_in_bad_fork():
                code |= 1
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError:
                lib = None
            if lib is not None and lib.cuInit(0) != 0:
                code |= 2
        finally:
            os._exit(code)
    _, wstatus = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(wstatus)
    if code == 0:
        return ""
    return ("an import initialised CUDA: a forked child could not use it ("
            + ", ".join(w for bit, w in ((1, "torch: bad fork"), (2, "cuInit failed")) if code & bit)
            + (f", exit {code}" if code < 0 or code > 3 else "") + ")")


def _child(req: dict, out_fd: int, err_fd: int, ctrl: socket.socket) -> None:
    """In the forked child: become the requested `pdserve` process. Never returns."""
    status = 1
    try:
        os.setsid()
        ctrl.close()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        for fd in (null, out_fd, err_fd):
            if fd > 2:
                os.close(fd)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        replace_environ(req["env"])
        os.chdir(req["cwd"])
        sys.argv = ["pdserve", *req["argv"]]
        gc.unfreeze()
        from pdserve.app.cli import main

        status = main(req["argv"])
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported on the child's stderr, then it exits
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(status)


def _serve(ctrl: socket.socket) -> None:
    children: set[int] = set()
    while True:
        readable = select.select([ctrl], [], [], 0.05)[0]
        while children:  # reap (and report) whatever exited
            try:
                pid, wstatus = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            with contextlib.suppress(OSError):
                send(ctrl, {"exit": pid, "status": os.waitstatus_to_exitcode(wstatus)})
        if not readable:
            continue
        try:
            req, fds = recv(ctrl)
        except (OSError, ValueError):
            return  # the launcher closed the channel (or died): the children run on
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            send(ctrl, {"error": "a fork request carries exactly two descriptors (stdout, stderr)"})
            continue
        why = _unsafe_to_fork()
        if why:
            for fd in fds:
                os.close(fd)
            send(ctrl, {"error": why})
            continue
        pid = os.fork()
        if pid == 0:
            _child(req, fds[0], fds[1], ctrl)
        for fd in fds:
            os.close(fd)
        children.add(pid)
        pidfd = os.pidfd_open(pid)
        try:
            send(ctrl, {"pid": pid}, [pidfd])
        finally:
            os.close(pidfd)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m pdserve.app.launcher.zygote")
    parser.add_argument("--ctrl-fd", type=int, required=True)
    parser.add_argument("--preload", default=",".join(PRELOAD))
    args = parser.parse_args()
    bytecode.enable()  # its children inherit it with the modules
    ctrl = socket.socket(fileno=args.ctrl_fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when it ends (its channel closes)
    t = time.monotonic()
    try:
        took = _preload([m for m in args.preload.split(",") if m])
    except Exception as exc:  # noqa: BLE001 - told to the launcher, which then starts plain processes
        send(ctrl, {"ready": False, "error": f"preload failed: {exc!r}"})
        return
    why = _no_pidfd() or _unsafe_to_fork() or _probe_child()
    if why:
        send(ctrl, {"ready": False, "error": why})
        return
    gc.collect()
    gc.freeze()
    print(f"zygote {os.getpid()} ready in {time.monotonic() - t:.2f}s: {took}", flush=True)
    send(ctrl, {"ready": True, "preload_s": round(time.monotonic() - t, 3), "modules": took,
                 "pid": os.getpid(), "native_threads": len(os.listdir("/proc/self/task"))})
    _serve(ctrl)
    os._exit(0)  # nothing to tear down: the interpreter's teardown of torch / Triton only takes time


if __name__ == "__main__":
    main()
