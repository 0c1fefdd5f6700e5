/* Helpers shared by the CPU kernels (cpu_ops.c, cpu_attention.c, decode_step.c, the
 * *_avx2.c files): bf16 conversions with torch's rounding, a vectorizable exp, and the
 * lane sums (hsum16 on AVX-512, hsum8x8 on AVX2). Header-only (static inline), so each
 * file gets its own copy inlined. */
#ifndef SARAZMQ_COMMON_H
#define SARAZMQ_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float -> bf16, round to nearest even, as torch does (for finite inputs) */
static inline uint16_t to_bf(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float round_bf(float f) { return bf(to_bf(f)); }

/* exp(x), ~2 ulp, vectorizable: x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-7
 * polynomial, 2^n by exponent bits; below -87 the result is exp(-87) (~1.6e-38, where
 * the exponent bits end), above 88.72 +inf as expf. */
static inline float exp_approx(float x) {
    if (x > 88.7228f) return INFINITY;
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.42860682030941723212e-6f;
    float p = 1.98412698412698413e-4f;
    p = p * r + 1.38888888888888889e-3f;
    p = p * r + 8.33333333333333333e-3f;
    p = p * r + 4.16666666666666667e-2f;
    p = p * r + 1.66666666666666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* AVX2 + FMA without AVX-512: builds whose float32 matrix-vector products and decode
 * attention come from gemv_avx2.c and decode_attention_avx2.c */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define AVX2_ONLY 1
#endif

#if defined(AVX2_ONLY)
#include <immintrin.h>

/* exp_approx on 8 lanes (AVX2 builds; exp512 below is the AVX-512 one) */
static inline __m256 exp256(__m256 x) {
    const __m256 over = _mm256_cmp_ps(x, _mm256_set1_ps(88.7228f), _CMP_GT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), r);
    __m256 p = _mm256_set1_ps(1.98412698412698413e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.38888888888888889e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.33333333333333333e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.16666666666666667e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.66666666666666667e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_blendv_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)),
                            _mm256_set1_ps(INFINITY), over);
}

/* silu(x) = x / (1 + exp(-x)) on 8 lanes, float32: silu16's math (the same bits) */
static inline __m256 silu8(__m256 x) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), x));
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

/* lane t of the result = the sum of v[t]'s 8 lanes (8 keys' dot products, a tile of 8
 * output rows), hsum16's plan on 8 lanes */
static inline __attribute__((always_inline)) __m256 hsum8x8(const __m256 v[8]) {
    const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20),
                         _mm256_permute2f128_ps(b0, b1, 0x31));
}

static inline float hmax8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
}

static inline float hadd8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
}
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

/* exp_approx on 16 lanes */
static inline __m512 exp512(__m512 x) {
    const __mmask16 over = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.7228f), _CMP_GT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
    __m512 p = _mm512_set1_ps(1.98412698412698413e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.38888888888888889e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.33333333333333333e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.16666666666666667e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.66666666666666667e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mask_mov_ps(_mm512_mul_ps(p, _mm512_castsi512_ps(e)), over,
                              _mm512_set1_ps(INFINITY));
}

/* silu(x) = x / (1 + exp(-x)) on 16 lanes, float32 */
static inline __m512 silu16(__m512 x) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), x));
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}
/* 16 bf16 <-> float32, round to nearest even (finite inputs), as to_bf */
static inline __m512 bf16x16_load(const uint16_t *p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline __m512 bf16x16_round(__m512 v) {
    __m512i b = _mm512_castps_si512(v);
    b = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                             _mm512_and_si512(_mm512_srli_epi32(b, 16),
                                                              _mm512_set1_epi32(1))));
    return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32((int)0xFFFF0000)));
}
/* 16 float32 lanes already rounded to bf16 values (bf16x16_round) -> 16 bf16 */
static inline void bf16x16_store(uint16_t *p, __m512 rounded) {
    _mm256_storeu_si256((__m256i *)p,
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16)));
}
/* SwiGLU on 16 lanes of bf16 values (as float32): silu(gate) rounded to bf16, times up,
 * rounded to bf16 (where torch stores its bf16 tensors); shared by silu_mul_bf16 and the
 * tile matmul's fused epilogue so both give the same bits */
static inline __m512 silu_mul16_bf16(__m512 gate, __m512 up) {
    return bf16x16_round(_mm512_mul_ps(bf16x16_round(silu16(gate)), up));
}

/* Lane i of the result = the sum of v[i]'s 16 lanes: 16 horizontal sums (a run of keys'
 * dot products, a tile of output rows) in 45 shuffles and adds, where 16 separate
 * reductions would take ~130 and a dependent chain each. */
static inline __attribute__((always_inline)) __m512 hsum16(const __m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: (v2i, v2i+1) pair sums, interleaved */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: the lane sums of v4i .. v4i+3 */
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++) /* lanes pairwise summed across the four 128-bit lanes */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                         _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}
#endif

#endif
