"""Integer-dot matmuls on GGUF block-quantized weights, as llama.cpp computes them
(kernels/csrc/int8_dot.c).

`block_quant.py` keeps a GGUF model's Q4_0 / Q4_1 / Q8_0 blocks (`BlockQuantWeight`) and
its kernel rebuilds the float32 weights in registers: bitwise the float path, and bound by
float32 FMA throughput once there are many rows (prefill). This module trades that
exactness for integer dot products, llama.cpp's way:

- activations x float32 [M, K] are quantized per 32-block (`quantize_activations`;
  C: kernels/csrc/act_quant.c):
  d = max|x| / 127, q = round-half-even(x * (127 / max|x|)) in -127..127 (all zeros where
  the block is), s = d * sum(q) (float32, llama.cpp's Q8_1 sum term);
- with the weights' blocks stored as weight = dw * qw + mw (Q4, qw unsigned 0..15; Q4_0 has
  mw = -8 dw) or weight = dw * qw (Q8, qw int8),

      y[m, n] = sum_b  dw[n, b] * dx[m, b] * dot(qw[n, b], qx[m, b])  +  mw[n, b] * s[m, b]

  where each block's dot product is exact in int32 (AVX2: VPMADDUBSW of unsigned nibbles
  and signed int8, then VPMADDWD by ones; Q8 weights by the sign trick |w| * sign(w) x)
  and scaled once per block in float32.

Accuracy: this is NOT the float path's result. Each activation is rounded to 1/254 of its
block's largest magnitude (relative error up to ~0.4% per element, largely averaging out
over a dot product), the precision llama.cpp runs GGUF models at; the weights themselves
are the checkpoint's exactly. The tests bound the error against the float32 matmul of the
dequantized weight; `quantize_activations_reference` and `int8_block_linear_reference`
are the plain-PyTorch statements of the math (the quantizer is bitwise; the matmul is
exact int32 dot products summed in float64, which the kernel matches to float32 rounding).
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import torch

from .block_quant import BLOCK, BlockQuantWeight
from .int8_isa import int8_dot_avx2, int8_dot_vnni, int8_panels_vector_bits
from .native import load_library

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_KIND = {"q4": 4, "q8": 8}


class _Kernels:
    def __init__(self) -> None:
        lib = load_library()
        self.quantize: ctypes._CFuncPtr | None = None
        self.matmul: ctypes._CFuncPtr | None = None
        self.avx2 = False
        self.vnni = False
        self.probe: ctypes._CFuncPtr | None = None
        if lib is None or not hasattr(lib, "int8_block_matmul"):
            return
        self.quantize = lib.int8_quantize_rows
        self.quantize.argtypes = [_P, _L, _I, _I, _P, _P, _P, _I]
        self.quantize.restype = _I
        self.matmul = lib.int8_block_matmul
        self.matmul.argtypes = [_I, _P, _P, _P, _I, _I, _P, _P, _P, _L, _I, _I]
        self.matmul.restype = _I
        self.avx2 = int8_dot_avx2()
        self.vnni = int8_dot_vnni()
        self.probe = lib.int8_peak_probe
        self.probe.argtypes = [_L, _I]
        self.probe.restype = _L
        self.panels: ctypes._CFuncPtr | None = None
        self.panel_bits = 0
        if hasattr(lib, "int8_panels_matmul"):
            self.panels = lib.int8_panels_matmul
            self.panels.argtypes = [_P, _P, _P, _I, _I, _P, _P, _P, _L, _I, _I, _I]
            self.panels.restype = _I
            self.panel_bits = int8_panels_vector_bits()


_kernels: list[_Kernels] = []


def _get() -> _Kernels:
    if not _kernels:
        _kernels.append(_Kernels())
    return _kernels[0]


def int8_dot_available() -> bool:
    """Whether the int8 kernels were built (any C compiler; fast with AVX2 + FMA)."""
    return _get().matmul is not None


def probe_peak_macs(int8: bool, iters: int = 2_000_000) -> float:
    """Multiply-accumulates per second of the C peak probe on every OpenMP thread, best of
    3: int8 = True, chains of VPMADDUBSW summed in int16 (AVX2's int8 dot-accumulate), or
    of VPDPBUSD where the build has it (`int8_dot_vnni`), on the panels' vector width
    (`int8_panels_vector_bits`): the limit of the panel kernels;
    False, chains of 256-bit float32 FMAs. 0.0 without the AVX2 build."""
    kernels = _get()
    if kernels.probe is None or not kernels.avx2:
        return 0.0
    kernels.probe(iters // 10, int(int8))  # warm up (clocks, threads)
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        macs = kernels.probe(iters, int(int8))
        best = max(best, macs / (time.perf_counter() - t))
    return best


def _check_x(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"int8 activations are quantized from float32, got {got}")
    if x.dim() != 2 or x.shape[1] == 0 or x.shape[1] % BLOCK != 0:
        raise ValueError(
            f"int8 activations: x must be [M, K] with K a positive multiple of {BLOCK}, "
            f"got shape {tuple(x.shape)}"
        )
    if x.device.type != "cpu":
        raise ValueError(f"int8 activations: x must be on the CPU, got {x.device}")


def quantize_activations_reference(
    x: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float32 [M, K] -> (q int8 [M, K], d float32 [M, K/32], s float32 [M, K/32]):
    the plain-PyTorch statement of the quantizer (the kernel's result bit for bit)."""
    _check_x(x)
    m, k = x.shape
    xb = x.reshape(m, k // BLOCK, BLOCK)  # [M, KB, 32]
    amax = xb.abs().amax(dim=-1)  # [M, KB]
    d = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None])  # round half to even, as the kernel
    s = d * q.sum(dim=-1)  # the sum is exact in float32 (|sum| <= 4064)
    return q.to(torch.int8).reshape(m, k), d, s


def quantize_activations(
    x: torch.Tensor, *, portable: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float32 [M, K] (K a multiple of 32; unit column stride) -> (q int8 [M, K],
    d float32 [M, K/32], s float32 [M, K/32]) by the C kernel (`portable`: its plain C
    loop, not the AVX2 one); the reference's result where the library is unavailable.
    Raises ValueError for another dtype or shape."""
    _check_x(x)
    kernels = _get()
    if kernels.quantize is None:
        return quantize_activations_reference(x)
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8)
    d = torch.empty((m, k // BLOCK), dtype=torch.float32)
    s = torch.empty((m, k // BLOCK), dtype=torch.float32)
    rc = kernels.quantize(
        x.data_ptr(), x.stride(0), m, k, q.data_ptr(), d.data_ptr(), s.data_ptr(), int(portable)
    )
    if rc != 0:
        raise ValueError(f"int8 quantizer refused x of shape {tuple(x.shape)}")
    return q, d, s


def _check_weight(x: torch.Tensor, weight: BlockQuantWeight) -> None:
    _check_x(x)
    if not isinstance(weight, BlockQuantWeight):
        raise ValueError(f"int8 matmul needs a BlockQuantWeight, got {type(weight).__name__}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"x has K = {x.shape[1]}, the weight is {weight.shape} ([N, K])")


def int8_block_linear_reference(x: torch.Tensor, weight: BlockQuantWeight) -> torch.Tensor:
    """x float32 [M, K] @ weight^T -> float32 [M, N] by the int8 math, in plain PyTorch:
    the reference quantizer, per-block dot products exact in int64, the scaled sum in
    float64 (rounded to float32 once at the end)."""
    _check_weight(x, weight)
    q, d, s = quantize_activations_reference(x)
    m, k = x.shape
    n = weight.shape[0]
    kb = k // BLOCK
    qx = q.reshape(m, kb, BLOCK).to(torch.int64)  # [M, KB, 32]
    if weight.kind == "q4":
        b = weight.qs.view(n, kb, 16).to(torch.int64)
        qw = torch.cat([b & 15, b >> 4], dim=-1)  # [N, KB, 32] in 0..15
        dw = weight.scales[..., 0].double()  # [N, KB]
        mw = weight.scales[..., 1].double()
    else:
        qw = weight.qs.view(n, kb, BLOCK).to(torch.int64)
        dw = weight.scales.double()
        mw = torch.zeros_like(dw)
    dots = torch.einsum("mbi,nbi->mnb", qx, qw)  # [M, N, KB] exact
    dd = (dw.float()[None, :, :] * d[:, None, :]).double()  # float32 product, as the kernel
    y = (dots.double() * dd).sum(-1) + s.double() @ mw.T  # [M, N]
    return y.float()


def int8_block_linear(
    x: torch.Tensor, weight: BlockQuantWeight, *, portable: bool = False
) -> torch.Tensor | None:
    """x float32 [M, K] @ weight^T -> float32 [M, N] by llama.cpp-style int8 dot products
    (activations quantized per 32-block here, then one C call); `portable`: the plain C
    loops instead of the AVX2 ones. None (nothing computed) where the library is not
    built. Raises ValueError for another dtype, a K that is not a multiple of 32 or does
    not match the weight."""
    _check_weight(x, weight)
    kernels = _get()
    if kernels.matmul is None:
        return None
    q, d, s = quantize_activations(x, portable=portable)
    m = x.shape[0]
    n, k = weight.shape
    out = torch.empty((m, n), dtype=torch.float32)
    rc = kernels.matmul(
        _KIND[weight.kind],
        q.data_ptr(),
        d.data_ptr(),
        s.data_ptr(),
        m,
        k,
        weight.qs.data_ptr(),
        weight.scales.data_ptr(),
        out.data_ptr(),
        n,
        n,
        int(portable),
    )
    return out if rc == 0 else None


PANEL_COLUMNS = 16  # output columns interleaved in one panel (int8_panels.c)


@dataclass(frozen=True)
class Int8Panels:
    """A Q4 or Q8 weight [N, K] repacked for `int8_panels.c`: columns in panels of 16
    interleaved, one byte a weight (twice the Q4 blocks' bytes, the Q8 blocks' own).

    qs uint8 [P, K/32, 8, 16, 4] (P = ceil(N / 16)): per panel and block, run r holds each
    of the 16 columns' weights 4r .. 4r+3 (column c at bytes 4c .. 4c+3 of the run; padding
    columns 0): one 512-bit vector, or two 256-bit halves of 8 columns. Q4 values 0..15, or
    Q8 values + 128; scales float32 [P, K/32, 2, 16]: the 16 columns' block scales d, then
    their minimums m (Q8: -128 d, which takes the offset
    back out through the activations' block sums). shape: the weight's (N, K); kind: "q4"
    or "q8".
    """

    qs: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, int]
    kind: str

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales))


def int8_panels_take(kind: str) -> bool:
    """Whether this build's panel kernel computes `kind` ("q4", "q8") weights on its
    vector path: Q4 wherever the AVX2 kernels are built, Q8 only with VPDPBUSD (their
    values + 128 would saturate VPMADDUBSW's int16 sums)."""
    kernels = _get()
    return kernels.panels is not None and kernels.avx2 and (kind == "q4" or kernels.vnni)


def pack_int8_panels(weight: BlockQuantWeight) -> Int8Panels:
    """The weight's panels (`Int8Panels`). ValueError for anything but Q4/Q8 blocks."""
    if not isinstance(weight, BlockQuantWeight) or weight.kind not in ("q4", "q8"):
        got = weight.kind if isinstance(weight, BlockQuantWeight) else type(weight).__name__
        raise ValueError(f"int8 panels are built from q4 or q8 block weights, got {got}")
    n, k = weight.shape
    kb = k // BLOCK
    groups = -(-n // PANEL_COLUMNS)
    pad = groups * PANEL_COLUMNS - n
    if weight.kind == "q4":
        b = weight.qs.view(n, kb, 16)
        q = torch.cat([b & 15, b >> 4], dim=-1)  # [N, KB, 32] in 0..15
        scales = weight.scales  # [N, KB, 2]: d, m
    else:
        # [N, KB, 32] int8 -> q + 128 in 0..255: unsigned, as VPDPBUSD's first operand
        q = (weight.qs.view(n, kb, BLOCK).to(torch.int16) + 128).to(torch.uint8)
        d = weight.scales.view(n, kb)
        scales = torch.stack([d, d * -128.0], dim=-1)  # [N, KB, 2]; exact (a power of 2)
    if pad:
        q = torch.cat([q, q.new_zeros(pad, kb, BLOCK)])
        scales = torch.cat([scales, scales.new_zeros(pad, kb, 2)])
    # [P, 16 cols, KB, 8 runs, 4] -> [P, KB, 8 runs, 16 cols, 4]
    qs = q.view(groups, PANEL_COLUMNS, kb, 8, 4).permute(0, 2, 3, 1, 4).contiguous()
    # [P, 16 cols, KB, 2] -> [P, KB, 2, 16 cols]
    sc = scales.view(groups, PANEL_COLUMNS, kb, 2).permute(0, 2, 3, 1).contiguous()
    return Int8Panels(qs, sc, (n, k), weight.kind)


def int8_panels_linear(
    x: torch.Tensor, panels: Int8Panels, *, portable: bool = False
) -> torch.Tensor | None:
    """`int8_block_linear` on the weight's panels (`pack_int8_panels`): the same math (the
    same result up to float32 summation order), computed 8 or 16 columns a vector. None where
    the library is not built. Raises ValueError as `int8_block_linear` does, and for Q8
    panels where the vector kernel cannot take them (`int8_panels_take`) unless
    `portable`."""
    _check_x(x)
    if not isinstance(panels, Int8Panels):
        raise ValueError(f"int8 panel matmul needs Int8Panels, got {type(panels).__name__}")
    n, k = panels.shape
    if x.shape[1] != k:
        raise ValueError(f"x has K = {x.shape[1]}, the weight is {panels.shape} ([N, K])")
    kernels = _get()
    if kernels.panels is None:
        return None
    if not portable and kernels.avx2 and not int8_panels_take(panels.kind):
        raise ValueError(
            f"{panels.kind} panels need VPDPBUSD (AVX512-VNNI or AVX-VNNI), which this "
            "build lacks; keep the block layout (int8_block_linear) or pass portable=True"
        )
    q, d, s = quantize_activations(x, portable=portable)
    m = x.shape[0]
    out = torch.empty((m, n), dtype=torch.float32)
    rc = kernels.panels(
        q.data_ptr(),
        d.data_ptr(),
        s.data_ptr(),
        m,
        k,
        panels.qs.data_ptr(),
        panels.scales.data_ptr(),
        out.data_ptr(),
        n,
        n,
        4 if panels.kind == "q4" else 8,
        int(portable),
    )
    return out if rc == 0 else None
