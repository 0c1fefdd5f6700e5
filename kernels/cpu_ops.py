"""Fused RMSNorm(+residual), RoPE, SiLU-and-multiply and 1-3-row matmuls in C
(kernels/csrc/cpu_ops.c).

`HotOps` is the interface the model calls for its elementwise work and its matmuls;
`TORCH_OPS` is the plain-PyTorch implementation (sarazmq.kernels.ops, the reference),
`NativeCpuOps` the C one, each op falling back to the reference where the kernel does not
apply (device, dtype, strides). Same numerics as the reference up to float32 summation
order in the RMSNorm reduction and SiLU's exp (within ~2 ulp of torch's: float32 results
can differ in the last bit, bf16 ones practically never).

Matmuls (`HotOps.linear`, on a `LinearWeight`) of decode steps with at most
`GEMV_MAX_ROWS` rows go to a C matrix-vector kernel that streams the weights near the
machine's read bandwidth, faster there than oneDNN's packed matmul, which keeps the
larger ones (docs/KERNELS.md, "GEMV_MAX_ROWS"). Float32 sums run in another order than
the library's: results may differ in the last bit. Where the weight also holds a GGUF's
quantized blocks, those rows read the blocks instead (sarazmq.kernels.block_quant):
bitwise the same result.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from .block_quant import block_quant_covers, block_quant_linear
from .int8_dot import int8_block_linear, int8_panels_linear
from .linear_amx import (
    amx_linear_available,
    linear_tiles,
    linear_tiles_into_f32,
    silu_mul_tiles,
)
from .linear_weight import LinearWeight
from .native import cpu_has_flag, load_library
from .ops import apply_rope_, linear, rms_norm_

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "rms_norm": [_P, _L, _P, _L, _P, _P, _L, _L, _I, _F],
    "rope": [_P, _L, _P, _P, _L, _I, _I],
    "silu_mul": [_P, _L, _P, _L, _L, _I],
}
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_ROPE_MAX_D = 512
# rows up to which the C matrix-vector kernel beats oneDNN's prepacked matmul on the
# default model's matmuls (the kernel takes up to 8): docs/KERNELS.md, "GEMV_MAX_ROWS"
GEMV_MAX_ROWS = {torch.bfloat16: 3, torch.float32: 3}
# ... for a weight that holds GGUF blocks: on CPUs with AVX2 but no AVX-512 the float32
# block kernel dequantizes each weight tile once for all rows and beats oneDNN's float32
# matmul up to the 64 rows it takes (docs/KERNELS.md, "GEMV_MAX_ROWS")
GEMV_MAX_ROWS_BLOCKS = {
    torch.bfloat16: GEMV_MAX_ROWS[torch.bfloat16],
    torch.float32: GEMV_MAX_ROWS[torch.float32] if cpu_has_flag("avx512f") else 64,
}
# ... for a weight that holds AMX tiles (`LinearWeight.tiles`): the tile kernel, which
# streams the weights too, wins from 2 rows (docs/PERF_LOG.md, "Seventh round")
GEMV_MAX_ROWS_TILES = 1
_GEMV_KERNEL_ROWS = 8  # GEMV_MAX_ROWS of kernels.h: the most rows one call takes
_GEMV_ARGTYPES = [_P, _L, _P, _P, _L, _I, _I, _I]


def int8_blocks_linear(x: torch.Tensor, weight: LinearWeight) -> torch.Tensor | None:
    """x [T, in] float32 @ the owner's blocks^T (+ bias) -> [T, out] by int8 dot products
    where the owner is set to (`LinearWeight.int8_blocks`); None where it is not, or for
    rows the kernel does not take (another dtype or device, a build without it)."""
    blocks = weight.blocks
    if (
        not weight.int8_blocks
        or blocks is None
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or x.dim() != 2
        or x.shape[1] != weight.in_features
    ):
        return None
    panels = weight.int8_panels
    # [T, out]
    out = int8_block_linear(x, blocks) if panels is None else int8_panels_linear(x, panels)
    if out is not None and weight.bias is not None:
        out += weight.bias
    return out


class HotOps:
    """The model's elementwise ops and matmuls, plain PyTorch (the reference for
    `NativeCpuOps`)."""

    name = "torch"
    # whether `linear` reads a weight's AMX tile layout (`LinearWeight.tiles`), so that
    # the model packs its weights into it instead of oneDNN's layout
    reads_tiles: bool = False

    def rms_norm_(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See `sarazmq.kernels.ops.rms_norm_`: (normed, residual after adding x)."""
        return rms_norm_(x, weight, eps, residual)

    def linear(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        """x [T, in] @ weight [out, in]^T (+ bias) -> [T, out], see
        `sarazmq.kernels.ops.linear`: through the owner's prepacked oneDNN weight where it
        holds one, else its plain weight; by int8 dot products on its blocks where it is
        set to (`LinearWeight.int8_blocks`, float32 rows)."""
        out = int8_blocks_linear(x, weight)
        if out is not None:
            return out
        return linear(x, weight.weight, weight.bias, weight.packed)

    def linear_into_f32(
        self, x: torch.Tensor, weight: LinearWeight, out: torch.Tensor
    ) -> torch.Tensor:
        """`linear` into float32 out [T, out] (what the LM head's logits go to): the same
        values, widened; returns out. Backends may skip the intermediate."""
        return out.copy_(self.linear(x, weight))

    def needs_plain(self, weight: LinearWeight) -> bool:
        """Whether some `linear` call of these ops would read the owner's plain weight
        (so that `LinearWeight.drop_plain` would change a result or fail): here, wherever
        it has no packed copy."""
        return weight.packed is None

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        """gate_up [T, 2 * inter] (gate, then up) -> silu(gate) * up [T, inter]."""
        return F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])

    def linear_silu_mul(self, x: torch.Tensor, weight: LinearWeight, inter: int) -> torch.Tensor:
        """SwiGLU's projection and activation: silu_mul(linear(x, weight), inter) for a
        gate/up weight [2 * inter, in] -> [T, inter]; backends may fuse the two."""
        return self.silu_mul(self.linear(x, weight), inter)

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


def _gemv_max_rows(weight: LinearWeight) -> int:
    # rows of this weight's matmuls that the C matrix-vector kernels take
    if weight.tiles is not None:
        return GEMV_MAX_ROWS_TILES
    if weight.blocks is not None:
        return GEMV_MAX_ROWS_BLOCKS[weight.dtype]
    return GEMV_MAX_ROWS[weight.dtype]


def _rows_ok(t: torch.Tensor) -> bool:
    # 2-d, CPU, unit stride along the row (any row stride)
    return t.dim() == 2 and t.device.type == "cpu" and t.stride(1) == 1


def _run_gemv(fn: ctypes._CFuncPtr, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] (rows checked by the caller) @ weight [N, K]^T (contiguous) -> [M, N]
    through gemv_f32 / gemv_bf16; None where the kernel does not cover the sizes."""
    rows, (n, k) = x.shape[0], weight.shape
    out = torch.empty((rows, n), dtype=x.dtype)
    if fn(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), n, rows, n, k) != 0:
        return None
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """The C matrix-vector kernel alone (gemv_f32 / gemv_bf16, the one `NativeCpuOps.linear`
    runs up to GEMV_MAX_ROWS rows and the fused decode step up to 8): x [M, K] (1 to 8
    rows, unit column stride) @ weight [N, K]^T (contiguous, x's dtype) -> [M, N]; None
    where it does not apply (no kernels, another dtype, sizes it does not cover)."""
    fns = _native_functions()
    fn = None if fns is None else fns.get(("gemv", x.dtype))
    if (
        fn is None
        or not _rows_ok(x)
        or not 1 <= x.shape[0] <= _GEMV_KERNEL_ROWS
        or weight.dtype != x.dtype
        or weight.dim() != 2
        or not weight.is_contiguous()
        or weight.device.type != "cpu"
        or weight.shape[1] != x.shape[1]
    ):
        return None
    return _run_gemv(fn, x, weight)


class NativeCpuOps(HotOps):
    """`HotOps` in C (see module docstring); raises ValueError when the kernels cannot be
    built, so callers decide on a fallback once, not per op."""

    name = "cpu"

    def __init__(self) -> None:
        fns = _native_functions()
        if fns is None:
            raise ValueError("native CPU ops unavailable: kernels/csrc/cpu_ops.c did not build")
        self._fns = fns
        self.reads_tiles = amx_linear_available()

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

    def linear(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        """x [T, in] -> [T, out] as `HotOps.linear`; 1 to `GEMV_MAX_ROWS` rows of a
        bias-free weight read its blocks where it holds them, else its plain weight
        through the C matrix-vector kernel; more rows its AMX tiles where it holds them.
        Every row reads the blocks by int8 dot products where the owner is set to
        (`LinearWeight.int8_blocks`), except blocks without int8 panels (Q8 on builds
        without VPDPBUSD) within those rows: int8_dot.c on the file's layout is no faster
        than the float block kernel there (docs/KERNELS.md), which is the float path's
        result."""
        fn = self._fns.get(("gemv", x.dtype))
        gemv_rows = not (
            fn is None
            or weight.bias is not None
            or not _rows_ok(x)
            or not 1 <= x.shape[0] <= _gemv_max_rows(weight)
            or weight.dtype != x.dtype
            or weight.device.type != "cpu"
            or weight.in_features != x.shape[1]
        )
        if not (gemv_rows and weight.blocks is not None and weight.int8_panels is None):
            out = int8_blocks_linear(x, weight)
            if out is not None:
                return out
        if not gemv_rows:
            return self._many_rows(x, weight)
        if weight.blocks is not None:
            # the quantized blocks hold exactly the plain weight, and their kernel sums as
            # the plain one does: the same result from a fraction of the bytes
            out = block_quant_linear(x, weight.blocks)
            if out is not None:
                return out
        plain = weight.weight
        if plain is None or not plain.is_contiguous():
            return self._many_rows(x, weight)  # only the packed copy is left, or strided
        out = _run_gemv(fn, x, plain)
        if out is None:
            return self._many_rows(x, weight)  # sizes the kernel does not cover
        return out

    def _many_rows(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        # the tile kernel where the weight holds its layout, else oneDNN / F.linear
        if weight.tiles is not None:
            out = linear_tiles(x, weight.tiles, weight.out_features)
            if out is not None:
                return out
        return super().linear(x, weight)

    def linear_into_f32(
        self, x: torch.Tensor, weight: LinearWeight, out: torch.Tensor
    ) -> torch.Tensor:
        """As `HotOps.linear_into_f32`; where `linear` would run the AMX tiles, they write
        the widened outputs straight into out (the same bits, no bf16 copy to read back)."""
        if (
            weight.tiles is not None
            and x.shape[0] > _gemv_max_rows(weight)
            and linear_tiles_into_f32(x, weight.tiles, out)
        ):
            return out
        return super().linear_into_f32(x, weight, out)

    def needs_plain(self, weight: LinearWeight) -> bool:
        """Also where rows within `GEMV_MAX_ROWS` would read it: a weight without a bias
        whose blocks do not cover every such row count (the C kernel reads the plain
        weight there, and the packed copy would sum in another order)."""
        if weight.packed is None and weight.tiles is None:
            return True
        if weight.bias is not None or ("gemv", weight.dtype) not in self._fns:
            return False  # every call goes to the packed copy
        blocks = weight.blocks
        return blocks is None or not all(
            block_quant_covers(weight.dtype, rows, blocks)
            for rows in range(1, _gemv_max_rows(weight) + 1)
        )

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        fn = self._fns.get(("silu_mul", gate_up.dtype))
        if fn is None or not _rows_ok(gate_up) or gate_up.shape[1] != 2 * inter:
            return super().silu_mul(gate_up, inter)
        rows = gate_up.shape[0]
        out = torch.empty((rows, inter), dtype=gate_up.dtype)
        fn(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), inter, rows, inter)
        return out

    def linear_silu_mul(self, x: torch.Tensor, weight: LinearWeight, inter: int) -> torch.Tensor:
        """As `HotOps.linear_silu_mul`; where `linear` would run the AMX tiles (more rows
        than the C matrix-vector kernel takes) and the C `silu_mul` would follow, one tile
        pass computes the activation from the products directly: the same bits, without
        writing and re-reading the [T, 2 * inter] gate/up rows."""
        if (
            weight.tiles is not None
            and x.shape[0] > _gemv_max_rows(weight)
            and ("silu_mul", torch.bfloat16) in self._fns
            and weight.out_features == 2 * inter
        ):
            out = silu_mul_tiles(x, weight.tiles, inter)
            if out is not None:
                return out
        return super().linear_silu_mul(x, weight, inter)

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
