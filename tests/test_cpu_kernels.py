"""Native CPU kernels (kernels/csrc, built with the system C compiler) against the torch
reference: paged decode attention, KV cache writes, the backend built on them, and the
fallback when the kernels cannot be built."""

from __future__ import annotations

import mmap
import os
import re
import subprocess
import sys

import pytest
import torch
from test_kernels import SCENARIOS, _scenario

from sarazmq.kernels import CpuPagedAttention, TorchPagedAttention, select_attention_backend
from sarazmq.kernels.cpu_attention_kernels import (
    cpu_attention_available,
    paged_decode_attention,
    prefill_amx_available,
    prefill_attention,
    prefill_f32_available,
    write_kv_cache_native,
)
from sarazmq.kernels.cpu_ops import TORCH_OPS, HotOps, NativeCpuOps
from sarazmq.kernels.linear_weight import LinearWeight
from sarazmq.kernels.memory import zeros_huge_pages
from sarazmq.kernels.native import cpu_has_flag
from sarazmq.kernels.torch_attention import reference_attention, write_kv_cache

pytestmark = pytest.mark.skipif(
    not cpu_attention_available(), reason="no C compiler: native kernels not built"
)


# head_dim 64 and 128 take the AVX-512 path where the CPU has it, 16 and 80 the portable one
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
def test_decode_kernel_matches_reference(
    head_dim: int, heads: tuple[int, int], block_size: int
) -> None:
    # lengths around block and 16-key run edges, and a single key
    seqs = [(1, n) for n in (1, 2, 15, 16, 17, 33, 70)]
    num_heads, num_kv_heads = heads
    q, k, v, k_cache, v_cache, meta, k_full, v_full = _scenario(
        seqs, num_heads, num_kv_heads, head_dim, block_size, seed=head_dim + block_size
    )
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens_k, scale)
    assert out is not None and out.shape == q.shape
    ref = reference_attention(q, k_full, v_full, meta.q_lens, meta.k_lens, scale)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)


def test_decode_kernel_reads_strided_queries() -> None:
    # q as the model passes it: the query heads of a fused qkv projection output
    seqs = [(1, 9), (1, 30), (1, 17)]
    q, k, v, k_cache, v_cache, meta, k_full, v_full = _scenario(seqs, 6, 2, 64, 16, seed=1)
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    qkv = torch.cat([q.flatten(1), torch.randn(3, 2 * 2 * 64)], dim=1)  # [3, (6 + 4) * 64]
    q_view = qkv[:, : 6 * 64].view(3, 6, 64)
    assert not q_view.is_contiguous()
    out = paged_decode_attention(
        q_view, k_cache, v_cache, meta.block_tables, meta.seq_lens_k, 0.125
    )
    ref = reference_attention(q, k_full, v_full, meta.q_lens, meta.k_lens, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)


# fewer than 4 sequences: each sequence's keys are split into ranges (work for every
# thread) and merged by their softmax maxima and sums; short sequences leave ranges empty
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (40, 4)])
@pytest.mark.parametrize("lens", [(1,), (515,), (2, 100), (17, 1, 300)])
def test_decode_kernel_with_few_sequences_matches_reference(
    dtype: torch.dtype, head_dim: int, heads: tuple[int, int], lens: tuple[int, ...]
) -> None:
    seqs = [(1, n) for n in lens]
    q, k, v, k_cache, v_cache, meta, k_full, v_full = _scenario(
        seqs, *heads, head_dim, 16, seed=len(lens) + head_dim
    )
    kc, vc = k_cache.to(dtype), v_cache.to(dtype)
    write_kv_cache(k.to(dtype), v.to(dtype), kc, vc, meta.slot_mapping)
    out = paged_decode_attention(q.to(dtype), kc, vc, meta.block_tables, meta.seq_lens_k, 0.2)
    assert out is not None and out.dtype == dtype
    kf = [t.to(dtype) for t in k_full]
    vf = [t.to(dtype) for t in v_full]
    ref = reference_attention(q.to(dtype), kf, vf, meta.q_lens, meta.k_lens, 0.2)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), atol=0.02, rtol=0.02)


# bf16 has its own AVX-512 path (VDPBF16PS dot products, V rows widened in an even/odd
# order that the output store undoes), compiled per (head_dim, heads per KV head) pair
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("heads", [(6, 2), (9, 3), (8, 1), (4, 4), (20, 2)])
@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_decode_kernel_bf16_close_to_reference(
    head_dim: int, heads: tuple[int, int], block_size: int
) -> None:
    seqs = [(1, 9), (1, 30), (1, 2), (1, 100), (1, 16), (1, 33)]
    q, k, v, k_cache, v_cache, meta, k_full, v_full = _scenario(
        seqs, *heads, head_dim, block_size, seed=9
    )
    bf = torch.bfloat16
    kc, vc = k_cache.to(bf), v_cache.to(bf)
    write_kv_cache(k.to(bf), v.to(bf), kc, vc, meta.slot_mapping)
    out = paged_decode_attention(q.to(bf), kc, vc, meta.block_tables, meta.seq_lens_k, 0.25)
    assert out is not None and out.dtype == bf
    kf = [t.to(bf) for t in k_full]
    vf = [t.to(bf) for t in v_full]
    ref = reference_attention(q.to(bf), kf, vf, meta.q_lens, meta.k_lens, 0.25)
    torch.testing.assert_close(out.float(), ref.float(), atol=0.02, rtol=0.02)


def _bf16_prefill_case(
    q_len: int,
    k_len: int,
    heads: tuple[int, int],
    head_dim: int,
    block_size: int,
    kernel: str = "avx512",
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(native output or None when the kernel declined, float32 reference) for one chunk."""
    bf = torch.bfloat16
    q, k, v, k_cache, v_cache, meta, k_full, v_full = _scenario(
        [(q_len, k_len)], *heads, head_dim, block_size, seed=q_len + k_len
    )
    kc, vc = k_cache.to(bf), v_cache.to(bf)
    write_kv_cache(k.to(bf), v.to(bf), kc, vc, meta.slot_mapping)
    out = torch.full(q.shape, float("nan"), dtype=bf)
    scale = head_dim**-0.5
    ok = prefill_attention(q.to(bf), kc, vc, meta.block_tables[0], k_len, scale, out, kernel=kernel)
    kf, vf = [t.to(bf) for t in k_full], [t.to(bf) for t in v_full]
    ref = reference_attention(q.to(bf), kf, vf, meta.q_lens, meta.k_lens, scale)
    return (out if ok else None), ref


_PREFILL_BF16 = _bf16_prefill_case(1, 1, (2, 1), 64, 16)[0] is not None
_PREFILL_KERNELS = [
    pytest.param(
        "avx512", marks=pytest.mark.skipif(not _PREFILL_BF16, reason="CPU without AVX512-BF16")
    ),
    pytest.param(
        "amx", marks=pytest.mark.skipif(not prefill_amx_available(), reason="CPU without AMX")
    ),
]


# causal chunks with and without earlier context, at and off the 16-key and row-group
# edges, over blocks of several sizes; grouped-query layouts with G of 1, 3 and 8
@pytest.mark.parametrize("kernel", _PREFILL_KERNELS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (4, 4)])
@pytest.mark.parametrize(
    "lens",
    [(1, 1), (5, 5), (16, 16), (37, 37), (3, 40), (16, 48), (33, 100), (64, 81), (70, 200)],
)
@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_prefill_kernel_bf16_close_to_reference(
    kernel: str, head_dim: int, heads: tuple[int, int], lens: tuple[int, int], block_size: int
) -> None:
    out, ref = _bf16_prefill_case(*lens, heads, head_dim, block_size, kernel)
    assert out is not None
    # probabilities rounded to bf16 before the V product, as SDPA's bf16 CPU kernel does
    torch.testing.assert_close(out.float(), ref.float(), atol=0.02, rtol=0.02)


@pytest.mark.parametrize("kernel", _PREFILL_KERNELS)
def test_prefill_kernel_bf16_long_context(kernel: str) -> None:
    # a late 512-token chunk of a 2,048-token prompt (the benchmark's shape), 9/3 heads;
    # the AMX kernel's 64-key steps end mid-block and mid-chunk here too
    out, ref = _bf16_prefill_case(512, 2048, (9, 3), 64, 16, kernel)
    assert out is not None
    torch.testing.assert_close(out.float(), ref.float(), atol=0.01, rtol=0.02)


def test_prefill_kernel_declines_what_it_cannot_do() -> None:
    q, k, v, k_cache, v_cache, meta, _, _ = _scenario([(4, 9)], 4, 2, 64, 4, seed=3)
    table = meta.block_tables[0]
    out = torch.empty_like(q)
    # float32 takes the SDPA path where its kernel is not built (tests/test_prefill_f32.py);
    # head sizes other than 64/128 take it everywhere
    assert prefill_attention(q, k_cache, v_cache, table, 9, 0.1, out) == prefill_f32_available()
    bf = torch.bfloat16
    q80 = torch.zeros(4, 4, 80, dtype=bf)
    c80 = torch.zeros(6, 4, 2, 80, dtype=bf)
    assert not prefill_attention(q80, c80, c80, table, 9, 0.1, torch.empty_like(q80))
    # a block id outside the cache is an error, as everywhere else, for either kernel
    bad = table.clone()
    bad[1] = 10_000
    if _PREFILL_BF16:
        for kernel in ("avx512", "amx") if prefill_amx_available() else ("avx512",):
            with pytest.raises(IndexError, match="outside the KV cache"):
                prefill_attention(
                    q.to(bf), k_cache.to(bf), v_cache.to(bf), bad, 9, 0.1, out.to(bf), kernel=kernel
                )
    with pytest.raises(ValueError, match="prefill kernel 'tiles' is not one of"):
        prefill_attention(
            q.to(bf), k_cache.to(bf), v_cache.to(bf), table, 9, 0.1, out, kernel="tiles"
        )


def test_decode_kernel_declines_what_it_cannot_do() -> None:
    seqs = [(1, 9)]
    q, k, v, k_cache, v_cache, meta, _, _ = _scenario(seqs, 4, 4, 16, 4, seed=2)
    lens, tables = meta.seq_lens_k, meta.block_tables
    # head size beyond the kernel's limit, mixed dtypes, float16: the caller falls back
    big = torch.zeros(1, 4, 512)
    assert paged_decode_attention(big, k_cache, v_cache, tables, lens, 1.0) is None
    assert paged_decode_attention(q.double(), k_cache, v_cache, tables, lens, 1.0) is None
    assert paged_decode_attention(q, k_cache.half(), v_cache.half(), tables, lens, 1.0) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kv_write_equals_index_copy(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(10, 4, 2, 16, generator=g).to(dtype)
    v_cache = torch.randn(10, 4, 2, 16, generator=g).to(dtype)
    qkv = torch.randn(5, 6 * 16, generator=g).to(dtype)
    k = qkv[:, 2 * 16 : 4 * 16].view(5, 2, 16)  # strided views, as the model passes them
    v = qkv[:, 4 * 16 :].view(5, 2, 16)
    slots = torch.tensor([3, 17, 0, 39, 22])
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache(k, v, k_ref, v_ref, slots)
    assert write_kv_cache_native(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    # a dtype mismatch is declined, nothing written
    assert not write_kv_cache_native(k.float(), v.float(), k_cache.half(), v_cache.half(), slots)


@pytest.mark.parametrize("scenario", range(len(SCENARIOS)))
def test_cpu_backend_matches_torch_backend_on_hybrid_batches(scenario: int) -> None:
    seqs = SCENARIOS[scenario]
    q, k, v, k_cache, v_cache, meta, k_full, v_full = _scenario(seqs, 6, 2, 64, 4, seed=scenario)
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    out = CpuPagedAttention().forward(q, k, v, k_cache, v_cache, meta, 0.125)
    ref = TorchPagedAttention().forward(q, k, v, kc2, vc2, meta, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)
    assert torch.equal(k_cache, kc2) and torch.equal(v_cache, vc2)


@pytest.mark.parametrize("scenario", range(len(SCENARIOS)))
@pytest.mark.parametrize("native_prefill", [True, False])
def test_cpu_backend_in_bf16_close_to_reference(scenario: int, native_prefill: bool) -> None:
    # bf16 hybrid batches through the backend, with the native prefill kernel and with
    # SDPA for the chunks (what CPUs with AMX get)
    seqs = SCENARIOS[scenario]
    q, k, v, k_cache, v_cache, meta, k_full, v_full = _scenario(seqs, 6, 2, 64, 4, seed=scenario)
    bf = torch.bfloat16
    backend = CpuPagedAttention(native_prefill=native_prefill)
    kc, vc = k_cache.to(bf), v_cache.to(bf)
    out = backend.forward(q.to(bf), k.to(bf), v.to(bf), kc, vc, meta, 0.125)
    kf, vf = [t.to(bf) for t in k_full], [t.to(bf) for t in v_full]
    ref = reference_attention(q.to(bf), kf, vf, meta.q_lens, meta.k_lens, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=0.02, rtol=0.02)


def test_auto_backend_on_cpu_is_native() -> None:
    cpu = torch.device("cpu")
    assert isinstance(select_attention_backend("auto", cpu, 16), CpuPagedAttention)
    assert select_attention_backend("cpu", cpu, 16).name == "cpu"


def test_without_native_kernels_auto_falls_back_to_torch(tmp_path) -> None:
    # SARAZMQ_NATIVE=0 stands for a machine with no C compiler: nothing is built, "auto"
    # picks the torch backend and asking for "cpu" explicitly names the problem
    code = (
        "import torch\n"
        "from sarazmq.kernels import select_attention_backend\n"
        "cpu = torch.device('cpu')\n"
        "assert select_attention_backend('auto', cpu, 16).name == 'torch'\n"
        "try:\n"
        "    select_attention_backend('cpu', cpu, 16)\n"
        "except ValueError as e:\n"
        "    assert 'native kernel could not be built' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('cpu backend without kernels was accepted')\n"
    )
    env = dict(os.environ, SARAZMQ_NATIVE="0", SARAZMQ_CACHE=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "native").exists()


@pytest.mark.parametrize("mapping", ["anonymous", "no mmap"])
def test_huge_page_buffer_is_zeroed_and_writable(
    mapping: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mapping == "no mmap":  # the fallback: allocated and zeroed here

        def refuse(*args: object, **kwargs: object) -> None:
            raise OSError("no mapping")

        monkeypatch.setattr(mmap, "mmap", refuse)
    buf = zeros_huge_pages(3 * 1024 * 1024 + 7, torch.bfloat16, "cpu")
    assert buf.numel() == 3 * 1024 * 1024 + 7 and buf.dtype == torch.bfloat16
    assert buf.data_ptr() % (2 * 1024 * 1024) == 0 and not buf.any()
    buf[-1] = 1.0
    assert buf.sum().item() == 1.0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_huge_page_buffer_commits_memory_only_where_written() -> None:
    # a KV pool of gigabytes costs no start-up time and no memory until it is used
    before = _rss_bytes()
    buf = zeros_huge_pages(256 * 1024 * 1024, torch.float32, "cpu")  # 1 GiB
    assert _rss_bytes() - before < 64 * 1024 * 1024
    buf[:: 1024 * 1024] = 1.0  # one float a 4 MiB: at most 256 pages (2 MiB or 4 KiB)
    assert _rss_bytes() - before < 600 * 1024 * 1024
    assert buf.sum().item() == 256.0


# ---------------------------------------------------------------------------- fused ops


def _ops() -> tuple[HotOps, NativeCpuOps]:
    return TORCH_OPS, NativeCpuOps()


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    else:
        # bf16: the same roundings as torch; a float32 summation-order or exp ulp can
        # still flip a rare last bf16 bit
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)
        assert (a != b).float().mean().item() < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("with_residual", [False, True])
def test_native_rms_norm_matches_torch(dtype: torch.dtype, rows: int, with_residual: bool) -> None:
    ref_ops, native = _ops()
    g = torch.Generator().manual_seed(rows)
    wide = (torch.randn(rows, 600, generator=g) * 3).to(dtype)
    x = wide[:, :576]  # a strided row view, as a slice of a fused output would be
    weight = torch.randn(576, generator=g).to(dtype)
    res = torch.randn(rows, 576, generator=g).to(dtype) if with_residual else None
    res_ref = None if res is None else res.clone()
    out, new_res = native.rms_norm_(x, weight, 1e-5, res)
    ref, new_res_ref = ref_ops.rms_norm_(x, weight, 1e-5, res_ref)
    _close(out, ref, dtype)
    assert torch.equal(new_res, new_res_ref)  # the residual add rounds identically
    if with_residual:
        assert new_res is res  # updated in place, like the reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_native_rope_matches_torch(dtype: torch.dtype, head_dim: int) -> None:
    from sarazmq.kernels.ops import build_rope_cache, rope_cos_sin

    ref_ops, native = _ops()
    g = torch.Generator().manual_seed(head_dim)
    rows, q_heads, kv_heads = 7, 9, 3
    qkv = torch.randn(rows, (q_heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.tensor([0, 1, 5, 100, 511, 2047, 3])
    cos, sin = rope_cos_sin(positions, build_rope_cache(head_dim, 4096, 10000.0), dtype)
    view = (q_heads + kv_heads) * head_dim
    a = qkv.clone()
    b = qkv.clone()
    native.apply_rope_(a[:, :view].view(rows, -1, head_dim), cos, sin)
    ref_ops.apply_rope_(b[:, :view].view(rows, -1, head_dim), cos, sin)
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(a, b)  # products and sum rounded exactly as torch does
    assert torch.equal(a[:, view:], qkv[:, view:])  # V untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("inter", [1536, 37])
def test_native_silu_mul_matches_torch(dtype: torch.dtype, rows: int, inter: int) -> None:
    ref_ops, native = _ops()
    g = torch.Generator().manual_seed(rows + inter)
    wide = (torch.randn(rows, 2 * inter + 8, generator=g) * 6).to(dtype)
    # saturating and special values: exp overflow (silu -> -0), large positives, zeros
    wide[0, :6] = torch.tensor([100.0, -100.0, 89.0, -89.0, 0.0, -1e-30])
    gate_up = wide[:, : 2 * inter]  # a row stride, as a slice of a fused output would be
    out = native.silu_mul(gate_up, inter)
    ref = ref_ops.silu_mul(gate_up, inter)
    assert out.shape == (rows, inter) and out.dtype == dtype
    if dtype == torch.float32:  # torch's exp and ours differ by an ulp or two
        torch.testing.assert_close(out, ref, atol=1e-30, rtol=3e-7)
    else:  # rounded to bf16 where torch rounds: the same bits but for a rare exp ulp
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-30, rtol=8e-3)
        assert (out != ref).float().mean().item() < 1e-3
    assert torch.equal(out[0, 1].abs(), torch.zeros((), dtype=dtype))


def test_native_ops_fall_back_where_they_do_not_apply() -> None:
    ref_ops, native = _ops()
    x = torch.randn(3, 8, dtype=torch.float64)
    w = torch.ones(8, dtype=torch.float64)
    out, _ = native.rms_norm_(x, w, 1e-6, None)  # float64: the torch reference
    torch.testing.assert_close(out, ref_ops.rms_norm_(x, w, 1e-6, None)[0])
    qk = torch.randn(3, 2, 16).transpose(0, 1)  # heads not contiguous: the reference
    cos, sin = torch.ones(2, 1, 16), torch.zeros(2, 1, 16)
    torch.testing.assert_close(native.apply_rope_(qk.clone(), cos, sin), qk)


# the model's shapes (hidden 576 -> qkv 960, MLP 1536, vocab rows), row counts below, at
# and past each dtype's limit, widths off the 16-row tile (and AVX2's 8-row one, 15: 4 + 2
# + 1 rows at one input row), an odd number of 8-wide pieces (40), inputs with a row stride
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 9])
@pytest.mark.parametrize("n_k", [(960, 576), (576, 1536), (49, 64), (16, 32), (15, 40)])
def test_native_linear_matches_torch(dtype: torch.dtype, rows: int, n_k: tuple[int, int]) -> None:
    ref_ops, native = _ops()
    n, k = n_k
    g = torch.Generator().manual_seed(n + k + rows)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    x = torch.randn(rows, 2 * k, generator=g).to(dtype)[:, :k]  # row stride 2k
    out = native.linear(x, LinearWeight(w))
    ref = torch.nn.functional.linear(x, w)
    assert out.shape == ref.shape and out.dtype == dtype
    exact = x.double() @ w.double().T
    if dtype == torch.bfloat16:
        # float32 sums in another order, then one bf16 rounding: a unit in the last place
        torch.testing.assert_close(out.double(), exact, atol=1e-4, rtol=2**-7)
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-4, rtol=2**-7)
    else:
        torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_native_linear_falls_back_where_it_does_not_apply() -> None:
    ref_ops, native = _ops()
    bf = torch.bfloat16
    w = torch.randn(40, 48).to(bf)  # 48 inputs: not a multiple of 32
    x = torch.randn(1, 48).to(bf)
    torch.testing.assert_close(native.linear(x, LinearWeight(w)), torch.nn.functional.linear(x, w))
    b = torch.randn(40).to(bf)
    w64, x64 = torch.randn(40, 64).to(bf), torch.randn(1, 64).to(bf)
    torch.testing.assert_close(
        native.linear(x64, LinearWeight(w64, b)), torch.nn.functional.linear(x64, w64, b)
    )
    # float32 past its row limit, or with 36 inputs (not a multiple of the kernel's 16
    # lanes, 8 on AVX2): torch itself
    for xf, wf in (
        (torch.randn(9, 64), torch.randn(8, 64)),
        (torch.randn(1, 36), torch.randn(8, 36)),
    ):
        assert torch.equal(native.linear(xf, LinearWeight(wf)), torch.nn.functional.linear(xf, wf))
    # float16: not covered
    xh, wh = torch.randn(1, 64).half(), torch.randn(8, 64).half()
    assert torch.equal(native.linear(xh, LinearWeight(wh)), torch.nn.functional.linear(xh, wh))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_chunk_with_long_context_matches_reference(dtype: torch.dtype) -> None:
    # a later prefill chunk (context + itself, merged by log-sum-exp) next to decodes
    seqs = [(1, 40), (1, 7), (48, 200), (33, 33)]
    q, k, v, k_cache, v_cache, meta, k_full, v_full = _scenario(seqs, 9, 3, 64, 16, seed=11)
    cast = [t.to(dtype) for t in (q, k, v, k_cache, v_cache)]
    out = CpuPagedAttention().forward(*cast, meta, 0.125)
    kf = [t.to(dtype) for t in k_full]
    vf = [t.to(dtype) for t in v_full]
    ref = reference_attention(cast[0], kf, vf, meta.q_lens, meta.k_lens, 0.125)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), atol=0.02, rtol=0.02)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs a POSIX shell wrapper")
@pytest.mark.parametrize("no_flag", ["-mno-avx2", "-mno-avx512f", "-mno-avx512bf16"])
def test_c_paths_for_cpus_without_avx512_or_bf16(tmp_path, no_flag: str) -> None:
    # the kernels built for a CPU without AVX2 (the portable C path), without AVX-512 (the
    # AVX2 float32 kernels) or with AVX-512 but no BF16 dot products (bf16 keys widened to
    # float32): the same results as the reference
    import shutil

    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    wrapper = tmp_path / "cc-restricted"
    wrapper.write_text(f'#!/bin/sh\nexec {cc} "$@" {no_flag}\n')
    wrapper.chmod(0o755)
    code = (
        "import torch\n"
        "from test_kernels import _scenario\n"
        "from sarazmq.kernels.cpu_attention_kernels import paged_decode_attention\n"
        "from sarazmq.kernels.torch_attention import reference_attention, write_kv_cache\n"
        "from sarazmq.kernels.kv_int8 import dequantize_kv_rows, quantize_kv_rows\n"
        "bf = torch.bfloat16\n"
        "deq = lambda t: dequantize_kv_rows(quantize_kv_rows(t), torch.float32)\n"
        "for d in (64, 128):\n"
        "    seqs = [(1, n) for n in (1, 17, 33, 70)]\n"
        "    q, k, v, kc, vc, meta, kf, vf = _scenario(seqs, 6, 2, d, 16, seed=d)\n"
        "    tables, lens = meta.block_tables, meta.seq_lens_k\n"
        "    kb, vb = kc.to(bf), vc.to(bf)\n"
        "    write_kv_cache(k, v, kc, vc, meta.slot_mapping)\n"
        "    out = paged_decode_attention(q, kc, vc, tables, lens, 0.1)\n"
        "    ref = reference_attention(q, kf, vf, meta.q_lens, meta.k_lens, 0.1)\n"
        "    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)\n"
        # float32 queries over int8 cache rows: a kernel on AVX-512 and AVX2 builds, the
        # torch path (None here) without AVX2
        "    out8 = paged_decode_attention(\n"
        "        q, quantize_kv_rows(kc), quantize_kv_rows(vc), tables, lens, 0.1)\n"
        "    int8_f32 = out8 is not None\n"
        "    if int8_f32:\n"
        "        ref8 = reference_attention(\n"
        "            q, [deq(t) for t in kf], [deq(t) for t in vf], meta.q_lens, meta.k_lens, 0.1)\n"
        "        torch.testing.assert_close(out8, ref8, atol=1e-4, rtol=1e-4)\n"
        "    write_kv_cache(k.to(bf), v.to(bf), kb, vb, meta.slot_mapping)\n"
        "    out = paged_decode_attention(q.to(bf), kb, vb, tables, lens, 0.1)\n"
        "    kf, vf = [t.to(bf) for t in kf], [t.to(bf) for t in vf]\n"
        "    ref = reference_attention(q.to(bf), kf, vf, meta.q_lens, meta.k_lens, 0.1)\n"
        "    torch.testing.assert_close(out.float(), ref.float(), atol=0.02, rtol=0.02)\n"
        # the fused decode step: where this build has the dtype's matrix-vector kernel,
        # bitwise the per-op path; where not (no AVX2; bf16 without AVX512-BF16) it
        # declines and the model runs per op
        "from test_decode_step import compare_with_per_op\n"
        "used_f32, same = compare_with_per_op(torch.float32, 2)\n"
        "assert same\n"
        "used_bf16, same = compare_with_per_op(torch.bfloat16, 2)\n"
        "assert same\n"
        "used_i8, same = compare_with_per_op(torch.float32, 2, kv_cache_dtype='int8', head_dim=64)\n"
        "assert same\n"
        "print('fused', used_f32, used_bf16)\n"
        "print('int8 rows', int8_f32, used_i8)\n"
        # the GGUF block kernels need AVX-512 or AVX2 + FMA, and for bf16 activations
        # AVX512-BF16; where built, bitwise the plain GEMV and close to the reference
        "from sarazmq.kernels.block_quant import block_quant_kernels_available\n"
        "from test_block_quant import (\n"
        "    test_kernel_is_the_plain_kernel_on_the_dequantized_weight as same_as_plain)\n"
        "if block_quant_kernels_available(torch.float32):\n"
        "    for t in ('Q4_1', 'Q8_0'):\n"
        "        same_as_plain(torch.float32, t, (100, 64))\n"
        "print('blocks', block_quant_kernels_available(torch.float32),\n"
        "      block_quant_kernels_available(torch.bfloat16))\n"
    )
    # the code imports helpers of other test modules: tests/ on its path (not the
    # checkout root: tests/conftest.py says why)
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = dict(
        os.environ,
        CC=str(wrapper),
        SARAZMQ_CACHE=str(tmp_path / "cache"),
        PYTHONPATH=tests_dir,
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list((tmp_path / "cache" / "native").glob("cpu_kernels-*.so"))
    # a float32 GEMV (so a fused step and block kernels) on AVX-512 or AVX2 + FMA, none
    # without AVX2; bf16 ones only with AVX512-BF16
    f32 = no_flag != "-mno-avx2" and (
        cpu_has_flag("avx512f") or (cpu_has_flag("avx2") and cpu_has_flag("fma"))
    )
    assert f"fused {f32} False" in proc.stdout
    assert f"int8 rows {f32} {f32}" in proc.stdout
    assert f"blocks {f32} False" in proc.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs a POSIX shell wrapper")
def test_a_compiler_that_fails_leaves_the_torch_path_and_names_the_source(tmp_path) -> None:
    # the sources compile one per core (kernels/native.py): a failure names its source,
    # load_library returns None (callers keep torch), and nothing is left in the cache
    wrapper = tmp_path / "cc-broken"
    wrapper.write_text('#!/bin/sh\necho "boom: cannot compile" >&2\nexit 1\n')
    wrapper.chmod(0o755)
    code = (
        "import logging\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from sarazmq.kernels.native import load_library\n"
        "print('library', load_library())\n"
    )
    env = dict(os.environ, CC=str(wrapper), SARAZMQ_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "library None" in proc.stdout
    assert "native CPU kernels unavailable" in proc.stderr
    assert re.search(r"cc-broken failed on \w+\.c: boom: cannot compile", proc.stderr), proc.stderr
    assert [p.name for p in (tmp_path / "cache" / "native").iterdir()] == []


def test_out_of_range_slots_and_blocks_are_errors_not_stray_writes() -> None:
    # a bad plan (a scheduler bug) must raise like the torch path, never touch memory
    # outside the cache
    seqs = [(1, 9), (1, 20)]
    q, k, v, k_cache, v_cache, meta, _, _ = _scenario(seqs, 6, 2, 64, 4, seed=4)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    before = k_cache.clone()
    bad_slots = torch.tensor([3, num_slots])
    with pytest.raises(IndexError, match="slot"):
        write_kv_cache_native(k, v, k_cache, v_cache, bad_slots)
    assert torch.equal(k_cache, before)  # validated before anything is written
    tables = meta.block_tables.clone()
    tables[1, 2] = k_cache.shape[0]  # one block id past the end
    with pytest.raises(IndexError, match="outside the KV cache"):
        paged_decode_attention(q, k_cache, v_cache, tables, meta.seq_lens_k, 0.1)
    too_long = meta.seq_lens_k.clone()
    too_long[0] = 4 * tables.shape[1] + 1  # longer than its block table
    with pytest.raises(IndexError, match="outside the KV cache"):
        paged_decode_attention(q, k_cache, v_cache, meta.block_tables, too_long, 0.1)


def test_out_of_range_block_in_a_prefill_chunk_is_an_error() -> None:
    seqs = [(5, 20)]
    q, k, v, k_cache, v_cache, meta, _, _ = _scenario(seqs, 6, 2, 64, 4, seed=6)
    meta.block_tables[0, 0] = k_cache.shape[0] + 3
    # float32: the chunk attends through the native prefill kernel where it is built,
    # else over its gathered context (the merge by log-sum-exp)
    with pytest.raises(IndexError, match="block id (out of range|reaches outside the KV cache)"):
        CpuPagedAttention().forward(q, k, v, k_cache, v_cache, meta, 0.1)
