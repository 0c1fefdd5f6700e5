"""int8 matmuls on Q4 and Q8 weights in panels of 16 interleaved columns
(kernels/csrc/int8_panels.c, sarazmq.kernels.int8_dot.pack_int8_panels /
int8_panels_linear): the packing holds the blocks' weights and scales exactly, the kernel
(vector and portable loops) matches the exact-integer reference to float32 rounding at
every column count (partial last panels too), Q8 panels run only where VPDPBUSD is built
(else a clear error), and the owners of the model's weights build the panels for int8 and
use them."""

from __future__ import annotations

import pytest
import torch
from test_int8_dot import (
    PORTABLE,
    _assert_close_to_reference,
    _assert_same_at_thread_counts,
    _weight,
    _x,
)

from sarazmq.kernels.block_quant import BlockQuantWeight
from sarazmq.kernels.cpu_ops import int8_blocks_linear
from sarazmq.kernels.int8_dot import (
    PANEL_COLUMNS,
    Int8Panels,
    int8_block_linear_reference,
    int8_dot_available,
    int8_dot_avx2,
    int8_panels_linear,
    int8_panels_take,
    int8_panels_vector_bits,
    pack_int8_panels,
)
from sarazmq.kernels.linear_weight import LinearWeight
from sarazmq.kernels.native import cpu_has_flag

pytestmark = [
    pytest.mark.one_torch_thread,
    pytest.mark.skipif(not int8_dot_available(), reason="no C compiler"),
]


def _unpack(panels: Int8Panels) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The panels back to per-column rows: q uint8 [N, K], d and m float32 [N, K/32]."""
    n, k = panels.shape
    g, kb = panels.qs.shape[:2]
    q = panels.qs.permute(0, 3, 1, 2, 4).reshape(g * PANEL_COLUMNS, k)[:n]
    d = panels.scales[:, :, 0].permute(0, 2, 1).reshape(g * PANEL_COLUMNS, kb)[:n]
    m = panels.scales[:, :, 1].permute(0, 2, 1).reshape(g * PANEL_COLUMNS, kb)[:n]
    return q, d, m


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("n", [8, 13, 64])
def test_packing_holds_the_blocks(type_name: str, n: int) -> None:
    weight = _weight(n, 96, type_name, seed=n)
    panels = pack_int8_panels(weight)
    groups = -(-n // PANEL_COLUMNS)
    assert panels.shape == (n, 96)
    assert tuple(panels.qs.shape) == (groups, 3, 8, PANEL_COLUMNS, 4)
    assert tuple(panels.scales.shape) == (groups, 3, 2, PANEL_COLUMNS)
    assert panels.nbytes == groups * PANEL_COLUMNS * (96 + 2 * 3 * 4)
    q, d, m = _unpack(panels)
    b = weight.qs.view(n, 3, 16)
    assert torch.equal(q, torch.cat([b & 15, b >> 4], dim=-1).reshape(n, 96))
    assert torch.equal(d, weight.scales[..., 0]) and torch.equal(m, weight.scales[..., 1])
    assert panels.kind == "q4"
    # the padding columns of the last panel are zero weights with zero scales
    pad = groups * PANEL_COLUMNS - n
    if pad:
        assert not bool(panels.qs[-1, :, :, -pad:].any()) and not bool(
            panels.scales[-1, ..., -pad:].any()
        )


@pytest.mark.parametrize("n", [8, 13])
def test_q8_packing_offsets_the_values_and_moves_them_back_through_m(n: int) -> None:
    weight = _weight(n, 64, "Q8_0", seed=n)
    panels = pack_int8_panels(weight)
    assert panels.kind == "q8" and panels.shape == (n, 64)
    q, d, m = _unpack(panels)
    assert torch.equal(q.to(torch.int16) - 128, weight.qs.to(torch.int16))
    assert torch.equal(d, weight.scales) and torch.equal(m, weight.scales * -128.0)


def test_vector_width_follows_the_cpu() -> None:
    """512-bit VPDPBUSD panels wherever the CPU (or its SARAZMQ_CPU_ISA cap) has
    AVX512-VNNI, 256-bit ones on other AVX2 CPUs."""
    if not int8_dot_avx2():
        assert int8_panels_vector_bits() == 0
    elif all(cpu_has_flag(f) for f in ("avx512f", "avx512bw", "avx512_vnni")):
        assert int8_panels_vector_bits() == 512
    else:
        assert int8_panels_vector_bits() == 256


def _runs(type_name: str, portable: bool) -> bool:
    return portable or int8_panels_take("q8" if type_name == "Q8_0" else "q4")


@pytest.mark.parametrize("portable", PORTABLE)
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize(
    ("m", "n", "k"),
    # partial tiles of rows and panels, a partial last panel, several OpenMP spans (300)
    [(1, 37, 64), (2, 8, 32), (3, 64, 96), (5, 33, 576), (70, 50, 160), (6, 300, 64)],
)
def test_kernel_matches_reference(portable: bool, type_name: str, m: int, n: int, k: int) -> None:
    weight = _weight(n, k, type_name, seed=m + n + k)
    x = _x(m, k, seed=k)
    if not _runs(type_name, portable):
        with pytest.raises(ValueError, match="VPDPBUSD"):
            int8_panels_linear(x, pack_int8_panels(weight), portable=portable)
        return
    y = int8_panels_linear(x, pack_int8_panels(weight), portable=portable)
    assert y is not None and y.shape == (m, n) and y.dtype == torch.float32
    _assert_close_to_reference(y, int8_block_linear_reference(x, weight), x, weight)


def test_extreme_blocks() -> None:
    """The int16 sums at their largest: nibbles 15 against activations of +-127 in every
    position of a block (16 products of 1,905 per lane), zero scales, zero rows."""
    n, k, m = 19, 128, 5
    g = torch.Generator().manual_seed(3)
    qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    qs[0] = 0xFF
    qs[1] = 0
    scales = torch.rand(n, k // 32, 2, generator=g) * 100.0
    scales[2] = 0.0
    weight = BlockQuantWeight("q4", qs, scales)
    x = _x(m, k, 4, scale=1e4)
    x[0] = 1e4  # all +127
    x[1] = -1e4  # all -127
    x[2] = 0.0
    ref = int8_block_linear_reference(x, weight)
    assert float(ref[0, 0]) > 0 and float(ref[1, 0]) < 0
    panels = pack_int8_panels(weight)
    for portable in PORTABLE:
        y = int8_panels_linear(x, panels, portable=portable)
        assert y is not None
        _assert_close_to_reference(y, ref, x, weight)
        assert not bool(y[2].any())  # zero rows give zeros
        assert not bool(y[:, 2].any())  # zero scales give zeros


def test_threads_and_no_rows() -> None:
    panels = pack_int8_panels(_weight(72, 64, "Q4_1", 1))
    y = int8_panels_linear(torch.zeros(0, 64), panels)
    assert y is not None and y.shape == (0, 72)
    x = _x(9, 64, 2)
    _assert_same_at_thread_counts(lambda: int8_panels_linear(x, panels))


def test_q8_extreme_blocks() -> None:
    """Q8 values at both ends (-128 and 127, stored 0 and 255) against +-127 activations:
    VPDPBUSD's int32 sums hold them exactly."""
    n, k, m = 11, 64, 3
    qs = torch.randint(
        -128, 128, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(1)
    )
    qs[0] = 127
    qs[1] = -128
    weight = BlockQuantWeight("q8", qs, torch.rand(n, k // 32) + 0.5)
    x = _x(m, k, 4, scale=1e4)
    x[0] = 1e4
    x[1] = -1e4
    ref = int8_block_linear_reference(x, weight)
    panels = pack_int8_panels(weight)
    for portable in PORTABLE:
        if not _runs("Q8_0", portable):
            continue
        y = int8_panels_linear(x, panels, portable=portable)
        assert y is not None
        _assert_close_to_reference(y, ref, x, weight)


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="q4 or q8 block weights, got Tensor"):
        pack_int8_panels(torch.zeros(8, 64))  # type: ignore[arg-type]
    panels = pack_int8_panels(_weight(8, 64, "Q4_0", 0))
    with pytest.raises(ValueError, match="K = 96"):
        int8_panels_linear(torch.zeros(2, 96), panels)
    with pytest.raises(ValueError, match="float32"):
        int8_panels_linear(torch.zeros(2, 64, dtype=torch.bfloat16), panels)
    with pytest.raises(ValueError, match="Int8Panels"):
        int8_panels_linear(torch.zeros(2, 64), torch.zeros(8, 64))  # type: ignore[arg-type]


def test_released_float_copies_leave_int8_results_and_come_back_exactly() -> None:
    from sarazmq.kernels.cpu_ops import NativeCpuOps

    ops = NativeCpuOps()
    for type_name in ("Q4_1", "Q8_0"):
        blocks = _weight(40, 64, type_name, 9)
        plain = blocks.dequantize()
        w = LinearWeight(plain.clone())
        w.attach_blocks(blocks, "w")
        w.prepack()
        assert not w.release_float_copies()  # int8 off: the float copies are read
        assert w.set_int8_blocks(True)
        x = _x(5, 64, 3)
        before = [ops.linear(x[:n], w) for n in (1, 5)]  # within and past the GEMV rows
        assert w.release_float_copies() and w.float_released
        assert not w.has_plain and w.packed is None
        assert all(torch.equal(ops.linear(x[:n], w), b) for n, b in zip((1, 5), before))
        assert not w.set_int8_blocks(False) and not w.float_released
        assert w.has_plain and torch.equal(w.plain, plain)  # rebuilt, bit for bit
    # a plain weight needed elsewhere (a tied embedding) stays
    tied = LinearWeight(plain.clone(), keep_plain=True)
    tied.attach_blocks(blocks, "tied")
    tied.set_int8_blocks(True)
    assert tied.release_float_copies() and tied.has_plain


def test_owner_builds_panels_for_int8_and_reads_them() -> None:
    blocks = _weight(40, 64, "Q4_1", 5)
    w = LinearWeight(blocks.dequantize())
    w.attach_blocks(blocks, "w")
    x = _x(6, 64, 6)
    assert int8_blocks_linear(x, w) is None  # not set: the caller's float path
    assert w.set_int8_blocks(True) and w.int8_panels is not None
    assert w.variant_bytes()["int8_panels"] == w.int8_panels.nbytes > 0
    out = int8_blocks_linear(x, w)
    want = int8_panels_linear(x, w.int8_panels)
    assert out is not None and want is not None and torch.equal(out, want)
    # new blocks while int8 is on: the panels follow them
    other = _weight(40, 64, "Q4_1", 7)
    w.weight = torch.nn.Parameter(other.dequantize(), requires_grad=False)
    w.attach_blocks(other, "w")
    assert w.int8_panels is not None
    assert torch.equal(_unpack(w.int8_panels)[1], other.scales[..., 0])
    assert not w.set_int8_blocks(False) and w.int8_panels is None
    assert w.variant_bytes()["int8_panels"] == 0
    # Q8 blocks take panels where VPDPBUSD is built, else int8 in their own layout; a
    # bf16 owner does not take it at all
    q8 = _weight(16, 64, "Q8_0", 8)
    w8 = LinearWeight(q8.dequantize())
    w8.attach_blocks(q8, "w8")
    assert w8.set_int8_blocks(True)
    assert (w8.int8_panels is not None) == int8_panels_take("q8")
    out8 = int8_blocks_linear(x, w8)
    assert out8 is not None
    _assert_close_to_reference(out8, int8_block_linear_reference(x, q8), x, q8)
    wb = LinearWeight(blocks.dequantize().bfloat16())
    wb.attach_blocks(blocks, "wb")
    assert not wb.set_int8_blocks(True) and wb.int8_panels is None


def test_q8_panels_refused_where_vpdpbusd_is_not_built(monkeypatch: pytest.MonkeyPatch) -> None:
    from sarazmq.kernels import int8_dot, linear_weight

    if not int8_dot.int8_dot_avx2():
        pytest.skip("portable build: every kind runs the exact C loop")

    # as an AVX2-only build answers
    def take(kind: str) -> bool:
        return kind == "q4"

    monkeypatch.setattr(int8_dot, "int8_panels_take", take)
    monkeypatch.setattr(linear_weight, "int8_panels_take", take)
    panels = pack_int8_panels(_weight(8, 64, "Q8_0", 0))
    with pytest.raises(ValueError, match="q8 panels need VPDPBUSD"):
        int8_panels_linear(_x(2, 64, 1), panels)
    assert int8_panels_linear(_x(2, 64, 1), panels, portable=True) is not None
    q8 = _weight(16, 64, "Q8_0", 8)
    w8 = LinearWeight(q8.dequantize())
    w8.attach_blocks(q8, "w8")
    assert w8.set_int8_blocks(True) and w8.int8_panels is None  # its own layout instead


def test_native_linear_reads_q8_blocks_without_panels_by_the_float_kernel_within_its_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Set to int8, an owner whose blocks have no panels (Q8 where VPDPBUSD is not built)
    takes the float block kernel for the rows that kernel covers (int8_dot.c on the
    file's layout is no faster there: the float path's result, bitwise) and int8 dot
    products above them; an owner with panels takes int8 at every row count."""
    from sarazmq.kernels import cpu_ops, linear_weight
    from sarazmq.kernels.block_quant import block_quant_linear
    from sarazmq.kernels.cpu_ops import NativeCpuOps

    try:
        ops = NativeCpuOps()
    except ValueError:
        pytest.skip("native CPU ops unavailable")
    monkeypatch.setattr(linear_weight, "int8_panels_take", lambda kind: kind == "q4")
    q8 = _weight(40, 64, "Q8_0", 11)
    w8 = LinearWeight(q8.dequantize())
    w8.attach_blocks(q8, "w8")
    assert w8.set_int8_blocks(True) and w8.int8_panels is None
    max_rows = cpu_ops.GEMV_MAX_ROWS_BLOCKS[torch.float32]
    for rows in (1, max_rows):
        x = _x(rows, 64, rows)
        want = block_quant_linear(x, q8)
        if want is None:
            pytest.skip("the float block kernel does not cover these sizes in this build")
        assert torch.equal(ops.linear(x, w8), want)
    x = _x(max_rows + 1, 64, 3)
    out = ops.linear(x, w8)
    int8_out = int8_blocks_linear(x, w8)
    assert int8_out is not None and torch.equal(out, int8_out)
    # Q4 blocks hold panels: int8 at one row too
    q4 = _weight(40, 64, "Q4_1", 12)
    w4 = LinearWeight(q4.dequantize())
    w4.attach_blocks(q4, "w4")
    assert w4.set_int8_blocks(True) and w4.int8_panels is not None
    x = _x(1, 64, 4)
    want4 = int8_blocks_linear(x, w4)
    assert want4 is not None and torch.equal(ops.linear(x, w4), want4)
