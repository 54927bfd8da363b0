"""The await surface both transfer handles share (a receiver's Expectation, a sender's SendHandle).

Each owns ``self._future``, resolved with the transfer's result dict or failed with the
``TransferError`` that ended it; callers poll ``done()`` / ``exception()`` or ``await wait()``.
``wait`` shields the future, so cancelling a waiter never cancels the transfer itself.
"""

from __future__ import annotations

import asyncio


class FutureResult:
    _future: asyncio.Future

    def done(self) -> bool:
        return self._future.done()

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    async def wait(self) -> dict:
        """{request_id, bytes, seconds, backend}; raises the TransferError that ended it."""
        return await asyncio.shield(self._future)
