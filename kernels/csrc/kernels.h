/* The C entry points of the CPU kernel library (one shared object built from every .c
 * file here by sarazmq.kernels.native and called through ctypes). Declared once so that
 * decode_step.c calls the other files' kernels with checked signatures. Return codes:
 * 0 done; -1 a size this build does not cover, nothing written (the caller falls back to
 * torch); -2 an index (slot, block id, length) outside the cache, nothing written. */
#ifndef SARAZMQ_KERNELS_H
#define SARAZMQ_KERNELS_H

#include <stdint.h>

/* rows a gemv_* call takes */
#define GEMV_MAX_ROWS 8
/* rows a gemv_q*_f32 call takes: GEMV_MAX_ROWS at a time per tile of weights, which the
 * later groups read from L1 (a tile is 16 weight rows, a few KB as blocks) */
#define QGEMV_MAX_ROWS 64

/* cpu_ops.c */
void rms_norm_f32(const float *x, long x_stride, float *residual, long r_stride,
                  const float *weight, float *out, long o_stride, long rows, int hidden,
                  float eps);
void rms_norm_bf16(const uint16_t *x, long x_stride, uint16_t *residual, long r_stride,
                   const uint16_t *weight, uint16_t *out, long o_stride, long rows, int hidden,
                   float eps);
void rope_f32(float *x, long x_stride, const float *cos, const float *sin_signed, long rows,
              int heads, int D);
void rope_bf16(uint16_t *x, long x_stride, const uint16_t *cos, const uint16_t *sin_signed,
               long rows, int heads, int D);
void silu_mul_f32(const float *gate_up, long gu_stride, float *out, long o_stride, long rows,
                  int inter);
void silu_mul_bf16(const uint16_t *gate_up, long gu_stride, uint16_t *out, long o_stride,
                   long rows, int inter);
/* one row of rms_norm_f32 (ri may be NULL) and of silu_mul_f32 (g: gate then up) */
void rms_norm_row_f32(const float *xi, float *ri, const float *weight, float *oi, int hidden,
                      float eps);
void silu_mul_row_f32(const float *g, float *o, int inter);
/* whether gemv_* takes these sizes (1 if so); on AVX2 builds without AVX-512 the float32
 * ones (and block_quant.c's float32 ones below) come from gemv_avx2.c */
int gemv_f32_covers(int M, int N, int K);
int gemv_bf16_covers(int M, int N, int K);
int gemv_f32(const float *x, long x_stride, const float *w, float *y, long y_stride, int M,
             int N, int K);
int gemv_bf16(const uint16_t *x, long x_stride, const uint16_t *w, uint16_t *y, long y_stride,
              int M, int N, int K);

/* block_quant.c: x [M, K] (float32 or bf16) times GGUF-block-quantized weights (see the
 * file); *_covers: whether this build takes these sizes */
int gemv_q_f32_covers(int M, int N, int K);
int gemv_q_bf16_covers(int M, int N, int K);
int gemv_q4_f32(const float *x, long x_stride, const void *qs, const float *scales, float *y,
                long y_stride, int M, int N, int K);
int gemv_q8_f32(const float *x, long x_stride, const void *qs, const float *scales, float *y,
                long y_stride, int M, int N, int K);
int gemv_q4_bf16(const uint16_t *x, long x_stride, const void *qs, const float *scales,
                 uint16_t *y, long y_stride, int M, int N, int K);
int gemv_q8_bf16(const uint16_t *x, long x_stride, const void *qs, const float *scales,
                 uint16_t *y, long y_stride, int M, int N, int K);

/* act_quant.c: int8_quantize_rows: x float32 [M, K] (row stride x_stride, K % 32 == 0) ->
 * xq int8 [M, K], xd (scale) and xs (scale * sum of the block's q) float32 [M, K/32];
 * portable = 1: the plain C loop (the same bits). The fused producers: bitwise
 * rms_norm_f32 / silu_mul_f32 then int8_quantize_rows, without the float rows in memory
 * (hidden, inter multiples of 32). */
int int8_quantize_rows(const float *x, long x_stride, int M, int K, int8_t *xq, float *xd,
                       float *xs, int portable);
void rms_norm_quantize_f32(const float *x, long x_stride, float *residual, long r_stride,
                           const float *weight, long rows, int hidden, float eps, int8_t *xq,
                           float *xd, float *xs);
void silu_mul_quantize_f32(const float *gate_up, long gu_stride, long rows, int inter,
                           int8_t *xq, float *xd, float *xs);

/* int8_dot.c: llama.cpp-style integer-dot matmuls on block_quant.c's weight layouts (see
 * the file); their inputs come from act_quant.c. int8_block_matmul:
 * y [M, N] (row stride y_stride) = xq . W^T, kind 4 (Q4 layout) or 8 (Q8 layout).
 * portable = 1: the plain C loops (int8_dot_avx2_built says whether the other exists;
 * int8_dot_vnni_built whether the panels and the probe use VPDPBUSD, INT8_DPBUSD). */
int int8_dot_avx2_built(void);
int int8_dot_vnni_built(void);
long int8_peak_probe(long iters, int int8);
int int8_block_matmul(int kind, const int8_t *xq, const float *xd, const float *xs, int M,
                      int K, const void *qs, const float *scales, float *y, long y_stride,
                      int N, int portable);
/* VPDPBUSD on 256-bit vectors where the build has it (AVX512-VNNI with VL, or AVX-VNNI):
 * unsigned x signed bytes multiplied and summed in fours straight into int32 lanes, one
 * instruction where AVX2 takes VPMADDUBSW + VPADDW (+ VPMADDWD); bitwise the same sums for
 * the kernels' operands (Q4 values 0..15 never saturate VPMADDUBSW's int16 pairs) */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define INT8_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define INT8_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif
/* VPDPBUSD on 512-bit vectors (AVX512-VNNI): twice the 256-bit form's products per
 * instruction at the same issue rate on cores with two 512-bit units; the panels and the
 * probe use it where built */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define INT8_DPBUSD512 1
#endif

/* int8_panels.c: the same math on weights repacked into panels of 16 interleaved columns
 * (wq uint8 [ceil(N/16), K/32, 8, 16, 4], scales float32 [ceil(N/16), K/32, 2, 16]: d, m);
 * weight_bits 4 (Q4 values) or 8 (Q8 values + 128: VPDPBUSD builds or portable only).
 * int8_panels_vector_bits: 512 (VPDPBUSD on zmm), 256 (AVX2 / AVX-VNNI) or 0 (portable
 * C only). */
int int8_panels_vector_bits(void);
int int8_panels_matmul(const int8_t *xq, const float *xd, const float *xs, int M, int K,
                       const uint8_t *wq, const float *scales, float *y, long y_stride, int N,
                       int weight_bits, int portable);
/* float32 rows through Q4 panels: quantized into qwork (M * K bytes rounded up to 64, then
 * 2 * M * K / 32 floats), then int8_panels_matmul */
void int8_panels_linear_q4_f32(const float *x, long x_stride, const uint8_t *wq,
                               const float *scales, float *y, long y_stride, int M, int N, int K,
                               void *qwork);
/* that qwork's parts for M rows of K: xq, then xd and xs */
void int8_qwork_parts(void *qwork, int M, int K, int8_t **xq, float **xd, float **xs);

/* decode_attention_avx2.c: one float32 decode work item on AVX2 builds; 1 done, 0 not
 * taken (another build, head size or item size) */
int decode_item_avx2_f32(int D, int G, const float *q, long q_stride, const float *k_cache,
                         const float *v_cache, const int32_t *tables, long table_stride,
                         const int32_t *lens, float *out, int n, int h0, int h1, int H, int Hkv,
                         int block_size, float scale);
/* the same over int8 cache rows (kernels/kv_int8.py) */
int decode_item_avx2_i8_f32(int D, int G, const float *q, long q_stride, const int8_t *k_cache,
                            const int8_t *v_cache, const int32_t *tables, long table_stride,
                            const int32_t *lens, float *out, int n, int h0, int h1, int H,
                            int Hkv, int block_size, float scale);

/* cpu_attention.c */
int decode_attention_check(const int32_t *tables, long table_stride, const int32_t *lens,
                           int nd, int H, int Hkv, int D, int block_size, long num_blocks);
int paged_decode_attention_f32(const float *q, long q_stride, const float *k_cache,
                               const float *v_cache, const int32_t *tables, long table_stride,
                               const int32_t *lens, float *out, int nd, int H, int Hkv, int D,
                               int block_size, float scale, long num_blocks);
int paged_decode_attention_bf16(const uint16_t *q, long q_stride, const uint16_t *k_cache,
                                const uint16_t *v_cache, const int32_t *tables,
                                long table_stride, const int32_t *lens, uint16_t *out, int nd,
                                int H, int Hkv, int D, int block_size, float scale,
                                long num_blocks);
/* int8 cache rows (D int8 values, then their float32 scale; kernels/kv_int8.py) */
int paged_decode_attention_i8_bf16(const uint16_t *q, long q_stride, const int8_t *k_cache,
                                   const int8_t *v_cache, const int32_t *tables,
                                   long table_stride, const int32_t *lens, uint16_t *out,
                                   int nd, int H, int Hkv, int D, int block_size, float scale,
                                   long num_blocks);
int paged_decode_attention_i8_f32(const float *q, long q_stride, const int8_t *k_cache,
                                  const int8_t *v_cache, const int32_t *tables,
                                  long table_stride, const int32_t *lens, float *out, int nd,
                                  int H, int Hkv, int D, int block_size, float scale,
                                  long num_blocks);

/* kv_cache_copy.c */
int write_kv_cache(const char *k, long k_stride, const char *v, long v_stride, char *k_cache,
                   char *v_cache, const int64_t *slots, long num_tokens, long row_elems,
                   long elem_size, long num_slots);

/* prefill_attention.c */
/* The prefill kernels' argument checks: 0 fine; -1 sizes they do not take (head size 64
 * or 128, H a multiple of Hkv, 1 <= q_len <= k_len); -2 a block id outside the cache */
int prefill_check(const int32_t *table, int q_len, int k_len, int H, int Hkv, int D,
                  int block_size, long num_blocks);

/* The body of a prefill entry (the arguments as prefill_check's callers name them) in a
 * build without its kernel: -1, the caller falls back */
#define PREFILL_NOT_BUILT()                                                                    \
    do {                                                                                       \
        (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)table, (void)q_len;      \
        (void)k_len, (void)H, (void)Hkv, (void)D, (void)block_size, (void)scale, (void)out;   \
        (void)out_stride, (void)num_blocks, (void)scratch;                                     \
        return -1;                                                                             \
    } while (0)

/* K and V of keys run * 16 .. run * 16 + 15 of KV head h in the packed layouts of the
 * prefill kernels: K [D/2][16], V [8][D], 32-bit words; keys past k_len are zeros */
void prefill_pack_kv_run(const uint16_t *k_cache, const uint16_t *v_cache,
                         const int32_t *table, int k_len, int run, int h, int Hkv, int D,
                         int block_size, uint32_t *kp, uint32_t *vp);

/* prefill_amx.c */
int prefill_amx_supported(void);
int prefill_attention_amx_bf16(const uint16_t *q, long q_stride, const uint16_t *k_cache,
                               const uint16_t *v_cache, const int32_t *table, int q_len,
                               int k_len, int H, int Hkv, int D, int block_size, float scale,
                               uint16_t *out, long out_stride, long num_blocks,
                               uint16_t *scratch);

/* prefill_attention_f32.c: float32 prefill attention on AVX2 + FMA and AVX-512 builds
 * (prefill_attention_f32 returns -1 elsewhere) */
int prefill_f32_supported(void);
int prefill_attention_f32(const float *q, long q_stride, const float *k_cache,
                          const float *v_cache, const int32_t *table, int q_len, int k_len,
                          int H, int Hkv, int D, int block_size, float scale, float *out,
                          long out_stride, long num_blocks, float *scratch);
/* the same over an int8 cache read in place (AVX512-VNNI builds; -1 elsewhere) */
int prefill_i8_f32_supported(void);
int prefill_attention_i8_f32(const float *q, long q_stride, const int8_t *k_cache,
                             const int8_t *v_cache, const int32_t *table, int q_len, int k_len,
                             int H, int Hkv, int D, int block_size, float scale, float *out,
                             long out_stride, long num_blocks, float *scratch);

/* argmax.c */
void argmax_rows_f32(const float *x, long x_stride, long rows, long cols, int64_t *out);

/* linear_amx.c */
int linear_amx_supported(void);
int linear_amx_pack(const uint16_t *w, int N, int K, uint16_t *out);
int linear_amx_bf16(const uint16_t *x, long x_stride, const uint16_t *wpacked, uint16_t *y,
                    long y_stride, int M, int N, int K);
int linear_amx_bf16_f32out(const uint16_t *x, long x_stride, const uint16_t *wpacked, float *y,
                           long y_stride, int M, int N, int K);
int linear_amx_silu_mul_bf16(const uint16_t *x, long x_stride, const uint16_t *wpacked,
                             uint16_t *y, long y_stride, int M, int inter, int K);

/* decode_step.c */

/* The per-layer pointer table of decode_step_*: one slot per name, in this order. The
 * Python side (sarazmq.kernels.decode_step) reads the names (decode_step_layer_slots) and
 * each slot's shape (decode_step_slot_shape) from the library, checks them against its own
 * DecodeLayerWeights, and fills the table by name. <matmul>_scales holds that matmul's
 * block scales where its weight is block-quantized (the weight slot then holds the
 * blocks' qs), and is unused otherwise. */
#define DECODE_STEP_LAYER_SLOTS(X)                                                             \
    X(input_norm) X(qkv) X(o) X(post_norm) X(gate_up) X(down) X(k_cache) X(v_cache)           \
    X(qkv_scales) X(o_scales) X(gate_up_scales) X(down_scales)
/* The matmuls of a layer, in the order of its row of the formats table (one of
 * DECODE_STEP_W_PLAIN, _Q4, _Q8 per matmul, or _I8P: Q4 panels read by int8 dot products,
 * int8_panels.c, float32 steps only; the scales slot then holds the panels' scales) */
#define DECODE_STEP_MATMULS(X) X(qkv) X(o) X(gate_up) X(down)
enum { DECODE_STEP_W_PLAIN, DECODE_STEP_W_Q4, DECODE_STEP_W_Q8, DECODE_STEP_W_I8P };

/* the slot names, space-separated, in table order; the matmul names likewise */
const char *decode_step_layer_slots(void);
const char *decode_step_matmuls(void);
/* The shape the step reads slot `slot` with, for these sizes: writes its dims (at most 4)
 * and returns their number; 0 for a slot without a shape of its own (block scales), -1
 * for no such slot. A matmul's shape is its weight's [N, K], plain or block-quantized. */
int decode_step_slot_shape(int slot, int hidden, int H, int Hkv, int D, int inter,
                           long num_blocks, int block_size, long *dims);
long decode_step_work_elems(int M, int hidden, int H, int Hkv, int D, int inter);
/* kv_int8: the caches hold kv_int8.c's rows ([num_blocks, block_size, Hkv, D + 4] int8,
 * not the slot shape above); bf16 steps with the AVX-512 decode item only (else -1) */
int decode_step_f32(const void *const *layers, const int32_t *formats, int num_layers,
                    const float *final_norm, const float *x_in, float *out, float *work,
                    const float *cos, const float *sin_signed, const int64_t *slots,
                    const int32_t *tables, long table_stride, const int32_t *lens, int M,
                    int hidden, int H, int Hkv, int D, int inter, int block_size,
                    long num_blocks, float eps, float scale, int kv_int8);
int decode_step_bf16(const void *const *layers, const int32_t *formats, int num_layers,
                     const uint16_t *final_norm, const uint16_t *x_in, uint16_t *out,
                     uint16_t *work, const uint16_t *cos, const uint16_t *sin_signed,
                     const int64_t *slots, const int32_t *tables, long table_stride,
                     const int32_t *lens, int M, int hidden, int H, int Hkv, int D, int inter,
                     int block_size, long num_blocks, float eps, float scale, int kv_int8);

/* hybrid_step.c: a bf16 hybrid iteration (decodes first, then prefill chunks) through
 * every layer and the final norm, matmuls on AMX tiles (decode_step's slot table, each
 * matmul slot a linear_amx_pack'ed weight); work: decode_step_work_elems(T, ...).
 * kv_int8: the caches hold kv_int8.c's rows (AVX-512 builds, D 64 or 128); kv_dequant then
 * holds two bf16 copies of the longest chunk's context blocks and identity [0, 1, ...]
 * as many block ids (both unused otherwise) */
int hybrid_step_bf16(const void *const *layers, int num_layers, const uint16_t *final_norm,
                     const uint16_t *x_in, uint16_t *out, uint16_t *work, const uint16_t *cos,
                     const uint16_t *sin_signed, const int64_t *slots, const int32_t *tables,
                     long table_stride, const int32_t *q_lens, const int32_t *k_lens,
                     int num_seqs, int num_decodes, int T, int hidden, int H, int Hkv, int D,
                     int inter, int block_size, long num_blocks, float eps, float scale,
                     uint16_t *scratch, int kv_int8, uint16_t *kv_dequant,
                     const int32_t *identity);
/* The same for a float32 model whose matmuls are all Q4 int8 panels (the slots hold each
 * panel's qs and scales, decode_step.c's W_I8P), chunks through prefill_attention_f32
 * (AVX2 + FMA or AVX-512 builds, else -1); kv_int8 with the AVX-512 or AVX2 int8 decode
 * item; scratch (64-byte aligned, else -1), kv_dequant float32 */
int hybrid_step_f32(const void *const *layers, int num_layers, const float *final_norm,
                    const float *x_in, float *out, float *work, const float *cos,
                    const float *sin_signed, const int64_t *slots, const int32_t *tables,
                    long table_stride, const int32_t *q_lens, const int32_t *k_lens,
                    int num_seqs, int num_decodes, int T, int hidden, int H, int Hkv, int D,
                    int inter, int block_size, long num_blocks, float eps, float scale,
                    float *scratch, int kv_int8, float *kv_dequant, const int32_t *identity);

/* kv_int8.c */
int write_kv_cache_int8(const char *k, long k_stride, const char *v, long v_stride,
                        int8_t *k_cache, int8_t *v_cache, const int64_t *slots, long num_tokens,
                        int Hkv, int D, int is_bf16, long num_slots);
int dequantize_kv_blocks_int8_bf16(const int8_t *cache, const int32_t *blocks, long n,
                                   int block_size, int Hkv, int D, long num_blocks,
                                   uint16_t *out);
int dequantize_kv_blocks_int8_f32(const int8_t *cache, const int32_t *blocks, long n,
                                  int block_size, int Hkv, int D, long num_blocks, float *out);

#endif
