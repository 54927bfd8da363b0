"""A source rank's staging area for receivers that hold fewer KV heads per rank than it does.

In the cache ``[L, B, 2, block_size, H, head_dim]`` a range of heads is not contiguous inside a
block (heads are innermost but one, per token), so a receiver rank that owns heads [h0, h1) of a
sender rank's H cannot be written with one descriptor per block. The sender gathers those heads of
the request's blocks into this area, laid out as blocks of ``g = h1 - h0`` heads (contiguous, the
receiver's own block layout), and sends whole staging blocks. The copy is local to the rank (device
memory to device memory on a GPU), so no KV passes through another rank.

Lifecycle (all on the agent's event loop)::

    area = StagingArea(layout_g, num_blocks, device, make_transport); await area.start()
    ids = await area.reserve(n, deadline)     # waits while the area is full; refuses n > capacity
    await area.gather(cache, src, ids, head_offset, layers)   # heads [off, off+g) of src -> ids
    ... area.transport.start_send(..., ids, ...) ...
    area.free(ids)                            # once the send is settled (acknowledged or aborted)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import torch

from engine.kv_layout import KVLayout

from ..errors import InvalidTransfer, TransferTimeout


class StagingArea:
    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device,
                 make_transport: Callable[[KVLayout, torch.Tensor], object]) -> None:
        if num_blocks < 1:
            raise ValueError(f"a staging area needs at least one block, got {num_blocks}")
        self.layout = layout
        self.capacity = num_blocks
        self.tensor = layout.allocate(num_blocks, device)
        self.transport = make_transport(layout, self.tensor)
        self.stream = torch.cuda.Stream(device) if self.tensor.is_cuda else None
        self._free = list(range(num_blocks - 1, -1, -1))
        self._changed = asyncio.Condition()

    async def start(self) -> StagingArea:
        await self.transport.start()
        return self

    @property
    def in_use(self) -> int:
        return self.capacity - len(self._free)

    async def reserve(self, n: int, deadline: float) -> list[int]:
        """``n`` staging blocks, waiting (until ``deadline``, time.monotonic()) while others hold them."""
        if n > self.capacity:
            raise InvalidTransfer(f"{n} blocks do not fit the {self.capacity}-block staging area "
                                  "(raise --kv-staging-blocks)")
        async with self._changed:
            while len(self._free) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(f"no {n} free staging blocks before the send's deadline")
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except TimeoutError:
                    continue
            return [self._free.pop() for _ in range(n)]

    def free(self, ids: Sequence[int]) -> None:
        self._free.extend(ids)
        loop = asyncio.get_running_loop()
        loop.create_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def gather(self, cache: torch.Tensor, src: Sequence[int], ids: Sequence[int], head_offset: int,
                     layers: Sequence[int]) -> None:
        """Copy KV heads [head_offset, head_offset + g) of ``src`` blocks of ``layers`` into ``ids``;
        returns once the copy is complete (the transport may read the area then)."""
        g = self.layout.num_kv_heads
        dev = self.tensor.device
        src_t = torch.as_tensor(list(src), dtype=torch.long, device=dev)
        ids_t = torch.as_tensor(list(ids), dtype=torch.long, device=dev)
        if self.stream is None:
            self._copy(cache, src_t, ids_t, head_offset, g, layers)
            return
        # The layers are computed (the push comes after rank 0 saw them done, and the ranks' all-reduces
        # order every rank's KV writes before that): the copy needs no wait on the compute stream.
        with torch.cuda.stream(self.stream):
            self._copy(cache, src_t, ids_t, head_offset, g, layers)
            event = torch.cuda.Event()
            event.record(self.stream)
        await asyncio.get_running_loop().run_in_executor(None, event.synchronize)

    def _copy(self, cache, src_t, ids_t, off, g, layers) -> None:
        for layer in layers:
            self.tensor[layer].index_copy_(0, ids_t, cache[layer].index_select(0, src_t)[..., off:off + g, :])

    async def close(self) -> None:
        await self.transport.close()


def regroup(cache: torch.Tensor, blocks: Sequence[int], pieces: int,
            stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
    """Blocks whose bytes arrived as ``pieces`` consecutive pieces of ``[2, block_size, g, head_dim]``
    (piece j = heads [j*g, (j+1)*g) of the block, written through the cache's piece view) put back into
    the cache's ``[2, block_size, pieces*g, head_dim]`` order, in place. Returns the CUDA event after the
    copies (None on CPU, where they are done)."""
    num_layers, _, two, bs, heads, hd = cache.shape
    g = heads // pieces
    idx = torch.as_tensor(list(blocks), dtype=torch.long, device=cache.device)
    n = len(blocks)

    def run() -> None:
        for layer in range(num_layers):
            raw = cache[layer].index_select(0, idx).view(n, pieces, two, bs, g, hd)
            cache[layer].index_copy_(0, idx, raw.permute(0, 2, 3, 1, 4, 5).reshape(n, two, bs, heads, hd))

    if stream is None:
        run()
        return None
    with torch.cuda.stream(stream):
        run()
        event = torch.cuda.Event()
        event.record(stream)
    return event
