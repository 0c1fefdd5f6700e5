/* Matrix-vector products over block-quantized weights, for float32 and bf16 activations:
 * the weights a GGUF checkpoint stores in Q4_0, Q4_1 or Q8_0 (32 weights per block, a
 * float16 scale, Q4_1 also a float16 minimum), read as stored and dequantized in
 * registers.
 *
 * A model loaded from such a file holds exactly the dequantized values (gguf's dequantize:
 * d * q + m with d * q exact in float32, one rounding for the add, which is what one fma
 * gives; a bf16 model holds them rounded to bf16). These kernels rebuild those same
 * values in registers and sum them in gemv_f32's / gemv_bf16's order (cpu_ops.c: one
 * vector partial per row, two chains at one row, the same hsum16), so the result is
 * bitwise the plain kernel's on the dequantized matrix, while the bytes streamed per step
 * drop from 4 (float32) or 2 (bf16) per weight to 0.75 (Q4) or 1.125 (Q8). Decode of a
 * few sequences is bound by streaming the weights: this is the whole gain. Past
 * GEMV_MAX_ROWS rows the rows are taken in groups of that many per weight tile. AVX2
 * builds without AVX-512 take the float32 kernels from gemv_avx2.c.
 *
 * Layouts (made by sarazmq.kernels.block_quant from the GGUF blocks):
 *   Q4: qs uint8 [N, K/2], per row and block the GGUF's 16 bytes (byte j: low nibble
 *       weight j, high nibble weight j + 16); dm float32 [N, K/32, 2] = (d, m) per block
 *       (Q4_0: m = -8 d, exact). weight = fma(d, q, m).
 *   Q8: qs int8 [N, K]; d float32 [N, K/32]. weight = d * q (exact).
 * x: [M, K] row stride x_stride; y: [M, N] row stride y_stride; K a multiple of 32.
 * Returns 0, or -1 (nothing written) when this build or these sizes are not covered. */
#include "common.h"
#include "kernels.h"

#if !defined(AVX2_ONLY) /* AVX2 builds: gemv_avx2.c's float32 kernels and covers */
int gemv_q_f32_covers(int M, int N, int K) {
#if defined(__AVX512F__)
    return M >= 1 && M <= QGEMV_MAX_ROWS && N >= 1 && K >= 32 && K % 32 == 0;
#else
    (void)M; (void)N; (void)K;
    return 0;
#endif
}
#endif

#if defined(__AVX512F__)

/* The 32 weights of one block as two vectors (weights 0-15, 16-31). */
static inline __attribute__((always_inline)) void q4_block(const uint8_t *qs, const float *dm,
                                                           __m512 *lo, __m512 *hi) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    /* the 16 possible values of this block; vpermps reads the low 4 bits of each index */
    const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(dm[0]), _mm512_set1_ps(dm[1]));
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    *lo = _mm512_permutexvar_ps(idx, table);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);
}

static inline __attribute__((always_inline)) void q8_block(const int8_t *qs, const float *d,
                                                           __m512 *lo, __m512 *hi) {
    const __m512 s = _mm512_set1_ps(d[0]);
    *lo = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs))), s);
    *hi = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16)))),
        s);
}

/* One tile of 16 output rows, as gemv_f32's tile: per output row a vector partial per input
 * row (at M = 1 a second chain takes the odd 16-weight pieces), then hsum16. BLOCK(r, b,
 * lo, hi) yields block b of weight row r. */
#define DEFINE_QGEMV_TILE(NAME, BLOCK)                                                         \
    static inline __attribute__((always_inline)) void NAME(                                    \
        const int M, const float *x, long x_stride, const void *qs, const float *sc,           \
        float *y, long y_stride, int n0, int nn, int K) {                                      \
        const int KB = K / 32;                                                                 \
        __m512 acc[GEMV_MAX_ROWS][16];                                                         \
        for (int i = 0; i < 16; i += 2) { /* two output rows side by side, each in order */    \
            __m512 a[2][GEMV_MAX_ROWS], b[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};    \
            for (int m = 0; m < M; m++) a[0][m] = a[1][m] = _mm512_setzero_ps();               \
            if (i < nn) {                                                                      \
                const int rows = i + 1 < nn ? 2 : 1;                                           \
                for (int kb = 0; kb < KB; kb++) {                                              \
                    for (int j = 0; j < rows; j++) {                                           \
                        __m512 lo, hi;                                                         \
                        BLOCK(n0 + i + j, kb, &lo, &hi);                                       \
                        if (M == 1) {                                                          \
                            a[j][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + 32 * kb), lo, a[j][0]); \
                            b[j] = _mm512_fmadd_ps(_mm512_loadu_ps(x + 32 * kb + 16), hi, b[j]); \
                        } else {                                                               \
                            for (int m = 0; m < M; m++)                                        \
                                a[j][m] = _mm512_fmadd_ps(                                     \
                                    _mm512_loadu_ps(x + m * x_stride + 32 * kb), lo, a[j][m]); \
                            for (int m = 0; m < M; m++)                                        \
                                a[j][m] = _mm512_fmadd_ps(                                     \
                                    _mm512_loadu_ps(x + m * x_stride + 32 * kb + 16), hi,      \
                                    a[j][m]);                                                  \
                        }                                                                      \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
            for (int j = 0; j < 2; j++) {                                                      \
                acc[0][i + j] = _mm512_add_ps(a[j][0], b[j]);                                  \
                for (int m = 1; m < M; m++) acc[m][i + j] = a[j][m];                           \
            }                                                                                  \
        }                                                                                      \
        for (int m = 0; m < M; m++)                                                            \
            _mm512_mask_storeu_ps(y + (long)m * y_stride + n0, (__mmask16)((1u << nn) - 1u),   \
                                  hsum16(acc[m]));                                             \
    }

#define Q4_AT(r, kb, lo, hi)                                                                   \
    q4_block((const uint8_t *)qs + (r) * (K / 2) + 16L * (kb), sc + ((r) * KB + (kb)) * 2, lo, \
             hi)
#define Q8_AT(r, kb, lo, hi)                                                                   \
    q8_block((const int8_t *)qs + (r) * K + 32L * (kb), sc + (r) * KB + (kb), lo, hi)
DEFINE_QGEMV_TILE(q4_tile, Q4_AT)
DEFINE_QGEMV_TILE(q8_tile, Q8_AT)

#if defined(__AVX512BF16__)
/* bf16: a bf16 model holds the dequantized weights rounded to bf16 (to nearest even), which
 * cvtne2ps gives from the float32 values; each block's 32 weights are then one VDPBF16PS
 * operand, as one 32-element piece of gemv_bf16 (two chains at one row, tail on the
 * first), and the result is rounded to bf16 as there. */
static inline __attribute__((always_inline)) __m512bh bf16_pair(__m512 lo, __m512 hi) {
    return _mm512_cvtne2ps_pbh(hi, lo); /* elements 0-15 from lo, 16-31 from hi */
}
static inline __attribute__((always_inline)) __m512bh q4_block_bf16(const uint8_t *qs,
                                                                   const float *dm) {
    __m512 lo, hi;
    q4_block(qs, dm, &lo, &hi);
    return bf16_pair(lo, hi);
}
static inline __attribute__((always_inline)) __m512bh q8_block_bf16(const int8_t *qs,
                                                                   const float *d) {
    __m512 lo, hi;
    q8_block(qs, d, &lo, &hi);
    return bf16_pair(lo, hi);
}

/* At M = 1 two output rows are summed side by side (four dependency chains, not two:
 * VDPBF16PS's latency, not its throughput, bounded the one-row loop); each row's sums run
 * in the same order as alone, so the results do not change. */
#define DEFINE_QGEMV_TILE_BF16(NAME, BLOCK)                                                    \
    static inline __attribute__((always_inline)) void NAME(                                    \
        const int M, const uint16_t *x, long x_stride, const void *qs, const float *sc,        \
        uint16_t *y, long y_stride, int n0, int nn, int K) {                                   \
        const int KB = K / 32;                                                                 \
        __m512 acc[GEMV_MAX_ROWS][16];                                                         \
        if (M == 1) {                                                                          \
            for (int i = 0; i < 16; i += 2) {                                                  \
                __m512 a0 = _mm512_setzero_ps(), b0 = a0, a1 = a0, b1 = a0;                    \
                if (i < nn) {                                                                  \
                    const long r = n0 + i;                                                     \
                    const int two = i + 1 < nn;                                                \
                    int kb = 0;                                                                \
                    for (; kb + 1 < KB; kb += 2) {                                             \
                        const __m512bh x0 = (__m512bh)_mm512_loadu_si512(x + 32 * kb);        \
                        const __m512bh x1 = (__m512bh)_mm512_loadu_si512(x + 32 * kb + 32);   \
                        a0 = _mm512_dpbf16_ps(a0, x0, BLOCK(r, kb));                           \
                        b0 = _mm512_dpbf16_ps(b0, x1, BLOCK(r, kb + 1));                       \
                        if (two) {                                                             \
                            a1 = _mm512_dpbf16_ps(a1, x0, BLOCK(r + 1, kb));                   \
                            b1 = _mm512_dpbf16_ps(b1, x1, BLOCK(r + 1, kb + 1));               \
                        }                                                                      \
                    }                                                                          \
                    for (; kb < KB; kb++) {                                                    \
                        const __m512bh x0 = (__m512bh)_mm512_loadu_si512(x + 32 * kb);        \
                        a0 = _mm512_dpbf16_ps(a0, x0, BLOCK(r, kb));                           \
                        if (two) a1 = _mm512_dpbf16_ps(a1, x0, BLOCK(r + 1, kb));              \
                    }                                                                          \
                }                                                                              \
                acc[0][i] = _mm512_add_ps(a0, b0);                                             \
                acc[0][i + 1] = _mm512_add_ps(a1, b1);                                         \
            }                                                                                  \
        } else { /* two output rows side by side here too (2 M chains) */                   \
            for (int i = 0; i < 16; i += 2) {                                                  \
                __m512 a[2][GEMV_MAX_ROWS];                                                    \
                for (int m = 0; m < M; m++) a[0][m] = a[1][m] = _mm512_setzero_ps();           \
                if (i < nn) {                                                                  \
                    const long r = n0 + i;                                                     \
                    const int two = i + 1 < nn;                                                \
                    for (int kb = 0; kb < KB; kb++) {                                          \
                        const __m512bh w0 = BLOCK(r, kb);                                      \
                        for (int m = 0; m < M; m++)                                            \
                            a[0][m] = _mm512_dpbf16_ps(                                        \
                                a[0][m],                                                       \
                                (__m512bh)_mm512_loadu_si512(x + m * x_stride + 32 * kb), w0); \
                        if (two) {                                                             \
                            const __m512bh w1 = BLOCK(r + 1, kb);                              \
                            for (int m = 0; m < M; m++)                                        \
                                a[1][m] = _mm512_dpbf16_ps(                                    \
                                    a[1][m],                                                   \
                                    (__m512bh)_mm512_loadu_si512(x + m * x_stride + 32 * kb),  \
                                    w1);                                                       \
                        }                                                                      \
                    }                                                                          \
                }                                                                              \
                for (int j = 0; j < 2; j++) { /* + 0 as the plain kernel */                    \
                    acc[0][i + j] = _mm512_add_ps(a[j][0], _mm512_setzero_ps());               \
                    for (int m = 1; m < M; m++) acc[m][i + j] = a[j][m];                       \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int m = 0; m < M; m++)                                                            \
            _mm256_mask_storeu_epi16(y + (long)m * y_stride + n0, (__mmask16)((1u << nn) - 1u),\
                                     (__m256i)_mm512_cvtneps_pbh(hsum16(acc[m])));             \
    }

#define Q4_BF16_AT(r, kb)                                                                      \
    q4_block_bf16((const uint8_t *)qs + (r) * (K / 2) + 16L * (kb), sc + ((r) * KB + (kb)) * 2)
#define Q8_BF16_AT(r, kb)                                                                      \
    q8_block_bf16((const int8_t *)qs + (r) * K + 32L * (kb), sc + (r) * KB + (kb))
DEFINE_QGEMV_TILE_BF16(q4_tile_bf16, Q4_BF16_AT)
DEFINE_QGEMV_TILE_BF16(q8_tile_bf16, Q8_BF16_AT)
#define HAVE_QGEMV_BF16 1
#endif

/* Past GEMV_MAX_ROWS rows the tile is run again for each further group of rows: its weight
 * blocks then come from L1 (a row's result depends only on its group's size). */
#define DEFINE_QGEMV(NAME, T, TILE)                                                            \
    int NAME(const T *x, long x_stride, const void *qs, const float *scales, T *y,             \
             long y_stride, int M, int N, int K) {                                             \
        if (!gemv_q_f32_covers(M, N, K)) return -1;                                            \
        const long tiles = (N + 15) / 16;                                                      \
        _Pragma("omp parallel for schedule(static)")                                           \
        for (long tile = 0; tile < tiles; tile++) {                                            \
            const int n0 = (int)tile * 16, nn = N - n0 < 16 ? N - n0 : 16;                     \
            for (int r0 = 0; r0 < M; r0 += GEMV_MAX_ROWS) {                                    \
                const int g = M - r0 < GEMV_MAX_ROWS ? M - r0 : GEMV_MAX_ROWS;                 \
                const T *xg = x + (long)r0 * x_stride;                                         \
                T *yg = y + (long)r0 * y_stride;                                               \
                switch (g) {                                                                   \
                case 1: TILE(1, xg, x_stride, qs, scales, yg, y_stride, n0, nn, K); break;     \
                case 2: TILE(2, xg, x_stride, qs, scales, yg, y_stride, n0, nn, K); break;     \
                case 3: TILE(3, xg, x_stride, qs, scales, yg, y_stride, n0, nn, K); break;     \
                case 4: TILE(4, xg, x_stride, qs, scales, yg, y_stride, n0, nn, K); break;     \
                case 5: TILE(5, xg, x_stride, qs, scales, yg, y_stride, n0, nn, K); break;     \
                case 6: TILE(6, xg, x_stride, qs, scales, yg, y_stride, n0, nn, K); break;     \
                case 7: TILE(7, xg, x_stride, qs, scales, yg, y_stride, n0, nn, K); break;     \
                default: TILE(8, xg, x_stride, qs, scales, yg, y_stride, n0, nn, K); break;    \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        return 0;                                                                              \
    }

DEFINE_QGEMV(gemv_q4_f32, float, q4_tile)
DEFINE_QGEMV(gemv_q8_f32, float, q8_tile)
#ifdef HAVE_QGEMV_BF16
DEFINE_QGEMV(gemv_q4_bf16, uint16_t, q4_tile_bf16)
DEFINE_QGEMV(gemv_q8_bf16, uint16_t, q8_tile_bf16)
#endif

#endif

/* builds without the instructions: -1 (nothing written), the caller keeps plain weights */
#define QGEMV_STUB(NAME, T)                                                                    \
    int NAME(const T *x, long x_stride, const void *qs, const float *scales, T *y,             \
             long y_stride, int M, int N, int K) {                                             \
        (void)x; (void)x_stride; (void)qs; (void)scales; (void)y; (void)y_stride;             \
        (void)M; (void)N; (void)K;                                                             \
        return -1;                                                                             \
    }
#if !defined(__AVX512F__) && !defined(AVX2_ONLY)
QGEMV_STUB(gemv_q4_f32, float)
QGEMV_STUB(gemv_q8_f32, float)
#endif
#ifndef HAVE_QGEMV_BF16
QGEMV_STUB(gemv_q4_bf16, uint16_t)
QGEMV_STUB(gemv_q8_bf16, uint16_t)
#endif

int gemv_q_bf16_covers(int M, int N, int K) {
#ifdef HAVE_QGEMV_BF16
    return gemv_q_f32_covers(M, N, K);
#else
    (void)M; (void)N; (void)K;
    return 0;
#endif
}
