/* A hybrid iteration of a Llama-family model (decodes and prefill chunks) in one call: the
 * kernels LlamaForCausalLM.forward runs per op with NativeCpuOps and CpuPagedAttention, in
 * the same order, with no Python between them, so the result is bitwise the per-op path's.
 * At a few hundred rows the Python and torch bookkeeping around the ~300 kernel calls of an
 * iteration is a tenth of it, during which the other OpenMP threads wait (docs/KERNELS.md,
 * "The hybrid step"). Two models are taken:
 *   hybrid_step_bf16: bf16, every matmul on AMX tiles (each matmul slot of decode_step.c's
 *     table holds the weight packed by linear_amx_pack), chunks through the AMX prefill
 *     kernel; SwiGLU in the gate/up matmul's tile pass;
 *   hybrid_step_f32: float32, every matmul Q4 int8 panels (gguf_matmul="int8": each slot
 *     holds the panels' qs, its _scales slot their scales), chunks through
 *     prefill_attention_f32; the two RMSNorms and SwiGLU write their matmul's quantized
 *     input directly (act_quant.c: the same bits as the per-op norm, then quantization).
 *
 * Per layer (pointers in layers[l * L_PTRS + L_<slot>]):
 *   h = RMSNorm(residual += x) ; qkv = h W_qkv^T ; RoPE(q, k) ; write k, v to the cache ;
 *   attn = paged decode attention of the first num_decodes rows, then the prefill
 *   attention of each chunk ; x = attn W_o^T ; h = RMSNorm(residual += x) ;
 *   act = silu(gate) * up of h W_gate_up^T ; x = act W_down^T
 * and at the end out = RMSNorm(residual += x) with the final norm.
 *
 * Rows: the num_decodes decodes first (one token each), then each chunk's q_lens[i] rows,
 * T in all. tables [num_seqs, table_stride] int32; k_lens [num_seqs] int32 (keys after this
 * step); slots [T] int64; cos, sin_signed [T, D]; x_in, out [T, hidden]; work
 * decode_step_work_elems(T, ...) elements; scratch prefill_scratch elements for the
 * longest chunk (2 * Hkv * ceil(k_len / 64) * 64 * D), 64-byte aligned. kv_int8 = 1: the caches hold
 * kv_int8.c's int8 rows ([num_blocks, block_size, Hkv, D + 4]), kv_dequant 2 * ceil(k_len /
 * block_size) * block_size * Hkv * D elements for the longest chunk and identity the block
 * ids 0, 1, ... as many (attend_int8_<dtype>; both unused, may be NULL, in the float32 step
 * where prefill_i8_f32_supported()). Returns 0; -1 where a size or this machine
 * is not covered (nothing written); -2 where a slot, length or block id lies outside the
 * cache (nothing written). */
#include <string.h>

#include "common.h"
#include "kernels.h"

enum {
#define SLOT_ENUM(name) L_##name,
    DECODE_STEP_LAYER_SLOTS(SLOT_ENUM)
#undef SLOT_ENUM
    L_PTRS
};

/* where cpu_attention.c builds an int8 decode item for the step's queries (the per-op
 * path's kernels): bf16 on AVX-512; float32 on AVX-512 or AVX2 + FMA */
#if defined(__AVX512F__)
#define KV_INT8_HYBRID_bf16 1
#define KV_INT8_HYBRID_f32 1
#elif defined(AVX2_ONLY)
#define KV_INT8_HYBRID_bf16 0
#define KV_INT8_HYBRID_f32 1
#else
#define KV_INT8_HYBRID_bf16 0
#define KV_INT8_HYBRID_f32 0
#endif

/* One layer's attention, as CpuPagedAttention runs it: this step's K/V written to the
 * caches, the decodes' paged attention, then each chunk's prefill kernel (PREFILL: the AMX
 * one for bf16, prefill_attention_f32 for float32), rows in the step's order.
 *
 * attend_<SUF>: over caches of the model's dtype. attend_int8_<SUF>: over int8 caches
 * (kv_int8.c's rows): the rows quantized into the caches, the decodes' int8 paged
 * attention, and each chunk through PREFILL_I8 where it is built (the int8 cache read in
 * place), else its context blocks dequantized to the model's dtype (kv_dequant: K's
 * blocks, then V's) for the prefill kernel, which reads them as a cache of their own
 * (blocks `identity`). */
#define DEFINE_ATTEND(SUF, T, PREFILL, IS_BF16, PREFILL_I8, PREFILL_I8_BUILT)                 \
    static void attend_##SUF(const void *const *p, T *qkv, T *attn, const int64_t *slots,      \
                             const int32_t *tables, long table_stride, const int32_t *q_lens,  \
                             const int32_t *k_lens, int num_seqs, int num_decodes, int rows,   \
                             int H, int Hkv, int D, int block_size, long num_blocks,           \
                             float scale, T *scratch) {                                        \
        const int q_n = H * D, kv_n = Hkv * D, qkv_n = q_n + 2 * kv_n;                         \
        const T *kc = p[L_k_cache], *vc = p[L_v_cache];                                        \
        write_kv_cache((const char *)(qkv + q_n), qkv_n, (const char *)(qkv + q_n + kv_n),     \
                       qkv_n, (char *)p[L_k_cache], (char *)p[L_v_cache], slots, rows, kv_n,   \
                       (long)sizeof(T), num_blocks * block_size);                              \
        if (num_decodes > 0)                                                                   \
            paged_decode_attention_##SUF(qkv, qkv_n, kc, vc, tables, table_stride, k_lens,     \
                                         attn, num_decodes, H, Hkv, D, block_size, scale,      \
                                         num_blocks);                                          \
        long row = num_decodes;                                                                \
        for (int i = num_decodes; i < num_seqs; i++) {                                         \
            PREFILL(qkv + row * qkv_n, qkv_n, kc, vc, tables + (long)i * table_stride,         \
                    q_lens[i], k_lens[i], H, Hkv, D, block_size, scale, attn + row * q_n,      \
                    q_n, num_blocks, scratch);                                                 \
            row += q_lens[i];                                                                  \
        }                                                                                      \
    }                                                                                          \
    static void attend_int8_##SUF(const void *const *p, T *qkv, T *attn, const int64_t *slots, \
                                  const int32_t *tables, long table_stride,                    \
                                  const int32_t *q_lens, const int32_t *k_lens, int num_seqs,  \
                                  int num_decodes, int rows, int H, int Hkv, int D,            \
                                  int block_size, long num_blocks, float scale, T *scratch,    \
                                  T *kv_dequant, const int32_t *identity) {                    \
        const int q_n = H * D, kv_n = Hkv * D, qkv_n = q_n + 2 * kv_n;                         \
        const int8_t *kc = p[L_k_cache], *vc = p[L_v_cache];                                   \
        write_kv_cache_int8((const char *)(qkv + q_n), qkv_n,                                  \
                            (const char *)(qkv + q_n + kv_n), qkv_n, (int8_t *)p[L_k_cache],   \
                            (int8_t *)p[L_v_cache], slots, rows, Hkv, D, IS_BF16,              \
                            num_blocks * block_size);                                          \
        if (num_decodes > 0)                                                                   \
            paged_decode_attention_i8_##SUF(qkv, qkv_n, kc, vc, tables, table_stride, k_lens,  \
                                            attn, num_decodes, H, Hkv, D, block_size, scale,   \
                                            num_blocks);                                       \
        long row = num_decodes, longest = 0;                                                   \
        if (PREFILL_I8_BUILT) { /* the chunks straight from the int8 cache */                  \
            for (int i = num_decodes; i < num_seqs; i++) {                                     \
                PREFILL_I8(qkv + row * qkv_n, qkv_n, kc, vc, tables + (long)i * table_stride,  \
                           q_lens[i], k_lens[i], H, Hkv, D, block_size, scale,                 \
                           attn + row * q_n, q_n, num_blocks, scratch);                        \
                row += q_lens[i];                                                              \
            }                                                                                  \
            return;                                                                            \
        }                                                                                      \
        for (int i = num_decodes; i < num_seqs; i++) {                                         \
            const long n = (k_lens[i] + block_size - 1) / block_size;                          \
            longest = n > longest ? n : longest;                                               \
        }                                                                                      \
        T *kdq = kv_dequant, *vdq = kv_dequant + longest * block_size * kv_n;                  \
        for (int i = num_decodes; i < num_seqs; i++) {                                         \
            const long n = (k_lens[i] + block_size - 1) / block_size;                          \
            const int32_t *table = tables + (long)i * table_stride;                            \
            dequantize_kv_blocks_int8_##SUF(kc, table, n, block_size, Hkv, D, num_blocks, kdq); \
            dequantize_kv_blocks_int8_##SUF(vc, table, n, block_size, Hkv, D, num_blocks, vdq); \
            PREFILL(qkv + row * qkv_n, qkv_n, kdq, vdq, identity, q_lens[i], k_lens[i], H,     \
                    Hkv, D, block_size, scale, attn + row * q_n, q_n, n, scratch);             \
            row += q_lens[i];                                                                  \
        }                                                                                      \
    }
/* the float32 step's chunks read int8 caches in place where the build has the kernel
 * (prefill_attention_i8_f32, as CpuPagedAttention does per op); the bf16 step's always
 * through the dequantized context */
#define NO_PREFILL_I8(...) (void)0
DEFINE_ATTEND(bf16, uint16_t, prefill_attention_amx_bf16, 1, NO_PREFILL_I8, 0)
DEFINE_ATTEND(f32, float, prefill_attention_f32, 0, prefill_attention_i8_f32,
              prefill_i8_f32_supported())

/* The checks both steps make before anything is written: 0 fine; -1 a size or batch
 * layout not taken (decodes of one row first, then chunks of >= 1 rows, T rows in all;
 * head size and int8 cache as the kernels take); -2 a slot, length or block id outside the
 * cache */
static int hybrid_check(const int64_t *slots, const int32_t *tables, long table_stride,
                        const int32_t *q_lens, const int32_t *k_lens, int num_layers,
                        int num_seqs, int num_decodes, int T, int H, int Hkv, int D,
                        int block_size, long num_blocks, int kv_int8, int kv_int8_built) {
    if (num_layers < 1 || T < 1 || num_seqs < 1 || num_decodes < 0 || num_decodes > num_seqs ||
        D % 2 != 0 || D > 512)
        return -1;
    if (kv_int8 && (!kv_int8_built || (D != 64 && D != 128))) return -1;
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
    return 0;
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
    if (!tiles_take(qkv_n, hidden) || !tiles_take(hidden, q_n) || !tiles_take(hidden, inter) ||
        inter % 16 != 0)
        return -1;
    const int rc = hybrid_check(slots, tables, table_stride, q_lens, k_lens, num_layers,
                                num_seqs, num_decodes, T, H, Hkv, D, block_size, num_blocks,
                                kv_int8, KV_INT8_HYBRID_bf16);
    if (rc != 0) return rc;
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
            attend_int8_bf16(p, qkv, attn, slots, tables, table_stride, q_lens, k_lens,
                             num_seqs, num_decodes, T, H, Hkv, D, block_size, num_blocks, scale,
                             scratch, kv_dequant, identity);
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

/* The float32 hybrid step: every matmul Q4 int8 panels (the slots hold each panel's qs and
 * scales), as NativeCpuOps runs them with gguf_matmul="int8": x quantized, the panels'
 * matmul. Where the per-op path runs a norm or SwiGLU and then quantizes its output for
 * the next matmul, this step runs the fused producer (act_quant.c), bitwise the same. */
int hybrid_step_f32(const void *const *layers, int num_layers, const float *final_norm,
                    const float *x_in, float *out, float *work, const float *cos,
                    const float *sin_signed, const int64_t *slots, const int32_t *tables,
                    long table_stride, const int32_t *q_lens, const int32_t *k_lens,
                    int num_seqs, int num_decodes, int T, int hidden, int H, int Hkv, int D,
                    int inter, int block_size, long num_blocks, float eps, float scale,
                    float *scratch, int kv_int8, float *kv_dequant, const int32_t *identity) {
    const int q_n = H * D, kv_n = Hkv * D, qkv_n = q_n + 2 * kv_n;
    /* everything checked before anything is written: the panels take K a multiple of 32 */
    if (!prefill_f32_supported() || int8_panels_vector_bits() == 0) return -1;
    if (hidden % 32 != 0 || q_n % 32 != 0 || inter % 32 != 0) return -1;
    /* the float32 prefill kernel refuses (writes nothing) unaligned scratch */
    if (num_seqs > num_decodes && ((uintptr_t)scratch & 63) != 0) return -1;
    const int rc = hybrid_check(slots, tables, table_stride, q_lens, k_lens, num_layers,
                                num_seqs, num_decodes, T, H, Hkv, D, block_size, num_blocks,
                                kv_int8, KV_INT8_HYBRID_f32);
    if (rc != 0) return rc;
    /* decode_step.c's work layout for T rows */
    float *res = work, *h = res + (long)T * hidden, *x = h + (long)T * hidden;
    float *qkv = x + (long)T * hidden, *attn = qkv + (long)T * qkv_n;
    float *gu = attn + (long)T * q_n, *act = gu + 2L * T * inter;
    void *qwork = (void *)(((uintptr_t)(act + (long)T * inter) + 63) & ~(uintptr_t)63);
    /* the quantized inputs of the matmuls after the norms (K = hidden) and after SwiGLU
     * (K = inter), in qwork as int8_panels_linear_q4_f32 lays it out */
    int8_t *hq, *aq;
    float *hd, *hs, *ad, *as;
    int8_qwork_parts(qwork, T, hidden, &hq, &hd, &hs);
    int8_qwork_parts(qwork, T, inter, &aq, &ad, &as);
#define PANELS(slot) (const uint8_t *)p[L_##slot], (const float *)p[L_##slot##_scales]
    memcpy(res, x_in, (size_t)T * hidden * sizeof(float));
    for (int l = 0; l < num_layers; l++) {
        const void *const *p = layers + (long)l * L_PTRS;
        rms_norm_quantize_f32(l ? x : res, hidden, l ? res : NULL, hidden, p[L_input_norm], T,
                              hidden, eps, hq, hd, hs);
        int8_panels_matmul(hq, hd, hs, T, hidden, PANELS(qkv), qkv, qkv_n, qkv_n, 4, 0);
        rope_f32(qkv, qkv_n, cos, sin_signed, T, H + Hkv, D);
        if (kv_int8)
            attend_int8_f32(p, qkv, attn, slots, tables, table_stride, q_lens, k_lens, num_seqs,
                            num_decodes, T, H, Hkv, D, block_size, num_blocks, scale, scratch,
                            kv_dequant, identity);
        else
            attend_f32(p, qkv, attn, slots, tables, table_stride, q_lens, k_lens, num_seqs,
                       num_decodes, T, H, Hkv, D, block_size, num_blocks, scale, scratch);
        int8_panels_linear_q4_f32(attn, q_n, PANELS(o), x, hidden, T, hidden, q_n, qwork);
        rms_norm_quantize_f32(x, hidden, res, hidden, p[L_post_norm], T, hidden, eps, hq, hd,
                              hs);
        int8_panels_matmul(hq, hd, hs, T, hidden, PANELS(gate_up), gu, 2 * inter, 2 * inter, 4,
                           0);
        silu_mul_quantize_f32(gu, 2 * inter, T, inter, aq, ad, as);
        int8_panels_matmul(aq, ad, as, T, inter, PANELS(down), x, hidden, hidden, 4, 0);
    }
#undef PANELS
    rms_norm_f32(x, hidden, res, hidden, final_norm, out, hidden, T, hidden, eps);
    return 0;
}
