"""Paged attention and the KV write as Triton kernels (CUDA; on a CPU only under Triton's
interpreter, TRITON_INTERPRET=1, which the tests use).

Three kernels, each launched once per layer (no loop over tokens or sequences on the host):
- `_write_kv_kernel`: one program per new token scatters its k/v rows [Hkv, D] to its
  cache slot (block slot // block_size, offset slot % block_size).
- `_decode_kernel`: one program per (decode sequence, KV head). The query heads sharing
  that KV head (GQA) are the rows of one tile, so each key is read once for all of them;
  an online softmax runs over tiles of BLOCK_N keys read through the block table.
- `_prefill_kernel`: one program per (prefill chunk, tile of its queries, KV head). A
  tile's rows are (token, query head of the group) pairs; query i of a chunk sits at
  absolute position k_len - q_len + i and sees keys 0..that position (causal inside the
  chunk, the whole cached context before it), so the key loop stops at the tile's last
  position.

Keys are addressed one by one through the block table (block id of key n:
table[n // block_size]), so a key tile may span several blocks and any block size works;
block sizes are restricted to powers of two, where that index math is shifts and masks.
Scores and the softmax run in float32 (exp2 with log2(e) folded into the scale), the
products on the tensor cores in the inputs' dtype (float32: exact "ieee" products, no
TF32). Head sizes are padded to a power of two (at least 16, tl.dot's minimum) and masked.

Limits: dtypes float32 / bfloat16 / float16 (q and both caches alike); head_dim <= 256;
block_size a power of two; no int8 KV cache. Padding slots (slot < 0) are skipped.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .metadata import AttentionMetadata

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256
_LOG2_E = 1.4426950408889634
_MIN_DOT = 16  # tl.dot needs every dimension >= 16


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    s_kt, s_kh, s_kd, s_vt, s_vh, s_vd,
    s_cb, s_co, s_ch, s_cd,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # a padding token (slot < 0) has no heads to write
    heads = tl.where(slot >= 0, num_kv_heads, 0)
    mask = (h[:, None] < heads) & (d[None, :] < head_dim)
    # int64: a cache may hold more than 2**31 elements
    dst = (slot // BLOCK_SIZE) * s_cb + (slot % BLOCK_SIZE) * s_co
    dst_hd = dst + h[:, None] * s_ch + d[None, :] * s_cd  # [BLOCK_H, BLOCK_D]
    k = tl.load(k_ptr + t * s_kt + h[:, None] * s_kh + d[None, :] * s_kd, mask=mask)
    v = tl.load(v_ptr + t * s_vt + h[:, None] * s_vh + d[None, :] * s_vd, mask=mask)
    tl.store(k_cache_ptr + dst_hd, k, mask=mask)
    tl.store(v_cache_ptr + dst_hd, v, mask=mask)


@triton.jit
def _attend(
    q, row_pos, key_end, k_cache_ptr, v_cache_ptr, table_row_ptr, s_tn,
    kv_head, s_cb, s_co, s_ch, s_cd, head_dim, qk_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Online softmax of the rows of q ([BLOCK_M, BLOCK_D]) over keys 0..key_end - 1,
    row r seeing keys <= row_pos[r]. Returns (unnormalized output [BLOCK_M, BLOCK_D]
    float32, softmax denominators [BLOCK_M])."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    for start in range(0, key_end, BLOCK_N):
        n = start + offs_n  # [BLOCK_N] key positions
        n_mask = n < key_end
        blk = tl.load(table_row_ptr + (n // BLOCK_SIZE) * s_tn, mask=n_mask, other=0)
        row = blk.to(tl.int64) * s_cb + (n % BLOCK_SIZE) * s_co + kv_head * s_ch  # [BLOCK_N]
        kv_off = row[:, None] + d[None, :] * s_cd  # [BLOCK_N, BLOCK_D]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        seen = (n[None, :] <= row_pos[:, None]) & n_mask[None, :]
        s = tl.where(seen, s, float("-inf"))
        # every row sees key 0 (its position is >= 0), so m_new is finite from tile 0 on
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        # p rounded to the cache dtype as the tensor cores take it
        p = p.to(v_cache_ptr.dtype.element_ty)
        if DOT_F32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i


# Ints that change from step to step (the block tables' row stride grows with the longest
# context, the prefills' first sequence index) are not specialized on (== 1, % 16): each
# distinct specialization would be compiled again, mid-run.
@triton.jit(do_not_specialize=["s_tb"])
def _decode_kernel(
    q_ptr, out_ptr, k_cache_ptr, v_cache_ptr, table_ptr, seq_lens_ptr,
    s_qt, s_qh, s_qd, s_ot, s_oh, s_od, s_tb, s_tn,
    s_cb, s_co, s_ch, s_cd, head_dim, qk_scale,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)  # decodes come first, one token each: sequence i is token i
    kv_head = tl.program_id(1)
    k_len = tl.load(seq_lens_ptr + seq)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g  # [BLOCK_G] query heads of this KV head
    mask = (g[:, None] < GROUP) & (d[None, :] < head_dim)
    q_off = seq * s_qt + heads[:, None] * s_qh + d[None, :] * s_qd
    # zeros in the padding: tl.dot sums over it (garbage there could be NaN)
    q = tl.load(q_ptr + q_off, mask=mask, other=0.0)  # [BLOCK_G, BLOCK_D]
    if DOT_F32:
        q = q.to(tl.float32)
    row_pos = tl.zeros([BLOCK_G], tl.int32) + (k_len - 1)
    acc, l_i = _attend(
        q, row_pos, k_len, k_cache_ptr, v_cache_ptr, table_ptr + seq * s_tb, s_tn,
        kv_head, s_cb, s_co, s_ch, s_cd, head_dim, qk_scale,
        BLOCK_SIZE, BLOCK_G, BLOCK_N, BLOCK_D, DOT_F32, PRECISION,
    )  # fmt: skip
    out = acc / l_i[:, None]
    dst = out_ptr + seq * s_ot + heads[:, None] * s_oh + d[None, :] * s_od
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["first_seq", "s_tb"])
def _prefill_kernel(
    q_ptr, out_ptr, k_cache_ptr, v_cache_ptr, table_ptr, seq_lens_ptr, cu_q_ptr,
    first_seq, s_qt, s_qh, s_qd, s_ot, s_oh, s_od, s_tb, s_tn,
    s_cb, s_co, s_ch, s_cd, head_dim, qk_scale,
    GROUP: tl.constexpr, TOKENS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    seq = first_seq + tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    k_len = tl.load(seq_lens_ptr + seq)
    # the grid covers the longest chunk: tiles past this chunk's queries do nothing
    if tile * TOKENS < q_len:
        r = tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        t = tile * TOKENS + r // GROUP  # [BLOCK_M] token of each row within the chunk
        heads = kv_head * GROUP + r % GROUP  # [BLOCK_M] query head of each row
        valid = (r < TOKENS * GROUP) & (t < q_len)
        mask = valid[:, None] & (d[None, :] < head_dim)
        q_off = (q_start + t)[:, None] * s_qt + heads[:, None] * s_qh + d[None, :] * s_qd
        q = tl.load(q_ptr + q_off, mask=mask, other=0.0)  # [BLOCK_M, BLOCK_D]
        if DOT_F32:
            q = q.to(tl.float32)
        # padding rows take the last position: finite softmax, never stored
        row_pos = tl.where(valid, k_len - q_len + t, k_len - 1)
        key_end = k_len - q_len + tl.minimum(q_len, (tile + 1) * TOKENS)
        acc, l_i = _attend(
            q, row_pos, key_end, k_cache_ptr, v_cache_ptr, table_ptr + seq * s_tb, s_tn,
            kv_head, s_cb, s_co, s_ch, s_cd, head_dim, qk_scale,
            BLOCK_SIZE, BLOCK_M, BLOCK_N, BLOCK_D, DOT_F32, PRECISION,
        )  # fmt: skip
        out = acc / l_i[:, None]
        o_off = (q_start + t)[:, None] * s_ot + heads[:, None] * s_oh + d[None, :] * s_od
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=mask)


# Kernels built by the interpreter are not `JITFunction`s.
INTERPRETED: bool = not isinstance(_decode_kernel, triton.runtime.jit.JITFunction)


def check_block_size(block_size: int) -> None:
    """ValueError unless block_size is a power of two (the kernels' index math)."""
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(
            f"triton attention backend needs a power-of-two block_size, got {block_size}"
        )


# (decode BLOCK_N, prefill BLOCK_M, prefill BLOCK_N) by padded head size, for 16-bit and
# float32 tensors: the largest tiles whose programs, compiled for sm_80 with 8 warps,
# spill no registers (8 bytes in one case) and use under 99 KB of shared memory (the
# sm_86/sm_89 limit). Chosen from ptxas reports only: never timed on a GPU.
_TILES_16BIT = {64: (64, 64, 64), 128: (64, 64, 32), 256: (32, 32, 32)}
_TILES_32BIT = {64: (64, 64, 32), 128: (32, 32, 32), 256: (32, 32, 16)}
_NUM_WARPS = 8


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, triton.next_power_of_2(n))


def _check_device(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError("triton attention: all tensors must be on one device")
    if device.type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"triton attention kernels need CUDA tensors, got {device}; on a CPU they run "
            "only under Triton's interpreter (TRITON_INTERPRET=1 set before "
            "sarazmq.kernels.triton_attention is first imported)"
        )


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dtype not in SUPPORTED_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            "triton attention supports float32/bfloat16/float16 KV caches (no int8), got "
            f"{k_cache.dtype} / {v_cache.dtype}"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, Hkv, D], got "
            f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}"
        )
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides")
    check_block_size(k_cache.shape[1])
    if k_cache.shape[3] > MAX_HEAD_DIM:
        raise ValueError(f"triton attention supports head_dim <= {MAX_HEAD_DIM}")


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatters k, v [T, Hkv, D] into k_cache, v_cache [num_blocks, block_size, Hkv, D]
    at slot_mapping [T] (slot s: block s // block_size, offset s % block_size; s < 0 is
    skipped), converted to the caches' dtype first. One program per token."""
    _check_caches(k_cache, v_cache)
    _check_device(k, v, k_cache, v_cache, slot_mapping)
    t, hkv, d = k.shape
    if v.shape != k.shape or (hkv, d) != tuple(k_cache.shape[2:]) or slot_mapping.shape != (t,):
        raise ValueError(
            f"k, v {tuple(k.shape)} / {tuple(v.shape)} and slot_mapping "
            f"{tuple(slot_mapping.shape)} do not fit the cache {tuple(k_cache.shape)}"
        )
    if t == 0:
        return
    # the conversion (a no-op when the model already runs in the cache's dtype) on the
    # host: torch rounds to nearest even, as the GPU would; the interpreter truncates
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    _write_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), hkv, d,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(hkv),
        BLOCK_D=triton.next_power_of_2(d),
    )  # fmt: skip


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Attention of the packed queries q [T, H, D] (decodes first, then prefill chunks)
    over the paged caches [num_blocks, block_size, Hkv, D], whose keys this step's tokens
    must already be written to. Returns [T, H, D] in q's dtype.

    block_m (query rows per prefill tile), block_n (keys per tile): powers of two >= 16,
    by default from the head size and dtype (`_TILES_16BIT`); the tests set small ones to
    run several tiles.
    """
    _check_caches(k_cache, v_cache)
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} != KV cache dtype {k_cache.dtype}")
    tables, lens, cu_q = meta.block_tables, meta.seq_lens_k, meta.cu_seqlens_q
    _check_device(q, k_cache, v_cache, tables, lens, cu_q)
    t, h, d = q.shape
    hkv = k_cache.shape[2]
    if d != k_cache.shape[3] or h % hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    if t != meta.num_tokens:
        raise ValueError(f"q has {t} tokens, the metadata {meta.num_tokens}")
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size is not None and (size < _MIN_DOT or size & (size - 1)):
            raise ValueError(f"{name}={size} must be a power of two >= {_MIN_DOT}")
    out = torch.empty_like(q)  # [T, H, D]
    if t == 0:
        return out
    group = h // hkv
    block_d = _pow2_at_least(d, _MIN_DOT)
    tiles = (_TILES_32BIT if q.dtype == torch.float32 else _TILES_16BIT)[max(block_d, 64)]
    flags = {
        # the interpreter multiplies bfloat16 tiles as their raw 16-bit integers: float32
        "DOT_F32": INTERPRETED and q.dtype == torch.bfloat16,
        # float32 inputs: exact products rather than TF32's 10-bit mantissa
        "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
    }
    common = (*tables.stride(), *k_cache.stride(), d, scale * _LOG2_E)
    nd = meta.num_decodes
    if nd:
        _decode_kernel[(nd, hkv)](
            q, out, k_cache, v_cache, tables, lens,
            *q.stride(), *out.stride(), *common,
            GROUP=group, BLOCK_SIZE=k_cache.shape[1],
            BLOCK_G=_pow2_at_least(group, _MIN_DOT), BLOCK_N=block_n or tiles[0],
            BLOCK_D=block_d, num_warps=_NUM_WARPS, **flags,
        )  # fmt: skip
    num_prefills = meta.num_seqs - nd
    if num_prefills:
        block_m = max(block_m or tiles[1], triton.next_power_of_2(group))
        tokens = block_m // group  # query tokens per tile (all G heads of each)
        max_q = max(meta.q_lens[nd:])
        _prefill_kernel[(num_prefills, math.ceil(max_q / tokens), hkv)](
            q, out, k_cache, v_cache, tables, lens, cu_q, nd,
            *q.stride(), *out.stride(), *common,
            GROUP=group, TOKENS=tokens, BLOCK_SIZE=k_cache.shape[1],
            BLOCK_M=block_m, BLOCK_N=block_n or tiles[2], BLOCK_D=block_d,
            num_warps=_NUM_WARPS, **flags,
        )  # fmt: skip
    return out
