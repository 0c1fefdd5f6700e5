"""The one-call hybrid iteration of a float32 model with gguf_matmul="int8"
(kernels/csrc/hybrid_step.c `hybrid_step_f32`): every matmul on Q4 int8 panels, prefill
chunks through the float32 prefill kernel. Its hidden states and KV caches must be
bitwise the per-op int8 path's, over float32 and int8 caches; it must be what the model
runs for such batches, decline what it does not cover, and turn a bad plan into an error
that writes nothing. Runs on AVX2 and AVX-512 builds (test_cpu_isa.py runs it capped at
AVX2: the VPMADDUBSW panels and the AVX2 decode items)."""

from __future__ import annotations

import pytest
import torch
from test_block_quant import ALL_Q4, LAYER_TYPES, _quantized_model
from test_hybrid_step import (
    NUM_BLOCKS,
    NoFusedDecode,
    PerOpCpuAttention,
    _run,
    assert_bitwise_equal,
    count_hybrid_rows,
)

from sarazmq.kernels import CpuPagedAttention
from sarazmq.kernels.cpu_attention_kernels import cpu_attention_available, prefill_f32_available
from sarazmq.kernels.hybrid_step import HybridStep
from sarazmq.kernels.int8_dot import int8_dot_avx2
from sarazmq.kernels.metadata import AttentionMetadata
from sarazmq.model.kv_cache import allocate_kv_cache
from sarazmq.model.llama import LlamaForCausalLM

pytestmark = pytest.mark.skipif(
    not (cpu_attention_available() and prefill_f32_available() and int8_dot_avx2()),
    reason="needs the native float32 prefill kernel and the AVX2 int8 kernels",
)

BLOCK = 16
# the smallest sizes the kernels take: head size 64 (the prefill and int8-cache kernels),
# every matmul's K a multiple of 32 (the panels)
SIZES = dict(
    hidden_size=128, intermediate_size=96, num_heads=2, num_kv_heads=1, head_dim=64,
    max_position=256,
)  # fmt: skip


def _int8_model(backend: CpuPagedAttention, types: dict[str, str] = ALL_Q4) -> LlamaForCausalLM:
    """A float32 model on Q4_1 blocks (the same weights for every backend: fixed seeds)
    computing its matmuls by int8 dot products."""
    model, named = _quantized_model(backend, types, **SIZES)
    model.load_block_quant_weights(named)
    model.set_gguf_matmul("int8")
    return model


def _caches(model: LlamaForCausalLM, kv_cache_dtype: str = "auto") -> list:
    return allocate_kv_cache(
        model.config, NUM_BLOCKS, BLOCK, torch.float32, "cpu", kv_cache_dtype=kv_cache_dtype
    )


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("backend", [CpuPagedAttention, NoFusedDecode])
def test_int8_hybrid_iterations_are_bitwise_the_per_op_int8_path(
    backend: type[CpuPagedAttention], kv_cache_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    one_call = _int8_model(backend())
    per_op = _int8_model(PerOpCpuAttention())
    caches_a, caches_b = _caches(one_call, kv_cache_dtype), _caches(per_op, kv_cache_dtype)
    step = one_call.hybrid_step(caches_a)
    assert step is not None and step.kind == "int8" and step.kv_int8 == (kv_cache_dtype == "int8")
    rows = count_hybrid_rows(monkeypatch)
    outs_a = _run(one_call, caches_a)
    assert per_op.hybrid_step(caches_b) is None
    outs_b = _run(per_op, caches_b)
    assert_bitwise_equal(outs_a, outs_b, caches_a, caches_b)
    # every multi-row batch took the one-call step; decode-only batches of a few rows are
    # the fused decode step's where the backend has it
    assert rows == ([57, 39, 64, 4] if backend is NoFusedDecode else [57, 39, 64])


def test_it_is_the_integer_path_not_the_float_one() -> None:
    int8 = _int8_model(CpuPagedAttention())
    float_model, named = _quantized_model(CpuPagedAttention(), ALL_Q4, **SIZES)
    float_model.load_block_quant_weights(named)
    assert float_model.hybrid_step(_caches(float_model)) is None  # no panels, no tiles
    a, b = _run(int8, _caches(int8)), _run(float_model, _caches(float_model))
    # llama.cpp's precision: close to the float path, not equal to it
    rel = float((a[2] - b[2]).norm() / b[2].norm())
    assert 0 < rel < 0.05, rel


def test_declines_what_it_does_not_cover() -> None:
    # a Q8 matmul in a layer: no Q4 panels for it (Q8 panels or blocks): no step
    mixed = _int8_model(CpuPagedAttention(), LAYER_TYPES)
    assert mixed.hybrid_step(_caches(mixed)) is None
    model = _int8_model(CpuPagedAttention())
    step = model.hybrid_step(_caches(model))
    assert step is not None
    meta = AttentionMetadata.build([2], [2], [[0]], BLOCK)
    bf16 = torch.randn(2, 128).to(torch.bfloat16)
    assert step.run(bf16, bf16[:, None, :64], bf16[:, None, :64], meta) is None
    # caches partly int8: no step
    int8 = _caches(model, "int8")
    assert model.hybrid_step(int8[:1] + _caches(model)[1:]) is None


def test_a_block_outside_the_cache_is_an_error_that_writes_nothing() -> None:
    model = _int8_model(CpuPagedAttention())
    caches = _caches(model)
    step = model.hybrid_step(caches)
    assert step is not None
    meta = AttentionMetadata.build([3, 1], [3, 9], [[NUM_BLOCKS], [0]], BLOCK)
    x = torch.randn(4, 128)
    cos = torch.ones(4, 1, 64)
    before = [(k.clone(), v.clone()) for k, v in caches]
    with pytest.raises(IndexError, match="outside the KV cache"):
        step.run(x, cos, cos, meta)
    for (k, v), (k0, v0) in zip(caches, before, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_unaligned_scratch_is_declined_before_anything_is_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the float32 prefill kernel refuses scratch off a 64-byte boundary (nothing written):
    # the step must refuse it up front, not return a chunk it never attended
    model = _int8_model(CpuPagedAttention())
    caches = _caches(model)
    step = model.hybrid_step(caches)
    assert step is not None
    real_buffer = HybridStep._buffer

    def shifted(self: HybridStep, name: str, elems: int) -> torch.Tensor:
        buf = real_buffer(self, name, elems + 1)
        return buf[1:] if name == "scratch" else buf

    monkeypatch.setattr(HybridStep, "_buffer", shifted)
    meta = AttentionMetadata.build([3], [3], [[0]], BLOCK)
    x = torch.randn(3, 128)
    cos = torch.ones(3, 1, 64)
    before = [(k.clone(), v.clone()) for k, v in caches]
    assert step.run(x, cos, cos, meta) is None
    for (k, v), (k0, v0) in zip(caches, before, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)
