"""Host-to-device copies spread over lanes: a thread and a CUDA stream each (engine.early_upload).

A copy call into the driver releases the GIL, but its return waits to take the GIL back from whatever
the main thread runs (the imports, in a worker's start). Lanes wait for it side by side instead of one
after another, so the pieces go at the pace of several threads (docs/gpu.md, "Boot").
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

from engine.cuda_driver import _Driver

Work = Callable[[list, ctypes.c_void_p, Callable[[], bool]], None]  # (pieces, stream, stop)


def run(cuda: _Driver, ctx: ctypes.c_void_p, pieces: list, stream: ctypes.c_void_p, work: Work, lanes: int,
        cancel: threading.Event, name: str = "copy-lane") -> None:
    """``work(pieces, stream, stop)`` over ``lanes`` lanes, the pieces dealt round robin, each helper
    lane on a thread and a stream of its own in context ``ctx`` (the first lane: this thread, on
    ``stream``); ``stop()`` turns true on ``cancel`` or once any lane failed, and the first failure is
    raised here after every lane has ended and synchronized its stream. Helper threads are named
    ``{name}-{i}``."""
    n = max(1, min(lanes, len(pieces)))
    errors: list[BaseException] = []

    def stop() -> bool:
        return cancel.is_set() or bool(errors)

    def lane(items: list, own: ctypes.c_void_p | None) -> None:
        s = own or ctypes.c_void_p()
        try:
            if own is None:
                cuda.cuCtxSetCurrent(ctx)
                cuda.cuStreamCreate(ctypes.byref(s), 1)  # CU_STREAM_NON_BLOCKING
            try:
                work(items, s, stop)
            finally:
                if s.value:
                    cuda.cuStreamSynchronize(s)
                    if own is None:
                        cuda.cuStreamDestroy_v2(s)
        except BaseException as exc:  # noqa: BLE001 - raised on the calling thread below
            errors.append(exc)

    helpers = [threading.Thread(target=lane, args=(pieces[i::n], None), name=f"{name}-{i}",
                                daemon=True) for i in range(1, n)]
    for t in helpers:
        t.start()
    lane(pieces[0::n], stream)
    for t in helpers:
        t.join()
    if errors:
        raise next((e for e in errors if str(e) != "cancelled"), errors[0])
