"""Attention metadata for one hybrid batch, shared by every attention backend.

Layout conventions (all backends rely on them):
- Queries of all scheduled sequences are packed along one token axis T.
- Sequences are ordered decodes first (q_len == 1), then prefill chunks; the first
  `num_decodes` sequences are decodes. This lets the torch backend batch all decodes
  in one call without padding prefills.
- The KV cache of one layer is a pair of tensors k_cache, v_cache, each
  [num_blocks, block_size, num_kv_heads, head_dim]; token slot s lives at
  block s // block_size, offset s % block_size (flash-attn's paged layout).
- New K/V of this step are written to the cache by `slot_mapping` before attending,
  so each sequence attends over k_len = (tokens computed before) + q_len keys, and
  query i of a sequence sits at absolute position k_len - q_len + i (causal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-iteration metadata, built once per step and shared by all layers."""

    cu_seqlens_q: torch.Tensor  # [B + 1] int32, prefix sums of q_lens
    seq_lens_k: torch.Tensor  # [B] int32, KV length of each sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64, cache slot of every new token
    max_seqlen_q: int
    max_seqlen_k: int
    num_decodes: int  # the first num_decodes sequences have q_len == 1
    q_lens: list[int]  # host copies (no device sync to read them)
    k_lens: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.q_lens))

    @staticmethod
    def build(
        q_lens: list[int],
        k_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Builds the metadata from host lists (decodes first, then prefills)."""
        if not (len(q_lens) == len(k_lens) == len(block_tables)):
            raise ValueError("q_lens, k_lens and block_tables must have one entry per sequence")
        num_decodes = 0
        for q in q_lens:
            if q != 1:
                break
            num_decodes += 1
        slots: list[int] = []
        for q, k, table in zip(q_lens, k_lens, block_tables):
            if k < q:
                raise ValueError(f"k_len {k} < q_len {q}")
            if (k + block_size - 1) // block_size > len(table):
                raise ValueError(f"block table of {len(table)} blocks too short for {k} tokens")
            for pos in range(k - q, k):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        cu = [0]
        for q in q_lens:
            cu.append(cu[-1] + q)
        return AttentionMetadata(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            seq_lens_k=torch.tensor(k_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(
                len(block_tables), max_blocks
            ),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_seqlen_q=max(q_lens, default=0),
            max_seqlen_k=max(k_lens, default=0),
            num_decodes=num_decodes,
            q_lens=list(q_lens),
            k_lens=list(k_lens),
        )
