"""The int8 KV cache (sarazmq.kernels.kv_int8): the row format against its definition,
the C write bitwise as the torch reference, the int8 decode kernel and both backends
against attention over the dequantized rows, sizing and allocation, the errors for what
it does not support, and a model whose logits stay close to its bf16 / float32-cache
ones."""

from __future__ import annotations

import pytest
import torch
from test_kernels import SCENARIOS, _scenario
from test_model import _tiny_config

from sarazmq.config import CacheConfig, EngineConfig
from sarazmq.kernels import CpuPagedAttention, TorchPagedAttention, select_attention_backend
from sarazmq.kernels.cpu_attention_kernels import cpu_attention_available, paged_decode_attention
from sarazmq.kernels.kv_int8 import (
    dequantize_kv_blocks_native,
    dequantize_kv_rows,
    kv_cache_layout,
    quantize_kv_rows,
    write_kv_int8_native,
)
from sarazmq.kernels.metadata import AttentionMetadata
from sarazmq.kernels.native import cpu_has_flag
from sarazmq.kernels.torch_attention import reference_attention
from sarazmq.model.kv_cache import allocate_kv_cache, kv_cache_bytes_per_block

needs_native = pytest.mark.skipif(
    not cpu_attention_available(), reason="no C compiler: native kernels not built"
)
BF = torch.bfloat16


def test_rows_hold_values_to_half_a_step_of_their_scale() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]
    x[2, 1] = 0.0  # an all-zero row: zeros and scale 0
    rows = quantize_kv_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 68)
    assert rows[..., :64].abs().max() <= 127 and not rows[2, 1].any()
    back = dequantize_kv_rows(rows, torch.float32)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((back - x).abs() <= step / 2 * (1 + 1e-5)).all()
    # the largest value of each row is exact up to float rounding
    assert torch.allclose(back.abs().amax(-1), x.abs().amax(-1), rtol=1e-6)
    assert dequantize_kv_rows(rows, BF).dtype == BF


@needs_native
@pytest.mark.parametrize("dtype", [BF, torch.float32])
def test_native_write_is_bitwise_the_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    k = (torch.randn(37, 3, 64, generator=g) * 3).to(dtype)
    v = torch.randn(37, 3, 64, generator=g).to(dtype)
    k[3, 1] = 0
    cache_shape = (20, 16, 3, 68)
    k_cache = torch.zeros(cache_shape, dtype=torch.int8)
    v_cache = torch.zeros(cache_shape, dtype=torch.int8)
    slots = torch.randperm(320, generator=g)[:37]
    assert write_kv_int8_native(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 3, 68)[slots], quantize_kv_rows(k))
    assert torch.equal(v_cache.view(-1, 3, 68)[slots], quantize_kv_rows(v))
    # a slot outside the cache: IndexError, nothing written
    before = k_cache.clone()
    with pytest.raises(IndexError, match="320 slots"):
        write_kv_int8_native(k[:2], v[:2], k_cache, v_cache, torch.tensor([5, 320]))
    assert torch.equal(k_cache, before)
    # not int8 rows of this head size: not this kernel's (the caller's path runs)
    assert not write_kv_int8_native(k, v, k_cache[..., :66], v_cache[..., :66], slots)


@needs_native
@pytest.mark.parametrize("dtype", [BF, torch.float32])
def test_native_block_dequantization_is_bitwise_the_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(12, 16, 3, 64, generator=g) * torch.tensor([0.02, 1.0, 40.0])[:, None]
    x[4, 7, 2] = 0.0  # an all-zero row
    cache = quantize_kv_rows(x)  # [12 blocks, 16, 3, 68]
    blocks = torch.tensor([9, 0, 4, 4, 11], dtype=torch.int32)  # any order, repeats
    out = torch.full((5, 16, 3, 64), 7.0, dtype=dtype)
    assert dequantize_kv_blocks_native(cache, blocks, out)
    assert torch.equal(out, dequantize_kv_rows(cache[blocks.long()], dtype))
    # a block id outside the cache: IndexError, nothing written
    before = out.clone()
    with pytest.raises(IndexError, match="outside the cache's 12"):
        dequantize_kv_blocks_native(cache, torch.tensor([1, 12], dtype=torch.int32), out[:2])
    assert torch.equal(out, before)
    # what it does not take: the caller's torch path runs
    assert not dequantize_kv_blocks_native(cache, blocks.long(), out)
    assert not dequantize_kv_blocks_native(cache, blocks, out.half())
    assert not dequantize_kv_blocks_native(cache, blocks[:4], out)


def _int8_scenario(
    seqs: list[tuple[int, int]],
    heads: tuple[int, int],
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = BF,
) -> tuple[torch.Tensor, ...]:
    """`_scenario` in `dtype` with int8 caches, and each sequence's K/V as the cache will
    hold them (quantized, dequantized to float32) for the reference."""
    q, k, v, k_cache, v_cache, meta, k_full, v_full = _scenario(
        seqs, heads[0], heads[1], head_dim, block_size, seed=head_dim + block_size
    )
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    k8, v8 = quantize_kv_rows(k_cache), quantize_kv_rows(v_cache)
    k_ref = [dequantize_kv_rows(quantize_kv_rows(kf.to(dtype)), torch.float32) for kf in k_full]
    v_ref = [dequantize_kv_rows(quantize_kv_rows(vf.to(dtype)), torch.float32) for vf in v_full]
    return q, k, v, k8, v8, meta, k_ref, v_ref


# the int8 decode kernels: bf16 queries on AVX-512, float32 ones on AVX-512 or AVX2 + FMA
# (the attention math in float32 either way; bf16 outputs round to 8 bits)
_INT8_DECODE = [
    pytest.param(
        BF,
        2e-2,
        marks=pytest.mark.skipif(not cpu_has_flag("avx512f"), reason="bf16: AVX-512 only"),
    ),
    pytest.param(
        torch.float32,
        1e-4,
        marks=pytest.mark.skipif(
            not (cpu_has_flag("avx512f") or (cpu_has_flag("avx2") and cpu_has_flag("fma"))),
            reason="float32: AVX-512 or AVX2 + FMA",
        ),
    ),
]


@needs_native
@pytest.mark.parametrize(("dtype", "tol"), _INT8_DECODE)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_seqs", [1, 3, 9])  # fewer than 4: key ranges split and merged
@pytest.mark.parametrize("block_size", [16, 4])  # runs of keys cut short by block ends
def test_int8_decode_kernel_matches_attention_over_dequantized_rows(
    head_dim: int, num_seqs: int, block_size: int, dtype: torch.dtype, tol: float
) -> None:
    seqs = [(1, n) for n in (1, 17, 300, 33, 64, 5, 129, 16, 90)[:num_seqs]]
    q, k, v, k8, v8, meta, k_ref, v_ref = _int8_scenario(seqs, (9, 3), head_dim, block_size, dtype)
    # the new tokens' rows written first, as the backend does
    assert write_kv_int8_native(k, v, k8, v8, meta.slot_mapping)
    out = paged_decode_attention(q, k8, v8, meta.block_tables, meta.seq_lens_k, 0.125)
    assert out is not None and out.dtype == dtype
    ref = reference_attention(q.float(), k_ref, v_ref, meta.q_lens, meta.k_lens, 0.125)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    # a block id outside the cache is an error, not a stray read
    bad = meta.block_tables.clone()
    bad[0, 0] = k8.shape[0]
    with pytest.raises(IndexError, match="outside the KV cache"):
        paged_decode_attention(q, k8, v8, bad, meta.seq_lens_k, 0.125)


@pytest.mark.parametrize(
    "backend",
    [
        TorchPagedAttention,
        pytest.param(CpuPagedAttention, marks=needs_native),
    ],
)
@pytest.mark.parametrize("scenario", range(len(SCENARIOS)))
def test_backends_attend_over_the_quantized_rows(backend: type, scenario: int) -> None:
    # decodes, fresh prefills and chunks with context: every step reads the rows back
    q, k, v, k8, v8, meta, k_ref, v_ref = _int8_scenario(SCENARIOS[scenario], (6, 2), 64, 4)
    out = backend().forward(q, k, v, k8, v8, meta, 0.125)
    ref = reference_attention(q.float(), k_ref, v_ref, meta.q_lens, meta.k_lens, 0.125)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    # and the new tokens' rows are in the cache as the reference quantizes them
    slots = meta.slot_mapping
    assert torch.equal(k8.view(-1, 2, 68)[slots], quantize_kv_rows(k))


def test_allocation_and_sizing_of_int8_caches() -> None:
    cfg = _tiny_config(head_dim=64, num_heads=6, num_kv_heads=3, hidden_size=384)
    assert kv_cache_layout("int8", BF, 64) == (torch.int8, 68)
    assert kv_cache_layout("auto", BF, 64) == (BF, 64)
    caches = allocate_kv_cache(cfg, 10, 16, BF, "cpu", kv_cache_dtype="int8")
    assert len(caches) == cfg.num_layers
    k, v = caches[0]
    assert k.dtype == v.dtype == torch.int8 and k.shape == (10, 16, 3, 68)
    per_int8 = kv_cache_bytes_per_block(cfg, 16, BF, kv_cache_dtype="int8")
    per_bf16 = kv_cache_bytes_per_block(cfg, 16, BF)
    assert per_int8 == 2 * 16 * 3 * 68 * cfg.num_layers and per_int8 / per_bf16 == 68 / 128


def test_unsupported_int8_setups_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'fp8'"):
        CacheConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="not supported by the flash_attn attention backend"):
        EngineConfig(attention_backend="flash_attn", cache=CacheConfig(kv_cache_dtype="int8"))
    with pytest.raises(ValueError, match="not int8"):
        select_attention_backend("flash_attn", torch.device("cpu"), 256, kv_cache_dtype="int8")
    # auto never picks flash-attn for an int8 cache
    auto = select_attention_backend("auto", torch.device("cpu"), 16, BF, kv_cache_dtype="int8")
    assert auto.name in ("cpu", "torch")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_layout("fp8", BF, 64)


@pytest.mark.parametrize(
    "backend", [TorchPagedAttention, pytest.param(CpuPagedAttention, marks=needs_native)]
)
@pytest.mark.parametrize("dtype", [BF, torch.float32])
def test_model_logits_on_an_int8_cache_stay_close_to_the_model_dtype_cache(
    backend: type, dtype: torch.dtype
) -> None:
    from sarazmq.model.llama import LlamaForCausalLM

    cfg = _tiny_config(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        max_position=128,
    )
    model = LlamaForCausalLM(cfg, backend(), dtype=dtype)
    model.random_init_(seed=3, std=0.1)
    table = [[3, 1, 7, 0, 5, 9, 11, 2]]

    def run(kv_cache_dtype: str) -> torch.Tensor:
        caches = allocate_kv_cache(cfg, 16, 4, dtype, "cpu", kv_cache_dtype=kv_cache_dtype)
        logits = []
        for q_len, k_len in ((12, 12), (8, 20), (1, 21), (1, 22), (1, 23)):
            meta = AttentionMetadata.build([q_len], [k_len], table, 4)
            pos = torch.arange(k_len - q_len, k_len)
            hidden = model(pos % cfg.vocab_size, pos, caches, meta)
            logits.append(model.compute_logits(hidden)[-1:])
        return torch.cat(logits).float()

    on_dtype, on_int8 = run("auto"), run("int8")
    assert not torch.equal(on_dtype, on_int8)  # the cache did change
    # random weights leave near-ties in the argmax: the logits themselves are compared
    torch.testing.assert_close(on_int8, on_dtype, atol=0.1, rtol=0.05)
    assert (on_int8 - on_dtype).abs().mean() < 0.02


def test_the_cli_option_reaches_the_engine_config() -> None:
    from click.testing import CliRunner

    from sarazmq.cli import main
    from sarazmq.cli.options import engine_config

    assert engine_config({"kv_cache_dtype": "int8"}).cache.kv_cache_dtype == "int8"
    assert engine_config({}).cache.kv_cache_dtype == "auto"
    r = CliRunner().invoke(main, ["serve", "--kv-cache-dtype", "fp8"])
    assert r.exit_code == 2 and "'--kv-cache-dtype'" in r.output and "fp8" in r.output
