"""The registered KV tensor seen as bytes: offsets, zero-copy host views, staging for device memory.

Host (CPU) tensors are read and written in place through a memoryview of their storage, so the TCP
path receives straight into the destination blocks (``recv_into``) and sends straight from the
source blocks (``sendmsg``). Device (CUDA) tensors cannot be handed to a socket; the TCP path stages
them through host buffers (one copy each way). NIXL reads/writes device memory directly (VRAM).
"""

from __future__ import annotations

import torch

from engine.kv_layout import KVLayout

from .errors import InvalidTransfer


class KVMemory:
    def __init__(self, tensor: torch.Tensor, layout: KVLayout, *, force_staging: bool = False) -> None:
        if tensor.dim() != 6:
            raise InvalidTransfer(f"KV tensor must be 6-D {layout.cache_shape(0)}, "
                                  f"got shape {tuple(tensor.shape)}")
        num_blocks = int(tensor.shape[1])
        if tuple(tensor.shape) != layout.cache_shape(num_blocks):
            raise InvalidTransfer(f"KV tensor shape {tuple(tensor.shape)} does not match layout "
                                  f"{layout.cache_shape(num_blocks)} ({layout.describe()})")
        if tensor.dtype != layout.torch_dtype:
            raise InvalidTransfer(f"KV tensor dtype {tensor.dtype} but layout says {layout.dtype}")
        if not tensor.is_contiguous():
            raise InvalidTransfer("KV tensor must be contiguous")
        if tensor.device.type != layout.memory:
            raise InvalidTransfer(f"KV tensor on {tensor.device} but layout memory is {layout.memory!r}")
        self.tensor = tensor
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_bytes = layout.block_bytes
        self.nbytes = layout.cache_bytes(num_blocks)
        self.device = tensor.device
        self.is_host = tensor.device.type == "cpu"
        self.staged = force_staging or not self.is_host
        # Same storage, viewed as flat bytes (works for bf16, which numpy cannot represent).
        self._flat = tensor.view(-1).view(torch.uint8)
        self._host = memoryview(self._flat.numpy()) if self.is_host else None

    @property
    def base_address(self) -> int:
        return self.tensor.data_ptr()

    @property
    def device_id(self) -> int:
        return 0 if self.is_host else (self.device.index or 0)

    @property
    def nixl_mem_type(self) -> str:
        return "DRAM" if self.is_host else "VRAM"

    def offset(self, layer: int, block: int) -> int:
        return (layer * self.num_blocks + block) * self.block_bytes

    def send_views(self, segments: list[tuple[int, int, int]]) -> list[memoryview]:
        """Buffers holding (offset, length, _) segments' bytes, zero-copy for host memory."""
        if not self.staged:
            return [self._host[off:off + n] for off, n, _ in segments]
        return [memoryview(self._flat[off:off + n].cpu().numpy()) for off, n, _ in segments]

    def recv_views(self, segments: list[tuple[int, int, int]]) -> tuple[list[memoryview], bytearray | None]:
        """Writable buffers for incoming segments; a staging buffer to flush() afterwards when staged."""
        if not self.staged:
            return [self._host[off:off + n] for off, n, _ in segments], None
        staging = bytearray(sum(n for _, n, _ in segments))
        view = memoryview(staging)
        views, pos = [], 0
        for _, n, _ in segments:
            views.append(view[pos:pos + n])
            pos += n
        return views, staging

    def flush(self, segments: list[tuple[int, int, int]], staging: bytearray) -> None:
        """Copy a staged payload into the tensor (device memory, or host when force_staging)."""
        src = torch.frombuffer(staging, dtype=torch.uint8)
        pos = 0
        for off, n, _ in segments:
            self._flat[off:off + n].copy_(src[pos:pos + n], non_blocking=False)
            pos += n

    def region_bytes(self, offset: int, nbytes: int) -> bytes:
        """A copy of a region (checksums, tests)."""
        return bytes(self._flat[offset:offset + nbytes].cpu().numpy())
