/* Integer-dot matmuls on GGUF weights repacked into panels of 8 interleaved columns (the
 * faster layout of int8_dot.c's math; kernels/int8_dot.py `pack_int8_panels` builds it).
 * Q4 weights are stored as their 0..15 values (weight_bits = 4); Q8 ones as q + 128 in
 * 0..255 with m = -128 d (weight_bits = 8), the same formula below. 8-bit weights need
 * VPDPBUSD's int32 sums (or the portable loop): the AVX2 build refuses them.
 *
 * Same result definition as int8_dot.c (activations quantized per 32-block; per block
 * y += dw * dx * dot(qw, qx) + mw * s), different layout and loop:
 *   wq uint8 [G, KB, 8, 8, 4]: G = ceil(N / 8) column groups; per group and block, 8 runs
 *      of 32 bytes, run r holding, for each of the group's 8 columns c, that column's
 *      weights 4r .. 4r+3 of the block (unsigned, one byte each; padding columns 0);
 *   scales float32 [G, KB, 2, 8]: the group's 8 columns' d, then their m, of each block.
 * One run times the activation bytes 4r .. 4r+3 broadcast to every lane is one VPMADDUBSW:
 * 8 columns x 4 products summed in pairs to int16. A block's 8 runs add up in int16 without
 * overflow (16 products of |15 * 127| per lane: <= 30,480 < 32,767), one VPMADDWD by ones
 * gives the 8 columns' exact int32 block dots in the 8 lanes, and the block's scaling is
 * one conversion, one multiply and two fmas for 8 columns (int8_dot.c pays that per
 * column). The lanes are the output columns: no horizontal sums. Where the build has
 * VPDPBUSD (kernels.h INT8_DPBUSD: AVX512-VNNI or AVX-VNNI) each run is one VPDPBUSD into
 * int32 lanes instead: the same sums, bitwise.
 *
 * Tiles of 2 rows x 2 column groups (weight runs shared by the rows, activation broadcasts
 * by the groups); OpenMP over spans of column groups whose weights stay in L1/L2 while
 * every row passes. `portable` = 1 runs the plain C loop. Returns 0, or -1 (nothing
 * written) for K not a positive multiple of 32, a negative size, or 8-bit weights on the
 * VPMADDUBSW build. */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PANELS_AVX2 1
#endif

/* ------------------------------------------------------------------ portable C */

static void panels_c(const int8_t *xq, const float *xd, const float *xs, int M, int K,
                     const uint8_t *wq, const float *scales, float *y, long y_stride, int N) {
    const int KB = K / 32;
    const long G = (N + 7) / 8;
#pragma omp parallel for schedule(static)
    for (long g = 0; g < G; g++) {
        for (int m = 0; m < M; m++) {
            float acc[8] = {0};
            for (int b = 0; b < KB; b++) {
                const uint8_t *wb = wq + (g * KB + b) * 256L;
                const int8_t *xb = xq + (long)m * K + 32L * b;
                const float dx = xd[(long)m * KB + b], sx = xs[(long)m * KB + b];
                for (int c = 0; c < 8; c++) {
                    int32_t dot = 0;
                    for (int r = 0; r < 8; r++)
                        for (int t = 0; t < 4; t++) dot += (int32_t)wb[32 * r + 4 * c + t] * xb[4 * r + t];
                    const float *sc = scales + (g * KB + b) * 16;
                    acc[c] += (float)dot * (sc[c] * dx);
                    acc[c] += sc[8 + c] * sx;
                }
            }
            for (int c = 0; c < 8 && g * 8 + c < N; c++) y[(long)m * y_stride + g * 8 + c] = acc[c];
        }
    }
}

/* ------------------------------------------------------------------ AVX2 */

#if defined(PANELS_AVX2)
/* rows per tile: 4 where AVX-512VL gives 32 vector registers (8 sums, 8 accumulators, the
 * weights and broadcasts fit), 2 with AVX2's 16 */
#if defined(__AVX512VL__)
#define TILE_MR 4
#else
#define TILE_MR 2
#endif

/* the 8 lanes of v into y (n valid columns: the last group may be partial) */
static inline void store_cols(float *y, __m256 v, int n) {
    if (n >= 8) {
        _mm256_storeu_ps(y, v);
        return;
    }
    float tmp[8];
    _mm256_storeu_ps(tmp, v);
    memcpy(y, tmp, sizeof(float) * (size_t)n);
}

/* MR rows (1-TILE_MR) from xq/xd/xs x NG groups (1-2) from g; y at (row 0, group g's
 * column 0) */
static inline __attribute__((always_inline)) void tile(
    const int MR, const int NG, const int8_t *xq, const float *xd, const float *xs, int K,
    const uint8_t *wq, const float *scales, long g, float *y, long y_stride, int N) {
    const int KB = K / 32;
#if !defined(INT8_DPBUSD)
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    __m256 acc[TILE_MR][2];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NG; j++) acc[i][j] = _mm256_setzero_ps();
    for (int b = 0; b < KB; b++) {
        __m256i s16[TILE_MR][2]; /* int32 lanes with VPDPBUSD */
        for (int r = 0; r < 8; r++) {
            __m256i w[2], x[TILE_MR];
            for (int j = 0; j < NG; j++)
                w[j] = _mm256_loadu_si256((const __m256i *)(wq + ((g + j) * KB + b) * 256L + 32 * r));
            for (int i = 0; i < MR; i++) {
                int32_t four;
                memcpy(&four, xq + (long)i * K + 32L * b + 4 * r, 4);
                x[i] = _mm256_set1_epi32(four);
            }
            for (int i = 0; i < MR; i++)
                for (int j = 0; j < NG; j++) {
#if defined(INT8_DPBUSD)
                    s16[i][j] = INT8_DPBUSD(r == 0 ? _mm256_setzero_si256() : s16[i][j], w[j], x[i]);
#else
                    const __m256i p = _mm256_maddubs_epi16(w[j], x[i]);
                    s16[i][j] = r == 0 ? p : _mm256_add_epi16(s16[i][j], p);
#endif
                    /* keeps the sum a running register: left free, compilers gather all
                     * 32 products first and spill them */
                    __asm__("" : "+x"(s16[i][j]));
                }
        }
        for (int j = 0; j < NG; j++) {
            const float *sc = scales + ((g + j) * KB + b) * 16;
            const __m256 dw = _mm256_loadu_ps(sc), mw = _mm256_loadu_ps(sc + 8);
            for (int i = 0; i < MR; i++) {
#if defined(INT8_DPBUSD)
                const __m256 f = _mm256_cvtepi32_ps(s16[i][j]);
#else
                const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[i][j], ones));
#endif
                const __m256 dx = _mm256_broadcast_ss(xd + (long)i * KB + b);
                const __m256 sx = _mm256_broadcast_ss(xs + (long)i * KB + b);
                acc[i][j] = _mm256_fmadd_ps(f, _mm256_mul_ps(dw, dx), acc[i][j]);
                acc[i][j] = _mm256_fmadd_ps(mw, sx, acc[i][j]);
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NG; j++) {
            const long col = (g + j) * 8;
            store_cols(y + (long)i * y_stride + col, acc[i][j], N - col < 8 ? (int)(N - col) : 8);
        }
}

#define TILE(MR, NG)                                                                       \
    tile(MR, NG, xq + (long)m * K, xd + (long)m * KB, xs + (long)m * KB, K, wq, scales, g, \
         y + (long)m * y_stride, y_stride, N)

/* groups [g0, g1) for every row */
static void span_avx2(const int8_t *xq, const float *xd, const float *xs, int M, int K,
                      const uint8_t *wq, const float *scales, float *y, long y_stride, int N,
                      long g0, long g1) {
    const int KB = K / 32;
    int m = 0;
    for (; m + TILE_MR <= M; m += TILE_MR) {
        long g = g0;
        for (; g + 2 <= g1; g += 2) TILE(TILE_MR, 2);
        for (; g < g1; g++) TILE(TILE_MR, 1);
    }
#if TILE_MR > 2
    for (; m + 2 <= M; m += 2) {
        long g = g0;
        for (; g + 2 <= g1; g += 2) TILE(2, 2);
        for (; g < g1; g++) TILE(2, 1);
    }
#endif
    for (; m < M; m++) {
        long g = g0;
        for (; g + 2 <= g1; g += 2) TILE(1, 2);
        for (; g < g1; g++) TILE(1, 1);
    }
}
#endif

/* ------------------------------------------------------------------ entry point */

int int8_panels_matmul(const int8_t *xq, const float *xd, const float *xs, int M, int K,
                       const uint8_t *wq, const float *scales, float *y, long y_stride, int N,
                       int weight_bits, int portable) {
    if (M < 0 || N < 0 || K <= 0 || K % 32 != 0 || (weight_bits != 4 && weight_bits != 8))
        return -1;
    if (M == 0 || N == 0) return 0;
#if defined(PANELS_AVX2)
#if !defined(INT8_DPBUSD)
    /* 8-bit weights (up to 255) would saturate VPMADDUBSW's int16 pair sums */
    if (weight_bits == 8 && !portable) return -1;
#endif
    if (!portable) {
        const int KB = K / 32;
        const long G = (N + 7) / 8;
        /* a span's weights (256 bytes per group and block) about 16 KB: L1 while the rows
         * pass; at least 2 groups for the 2x2 tile */
        long span = 16384 / (256L * KB);
        span = span < 2 ? 2 : span & ~1L;
        const long spans = (G + span - 1) / span;
#pragma omp parallel for schedule(dynamic, 1)
        for (long p = 0; p < spans; p++) {
            const long g0 = p * span, g1 = g0 + span < G ? g0 + span : G;
            span_avx2(xq, xd, xs, M, K, wq, scales, y, y_stride, N, g0, g1);
        }
        return 0;
    }
#endif
    (void)portable;
    panels_c(xq, xd, xs, M, K, wq, scales, y, y_stride, N);
    return 0;
}
