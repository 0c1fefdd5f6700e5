"""The int8 paged KV cache (`--kv-cache-dtype int8`): half the bytes of bf16 per token.

Decode attention reads every running sequence's whole KV each iteration and is bound by
memory bandwidth on CPUs (docs/KERNELS.md, "int8 KV cache"); int8 rows halve what it
reads, and the pool holds 1.9x the tokens in the same memory. The price is precision:
each row keeps ~7 bits of its largest value's magnitude (as vLLM's and SGLang's fp8
caches trade precision for bytes, which is why it is opt-in).

Layout: the cache tensors are int8 [num_blocks, block_size, Hkv, D + 4]: a row is one
token's one KV head, D int8 values q then the float32 scale s (its 4 bytes), x ~= s * q.
Symmetric per row: s = max|x| / 127, q = round-half-even(x * (127 / max|x|)).
`quantize_kv_rows` / `dequantize_kv_rows` are the plain PyTorch reference and the torch
backend's path; kernels/csrc/kv_int8.c writes the same bytes and dequantizes a prefill
chunk's context blocks to the same bf16 or float32 bits, and the decode attention kernels
(kernels/csrc/cpu_attention.c and, on AVX2 CPUs, decode_attention_avx2.c;
`paged_decode_attention` for int8 caches) read the rows directly.
"""

from __future__ import annotations

import ctypes

import torch

from .kv_layout import INT8_SCALE_BYTES, kv_row_layout
from .native import load_library


def kv_cache_layout(
    kv_cache_dtype: str, model_dtype: torch.dtype, head_dim: int
) -> tuple[torch.dtype, int]:
    """(element dtype, elements per row of one token's one KV head) of the cache
    (`kv_layout.kv_row_layout` in torch dtypes)."""
    name, row = kv_row_layout(kv_cache_dtype, str(model_dtype).removeprefix("torch."), head_dim)
    return getattr(torch, name), row


def is_int8_cache(cache: torch.Tensor) -> bool:
    """Whether `cache` holds int8 rows (this module's layout)."""
    return cache.dtype == torch.int8


def quantize_kv_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) -> int8 rows [..., D + 4] (the reference)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    scale = amax / 127.0
    # a tensor / tensor division: one rounding, as the C kernel (`127.0 / amax` would be
    # torch's reciprocal times 127, two)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_kv_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., D + 4] -> [..., D] in `dtype` (s * q, computed in float32)."""
    d = rows.shape[-1] - INT8_SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :d].float() * scale).to(dtype)


class _Kernels:
    """The int8 write and block dequantization of the native library, with their
    signatures (the int8 decode is `cpu_attention_kernels.paged_decode_attention`'s)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i, n = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
        self.write = lib.write_kv_cache_int8
        self.write.argtypes = [p, n, p, n, p, p, p, n, i, i, i, n]
        self.write.restype = i
        # by the dtype it writes
        self.dequantize_blocks: dict[torch.dtype, ctypes._CFuncPtr] = {}
        for dtype, name in (
            (torch.bfloat16, "dequantize_kv_blocks_int8_bf16"),
            (torch.float32, "dequantize_kv_blocks_int8_f32"),
        ):
            fn = getattr(lib, name)
            fn.argtypes = [p, p, n, i, i, i, n, p]
            fn.restype = i
            self.dequantize_blocks[dtype] = fn


_kernels: list[_Kernels | None] = []  # [resolved kernels or None], filled on first use


def _get() -> _Kernels | None:
    if not _kernels:
        lib = load_library()
        _kernels.append(None if lib is None else _Kernels(lib))
    return _kernels[0]


def write_kv_int8_native(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """Quantizes k, v [T, Hkv, D] (bf16 or float32, heads and D contiguous) into int8
    caches at slot_mapping [T] (int64) in C: the bytes `quantize_kv_rows` gives. False
    (nothing written) where the kernel does not apply; IndexError for a slot outside the
    cache (nothing written)."""
    kernels = _get()
    t, hkv, d = k.shape
    if (
        kernels is None
        or k.device.type != "cpu"
        or k.dtype not in (torch.bfloat16, torch.float32)
        or v.dtype != k.dtype
        or not (is_int8_cache(k_cache) and is_int8_cache(v_cache))
        or k_cache.shape[-1] != d + INT8_SCALE_BYTES
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or slot_mapping.dtype != torch.int64
        or not slot_mapping.is_contiguous()
        or k.stride()[1:] != (d, 1)
        or v.stride()[1:] != (d, 1)
    ):
        return False
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    rc = kernels.write(
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        t,
        hkv,
        d,
        int(k.dtype == torch.bfloat16),
        num_slots,
    )
    if rc == -2:
        raise IndexError(
            f"KV cache slot out of range: a slot in slot_mapping is outside the cache's "
            f"{num_slots} slots"
        )
    return rc == 0


def dequantize_kv_blocks_native(
    cache: torch.Tensor, blocks: torch.Tensor, out: torch.Tensor
) -> bool:
    """cache[blocks] of an int8 cache [num_blocks, block_size, Hkv, D + 4] dequantized in C
    into out, bf16 or float32 [len(blocks), block_size, Hkv, D]: the bits
    `dequantize_kv_rows(..., out.dtype)` gives. False (nothing written) where the kernel
    does not apply; IndexError for a block id outside the cache (nothing written)."""
    kernels = _get()
    if (
        kernels is None
        or cache.device.type != "cpu"
        or not is_int8_cache(cache)
        or cache.dim() != 4
        or not cache.is_contiguous()
        or blocks.dtype != torch.int32
        or blocks.dim() != 1
        or not blocks.is_contiguous()
        or out.dtype not in kernels.dequantize_blocks
        or not out.is_contiguous()
        or tuple(out.shape)
        != (blocks.numel(), *cache.shape[1:3], cache.shape[3] - INT8_SCALE_BYTES)
    ):
        return False
    num_blocks, block_size, hkv, row = cache.shape
    rc = kernels.dequantize_blocks[out.dtype](
        cache.data_ptr(),
        blocks.data_ptr(),
        blocks.numel(),
        block_size,
        hkv,
        row - INT8_SCALE_BYTES,
        num_blocks,
        out.data_ptr(),
    )
    if rc == -2:
        raise IndexError(
            f"KV cache block out of range: a block id is outside the cache's {num_blocks}"
        )
    return rc == 0
