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

from dataclasses import dataclass, field

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
    # Per-step scratch of the attention backend (index tensors, masks): derived from the
    # fields above by the first layer that needs them and reused by the other layers, so
    # that work is done once per iteration rather than once per layer. Never part of the
    # metadata's meaning; a fresh metadata starts empty.
    derived: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)
    # [T] int64 absolute position of every query token (k_len - q_len + j); set by `build`
    positions: torch.Tensor | None = field(default=None, repr=False, compare=False)

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
        """Builds the metadata from host lists (decodes first, then prefills).

        Vectorized: the per-token slot mapping is computed with tensor ops on the padded
        block table, with no Python loop over tokens.
        """
        num_seqs = len(q_lens)
        if not (num_seqs == len(k_lens) == len(block_tables)):
            raise ValueError("q_lens, k_lens and block_tables must have one entry per sequence")
        num_decodes = 0
        for q in q_lens:
            if q != 1:
                break
            num_decodes += 1
        table_lens = [len(t) for t in block_tables]
        for q, k, n in zip(q_lens, k_lens, table_lens):
            if k < q:
                raise ValueError(f"k_len {k} < q_len {q}")
            if (k + block_size - 1) // block_size > n:
                raise ValueError(f"block table of {n} blocks too short for {k} tokens")
        max_blocks = max(table_lens, default=0)
        # one flat list, then a single tensor conversion (per sequence, not per token)
        padded: list[int] = []
        for t, n in zip(block_tables, table_lens):
            padded.extend(t)
            if n < max_blocks:
                padded.extend([0] * (max_blocks - n))
        tables = torch.tensor(padded, dtype=torch.int32).reshape(num_seqs, max_blocks)
        if num_decodes == num_seqs:
            # decodes only (one token each): positions and slots straight from the host
            # lists, a few scalar ops per sequence instead of ~10 small tensor ops
            pos = [k - 1 for k in k_lens]
            slot_list = [
                t[p // block_size] * block_size + p % block_size
                for t, p in zip(block_tables, pos, strict=True)
            ]
            return AttentionMetadata(
                cu_seqlens_q=torch.arange(num_seqs + 1, dtype=torch.int32).to(device),
                seq_lens_k=torch.tensor(k_lens, dtype=torch.int32).to(device),
                block_tables=tables.to(device),
                slot_mapping=torch.tensor(slot_list, dtype=torch.int64).to(device),
                max_seqlen_q=1 if num_seqs else 0,
                max_seqlen_k=max(k_lens, default=0),
                num_decodes=num_decodes,
                q_lens=list(q_lens),
                k_lens=list(k_lens),
                positions=torch.tensor(pos, dtype=torch.int64).to(device),
            )
        q_t = torch.tensor(q_lens, dtype=torch.int64)  # [B]
        k_t = torch.tensor(k_lens, dtype=torch.int64)  # [B]
        positions = token_positions(q_t, k_t)  # [T]
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), q_t)  # [T]
        if positions.numel():
            block = tables[seq_of_token, positions // block_size].to(torch.int64)
            slots = block * block_size + positions % block_size  # [T]
        else:
            slots = torch.zeros(0, dtype=torch.int64)
        cu = torch.zeros(num_seqs + 1, dtype=torch.int32)
        torch.cumsum(q_t, 0, out=cu[1:])
        return AttentionMetadata(
            cu_seqlens_q=cu.to(device),
            seq_lens_k=k_t.to(device=device, dtype=torch.int32),
            block_tables=tables.to(device),
            slot_mapping=slots.to(device),
            max_seqlen_q=max(q_lens, default=0),
            max_seqlen_k=max(k_lens, default=0),
            num_decodes=num_decodes,
            q_lens=list(q_lens),
            k_lens=list(k_lens),
            positions=positions.to(device),
        )


def token_positions(q_lens: torch.Tensor, k_lens: torch.Tensor) -> torch.Tensor:
    """Absolute position of every packed query token: [T] int64.

    q_lens, k_lens: [B] int64. Sequence i contributes positions k_i - q_i .. k_i - 1.
    """
    total = int(q_lens.sum())
    starts = k_lens - q_lens  # [B] first position of each sequence's queries
    cu = torch.cumsum(q_lens, 0) - q_lens  # [B] offset of each sequence in the packed axis
    # token j of the packed axis belongs to sequence i: position = starts_i + (j - cu_i)
    shift = torch.repeat_interleave(starts - cu, q_lens, output_size=total)  # [T]
    return torch.arange(total, dtype=torch.int64) + shift
