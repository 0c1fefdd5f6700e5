/* A hybrid iteration of a bf16 Llama-family model (decodes and prefill chunks, more rows
 * than the matrix-vector kernel takes) in one call: the kernels LlamaForCausalLM.forward
 * runs per op with NativeCpuOps and CpuPagedAttention where every matmul is on AMX tiles
 * and prefill chunks take the AMX prefill kernel, in the same order, with no Python
 * between them, so the result is bitwise the per-op path's. At a few hundred rows the
 * Python and torch bookkeeping around the ~300 kernel calls of an iteration is a tenth of
 * it, during which the other OpenMP threads wait (docs/KERNELS.md, "The hybrid step").
 *
 * Per layer (pointers in layers[l * L_PTRS + L_<slot>], decode_step.c's table with each
 * matmul slot holding the weight packed by linear_amx_pack):
 *   h = RMSNorm(residual += x) ; qkv = h W_qkv^T ; RoPE(q, k) ; write k, v to the cache ;
 *   attn = paged decode attention of the first num_decodes rows, then the AMX prefill
 *   attention of each chunk ; x = attn W_o^T ; h = RMSNorm(residual += x) ;
 *   act = silu(gate) * up of h W_gate_up^T (one tile pass) ; x = act W_down^T
 * and at the end out = RMSNorm(residual += x) with the final norm.
 *
 * Rows: the num_decodes decodes first (one token each), then each chunk's q_lens[i] rows,
 * T in all. tables [num_seqs, table_stride] int32; k_lens [num_seqs] int32 (keys after this
 * step); slots [T] int64; cos, sin_signed [T, D]; x_in, out [T, hidden]; work
 * decode_step_work_elems(T, ...) elements; scratch prefill_scratch elements for the
 * longest chunk (2 * Hkv * ceil(k_len / 64) * 64 * D). kv_int8 = 1: the caches hold
 * kv_int8.c's int8 rows ([num_blocks, block_size, Hkv, D + 4]), kv_dequant 2 * ceil(k_len /
 * block_size) * block_size * Hkv * D elements for the longest chunk and identity the block
 * ids 0, 1, ... as many (attend_int8). Returns 0; -1 where a size or this machine is not
 * covered (nothing written); -2 where a slot, length or block id lies outside the cache
 * (nothing written). */
#include <string.h>

#include "common.h"
#include "kernels.h"

enum {
#define SLOT_ENUM(name) L_##name,
    DECODE_STEP_LAYER_SLOTS(SLOT_ENUM)
#undef SLOT_ENUM
    L_PTRS
};

#if defined(__AVX512F__)
#define KV_INT8_HYBRID 1 /* the int8 decode item is built (cpu_attention.c) */
#else
#define KV_INT8_HYBRID 0
#endif

/* One layer's attention over bf16 caches: this step's K/V written, the decodes' paged
 * attention, then each chunk's AMX prefill attention (rows in the step's order). */
static void attend_bf16(const void *const *p, uint16_t *qkv, uint16_t *attn,
                        const int64_t *slots, const int32_t *tables, long table_stride,
                        const int32_t *q_lens, const int32_t *k_lens, int num_seqs,
                        int num_decodes, int T, int H, int Hkv, int D, int block_size,
                        long num_blocks, float scale, uint16_t *scratch) {
    const int q_n = H * D, kv_n = Hkv * D, qkv_n = q_n + 2 * kv_n;
    const uint16_t *kc = p[L_k_cache], *vc = p[L_v_cache];
    write_kv_cache((const char *)(qkv + q_n), qkv_n, (const char *)(qkv + q_n + kv_n), qkv_n,
                   (char *)p[L_k_cache], (char *)p[L_v_cache], slots, T, kv_n,
                   (long)sizeof(uint16_t), num_blocks * block_size);
    if (num_decodes > 0)
        paged_decode_attention_bf16(qkv, qkv_n, kc, vc, tables, table_stride, k_lens, attn,
                                    num_decodes, H, Hkv, D, block_size, scale, num_blocks);
    long row = num_decodes;
    for (int i = num_decodes; i < num_seqs; i++) {
        prefill_attention_amx_bf16(qkv + row * qkv_n, qkv_n, kc, vc,
                                   tables + (long)i * table_stride, q_lens[i], k_lens[i], H, Hkv,
                                   D, block_size, scale, attn + row * q_n, q_n, num_blocks,
                                   scratch);
        row += q_lens[i];
    }
}

/* The same over int8 caches (kv_int8.c's rows), as the per-op path runs it: rows quantized
 * into the caches, the decodes' int8 paged attention, and each chunk's context blocks
 * dequantized to bf16 (kv_dequant: K's blocks, then V's) for the AMX prefill kernel, which
 * reads them as a cache of their own (blocks `identity`). */
static void attend_int8(const void *const *p, uint16_t *qkv, uint16_t *attn,
                        const int64_t *slots, const int32_t *tables, long table_stride,
                        const int32_t *q_lens, const int32_t *k_lens, int num_seqs,
                        int num_decodes, int T, int H, int Hkv, int D, int block_size,
                        long num_blocks, float scale, uint16_t *scratch, uint16_t *kv_dequant,
                        const int32_t *identity) {
    const int q_n = H * D, kv_n = Hkv * D, qkv_n = q_n + 2 * kv_n;
    const int8_t *kc = p[L_k_cache], *vc = p[L_v_cache];
    write_kv_cache_int8((const char *)(qkv + q_n), qkv_n, (const char *)(qkv + q_n + kv_n),
                        qkv_n, (int8_t *)p[L_k_cache], (int8_t *)p[L_v_cache], slots, T, Hkv, D,
                        1, num_blocks * block_size);
    if (num_decodes > 0)
        paged_decode_attention_i8_bf16(qkv, qkv_n, kc, vc, tables, table_stride, k_lens, attn,
                                       num_decodes, H, Hkv, D, block_size, scale, num_blocks);
    long row = num_decodes, longest = 0;
    for (int i = num_decodes; i < num_seqs; i++) {
        const long n = (k_lens[i] + block_size - 1) / block_size;
        longest = n > longest ? n : longest;
    }
    uint16_t *kdq = kv_dequant, *vdq = kv_dequant + longest * block_size * kv_n;
    for (int i = num_decodes; i < num_seqs; i++) {
        const long n = (k_lens[i] + block_size - 1) / block_size;
        const int32_t *table = tables + (long)i * table_stride;
        dequantize_kv_blocks_int8_bf16(kc, table, n, block_size, Hkv, D, num_blocks, kdq);
        dequantize_kv_blocks_int8_bf16(vc, table, n, block_size, Hkv, D, num_blocks, vdq);
        prefill_attention_amx_bf16(qkv + row * qkv_n, qkv_n, kdq, vdq, identity, q_lens[i],
                                   k_lens[i], H, Hkv, D, block_size, scale, attn + row * q_n,
                                   q_n, n, scratch);
        row += q_lens[i];
    }
}

/* whether an AMX tile matmul takes [*, K] x [N, K]^T (matmul_entry's size rule) */
static int tiles_take(long N, long K) { return N >= 32 && K >= 32 && N % 32 == 0 && K % 32 == 0; }

int hybrid_step_bf16(const void *const *layers, int num_layers, const uint16_t *final_norm,
                     const uint16_t *x_in, uint16_t *out, uint16_t *work, const uint16_t *cos,
                     const uint16_t *sin_signed, const int64_t *slots, const int32_t *tables,
                     long table_stride, const int32_t *q_lens, const int32_t *k_lens,
                     int num_seqs, int num_decodes, int T, int hidden, int H, int Hkv, int D,
                     int inter, int block_size, long num_blocks, float eps, float scale,
                     uint16_t *scratch, int kv_int8, uint16_t *kv_dequant,
                     const int32_t *identity) {
    const int q_n = H * D, kv_n = Hkv * D, qkv_n = q_n + 2 * kv_n;
    /* everything checked before anything is written */
    if (!linear_amx_supported() || !prefill_amx_supported()) return -1;
    if (num_layers < 1 || T < 1 || num_seqs < 1 || num_decodes < 0 || num_decodes > num_seqs ||
        D % 2 != 0 || D > 512 || !tiles_take(qkv_n, hidden) || !tiles_take(hidden, q_n) ||
        !tiles_take(hidden, inter) || inter % 16 != 0)
        return -1;
    /* int8 caches: the AVX-512 int8 decode item (the per-op path's kernels) */
    if (kv_int8 && (!KV_INT8_HYBRID || (D != 64 && D != 128))) return -1;
    long rows = 0;
    for (int i = 0; i < num_seqs; i++) {
        if (i < num_decodes ? q_lens[i] != 1 : q_lens[i] < 1) return -1;
        rows += q_lens[i];
    }
    if (rows != T) return -1;
    if (num_decodes > 0) {
        const int rc = decode_attention_check(tables, table_stride, k_lens, num_decodes, H, Hkv,
                                              D, block_size, num_blocks);
        if (rc != 0) return rc;
    }
    for (int i = num_decodes; i < num_seqs; i++) {
        const int rc = prefill_check(tables + (long)i * table_stride, q_lens[i], k_lens[i], H,
                                     Hkv, D, block_size, num_blocks);
        if (rc != 0) return rc;
    }
    for (int i = 0; i < T; i++)
        if (slots[i] < 0 || slots[i] >= num_blocks * block_size) return -2;
    uint16_t *res = work, *h = res + (long)T * hidden, *x = h + (long)T * hidden;
    uint16_t *qkv = x + (long)T * hidden, *attn = qkv + (long)T * qkv_n;
    uint16_t *act = attn + (long)T * q_n;
    memcpy(res, x_in, (size_t)T * hidden * sizeof(uint16_t));
    for (int l = 0; l < num_layers; l++) {
        const void *const *p = layers + (long)l * L_PTRS;
        rms_norm_bf16(l ? x : res, hidden, l ? res : NULL, hidden, p[L_input_norm], h, hidden, T,
                      hidden, eps);
        linear_amx_bf16(h, hidden, p[L_qkv], qkv, qkv_n, T, qkv_n, hidden);
        rope_bf16(qkv, qkv_n, cos, sin_signed, T, H + Hkv, D);
        if (kv_int8)
            attend_int8(p, qkv, attn, slots, tables, table_stride, q_lens, k_lens, num_seqs,
                        num_decodes, T, H, Hkv, D, block_size, num_blocks, scale, scratch,
                        kv_dequant, identity);
        else
            attend_bf16(p, qkv, attn, slots, tables, table_stride, q_lens, k_lens, num_seqs,
                        num_decodes, T, H, Hkv, D, block_size, num_blocks, scale, scratch);
        linear_amx_bf16(attn, q_n, p[L_o], x, hidden, T, hidden, q_n);
        rms_norm_bf16(x, hidden, res, hidden, p[L_post_norm], h, hidden, T, hidden, eps);
        linear_amx_silu_mul_bf16(h, hidden, p[L_gate_up], act, inter, T, inter, hidden);
        linear_amx_bf16(act, inter, p[L_down], x, hidden, T, hidden, inter);
    }
    rms_norm_bf16(x, hidden, res, hidden, final_norm, out, hidden, T, hidden, eps);
    return 0;
}
