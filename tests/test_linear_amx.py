"""The AMX tile matmul (sarazmq.kernels.linear_amx): against a float64 reference and
oneDNN over row counts at and off the kernel's 16/32-row blocks, the shapes it refuses,
the `tiles` weight variant (packed instead of oneDNN's copy, plain weight dropped with the
same results), the SwiGLU pass (bitwise the matmul then `silu_mul`), and a bf16 model whose
matmuls run on it."""

from __future__ import annotations

import pytest
import torch
from test_model import _tiny_config

from sarazmq.config import ModelConfig
from sarazmq.kernels import CpuPagedAttention
from sarazmq.kernels.cpu_ops import TORCH_OPS, NativeCpuOps
from sarazmq.kernels.linear_amx import (
    amx_linear_available,
    linear_tiles,
    linear_tiles_into_f32,
    pack_tiles,
    silu_mul_tiles,
    tiles_cover,
)
from sarazmq.kernels.linear_weight import LinearWeight
from sarazmq.kernels.metadata import AttentionMetadata
from sarazmq.model.kv_cache import allocate_kv_cache
from sarazmq.model.llama import LlamaForCausalLM

needs_amx = pytest.mark.skipif(not amx_linear_available(), reason="CPU without AMX tiles")
BF = torch.bfloat16
CPU = torch.device("cpu")


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Exact sums of the bf16 products, rounded once to bf16."""
    return (x.double() @ w.double().t()).to(BF)


@needs_amx
@pytest.mark.parametrize("rows", [1, 4, 15, 16, 17, 31, 32, 33, 64, 100, 257])
@pytest.mark.parametrize("shape", [(32, 32), (96, 576), (960, 576), (576, 1536)])
def test_tiles_close_to_reference_and_onednn(rows: int, shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(rows * 7 + shape[0])
    n, k = shape
    w = torch.randn(n, k, generator=g).to(BF)
    x = torch.randn(rows, k, generator=g).to(BF)
    y = linear_tiles(x, pack_tiles(w), n)
    assert y is not None and y.shape == (rows, n) and y.dtype == BF
    # float32 sums in some order, one rounding: within a bf16 step of the exact result
    ref = _reference(x, w).float()
    torch.testing.assert_close(y.float(), ref, atol=1e-2 * k**0.5, rtol=1e-2)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w), atol=1e-2 * k**0.5, rtol=1e-2)


@needs_amx
def test_strided_rows_and_exact_small_integers() -> None:
    # small integers: every product and sum exact in float32, so the result is exact
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-3, 4, (64, 96), generator=g).to(BF)
    wide = torch.randint(-3, 4, (40, 160), generator=g).to(BF)
    x = wide[:, 10:106]  # row stride 160, as a slice of a fused projection's output
    y = linear_tiles(x, pack_tiles(w), 64)
    assert y is not None
    assert torch.equal(y, (x.float() @ w.float().t()).to(BF))


@needs_amx
@pytest.mark.parametrize("rows", [2, 15, 16, 17, 33, 100, 257])
@pytest.mark.parametrize("shape", [(16, 32), (48, 64), (1536, 576)])
def test_swiglu_tiles_bitwise_as_matmul_then_silu_mul(rows: int, shape: tuple[int, int]) -> None:
    # (inter, in): one 16-column block; blocks across both halves of a pair; the model's
    inter, k = shape
    g = torch.Generator().manual_seed(rows + inter)
    w = (torch.randn(2 * inter, k, generator=g) * 0.1).to(BF)
    wide = torch.randn(rows, k + 32, generator=g).to(BF)
    native = NativeCpuOps()
    tiles = pack_tiles(w)
    for x in (wide[:, :k].contiguous(), wide[:, 32:]):  # contiguous and strided rows
        act = silu_mul_tiles(x, tiles, inter)
        assert act is not None and act.shape == (rows, inter)
        assert torch.equal(act, native.silu_mul(linear_tiles(x, tiles, 2 * inter), inter))
    # and close to torch's own SwiGLU of the bf16 products
    y = torch.nn.functional.linear(x, w)
    ref = torch.nn.functional.silu(y[:, :inter]) * y[:, inter:]
    torch.testing.assert_close(act, ref, atol=0.05, rtol=0.05)


@needs_amx
def test_swiglu_op_fuses_only_where_the_matmul_runs_on_tiles() -> None:
    native = NativeCpuOps()
    g = torch.Generator().manual_seed(2)
    w = LinearWeight((torch.randn(96, 64, generator=g) * 0.1).to(BF))
    assert w.prepack(tiles=True) and w.tiles is not None
    for rows in (1, 2, 9, 40):  # 1 row: the matrix-vector kernel, then silu_mul
        x = torch.randn(rows, 64, generator=g).to(BF)
        unfused = native.silu_mul(native.linear(x, w), 48)
        assert torch.equal(native.linear_silu_mul(x, w, 48), unfused)
        torch.testing.assert_close(
            TORCH_OPS.linear_silu_mul(x, w, 48), unfused, atol=0.02, rtol=0.02
        )
    # what the pass does not take: float32 rows, a weight of other sizes, no rows
    tiles = w.tiles
    assert silu_mul_tiles(torch.zeros(3, 64), tiles, 48) is None
    assert silu_mul_tiles(torch.zeros(3, 64, dtype=BF), tiles, 32) is None
    assert silu_mul_tiles(torch.zeros(0, 64, dtype=BF), tiles, 48) is None
    # an inter that is not a whole number of 16-column blocks: the C kernel refuses it
    assert (
        silu_mul_tiles(torch.zeros(3, 32, dtype=BF), torch.zeros(2 * 24 * 32, dtype=BF), 24) is None
    )


@needs_amx
@pytest.mark.parametrize("rows", [2, 17, 33, 100])
def test_tiles_into_float32_bitwise_as_widened_bf16(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = LinearWeight(torch.randn(96, 64, generator=g).to(BF))
    assert w.prepack(tiles=True) and w.tiles is not None
    x = torch.randn(rows, 64, generator=g).to(BF)
    wide = torch.full((rows, 100), float("nan"))  # a row stride past the 96 outputs
    assert linear_tiles_into_f32(x, w.tiles, wide[:, :96])
    assert torch.equal(wide[:, :96], linear_tiles(x, w.tiles, 96).float())
    assert wide[:, 96:].isnan().all()  # nothing written past the outputs
    native = NativeCpuOps()
    for m in (1, rows):  # 1 row: the matrix-vector kernel, then the copy
        out = torch.empty(m, 96)
        assert native.linear_into_f32(x[:m], w, out) is out
        assert torch.equal(out, native.linear(x[:m], w).float())
        ref = TORCH_OPS.linear_into_f32(x[:m], w, torch.empty(m, 96))  # the copy
        assert torch.equal(ref, TORCH_OPS.linear(x[:m], w).float())
    # what it does not take: a bf16 destination, a column-strided one, wrong sizes
    assert not linear_tiles_into_f32(x, w.tiles, torch.empty(rows, 96, dtype=BF))
    assert not linear_tiles_into_f32(x, w.tiles, torch.empty(96, rows).t())
    assert not linear_tiles_into_f32(x, w.tiles, torch.empty(rows, 64))
    assert not linear_tiles_into_f32(x, w.tiles, torch.empty(rows + 1, 96))


@needs_amx
def test_every_unit_once_whatever_the_team() -> None:
    """Threads take their own units front to back and, when done, the others' from the
    back: with more threads than cores (preempted ones fall behind and get robbed) and
    unit counts that do not split evenly, every output is still written once, bitwise as
    with one thread (NaN-filled output: a unit left out would show)."""
    g = torch.Generator().manual_seed(7)
    w = LinearWeight(torch.randn(32 * 37, 64, generator=g).to(BF))  # 37 column pairs
    assert w.prepack(tiles=True) and w.tiles is not None
    gate_up = pack_tiles((torch.randn(2 * 16 * 19, 64, generator=g) * 0.1).to(BF))  # 19 blocks
    x = torch.randn(70, 64, generator=g).to(BF)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3, 7):
            torch.set_num_threads(n)
            for _ in range(3):
                out = torch.full((70, 32 * 37), float("nan"))
                assert linear_tiles_into_f32(x, w.tiles, out)
                act = silu_mul_tiles(x, gate_up, 16 * 19)
                assert act is not None
                results.append((out, act))
    finally:
        torch.set_num_threads(threads)
    for out, act in results:
        assert not out.isnan().any()
        assert torch.equal(out, results[0][0]) and torch.equal(act, results[0][1])


def test_what_the_kernel_does_not_take() -> None:
    assert not tiles_cover(torch.float32, CPU, 64, 64)
    assert not tiles_cover(BF, CPU, 48, 64)  # out not a multiple of 32
    assert not tiles_cover(BF, CPU, 64, 40)  # in not a multiple of 32
    assert not tiles_cover(BF, CPU, 16, 64)
    with pytest.raises(ValueError, match="no tile layout"):
        pack_tiles(torch.zeros(48, 64, dtype=BF))
    if amx_linear_available():
        tiles = pack_tiles(torch.zeros(64, 64, dtype=BF))
        assert linear_tiles(torch.zeros(3, 64), tiles, 64) is None  # float32 rows
        assert linear_tiles(torch.zeros(3, 32, dtype=BF), tiles, 64) is None  # wrong in
        assert linear_tiles(torch.zeros(0, 64, dtype=BF), tiles, 64) is None  # no rows
        assert linear_tiles(torch.zeros(64, 3, dtype=BF).t(), tiles, 64) is None  # strided


@needs_amx
def test_weight_holds_tiles_instead_of_onednn_and_drops_plain() -> None:
    native = NativeCpuOps()
    assert native.reads_tiles and not TORCH_OPS.reads_tiles
    g = torch.Generator().manual_seed(1)
    w = LinearWeight(torch.randn(96, 128, generator=g).to(BF))
    assert w.prepack(tiles=True)
    assert w.tiles is not None and w.packed is None
    assert w.variant_bytes()["tiles"] == 96 * 128 * 2
    assert native.needs_plain(w)  # 1 row still reads it (the C kernel, no blocks)
    assert TORCH_OPS.needs_plain(w)  # the torch ops cannot read tiles
    xs = [torch.randn(m, 128, generator=g).to(BF) for m in (2, 4, 9, 64)]
    before = [native.linear(x, w) for x in xs]
    # from 2 rows the tile kernel, not the matrix-vector one (GEMV_MAX_ROWS_TILES)
    assert all(torch.equal(y, linear_tiles(x, w.tiles, 96)) for x, y in zip(xs, before))
    for x, y in zip(xs, before, strict=True):
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w.plain), atol=0.1, rtol=1e-2)
    w.drop_plain()  # rows past the C kernel's need only the tiles
    for x, y in zip(xs, before, strict=True):
        assert torch.equal(native.linear(x, w), y)
    # a bias, or a shape the kernel does not take: oneDNN's packed copy as before
    biased = LinearWeight(torch.randn(96, 128).to(BF), torch.randn(96).to(BF))
    assert biased.prepack(tiles=True) and biased.tiles is None and biased.packed is not None
    odd = LinearWeight(torch.randn(48, 128).to(BF))
    assert odd.prepack(tiles=True) and odd.tiles is None and odd.packed is not None
    # a reload drops the tiles with the other derived copies
    fresh = LinearWeight(torch.randn(96, 128).to(BF))
    fresh.prepack(tiles=True)
    fresh.variants_changed()
    assert fresh.tiles is None


def _tile_model() -> tuple[ModelConfig, LlamaForCausalLM]:
    # sizes multiples of 32 where the tile kernel needs them; an untied LM head
    cfg = _tiny_config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg, CpuPagedAttention(), dtype=BF)
    model.random_init_(seed=5, std=0.1)
    return cfg, model


@needs_amx
def test_bf16_model_on_tiles_close_to_unpacked() -> None:
    cfg, model = _tile_model()

    def run() -> torch.Tensor:
        caches = allocate_kv_cache(cfg, 8, 4, BF, "cpu")
        meta = AttentionMetadata.build([20], [20], [[3, 1, 7, 0, 5]], 4)
        return model.compute_logits(model(torch.arange(20), torch.arange(20), caches, meta))

    plain = run()
    assert model.prepack_linear_weights()
    held = [w.variant_bytes() for _, w in model.matmul_weights()]
    assert all(v["tiles"] > 0 and v["packed"] == 0 for v in held)
    on_tiles = run()
    torch.testing.assert_close(on_tiles, plain, atol=0.05, rtol=0.05)
    # the reused float32 logits buffer gets the tile kernel's widened outputs directly:
    # the same logits as through the bf16 intermediate
    caches = allocate_kv_cache(cfg, 8, 4, BF, "cpu")
    meta = AttentionMetadata.build([20], [20], [[3, 1, 7, 0, 5]], 4)
    hidden = model(torch.arange(20), torch.arange(20), caches, meta)
    buf = torch.full((20, cfg.vocab_size), float("nan"))
    assert model.compute_logits(hidden, out=buf) is buf
    assert torch.equal(buf, on_tiles)
