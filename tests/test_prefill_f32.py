"""The float32 prefill attention kernel (kernels/csrc/prefill_attention_f32.c, CPUs with
AVX2 and FMA: 8 lanes, or 16 with AVX-512) against the torch reference, and the backend
taking it for float32 chunks. The AVX2 build runs here on AVX-512 CPUs too, under the
avx2 cap (tests/test_cpu_isa.py)."""

from __future__ import annotations

import pytest
import torch
from test_kernels import SCENARIOS, _scenario

from sarazmq.kernels import CpuPagedAttention
from sarazmq.kernels import cpu_attention as cpu_attention_module
from sarazmq.kernels.cpu_attention_kernels import (
    cpu_attention_available,
    prefill_attention,
    prefill_f32_available,
    prefill_scratch_elems,
)
from sarazmq.kernels.torch_attention import reference_attention, write_kv_cache

pytestmark = pytest.mark.skipif(
    not (cpu_attention_available() and prefill_f32_available()),
    reason="the float32 prefill kernel is built for CPUs with AVX2 and FMA",
)


def _case(
    q_len: int, k_len: int, heads: tuple[int, int], head_dim: int, block_size: int
) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """(kernel ran, its output, the reference) for one chunk over its cached context."""
    q, k, v, k_cache, v_cache, meta, k_full, v_full = _scenario(
        [(q_len, k_len)], *heads, head_dim, block_size, seed=q_len * 7 + k_len
    )
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.full(q.shape, float("nan"))
    scale = head_dim**-0.5
    ok = prefill_attention(q, k_cache, v_cache, meta.block_tables[0], k_len, scale, out)
    ref = reference_attention(q, k_full, v_full, meta.q_lens, meta.k_lens, scale)
    return ok, out, ref


# chunks with and without earlier context, at and off the 16-key pieces, the 64-key steps
# and the 6- and 12-row groups, over blocks of several sizes; grouped-query layouts with G of 1,
# 3 and 8
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (4, 4)])
@pytest.mark.parametrize(
    "lens",
    [(1, 1), (5, 5), (7, 7), (16, 16), (37, 37), (3, 40), (16, 48), (6, 64), (7, 65)]
    + [(12, 12), (25, 77), (33, 100), (64, 81), (70, 200), (130, 130)],
)
@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_prefill_kernel_f32_matches_reference(
    head_dim: int, heads: tuple[int, int], lens: tuple[int, int], block_size: int
) -> None:
    ok, out, ref = _case(*lens, heads, head_dim, block_size)
    assert ok
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)


def test_prefill_kernel_f32_long_context() -> None:
    # a late 512-token chunk of a 2,048-token prompt (the benchmark's shape), 9/3 heads
    ok, out, ref = _case(512, 2048, (9, 3), 64, 16)
    assert ok
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)


def test_prefill_kernel_f32_reads_strided_queries_and_any_scratch() -> None:
    # q and out as the model passes them (query heads of a fused qkv row; a slice of a
    # wider buffer), and a scratch buffer that is too small or misaligned: replaced
    q, k, v, k_cache, v_cache, meta, k_full, v_full = _scenario([(20, 50)], 6, 2, 64, 16, seed=4)
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    qkv = torch.cat([q.flatten(1), torch.randn(20, 2 * 2 * 64)], dim=1)
    q_view = qkv[:, : 6 * 64].view(20, 6, 64)
    wide = torch.full((20, 7 * 64), float("nan"))
    out = wide[:, 64:].view(20, 6, 64)
    table = meta.block_tables[0]
    ref = reference_attention(q, k_full, v_full, meta.q_lens, meta.k_lens, 0.125)
    need = prefill_scratch_elems(50, 2, 64)
    for scratch in (None, torch.empty(need + 1)[1:], torch.empty(need // 2)):
        out.fill_(float("nan"))
        assert prefill_attention(q_view, k_cache, v_cache, table, 50, 0.125, out, scratch)
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)
    assert torch.isnan(wide[:, :64]).all()  # nothing written outside out


def test_prefill_kernel_f32_declines_what_it_cannot_do() -> None:
    q, k, v, k_cache, v_cache, meta, _, _ = _scenario([(4, 9)], 4, 2, 64, 4, seed=3)
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    table = meta.block_tables[0]
    out = torch.full(q.shape, float("nan"))
    # the bf16 kernels by name, head sizes other than 64/128, float16: nothing written
    for kernel in ("amx", "avx512"):
        assert not prefill_attention(q, k_cache, v_cache, table, 9, 0.1, out, kernel=kernel)
    q80, c80 = torch.zeros(4, 4, 80), torch.zeros(6, 4, 2, 80)
    assert not prefill_attention(q80, c80, c80, table, 9, 0.1, torch.empty_like(q80))
    half = q.half()
    assert not prefill_attention(half, k_cache.half(), v_cache.half(), table, 9, 0.1, half)
    assert torch.isnan(out).all()
    # the float32 kernel by name takes float32 only
    bf = torch.bfloat16
    assert not prefill_attention(
        q.to(bf), k_cache.to(bf), v_cache.to(bf), table, 9, 0.1, out.to(bf), kernel="f32"
    )
    assert prefill_attention(q, k_cache, v_cache, table, 9, 0.1, out, kernel="f32")
    # a block id outside the cache is an error, as everywhere else
    bad = table.clone()
    bad[1] = 10_000
    with pytest.raises(IndexError, match="outside the KV cache"):
        prefill_attention(q, k_cache, v_cache, bad, 9, 0.1, out)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3)])
@pytest.mark.parametrize("scenario", range(len(SCENARIOS)))
def test_backend_takes_the_f32_kernel_for_chunks(
    block_size: int, heads: tuple[int, int], scenario: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # hybrid batches (decodes first, then chunks with and without context) through the
    # backend with the native prefill and without it (SDPA): the same attention
    q, k, v, k_cache, v_cache, meta, k_full, v_full = _scenario(
        SCENARIOS[scenario], *heads, 64, block_size, seed=11
    )
    ref = reference_attention(q, k_full, v_full, meta.q_lens, meta.k_lens, 0.3)
    ran: list[bool] = []

    def counted(*args: object, **kwargs: object) -> bool:
        ran.append(prefill_attention(*args, **kwargs))  # type: ignore[arg-type]
        return ran[-1]

    monkeypatch.setattr(cpu_attention_module, "prefill_attention", counted)
    out = CpuPagedAttention(native_prefill=True).forward(
        q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.3
    )
    assert ran == [True] * (meta.num_seqs - meta.num_decodes)
    out_sdpa = CpuPagedAttention(native_prefill=False).forward(
        q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.3
    )
    assert len(ran) == meta.num_seqs - meta.num_decodes  # SDPA: the kernel not called
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out, out_sdpa, atol=2e-5, rtol=2e-5)
