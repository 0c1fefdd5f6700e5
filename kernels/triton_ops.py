"""The Triton backend's elementwise ops: RMSNorm (with the residual add), RoPE, SiLU-and-
multiply, one kernel launch each instead of torch's 4-9 (CUDA; Triton's interpreter on a
CPU, which is how they are tested).

The torch versions (`sarazmq.kernels.ops`, `TORCH_OPS`) are the reference, rounding for
rounding: each intermediate that torch stores in the model's dtype is rounded to it here
too (`_rounded`, by integer arithmetic for bf16), so that results agree with torch's but
for float32 summation order in the RMSNorm's mean and the exponential of SiLU (a last-bit
difference, rarely). A decode step of an 8B model runs
~1,000 torch kernels op by op; these take ~600 of them away, which is launch overhead
on the host in an eager step and launch latency on the GPU in a replayed CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cpu_ops import HotOps


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """float32 x rounded to the nearest `dtype` value (ties to even), kept in float32.
    bf16 by integer arithmetic on the bits: a conversion pair the compiler could fold
    away, or the interpreter's truncating conversion, cannot change it."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, s_x, s_r, s_o, n_cols, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = x_ptr.dtype.element_ty
    xf = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        # residual.add_(x): the sum rounded to the model's dtype, stored back
        res = tl.load(res_ptr + row * s_r + cols, mask=mask, other=0.0).to(tl.float32)
        xf = _rounded(res + xf, dtype)
        tl.store(res_ptr + row * s_r + cols, xf.to(dtype), mask=mask)
    variance = tl.sum(xf * xf, axis=0) / n_cols
    normed = _rounded(xf * tl.rsqrt(variance + eps), dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = _rounded(normed * w, dtype)
    tl.store(out_ptr + row * s_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, s_xt, s_xh, s_ct, s_st, num_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    half = head_dim // 2
    mask = (h[:, None] < num_heads) & (d[None, :] < head_dim)
    row = x_ptr + t * s_xt + h[:, None] * s_xh  # [BLOCK_H, 1]
    x = tl.load(row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    swapped = tl.load(row + ((d + half) % head_dim)[None, :], mask=mask, other=0.0)
    cos = tl.load(cos_ptr + t * s_ct + d, mask=d < head_dim, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * s_st + d, mask=d < head_dim, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    # x * cos + roll(x) * sin_signed, each product rounded as torch's in-place ops do
    a = _rounded(x * cos[None, :], dtype)
    b = _rounded(swapped.to(tl.float32) * sin[None, :], dtype)
    tl.store(row + d[None, :], _rounded(a + b, dtype).to(dtype), mask=mask)


@triton.jit
def _silu_mul_kernel(
    x_ptr, out_ptr, s_x, s_o, inter, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * s_x + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    # F.silu's value, rounded to the dtype, then the product rounded (torch's mul_)
    silu = _rounded(g / (1.0 + tl.exp(-g)), dtype)
    out = _rounded(silu * up.to(tl.float32), dtype)
    tl.store(out_ptr + row * s_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


_SILU_BLOCK = 1024
#: whether these kernels run under Triton's interpreter (TRITON_INTERPRET=1 at import)
INTERPRETED: bool = not isinstance(_rms_norm_kernel, triton.runtime.jit.JITFunction)


class TritonOps(HotOps):
    """`HotOps` with RMSNorm, RoPE and SiLU-and-multiply as one Triton kernel each, where
    the tensors fit them (rows with a unit last stride); anything else goes to the torch
    reference. Matmuls stay torch's (cuBLAS)."""

    name = "triton"

    def rms_norm_(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] (+ residual [T, hidden], updated in place) -> (normed, residual)."""
        if (
            x.dim() != 2
            or x.stride(1) != 1
            or weight.shape != x.shape[1:]
            or weight.dtype != x.dtype
            or not weight.is_contiguous()
            or (residual is not None and (residual.shape != x.shape or residual.stride(1) != 1))
            or (residual is not None and residual.dtype != x.dtype)
        ):
            return super().rms_norm_(x, weight, eps, residual)
        rows, cols = x.shape
        out = torch.empty_like(x, memory_format=torch.contiguous_format)  # [T, hidden]
        if rows:
            res = x if residual is None else residual
            _rms_norm_kernel[(rows,)](
                x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), cols, eps,
                HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(cols),
            )  # fmt: skip
        return out, (x if residual is None else residual)

    def apply_rope_(
        self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
    ) -> torch.Tensor:
        """x [T, heads, D] rotated in place by cos, sin_signed [T, 1, D]; returns x."""
        t, heads, d = x.shape
        if (
            x.stride(2) != 1
            or cos.shape != (t, 1, d)
            or sin_signed.shape != (t, 1, d)
            or cos.stride(2) != 1
            or sin_signed.stride(2) != 1
            or d % 2
        ):
            return super().apply_rope_(x, cos, sin_signed)
        if t:
            _rope_kernel[(t,)](
                x, cos, sin_signed, x.stride(0), x.stride(1), cos.stride(0),
                sin_signed.stride(0), heads, d,
                BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(d),
            )  # fmt: skip
        return x

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        """gate_up [T, 2 * inter] (gate, then up) -> silu(gate) * up [T, inter]."""
        if gate_up.dim() != 2 or gate_up.shape[1] != 2 * inter or gate_up.stride(1) != 1:
            return super().silu_mul(gate_up, inter)
        rows = gate_up.shape[0]
        out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
        if rows:
            grid = (rows, triton.cdiv(inter, _SILU_BLOCK))
            _silu_mul_kernel[grid](
                gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=_SILU_BLOCK
            )
        return out


TRITON_OPS = TritonOps()
