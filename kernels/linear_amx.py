"""bf16 matmuls on AMX tiles (kernels/csrc/linear_amx.c), for the model's linear layers on
CPUs with AMX.

oneDNN's matmul, which the packed weights (`LinearWeight.packed`) go through, reads the
weights of a serving iteration as if they were in cache: at a few to a hundred rows its
time is the cached compute time plus the weights' read time. The tile kernel streams each
thread's share of the weights front to back with prefetches ahead of the products, so
reading and multiplying overlap; it needs its own weight layout (`pack_tiles`, the
`LinearWeight.tiles` variant). Same float32 accumulation and one rounding to bf16 per
output as oneDNN; the sums may run in another order. Numbers: docs/KERNELS.md, "AMX
linear".
"""

from __future__ import annotations

import ctypes

import torch

from .native import load_library

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


class _Kernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.supported = bool(lib.linear_amx_supported())
        self.pack = lib.linear_amx_pack
        self.pack.argtypes = [_P, _I, _I, _P]
        self.pack.restype = _I
        self.matmul = lib.linear_amx_bf16
        self.matmul.argtypes = [_P, _L, _P, _P, _L, _I, _I, _I]
        self.matmul.restype = _I
        self.matmul_f32out = lib.linear_amx_bf16_f32out
        self.matmul_f32out.argtypes = [_P, _L, _P, _P, _L, _I, _I, _I]
        self.matmul_f32out.restype = _I
        self.silu_mul = lib.linear_amx_silu_mul_bf16
        self.silu_mul.argtypes = [_P, _L, _P, _P, _L, _I, _I, _I]
        self.silu_mul.restype = _I


_kernels: list[_Kernels | None] = []  # [resolved kernels or None], filled on first use


def _get() -> _Kernels | None:
    if not _kernels:
        lib = load_library()
        _kernels.append(None if lib is None else _Kernels(lib))
    k = _kernels[0]
    return k if k is not None and k.supported else None


def amx_linear_available() -> bool:
    """Whether the tile kernel runs here (built for a CPU with AMX, tiles granted)."""
    return _get() is not None


def tiles_cover(
    dtype: torch.dtype, device: torch.device, out_features: int, in_features: int
) -> bool:
    """Whether a weight of this kind can be packed into tiles: bf16 on a CPU with the
    kernel, both sizes multiples of 32."""
    return (
        dtype == torch.bfloat16
        and device.type == "cpu"
        and out_features >= 32
        and in_features >= 32
        and out_features % 32 == 0
        and in_features % 32 == 0
        and amx_linear_available()
    )


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] (bf16) -> its tile layout (a flat bf16 copy of out * in elements);
    ValueError where `tiles_cover` does not hold."""
    k = _get()
    if k is None or not tiles_cover(weight.dtype, weight.device, *weight.shape):
        raise ValueError(
            f"no tile layout for a {weight.dtype} weight of shape {tuple(weight.shape)} here "
            "(bf16 on a CPU with AMX, sizes multiples of 32)"
        )
    w = weight.detach().contiguous()
    out = torch.empty(w.numel(), dtype=torch.bfloat16)
    if k.pack(w.data_ptr(), w.shape[0], w.shape[1], out.data_ptr()) != 0:
        raise ValueError(f"the tile kernel refused a weight of shape {tuple(w.shape)}")
    return out


def _rows_ok(x: torch.Tensor) -> bool:
    # what every tile kernel takes as its rows: 2-d bf16 on the CPU, at least one row,
    # unit column stride (any row stride)
    return (
        x.dim() == 2
        and x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and x.stride(1) == 1
        and x.shape[0] >= 1
    )


def linear_tiles(x: torch.Tensor, tiles: torch.Tensor, out_features: int) -> torch.Tensor | None:
    """x [M, in] (bf16, unit column stride) @ the packed weight^T -> [M, out_features];
    None where the kernel does not apply (nothing computed)."""
    k = _get()
    if k is None or not _rows_ok(x) or tiles.numel() != out_features * x.shape[1]:
        return None
    rows, in_features = x.shape
    out = torch.empty((rows, out_features), dtype=torch.bfloat16)
    rc = k.matmul(
        x.data_ptr(),
        x.stride(0),
        tiles.data_ptr(),
        out.data_ptr(),
        out_features,
        rows,
        out_features,
        in_features,
    )
    return out if rc == 0 else None


def linear_tiles_into_f32(x: torch.Tensor, tiles: torch.Tensor, out: torch.Tensor) -> bool:
    """`linear_tiles` into float32 out [M, out_features] (unit column stride, any row
    stride): each output the bf16-rounded sum, widened (bitwise `linear_tiles` followed by
    a copy into out). False where the kernel does not apply (nothing written)."""
    k = _get()
    if (
        k is None
        or not _rows_ok(x)
        or out.dim() != 2
        or out.dtype != torch.float32
        or out.device.type != "cpu"
        or out.stride(1) != 1
        or out.shape[0] != x.shape[0]
        or tiles.numel() != out.shape[1] * x.shape[1]
    ):
        return False
    (rows, in_features), n = x.shape, out.shape[1]
    rc = k.matmul_f32out(
        x.data_ptr(),
        x.stride(0),
        tiles.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        rows,
        n,
        in_features,
    )
    return rc == 0


def silu_mul_tiles(x: torch.Tensor, tiles: torch.Tensor, inter: int) -> torch.Tensor | None:
    """SwiGLU in one pass: silu(gate) * up [M, inter] where [gate | up] = x [M, in] (bf16,
    unit column stride) @ the packed [2 * inter, in] weight^T; bitwise `linear_tiles`
    followed by the C `silu_mul`, without the [M, 2 * inter] intermediate. None where the
    kernel does not apply (nothing computed)."""
    k = _get()
    if k is None or not _rows_ok(x) or tiles.numel() != 2 * inter * x.shape[1]:
        return None
    rows, in_features = x.shape
    out = torch.empty((rows, inter), dtype=torch.bfloat16)
    rc = k.silu_mul(
        x.data_ptr(), x.stride(0), tiles.data_ptr(), out.data_ptr(), inter, rows, inter, in_features
    )
    return out if rc == 0 else None
