/* Activations quantized for the integer-dot matmuls (int8_dot.c, int8_panels.c), and the
 * two producers of matmul inputs fused with it.
 *
 * A row of K float32 (K a multiple of 32) becomes, per 32-block, llama.cpp's Q8_1:
 * d = max|x| / 127, q = round-half-even(x * 127 / max|x|) (int8), s = d * sum(q). Every
 * variant gives the same bits: the maximum and the integer sum are exact in any order,
 * the two divisions and the last product are single IEEE operations, and the rounding is
 * the default MXCSR mode's, nearbyintf's.
 *   quantize_block_c: the plain loop, one block;
 *   quantize_block_avx2: one block in 8-lane vectors (AVX2 builds);
 *   quantize_blocks16_avx512: 16 blocks at a time (AVX-512 builds): the per-block maxima
 *     first, then both divisions as one 16-lane instruction each, where the one-block
 *     forms pay two scalar divisions per block (docs/KERNELS.md, "Activation
 *     quantization").
 *
 * rms_norm_quantize_f32 and silu_mul_quantize_f32 write the quantized rows straight from
 * rms_norm_row_f32 / silu_mul_row_f32 (cpu_ops.c, the very code of rms_norm_f32 and
 * silu_mul_f32) through a row buffer on the stack: bitwise rms_norm_f32 or silu_mul_f32
 * followed by int8_quantize_rows, without the float rows' round trip through memory nor
 * one of the two passes' OpenMP barriers. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QUANT_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define QUANT_AVX512 1
#endif

static void quantize_block_c(const float *x, int8_t *q, float *d, float *s) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) {
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int i = 0; i < 32; i++) {
        const int v = (int)nearbyintf(x[i] * id);
        q[i] = (int8_t)v;
        sum += v;
    }
    *d = amax / 127.0f;
    *s = *d * (float)sum;
}

#if defined(QUANT_AVX2)
static inline void quantize_block_avx2(const float *x, int8_t *q, float *d, float *s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4];
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    const float amax = _mm_cvtss_f32(h);
    const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i i32[4];
    for (int i = 0; i < 4; i++) /* MXCSR default: round half to even */
        i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]),
                                   _mm256_add_epi32(i32[2], i32[3]));
    /* packs interleave 128-bit lanes: 0 1 4 5 2 3 6 7 (4-byte groups), undone by a permute */
    const __m256i p16a = _mm256_packs_epi32(i32[0], i32[1]);
    const __m256i p16b = _mm256_packs_epi32(i32[2], i32[3]);
    const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    _mm256_storeu_si256((__m256i *)q,
                        _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    *d = amax / 127.0f;
    *s = *d * (float)_mm_cvtsi128_si32(s4);
}
#endif

#if defined(QUANT_AVX512)
/* blocks 0..15 of x (512 values) into q, d[0..15], s[0..15] */
static inline void quantize_blocks16_avx512(const float *x, int8_t *q, float *d, float *s) {
    __attribute__((aligned(64))) float lane[16];
    __attribute__((aligned(64))) int32_t sums[16];
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int b = 0; b < 16; b++) {
        const __m512 lo = _mm512_and_ps(_mm512_loadu_ps(x + 32 * b), magnitude);
        const __m512 hi = _mm512_and_ps(_mm512_loadu_ps(x + 32 * b + 16), magnitude);
        lane[b] = _mm512_reduce_max_ps(_mm512_max_ps(lo, hi));
    }
    const __m512 amax = _mm512_load_ps(lane);
    const __mmask16 nonzero = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ);
    _mm512_store_ps(lane, _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(127.0f), amax));
    for (int b = 0; b < 16; b++) {
        const __m512 id = _mm512_set1_ps(lane[b]);
        const __m512i lo = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 32 * b), id));
        const __m512i hi =
            _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 32 * b + 16), id));
        /* |q| <= 127: the saturating narrowings keep every value */
        _mm_storeu_si128((__m128i *)(q + 32 * b), _mm512_cvtsepi32_epi8(lo));
        _mm_storeu_si128((__m128i *)(q + 32 * b + 16), _mm512_cvtsepi32_epi8(hi));
        sums[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi));
    }
    const __m512 dv = _mm512_div_ps(amax, _mm512_set1_ps(127.0f));
    _mm512_storeu_ps(d, dv);
    _mm512_storeu_ps(s, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_load_si512(sums))));
}
#endif

/* one row of K values (K % 32 == 0) into q [K], d and s [K / 32] */
static inline void quantize_row(const float *x, int K, int8_t *q, float *d, float *s,
                                int portable) {
    const int KB = K / 32;
    int b = 0;
    if (!portable) {
#if defined(QUANT_AVX512)
        for (; b + 16 <= KB; b += 16) quantize_blocks16_avx512(x + 32L * b, q + 32L * b, d + b, s + b);
#endif
#if defined(QUANT_AVX2)
        for (; b < KB; b++) quantize_block_avx2(x + 32L * b, q + 32L * b, d + b, s + b);
#endif
    }
    for (; b < KB; b++) quantize_block_c(x + 32L * b, q + 32L * b, d + b, s + b);
}

int int8_quantize_rows(const float *x, long x_stride, int M, int K, int8_t *xq, float *xd,
                       float *xs, int portable) {
    if (M < 0 || K <= 0 || K % 32 != 0) return -1;
    const int KB = K / 32;
#pragma omp parallel for schedule(static) if ((long)M * K >= 65536)
    for (long m = 0; m < M; m++)
        quantize_row(x + m * x_stride, K, xq + m * K, xd + m * KB, xs + m * KB, portable);
    return 0;
}

/* rows to fuse per OpenMP thread at the least (rms_norm_f32's threshold) */
#define FUSED_PAR_ROWS 32

void rms_norm_quantize_f32(const float *x, long x_stride, float *residual, long r_stride,
                           const float *weight, long rows, int hidden, float eps, int8_t *xq,
                           float *xd, float *xs) {
    const int KB = hidden / 32;
#pragma omp parallel for schedule(static) if (rows >= FUSED_PAR_ROWS)
    for (long i = 0; i < rows; i++) {
        float h[hidden]; /* hidden floats: L1 */
        rms_norm_row_f32(x + i * x_stride, residual ? residual + i * r_stride : NULL, weight, h,
                         hidden, eps);
        quantize_row(h, hidden, xq + i * hidden, xd + i * KB, xs + i * KB, 0);
    }
}

void silu_mul_quantize_f32(const float *gate_up, long gu_stride, long rows, int inter,
                           int8_t *xq, float *xd, float *xs) {
    const int KB = inter / 32;
#pragma omp parallel for schedule(static) if (rows >= FUSED_PAR_ROWS)
    for (long i = 0; i < rows; i++) {
        float act[inter];
        silu_mul_row_f32(gate_up + i * gu_stride, act, inter);
        quantize_row(act, inter, xq + i * inter, xd + i * KB, xs + i * KB, 0);
    }
}
