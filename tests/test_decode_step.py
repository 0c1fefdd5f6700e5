"""The fused decode step (kernels/csrc/decode_step.c, sarazmq.kernels.decode_step): a
Llama decode step of 1-8 sequences in one C call must give bitwise the per-op path's
hidden states and KV cache where that path runs the same kernels (1-3 rows), close ones
past that (its matmuls are oneDNN's there), decline what it does not cover, and turn bad
plans into errors that write nothing."""

from __future__ import annotations

import pytest
import torch
from test_model import _tiny_config

from sarazmq.config import ModelConfig
from sarazmq.kernels import AttentionBackend, CpuPagedAttention
from sarazmq.kernels.cpu_attention_kernels import cpu_attention_available
from sarazmq.kernels.cpu_ops import GEMV_MAX_ROWS, gemv
from sarazmq.kernels.decode_step import (
    FUSED_MAX_ROWS,
    DecodeLayerWeights,
    FusedDecodeStep,
    StepSizes,
)
from sarazmq.kernels.kv_layout import INT8_SCALE_BYTES
from sarazmq.kernels.metadata import AttentionMetadata
from sarazmq.kernels.native import cpu_has_flag
from sarazmq.model.kv_cache import allocate_kv_cache
from sarazmq.model.llama import LlamaForCausalLM

pytestmark = pytest.mark.skipif(
    not cpu_attention_available(), reason="native CPU kernels unavailable (no C compiler)"
)

BLOCK = 4
NUM_BLOCKS = 48
# prompt lengths of up to eight sequences: inside one block, across blocks, full blocks
PROMPTS = (7, 12, 3, 1, 16, 9, 4, 13)
# scattered, non-monotonic block tables (room for three decode steps)
TABLES = (
    [25, 47, 11, 17],
    [3, 22, 19, 44, 10],
    [6, 43, 26],
    [24, 45],
    [13, 21, 9, 1, 18, 5],
    [2, 39, 31, 35],
    [28, 29, 7],
    [42, 27, 20, 33, 32],
)


class PerOpCpuAttention(CpuPagedAttention):
    """The CPU backend without its fused decode step: the per-op path."""

    def fused_decode_step(self, *args: object, **kwargs: object) -> None:
        return None


def tiny_config(**over: object) -> ModelConfig:
    # K = 96 for the down projection: three bf16 GEMV vectors
    base = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position=128,
    )
    base.update(over)
    return _tiny_config(**base)


def _model(backend: AttentionBackend, dtype: torch.dtype, **over: object) -> LlamaForCausalLM:
    model = LlamaForCausalLM(tiny_config(**over), backend, dtype=dtype)
    model.random_init_(seed=7, std=0.3)  # big enough weights that every op matters
    return model


def _prefilled(
    model: LlamaForCausalLM, m: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> list:
    """KV caches holding the prompts of the first m sequences."""
    caches = allocate_kv_cache(
        model.config, NUM_BLOCKS, BLOCK, dtype, "cpu", kv_cache_dtype=kv_cache_dtype
    )
    lens = list(PROMPTS[:m])
    ids = torch.randint(0, 96, (sum(lens),), generator=torch.Generator().manual_seed(m))
    pos = torch.cat([torch.arange(n) for n in lens])
    meta = AttentionMetadata.build(lens, lens, [list(t) for t in TABLES[:m]], BLOCK)
    model(ids, pos, caches, meta)
    return caches


def _decode_meta(m: int, step: int) -> AttentionMetadata:
    lens = [n + step + 1 for n in PROMPTS[:m]]
    return AttentionMetadata.build([1] * m, lens, [list(t) for t in TABLES[:m]], BLOCK)


def _decode(model: LlamaForCausalLM, caches: list, m: int, steps: int) -> list[torch.Tensor]:
    outs = []
    for step in range(steps):
        meta = _decode_meta(m, step)
        ids = torch.tensor([(11 * step + 5 * i) % 96 for i in range(m)])
        pos = torch.tensor([n + step for n in PROMPTS[:m]])
        outs.append(model(ids, pos, caches, meta))
    return outs


def compare_with_per_op(
    dtype: torch.dtype, m: int, steps: int = 3, kv_cache_dtype: str = "auto", **over: object
) -> tuple[bool, bool]:
    """(fused step used, outputs and caches the per-op path's: bitwise up to GEMV_MAX_ROWS
    rows, close past them) for m decodes over `steps` steps from the same prefilled
    caches (of `kv_cache_dtype`; `over`: model config changes). Also run by the
    restricted-build test in test_cpu_kernels.py."""
    torch.manual_seed(0)
    fused_model = _model(CpuPagedAttention(), dtype, **over)
    per_op_model = _model(PerOpCpuAttention(), dtype, **over)
    per_op_model.load_state_dict(fused_model.state_dict())
    caches_a = _prefilled(fused_model, m, dtype, kv_cache_dtype)
    caches_b = [(k.clone(), v.clone()) for k, v in caches_a]
    used = []
    real_run = FusedDecodeStep.run

    def counting_run(self: FusedDecodeStep, *args: object) -> torch.Tensor | None:
        out = real_run(self, *args)  # type: ignore[arg-type]
        used.append(out is not None)
        return out

    FusedDecodeStep.run = counting_run  # type: ignore[method-assign]
    try:
        fused = _decode(fused_model, caches_a, m, steps)
    finally:
        FusedDecodeStep.run = real_run  # type: ignore[method-assign]
    per_op = _decode(per_op_model, caches_b, m, steps)
    pairs = list(zip(fused, per_op, strict=True))
    for (ka, va), (kb, vb) in zip(caches_a, caches_b, strict=True):
        pairs += [(ka, kb), (va, vb)]
    if m <= GEMV_MAX_ROWS[dtype]:
        same = all(torch.equal(a, b) for a, b in pairs)
    else:  # float32 sums in another order (bf16: then rounded to bf16)
        tol = 1e-4 if dtype == torch.float32 else 0.05
        same = all(
            torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)
            if a.is_floating_point()
            else _int8_rows_close(a, b, tol)
            for a, b in pairs
        )
    return bool(used) and all(used), same


def _int8_rows_close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> bool:
    """Two int8 caches (rows of D values, then the scale's 4 bytes) written from close
    inputs: values a step apart at most, scales within `rtol` (compared as float32: a
    last-bit change of a scale moves its low byte anywhere in -128..127; bf16 inputs a
    rounding apart move a row's max, hence its scale, by up to a bf16 step)."""
    d = a.shape[-1] - INT8_SCALE_BYTES
    values_close = (a[..., :d].int() - b[..., :d].int()).abs().max() <= 1
    scale_a = a[..., d:].contiguous().view(torch.float32)
    scale_b = b[..., d:].contiguous().view(torch.float32)
    return bool(values_close) and torch.allclose(scale_a, scale_b, rtol=rtol) and bool(a.any())


@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 7, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_step_gives_the_per_op_path_results(dtype: torch.dtype, m: int) -> None:
    used, same = compare_with_per_op(dtype, m)
    assert same
    if m > FUSED_MAX_ROWS[dtype]:
        assert not used  # past its limit the model runs op by op
    elif not used:
        pytest.skip(f"this CPU's build has no {dtype} matrix-vector kernel")


_AVX2_FMA = cpu_has_flag("avx2") and cpu_has_flag("fma")


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(
                not cpu_has_flag("avx512f"), reason="the bf16 int8 decode item is AVX-512"
            ),
        ),
        pytest.param(
            torch.float32,
            marks=pytest.mark.skipif(
                not (cpu_has_flag("avx512f") or _AVX2_FMA),
                reason="the float32 int8 decode item is AVX-512 or AVX2 + FMA",
            ),
        ),
    ],
)
@pytest.mark.parametrize("m", [1, 3, 6])
def test_fused_step_on_int8_caches_gives_the_per_op_path_results(
    dtype: torch.dtype, m: int
) -> None:
    # head size 64: what the int8 decode items take
    used, same = compare_with_per_op(dtype, m, kv_cache_dtype="int8", head_dim=64)
    assert same
    if not used:
        pytest.skip(f"this CPU's build has no {dtype} matrix-vector kernel")


def test_fused_step_declines_what_it_does_not_cover() -> None:
    model = _model(CpuPagedAttention(), torch.float32)
    caches = allocate_kv_cache(model.config, NUM_BLOCKS, BLOCK, torch.float32, "cpu")
    step = model.fused_decode_step(caches)
    if step is None:
        pytest.skip("no fused step on this CPU's build")
    assert step.max_rows == FUSED_MAX_ROWS[torch.float32] == 6
    hidden = model.config.hidden_size
    x = torch.randn(7, hidden)
    cos = torch.ones(7, 1, 16)
    seven = AttentionMetadata.build([1] * 7, [2] * 7, [[i] for i in range(7)], BLOCK)
    assert step.run(x, cos, cos, seven) is None  # more sequences than it takes in float32
    hybrid = AttentionMetadata.build([1, 2], [2, 2], [[0], [1]], BLOCK)
    assert step.run(x[:3], cos[:3], cos[:3], hybrid) is None  # a prefill in the batch
    one = AttentionMetadata.build([1], [2], [[0]], BLOCK)
    assert step.run(x[:1].bfloat16(), cos[:1], cos[:1], one) is None  # another dtype
    # a model with a qkv bias (Qwen2) gets no fused step
    biased = _model(CpuPagedAttention(), torch.float32, qkv_bias=True)
    assert biased.fused_decode_step(caches) is None
    # sizes the GEMV does not take (hidden 36: not a multiple of 16 float32 lanes, nor of
    # AVX2's 8)
    odd = _model(CpuPagedAttention(), torch.float32, hidden_size=36)
    odd_caches = allocate_kv_cache(odd.config, NUM_BLOCKS, BLOCK, torch.float32, "cpu")
    odd_step = odd.fused_decode_step(odd_caches)
    assert odd_step is not None
    assert odd_step.run(torch.randn(1, 36), cos[:1], cos[:1], one) is None


def test_fused_step_refuses_tensors_of_the_wrong_shape() -> None:
    # the C step trusts every shape: a mismatch must be an error at build time
    model = _model(CpuPagedAttention(), torch.float32)
    caches = allocate_kv_cache(model.config, NUM_BLOCKS, BLOCK, torch.float32, "cpu")
    layers = [
        DecodeLayerWeights(
            layer.input_layernorm,
            layer.qkv_proj.plain,
            layer.o_proj.plain,
            layer.post_attention_layernorm,
            layer.gate_up_proj.plain,
            layer.down_proj.plain,
        )
        for layer in model.layers
    ]
    sizes = StepSizes(num_heads=4, num_kv_heads=2, head_dim=16, eps=1e-5, scale=0.25)
    FusedDecodeStep(layers, model.norm, caches, sizes)  # the right shapes build
    bad = list(layers)
    bad[1] = bad[1]._replace(o=torch.zeros(64, 32))
    with pytest.raises(ValueError, match=r"layer 1 o: shape \(64, 32\), expected \(64, 64\)"):
        FusedDecodeStep(bad, model.norm, caches, sizes)
    short = list(caches)
    short[2] = (caches[2][0][:8].contiguous(), caches[2][1])
    with pytest.raises(ValueError, match="layer 2 KV cache"):
        FusedDecodeStep(layers, model.norm, short, sizes)


def test_fused_step_is_rebuilt_for_new_caches_and_weights() -> None:
    model = _model(CpuPagedAttention(), torch.float32)
    caches = allocate_kv_cache(model.config, NUM_BLOCKS, BLOCK, torch.float32, "cpu")
    step = model.fused_decode_step(caches)
    if step is None:
        pytest.skip("no fused step on this CPU's build")
    assert model.fused_decode_step(caches) is step
    other = allocate_kv_cache(model.config, NUM_BLOCKS, BLOCK, torch.float32, "cpu")
    assert model.fused_decode_step(other) is not step
    again = model.fused_decode_step(other)
    model.random_init_(seed=1)
    assert model.fused_decode_step(other) is not again


@pytest.mark.parametrize("bad", ["slot", "block", "length"])
def test_bad_plans_raise_and_write_nothing(bad: str) -> None:
    model = _model(CpuPagedAttention(), torch.float32)
    caches = _prefilled(model, 2, torch.float32)
    step = model.fused_decode_step(caches)
    if step is None or gemv(torch.ones(1, 64), torch.ones(8, 64)) is None:
        # without the float32 GEMV (neither AVX-512 nor AVX2 + FMA) the step declines
        # every batch and the per-op path runs
        pytest.skip("no fused float32 step on this CPU's build")
    before = [(k.clone(), v.clone()) for k, v in caches]
    meta = _decode_meta(2, 0)
    if bad == "slot":
        meta.slot_mapping[1] = NUM_BLOCKS * BLOCK
    elif bad == "block":
        meta.block_tables[0, 1] = NUM_BLOCKS
    else:
        meta.seq_lens_k[1] = 4 * len(TABLES[1]) + 1  # more keys than its table holds
    ids, pos = torch.tensor([3, 4]), torch.tensor([PROMPTS[0], PROMPTS[1]])
    with pytest.raises(IndexError, match="outside the KV cache"):
        model(ids, pos, caches, meta)
    for (k, v), (k0, v0) in zip(caches, before, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)
