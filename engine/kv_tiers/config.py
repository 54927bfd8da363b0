"""``TierConfig``: the sizes of a worker's KV tiers, and the host tier's default size from the machine."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class TierConfig:
    """Sizes of the tiers behind the GPU (device) KV cache; both zero / None: no tiers. ``host_auto``:
    the host tier is sized from the machine once the device cache is known (``resolved``)."""

    host_bytes: int = 0
    host_auto: bool = False
    disk_dir: str | None = None
    disk_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("host_bytes", "disk_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"TierConfig.{name} must be an int >= 0, got {value!r}")
        if (self.disk_dir is None) != (self.disk_bytes == 0):
            raise ValueError("a disk tier needs both a directory (--kv-disk-dir) and a size (--kv-disk-gb)")

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_dir is not None

    def resolved(self, *, device_cache_bytes: int, device_type: str) -> TierConfig:
        """``host_auto`` made a size: on CUDA twice the device cache (SGLang HiCache's default ratio),
        at most a quarter of the memory this process may still take (the host's available memory,
        or its cgroup's headroom, the pod's); on CPU none (the cache is host memory already)."""
        if not self.host_auto:
            return self
        host = 0
        if device_type == "cuda":
            host = min(2 * device_cache_bytes, available_memory_bytes() // 4)
        return replace(self, host_bytes=host, host_auto=False)


def available_memory_bytes() -> int:
    """Memory this process may still allocate: MemAvailable, capped by its cgroup's limit (v2 or v1)
    less what the cgroup uses."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit_file, used_file in (("memory.max", "memory.current"),  # cgroup v2
                                  ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):  # v1
        try:
            limit = Path("/sys/fs/cgroup", limit_file).read_text().strip()
            if limit != "max" and int(limit) < 1 << 60:  # v1 says "no limit" with a huge number
                used = int(Path("/sys/fs/cgroup", used_file).read_text())
                available = min(available, max(int(limit) - used, 0))
        except (OSError, ValueError):
            continue
    return available
