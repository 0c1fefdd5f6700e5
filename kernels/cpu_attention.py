"""Paged attention for CPUs with native kernels (kernels/csrc/cpu_attention.c, wrapped in
sarazmq.kernels.cpu_attention_kernels).

Decodes read their K/V straight from the paged cache once, with an online softmax, in a
small OpenMP C kernel: no gathered copy of the KV (the torch backend's `index_select`)
and no per-group SDPA calls. Memory traffic, not math, bounds decode attention, so
reading the cache once is most of the win. bf16 prefill chunks on CPUs with AVX512-BF16
also run natively (`prefill_attention`: causal, over the cached context and the chunk in
one pass): on CPUs with AMX the matmuls on the tiles (kernels/csrc/prefill_amx.c), which
beats SDPA's CPU kernel (its bf16 matmuls on the tiles too, but the chunk and its context
as two calls merged by log-sum-exp); on CPUs with only AVX512-BF16 VDPBF16PS dot
products, faster than SDPA there (which computes bf16 in float32). Where AMX is present
but the kernel cannot use it, SDPA stays (it beats the VDPBF16PS kernel on AMX CPUs).
float32 chunks run natively on CPUs with AVX2 and FMA, 16 lanes with AVX-512
(prefill_attention_f32.c: SDPA's CPU kernel computes the whole causal square of a chunk of
up to 512 keys, and takes the chunk and its context as two calls). Numbers:
docs/KERNELS.md, "CPU attention". Falls back to the torch path entirely when the kernels
cannot be built (no C compiler) or a shape is beyond their limits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .cpu_attention_kernels import (
    cpu_attention_available,
    gather_blocks_native,
    paged_decode_attention,
    prefill_amx_available,
    prefill_attention,
    prefill_f32_available,
    prefill_int8_available,
    prefill_scratch_elems,
    write_kv_cache_native,
)
from .cpu_ops import TORCH_OPS, HotOps, NativeCpuOps
from .decode_step import DecodeLayerWeights, FusedDecodeStep, StepSizes
from .hybrid_step import HybridStep, hybrid_step_kind
from .kv_int8 import (
    INT8_SCALE_BYTES,
    dequantize_kv_blocks_native,
    is_int8_cache,
    write_kv_int8_native,
)
from .metadata import AttentionMetadata
from .native import cpu_has_flag
from .torch_attention import _DECODE_GROUP_BYTES, TorchPagedAttention

# SDPA's CPU flash kernel, which also returns the log-sum-exp of each query row: what
# merging two partial attentions needs (see CpuPagedAttention._chunk_with_context)
_SDPA_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


class CpuPagedAttention(TorchPagedAttention):
    """The torch backend with decodes (and the KV cache writes) through the native kernels
    (see module docstring)."""

    name = "cpu"

    def __init__(
        self, decode_group_bytes: int = _DECODE_GROUP_BYTES, native_prefill: bool | None = None
    ) -> None:
        """native_prefill: prefill chunks through the native kernels (True) or SDPA (False);
        None: the native kernel where it is the faster one (module docstring)."""
        super().__init__(decode_group_bytes)
        if native_prefill is None:
            native_prefill = prefill_amx_available() or not cpu_has_flag("amx_bf16")
        self.native_prefill = native_prefill
        # int8 caches: each chunk's context blocks dequantized to its dtype ("k", "v")
        self._dequant_buffers: dict[str, torch.Tensor] = {}
        # the model takes its fused elementwise ops and matmuls from here
        self.ops: HotOps
        try:
            self.ops = NativeCpuOps()
        except ValueError:
            self.ops = TORCH_OPS

    def fused_decode_step(
        self,
        layers: Sequence[DecodeLayerWeights],
        final_norm: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        sizes: StepSizes,
    ) -> FusedDecodeStep | None:
        """A Llama model's whole decode step in one native call (see
        `sarazmq.kernels.decode_step`), running the kernels this backend and its `ops` run
        per op; None where it cannot be built (no native kernels, a tensor that does not
        fit)."""
        if not isinstance(self.ops, NativeCpuOps):
            return None
        try:
            return FusedDecodeStep(
                layers,
                final_norm,
                kv_caches,
                sizes,
            )
        except ValueError:
            return None

    def hybrid_step(
        self,
        layers: Sequence[DecodeLayerWeights],
        final_norm: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        sizes: StepSizes,
    ) -> HybridStep | None:
        """A Llama model's hybrid iteration in one native call (see
        `sarazmq.kernels.hybrid_step`) where this backend's per-op path runs exactly its
        kernels: matmuls on AMX tiles (`ops.reads_tiles`) with bf16 prefill chunks through
        the AMX prefill kernel, or Q4 int8 panels with float32 chunks through the float32
        prefill kernel; None elsewhere or where a tensor does not fit."""
        kind = hybrid_step_kind(layers)
        if not (isinstance(self.ops, NativeCpuOps) and self.native_prefill):
            return None
        if kind == "tiles" and not (self.ops.reads_tiles and prefill_amx_available()):
            return None
        if kind == "int8" and not prefill_f32_available():
            return None
        try:
            return HybridStep(
                layers,
                final_norm,
                kv_caches,
                sizes,
            )
        except ValueError:
            return None

    def _write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if is_int8_cache(k_cache):
            written = write_kv_int8_native(k, v, k_cache, v_cache, slot_mapping)
        else:
            written = write_kv_cache_native(k, v, k_cache, v_cache, slot_mapping)
        if not written:
            super()._write_kv(k, v, k_cache, v_cache, slot_mapping)

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
        k_len = meta.k_lens[i]
        if not self.native_prefill or not cpu_attention_available():
            return False
        if q.dtype != torch.bfloat16 and not (q.dtype == torch.float32 and prefill_f32_available()):
            return False
        bs = k_cache.shape[1]
        table = meta.block_tables[i, : -(-k_len // bs)]
        if is_int8_cache(k_cache) and not (q.dtype == torch.float32 and prefill_int8_available()):
            # (float32 queries on AVX512-VNNI read the int8 cache in place.) The
            # sequence's blocks dequantized, in order: the kernel reads them as a cache of
            # their own (blocks 0 .. n-1)
            k_cache = self._dequantized("k", k_cache, table, q.dtype)
            v_cache = self._dequantized("v", v_cache, table, q.dtype)
            table = torch.arange(table.numel(), dtype=torch.int32)
        # scratch in q's dtype (rows of q's token size), enough for the packed K/V
        need, row = prefill_scratch_elems(k_len, k_cache.shape[2], q.shape[2]), q[0].numel()
        scratch = self._scratch_rows("packed", q, -(-need // row)).view(-1)
        return prefill_attention(q, k_cache, v_cache, table, k_len, scale, out, scratch)

    def _dequantized(
        self, which: str, cache: torch.Tensor, table: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """An int8 cache's blocks `table` (int32) in `dtype`: for bf16 and float32 in C into
        the reusable buffer `which` of that dtype (the scratch buffers are in the cache's
        dtype), else torch's `_gather` (a new tensor)."""
        n, (_, block_size, hkv, row) = table.numel(), cache.shape
        if dtype in (torch.bfloat16, torch.float32):
            shape = (n, block_size, hkv, row - INT8_SCALE_BYTES)
            elems = math.prod(shape)
            buf = self._dequant_buffers.get(which)
            if buf is None or buf.numel() < elems or buf.dtype != dtype:
                buf = self._dequant_buffers[which] = torch.empty(elems, dtype=dtype)
            out = buf[:elems].view(shape)
            if dequantize_kv_blocks_native(cache, table.contiguous(), out):
                return out
        return self._gather(which, cache, table.to(torch.long), dtype)

    def _gather_native(self, which: str, cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """cache[blocks] ([n, block_size, Hkv, D]) into the reusable buffer `which`."""
        out = self._scratch_rows(which, cache, blocks.numel())
        gather_blocks_native(cache, blocks, out)
        return out.view(out.shape[0], *cache.shape[1:])  # [n, block_size, Hkv, D]

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
        """The chunk's attention as two unmasked-or-causal parts merged by log-sum-exp.

        The reference gathers all k_len keys and runs SDPA with a [q_len, k_len] additive
        mask, which computes every masked score too. Here: (1) the cached context (all
        keys before the chunk, no mask needed; the query heads of a KV head folded into
        its rows, so no K/V repeat), (2) the chunk over its own fresh k/v with
        is_causal=True (half the scores skipped, nothing gathered), then
        out = (o1 e^{lse1} + o2 e^{lse2}) / (e^{lse1} + e^{lse2}), in float32.
        """
        q_len, k_len = meta.q_lens[i], meta.k_lens[i]
        ctx = k_len - q_len
        if (
            not cpu_attention_available()
            or _SDPA_WITH_LSE is None
            or qi.device.type != "cpu"
            or k_cache.dtype != qi.dtype
            or not k_cache.is_contiguous()
        ):
            return super()._chunk_with_context(qi, k_new, v_new, k_cache, v_cache, meta, i, scale)
        _, h, _, d = qi.shape
        bs, hkv = k_cache.shape[1], k_cache.shape[2]
        g = h // hkv
        blocks = meta.block_tables[i, : -(-ctx // bs)].contiguous()  # int32
        kc = self._gather_native("k", k_cache, blocks).flatten(0, 1)[:ctx]
        vc = self._gather_native("v", v_cache, blocks).flatten(0, 1)[:ctx]
        # (1) context: [1, Hkv, G * q_len, D] queries against [1, Hkv, ctx, D] keys
        q_fold = qi.reshape(1, hkv, g * q_len, d)
        o1, lse1 = _SDPA_WITH_LSE(
            q_fold,
            kc.transpose(0, 1).unsqueeze(0),
            vc.transpose(0, 1).unsqueeze(0),
            0.0,
            False,
            scale=scale,
        )
        # (2) the chunk itself, causal (GQA handled by the kernel)
        o2, lse2 = _SDPA_WITH_LSE(
            qi,
            k_new.transpose(0, 1).unsqueeze(0),  # [1, Hkv, q_len, D]
            v_new.transpose(0, 1).unsqueeze(0),
            0.0,
            True,
            scale=scale,
        )
        lse1 = lse1.reshape(1, h, q_len, 1)
        lse2 = lse2.reshape(1, h, q_len, 1)
        m = torch.maximum(lse1, lse2)
        w1 = (lse1 - m).exp_()
        w2 = (lse2 - m).exp_()
        merged = o1.reshape(1, h, q_len, d).float().mul_(w1).add_(o2.float().mul_(w2))
        return merged.div_(w1.add_(w2)).to(qi.dtype)  # [1, H, q_len, D]

    def _decodes(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        nd = q.shape[0]
        out = paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens_k[:nd], scale
        )
        if out is None:
            return super()._decodes(q, k_cache, v_cache, meta, scale)
        return out
