"""Attention backends, RMSNorm and RoPE against plain references."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

from sarazmq.config import RopeScaling
from sarazmq.kernels import (
    FlashAttnPagedAttention,
    TorchPagedAttention,
    select_attention_backend,
)
from sarazmq.kernels.metadata import AttentionMetadata
from sarazmq.kernels.ops import apply_rope, build_rope_cache, rms_norm, rope_inv_freq
from sarazmq.kernels.torch_attention import reference_attention, write_kv_cache

pytestmark = pytest.mark.one_torch_thread


def _scenario(
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    seed: int,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    AttentionMetadata,
    list[torch.Tensor],
    list[torch.Tensor],
]:
    """Random hybrid batch: seqs = [(q_len, k_len)] (decodes first). Earlier context
    (k_len - q_len tokens) is already in the cache at scattered blocks."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(k + block_size - 1) // block_size for _, k in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables: list[list[int]] = []
    for n in blocks_per_seq:
        tables.append(perm[:n])
        perm = perm[n:]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # garbage in unused slots must never leak into the result
    k_cache = torch.randn(cache_shape, generator=g) * 100
    v_cache = torch.randn(cache_shape, generator=g) * 100
    k_full = [torch.randn(k, num_kv_heads, head_dim, generator=g) for _, k in seqs]
    v_full = [torch.randn(k, num_kv_heads, head_dim, generator=g) for _, k in seqs]
    for (q_len, k_len), table, kf, vf in zip(seqs, tables, k_full, v_full, strict=True):
        for pos in range(k_len - q_len):
            b, o = table[pos // block_size], pos % block_size
            k_cache[b, o] = kf[pos]
            v_cache[b, o] = vf[pos]
    q_lens = [q for q, _ in seqs]
    k_lens = [k for _, k in seqs]
    meta = AttentionMetadata.build(q_lens, k_lens, tables, block_size)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g)
    k_new = torch.cat([kf[k - q :] for (q, k), kf in zip(seqs, k_full, strict=True)])
    v_new = torch.cat([vf[k - q :] for (q, k), vf in zip(seqs, v_full, strict=True)])
    return q, k_new, v_new, k_cache, v_cache, meta, k_full, v_full


SCENARIOS = [
    # decodes only
    [(1, 1), (1, 5), (1, 17)],
    # prefills only: fresh, and chunks with earlier context
    [(6, 6), (3, 10), (16, 33)],
    # hybrid: decodes + fresh prefill + later chunk
    [(1, 9), (1, 2), (1, 31), (7, 7), (5, 20), (1, 4)],
    [(1, 40), (12, 12)],
]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("scenario", range(len(SCENARIOS)))
def test_torch_paged_attention_matches_reference(
    block_size: int, heads: tuple[int, int], scenario: int
) -> None:
    num_heads, num_kv_heads = heads
    seqs = SCENARIOS[scenario]
    head_dim = 16
    q, k, v, k_cache, v_cache, meta, k_full, v_full = _scenario(
        seqs, num_heads, num_kv_heads, head_dim, block_size, seed=scenario * 7 + block_size
    )
    scale = head_dim**-0.5
    out = TorchPagedAttention().forward(q, k, v, k_cache, v_cache, meta, scale)
    ref = reference_attention(q, k_full, v_full, meta.q_lens, meta.k_lens, scale)
    assert out.shape == q.shape
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group_bytes", [1, 3000, 10**9])
def test_decodes_in_groups_match_reference(group_bytes: int) -> None:
    # group_bytes=1: one decode per group; 3000: a few per group (last one partial)
    seqs = [(1, 9), (1, 30), (1, 17), (1, 5), (1, 30), (1, 1), (1, 12), (9, 20)]
    q, k, v, k_cache, v_cache, meta, k_full, v_full = _scenario(seqs, 6, 2, 16, 4, seed=3)
    attn = TorchPagedAttention(decode_group_bytes=group_bytes)
    out = attn.forward(q, k, v, k_cache, v_cache, meta, 0.25)
    ref = reference_attention(q, k_full, v_full, meta.q_lens, meta.k_lens, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="decode_group_bytes"):
        TorchPagedAttention(decode_group_bytes=0)


def test_per_step_index_reused_by_later_layers() -> None:
    # two layers share one metadata: the second reuses the index tensors and masks the
    # first derived (and the shared scratch buffers) yet reads its own caches
    seqs = [(1, 9), (1, 30), (6, 6), (5, 21)]
    q, k, v, kc1, vc1, meta, kf, vf = _scenario(seqs, 6, 2, 16, 4, seed=5)
    kc2, vc2 = kc1 * 2, -vc1  # layer 2's caches: other values, same blocks
    attn = TorchPagedAttention()
    out1 = attn.forward(q, k, v, kc1, vc1, meta, 0.25)
    assert meta.derived, "the first layer leaves its index tensors for the others"
    out2 = attn.forward(q, k * 2, -v, kc2, vc2, meta, 0.25)
    ref1 = reference_attention(q, kf, vf, meta.q_lens, meta.k_lens, 0.25)
    ref2 = reference_attention(
        q, [t * 2 for t in kf], [-t for t in vf], meta.q_lens, meta.k_lens, 0.25
    )
    torch.testing.assert_close(out1, ref1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out2, ref2, atol=1e-5, rtol=1e-5)


def test_bf16_paged_attention_close_to_reference() -> None:
    seqs = [(1, 9), (1, 30), (1, 2), (7, 7), (5, 20)]
    q, k, v, k_cache, v_cache, meta, k_full, v_full = _scenario(seqs, 6, 2, 16, 4, seed=9)
    bf = torch.bfloat16
    out = TorchPagedAttention().forward(
        q.to(bf), k.to(bf), v.to(bf), k_cache.to(bf), v_cache.to(bf), meta, 0.25
    )
    assert out.dtype == bf
    kf = [t.to(bf) for t in k_full]
    vf = [t.to(bf) for t in v_full]
    ref = reference_attention(q.to(bf), kf, vf, meta.q_lens, meta.k_lens, 0.25)
    torch.testing.assert_close(out.float(), ref.float(), atol=0.05, rtol=0.02)


def test_metadata_build_matches_per_token_definition() -> None:
    g = torch.Generator().manual_seed(11)
    block_size = 4
    seqs = [(1, 1), (1, 9), (1, 16), (7, 7), (3, 10), (1, 6), (16, 33)]
    tables = []
    for _, k_len in seqs:
        n = (k_len + block_size - 1) // block_size + int(torch.randint(0, 2, (1,), generator=g))
        tables.append(torch.randperm(100, generator=g)[:n].tolist())
    q_lens = [q for q, _ in seqs]
    k_lens = [k for _, k in seqs]
    meta = AttentionMetadata.build(q_lens, k_lens, tables, block_size)
    slots, positions = [], []
    for (q_len, k_len), table in zip(seqs, tables, strict=True):
        for pos in range(k_len - q_len, k_len):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    assert meta.slot_mapping.tolist() == slots
    assert meta.positions is not None and meta.positions.tolist() == positions
    assert meta.cu_seqlens_q.tolist() == [0, 1, 2, 3, 10, 13, 14, 30]
    assert meta.seq_lens_k.dtype == torch.int32 and meta.seq_lens_k.tolist() == k_lens
    width = max(len(t) for t in tables)
    assert meta.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables]
    assert meta.num_decodes == 3 and meta.max_seqlen_q == 16 and meta.max_seqlen_k == 33
    empty = AttentionMetadata.build([], [], [], block_size)
    assert empty.slot_mapping.numel() == 0 and empty.num_tokens == 0
    with pytest.raises(ValueError, match="too short"):
        AttentionMetadata.build([1], [9], [[0, 1]], block_size)
    with pytest.raises(ValueError, match="k_len"):
        AttentionMetadata.build([5], [3], [[0]], block_size)


def test_metadata_build_of_decodes_only_matches_per_token_definition() -> None:
    # decode-only batches take a host-side path: the same fields, dtypes and values
    g = torch.Generator().manual_seed(5)
    block_size = 4
    k_lens = [1, 4, 5, 16, 17, 30]
    tables = [
        torch.randperm(60, generator=g)[: -(-k // block_size) + i % 2].tolist()
        for i, k in enumerate(k_lens)
    ]
    meta = AttentionMetadata.build([1] * len(k_lens), k_lens, tables, block_size)
    positions = [k - 1 for k in k_lens]
    slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, positions)]
    assert meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.tolist() == slots
    assert meta.positions is not None and meta.positions.dtype == torch.int64
    assert meta.positions.tolist() == positions
    assert meta.cu_seqlens_q.dtype == torch.int32
    assert meta.cu_seqlens_q.tolist() == list(range(len(k_lens) + 1))
    assert meta.seq_lens_k.dtype == torch.int32 and meta.seq_lens_k.tolist() == k_lens
    width = max(len(t) for t in tables)
    assert meta.block_tables.dtype == torch.int32
    assert meta.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables]
    assert meta.num_decodes == meta.num_seqs == meta.num_tokens == len(k_lens)
    assert meta.max_seqlen_q == 1 and meta.max_seqlen_k == 30
    with pytest.raises(ValueError, match="too short"):
        AttentionMetadata.build([1, 1], [3, 9], [[0], [1, 2]], block_size)


def test_reference_attention_is_causal_and_gqa() -> None:
    # hand-checkable case: one head, keys identical -> output = mean of visible values
    q = torch.zeros(3, 2, 1)
    k = [torch.zeros(4, 1, 1)]
    v = [torch.arange(4.0).reshape(4, 1, 1)]
    out = reference_attention(q, k, v, [3], [4], 1.0)
    # query j at position 1 + j sees values 0..1+j
    expected = torch.tensor([0.5, 1.0, 1.5]).reshape(3, 1, 1).expand(3, 2, 1)
    torch.testing.assert_close(out, expected)


def test_slot_writes_land_in_blocks() -> None:
    block_size, hkv, d = 4, 2, 3
    seqs = [(1, 6), (5, 7)]
    tables = [[3, 0], [1, 4]]
    meta = AttentionMetadata.build([q for q, _ in seqs], [k for _, k in seqs], tables, block_size)
    k_cache = torch.zeros(5, block_size, hkv, d)
    v_cache = torch.zeros(5, block_size, hkv, d)
    k = torch.arange(6 * hkv * d, dtype=torch.float32).reshape(6, hkv, d) + 1
    write_kv_cache(k, -k, k_cache, v_cache, meta.slot_mapping)
    # seq 0 decodes position 5 -> block 0 offset 1; seq 1 writes positions 2..6
    torch.testing.assert_close(k_cache[0, 1], k[0])
    expected_slots = [(1, 2), (1, 3), (4, 0), (4, 1), (4, 2)]
    for t, (b, o) in enumerate(expected_slots, start=1):
        torch.testing.assert_close(k_cache[b, o], k[t])
        torch.testing.assert_close(v_cache[b, o], -k[t])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 6  # nothing else written


def test_torch_attention_writes_cache_in_place() -> None:
    q, k, v, k_cache, v_cache, meta, k_full, _ = _scenario([(1, 3), (4, 9)], 4, 2, 8, 4, seed=1)
    TorchPagedAttention().forward(q, k, v, k_cache, v_cache, meta, 0.3)
    for i, table in enumerate(meta.block_tables.tolist()):
        for pos in range(meta.k_lens[i]):
            torch.testing.assert_close(k_cache[table[pos // 4], pos % 4], k_full[i][pos])


# ---------------------------------------------------------------------------- RMSNorm


def _rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return (xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()).to(x.dtype)


def test_rms_norm_matches_reference() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 32, generator=g) * 3
    w = torch.randn(32, generator=g)
    out, res = rms_norm(x, w, 1e-6)
    torch.testing.assert_close(out, _rms_ref(x, w, 1e-6), atol=1e-5, rtol=1e-5)
    assert res is x
    r = torch.randn(7, 32, generator=g)
    out2, res2 = rms_norm(x, w, 1e-6, residual=r)
    torch.testing.assert_close(res2, x + r)
    torch.testing.assert_close(out2, _rms_ref(x + r, w, 1e-6), atol=1e-5, rtol=1e-5)


def test_rms_norm_bf16_matches_transformers() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 64, generator=g) * 2).to(torch.bfloat16)
    norm = LlamaRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g))
        expected = norm(x)
    out, _ = rms_norm(x, norm.weight, 1e-5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


# ---------------------------------------------------------------------------- RoPE


def _hf_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rope_parameters: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    d = q.shape[-1]
    cfg = LlamaConfig(
        hidden_size=d * 4,
        num_attention_heads=4,
        head_dim=d,
        max_position_embeddings=4096,
        rope_parameters=rope_parameters,
    )
    emb = LlamaRotaryEmbedding(cfg)
    cos, sin = emb(q, positions[None, :])  # [1, T, D]
    # HF layout [B, H, T, D]
    qh, kh = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return qh[0].transpose(0, 1), kh[0].transpose(0, 1)


ROPE_CASES = [
    ({"rope_type": "default", "rope_theta": 10000.0}, None),
    (
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        RopeScaling("linear", factor=4.0),
    ),
    (
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
        RopeScaling(
            "llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position=512,
        ),
    ),
]


@pytest.mark.parametrize("case", range(len(ROPE_CASES)))
def test_rope_matches_transformers(case: int) -> None:
    params, scaling = ROPE_CASES[case]
    d = 64
    g = torch.Generator().manual_seed(case)
    positions = torch.tensor([0, 1, 2, 77, 1000, 3999, 5, 5])
    q = torch.randn(len(positions), 6, d, generator=g)
    k = torch.randn(len(positions), 2, d, generator=g)
    cache = build_rope_cache(d, 4096, params["rope_theta"], scaling)
    q_out, k_out = apply_rope(q, k, positions, cache)
    q_ref, k_ref = _hf_rope(q, k, positions, params)
    torch.testing.assert_close(q_out, q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_out, k_ref, atol=1e-6, rtol=1e-6)


def test_rope_plain_reference() -> None:
    # rotation of each (x_i, x_{i+D/2}) pair by angle pos * theta^(-2i/D)
    d, theta = 8, 100.0
    x = torch.randn(3, 1, d)
    pos = torch.tensor([0, 3, 10])
    cache = build_rope_cache(d, 16, theta)
    out, _ = apply_rope(x, x, pos, cache)
    for t in range(3):
        for i in range(d // 2):
            ang = pos[t].item() * theta ** (-2 * i / d)
            a, b = x[t, 0, i].item(), x[t, 0, i + d // 2].item()
            assert math.isclose(
                out[t, 0, i].item(), a * math.cos(ang) - b * math.sin(ang), abs_tol=1e-5
            )
            assert math.isclose(
                out[t, 0, i + d // 2].item(), b * math.cos(ang) + a * math.sin(ang), abs_tol=1e-5
            )
    torch.testing.assert_close(out[0], x[0])  # position 0 is the identity


def test_rope_llama3_scaling_changes_only_low_frequencies() -> None:
    base = rope_inv_freq(128, 500000.0, None)
    scaled = rope_inv_freq(
        128, 500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, original_max_position=8192)
    )
    assert torch.equal(scaled[:10], base[:10])  # short wavelengths untouched
    torch.testing.assert_close(scaled[-5:], base[-5:] / 8.0)


# ---------------------------------------------------------------------------- selection


def test_select_backend_on_cpu() -> None:
    cpu = torch.device("cpu")
    assert isinstance(select_attention_backend("auto", cpu, 16), TorchPagedAttention)
    assert isinstance(select_attention_backend("auto", cpu, 256), TorchPagedAttention)
    assert select_attention_backend("torch", cpu, 16).name == "torch"
    with pytest.raises(ValueError, match="CUDA"):
        select_attention_backend("flash_attn", cpu, 256)
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_attention_backend("tensorrt", cpu, 16)
    if importlib.util.find_spec("triton") is not None and not os.environ.get("TRITON_INTERPRET"):
        with pytest.raises(ValueError, match="CUDA"):  # a real backend, not on a CPU
            select_attention_backend("triton", cpu, 16)


def test_flash_attn_backend_validates_block_size() -> None:
    with pytest.raises(ValueError, match="256"):
        FlashAttnPagedAttention(16)


def test_flash_attn_missing_package_is_clear() -> None:
    try:
        import flash_attn  # noqa: F401
    except Exception:
        with pytest.raises(ImportError, match="flash-attn"):
            FlashAttnPagedAttention(256)
    else:
        pytest.skip("flash-attn is installed")
