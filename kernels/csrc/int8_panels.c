/* Integer-dot matmuls on GGUF weights repacked into panels of 16 interleaved columns (the
 * faster layout of int8_dot.c's math; kernels/int8_dot.py `pack_int8_panels` builds it).
 * Q4 weights are stored as their 0..15 values (weight_bits = 4); Q8 ones as q + 128 in
 * 0..255 with m = -128 d (weight_bits = 8), the same formula below. 8-bit weights need
 * VPDPBUSD's int32 sums (or the portable loop): the VPMADDUBSW build refuses them.
 *
 * Same result definition as int8_dot.c (activations quantized per 32-block; per block
 * y += dw * dx * dot(qw, qx) + mw * s), different layout and loop:
 *   wq uint8 [P, KB, 8, 16, 4]: P = ceil(N / 16) panels; per panel and block, 8 runs of 64
 *      bytes, run r holding, for each of the panel's 16 columns c, that column's weights
 *      4r .. 4r+3 of the block (unsigned, one byte each; padding columns 0);
 *   scales float32 [P, KB, 2, 16]: the panel's 16 columns' d, then their m, of each block.
 * One run times the activation bytes 4r .. 4r+3 broadcast to every lane is one 512-bit
 * VPDPBUSD (AVX512-VNNI builds: 16 columns x 4 products summed into int32 lanes) or, on
 * 256-bit builds, one instruction per half run (8 columns): VPDPBUSD (AVX-VNNI) or
 * VPMADDUBSW (AVX2), whose int16 pair sums of a block's 8 runs cannot overflow (16
 * products of |15 * 127| per lane: <= 30,480 < 32,767) and one VPMADDWD by ones turns
 * into the exact int32 block dots. Every variant computes the same integer sums, bitwise.
 * A block's scaling is then one conversion, one multiply and two fmas per vector of
 * columns (int8_dot.c pays that per column); the lanes are the output columns: no
 * horizontal sums.
 *
 * Tiles of rows x panels (weight runs shared by the rows, activation broadcasts by the
 * panels); OpenMP over spans of panels whose weights stay in L1/L2 while every row passes.
 * `portable` = 1 runs the plain C loop. Returns 0, or -1 (nothing written) for K not a
 * positive multiple of 32, a negative size, or 8-bit weights on the VPMADDUBSW build. */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PANELS_AVX2 1
#endif

#define PANEL_COLS 16
#define PANEL_BLOCK_BYTES (8 * PANEL_COLS * 4) /* one panel's block: 8 runs of 64 bytes */

/* ------------------------------------------------------------------ portable C */

static void panels_c(const int8_t *xq, const float *xd, const float *xs, int M, int K,
                     const uint8_t *wq, const float *scales, float *y, long y_stride, int N) {
    const int KB = K / 32;
    const long P = (N + PANEL_COLS - 1) / PANEL_COLS;
#pragma omp parallel for schedule(static)
    for (long p = 0; p < P; p++) {
        for (int m = 0; m < M; m++) {
            float acc[PANEL_COLS] = {0};
            for (int b = 0; b < KB; b++) {
                const uint8_t *wb = wq + (p * KB + b) * (long)PANEL_BLOCK_BYTES;
                const float *sc = scales + (p * KB + b) * 2L * PANEL_COLS;
                const int8_t *xb = xq + (long)m * K + 32L * b;
                const float dx = xd[(long)m * KB + b], sx = xs[(long)m * KB + b];
                for (int c = 0; c < PANEL_COLS; c++) {
                    int32_t dot = 0;
                    for (int r = 0; r < 8; r++)
                        for (int t = 0; t < 4; t++)
                            dot += (int32_t)wb[PANEL_COLS * 4 * r + 4 * c + t] * xb[4 * r + t];
                    acc[c] += (float)dot * (sc[c] * dx);
                    acc[c] += sc[PANEL_COLS + c] * sx;
                }
            }
            for (int c = 0; c < PANEL_COLS && p * PANEL_COLS + c < N; c++)
                y[(long)m * y_stride + p * PANEL_COLS + c] = acc[c];
        }
    }
}

#if defined(PANELS_AVX2)
/* ------------------------------------------------------------------ 512-bit VPDPBUSD */

#if defined(INT8_DPBUSD512)
#define TILE_MR 4 /* rows; 2 panels: 8 sums, 8 accumulators, 2 runs, 4 broadcasts */
#define TILE_NP 2

/* MR rows (1-TILE_MR) from xq/xd/xs x NP panels (1-2) from p; y at (row 0, panel p's
 * column 0) */
static inline __attribute__((always_inline)) void tile(
    const int MR, const int NP, const int8_t *xq, const float *xd, const float *xs, int K,
    const uint8_t *wq, const float *scales, long p, float *y, long y_stride, int N) {
    const int KB = K / 32;
    __m512 acc[TILE_MR][TILE_NP];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NP; j++) acc[i][j] = _mm512_setzero_ps();
    for (int b = 0; b < KB; b++) {
        __m512i s[TILE_MR][TILE_NP];
        /* unrolled: `r == 0` resolves at compile time (a rolled loop pays a branch and
         * loop counters on the vector ports' cycles) */
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) {
            __m512i w[TILE_NP], x[TILE_MR];
            for (int j = 0; j < NP; j++) {
                w[j] = _mm512_loadu_si512(wq + ((p + j) * KB + b) * (long)PANEL_BLOCK_BYTES + 64 * r);
                /* held in a register for the MR rows: left free, compilers load the run
                 * again for every row (VPDPBUSD's unsigned operand cannot come from
                 * memory), a 64-byte load per instruction */
                __asm__("" : "+v"(w[j]));
            }
            for (int i = 0; i < MR; i++) {
                int32_t four;
                memcpy(&four, xq + (long)i * K + 32L * b + 4 * r, 4);
                x[i] = _mm512_set1_epi32(four);
            }
            for (int i = 0; i < MR; i++)
                for (int j = 0; j < NP; j++) {
                    s[i][j] = _mm512_dpbusd_epi32(r == 0 ? _mm512_setzero_si512() : s[i][j], w[j], x[i]);
                    /* keeps the sum a running register: left free, compilers gather all
                     * the products first and spill them */
                    __asm__("" : "+v"(s[i][j]));
                }
        }
        for (int j = 0; j < NP; j++) {
            const float *sc = scales + ((p + j) * KB + b) * 2L * PANEL_COLS;
            const __m512 dw = _mm512_loadu_ps(sc), mw = _mm512_loadu_ps(sc + PANEL_COLS);
            for (int i = 0; i < MR; i++) {
                const __m512 f = _mm512_cvtepi32_ps(s[i][j]);
                const __m512 dx = _mm512_set1_ps(xd[(long)i * KB + b]);
                const __m512 sx = _mm512_set1_ps(xs[(long)i * KB + b]);
                acc[i][j] = _mm512_fmadd_ps(f, _mm512_mul_ps(dw, dx), acc[i][j]);
                acc[i][j] = _mm512_fmadd_ps(mw, sx, acc[i][j]);
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NP; j++) {
            const long col = (p + j) * PANEL_COLS;
            const long n = N - col < PANEL_COLS ? N - col : PANEL_COLS;
            _mm512_mask_storeu_ps(y + (long)i * y_stride + col, (__mmask16)((1u << n) - 1), acc[i][j]);
        }
}

#else
/* ------------------------------------------------------------------ 256-bit */

/* rows per tile: 4 where AVX-512VL gives 32 vector registers (8 sums, 8 accumulators, the
 * runs and broadcasts fit), 2 with AVX2's 16; one panel (two 8-column halves) */
#if defined(__AVX512VL__)
#define TILE_MR 4
#else
#define TILE_MR 2
#endif
#define TILE_NP 1

/* the 8 lanes of v into y (n valid columns: the last half panel may be partial) */
static inline void store_cols(float *y, __m256 v, long n) {
    if (n >= 8) {
        _mm256_storeu_ps(y, v);
        return;
    }
    if (n <= 0) return;
    float tmp[8];
    _mm256_storeu_ps(tmp, v);
    memcpy(y, tmp, sizeof(float) * (size_t)n);
}

/* MR rows (1-TILE_MR) from xq/xd/xs x panel p (NP = 1); y at (row 0, panel p's column 0) */
static inline __attribute__((always_inline)) void tile(
    const int MR, const int NP, const int8_t *xq, const float *xd, const float *xs, int K,
    const uint8_t *wq, const float *scales, long p, float *y, long y_stride, int N) {
    (void)NP;
    const int KB = K / 32;
#if !defined(INT8_DPBUSD)
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    __m256 acc[TILE_MR][2];
    for (int i = 0; i < MR; i++)
        for (int h = 0; h < 2; h++) acc[i][h] = _mm256_setzero_ps();
    for (int b = 0; b < KB; b++) {
        const uint8_t *wb = wq + (p * KB + b) * (long)PANEL_BLOCK_BYTES;
        __m256i s16[TILE_MR][2]; /* int32 lanes with VPDPBUSD */
#pragma GCC unroll 8 /* as in the 512-bit tile */
        for (int r = 0; r < 8; r++) {
            __m256i w[2], x[TILE_MR];
            for (int h = 0; h < 2; h++) w[h] = _mm256_loadu_si256((const __m256i *)(wb + 64 * r + 32 * h));
            for (int i = 0; i < MR; i++) {
                int32_t four;
                memcpy(&four, xq + (long)i * K + 32L * b + 4 * r, 4);
                x[i] = _mm256_set1_epi32(four);
            }
            for (int i = 0; i < MR; i++)
                for (int h = 0; h < 2; h++) {
#if defined(INT8_DPBUSD)
                    s16[i][h] = INT8_DPBUSD(r == 0 ? _mm256_setzero_si256() : s16[i][h], w[h], x[i]);
#else
                    const __m256i prod = _mm256_maddubs_epi16(w[h], x[i]);
                    s16[i][h] = r == 0 ? prod : _mm256_add_epi16(s16[i][h], prod);
#endif
                    /* keeps the sum a running register: left free, compilers gather all
                     * 32 products first and spill them */
                    __asm__("" : "+x"(s16[i][h]));
                }
        }
        const float *sc = scales + (p * KB + b) * 2L * PANEL_COLS;
        for (int h = 0; h < 2; h++) {
            const __m256 dw = _mm256_loadu_ps(sc + 8 * h), mw = _mm256_loadu_ps(sc + PANEL_COLS + 8 * h);
            for (int i = 0; i < MR; i++) {
#if defined(INT8_DPBUSD)
                const __m256 f = _mm256_cvtepi32_ps(s16[i][h]);
#else
                const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[i][h], ones));
#endif
                const __m256 dx = _mm256_broadcast_ss(xd + (long)i * KB + b);
                const __m256 sx = _mm256_broadcast_ss(xs + (long)i * KB + b);
                acc[i][h] = _mm256_fmadd_ps(f, _mm256_mul_ps(dw, dx), acc[i][h]);
                acc[i][h] = _mm256_fmadd_ps(mw, sx, acc[i][h]);
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int h = 0; h < 2; h++) {
            const long col = p * PANEL_COLS + 8 * h;
            store_cols(y + (long)i * y_stride + col, acc[i][h], N - col);
        }
}
#endif

#define TILE(MR, NP)                                                                       \
    tile(MR, NP, xq + (long)m * K, xd + (long)m * KB, xs + (long)m * KB, K, wq, scales, p, \
         y + (long)m * y_stride, y_stride, N)

/* tiles of rows (TILE_MR, then 2, then 1) x panels (TILE_NP, then 1) over panels [p0, p1) */
static void span_vector(const int8_t *xq, const float *xd, const float *xs, int M, int K,
                        const uint8_t *wq, const float *scales, float *y, long y_stride, int N,
                        long p0, long p1) {
    const int KB = K / 32;
    int m = 0;
    for (; m + TILE_MR <= M; m += TILE_MR) {
        long p = p0;
        for (; p + TILE_NP <= p1; p += TILE_NP) TILE(TILE_MR, TILE_NP);
        for (; p < p1; p++) TILE(TILE_MR, 1);
    }
#if TILE_MR > 2
    for (; m + 2 <= M; m += 2) {
        long p = p0;
        for (; p + TILE_NP <= p1; p += TILE_NP) TILE(2, TILE_NP);
        for (; p < p1; p++) TILE(2, 1);
    }
#endif
    for (; m < M; m++) {
        long p = p0;
        for (; p + TILE_NP <= p1; p += TILE_NP) TILE(1, TILE_NP);
        for (; p < p1; p++) TILE(1, 1);
    }
}
#endif

int int8_panels_vector_bits(void) {
#if defined(PANELS_AVX2) && defined(INT8_DPBUSD512)
    return 512;
#elif defined(PANELS_AVX2)
    return 256;
#else
    return 0;
#endif
}

/* ------------------------------------------------------------------ entry point */

int int8_panels_matmul(const int8_t *xq, const float *xd, const float *xs, int M, int K,
                       const uint8_t *wq, const float *scales, float *y, long y_stride, int N,
                       int weight_bits, int portable) {
    if (M < 0 || N < 0 || K <= 0 || K % 32 != 0 || (weight_bits != 4 && weight_bits != 8))
        return -1;
    if (M == 0 || N == 0) return 0;
#if defined(PANELS_AVX2)
#if !defined(INT8_DPBUSD) && !defined(INT8_DPBUSD512)
    /* 8-bit weights (up to 255) would saturate VPMADDUBSW's int16 pair sums */
    if (weight_bits == 8 && !portable) return -1;
#endif
    if (!portable) {
        const int KB = K / 32;
        const long P = (N + PANEL_COLS - 1) / PANEL_COLS;
        /* a span's weights about 16 KB: L1 while the rows pass; at least one tile wide */
        long span = 16384 / ((long)PANEL_BLOCK_BYTES * KB);
        span = span < TILE_NP ? TILE_NP : span - span % TILE_NP;
        const long spans = (P + span - 1) / span;
#pragma omp parallel for schedule(dynamic, 1)
        for (long s = 0; s < spans; s++) {
            const long p0 = s * span, p1 = p0 + span < P ? p0 + span : P;
            span_vector(xq, xd, xs, M, K, wq, scales, y, y_stride, N, p0, p1);
        }
        return 0;
    }
#endif
    (void)portable;
    panels_c(xq, xd, xs, M, K, wq, scales, y, y_stride, N);
    return 0;
}

void int8_qwork_parts(void *qwork, int M, int K, int8_t **xq, float **xd, float **xs) {
    *xq = (int8_t *)qwork;
    *xd = (float *)(*xq + (((long)M * K + 63) & ~63L));
    *xs = *xd + (long)M * (K / 32);
}

/* y = x W^T for float32 rows x [M, K] (row stride x_stride) on Q4 panels: x quantized per
 * 32-block into qwork (xq int8 [M, K], padded to 64 bytes, then xd and xs float32 [M,
 * K/32]), then the panels' matmul: the per-op path's int8_panels_linear, call for call
 * (the float32 matmuls of decode_step.c and hybrid_step.c). Sizes checked by the callers. */
void int8_panels_linear_q4_f32(const float *x, long x_stride, const uint8_t *wq,
                               const float *scales, float *y, long y_stride, int M, int N, int K,
                               void *qwork) {
    int8_t *xq;
    float *xd, *xsum;
    int8_qwork_parts(qwork, M, K, &xq, &xd, &xsum);
    int8_quantize_rows(x, x_stride, M, K, xq, xd, xsum, 0);
    int8_panels_matmul(xq, xd, xsum, M, K, wq, scales, y, y_stride, N, 4, 0);
}
