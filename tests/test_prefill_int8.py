"""The float32 prefill kernel reading an int8 KV cache in place
(kernels/csrc/prefill_attention_f32.c, prefill_attention_i8_f32; AVX512-VNNI builds): both
products exact in integers, against the query rows and the probabilities rounded to int16.
Checked against the same kernel over the dequantized cache (the path taken elsewhere) and
against the torch reference over the dequantized keys and values."""

from __future__ import annotations

import pytest
import torch
from test_kernels import _scenario

from sarazmq.kernels.cpu_attention_kernels import (
    cpu_attention_available,
    prefill_attention,
    prefill_int8_available,
    prefill_scratch_elems,
)
from sarazmq.kernels.kv_int8 import dequantize_kv_rows, quantize_kv_rows
from sarazmq.kernels.torch_attention import reference_attention, write_kv_cache

pytestmark = pytest.mark.skipif(
    not (cpu_attention_available() and prefill_int8_available()),
    reason="the int8-cache prefill kernel is built for CPUs with AVX512-VNNI",
)


def _case(
    q_len: int, k_len: int, heads: tuple[int, int], head_dim: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the kernel over the int8 cache, the float32 kernel over its dequantized copy, the
    torch reference over the dequantized keys and values) for one chunk."""
    q, k, v, k_cache, v_cache, meta, _, _ = _scenario(
        [(q_len, k_len)], *heads, head_dim, block_size, seed=q_len * 7 + k_len
    )
    # the context at the scale of a model's keys: the scenario's garbage slots stay large
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    k_i8, v_i8 = quantize_kv_rows(k_cache), quantize_kv_rows(v_cache)
    k_deq, v_deq = dequantize_kv_rows(k_i8, torch.float32), dequantize_kv_rows(v_i8, torch.float32)
    table, scale = meta.block_tables[0], head_dim**-0.5
    got = torch.full(q.shape, float("nan"))
    assert prefill_attention(q, k_i8, v_i8, table, k_len, scale, got)
    deq = torch.full(q.shape, float("nan"))
    assert prefill_attention(q, k_deq, v_deq, table, k_len, scale, deq)
    bs = block_size
    blocks = table[: -(-k_len // bs)].long()
    k_full = k_deq[blocks].reshape(-1, heads[1], head_dim)[:k_len]
    v_full = v_deq[blocks].reshape(-1, heads[1], head_dim)[:k_len]
    ref = reference_attention(q, [k_full], [v_full], meta.q_lens, meta.k_lens, scale)
    return got, deq, ref


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (4, 4)])
@pytest.mark.parametrize(
    "lens", [(1, 1), (7, 7), (16, 16), (37, 37), (3, 40), (6, 64), (7, 65), (25, 77), (130, 130)]
)
@pytest.mark.parametrize("block_size", [4, 16])
def test_int8_cache_prefill_matches_the_dequantized_path(
    head_dim: int, heads: tuple[int, int], lens: tuple[int, int], block_size: int
) -> None:
    got, deq, ref = _case(*lens, heads, head_dim, block_size)
    # a query element or a probability rounded to int16 moves by at most 1 / 65,534 of
    # its row's largest: ~1e-5 here, a hundredth of what the int8 rows themselves move
    torch.testing.assert_close(got, deq, atol=1.5e-4, rtol=1e-3)
    torch.testing.assert_close(got, ref, atol=1.5e-4, rtol=1e-3)


def test_int8_cache_prefill_long_chunk_error_is_far_below_the_caches() -> None:
    # a late 512-token chunk of a 2,048-token prompt, 9/3 heads
    q_len, k_len, heads, d = 512, 2048, (9, 3), 64
    got, deq, ref = _case(q_len, k_len, heads, d, 16)
    torch.testing.assert_close(got, deq, atol=1.5e-4, rtol=1e-3)
    torch.testing.assert_close(got, ref, atol=1.5e-4, rtol=1e-3)
    # against attention over the float keys and values (before the int8 cache): the
    # int16 roundings add under a tenth of what the cache's int8 rows cost
    q, k, v, _, _, meta, k_full, v_full = _scenario(
        [(q_len, k_len)], *heads, d, 16, seed=q_len * 7 + k_len
    )
    exact = reference_attention(q, k_full, v_full, meta.q_lens, meta.k_lens, d**-0.5)
    cache_error = float((deq - exact).abs().max())
    assert float((got - deq).abs().max()) < cache_error / 10, cache_error


def test_int8_cache_prefill_zero_query_rows_and_bad_blocks() -> None:
    q, k, v, k_cache, v_cache, meta, _, _ = _scenario([(20, 50)], 6, 2, 64, 16, seed=4)
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    k_i8, v_i8 = quantize_kv_rows(k_cache), quantize_kv_rows(v_cache)
    q[3] = 0.0  # a zero query row: scale 0, uniform attention over its visible keys
    table = meta.block_tables[0]
    out = torch.empty_like(q)
    scratch = torch.empty(prefill_scratch_elems(50, 2, 64))
    assert prefill_attention(q, k_i8, v_i8, table, 50, 0.125, out, scratch)
    v_deq = dequantize_kv_rows(v_i8, torch.float32)[table[:4].long()].reshape(-1, 2, 64)
    visible = 50 - 20 + 3 + 1
    want = v_deq[:visible].mean(0).repeat_interleave(3, dim=0)  # [6, 64]: G = 3
    torch.testing.assert_close(out[3], want, atol=1e-5, rtol=1e-5)
    bad = table.clone()
    bad[1] = k_i8.shape[0]  # one past the cache
    before = out.clone()
    with pytest.raises(IndexError, match="outside the KV cache"):
        prefill_attention(q, k_i8, v_i8, bad, 50, 0.125, out, scratch)
    assert torch.equal(out, before)  # nothing written
