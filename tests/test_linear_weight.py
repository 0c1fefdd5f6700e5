"""The per-matmul weight owner (sarazmq.kernels.linear_weight): the bytes each variant
holds, blocks that do not hold the weight refused, and the plain copy freed where no path
reads it, with bitwise the same results before and after, per weight and in the model."""

from __future__ import annotations

import gc
import weakref

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize

import sarazmq.kernels.decode_step as decode_step
from sarazmq.kernels import AttentionBackend, CpuPagedAttention, TorchPagedAttention
from sarazmq.kernels.block_quant import block_quant_kernels_available, from_gguf_blocks
from sarazmq.kernels.cpu_attention_kernels import cpu_attention_available
from sarazmq.kernels.cpu_ops import TORCH_OPS, NativeCpuOps
from sarazmq.kernels.decode_step import DecodeLayerWeights, StepSizes, decode_step_layout
from sarazmq.kernels.flash_attn_backend import FlashAttnPagedAttention
from sarazmq.kernels.linear_weight import LinearWeight
from sarazmq.kernels.ops import can_prepack_linear

needs_native = pytest.mark.skipif(
    not cpu_attention_available(), reason="native CPU kernels unavailable (no C compiler)"
)
needs_blocks = pytest.mark.skipif(
    not block_quant_kernels_available(),
    reason="no float32 block kernels in this CPU's build (neither AVX-512 nor AVX2)",
)
needs_packing = pytest.mark.skipif(
    not can_prepack_linear(torch.float32, "cpu"), reason="no oneDNN prepacking in this torch"
)


def _quantized(n: int, k: int, seed: int = 0) -> tuple[LinearWeight, object]:
    """An owner of a float32 [n, k] weight that is exactly its Q4_1 blocks' values, and
    those blocks."""
    rng = np.random.default_rng(seed)
    raw = quantize(
        (rng.standard_normal((n, k)) * 0.1).astype(np.float32), gguf.GGMLQuantizationType.Q4_1
    )
    blocks = from_gguf_blocks(raw, "Q4_1", (n, k))
    return LinearWeight(blocks.dequantize()), blocks


def test_variant_bytes_and_shape() -> None:
    w = LinearWeight.empty(48, 64, bias=True, dtype=torch.bfloat16)
    assert (w.out_features, w.in_features, w.dtype) == (48, 64, torch.bfloat16)
    assert w.variant_bytes() == {
        "plain": 48 * 64 * 2,
        "packed": 0,
        "tiles": 0,
        "blocks": 0,
        "int8_panels": 0,
    }
    assert w.nbytes == 48 * 64 * 2
    if w.prepack():
        assert w.variant_bytes()["packed"] >= 48 * 64 * 2
    assert w.nbytes == sum(w.variant_bytes().values())
    with pytest.raises(ValueError, match=r"\[out, in\]"):
        LinearWeight(torch.zeros(3))
    with pytest.raises(ValueError, match="bias of shape"):
        LinearWeight(torch.zeros(4, 8), torch.zeros(5))


@needs_blocks
def test_blocks_count_and_a_mismatched_attach_is_refused() -> None:
    w, blocks = _quantized(32, 64)
    w.attach_blocks(blocks, "w")  # type: ignore[arg-type]
    assert w.variant_bytes()["blocks"] == blocks.nbytes  # type: ignore[attr-defined]
    other, other_blocks = _quantized(32, 64, seed=1)
    fresh = LinearWeight(w.plain.detach().clone())
    with pytest.raises(ValueError, match="layer 3 o_proj: the checkpoint's quantized blocks"):
        fresh.attach_blocks(other_blocks, "layer 3 o_proj")  # type: ignore[arg-type]
    narrow, narrow_blocks = _quantized(16, 64)
    with pytest.raises(ValueError, match=r"do not hold the loaded weight \(blocks \(16, 64\)"):
        fresh.attach_blocks(narrow_blocks, "w")  # type: ignore[arg-type]
    assert fresh.blocks is None  # nothing kept from a refused attach


@needs_native
@needs_blocks
@needs_packing
def test_drop_plain_frees_it_and_keeps_every_result() -> None:
    native = NativeCpuOps()
    w, blocks = _quantized(96, 128)
    w.attach_blocks(blocks, "w")  # type: ignore[arg-type]
    assert native.needs_plain(w) and TORCH_OPS.needs_plain(w)  # nothing packed yet
    assert w.prepack()
    assert not native.needs_plain(w) and not TORCH_OPS.needs_plain(w)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(m, 128, generator=g) for m in (1, 2, 3, 4, 9, 64)]
    before = [(native.linear(x, w), TORCH_OPS.linear(x, w)) for x in xs]
    plain = weakref.ref(w.plain)
    w.drop_plain()
    gc.collect()
    assert plain() is None  # the tensor is gone, not only the reference
    assert not w.has_plain and w.variant_bytes()["plain"] == 0
    assert (w.out_features, w.in_features) == (96, 128)  # the shape stays known
    for x, (a, b) in zip(xs, before, strict=True):
        assert torch.equal(native.linear(x, w), a)  # blocks to 3 rows, packed past them
        assert torch.equal(TORCH_OPS.linear(x, w), b)
    with pytest.raises(ValueError, match="was dropped"):
        w.prepack()
    with pytest.raises(ValueError, match="was dropped"):
        w.variants_changed()
    assert w.packed is not None and w.blocks is not None  # a refused call changes nothing
    with pytest.raises(ValueError, match="decode rows read the blocks"):
        w.detach_blocks()


@needs_native
@needs_packing
def test_plain_weights_some_path_reads_are_kept() -> None:
    native = NativeCpuOps()
    w = LinearWeight(torch.randn(32, 64))
    w.prepack()
    assert native.needs_plain(w)  # 1-3 rows read it (the C kernel) without blocks
    assert not TORCH_OPS.needs_plain(w)  # the torch ops read the packed copy only
    biased = LinearWeight(torch.randn(32, 64), torch.randn(32))
    biased.prepack()
    assert not native.needs_plain(biased)  # a bias sends every row count to oneDNN
    unpacked = LinearWeight(torch.randn(32, 64))
    with pytest.raises(ValueError, match="no packed copy"):
        unpacked.drop_plain()
    embedding = torch.nn.Parameter(torch.randn(32, 64), requires_grad=False)
    head = LinearWeight(embedding, keep_plain=True)
    head.prepack()
    with pytest.raises(ValueError, match="keep_plain"):
        head.drop_plain()


def test_every_backend_is_an_attention_backend() -> None:
    assert isinstance(TorchPagedAttention(), AttentionBackend)
    assert isinstance(CpuPagedAttention(), AttentionBackend)
    # flash-attn is not installed here: its class has the whole interface
    for attr in ("name", "ops", "forward", "fused_decode_step"):
        assert hasattr(FlashAttnPagedAttention, attr)
    assert TorchPagedAttention().fused_decode_step([], torch.zeros(1), [], _SIZES) is None


_SIZES = StepSizes(num_heads=1, num_kv_heads=1, head_dim=2, eps=1e-5, scale=1.0)


@needs_native
def test_decode_step_layout_is_the_libraries_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = decode_step_layout()
    assert layout.matmuls == ("qkv", "o", "gate_up", "down")
    assert layout.slots[: len(DecodeLayerWeights._fields)] == DecodeLayerWeights._fields
    assert set(layout.slots) >= {"k_cache", "v_cache", "qkv_scales", "down_scales"}
    # a Python side that no longer agrees with kernels.h is refused, not run
    monkeypatch.setattr(decode_step, "MATMULS", ("qkv", "o", "gate_up"))
    with pytest.raises(ValueError, match="are not DecodeLayerWeights'"):
        decode_step_layout()
