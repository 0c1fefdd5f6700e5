/* Integer-dot matmuls on GGUF block-quantized weights (llama.cpp's Q4_0/Q4_1/Q8_0 x Q8_1
 * plan): float32 activations are quantized per 32-block to int8 (d = max|x| / 127,
 * q = round-half-even(x * 127 / max|x|), s = d * sum(q)), then each output is
 *   y[m][n] = sum_b dw[n][b] * dx[m][b] * dot(qw[n][b], qx[m][b])   (int32, exact)
 *           + mw[n][b] * s[m][b]                                     (Q4 weights only)
 * with Q4 weights stored as weight = d * q + m, q unsigned 0..15, Q8 as weight = d * q.
 * Not bitwise the float32 path (block_quant.c): the activations lose their low bits
 * (llama.cpp's precision).
 *
 * Layouts: block_quant.c's (qs uint8 [N, K/2] + scales float32 [N, K/32, 2] for Q4; qs
 * int8 [N, K] + scales float32 [N, K/32] for Q8), untouched. Activations: xq int8 [M, K]
 * contiguous, xd and xs float32 [M, K/32] contiguous.
 *
 * AVX2: a weight block is unpacked once per tile of MR rows x NR columns; per block and
 * (row, column) pair one VPMADDUBSW (unsigned weight nibbles times signed activations; Q8
 * weights by llama.cpp's sign trick: |w| times sign(w) * x), one VPMADDWD by ones (int32
 * pair sums), a conversion and an fma by dw * dx into an 8-lane float accumulator. The Q4
 * minimum term runs with 8 blocks per vector (lane = block) into the same accumulators.
 * OpenMP over panels of INT8_PANEL output columns; within a panel the rows go by MR, the
 * x tile staying in L1 while the panel's weights come from L2.
 *
 * `portable` = 1 runs the plain C loops (any build). Returns 0, or -1 (nothing written)
 * for sizes or kinds not covered (K not a positive multiple of 32, kind not 4 or 8). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define INT8_DOT_AVX2 1
#endif

#define INT8_PANEL 32 /* output columns per OpenMP work item */

/* ------------------------------------------------------------------ portable C */

static void matmul_c(int kind, const int8_t *xq, const float *xd, const float *xs, int M,
                     int K, const void *qs, const float *sc, float *y, long y_stride, int N) {
    const int KB = K / 32;
#pragma omp parallel for schedule(static)
    for (long n = 0; n < N; n++) {
        for (int m = 0; m < M; m++) {
            float acc = 0.0f;
            for (int b = 0; b < KB; b++) {
                const int8_t *xb = xq + (long)m * K + 32L * b;
                int32_t dot = 0;
                float dw, mw = 0.0f;
                if (kind == 4) {
                    const uint8_t *wb = (const uint8_t *)qs + n * (K / 2) + 16L * b;
                    for (int j = 0; j < 16; j++)
                        dot += (int32_t)(wb[j] & 15) * xb[j] + (int32_t)(wb[j] >> 4) * xb[j + 16];
                    dw = sc[(n * KB + b) * 2];
                    mw = sc[(n * KB + b) * 2 + 1];
                } else {
                    const int8_t *wb = (const int8_t *)qs + n * K + 32L * b;
                    for (int j = 0; j < 32; j++) dot += (int32_t)wb[j] * xb[j];
                    dw = sc[n * KB + b];
                }
                acc = fmaf((float)dot, dw * xd[(long)m * KB + b], acc);
                if (kind == 4) acc = fmaf(mw, xs[(long)m * KB + b], acc);
            }
            y[(long)m * y_stride + n] = acc;
        }
    }
}

/* ------------------------------------------------------------------ AVX2 */

#if defined(INT8_DOT_AVX2)
static inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
}

/* a Q4 block's 16 bytes as 32 unsigned bytes 0..15 (weights 0-15 low lane, 16-31 high) */
static inline __attribute__((always_inline)) __m256i q4_unpack(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(b),
                                                 _mm_srli_epi16(b, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(15));
}

/* MR rows (xq, xd, xs at the tile's first row) x NR columns from n; y at the first row */
static inline __attribute__((always_inline)) void tile_avx2(
    const int KIND, const int MR, const int NR, const int8_t *xq, const float *xd,
    const float *xs, int K, const void *qs, const float *sc, long n, float *y, long y_stride) {
    const int KB = K / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4][4];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();
    if (KIND == 4) { /* sum_b mw * s, 8 blocks a vector */
        for (int b = 0; b < KB; b += 8) {
            const int rem = KB - b < 8 ? KB - b : 8;
            const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(rem), idx);
            const __m256i keep2lo = _mm256_cmpgt_epi32(_mm256_set1_epi32(2 * rem), idx);
            const __m256i keep2hi =
                _mm256_cmpgt_epi32(_mm256_set1_epi32(2 * rem - 8), idx);
            __m256 mw[4];
            for (int j = 0; j < NR; j++) {
                const float *p = sc + ((n + j) * KB + b) * 2;
                const __m256 a = _mm256_maskload_ps(p, keep2lo);
                const __m256 c = _mm256_maskload_ps(p + 8, keep2hi);
                /* m0 m1 m4 m5 | m2 m3 m6 m7 -> m0..m7 */
                mw[j] = _mm256_castpd_ps(
                    _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, c, 0xDD)), 0xD8));
            }
            for (int i = 0; i < MR; i++) {
                const __m256 sv = _mm256_maskload_ps(xs + (long)i * KB + b, keep);
                for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(mw[j], sv, acc[i][j]);
            }
        }
    }
    for (int b = 0; b < KB; b++) {
        __m256i w[4], wa[4];
        __m256 dw[4];
        for (int j = 0; j < NR; j++) {
            if (KIND == 4) {
                w[j] = q4_unpack((const uint8_t *)qs + (n + j) * (K / 2) + 16L * b);
                dw[j] = _mm256_broadcast_ss(sc + ((n + j) * KB + b) * 2);
            } else {
                w[j] = _mm256_loadu_si256((const __m256i *)((const int8_t *)qs + (n + j) * K +
                                                            32L * b));
                wa[j] = _mm256_sign_epi8(w[j], w[j]);
                dw[j] = _mm256_broadcast_ss(sc + (n + j) * KB + b);
            }
        }
        for (int i = 0; i < MR; i++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (long)i * K + 32L * b));
            const __m256 dx = _mm256_broadcast_ss(xd + (long)i * KB + b);
            for (int j = 0; j < NR; j++) {
                const __m256i p = KIND == 4 ? _mm256_maddubs_epi16(w[j], xv)
                                            : _mm256_maddubs_epi16(wa[j], _mm256_sign_epi8(xv, w[j]));
                const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
                acc[i][j] = _mm256_fmadd_ps(f, _mm256_mul_ps(dw[j], dx), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) y[(long)i * y_stride + n + j] = hsum8(acc[i][j]);
}

#define TILE_ROWS(KIND, MR, NR)                                                                \
    tile_avx2(KIND, MR, NR, xq + (long)m * K, xd + (long)m * KB, xs + (long)m * KB, K, qs, sc, \
              n, y + (long)m * y_stride, y_stride)

/* one panel's columns [n0, n1) for every row */
static inline __attribute__((always_inline)) void panel_avx2(
    const int KIND, const int8_t *xq, const float *xd, const float *xs, int M, int K,
    const void *qs, const float *sc, float *y, long y_stride, long n0, long n1) {
    const int KB = K / 32;
    int m = 0;
    for (; m + 4 <= M; m += 4) {
        long n = n0;
        for (; n + 2 <= n1; n += 2) TILE_ROWS(KIND, 4, 2);
        for (; n < n1; n++) TILE_ROWS(KIND, 4, 1);
    }
    const int rest = M - m;
    long n = n0;
    if (rest == 3) {
        for (; n + 2 <= n1; n += 2) TILE_ROWS(KIND, 3, 2);
        for (; n < n1; n++) TILE_ROWS(KIND, 3, 1);
    } else if (rest == 2) {
        for (; n + 3 <= n1; n += 3) TILE_ROWS(KIND, 2, 3);
        for (; n < n1; n++) TILE_ROWS(KIND, 2, 1);
    } else if (rest == 1) {
        for (; n + 4 <= n1; n += 4) TILE_ROWS(KIND, 1, 4);
        for (; n < n1; n++) TILE_ROWS(KIND, 1, 1);
    }
}
#endif

/* ------------------------------------------------------------------ entry points */

int int8_dot_avx2_built(void) {
#if defined(INT8_DOT_AVX2)
    return 1;
#else
    return 0;
#endif
}

int int8_dot_vnni_built(void) {
#if defined(INT8_DOT_AVX2) && defined(INT8_DPBUSD)
    return 1;
#else
    return 0;
#endif
}

int int8_block_matmul(int kind, const int8_t *xq, const float *xd, const float *xs, int M,
                      int K, const void *qs, const float *scales, float *y, long y_stride,
                      int N, int portable) {
    if ((kind != 4 && kind != 8) || M < 0 || N < 0 || K <= 0 || K % 32 != 0) return -1;
    if (M == 0 || N == 0) return 0;
#if defined(INT8_DOT_AVX2)
    if (!portable) {
        const long panels = (N + INT8_PANEL - 1) / INT8_PANEL;
#pragma omp parallel for schedule(static)
        for (long p = 0; p < panels; p++) {
            const long n0 = p * INT8_PANEL, n1 = n0 + INT8_PANEL < N ? n0 + INT8_PANEL : N;
            if (kind == 4)
                panel_avx2(4, xq, xd, xs, M, K, qs, scales, y, y_stride, n0, n1);
            else
                panel_avx2(8, xq, xd, xs, M, K, qs, scales, y, y_stride, n0, n1);
        }
        return 0;
    }
#endif
    matmul_c(kind, xq, xd, xs, M, K, qs, scales, y, y_stride, N);
    return 0;
}

/* Peak probes for scripts/bench_int8_dot.py and bench_engine.py --int8: `iters` rounds of
 * independent accumulator chains per thread (OpenMP). int8 = 1: 8 VPMADDUBSW a round, 32
 * int8 MACs each, summed in int16 by VPADDW (int8_panels.c's inner loop, the fastest AVX2
 * int8 dot-accumulate: the two together are the limit), or chains of VPDPBUSD where
 * the build has it, on the panels' vector width (16 of 512-bit ones, 64 MACs each, where
 * INT8_DPBUSD512; else 10 of INT8_DPBUSD's 256-bit ones); int8 = 0: 10 chains of
 * VFMADD231PS (8 float32 MACs each). Returns the MACs done (all threads); the caller times
 * the call. 0 in builds without AVX2. */
#if defined(INT8_DOT_AVX2)
#define PROBE_BAR(v) __asm__ volatile("" : "+x"(v)) /* opaque: nothing hoisted */
#define PROBE_CHAINS 10
#if defined(INT8_DPBUSD512)
#define PROBE_INT8_MACS 64
#define PROBE_INT8_CHAINS 16 /* latency x issue rate, with slack for the loop barrier */
static __attribute__((noinline)) int probe_int8(long iters, int seed) {
    const __m512i w = _mm512_set1_epi8(7);
    __m512i x = _mm512_set1_epi8((char)seed);
    __m512i a[PROBE_INT8_CHAINS];
    for (int c = 0; c < PROBE_INT8_CHAINS; c++) a[c] = _mm512_setzero_si512();
    for (long it = 0; it < iters; it++) {
        __asm__ volatile("" : "+v"(x));
        for (int c = 0; c < PROBE_INT8_CHAINS; c++) a[c] = _mm512_dpbusd_epi32(a[c], w, x);
    }
    for (int c = 1; c < PROBE_INT8_CHAINS; c++) a[0] = _mm512_add_epi32(a[0], a[c]);
    return _mm512_reduce_add_epi32(a[0]);
}
#else
#define PROBE_INT8_MACS 32
#if defined(INT8_DPBUSD)
#define PROBE_INT8_CHAINS PROBE_CHAINS
static __attribute__((noinline)) int probe_int8(long iters, int seed) {
    const __m256i w = _mm256_set1_epi8(7);
    __m256i x = _mm256_set1_epi8((char)seed);
    __m256i a[PROBE_CHAINS];
    for (int c = 0; c < PROBE_CHAINS; c++) a[c] = _mm256_setzero_si256();
    /* PROBE_CHAINS independent chains: VPDPBUSD's latency (~5 cycles) times its throughput
     * (2 a cycle) needs 10 in flight */
    for (long it = 0; it < iters; it++) {
        PROBE_BAR(x);
        for (int c = 0; c < PROBE_CHAINS; c++) a[c] = INT8_DPBUSD(a[c], w, x);
    }
    for (int c = 1; c < PROBE_CHAINS; c++) a[0] = _mm256_add_epi32(a[0], a[c]);
    return _mm256_extract_epi32(a[0], 0);
}
#else
#define PROBE_INT8_CHAINS 8
/* 8 VPMADDUBSW a round of distinct (weight, activation) pairs, each added into its own
 * int16 sum (only the 1-cycle VPADDW chains depend on the sums); the activations opaque
 * every round. One pair for all chains (before 2026-12-07) let the compiler compute the
 * product once a round: the probe timed VPADDW and spills (tests/test_int8_probe_codegen.py). */
static __attribute__((noinline)) int probe_int8(long iters, int seed) {
    const __m256i w0 = _mm256_set1_epi8(7), w1 = _mm256_set1_epi8(5);
    __m256i x0 = _mm256_set1_epi8((char)seed), x1 = _mm256_set1_epi8((char)(seed + 1)),
            x2 = _mm256_set1_epi8((char)(seed + 2)), x3 = _mm256_set1_epi8((char)(seed + 3));
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0,
            a6 = a0, a7 = a0;
    for (long it = 0; it < iters; it++) {
        PROBE_BAR(x0);
        PROBE_BAR(x1);
        PROBE_BAR(x2);
        PROBE_BAR(x3);
        a0 = _mm256_add_epi16(a0, _mm256_maddubs_epi16(w0, x0));
        a1 = _mm256_add_epi16(a1, _mm256_maddubs_epi16(w1, x0));
        a2 = _mm256_add_epi16(a2, _mm256_maddubs_epi16(w0, x1));
        a3 = _mm256_add_epi16(a3, _mm256_maddubs_epi16(w1, x1));
        a4 = _mm256_add_epi16(a4, _mm256_maddubs_epi16(w0, x2));
        a5 = _mm256_add_epi16(a5, _mm256_maddubs_epi16(w1, x2));
        a6 = _mm256_add_epi16(a6, _mm256_maddubs_epi16(w0, x3));
        a7 = _mm256_add_epi16(a7, _mm256_maddubs_epi16(w1, x3));
        /* the sums stay in registers (left free, GCC kept some on the stack) */
        __asm__("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6),
                "+x"(a7));
    }
    a0 = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(a0, a1), _mm256_add_epi16(a2, a3)),
                          _mm256_add_epi16(_mm256_add_epi16(a4, a5), _mm256_add_epi16(a6, a7)));
    return _mm256_extract_epi16(a0, 0);
}
#endif
#endif

static __attribute__((noinline)) int probe_f32(long iters, int seed) {
    const __m256 m = _mm256_set1_ps(1.0000001f), c = _mm256_set1_ps(1e-7f);
    __m256 a0 = _mm256_set1_ps((float)seed), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0,
           a6 = a0, a7 = a0, a8 = a0, a9 = a0;
    for (long it = 0; it < iters; it++) {
        a0 = _mm256_fmadd_ps(a0, m, c); a1 = _mm256_fmadd_ps(a1, m, c);
        a2 = _mm256_fmadd_ps(a2, m, c); a3 = _mm256_fmadd_ps(a3, m, c);
        a4 = _mm256_fmadd_ps(a4, m, c); a5 = _mm256_fmadd_ps(a5, m, c);
        a6 = _mm256_fmadd_ps(a6, m, c); a7 = _mm256_fmadd_ps(a7, m, c);
        a8 = _mm256_fmadd_ps(a8, m, c); a9 = _mm256_fmadd_ps(a9, m, c);
    }
    a0 = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                       _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    return (int)_mm256_cvtss_f32(_mm256_add_ps(a0, _mm256_add_ps(a8, a9)));
}
#endif

long int8_peak_probe(long iters, int int8) {
    long macs = 0;
#if defined(INT8_DOT_AVX2)
    volatile int sink = 0;
#pragma omp parallel reduction(+ : macs)
    {
        if (int8) {
            sink = probe_int8(iters, 1);
            macs += iters * PROBE_INT8_CHAINS * PROBE_INT8_MACS;
        } else {
            sink = probe_f32(iters, 1);
            macs += iters * 10 * 8;
        }
    }
    (void)sink;
#else
    (void)iters;
    (void)int8;
#endif
    return macs;
}
