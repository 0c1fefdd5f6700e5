"""Paged attention for CPUs with native kernels (kernels/csrc/cpu_attention.c).

Decodes read their K/V straight from the paged cache once, with an online softmax, in a
small OpenMP C kernel: no gathered copy of the KV (the torch backend's `index_select`)
and no per-group SDPA calls. Memory traffic, not math, bounds decode attention, so
reading the cache once is most of the win. bf16 prefill chunks on CPUs with AVX512-BF16
also run natively (`prefill_attention`: causal, over the cached context and the chunk in
one pass, VDPBF16PS dot products; about 2x SDPA's CPU kernel, which computes bf16 in
float32, on AVX512-BF16 CPUs without AMX). On CPUs with AMX, SDPA's kernel runs its bf16
matmuls on the AMX tiles, and the backend keeps it (the native kernel was not measured
there). float32 chunks keep the SDPA path (context and chunk merged by log-sum-exp).
Falls back to the torch path entirely when the kernels cannot be built (no C compiler)
or a shape is beyond their limits.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from .cpu_ops import TORCH_OPS, HotOps, NativeCpuOps
from .decode_step import DecodeLayerWeights, FusedDecodeStep
from .metadata import AttentionMetadata
from .native import cpu_has_flag, load_library
from .torch_attention import _DECODE_GROUP_BYTES, TorchPagedAttention

_c_long, _c_int, _c_float, _c_void_p = ctypes.c_long, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_ARGTYPES = [
    _c_void_p,  # q
    _c_long,  # q token stride (elements)
    _c_void_p,  # k_cache
    _c_void_p,  # v_cache
    _c_void_p,  # block tables (int32)
    _c_long,  # block table row stride
    _c_void_p,  # seq lens (int32)
    _c_void_p,  # out
    _c_int,  # nd
    _c_int,  # H
    _c_int,  # Hkv
    _c_int,  # D
    _c_int,  # block_size
    _c_float,  # scale
    _c_long,  # num_blocks of the cache (block ids are checked against it)
]


_PREFILL_ARGTYPES = [
    _c_void_p,  # q
    _c_long,  # q token stride (elements)
    _c_void_p,  # k_cache
    _c_void_p,  # v_cache
    _c_void_p,  # the sequence's block table (int32)
    _c_int,  # q_len
    _c_int,  # k_len
    _c_int,  # H
    _c_int,  # Hkv
    _c_int,  # D
    _c_int,  # block_size
    _c_float,  # scale
    _c_void_p,  # out
    _c_long,  # out token stride (elements)
    _c_long,  # num_blocks of the cache (block ids are checked against it)
    _c_void_p,  # scratch for the packed K/V
]

_WRITE_ARGTYPES = [
    _c_void_p,  # k
    _c_long,  # k token stride (elements)
    _c_void_p,  # v
    _c_long,  # v token stride
    _c_void_p,  # k_cache
    _c_void_p,  # v_cache
    _c_void_p,  # slots (int64)
    _c_long,  # num tokens
    _c_long,  # elements per row (Hkv * D)
    _c_long,  # element size in bytes
    _c_long,  # number of slots in the cache (slots are checked against it)
]


class _Kernels:
    """The C entry points of cpu_attention.c with their signatures, resolved once."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.decode: dict[torch.dtype, ctypes._CFuncPtr] = {}
        for dtype, sym in (
            (torch.float32, "paged_decode_attention_f32"),
            (torch.bfloat16, "paged_decode_attention_bf16"),
        ):
            fn = getattr(lib, sym)
            fn.argtypes = _ARGTYPES
            fn.restype = _c_int
            self.decode[dtype] = fn
        self.prefill_bf16 = lib.prefill_attention_bf16
        self.prefill_bf16.argtypes = _PREFILL_ARGTYPES
        self.prefill_bf16.restype = _c_int
        self.write_kv = lib.write_kv_cache
        self.write_kv.argtypes = _WRITE_ARGTYPES
        self.write_kv.restype = _c_int
        self.gather = lib.gather_blocks
        self.gather.argtypes = [_c_void_p, _c_long, _c_void_p, _c_long, _c_void_p, _c_long]
        self.gather.restype = _c_int


# SDPA's CPU flash kernel, which also returns the log-sum-exp of each query row: what
# merging two partial attentions needs (see CpuPagedAttention._chunk_with_context)
_SDPA_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

_kernels: list[_Kernels | None] = []  # [resolved kernels or None], filled on first use


def _get_kernels() -> _Kernels | None:
    if not _kernels:
        lib = load_library()
        _kernels.append(None if lib is None else _Kernels(lib))
    return _kernels[0]


def write_kv_cache_native(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """`torch_attention.write_kv_cache` in C; False (nothing written) when it does not apply.

    k, v: [T, Hkv, D] with heads and D contiguous (any token stride); caches contiguous
    [num_blocks, block_size, Hkv, D] of k's dtype; slot_mapping: [T] int64.
    """
    kernels = _get_kernels()
    t, hkv, d = k.shape
    if (
        kernels is None
        or k.device.type != "cpu"
        or not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype)
        or slot_mapping.dtype != torch.int64
        or not slot_mapping.is_contiguous()
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or k.stride()[1:] != (d, 1)
        or v.stride()[1:] != (d, 1)
    ):
        return False
    rc = kernels.write_kv(
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        t,
        hkv * d,
        k.element_size(),
        k_cache.numel() // (hkv * d),
    )
    if rc != 0:
        raise IndexError(
            f"KV cache slot out of range: a slot in slot_mapping is outside the cache's "
            f"{k_cache.numel() // (hkv * d)} slots"
        )
    return True


def cpu_attention_available() -> bool:
    """Whether the native kernels built (and SARAZMQ_NATIVE is not 0)."""
    return _get_kernels() is not None


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """Decode attention straight from the paged cache; None when the kernel does not apply.

    q: [nd, H, D] (token stride free, heads contiguous); k_cache, v_cache:
    [num_blocks, block_size, Hkv, D] contiguous; block_tables: [>= nd, max_blocks] int32;
    seq_lens: [>= nd] int32, keys per sequence (>= 1, this step's token already written).
    Returns [nd, H, D] in q's dtype.
    """
    kernels = _get_kernels()
    if kernels is None or q.device.type != "cpu":
        return None
    fn = kernels.decode.get(q.dtype)
    nd, h, d = q.shape
    if fn is None or k_cache.dtype != q.dtype or nd == 0:
        return None
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.int()
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.int()
    tables, lens = tables.contiguous(), lens.contiguous()
    out = torch.empty((nd, h, d), dtype=q.dtype)
    rc = fn(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.stride(0),
        lens.data_ptr(),
        out.data_ptr(),
        nd,
        h,
        k_cache.shape[2],
        d,
        k_cache.shape[1],
        scale,
        k_cache.shape[0],
    )
    if rc == -2:
        raise IndexError(
            f"decode attention: a sequence length or block id reaches outside the KV cache "
            f"({k_cache.shape[0]} blocks of {k_cache.shape[1]} tokens)"
        )
    return out if rc == 0 else None


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    k_len: int,
    scale: float,
    out: torch.Tensor,
    scratch: torch.Tensor | None = None,
) -> bool:
    """Causal attention of one prefill chunk over its whole sequence, read from the paged
    cache (bf16 on CPUs with AVX512-BF16, head size 64 or 128); False when the kernel does
    not apply and nothing was written.

    q: [q_len, H, D] (token stride free, heads contiguous), the queries at positions
    k_len - q_len .. k_len - 1; k_cache, v_cache: [num_blocks, block_size, Hkv, D]
    contiguous, holding all k_len keys (the chunk's own included); block_table: int32
    block ids of the sequence; out: [q_len, H, D] like q (token stride free);
    scratch: optional bf16 buffer of >= `prefill_scratch_elems` elements.
    """
    kernels = _get_kernels()
    if kernels is None or q.device.type != "cpu" or q.dtype != torch.bfloat16:
        return False
    q_len, h, d = q.shape
    if (
        k_cache.dtype != q.dtype
        or out.dtype != q.dtype
        or out.shape != q.shape
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or q.stride(2) != 1
        or q.stride(1) != d
        or out.stride(2) != 1
        or out.stride(1) != d
        or block_table.dtype != torch.int32
        or not block_table.is_contiguous()
    ):
        return False
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    if block_table.numel() * bs < k_len:
        raise IndexError(f"block table of {block_table.numel()} blocks is short for {k_len} keys")
    need = prefill_scratch_elems(k_len, hkv, d)
    if scratch is None or scratch.numel() < need or scratch.dtype != q.dtype:
        scratch = torch.empty(need, dtype=q.dtype)
    rc = kernels.prefill_bf16(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_table.data_ptr(),
        q_len,
        k_len,
        h,
        hkv,
        d,
        bs,
        scale,
        out.data_ptr(),
        out.stride(0),
        k_cache.shape[0],
        scratch.data_ptr(),
    )
    if rc == -2:
        raise IndexError(
            f"prefill attention: a block id reaches outside the KV cache "
            f"({k_cache.shape[0]} blocks)"
        )
    return rc == 0


def prefill_scratch_elems(k_len: int, num_kv_heads: int, head_dim: int) -> int:
    """Elements of the packed-K/V scratch `prefill_attention` needs: K and V of every KV
    head in runs of 16 keys."""
    return 2 * num_kv_heads * -(-k_len // 16) * 16 * head_dim


class CpuPagedAttention(TorchPagedAttention):
    """The torch backend with decodes (and the KV cache writes) through the native kernels
    (see module docstring)."""

    name = "cpu"

    def __init__(self, decode_group_bytes: int = _DECODE_GROUP_BYTES) -> None:
        super().__init__(decode_group_bytes)
        # bf16 prefill chunks: the native kernel, except where SDPA has AMX (module docstring)
        self._native_prefill = not cpu_has_flag("amx_bf16")
        # the model takes its fused elementwise ops from here (see LlamaForCausalLM.forward)
        self.ops: HotOps
        try:
            self.ops = NativeCpuOps()
        except ValueError:
            self.ops = TORCH_OPS

    def fused_decode_step(
        self,
        layers: Sequence[Sequence[torch.Tensor]],
        final_norm: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        **dims: Any,
    ) -> FusedDecodeStep | None:
        """A Llama model's whole decode step in one native call (see
        `sarazmq.kernels.decode_step`), running the kernels this backend and its `ops` run
        per op; None where it cannot be built (no native kernels, a tensor that does not
        fit). layers: per layer (input norm, qkv, o, post-attention norm, gate_up, down)
        weights; dims: num_heads, num_kv_heads, head_dim, eps, scale."""
        if not isinstance(self.ops, NativeCpuOps):
            return None
        try:
            return FusedDecodeStep(
                [DecodeLayerWeights(*w) for w in layers], final_norm, kv_caches, **dims
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
        if not write_kv_cache_native(k, v, k_cache, v_cache, slot_mapping):
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
        if q.dtype != torch.bfloat16 or not self._native_prefill or _get_kernels() is None:
            return False
        bs = k_cache.shape[1]
        table = meta.block_tables[i, : -(-k_len // bs)]
        # scratch rows are cache-block rows; enough of them for the packed K/V
        row = k_cache[0].numel()
        scratch = self._scratch_rows(
            "packed",
            k_cache,
            -(-prefill_scratch_elems(k_len, k_cache.shape[2], k_cache.shape[3]) // row),
        ).view(-1)
        return prefill_attention(q, k_cache, v_cache, table, k_len, scale, out, scratch)

    def _gather_native(
        self, which: str, cache: torch.Tensor, blocks: torch.Tensor, kernels: _Kernels
    ) -> torch.Tensor:
        """cache[blocks] ([n, block_size, Hkv, D]) into the reusable buffer `which`."""
        out = self._scratch_rows(which, cache, blocks.numel())
        rc = kernels.gather(
            cache.data_ptr(),
            out.shape[1] * cache.element_size(),
            blocks.data_ptr(),
            out.shape[0],
            out.data_ptr(),
            cache.shape[0],
        )
        if rc != 0:
            raise IndexError(f"block id out of range for a KV cache of {cache.shape[0]} blocks")
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
        kernels = _get_kernels()
        q_len, k_len = meta.q_lens[i], meta.k_lens[i]
        ctx = k_len - q_len
        if (
            kernels is None
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
        kc = self._gather_native("k", k_cache, blocks, kernels).flatten(0, 1)[:ctx]
        vc = self._gather_native("v", v_cache, blocks, kernels).flatten(0, 1)[:ctx]
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
