"""The C entry points of kernels/csrc/cpu_attention.c, prefill_attention.c and
kv_cache_copy.c, wrapped for torch tensors: decode attention straight from the paged
cache, bf16 prefill attention over a chunk and its cached context, KV cache writes and
block gathers. Each returns False / None (nothing written) where its kernel does not
apply, so that `CpuPagedAttention` keeps the torch path there, and raises IndexError
(nothing written) for an index outside the cache.
"""

from __future__ import annotations

import ctypes

import torch

from .kv_int8 import INT8_SCALE_BYTES
from .native import load_library

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
    """The attention kernels' C entry points with their signatures, resolved once."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        # by query dtype: over caches of that dtype, and over int8 cache rows
        # (sarazmq.kernels.kv_int8), the same arguments
        self.decode: dict[torch.dtype, ctypes._CFuncPtr] = {}
        self.decode_int8: dict[torch.dtype, ctypes._CFuncPtr] = {}
        for dtype, sym, int8_sym in (
            (torch.float32, "paged_decode_attention_f32", "paged_decode_attention_i8_f32"),
            (torch.bfloat16, "paged_decode_attention_bf16", "paged_decode_attention_i8_bf16"),
        ):
            for table, name in ((self.decode, sym), (self.decode_int8, int8_sym)):
                fn = getattr(lib, name)
                fn.argtypes = _ARGTYPES
                fn.restype = _c_int
                table[dtype] = fn
        self.prefill_bf16 = lib.prefill_attention_bf16
        self.prefill_bf16.argtypes = _PREFILL_ARGTYPES
        self.prefill_bf16.restype = _c_int
        self.prefill_amx = lib.prefill_attention_amx_bf16
        self.prefill_amx.argtypes = _PREFILL_ARGTYPES
        self.prefill_amx.restype = _c_int
        self.amx_supported = bool(lib.prefill_amx_supported())
        self.prefill_f32 = lib.prefill_attention_f32
        self.prefill_f32.argtypes = _PREFILL_ARGTYPES
        self.prefill_f32.restype = _c_int
        self.f32_prefill_supported = bool(lib.prefill_f32_supported())
        self.prefill_i8_f32 = lib.prefill_attention_i8_f32
        self.prefill_i8_f32.argtypes = _PREFILL_ARGTYPES
        self.prefill_i8_f32.restype = _c_int
        self.i8_prefill_supported = bool(lib.prefill_i8_f32_supported())
        self.write_kv = lib.write_kv_cache
        self.write_kv.argtypes = _WRITE_ARGTYPES
        self.write_kv.restype = _c_int
        self.gather = lib.gather_blocks
        self.gather.argtypes = [_c_void_p, _c_long, _c_void_p, _c_long, _c_void_p, _c_long]
        self.gather.restype = _c_int


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
    [num_blocks, block_size, Hkv, D] contiguous, of q's dtype, or int8 rows
    [..., D + 4] (`sarazmq.kernels.kv_int8`: head size 64 or 128; bf16 q on AVX-512,
    float32 q on AVX-512 or AVX2);
    block_tables: [>= nd, max_blocks] int32; seq_lens: [>= nd] int32, keys per sequence
    (>= 1, this step's token already written). Returns [nd, H, D] in q's dtype.
    """
    kernels = _get_kernels()
    if kernels is None or q.device.type != "cpu":
        return None
    nd, h, d = q.shape
    if k_cache.dtype == torch.int8:
        int8_rows = k_cache.shape[-1] == d + INT8_SCALE_BYTES
        fn = kernels.decode_int8.get(q.dtype) if int8_rows else None
    else:
        fn = kernels.decode.get(q.dtype) if k_cache.dtype == q.dtype else None
    if fn is None or nd == 0:
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


PREFILL_KERNELS = ("auto", "amx", "avx512", "f32")
# the prefill kernels that take each query dtype
_DTYPE_KERNELS = {torch.bfloat16: ("auto", "amx", "avx512"), torch.float32: ("auto", "f32")}


def prefill_amx_available() -> bool:
    """Whether the AMX prefill kernel runs here (built for a CPU with AMX tiles, and the
    kernel granted the tile state by Linux)."""
    kernels = _get_kernels()
    return kernels is not None and kernels.amx_supported


def prefill_f32_available() -> bool:
    """Whether the float32 prefill kernel runs here (built for a CPU with AVX2 and FMA, or
    AVX-512: prefill_attention_f32.c)."""
    kernels = _get_kernels()
    return kernels is not None and kernels.f32_prefill_supported


def prefill_int8_available() -> bool:
    """Whether the float32 prefill kernel reads int8 caches in place here (AVX512-VNNI
    builds: prefill_attention_i8_f32); elsewhere callers dequantize the context first."""
    kernels = _get_kernels()
    return kernels is not None and kernels.i8_prefill_supported


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    k_len: int,
    scale: float,
    out: torch.Tensor,
    scratch: torch.Tensor | None = None,
    kernel: str = "auto",
) -> bool:
    """Causal attention of one prefill chunk over its whole sequence, read from the paged
    cache (bf16 or float32, head size 64 or 128); False when the kernel does not apply and
    nothing was written.

    q: [q_len, H, D] (token stride free, heads contiguous), the queries at positions
    k_len - q_len .. k_len - 1; k_cache, v_cache: [num_blocks, block_size, Hkv, D]
    contiguous, holding all k_len keys (the chunk's own included), of q's dtype, or for
    float32 q int8 rows [..., D + 4] (`sarazmq.kernels.kv_int8`) where
    `prefill_int8_available` (both products exact in integers: the keys against each
    query row rounded to int16, the values against each step's probabilities rounded to
    int16; within ~1e-5 of the float path over the dequantized cache); block_table: int32
    block ids of the sequence; out: [q_len, H, D] like q (token stride free);
    scratch: optional buffer of q's dtype, >= `prefill_scratch_elems` elements.
    kernel: for bf16, "amx" (matmuls on AMX tiles, prefill_amx.c) or "avx512" (VDPBF16PS
    dot products, CPUs with AVX512-BF16); for float32, "f32" (prefill_attention_f32.c,
    CPUs with AVX2 and FMA, 16 lanes with AVX-512); "auto": the one for q's dtype (AMX
    where it runs, else AVX-512, for bf16). A kernel of another dtype does not apply
    (False).
    """
    if kernel not in PREFILL_KERNELS:
        raise ValueError(f"prefill kernel {kernel!r} is not one of {PREFILL_KERNELS}")
    kernels = _get_kernels()
    if kernels is None or q.device.type != "cpu" or kernel not in _DTYPE_KERNELS.get(q.dtype, ()):
        return False
    q_len, h, d = q.shape
    int8_rows = (
        k_cache.dtype == torch.int8
        and k_cache.shape[-1] == d + INT8_SCALE_BYTES
        and q.dtype == torch.float32
        and kernels.i8_prefill_supported
    )
    if (
        (k_cache.dtype != q.dtype and not int8_rows)
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
    if (
        scratch is None
        or scratch.numel() < need
        or scratch.dtype != q.dtype
        or scratch.data_ptr() % 64 != 0  # the kernels' aligned vector loads
    ):
        scratch = torch.empty(need, dtype=q.dtype)
    args = (
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
    rc = -1
    if int8_rows:
        rc = kernels.prefill_i8_f32(*args)
    elif q.dtype == torch.float32:
        rc = kernels.prefill_f32(*args)
    elif kernel != "avx512" and kernels.amx_supported:
        rc = kernels.prefill_amx(*args)
    if rc == -1 and q.dtype == torch.bfloat16 and kernel != "amx":
        rc = kernels.prefill_bf16(*args)
    if rc == -2:
        raise IndexError(
            f"prefill attention: a block id reaches outside the KV cache "
            f"({k_cache.shape[0]} blocks)"
        )
    return rc == 0


def prefill_scratch_elems(k_len: int, num_kv_heads: int, head_dim: int) -> int:
    """Elements of the packed-K/V scratch `prefill_attention` needs: K and V of every KV
    head, whole steps of 64 keys (the AMX kernel's step; the AVX-512 and float32 ones take
    16)."""
    return 2 * num_kv_heads * -(-k_len // 64) * 64 * head_dim


def gather_blocks_native(cache: torch.Tensor, blocks: torch.Tensor, out: torch.Tensor) -> None:
    """out[i] = cache[blocks[i]] for whole cache blocks, in C (prefetching ahead, where
    torch's index_select crawls over blocks scattered across a large cache).

    cache: contiguous [num_blocks, ...]; blocks: int32 [n] contiguous; out: [>= n, row]
    with rows of one cache block each, contiguous. Raises IndexError (nothing copied) for
    a block id outside the cache, ValueError when the kernels are unavailable.
    """
    kernels = _get_kernels()
    if kernels is None:
        raise ValueError("gather_blocks_native: the native CPU kernels did not build")
    rc = kernels.gather(
        cache.data_ptr(),
        out.shape[1] * cache.element_size(),
        blocks.data_ptr(),
        blocks.numel(),
        out.data_ptr(),
        cache.shape[0],
    )
    if rc != 0:
        raise IndexError(f"block id out of range for a KV cache of {cache.shape[0]} blocks")
