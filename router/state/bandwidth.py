"""LinkStats: measured prefill->decode bandwidth per pair and the KV size of one block.

Learnt from ``Outcome`` (bytes_sent / transfer_s, EWMA). Small transfers are dominated by
latency, not bandwidth, so they are not samples. Unmeasured pairs use the configured default.
"""

from __future__ import annotations


class LinkStats:
    def __init__(self, *, default_Bps: float, alpha: float, min_sample_bytes: int,
                 bytes_per_block: int) -> None:
        self.default_Bps = default_Bps
        self.alpha = alpha
        self.min_sample_bytes = min_sample_bytes
        self.bytes_per_block = float(bytes_per_block)
        # rows[prefill_id][decode_id] = bytes/s; nested so scoring looks up a prefill's row once.
        self.rows: dict[str, dict[str, float]] = {}

    def bandwidth(self, prefill_id: str, decode_id: str) -> float:
        return self.rows.get(prefill_id, {}).get(decode_id, self.default_Bps)

    def measured(self, prefill_id: str, decode_id: str) -> bool:
        return decode_id in self.rows.get(prefill_id, {})

    def observe(self, prefill_id: str, decode_id: str, *, bytes_sent: int, seconds: float,
                blocks_sent: int) -> None:
        if blocks_sent > 0 and bytes_sent > 0:
            per = bytes_sent / blocks_sent
            self.bytes_per_block += self.alpha * (per - self.bytes_per_block)
        if bytes_sent < self.min_sample_bytes or seconds <= 0:
            return
        sample = bytes_sent / seconds
        row = self.rows.setdefault(prefill_id, {})
        old = row.get(decode_id)
        row[decode_id] = sample if old is None else old + self.alpha * (sample - old)

    def forget(self, worker_id: str) -> None:
        self.rows.pop(worker_id, None)
        for p in [p for p, row in self.rows.items() if row.pop(worker_id, None) is not None and not row]:
            del self.rows[p]
