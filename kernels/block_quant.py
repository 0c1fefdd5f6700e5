"""GGUF block-quantized weights kept as stored, for decode (kernels/csrc/block_quant.c).

A model loaded from a GGUF file holds the dequantized weights: 4 bytes per weight in
float32, 2 in bf16, where the file stores 0.56-1.06. Decode steps of a few sequences are
bound by streaming those weights, so the loader also keeps the file's Q4_0 / Q4_1 / Q8_0
blocks (`BlockQuantWeight`), and the matrix-vector kernel dequantizes them in registers
into the very values the model holds (bf16: rounded to bf16 as the model's weights were)
and sums them in the plain kernel's order: bitwise the same result from 0.75 bytes a Q4
weight (the scales widened to float32). Nothing is re-quantized and no accuracy is
traded; it is the checkpoint's own precision.

`block_quant_linear` is the entry point (None where the kernel does not apply: more rows
than it takes, another dtype); `BlockQuantWeight.dequantize` is the plain-PyTorch
reference, equal to `gguf.quants.dequantize` bit for bit.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from .native import load_library

BLOCK = 32  # weights per block, all three formats
# GGUF type name -> (kind, bytes per block)
GGUF_BLOCK_FORMATS = {"Q4_0": ("q4", 18), "Q4_1": ("q4", 20), "Q8_0": ("q8", 34)}
_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_ARGTYPES = [_P, _L, _P, _P, _P, _L, _I, _I, _I]


@dataclass(frozen=True)
class BlockQuantWeight:
    """A [N, K] weight as 32-weight blocks along K (K a multiple of 32).

    kind "q4": qs uint8 [N, K/2] (per block the GGUF's 16 bytes: byte j holds weight j in
    its low nibble and weight j + 16 in its high one), scales float32 [N, K/32, 2] = (d, m),
    weight = d * q + m (Q4_0 is stored with m = -8 d). kind "q8": qs int8 [N, K], scales
    float32 [N, K/32] = d, weight = d * q.
    """

    kind: str
    qs: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        if self.kind not in ("q4", "q8"):
            raise ValueError(f"block quant kind must be 'q4' or 'q8', got {self.kind!r}")
        n, k = self.shape
        want_qs = (n, k // 2) if self.kind == "q4" else (n, k)
        want_sc = (n, k // BLOCK, 2) if self.kind == "q4" else (n, k // BLOCK)
        qs_dtype = torch.uint8 if self.kind == "q4" else torch.int8
        if (
            k % BLOCK != 0
            or tuple(self.qs.shape) != want_qs
            or self.qs.dtype != qs_dtype
            or tuple(self.scales.shape) != want_sc
            or self.scales.dtype != torch.float32
            or not (self.qs.is_contiguous() and self.scales.is_contiguous())
        ):
            raise ValueError(
                f"{self.kind} block weight: qs {tuple(self.qs.shape)} {self.qs.dtype}, scales "
                f"{tuple(self.scales.shape)} {self.scales.dtype} do not describe a contiguous "
                f"[{n}, {k}] matrix"
            )

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the weight matrix."""
        n = self.qs.shape[0]
        k = self.scales.shape[1] * BLOCK
        return n, k

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] weight (the reference: gguf's dequantize, bit for bit)."""
        n, k = self.shape
        if self.kind == "q4":
            b = self.qs.view(n, k // BLOCK, 16).to(torch.int32)
            q = torch.cat([b & 15, b >> 4], dim=-1).to(torch.float32)  # [N, K/32, 32]
            d, m = self.scales[..., 0:1], self.scales[..., 1:2]
            # d * q is exact in float32 (11 + 4 bits): one rounding, as an fma
            w = d * q + m
        else:
            w = self.qs.view(n, k // BLOCK, BLOCK).to(torch.float32) * self.scales[..., None]
        return w.reshape(n, k)

    def rows(self, index: torch.Tensor | slice) -> BlockQuantWeight:
        """The weight's rows at `index` (a permutation or a slice), as a new weight."""
        return BlockQuantWeight(
            self.kind, self.qs[index].contiguous(), self.scales[index].contiguous()
        )

    @staticmethod
    def cat_rows(parts: list[BlockQuantWeight]) -> BlockQuantWeight:
        """The parts stacked along N (a fused QKV or gate/up weight); one kind, one K."""
        kinds = {p.kind for p in parts}
        ks = {p.shape[1] for p in parts}
        if len(kinds) != 1 or len(ks) != 1:
            raise ValueError(f"cannot stack block weights of kinds {kinds} and widths {ks}")
        return BlockQuantWeight(
            parts[0].kind,
            torch.cat([p.qs for p in parts]),
            torch.cat([p.scales for p in parts]),
        )

    @property
    def nbytes(self) -> int:
        """Bytes held: the quantized values and their float32 scales."""
        return self.qs.numel() * self.qs.element_size() + self.scales.numel() * 4


def from_gguf_blocks(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> BlockQuantWeight:
    """The weight of a GGUF tensor from its raw blocks.

    data: uint8 [N, K / 32 * bytes per block] (gguf's `ReaderTensor.data`); type_name:
    "Q4_0", "Q4_1" or "Q8_0"; shape: (N, K). Raises ValueError for another type or size.
    """
    if type_name not in GGUF_BLOCK_FORMATS:
        raise ValueError(f"no block kernel for GGUF type {type_name}")
    kind, nbytes = GGUF_BLOCK_FORMATS[type_name]
    n, k = shape
    if k % BLOCK != 0 or data.dtype != np.uint8 or data.size != n * (k // BLOCK) * nbytes:
        raise ValueError(
            f"GGUF {type_name} tensor of {data.size} bytes ({data.dtype}) is not a [{n}, {k}] matrix"
        )
    blocks = np.ascontiguousarray(data).reshape(n, k // BLOCK, nbytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
    if type_name == "Q8_0":
        qs = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
        return BlockQuantWeight("q8", torch.from_numpy(qs), torch.from_numpy(d))
    if type_name == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:]
    else:  # Q4_0: weight = d * (q - 8) = d * q + (-8 d), both exact in float32
        m = -8.0 * d
        qs = blocks[..., 2:]
    scales = np.stack([d, m], axis=-1)  # [N, K/32, 2]
    return BlockQuantWeight(
        "q4",
        torch.from_numpy(np.ascontiguousarray(qs).reshape(n, k // 2)),
        torch.from_numpy(np.ascontiguousarray(scales)),
    )


_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


class _Kernels:
    def __init__(self) -> None:
        lib = load_library()
        self.fns: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}
        self.covers: dict[torch.dtype, ctypes._CFuncPtr] = {}
        self.available: dict[torch.dtype, bool] = {}
        if lib is None:
            return
        self.covers = {
            torch.float32: lib.gemv_q_f32_covers,
            torch.bfloat16: lib.gemv_q_bf16_covers,
        }
        for dtype, suffix in _SUFFIX.items():
            self.covers[dtype].argtypes = [_I, _I, _I]
            self.covers[dtype].restype = _I
            self.available[dtype] = bool(self.covers[dtype](1, 1, BLOCK))
            for kind in ("q4", "q8"):
                fn = getattr(lib, f"gemv_{kind}_{suffix}")
                fn.argtypes = _ARGTYPES
                fn.restype = _I
                self.fns[(kind, dtype)] = fn


_kernels: list[_Kernels] = []


def _get() -> _Kernels:
    if not _kernels:
        _kernels.append(_Kernels())
    return _kernels[0]


def block_quant_kernels_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the block matrix-vector kernels for `dtype` activations built for this CPU
    (float32: AVX-512, or AVX2 + FMA; bf16: AVX512-BF16)."""
    return _get().available.get(dtype, False)


def block_quant_covers(dtype: torch.dtype, rows: int, weight: BlockQuantWeight) -> bool:
    """Whether `block_quant_linear` computes (never returns None for) `rows` contiguous
    CPU rows of `dtype` activations against `weight`."""
    kernels = _get()
    covers = kernels.covers.get(dtype)
    n, k = weight.shape
    return (
        covers is not None
        and kernels.available.get(dtype, False)
        and (weight.kind, dtype) in kernels.fns
        and bool(covers(rows, n, k))
    )


def block_quant_linear(x: torch.Tensor, weight: BlockQuantWeight) -> torch.Tensor | None:
    """x [M, K] (float32 or bf16) @ weight^T -> [M, N] in x's dtype: bitwise `gemv_f32` /
    `gemv_bf16` on the dequantized weight (bf16: rounded to bf16, as a bf16 model holds it);
    None (nothing computed) where the kernel does not apply (another dtype or device, more
    than 64 rows (QGEMV_MAX_ROWS), a non-unit column stride, a build without the kernels).
    Rows are taken 8 at a time (GEMV_MAX_ROWS) per weight tile; within each group the sums
    are the plain kernel's."""
    kernels = _get()
    fn = kernels.fns.get((weight.kind, x.dtype))
    n, k = weight.shape
    if (
        fn is None
        or not kernels.available.get(x.dtype, False)
        or x.device.type != "cpu"
        or x.dim() != 2
        or x.shape[1] != k
        or x.stride(1) != 1
    ):
        return None
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype)
    rc = fn(
        x.data_ptr(),
        x.stride(0),
        weight.qs.data_ptr(),
        weight.scales.data_ptr(),
        out.data_ptr(),
        n,
        m,
        n,
        k,
    )
    return out if rc == 0 else None
