"""Parent-side driver for bench.kv_peer_proc children (tests and benchmark)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)


class PeerError(Exception):
    def __init__(self, reply: dict) -> None:
        super().__init__(f"{reply.get('kind')}: {reply.get('error')}")
        self.kind = reply.get("kind")
        self.reply = reply


class PeerClient:
    """``async with PeerClient.spawn(env={...}) as peer: await peer.call("init", ...)``."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.pid = proc.pid
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None

    @classmethod
    async def spawn(cls, env: dict | None = None, prefix: list[str] | None = None,
                    stderr=None, root: str | None = None) -> PeerClient:
        """root: the source tree the child imports kvtransfer from (another checkout, for A/B runs)."""
        root = root or _ROOT
        # root first, then whatever the parent had (a device run installs packages under /tmp/site)
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        full_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
        for key, value in list(full_env.items()):
            if value is None:
                del full_env[key]
        proc = await asyncio.create_subprocess_exec(
            *(prefix or []), sys.executable, "-m", "bench.kv_peer_proc", cwd=root, env=full_env,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=stderr, limit=1 << 24)
        self = cls(proc)
        hello = json.loads(await asyncio.wait_for(proc.stdout.readline(), 120))
        self.pid = hello.get("pid", proc.pid)
        self._reader = asyncio.get_running_loop().create_task(self._read())
        return self

    async def _read(self) -> None:
        while line := await self.proc.stdout.readline():
            try:
                reply = json.loads(line)
            except ValueError:  # not ours (a library printing to stdout); never fatal
                sys.stderr.write(f"peer {self.pid}: {line.decode(errors='replace')}")
                continue
            fut = self._pending.pop(reply.get("id"), None)
            if fut is not None and not fut.done():
                fut.set_result(reply)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError("peer process exited"))
        self._pending.clear()

    async def call(self, op: str, *, wait_s: float = 120.0, **kw) -> dict:
        cid = next(self._ids)
        fut = self._pending[cid] = asyncio.get_running_loop().create_future()
        self.proc.stdin.write((json.dumps({"id": cid, "op": op, **kw}) + "\n").encode())
        await self.proc.stdin.drain()
        reply = await asyncio.wait_for(fut, wait_s)
        if not reply.get("ok"):
            raise PeerError(reply)
        return reply

    def kill(self) -> None:
        """SIGKILL the peer (the real process, also when started under ip netns exec)."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    async def close(self) -> None:
        if self.proc.returncode is None:
            try:
                await self.call("exit", wait_s=20)
            except Exception:
                self.kill()
        try:
            await asyncio.wait_for(self.proc.wait(), 20)
        except asyncio.TimeoutError:
            self.kill()
            await self.proc.wait()
        if self._reader is not None:
            self._reader.cancel()

    async def __aenter__(self) -> PeerClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
