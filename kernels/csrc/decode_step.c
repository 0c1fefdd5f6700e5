/* One decode step of a Llama-family model for a few sequences (1 to GEMV_MAX_ROWS rows; up
 * to QGEMV_MAX_ROWS where every matmul reads block-quantized weights), in
 * one call. In a decode step of a few sequences the math is small (the weights are
 * streamed once) and the Python around its ~300 kernel calls costs a good part as much
 * again (docs/KERNELS.md, "The fused decode step"); this runs the kernels
 * LlamaForCausalLM.forward runs with NativeCpuOps and CpuPagedAttention (the per-op path),
 * in the same order, with no Python between them: where that path also uses the
 * matrix-vector kernel (1-3 rows) the result is bitwise its result.
 *
 * Per layer l (pointers in layers[l * L_PTRS + L_<slot>], slots named in kernels.h's
 * DECODE_STEP_LAYER_SLOTS; each matmul's weight is read in its format, plain or GGUF
 * block-quantized, see linear_f32 / linear_bf16):
 *   h = RMSNorm(residual += x) ; qkv = h W_qkv^T ; RoPE(q, k) ; write k, v to the cache ;
 *   attn = paged decode attention ; x = attn W_o^T ; h = RMSNorm(residual += x) ;
 *   gu = h W_gate_up^T ; act = silu(gate) * up ; x = act W_down^T
 * (layer 0 starts from the embeddings: residual = x_in, no add), and at the end
 * out = RMSNorm(residual += x) with the final norm.
 *
 * Shapes (elements, row-major, contiguous): x_in, out [M, hidden]; cos, sin_signed [M, D];
 * slots [M] int64; tables [M, table_stride] int32; lens [M] int32 (keys after this step);
 * the layer slots as decode_step_slot_shape gives them; work decode_step_work_elems(...)
 * elements. Returns 0; -1 when a size is not covered (nothing written, the caller takes
 * the per-op path); -2 when a slot, length or block id lies outside the cache (nothing
 * written). */
#include "common.h"
#include "kernels.h"

enum {
#define SLOT_ENUM(name) L_##name,
    DECODE_STEP_LAYER_SLOTS(SLOT_ENUM)
#undef SLOT_ENUM
    L_PTRS
};
enum {
#define MATMUL_ENUM(name) F_##name,
    DECODE_STEP_MATMULS(MATMUL_ENUM)
#undef MATMUL_ENUM
    F_PER_LAYER
};
enum {
    W_PLAIN = DECODE_STEP_W_PLAIN,
    W_Q4 = DECODE_STEP_W_Q4,
    W_Q8 = DECODE_STEP_W_Q8,
    W_I8P = DECODE_STEP_W_I8P
};

const char *decode_step_layer_slots(void) {
#define SLOT_NAME(name) #name " "
    return DECODE_STEP_LAYER_SLOTS(SLOT_NAME);
#undef SLOT_NAME
}

const char *decode_step_matmuls(void) {
#define MATMUL_NAME(name) #name " "
    return DECODE_STEP_MATMULS(MATMUL_NAME);
#undef MATMUL_NAME
}

int decode_step_slot_shape(int slot, int hidden, int H, int Hkv, int D, int inter,
                           long num_blocks, int block_size, long *dims) {
    const long q_n = (long)H * D, kv_n = (long)Hkv * D;
    switch (slot) {
    case L_input_norm:
    case L_post_norm:
        dims[0] = hidden;
        return 1;
    case L_qkv:
        dims[0] = q_n + 2 * kv_n;
        dims[1] = hidden;
        return 2;
    case L_o:
        dims[0] = hidden;
        dims[1] = q_n;
        return 2;
    case L_gate_up:
        dims[0] = 2L * inter;
        dims[1] = hidden;
        return 2;
    case L_down:
        dims[0] = hidden;
        dims[1] = inter;
        return 2;
    case L_k_cache:
    case L_v_cache:
        dims[0] = num_blocks;
        dims[1] = block_size;
        dims[2] = Hkv;
        dims[3] = D;
        return 4;
    case L_qkv_scales:
    case L_o_scales:
    case L_gate_up_scales:
    case L_down_scales:
        return 0;
    default:
        return -1;
    }
}

/* int8 panels of Q4 weights (float32 steps): the per-op path's int8_panels_linear, call for
 * call (int8_panels.c) */
#define LINEAR_I8P_f32(x, xs, w, sc, y, ys, M, N, K, qwork)                                     \
    int8_panels_linear_q4_f32(x, xs, (const uint8_t *)(w), (const float *)(sc), y, ys, M, N, K, \
                              qwork)
#define LINEAR_I8P_bf16(x, xs, w, sc, y, ys, M, N, K, qwork) (void)(qwork) /* refused up front */

/* y = x w^T for one of the layer's matmuls, in its storage format (block_quant.c's
 * kernels are bitwise gemv_f32 / gemv_bf16 on the dequantized weight). Sizes were checked
 * up front. */
#define DEFINE_LINEAR(SUF, T)                                                                  \
    static inline void linear_##SUF(int fmt, const T *x, long xs, const void *w,               \
                                    const void *sc, T *y, long ys, int M, int N, int K,        \
                                    void *qwork) {                                             \
        if (fmt == W_I8P)                                                                      \
            LINEAR_I8P_##SUF(x, xs, w, sc, y, ys, M, N, K, qwork);                             \
        else if (fmt == W_Q4)                                                                  \
            gemv_q4_##SUF(x, xs, w, sc, y, ys, M, N, K);                                       \
        else if (fmt == W_Q8)                                                                  \
            gemv_q8_##SUF(x, xs, w, sc, y, ys, M, N, K);                                       \
        else                                                                                   \
            gemv_##SUF(x, xs, w, y, ys, M, N, K);                                              \
    }
DEFINE_LINEAR(f32, float)
DEFINE_LINEAR(bf16, uint16_t)

/* Elements of the work buffer for M rows: residual, normed input and block output
 * [M, hidden] each, qkv [M, (H + 2 Hkv) D], attention output [M, H D], gate_up
 * [M, 2 inter] and the activation [M, inter]; then the int8 panels' quantized input
 * (qwork_bytes, counted in 2-byte elements so that either dtype's buffer holds it, plus
 * 64 bytes to align it). */
static long qwork_bytes(int M, int hidden, int H, int D, int inter) {
    long k = hidden > H * D ? hidden : (long)H * D;
    k = k > inter ? k : inter;
    return (((long)M * k + 63) & ~63L) + 2L * M * (k / 32) * (long)sizeof(float);
}

static long base_elems(int M, int hidden, int H, int Hkv, int D, int inter) {
    return (long)M * (3L * hidden + (long)(H + 2 * Hkv) * D + (long)H * D + 3L * inter);
}

long decode_step_work_elems(int M, int hidden, int H, int Hkv, int D, int inter) {
    return base_elems(M, hidden, H, Hkv, D, inter) +
           (qwork_bytes(M, hidden, H, D, inter) + 64 + 1) / 2;
}

#define DEFINE_DECODE_STEP(NAME, T, SUF)                                                       \
    int NAME(const void *const *layers, const int32_t *formats, int num_layers,                \
             const T *final_norm, const T *x_in, T *out, T *work, const T *cos,                \
             const T *sin_signed, const int64_t *slots, const int32_t *tables,                 \
             long table_stride, const int32_t *lens, int M, int hidden, int H, int Hkv, int D, \
             int inter, int block_size, long num_blocks, float eps, float scale,               \
             int kv_int8) {                                                                    \
        const int q_n = H * D, kv_n = Hkv * D, qkv_n = q_n + 2 * kv_n;                         \
        /* everything checked before anything is written */                                    \
        int plain = 0, blocks = 0, panels = 0;                                                 \
        for (int j = 0; j < F_PER_LAYER * num_layers; j++) {                                   \
            if (formats[j] == W_PLAIN)                                                         \
                plain = 1;                                                                     \
            else if (formats[j] == W_Q4 || formats[j] == W_Q8)                                 \
                blocks = 1;                                                                    \
            else if (formats[j] == W_I8P && sizeof(T) == 4)                                    \
                panels = 1;                                                                    \
            else                                                                               \
                return -1;                                                                     \
        }                                                                                      \
        if (panels && (hidden % 32 != 0 || q_n % 32 != 0 || inter % 32 != 0)) return -1;       \
        /* int8 caches (kv_int8.c's rows): where an int8 decode item takes T queries */      \
        if (kv_int8 && (!KV_INT8_STEP_##SUF || (D != 64 && D != 128))) return -1;              \
        if (num_layers < 1 || M < 1 || D % 2 != 0 || D > 512 ||                                \
            (plain && (!gemv_##SUF##_covers(M, qkv_n, hidden) ||                               \
                       !gemv_##SUF##_covers(M, hidden, q_n) ||                                 \
                       !gemv_##SUF##_covers(M, 2 * inter, hidden) ||                           \
                       !gemv_##SUF##_covers(M, hidden, inter))) ||                             \
            (blocks && (!gemv_q_##SUF##_covers(M, qkv_n, hidden) ||                            \
                        !gemv_q_##SUF##_covers(M, hidden, q_n) ||                              \
                        !gemv_q_##SUF##_covers(M, hidden, inter))))                            \
            return -1;                                                                         \
        const int rc = decode_attention_check(tables, table_stride, lens, M, H, Hkv, D,        \
                                              block_size, num_blocks);                         \
        if (rc != 0) return rc;                                                                \
        for (int i = 0; i < M; i++)                                                            \
            if (slots[i] < 0 || slots[i] >= num_blocks * block_size) return -2;                \
        T *res = work, *h = res + (long)M * hidden, *x = h + (long)M * hidden;                 \
        T *qkv = x + (long)M * hidden, *attn = qkv + (long)M * qkv_n;                          \
        T *gu = attn + (long)M * q_n, *act = gu + 2L * M * inter;                              \
        void *qwork = (void *)(((uintptr_t)(act + (long)M * inter) + 63) & ~(uintptr_t)63);    \
        memcpy(res, x_in, (size_t)M * hidden * sizeof(T));                                     \
        for (int l = 0; l < num_layers; l++) {                                                 \
            const void *const *p = layers + (long)l * L_PTRS;                                  \
            const int32_t *f = formats + (long)F_PER_LAYER * l;                                \
            rms_norm_##SUF(l ? x : res, hidden, l ? res : NULL, hidden, p[L_input_norm], h,    \
                           hidden, M, hidden, eps);                                            \
            linear_##SUF(f[F_qkv], h, hidden, p[L_qkv], p[L_qkv_scales], qkv, qkv_n, M, qkv_n, \
                         hidden, qwork);                                                       \
            rope_##SUF(qkv, qkv_n, cos, sin_signed, M, H + Hkv, D);                            \
            if (kv_int8) {                                                                     \
                write_kv_cache_int8((const char *)(qkv + q_n), qkv_n,                          \
                                    (const char *)(qkv + q_n + kv_n), qkv_n,                   \
                                    (int8_t *)p[L_k_cache], (int8_t *)p[L_v_cache], slots, M,  \
                                    Hkv, D, sizeof(T) == 2, num_blocks * block_size);          \
                KV_INT8_ATTEND_##SUF(qkv, qkv_n, p[L_k_cache], p[L_v_cache], tables,           \
                                     table_stride, lens, attn, M, H, Hkv, D, block_size,       \
                                     scale, num_blocks);                                       \
            } else {                                                                           \
                write_kv_cache((const char *)(qkv + q_n), qkv_n,                               \
                               (const char *)(qkv + q_n + kv_n), qkv_n, (char *)p[L_k_cache],  \
                               (char *)p[L_v_cache], slots, M, kv_n, (long)sizeof(T),          \
                               num_blocks * block_size);                                       \
                paged_decode_attention_##SUF(qkv, qkv_n, p[L_k_cache], p[L_v_cache], tables,   \
                                             table_stride, lens, attn, M, H, Hkv, D,           \
                                             block_size, scale, num_blocks);                   \
            }                                                                                  \
            linear_##SUF(f[F_o], attn, q_n, p[L_o], p[L_o_scales], x, hidden, M, hidden, q_n,  \
                         qwork);                                                               \
            rms_norm_##SUF(x, hidden, res, hidden, p[L_post_norm], h, hidden, M, hidden, eps); \
            linear_##SUF(f[F_gate_up], h, hidden, p[L_gate_up], p[L_gate_up_scales], gu,       \
                         2 * inter, M, 2 * inter, hidden, qwork);                              \
            silu_mul_##SUF(gu, 2 * inter, act, inter, M, inter);                               \
            linear_##SUF(f[F_down], act, inter, p[L_down], p[L_down_scales], x, hidden, M,     \
                         hidden, inter, qwork);                                                \
        }                                                                                      \
        rms_norm_##SUF(x, hidden, res, hidden, final_norm, out, hidden, M, hidden, eps);       \
        return 0;                                                                              \
    }

/* Which steps read int8 caches: where cpu_attention.c builds an int8 decode item for
 * their queries (bf16: AVX-512; float32: AVX-512 or AVX2 + FMA) */
#if defined(__AVX512F__)
#define KV_INT8_STEP_bf16 1
#else
#define KV_INT8_STEP_bf16 0
#endif
#if defined(__AVX512F__) || defined(AVX2_ONLY)
#define KV_INT8_STEP_f32 1
#else
#define KV_INT8_STEP_f32 0
#endif
#define KV_INT8_ATTEND_bf16(...) paged_decode_attention_i8_bf16(__VA_ARGS__)
#define KV_INT8_ATTEND_f32(...) paged_decode_attention_i8_f32(__VA_ARGS__)
DEFINE_DECODE_STEP(decode_step_f32, float, f32)
DEFINE_DECODE_STEP(decode_step_bf16, uint16_t, bf16)
