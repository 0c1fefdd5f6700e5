"""Paged attention in plain PyTorch (any device), plus the explicit-mask reference.

The torch backend is the portable one: CPU runs and CUDA without flash-attn. It batches
all decodes of a hybrid batch into one SDPA call over KV gathered through the block
tables, and runs each prefill chunk separately with a causal mask offset by its
already-cached context (chunked prefill).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .cpu_ops import TORCH_OPS, HotOps
from .kv_int8 import dequantize_kv_rows, is_int8_cache, quantize_kv_rows
from .metadata import AttentionMetadata

if TYPE_CHECKING:
    from .decode_step import DecodeLayerWeights, FusedDecodeStep, StepSizes
    from .hybrid_step import HybridStep

#: the SDPA kernels the torch backend lets run on CUDA (not cuDNN's: see `forward`)
_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


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
    int8 caches ([..., D + 4], `sarazmq.kernels.kv_int8`) get the quantized rows.
    """
    if k.shape[0] == 0:
        return
    hkv, d = k_cache.shape[-2], k_cache.shape[-1]
    if is_int8_cache(k_cache):
        k, v = quantize_kv_rows(k), quantize_kv_rows(v)
    # view (not reshape): the write must land in the cache storage itself
    k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, k_len: int) -> torch.Tensor:
    """Contiguous [k_len, Hkv, D] keys (or values) of one sequence from its block table."""
    block_size = cache.shape[1]
    num_blocks = (k_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].to(torch.long)
    return _gather_blocks(cache, blocks).flatten(0, 1)[:k_len]  # [k_len, Hkv, D]


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache[blocks] ([n, block_size, Hkv, D]) as one row gather of whole blocks.

    `index_select` on the cache viewed as [num_blocks, block_size * Hkv * D] copies each
    block as one contiguous row, several times faster than advanced indexing of the 4-d
    cache (which goes element by element).
    """
    return cache.flatten(1).index_select(0, blocks).view(-1, *cache.shape[1:])


def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # 0 where attending is allowed, -inf elsewhere: SDPA adds it to the scores directly
    # (a boolean mask is converted to this form inside every call)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )


# gathered K+V bytes per group of decodes (about an L2 cache; see `_decodes`)
_DECODE_GROUP_BYTES = 6 * 1024 * 1024


class TorchPagedAttention:
    """Paged attention with `F.scaled_dot_product_attention`.

    Decodes: one call for all of them, KV gathered block-wise through the block tables,
    the query heads sharing a KV head folded into that head's query rows (GQA without
    repeating K/V). Prefill chunks: one call each, causal (fresh prompt) or with a mask
    offset by the cached context (later chunk). Always 4-d inputs: 3-d inputs with
    `enable_gqa` fall back to SDPA's slow math path on CPU. Index tensors and masks are
    built by the first layer and reused by the others through `meta.derived`.
    """

    name = "torch"
    cuda_graph_safe = False  # per-sequence loops over the metadata's host lists
    # the model's other ops: plain PyTorch (CpuPagedAttention has C ones)
    ops: HotOps = TORCH_OPS

    def __init__(self, decode_group_bytes: int = _DECODE_GROUP_BYTES) -> None:
        if decode_group_bytes < 1:
            raise ValueError(f"decode_group_bytes={decode_group_bytes} must be >= 1")
        self.decode_group_bytes = decode_group_bytes
        # Reused gather destinations for K and V (layers run one after another, so one
        # pair serves them all): a fresh multi-MB tensor per layer costs page faults and
        # cache misses that are as slow as the gather itself.
        self._scratch: dict[str, torch.Tensor] = {}

    def _scratch_rows(self, which: str, cache: torch.Tensor, n: int) -> torch.Tensor:
        """[n, block elements] view of the reusable buffer `which` ("k" or "v"), grown as
        needed, in the cache's dtype and device."""
        row = cache[0].numel()
        buf = self._scratch.get(which)
        if (
            buf is None
            or buf.dtype != cache.dtype
            or buf.device != cache.device
            or buf.numel() < n * row
        ):
            buf = torch.empty(max(n * row, 1), dtype=cache.dtype, device=cache.device)
            self._scratch[which] = buf
        return buf[: n * row].view(n, row)

    def _gather(
        self, which: str, cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """`_gather_blocks` into the reusable buffer `which` ("k" or "v"); an int8 cache's
        rows dequantized into `dtype` (a new tensor)."""
        out = self._scratch_rows(which, cache, blocks.numel())
        torch.index_select(cache.flatten(1), 0, blocks, out=out)
        gathered = out.view(out.shape[0], *cache.shape[1:])  # [n, block_size, Hkv, D]
        return dequantize_kv_rows(gathered, dtype) if is_int8_cache(cache) else gathered

    def _write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        write_kv_cache(k, v, k_cache, v_cache, slot_mapping)

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
        self._write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if q.is_cuda:
            # cuDNN's attention failed on an H200 on these strided views (torch 2.11,
            # docs/GPU.md): the flash, memory-efficient and math kernels only
            with sdpa_kernel(_CUDA_SDPA_BACKENDS):
                return self._attend(q, k, v, k_cache, v_cache, meta, scale)
        return self._attend(q, k, v, k_cache, v_cache, meta, scale)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """`forward` once this step's k/v are in the caches."""
        nd = meta.num_decodes
        if 0 < nd == meta.num_seqs == q.shape[0]:
            return self._decodes(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)  # [T, H, D]
        if nd > 0:
            out[:nd] = self._decodes(q[:nd], k_cache, v_cache, meta, scale)

        start = nd  # decodes occupy the first nd tokens
        for i in range(nd, meta.num_seqs):
            q_len, k_len = meta.q_lens[i], meta.k_lens[i]
            end = start + q_len
            if self._prefill_into(out[start:end], q[start:end], k_cache, v_cache, meta, i, scale):
                start = end
                continue
            qi = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            if k_len == q_len and not is_int8_cache(k_cache):
                # no earlier context: this chunk's own k/v are the whole sequence (an int8
                # cache's chunk reads its quantized k/v back, as every other step does)
                ki = k[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hkv, k_len, D]
                vi = v[start:end].transpose(0, 1).unsqueeze(0)
                oi = F.scaled_dot_product_attention(
                    qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True
                )
            else:
                oi = self._chunk_with_context(
                    qi, k[start:end], v[start:end], k_cache, v_cache, meta, i, scale
                )
            out[start:end] = oi[0].transpose(0, 1)
            start = end
        return out

    def fused_decode_step(
        self,
        layers: Sequence[DecodeLayerWeights],
        final_norm: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        sizes: StepSizes,
    ) -> FusedDecodeStep | None:
        """None: decode steps run op by op here (see `AttentionBackend.fused_decode_step`)."""
        return None

    def hybrid_step(self, *args: Any, **kwargs: Any) -> HybridStep | None:
        """None: hybrid iterations run op by op here (see `AttentionBackend.hybrid_step`)."""
        return None

    def _prefill_into(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        i: int,
        scale: float,
    ) -> bool:
        """Hook for a backend's own prefill kernel: attends prefill chunk i (q: [q_len, H, D],
        its K/V already in the cache) into out ([q_len, H, D]) and returns True, or returns
        False to take the SDPA path below. Here: always False."""
        return False

    def _chunk_with_context(
        self,
        qi: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        i: int,
        scale: float,
    ) -> torch.Tensor:
        """Prefill chunk i over its cached context plus itself (causal within the chunk).

        qi: [1, H, q_len, D]; k_new, v_new: [q_len, Hkv, D] (already in the cache too).
        Returns [1, H, q_len, D]. Here: all k_len keys gathered, one SDPA call with an
        additive mask offset by the context.
        """
        k_len = meta.k_lens[i]
        blocks, mask = self._chunk_index(meta, i, k_cache.shape[1], qi.dtype)
        ki = self._gather("k", k_cache, blocks, qi.dtype).flatten(0, 1)[:k_len]  # [k_len, Hkv, D]
        vi = self._gather("v", v_cache, blocks, qi.dtype).flatten(0, 1)[:k_len]
        return F.scaled_dot_product_attention(
            qi,
            ki.transpose(0, 1).unsqueeze(0),  # [1, Hkv, k_len, D]
            vi.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )

    def _decodes(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention of the first nd (single-token) sequences: q [nd, H, D] -> [nd, H, D]."""
        nd, h, d = q.shape
        hkv = k_cache.shape[2]
        block_size = k_cache.shape[1]
        derived = meta.derived
        max_k = max(meta.k_lens[:nd])
        blocks = derived.get("decode_blocks")
        if blocks is None:
            nblk = (max_k + block_size - 1) // block_size
            blocks = meta.block_tables[:nd, :nblk].to(torch.long).reshape(-1)  # [nd * nblk]
            derived["decode_blocks"] = blocks
            if any(kl != max_k for kl in meta.k_lens[:nd]):
                lens = meta.seq_lens_k[:nd].to(device=q.device, dtype=torch.long)
                allowed = torch.arange(max_k, device=q.device)[None, :] < lens[:, None]
                derived["decode_mask"] = _additive_mask(allowed, q.dtype)[:, None, None, :]
        mask = derived.get("decode_mask")  # [nd, 1, 1, max_k], None when no padding
        nblk = blocks.numel() // nd
        # Sequences go in groups whose gathered K+V fit in the L2 cache: SDPA then reads
        # the copies from cache instead of memory, and the reused scratch never needs
        # writing back (memory traffic, not math, bounds decode attention).
        per_seq = 2 * nblk * k_cache[0].numel() * k_cache.element_size()
        group = max(1, self.decode_group_bytes // per_seq)
        out = q.new_empty(nd, hkv, h // hkv, d) if group < nd else None
        for s in range(0, nd, group):
            e = min(nd, s + group)
            sel = blocks[s * nblk : e * nblk]
            kd = self._gather("k", k_cache, sel, q.dtype).view(e - s, -1, hkv, d)[:, :max_k]
            vd = self._gather("v", v_cache, sel, q.dtype).view(e - s, -1, hkv, d)[:, :max_k]
            # the h // hkv query heads of one KV head become that head's query rows
            og = F.scaled_dot_product_attention(
                q[s:e].view(e - s, hkv, h // hkv, d),  # [n, Hkv, G, D]
                kd.transpose(1, 2),  # [n, Hkv, max_k, D]
                vd.transpose(1, 2),
                attn_mask=None if mask is None else mask[s:e],
                scale=scale,
            )
            if out is None:
                return og.reshape(nd, h, d)
            out[s:e] = og
        return out.view(nd, h, d)

    @staticmethod
    def _chunk_index(
        meta: AttentionMetadata, i: int, block_size: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ids and additive mask [q_len, k_len] of prefill chunk i (cached per step)."""
        key = f"chunk{i}"
        blocks = meta.derived.get(key + "_blocks")
        mask = meta.derived.get(key + "_mask")
        if blocks is None or mask is None:
            q_len, k_len = meta.q_lens[i], meta.k_lens[i]
            nblk = (k_len + block_size - 1) // block_size
            device = meta.block_tables.device
            blocks = meta.block_tables[i, :nblk].to(torch.long)
            # query j sits at absolute position k_len - q_len + j, sees keys <= it
            qpos = torch.arange(k_len - q_len, k_len, device=device)
            kpos = torch.arange(k_len, device=device)
            mask = _additive_mask(kpos[None, :] <= qpos[:, None], dtype)  # [q_len, k_len]
            meta.derived[key + "_blocks"] = blocks
            meta.derived[key + "_mask"] = mask
        return blocks, mask


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
