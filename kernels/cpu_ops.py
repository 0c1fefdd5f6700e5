"""Fused RMSNorm(+residual), RoPE, SiLU-and-multiply and 1-3-row matmuls in C
(kernels/csrc/cpu_ops.c).

`HotOps` is the interface the model calls for its elementwise work; `TORCH_OPS` is the
plain-PyTorch implementation (sarazmq.kernels.ops, the reference), `NativeCpuOps` the C
one, each op falling back to the reference where the kernel does not apply (device,
dtype, strides). Same numerics as the reference up to float32 summation order in the
RMSNorm reduction and SiLU's exp (within ~2 ulp of torch's: float32 results can differ in
the last bit, bf16 ones practically never).

Matmuls (`HotOps.linear`) of decode steps with at most `GEMV_MAX_ROWS` rows go to a C
matrix-vector kernel that streams the weights near the machine's read bandwidth: on the
default model's 121 weight matrices at one row, bf16 9.3 ms a step against oneDNN's 12.9,
float32 13.5 against oneDNN's 20.9 (and MKL's 44); past those rows oneDNN keeps them.
Float32 sums run in another order than the library's: results may differ in the last bit.
Where the model keeps a GGUF's quantized blocks of a weight (`linear(..., blocks=)`), those
rows read the blocks instead (sarazmq.kernels.block_quant): bitwise the same result.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from .block_quant import BlockQuantWeight, block_quant_linear
from .native import load_library
from .ops import apply_rope_, linear, rms_norm_

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "rms_norm": [_P, _L, _P, _L, _P, _P, _L, _L, _I, _F],
    "rope": [_P, _L, _P, _P, _L, _I, _I],
    "silu_mul": [_P, _L, _P, _L, _L, _I],
}
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_ROPE_MAX_D = 512
# rows up to which the C kernel beats oneDNN's prepacked matmul (it takes up to 8), measured
# over the default model's 121 matmuls: bf16 9.3 against 12.9 ms at one row, 9.5 against
# 13.9 at two, even at three to five, slower from six; float32 13.5 against 20.9 at one
# and two rows, 16.3 against 17.6 at three, slower from four
GEMV_MAX_ROWS = {torch.bfloat16: 3, torch.float32: 3}
_GEMV_ARGTYPES = [_P, _L, _P, _P, _L, _I, _I, _I]


class HotOps:
    """The model's elementwise ops, plain PyTorch (the reference for `NativeCpuOps`)."""

    name = "torch"

    def rms_norm_(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See `sarazmq.kernels.ops.rms_norm_`: (normed, residual after adding x)."""
        return rms_norm_(x, weight, eps, residual)

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        packed: torch.Tensor | None = None,
        blocks: BlockQuantWeight | None = None,
    ) -> torch.Tensor:
        """x [T, in] @ weight [out, in]^T (+ bias) -> [T, out]; see
        `sarazmq.kernels.ops.linear` (packed: its prepacked oneDNN weight, or None; blocks:
        the same weight as the checkpoint's quantized blocks, or None, which the C ops read
        where that gives the same result faster)."""
        return linear(x, weight, bias, packed)

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        """gate_up [T, 2 * inter] (gate, then up) -> silu(gate) * up [T, inter]."""
        return F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])

    def apply_rope_(
        self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
    ) -> torch.Tensor:
        """See `sarazmq.kernels.ops.apply_rope_` (in place, returns x)."""
        return apply_rope_(x, cos, sin_signed)


TORCH_OPS = HotOps()


def _native_functions() -> dict[tuple[str, torch.dtype], ctypes._CFuncPtr] | None:
    lib = load_library()
    if lib is None:
        return None
    fns = {}
    for dtype, suffix in _SUFFIX.items():
        gemv = getattr(lib, f"gemv_{suffix}")
        gemv.argtypes = _GEMV_ARGTYPES
        gemv.restype = _I
        fns[("gemv", dtype)] = gemv
    for op, argtypes in _SIGNATURES.items():
        for dtype, suffix in _SUFFIX.items():
            fn = getattr(lib, f"{op}_{suffix}")
            fn.argtypes = argtypes
            fn.restype = None
            fns[(op, dtype)] = fn
    return fns


def _rows_ok(t: torch.Tensor) -> bool:
    # 2-d, CPU, unit stride along the row (any row stride)
    return t.dim() == 2 and t.device.type == "cpu" and t.stride(1) == 1


class NativeCpuOps(HotOps):
    """`HotOps` in C (see module docstring); raises ValueError when the kernels cannot be
    built, so callers decide on a fallback once, not per op."""

    name = "cpu"

    def __init__(self) -> None:
        fns = _native_functions()
        if fns is None:
            raise ValueError("native CPU ops unavailable: kernels/csrc/cpu_ops.c did not build")
        self._fns = fns

    def rms_norm_(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fn = self._fns.get(("rms_norm", x.dtype))
        if (
            fn is None
            or not _rows_ok(x)
            or weight.dtype != x.dtype
            or not weight.is_contiguous()
            or (residual is not None and (not _rows_ok(residual) or residual.dtype != x.dtype))
        ):
            return super().rms_norm_(x, weight, eps, residual)
        rows, hidden = x.shape
        out = torch.empty((rows, hidden), dtype=x.dtype)
        fn(
            x.data_ptr(),
            x.stride(0),
            None if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0),
            weight.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            rows,
            hidden,
            eps,
        )
        return out, (x if residual is None else residual)

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        packed: torch.Tensor | None = None,
        blocks: BlockQuantWeight | None = None,
    ) -> torch.Tensor:
        fn = self._fns.get(("gemv", x.dtype))
        if (
            fn is None
            or bias is not None
            or not _rows_ok(x)
            or not 1 <= x.shape[0] <= GEMV_MAX_ROWS[x.dtype]
            or weight.dtype != x.dtype
            or weight.dim() != 2
            or not weight.is_contiguous()
            or weight.device.type != "cpu"
            or weight.shape[1] != x.shape[1]
        ):
            return super().linear(x, weight, bias, packed)
        if blocks is not None:
            # the quantized blocks hold exactly `weight`, and their kernel sums as gemv_f32
            # does: the same result from a quarter of the bytes (float32 only)
            out = block_quant_linear(x, blocks)
            if out is not None:
                return out
        rows, (n, k) = x.shape[0], weight.shape
        out = torch.empty((rows, n), dtype=x.dtype)
        if fn(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), n, rows, n, k) != 0:
            return super().linear(x, weight, bias, packed)  # sizes the kernel does not cover
        return out

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        fn = self._fns.get(("silu_mul", gate_up.dtype))
        if fn is None or not _rows_ok(gate_up) or gate_up.shape[1] != 2 * inter:
            return super().silu_mul(gate_up, inter)
        rows = gate_up.shape[0]
        out = torch.empty((rows, inter), dtype=gate_up.dtype)
        fn(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), inter, rows, inter)
        return out

    def apply_rope_(
        self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
    ) -> torch.Tensor:
        fn = self._fns.get(("rope", x.dtype))
        rows, heads, d = x.shape
        if (
            fn is None
            or x.device.type != "cpu"
            or x.stride(2) != 1
            or x.stride(1) != d
            or d > _ROPE_MAX_D
            or cos.dtype != x.dtype
            or sin_signed.dtype != x.dtype
            or cos.shape != (rows, 1, d)
            or not (cos.is_contiguous() and sin_signed.is_contiguous())
        ):
            return super().apply_rope_(x, cos, sin_signed)
        fn(x.data_ptr(), x.stride(0), cos.data_ptr(), sin_signed.data_ptr(), rows, heads, d)
        return x
