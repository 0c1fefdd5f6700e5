/* bf16 matmuls on AMX tiles for the model's linear layers: y[M][N] = x[M][K] w[N][K]^T,
 * float32 accumulation, each output rounded once to bf16 (to nearest even), as oneDNN.
 *
 * Why not oneDNN's own matmul: at the shapes of a serving iteration (a few to a few
 * hundred rows, weights of a few MB a layer) the weights come from memory on every
 * iteration, and oneDNN's matmul reads them as if they were cached: its time is the
 * cached compute time plus the time to read the weights (docs/KERNELS.md, "AMX linear").
 * Here each thread streams its own contiguous range of the packed weights, front to
 * back, with software prefetches a fixed distance ahead, so the reads overlap the tile
 * products.
 *
 * Weight layout (linear_amx_pack): tiles of 32 k x 16 n in AMX's B ("VNNI") layout,
 * 16 rows of 16 32-bit words (the k pair 2r, 2r + 1 of column n at word r * 16 + n), 1 KB
 * each, ordered [N / 32 column pairs][K / 32][2 columns of 16] so that a pair of 16-column
 * blocks is one contiguous run of the stream.
 *
 * Tiles: 0-3 accumulators (2 row blocks x 2 column blocks), 4-5 x (A), 6-7 w (B).
 * Row groups of 32 (two 16-row blocks); the last group's blocks take fewer rows through
 * the tile configuration.
 */
#include <stdlib.h>

#include "common.h"
#include "kernels.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#include "amx.h"

#ifdef HAVE_AMX_TILES
#define HAVE_LINEAR_AMX 1
/* bytes of weights ahead of the tile being multiplied that each thread prefetches */
#define PREFETCH_AHEAD 4096

/* rows0, rows1: the rows of the group's two 16-row blocks (rows1 may be 0: one block) */
static void config_tiles(int rows0, int rows1) {
    const uint8_t r0 = (uint8_t)rows0, r1 = (uint8_t)(rows1 > 0 ? rows1 : 1);
    const uint8_t rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
    amx_configure(rows);
}

/* 16 float32 accumulators of one row -> 16 bf16 outputs */
static inline void store_row_bf16(uint16_t *y, const float *acc) {
    _mm256_storeu_si256((__m256i *)y, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(acc)));
}

/* One pair of 16-column blocks (columns n0 .. n0 + 31) for rows m0 .. m0 + rows0 + rows1. */
static inline void column_pair(const uint16_t *x, long x_stride, const uint32_t *wp, int K,
                               uint16_t *y, long y_stride, int m0, int rows0, int rows1, int n0,
                               const char *prefetch_from, const char *prefetch_end) {
    __attribute__((aligned(64))) float acc[16 * 16];
    const int KB = K / 32;
    const long xs = x_stride * 2; /* bytes */
    const uint16_t *x0 = x + (long)m0 * x_stride, *x1 = x0 + 16 * x_stride;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int kb = 0; kb < KB; kb++) {
        const uint32_t *b = wp + (long)kb * 512; /* two 1 KB tiles: columns n0, n0 + 16 */
        if (prefetch_from) {
            const char *p = prefetch_from + (long)kb * 2048;
            for (int c = 0; c < 2048 && p + c < prefetch_end; c += 64) _mm_prefetch(p + c, _MM_HINT_T0);
        }
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + 256, 64);
        _tile_loadd(4, x0 + kb * 32, xs);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (rows1 > 0) {
            _tile_loadd(5, x1 + kb * 32, xs);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    uint16_t *y0 = y + (long)m0 * y_stride + n0;
    _tile_stored(0, acc, 64);
    for (int r = 0; r < rows0; r++) store_row_bf16(y0 + r * y_stride, acc + r * 16);
    _tile_stored(1, acc, 64);
    for (int r = 0; r < rows0; r++) store_row_bf16(y0 + r * y_stride + 16, acc + r * 16);
    if (rows1 > 0) {
        uint16_t *y1 = y0 + 16 * y_stride;
        _tile_stored(2, acc, 64);
        for (int r = 0; r < rows1; r++) store_row_bf16(y1 + r * y_stride, acc + r * 16);
        _tile_stored(3, acc, 64);
        for (int r = 0; r < rows1; r++) store_row_bf16(y1 + r * y_stride + 16, acc + r * 16);
    }
}
#endif

int linear_amx_supported(void) {
#ifdef HAVE_LINEAR_AMX
    return amx_tiles_granted();
#else
    return 0;
#endif
}

/* Packs w [N][K] (bf16, contiguous) into the layout above; out: N * K bf16 elements.
 * Returns 0, or -1 for sizes the kernel does not take (N % 32, K % 32). */
int linear_amx_pack(const uint16_t *w, int N, int K, uint16_t *out) {
    if (N < 32 || K < 32 || N % 32 != 0 || K % 32 != 0) return -1;
    uint32_t *o = (uint32_t *)out;
    const int KB = K / 32;
#pragma omp parallel for schedule(static)
    for (int np = 0; np < N / 32; np++)
        for (int kb = 0; kb < KB; kb++)
            for (int half = 0; half < 2; half++) {
                uint32_t *tile = o + ((long)np * KB + kb) * 512 + half * 256;
                for (int r = 0; r < 16; r++)
                    for (int n = 0; n < 16; n++) {
                        const uint16_t *row = w + (long)(np * 32 + half * 16 + n) * K + kb * 32 + 2 * r;
                        tile[r * 16 + n] = (uint32_t)row[0] | ((uint32_t)row[1] << 16);
                    }
            }
    return 0;
}

/* y [M][N] (row stride y_stride) = x [M][K] (row stride x_stride) w^T, w packed by
 * linear_amx_pack. Returns 0, or -1 where this build, process or these sizes are not
 * covered (nothing written). */
int linear_amx_bf16(const uint16_t *x, long x_stride, const uint16_t *wpacked, uint16_t *y,
                    long y_stride, int M, int N, int K) {
#ifdef HAVE_LINEAR_AMX
    if (M < 1 || N < 32 || K < 32 || N % 32 != 0 || K % 32 != 0) return -1;
    if (!amx_tiles_granted()) return -1;
    const int pairs = N / 32, KB = K / 32;
    const uint32_t *wp = (const uint32_t *)wpacked;
    const long pair_words = (long)KB * 512;
    const char *w_end = (const char *)(wp + (long)pairs * pair_words);
#pragma omp parallel
    {
#ifdef _OPENMP
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
#else
        const int nt = 1, t = 0;
#endif
        /* each thread a contiguous range of column pairs: one stream through memory */
        const int p_begin = (int)((long)pairs * t / nt), p_end = (int)((long)pairs * (t + 1) / nt);
        int configured = -1; /* the rows of the tail group the tiles are configured for */
        for (int np = p_begin; np < p_end; np++) {
            const uint32_t *w_pair = wp + np * pair_words;
            for (int m0 = 0; m0 < M; m0 += 32) {
                const int left = M - m0;
                const int rows0 = left < 16 ? left : 16;
                const int rows1 = left <= 16 ? 0 : (left - 16 < 16 ? left - 16 : 16);
                const int shape = rows0 * 32 + rows1;
                if (shape != configured) {
                    config_tiles(rows0, rows1);
                    configured = shape;
                }
                /* the first row group of a pair streams the weights: prefetches run
                 * PREFETCH_AHEAD bytes ahead of the tiles it multiplies */
                const char *pf = m0 == 0 ? (const char *)w_pair + PREFETCH_AHEAD : NULL;
                column_pair(x, x_stride, w_pair, K, y, y_stride, m0, rows0, rows1, np * 32,
                            pf, w_end);
            }
        }
        _tile_release();
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)wpacked; (void)y; (void)y_stride; (void)M; (void)N; (void)K;
    return -1;
#endif
}
