"""The float32 hybrid step's fused producers of quantized matmul inputs
(kernels/csrc/act_quant.c), callable on their own for tests and benchmarks.

The int8 matmuls take their activations quantized per 32-block (`int8_dot.
quantize_activations`). In a layer two of those inputs come straight out of an
elementwise pass: the RMSNorm before the QKV and gate/up matmuls, SwiGLU before the down
matmul. The step runs each pass and the quantization as one, through a row buffer on the
stack, so the float rows never reach memory and one OpenMP barrier goes; the result is
bitwise the native pass followed by `quantize_activations` (the very same C row code).
"""

from __future__ import annotations

import ctypes

import torch

from .block_quant import BLOCK
from .native import load_library

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int

Quantized = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class _Producers:
    def __init__(self) -> None:
        lib = load_library()
        self.rms_norm: ctypes._CFuncPtr | None = None
        self.silu_mul: ctypes._CFuncPtr | None = None
        if lib is None or not hasattr(lib, "rms_norm_quantize_f32"):
            return
        self.rms_norm = lib.rms_norm_quantize_f32
        self.rms_norm.argtypes = [_P, _L, _P, _L, _P, _L, _I, ctypes.c_float, _P, _P, _P]
        self.rms_norm.restype = None
        self.silu_mul = lib.silu_mul_quantize_f32
        self.silu_mul.argtypes = [_P, _L, _L, _I, _P, _P, _P]
        self.silu_mul.restype = None


_producers: list[_Producers] = []


def _get() -> _Producers:
    if not _producers:
        _producers.append(_Producers())
    return _producers[0]


def _rows_ok(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1 and x.device.type == "cpu"


def _quantized(m: int, k: int) -> Quantized:
    return (
        torch.empty((m, k), dtype=torch.int8),
        torch.empty((m, k // BLOCK), dtype=torch.float32),
        torch.empty((m, k // BLOCK), dtype=torch.float32),
    )


def rms_norm_quantize(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> Quantized | None:
    """residual (if given; updated in place) += x, RMSNorm with `weight`, quantized:
    (q int8 [M, hidden], d, s float32 [M, hidden / 32]) as `quantize_activations`.
    x, residual: float32 [M, hidden], hidden a multiple of 32, unit column stride.
    None (nothing written) where the library is not built or the operands are not taken."""
    fn = _get().rms_norm
    if fn is None or not _rows_ok(x) or x.shape[1] == 0 or x.shape[1] % BLOCK != 0:
        return None
    m, hidden = x.shape
    if (
        weight.dtype != torch.float32
        or weight.shape != (hidden,)
        or not weight.is_contiguous()
        or (residual is not None and (not _rows_ok(residual) or residual.shape != x.shape))
    ):
        return None
    q, d, s = _quantized(m, hidden)
    fn(
        x.data_ptr(),
        x.stride(0),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        weight.data_ptr(),
        m,
        hidden,
        eps,
        q.data_ptr(),
        d.data_ptr(),
        s.data_ptr(),
    )
    return q, d, s


def silu_mul_quantize(gate_up: torch.Tensor) -> Quantized | None:
    """silu(gate) * up of gate_up float32 [M, 2 inter] (gate, then up; inter a multiple
    of 32, unit column stride), quantized as `quantize_activations`. None where not
    taken."""
    fn = _get().silu_mul
    if fn is None or not _rows_ok(gate_up) or gate_up.shape[1] % (2 * BLOCK) != 0:
        return None
    m, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if inter == 0:
        return None
    q, d, s = _quantized(m, inter)
    fn(gate_up.data_ptr(), gate_up.stride(0), m, inter, q.data_ptr(), d.data_ptr(), s.data_ptr())
    return q, d, s
