"""The Triton backend's RMSNorm, RoPE and SiLU-and-multiply kernels (sarazmq.kernels.
triton_ops) against the torch reference ops, under Triton's CPU interpreter: the residual
add and RoPE bit for bit (their roundings are torch's), the norm and SiLU-and-multiply
within two units in the last place (float32 summation order in the norm's mean, the
exponential's last bit)."""

from __future__ import annotations

import pytest
import torch
from triton_interpreted import interpreted_kernels

from sarazmq.kernels.cpu_ops import TORCH_OPS
from sarazmq.kernels.ops import build_rope_cache, rope_cos_sin

(triton_ops,) = interpreted_kernels("triton_ops")
OPS = triton_ops.TRITON_OPS
# bf16: 2 units in the last place (2**-7 relative each)
TOL = {torch.float32: {"atol": 1e-6, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2}}


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, cols", [(1, 48), (5, 100), (3, 576)])
def test_rms_norm_with_and_without_residual_matches_torch(
    dtype: torch.dtype, rows: int, cols: int
) -> None:
    x = _randn(rows, cols, dtype=dtype, seed=1) * 3
    w = _randn(cols, dtype=dtype, seed=2)
    res = _randn(rows, cols, dtype=dtype, seed=3)
    out, same = OPS.rms_norm_(x, w, 1e-5, None)
    ref, _ = TORCH_OPS.rms_norm_(x.clone(), w, 1e-5, None)
    assert same is x
    torch.testing.assert_close(out, ref, **TOL[dtype])
    res_ref = res.clone()
    out, new_res = OPS.rms_norm_(x, w, 1e-5, res)
    ref, ref_res = TORCH_OPS.rms_norm_(x.clone(), w, 1e-5, res_ref)
    assert new_res is res  # updated in place, as the reference does
    assert torch.equal(new_res, ref_res)  # one rounded add: exact in every dtype
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_rms_norm_of_strided_rows_and_no_rows() -> None:
    # a column slice (row stride > width) runs the kernel; a transposed view falls back
    base = _randn(4, 70, dtype=torch.float32, seed=4)
    w = _randn(64, dtype=torch.float32, seed=5)
    out, _ = OPS.rms_norm_(base[:, 3:67], w, 1e-6, None)
    torch.testing.assert_close(out, TORCH_OPS.rms_norm_(base[:, 3:67], w, 1e-6, None)[0])
    t = _randn(64, 4, dtype=torch.float32, seed=6).t()
    torch.testing.assert_close(
        OPS.rms_norm_(t, w, 1e-6, None)[0], TORCH_OPS.rms_norm_(t, w, 1e-6, None)[0]
    )
    empty, _ = OPS.rms_norm_(torch.empty(0, 64), w, 1e-6, None)
    assert empty.shape == (0, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, heads", [(8, (6, 2)), (64, (3, 1)), (32, (5, 5))])
def test_rope_in_place_on_the_qk_heads_of_a_fused_projection(
    dtype: torch.dtype, head_dim: int, heads: tuple[int, int]
) -> None:
    # x: the q and k heads of a [T, (H + 2 Hkv) * D] qkv row, as the model rotates them
    t, (h, hkv) = 7, heads
    qkv = _randn(t, (h + 2 * hkv) * head_dim, dtype=dtype, seed=7)
    cache = build_rope_cache(head_dim, 64, 10000.0, None, "cpu")
    positions = torch.tensor([0, 3, 4, 17, 18, 40, 63])
    cos, sin = rope_cos_sin(positions, cache, dtype)
    qk_ref = qkv.clone()[:, : (h + hkv) * head_dim].view(t, -1, head_dim)
    ref = TORCH_OPS.apply_rope_(qk_ref.clone(), cos, sin)
    qk = qkv[:, : (h + hkv) * head_dim].view(t, -1, head_dim)
    before_v = qkv[:, (h + hkv) * head_dim :].clone()
    assert OPS.apply_rope_(qk, cos, sin) is qk
    assert torch.equal(qk, ref)  # products and sum rounded as torch's: bit for bit
    assert torch.equal(qkv[:, (h + hkv) * head_dim :], before_v)  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, inter", [(1, 64), (3, 37), (2, 1100)])
def test_silu_mul_matches_torch(dtype: torch.dtype, rows: int, inter: int) -> None:
    gate_up = _randn(rows, 2 * inter, dtype=dtype, seed=8) * 4
    torch.testing.assert_close(
        OPS.silu_mul(gate_up, inter), TORCH_OPS.silu_mul(gate_up, inter), **TOL[dtype]
    )
    assert OPS.silu_mul(gate_up[:0], inter).shape == (0, inter)
