"""Paged attention in plain PyTorch (any device), plus the explicit-mask reference.

The torch backend is the portable one: CPU runs and CUDA without flash-attn. It batches
all decodes of a hybrid batch into one SDPA call over KV gathered through the block
tables, and runs each prefill chunk separately with a causal mask offset by its
already-cached context (chunked prefill).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatters this step's k/v [T, Hkv, D] into the paged caches at slot_mapping [T].

    Caches are [num_blocks, block_size, Hkv, D]; slot s is row s of the cache viewed as
    [num_blocks * block_size, Hkv, D] (block s // block_size, offset s % block_size).
    """
    if k.shape[0] == 0:
        return
    hkv, d = k_cache.shape[-2], k_cache.shape[-1]
    # view (not reshape): the write must land in the cache storage itself
    k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, k_len: int) -> torch.Tensor:
    """Contiguous [k_len, Hkv, D] keys (or values) of one sequence from its block table."""
    block_size = cache.shape[1]
    num_blocks = (k_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].to(torch.long)
    return cache.index_select(0, blocks).flatten(0, 1)[:k_len]  # [k_len, Hkv, D]


class TorchPagedAttention:
    """Paged attention with `F.scaled_dot_product_attention` (GQA via enable_gqa)."""

    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Writes k/v to the caches, then attends.

        q: [T, H, D]; k, v: [T, Hkv, D] (new tokens, packed like q);
        k_cache, v_cache: [num_blocks, block_size, Hkv, D]. Returns [T, H, D].
        """
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)  # [T, H, D]
        nd = meta.num_decodes
        block_size = k_cache.shape[1]

        if nd > 0:
            # all decodes in one call: gather their KV padded to the longest, mask the tail
            max_k = max(meta.k_lens[:nd])
            nblk = (max_k + block_size - 1) // block_size
            tables = meta.block_tables[:nd, :nblk].to(torch.long)  # [nd, nblk]
            kd = k_cache[tables].flatten(1, 2)[:, :max_k]  # [nd, max_k, Hkv, D]
            vd = v_cache[tables].flatten(1, 2)[:, :max_k]
            key_pos = torch.arange(max_k, device=q.device)
            lens = meta.seq_lens_k[:nd].to(device=q.device, dtype=torch.long)
            mask = (key_pos[None, :] < lens[:, None])[:, None, None, :]  # [nd, 1, 1, max_k]
            od = F.scaled_dot_product_attention(
                q[:nd].unsqueeze(2),  # [nd, H, 1, D]
                kd.transpose(1, 2),  # [nd, Hkv, max_k, D]
                vd.transpose(1, 2),
                attn_mask=mask,
                scale=scale,
                enable_gqa=True,
            )
            out[:nd] = od.squeeze(2)

        start = nd  # decodes occupy the first nd tokens
        for i in range(nd, meta.num_seqs):
            q_len, k_len = meta.q_lens[i], meta.k_lens[i]
            end = start + q_len
            qi = q[start:end].transpose(0, 1)  # [H, q_len, D]
            if k_len == q_len:
                # no earlier context: this chunk's own k/v are the whole sequence
                ki = k[start:end].transpose(0, 1)  # [Hkv, k_len, D]
                vi = v[start:end].transpose(0, 1)
                oi = F.scaled_dot_product_attention(
                    qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True
                )
            else:
                table = meta.block_tables[i]
                ki = gather_kv(k_cache, table, k_len).transpose(0, 1)  # [Hkv, k_len, D]
                vi = gather_kv(v_cache, table, k_len).transpose(0, 1)
                # query j sits at absolute position k_len - q_len + j, sees keys <= it
                qpos = torch.arange(k_len - q_len, k_len, device=q.device)
                kpos = torch.arange(k_len, device=q.device)
                mask = kpos[None, :] <= qpos[:, None]  # [q_len, k_len]
                oi = F.scaled_dot_product_attention(
                    qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True
                )
            out[start:end] = oi.transpose(0, 1)
            start = end
        return out


def reference_attention(
    q: torch.Tensor,
    k_full_list: list[torch.Tensor],
    v_full_list: list[torch.Tensor],
    q_lens: list[int],
    k_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Straightforward attention over contiguous per-sequence K/V (for tests).

    q: [T, H, D] packed; k_full_list[i], v_full_list[i]: [k_lens[i], Hkv, D], the whole
    KV of sequence i (earlier context + this chunk). Query j of sequence i is at absolute
    position k_lens[i] - q_lens[i] + j and sees keys 0..that position. Computed in
    float32 with an explicit mask and softmax; returns [T, H, D] in q's dtype.
    """
    outs = []
    start = 0
    h = q.shape[1]
    for kf, vf, q_len, k_len in zip(k_full_list, v_full_list, q_lens, k_lens, strict=True):
        qi = q[start : start + q_len].float()  # [q_len, H, D]
        rep = h // kf.shape[1]
        ki = kf.float().repeat_interleave(rep, dim=1)  # [k_len, H, D]
        vi = vf.float().repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale  # [H, q_len, k_len]
        qpos = torch.arange(k_len - q_len, k_len)[:, None]
        kpos = torch.arange(k_len)[None, :]
        scores = scores.masked_fill(~(kpos <= qpos), float("-inf"))
        probs = scores.softmax(dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vi))  # [q_len, H, D]
        start += q_len
    if not outs:
        return q.new_empty(q.shape)
    return torch.cat(outs, dim=0).to(q.dtype)
