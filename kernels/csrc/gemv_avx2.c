/* float32 matrix-vector products for CPUs with AVX2 and FMA but no AVX-512: gemv_f32 on
 * plain weights and gemv_q4_f32 / gemv_q8_f32 on GGUF blocks, the AVX-512 kernels'
 * (cpu_ops.c, block_quant.c) plan on 8 lanes. Those files take their stubs out of such
 * builds; the contracts (layouts, return codes, covers) are theirs.
 *
 * Tiles of 8 output rows: per output row and input row one 8-lane partial over K, in order
 * (at one input row two chains, even and odd 8-weight pieces, summed at the end), then the
 * tile's 8 partials summed across lanes at once (hsum8x8). A Q4 block is rebuilt as
 * fma(d, q, m), a Q8 block as d * q: the values the model holds dequantized, summed in the
 * plain kernel's order, so the block kernels are bitwise gemv_f32 on the dequantized
 * matrix while streaming 0.75 or 1.125 bytes per weight instead of 4.
 *
 * Registers (16 on AVX2), plain kernel: up to 4 input rows, two output rows side by side
 * (2M partials); from 5 rows one output row at a time (M partials). Block kernels: up to
 * 4 rows one output row at a time, each block dequantized in registers; past that a tile
 * dequantized once into an L1 buffer (below). Which is used does not change a result:
 * each partial sums its own pieces in order either way. */
#include "common.h"
#include "kernels.h"

#if defined(AVX2_ONLY)

int gemv_f32_covers(int M, int N, int K) {
    return M >= 1 && M <= GEMV_MAX_ROWS && N >= 1 && K >= 8 && K % 8 == 0;
}

int gemv_q_f32_covers(int M, int N, int K) {
    return M >= 1 && M <= QGEMV_MAX_ROWS && N >= 1 && K >= 32 && K % 32 == 0;
}

/* y[m][n0 .. n0 + nn) from the tile's partials acc[m][0..7] */
static inline __attribute__((always_inline)) void store_tile(const int M, __m256 acc[][8],
                                                             float *y, long y_stride, int n0,
                                                             int nn) {
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(nn),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int m = 0; m < M; m++)
        _mm256_maskstore_ps(y + (long)m * y_stride + n0, keep, hsum8x8(acc[m]));
}

/* --- plain weights: w [N, K] row-major */

/* R output rows (1 or 2; at one input row up to 4) from row r of w into
 * acc[m][i .. i + R) */
static inline __attribute__((always_inline)) void plain_rows(const int M, const int R,
                                                             const float *x, long x_stride,
                                                             const float *w, int K,
                                                             __m256 acc[][8], int i) {
    const int KV = K / 8;
    if (M == 1) {
        __m256 a[4], b[4];
        for (int j = 0; j < R; j++) a[j] = b[j] = _mm256_setzero_ps();
        int kv = 0;
        for (; kv + 1 < KV; kv += 2) {
            const __m256 x0 = _mm256_loadu_ps(x + 8 * kv), x1 = _mm256_loadu_ps(x + 8 * kv + 8);
            for (int j = 0; j < R; j++) {
                a[j] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(w + (long)j * K + 8 * kv), a[j]);
                b[j] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(w + (long)j * K + 8 * kv + 8), b[j]);
            }
        }
        for (; kv < KV; kv++)
            for (int j = 0; j < R; j++)
                a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8 * kv),
                                       _mm256_loadu_ps(w + (long)j * K + 8 * kv), a[j]);
        for (int j = 0; j < R; j++) acc[0][i + j] = _mm256_add_ps(a[j], b[j]);
        return;
    }
    __m256 a[2][4];
    for (int j = 0; j < R; j++)
        for (int m = 0; m < M; m++) a[j][m] = _mm256_setzero_ps();
    for (int kv = 0; kv < KV; kv++)
        for (int j = 0; j < R; j++) {
            const __m256 wv = _mm256_loadu_ps(w + (long)j * K + 8 * kv);
            for (int m = 0; m < M; m++)
                a[j][m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * x_stride + 8 * kv), wv, a[j][m]);
        }
    for (int j = 0; j < R; j++)
        for (int m = 0; m < M; m++) acc[m][i + j] = a[j][m];
}

/* 5 to 8 input rows, one output row */
static inline __attribute__((always_inline)) void plain_row_wide(const int M, const float *x,
                                                                 long x_stride, const float *w,
                                                                 int K, __m256 acc[][8],
                                                                 int i) {
    __m256 a[GEMV_MAX_ROWS];
    for (int m = 0; m < M; m++) a[m] = _mm256_setzero_ps();
    for (int kv = 0; kv < K / 8; kv++) {
        const __m256 wv = _mm256_loadu_ps(w + 8 * kv);
        for (int m = 0; m < M; m++)
            a[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * x_stride + 8 * kv), wv, a[m]);
    }
    for (int m = 0; m < M; m++) acc[m][i] = a[m];
}

static inline __attribute__((always_inline)) void plain_tile(const int M, const float *x,
                                                             long x_stride, const float *w,
                                                             float *y, long y_stride, int n0,
                                                             int nn, int K) {
    __m256 acc[GEMV_MAX_ROWS][8];
    for (int i = 0; i < 8; i++) { /* rows past nn sum nothing: their lanes are not stored */
        const float *wr = w + (long)(n0 + i) * K;
        if (i >= nn) {
            for (int m = 0; m < M; m++) acc[m][i] = _mm256_setzero_ps();
        } else if (M == 1 && i + 3 < nn) { /* four weight streams at a time */
            plain_rows(1, 4, x, x_stride, wr, K, acc, i);
            i += 3;
        } else if (M > 4) {
            plain_row_wide(M, x, x_stride, wr, K, acc, i);
        } else if (i + 1 < nn) {
            plain_rows(M, 2, x, x_stride, wr, K, acc, i);
            i++;
        } else {
            plain_rows(M, 1, x, x_stride, wr, K, acc, i);
        }
    }
    store_tile(M, acc, y, y_stride, n0, nn);
}

int gemv_f32(const float *x, long x_stride, const float *w, float *y, long y_stride, int M,
             int N, int K) {
    if (!gemv_f32_covers(M, N, K)) return -1;
    const long tiles = (N + 7) / 8;
#pragma omp parallel for schedule(static)
    for (long tile = 0; tile < tiles; tile++) {
        const int n0 = (int)tile * 8, nn = N - n0 < 8 ? N - n0 : 8;
        switch (M) {
        case 1: plain_tile(1, x, x_stride, w, y, y_stride, n0, nn, K); break;
        case 2: plain_tile(2, x, x_stride, w, y, y_stride, n0, nn, K); break;
        case 3: plain_tile(3, x, x_stride, w, y, y_stride, n0, nn, K); break;
        case 4: plain_tile(4, x, x_stride, w, y, y_stride, n0, nn, K); break;
        case 5: plain_tile(5, x, x_stride, w, y, y_stride, n0, nn, K); break;
        case 6: plain_tile(6, x, x_stride, w, y, y_stride, n0, nn, K); break;
        case 7: plain_tile(7, x, x_stride, w, y, y_stride, n0, nn, K); break;
        default: plain_tile(8, x, x_stride, w, y, y_stride, n0, nn, K); break;
        }
    }
    return 0;
}

/* --- GGUF blocks (layouts: block_quant.c) */

/* block kb of weight row r as its four 8-weight pieces */
static inline __attribute__((always_inline)) void q4_block(const uint8_t *qs, const float *dm,
                                                           __m256 p[4]) {
    const __m256 d = _mm256_set1_ps(dm[0]), mn = _mm256_set1_ps(dm[1]);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, low4); /* weights 0-15 */
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4); /* weights 16-31 */
    const __m128i q[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int j = 0; j < 4; j++)
        p[j] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q[j])), mn);
}

static inline __attribute__((always_inline)) void q8_block(const int8_t *qs, const float *sc,
                                                           __m256 p[4]) {
    const __m256 d = _mm256_set1_ps(sc[0]);
    for (int j = 0; j < 4; j++) {
        const __m128i q = _mm_loadl_epi64((const __m128i *)(qs + 8 * j));
        p[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    }
}

/* one output row (weight row r) for M input rows into acc[m][i]: the plain kernel's chains
 * (M == 1: pieces 0, 2 of each block in one, 1, 3 in the other) */
#define DEFINE_QROW(NAME, BLOCK)                                                               \
    static inline __attribute__((always_inline)) void NAME(                                    \
        const int M, const float *x, long x_stride, const void *qs, const float *sc, int r,    \
        int K, __m256 acc[][8], int i) {                                                       \
        const int KB = K / 32;                                                                 \
        __m256 a[GEMV_MAX_ROWS], b = _mm256_setzero_ps();                                      \
        for (int m = 0; m < M; m++) a[m] = _mm256_setzero_ps();                                \
        for (int kb = 0; kb < KB; kb++) {                                                      \
            __m256 p[4];                                                                       \
            BLOCK(r, kb, p);                                                                   \
            if (M == 1) {                                                                      \
                const float *xb = x + 32 * kb;                                                 \
                a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(xb), p[0], a[0]);                       \
                b = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), p[1], b);                         \
                a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), p[2], a[0]);                  \
                b = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), p[3], b);                        \
            } else {                                                                           \
                for (int j = 0; j < 4; j++)                                                    \
                    for (int m = 0; m < M; m++)                                                \
                        a[m] = _mm256_fmadd_ps(                                                \
                            _mm256_loadu_ps(x + m * x_stride + 32 * kb + 8 * j), p[j], a[m]);  \
            }                                                                                  \
        }                                                                                      \
        if (M == 1) a[0] = _mm256_add_ps(a[0], b);                                             \
        for (int m = 0; m < M; m++) acc[m][i] = a[m];                                          \
    }

#define Q4_AT(r, kb, p)                                                                        \
    q4_block((const uint8_t *)qs + (long)(r) * (K / 2) + 16L * (kb),                           \
             sc + ((long)(r) * KB + (kb)) * 2, p)
#define Q8_AT(r, kb, p)                                                                        \
    q8_block((const int8_t *)qs + (long)(r) * K + 32L * (kb), sc + (long)(r) * KB + (kb), p)
DEFINE_QROW(q4_row, Q4_AT)
DEFINE_QROW(q8_row, Q8_AT)

/* Past 4 input rows: the tile's weights are dequantized once per chunk of at most KC
 * columns (K in equal chunks) into a buffer (8 rows x KC floats, 24 KB, in L1) and every
 * input row is summed against it, two weight rows and up to four input rows at a time (8
 * partials in registers, each x piece loaded once for two rows, each weight piece once
 * for four): one chain per input and output row, in order, as the plain kernel's. The
 * partials live in acc between chunks. A last group of one row (M % GEMV_MAX_ROWS == 1)
 * is summed as a one-row call would (two chains), so that every group of GEMV_MAX_ROWS
 * rows is bitwise the plain kernel on its rows. */
#define KC 768

static inline __attribute__((always_inline)) void rows_against_buffer(
    const int MM, const float *x, long x_stride, const float *wbuf, int nn, int kc, int kn,
    __m256 acc[][8]) {
    for (int i = 0; i < nn; i += 2) {
        const int two = i + 1 < nn;
        const float *w0 = wbuf + i * KC, *w1 = two ? w0 + KC : w0;
        __m256 a0[4], a1[4];
        for (int m = 0; m < MM; m++) a0[m] = acc[m][i], a1[m] = two ? acc[m][i + 1] : a0[m];
        for (int p = 0; p < kn; p += 8) {
            __m256 v0 = _mm256_loadu_ps(w0 + p), v1 = _mm256_loadu_ps(w1 + p);
            /* in registers (and each x piece below): GCC otherwise folds them into every
             * fma as another load */
            __asm__("" : "+x"(v0), "+x"(v1));
            for (int m = 0; m < MM; m++) {
                __m256 xv = _mm256_loadu_ps(x + m * x_stride + kc + p);
                __asm__("" : "+x"(xv));
                a0[m] = _mm256_fmadd_ps(xv, v0, a0[m]);
                a1[m] = _mm256_fmadd_ps(xv, v1, a1[m]);
            }
        }
        for (int m = 0; m < MM; m++) {
            acc[m][i] = a0[m];
            if (two) acc[m][i + 1] = a1[m];
        }
    }
}

#define DEFINE_QGEMV(NAME, BLOCK, ROW)                                                         \
    static void NAME##_rows(const float *x, long x_stride, const void *qs, const float *sc,    \
                            float *y, long y_stride, int M, int n0, int nn, int K) {           \
        const int KB = K / 32;                                                                 \
        __m256 acc[QGEMV_MAX_ROWS][8];                                                         \
        __attribute__((aligned(32))) float wbuf[8 * KC];                                       \
        for (int m = 0; m < M; m++)                                                            \
            for (int i = 0; i < 8; i++) acc[m][i] = _mm256_setzero_ps();                       \
        const int chunk = 32 * ((KB + (K + KC - 1) / KC - 1) / ((K + KC - 1) / KC));          \
        for (int kc = 0; kc < K; kc += chunk) {                                                \
            const int kn = K - kc < chunk ? K - kc : chunk;                                    \
            for (int i = 0; i < nn; i++)                                                       \
                for (int b = 0; b < kn / 32; b++) {                                            \
                    __m256 p[4];                                                               \
                    BLOCK(n0 + i, kc / 32 + b, p);                                             \
                    for (int j = 0; j < 4; j++)                                                \
                        _mm256_store_ps(wbuf + i * KC + 32 * b + 8 * j, p[j]);                 \
                }                                                                              \
            int m0 = 0;                                                                        \
            for (; m0 + 4 <= M; m0 += 4)                                                       \
                rows_against_buffer(4, x + (long)m0 * x_stride, x_stride, wbuf, nn, kc, kn,    \
                                    acc + m0);                                                 \
            const float *xr = x + (long)m0 * x_stride; /* the last 1-3 rows */                 \
            switch (M - m0) {                                                                  \
            case 1: rows_against_buffer(1, xr, x_stride, wbuf, nn, kc, kn, acc + m0); break;   \
            case 2: rows_against_buffer(2, xr, x_stride, wbuf, nn, kc, kn, acc + m0); break;   \
            case 3: rows_against_buffer(3, xr, x_stride, wbuf, nn, kc, kn, acc + m0); break;   \
            default: break;                                                                    \
            }                                                                                  \
        }                                                                                      \
        store_tile(M, acc, y, y_stride, n0, nn);                                               \
    }                                                                                          \
                                                                                               \
    /* up to 4 rows: each block dequantized in registers and summed right away */         \
    static inline __attribute__((always_inline)) void NAME##_row_tile(                         \
        const int M, const float *x, long x_stride, const void *qs, const float *sc,           \
        float *y, long y_stride, int n0, int nn, int K) {                                      \
        __m256 acc[4][8];                                                                      \
        for (int i = 0; i < 8; i++) {                                                          \
            if (i < nn)                                                                        \
                ROW(M, x, x_stride, qs, sc, n0 + i, K, acc, i);                                \
            else                                                                               \
                for (int m = 0; m < M; m++) acc[m][i] = _mm256_setzero_ps();                   \
        }                                                                                      \
        store_tile(M, acc, y, y_stride, n0, nn);                                               \
    }                                                                                          \
                                                                                               \
    int NAME(const float *x, long x_stride, const void *qs, const float *scales, float *y,     \
             long y_stride, int M, int N, int K) {                                             \
        if (!gemv_q_f32_covers(M, N, K)) return -1;                                            \
        const long tiles = (N + 7) / 8;                                                        \
        /* a last group of one row: summed as a one-row call */                                \
        const int single = M % GEMV_MAX_ROWS == 1 ? M - 1 : -1, many = single >= 0 ? M - 1 : M; \
        _Pragma("omp parallel for schedule(static)")                                           \
        for (long tile = 0; tile < tiles; tile++) {                                            \
            const int n0 = (int)tile * 8, nn = N - n0 < 8 ? N - n0 : 8;                        \
            switch (many) {                                                                    \
            case 0: break;                                                                     \
            case 2: NAME##_row_tile(2, x, x_stride, qs, scales, y, y_stride, n0, nn, K); break; \
            case 3: NAME##_row_tile(3, x, x_stride, qs, scales, y, y_stride, n0, nn, K); break; \
            case 4: NAME##_row_tile(4, x, x_stride, qs, scales, y, y_stride, n0, nn, K); break; \
            default: NAME##_rows(x, x_stride, qs, scales, y, y_stride, many, n0, nn, K); break; \
            }                                                                                  \
            if (single >= 0)                                                                   \
                NAME##_row_tile(1, x + (long)single * x_stride, x_stride, qs, scales,          \
                                y + (long)single * y_stride, y_stride, n0, nn, K);             \
        }                                                                                      \
        return 0;                                                                              \
    }

DEFINE_QGEMV(gemv_q4_f32, Q4_AT, q4_row)
DEFINE_QGEMV(gemv_q8_f32, Q8_AT, q8_row)

#endif
