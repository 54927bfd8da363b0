"""Paged attention in plain PyTorch (``scaled_dot_product_attention``), correct on CPU and GPU.

``plan`` splits the batch in two groups and precomputes, with numpy on the host, every index the
layers need, so a layer is a handful of batched tensor ops with no Python loop over sequences:

* **decode** — the leading run of sequences with one query token. Their keys/values are gathered
  from the cache through the block tables into ``[Bd, L, kv_heads, head_dim]`` (``L`` = longest
  context in the group, rounded up to blocks) and attended with a length mask. GQA without copying
  K/V: the ``group`` query heads sharing a KV head are folded into SDPA's query-length axis.
* **prefill** — everything else (whole prompts, chunks, prompts after a prefix-cache hit), padded to
  ``[Bp, Qmax]``. Without cached context (the common case: a fresh prompt) queries attend to this
  step's own keys with SDPA's causal kernel and never read the cache; with context (a later chunk, a
  prefix hit) the keys come from the cache and a bottom-right causal mask
  ``key_pos <= context_len + i`` is built once per step and shared by all layers.

Padded query rows are clamped copies of real rows (finite, never fully masked) and are dropped by a
final gather, so no NaN can appear and the output is in the batch's token order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata, BatchSpec
from engine.staging import to_device


def _probe_gqa() -> bool:
    """torch >= 2.5 attends grouped KV heads (``enable_gqa``) without materialising K/V copies."""
    try:
        F.scaled_dot_product_attention(torch.zeros(1, 2, 1, 2), torch.zeros(1, 1, 1, 2),
                                       torch.zeros(1, 1, 1, 2), enable_gqa=True)
        return True
    except TypeError:
        return False


_HAS_GQA = _probe_gqa()


@dataclass(kw_only=True)
class TorchAttentionMetadata(AttentionMetadata):
    kv_slots: torch.Tensor  # [2T] rows of the flat cache view receiving k (first T) then v (last T)
    num_decodes: int
    # decode group
    dec_k_rows: torch.Tensor | None = None  # [Bd * Ld] rows of K in the flat cache view
    dec_len: int = 0  # Ld
    dec_mask: torch.Tensor | None = None  # [Bd, 1, 1, Ld] bool
    # prefill group
    num_prefills: int = 0
    pre_q_index: torch.Tensor | None = None  # [Bp * Qmax] token index (within the prefill group)
    pre_q_len: int = 0  # Qmax
    pre_out_index: torch.Tensor | None = None  # [Tp] row of the padded output for each prefill token
    pre_k_rows: torch.Tensor | None = None  # [Bp * Lp] rows of K in the flat cache (None: causal path)
    pre_len: int = 0  # Lp
    pre_mask: torch.Tensor | None = None  # [Bp, 1, Qmax, Lp] bool (None: SDPA is_causal)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def plan(self, batch: BatchSpec) -> TorchAttentionMetadata:
        bs = self.block_size
        q_lens = np.asarray(batch.query_lens, dtype=np.int64)
        ctx = np.asarray(batch.context_lens, dtype=np.int64)
        n_seqs = len(q_lens)
        if n_seqs == 0 or (q_lens <= 0).any() or (ctx < 0).any():
            raise ValueError("a step needs at least one sequence, each with >= 1 query token")
        kv_lens = ctx + q_lens
        n_blocks = -(-kv_lens // bs)
        tables = np.zeros((n_seqs, int(n_blocks.max())), dtype=np.int64)
        for i, table in enumerate(batch.block_tables):
            need = int(n_blocks[i])
            if len(table) < need:
                raise ValueError(f"sequence {i} has {len(table)} blocks but {kv_lens[i]} tokens need {need}")
            tables[i, :need] = table[:need]

        total = int(q_lens.sum())
        cu = np.zeros(n_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        seq_of = np.repeat(np.arange(n_seqs), q_lens)  # [T]
        local = np.arange(total) - cu[seq_of]  # index of each token within its sequence's queries
        positions = ctx[seq_of] + local
        k_slots = (tables[seq_of, positions // bs] * 2) * bs + positions % bs
        kv_slots = np.concatenate([k_slots, k_slots + bs])

        host: dict[str, np.ndarray] = {"positions": positions, "kv_slots": kv_slots}
        fields: dict = {}
        # Decode group: the leading run of single-token sequences.
        not_one = np.flatnonzero(q_lens != 1)
        nd = int(not_one[0]) if len(not_one) else n_seqs
        if nd:
            nb = int(n_blocks[:nd].max())
            length = nb * bs
            host["dec_k_rows"] = self._rows(tables[:nd, :nb])
            key = np.arange(length)[None, :]
            allowed = key < kv_lens[:nd, None]
            if self.sliding_window is not None:
                allowed &= key > kv_lens[:nd, None] - 1 - self.sliding_window
            host["dec_mask"] = allowed[:, None, None, :]
            fields["dec_len"] = length
        # Prefill group: the rest, padded to the longest query run.
        np_ = n_seqs - nd
        if np_:
            pq, pctx = q_lens[nd:], ctx[nd:]
            q_max = int(pq.max())
            cols = np.minimum(np.arange(q_max)[None, :], pq[:, None] - 1)  # clamp padding to real rows
            start = cu[nd:-1] - cu[nd]
            host["pre_q_index"] = (start[:, None] + cols).reshape(-1)
            host["pre_out_index"] = (seq_of[cu[nd]:] - nd) * q_max + local[cu[nd]:]
            fields.update(pre_q_len=q_max, num_prefills=np_)
            windowed = self.sliding_window is not None and int(kv_lens[nd:].max()) > self.sliding_window
            if pctx.any() or windowed:
                nb = int(n_blocks[nd:].max())
                length = nb * bs
                host["pre_k_rows"] = self._rows(tables[nd:, :nb])
                qpos = pctx[:, None] + cols  # [Bp, Qmax]
                key = np.arange(length)[None, None, :]
                allowed = key <= qpos[:, :, None]
                if self.sliding_window is not None:
                    allowed &= key > qpos[:, :, None] - self.sliding_window
                host["pre_mask"] = allowed[:, None, :, :]
                fields["pre_len"] = length

        dev = {name: self._to_device(arr) for name, arr in host.items()}
        return TorchAttentionMetadata(backend=self, num_tokens=total, num_decodes=nd, **dev, **fields)

    def _rows(self, tables: np.ndarray) -> np.ndarray:
        """Flat-cache row of K for every token slot of ``tables [B, nb]`` -> ``[B * nb * bs]``."""
        bs = self.block_size
        return ((tables * 2 * bs)[:, :, None] + np.arange(bs)[None, None, :]).reshape(-1)

    def _to_device(self, arr: np.ndarray) -> torch.Tensor:
        return to_device(torch.from_numpy(np.ascontiguousarray(arr)), self.device)

    # ---- per layer ----------------------------------------------------------------------------
    def kv_store_target(self, kv_layer: torch.Tensor,
                        meta: TorchAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, None]:
        return kv_layer.view(-1, self.num_kv_heads, self.head_dim), meta.kv_slots, None

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_layer: torch.Tensor,
                meta: TorchAttentionMetadata) -> torch.Tensor:
        flat, slots, _ = self.kv_store_target(kv_layer, meta)  # [blocks * 2 * block_size, kv_heads, d]
        t = meta.num_tokens
        if k is not None:
            flat.index_copy_(0, slots[:t], k)
            flat.index_copy_(0, slots[t:], v)
        elif meta.num_prefills:  # stored by the caller (engine.fused_ops): the prefill reads them back
            k, v = flat.index_select(0, slots[:t]), flat.index_select(0, slots[t:])
        nd = meta.num_decodes
        outs = []
        if nd:
            outs.append(self._decode(q[:nd], flat, meta))
        if meta.num_prefills:
            outs.append(self._prefill(q[nd:], k[nd:], v[nd:], flat, meta))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _gather_kv(self, flat: torch.Tensor, rows: torch.Tensor, b: int, length: int):
        """K, V ``[b, kv_heads, length, head_dim]`` for rows from ``_rows`` (V sits block_size after K)."""
        k = flat.index_select(0, rows).view(b, length, self.num_kv_heads, self.head_dim)
        v = flat.index_select(0, rows + self.block_size).view(b, length, self.num_kv_heads, self.head_dim)
        return k.transpose(1, 2), v.transpose(1, 2)

    def _decode(self, q: torch.Tensor, flat: torch.Tensor, meta: TorchAttentionMetadata) -> torch.Tensor:
        b, kvh, d = q.shape[0], self.num_kv_heads, self.head_dim
        k, v = self._gather_kv(flat, meta.dec_k_rows, b, meta.dec_len)
        # [Bd, heads, d] -> [Bd, kv_heads, group, d]: the group rides on the query-length axis.
        qg = q.view(b, kvh, self.num_heads // kvh, d)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=meta.dec_mask, scale=self.scale)
        return out.reshape(b, self.num_heads, d)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flat: torch.Tensor,
                 meta: TorchAttentionMetadata) -> torch.Tensor:
        b, q_max, h, d = meta.num_prefills, meta.pre_q_len, self.num_heads, self.head_dim
        padded = b * q_max != q.shape[0]
        qp = (q.index_select(0, meta.pre_q_index) if padded else q).view(b, q_max, h, d).transpose(1, 2)
        if meta.pre_k_rows is None:  # no cached context: causal over this step's own keys
            if padded:
                k = k.index_select(0, meta.pre_q_index)
                v = v.index_select(0, meta.pre_q_index)
            kp = k.view(b, q_max, self.num_kv_heads, d).transpose(1, 2)
            vp = v.view(b, q_max, self.num_kv_heads, d).transpose(1, 2)
            out = self._sdpa(qp, kp, vp, mask=None)
        else:
            kp, vp = self._gather_kv(flat, meta.pre_k_rows, b, meta.pre_len)
            out = self._sdpa(qp, kp, vp, mask=meta.pre_mask)
        out = out.transpose(1, 2).reshape(b * q_max, h, d)  # [Bp * Qmax, heads, d]
        return out.index_select(0, meta.pre_out_index) if padded else out

    def _sdpa(self, q, k, v, mask):
        causal = mask is None
        if self.num_heads == self.num_kv_heads:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale)
        if _HAS_GQA:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale,
                                                  enable_gqa=True)
        group = self.num_heads // self.num_kv_heads
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1),
                                              v.repeat_interleave(group, dim=1), attn_mask=mask,
                                              is_causal=causal, scale=self.scale)
