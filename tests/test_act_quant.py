"""The float32 hybrid step's fused producers (kernels/csrc/act_quant.c,
sarazmq.kernels.act_quant): RMSNorm or SwiGLU straight into quantized rows, bitwise the
native pass followed by the quantizer (which `test_int8_dot` pins to its plain-PyTorch
reference), and both thread counts alike."""

from __future__ import annotations

import pytest
import torch

from sarazmq.kernels.act_quant import rms_norm_quantize, silu_mul_quantize
from sarazmq.kernels.cpu_ops import NativeCpuOps
from sarazmq.kernels.int8_dot import int8_dot_available, quantize_activations

pytestmark = pytest.mark.skipif(not int8_dot_available(), reason="no C compiler")


def _equal(a: tuple[torch.Tensor, ...] | None, b: tuple[torch.Tensor, ...]) -> None:
    assert a is not None
    for got, want in zip(a, b, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


# rows past 32 run on every OpenMP thread; hidden 576 = 16 blocks + 2, 1024 = 2 x 16
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("hidden", [96, 576, 1024])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quantize_is_norm_then_quantizer(
    rows: int, hidden: int, with_residual: bool
) -> None:
    g = torch.Generator().manual_seed(rows * hidden)
    wide = torch.randn(rows, hidden + 24, generator=g) * 3
    x = wide[:, :hidden]  # a strided row view
    weight = torch.randn(hidden, generator=g)
    res = torch.randn(rows, hidden, generator=g) if with_residual else None
    res_native = None if res is None else res.clone()
    normed, new_res = NativeCpuOps().rms_norm_(x, weight, 1e-5, res_native)
    got = rms_norm_quantize(x, weight, 1e-5, res)
    _equal(got, quantize_activations(normed))
    if res is not None:
        assert torch.equal(res, new_res)  # the residual updated in place, as the norm does


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("inter", [64, 1536])
def test_silu_mul_quantize_is_swiglu_then_quantizer(rows: int, inter: int) -> None:
    g = torch.Generator().manual_seed(rows + inter)
    wide = torch.randn(rows, 2 * inter + 8, generator=g) * 6
    wide[0, :6] = torch.tensor([100.0, -100.0, 89.0, -89.0, 0.0, -1e-30])  # exp's edges
    gate_up = wide[:, : 2 * inter]
    _equal(
        silu_mul_quantize(gate_up), quantize_activations(NativeCpuOps().silu_mul(gate_up, inter))
    )


def test_operands_not_taken_write_nothing() -> None:
    x = torch.randn(3, 48)  # not a multiple of 32
    assert rms_norm_quantize(x, torch.ones(48), 1e-5) is None
    assert rms_norm_quantize(torch.randn(3, 64).bfloat16(), torch.ones(64).bfloat16(), 1e-5) is None
    assert rms_norm_quantize(torch.randn(3, 64), torch.ones(32), 1e-5) is None  # weight size
    res = torch.randn(2, 64)
    res_before = res.clone()
    assert rms_norm_quantize(torch.randn(3, 64), torch.ones(64), 1e-5, res) is None
    assert torch.equal(res, res_before)  # a residual of the wrong shape is left untouched
    assert silu_mul_quantize(torch.randn(2, 96)) is None  # inter 48
    assert silu_mul_quantize(torch.randn(2, 128).t().contiguous().t()) is None  # column stride
