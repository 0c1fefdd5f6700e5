/* bf16 matmuls on AMX tiles for the model's linear layers: y[M][N] = x[M][K] w[N][K]^T,
 * float32 accumulation, each output rounded once to bf16 (to nearest even), as oneDNN.
 *
 * Why not oneDNN's own matmul: at the shapes of a serving iteration (a few to a few
 * hundred rows, weights of a few MB a layer) the weights come from memory on every
 * iteration, and oneDNN's matmul reads them as if they were cached: its time is the
 * cached compute time plus the time to read the weights (docs/KERNELS.md, "AMX linear").
 * Here each thread streams its own contiguous range of the packed weights, front to
 * back, with software prefetches a fixed distance ahead, so the reads overlap the tile
 * products; a thread done with its range takes the last units of the others' (the
 * ranges' tails go to whichever thread is ahead instead of waiting at the barrier).
 *
 * Weight layout (linear_amx_pack): tiles of 32 k x 16 n in AMX's B ("VNNI") layout,
 * 16 rows of 16 32-bit words (the k pair 2r, 2r + 1 of column n at word r * 16 + n), 1 KB
 * each, ordered [N / 32 column pairs][K / 32][2 columns of 16] so that a pair of 16-column
 * blocks is one contiguous run of the stream.
 *
 * Tiles: 0-3 accumulators (2 row blocks x 2 column blocks), 4-5 x (A), 6-7 w (B).
 * Row groups of 32 (two 16-row blocks); the last group's blocks take fewer rows through
 * the tile configuration.
 *
 * SwiGLU (linear_amx_silu_mul_bf16): the same loop over a gate/up weight, its two column
 * blocks a gate block and the up block of the same columns, the activation computed from
 * the rounded products in the epilogue (silu_mul16_bf16, as silu_mul_bf16): the MLP's
 * [rows][2 * inter] intermediate is neither written nor read back.
 *
 * Epilogues (all modes): a group's sums leave the tiles into a buffer, and their rounding,
 * activation (SwiGLU's exp and division take about as long as the tile products of the
 * same outputs) and row stores run a few rows per k step of the next group's products
 * (the vector units run beside the tile unit), the last group's at the end; right after
 * each group, the plain epilogue waits on the tile stores and holds up the next group's
 * products (docs/KERNELS.md, "AMX linear").
 */
#include <stdatomic.h>
#include <stdlib.h>

#include "common.h"
#include "kernels.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#include "amx.h"

/* What the kernel writes per output: bf16 (the rounded sum), the SwiGLU activation of a
 * gate/up pair (bf16), or the rounded sum widened back to float32 (the LM head's logits,
 * which sampling reads in float32: no separate bf16 -> float32 pass). */
enum { OUT_BF16 = 0, OUT_SWIGLU = 1, OUT_F32 = 2 };

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

/* 16 float32 sums of one row -> 16 bf16 outputs (to nearest even) */
static inline void store_row_bf16(uint16_t *y, __m512 sums) {
    _mm256_storeu_si256((__m256i *)y, (__m256i)_mm512_cvtneps_pbh(sums));
}

/* A group's sums waiting for their epilogue: acc[0], acc[1] the sums of its first 16-row
 * block's two column blocks (for SwiGLU the gate and the up sums), acc[2], acc[3] of the
 * second; rows done so far of `rows`. */
typedef struct {
    __attribute__((aligned(64))) float acc[4][16 * 16];
    void *y; /* the group's first output (row m0, column n0): bf16, or float for OUT_F32 */
    long y_stride;
    int mode, rows0, rows, done;
} PendingEpilogue;

/* The next up to `count` rows of the pending epilogue (all of them: count = rows). */
static inline void drain_epilogue(PendingEpilogue *p, int count) {
    const int end = p->done + count < p->rows ? p->done + count : p->rows;
    for (int r = p->done; r < end; r++) {
        const int blk = r >= p->rows0, rr = r - blk * p->rows0;
        const __m512 a = _mm512_load_ps(p->acc[2 * blk] + rr * 16);
        const __m512 b = _mm512_load_ps(p->acc[2 * blk + 1] + rr * 16);
        if (p->mode == OUT_SWIGLU) {
            store_row_bf16((uint16_t *)p->y + (long)r * p->y_stride,
                           silu_mul16_bf16(bf16x16_round(a), bf16x16_round(b)));
        } else if (p->mode == OUT_F32) {
            float *yf = (float *)p->y + (long)r * p->y_stride;
            _mm512_storeu_ps(yf, bf16x16_round(a));
            _mm512_storeu_ps(yf + 16, bf16x16_round(b));
        } else {
            uint16_t *yb = (uint16_t *)p->y + (long)r * p->y_stride;
            store_row_bf16(yb, a);
            store_row_bf16(yb + 16, b);
        }
    }
    p->done = end;
}

/* Two 16-column blocks of the product for rows m0 .. m0 + rows0 + rows1. Tiles 6 and 7
 * stream the blocks' packed weights: w6, w7 point at their first 1 KB tile, each next k
 * step's is 2 KB on (the layout's [K / 32][2 columns of 16] order). OUT_BF16 and
 * OUT_F32 (y then float *): the blocks are columns n0 .. n0 + 31 of y. OUT_SWIGLU: w6 is
 * a gate block and w7 the up block of the same columns, and y gets silu(gate) * up in its
 * 16 columns n0 .. n0 + 15, each product first rounded to bf16 as the plain output would
 * be, so the result is bitwise the plain matmul followed by silu_mul_bf16. The epilogue
 * of the previous group in `pending` runs during the k steps, and this group's sums are
 * left in it. pf6, pf7: where the weight prefetches of w6's and w7's streams start (NULL:
 * none). */
static inline void column_blocks(const uint16_t *x, long x_stride, const uint32_t *w6,
                                 const uint32_t *w7, int K, void *y, long y_stride,
                                 int m0, int rows0, int rows1, int n0, int mode,
                                 const char *pf6, const char *pf7, const char *prefetch_end,
                                 PendingEpilogue *pending) {
    const int KB = K / 32;
    /* rows of the pending epilogue per k step: spread over this group's k steps */
    const int drain_per_step = (pending->rows - pending->done + KB - 1) / KB;
    const long xs = x_stride * 2; /* bytes */
    const uint16_t *x0 = x + (long)m0 * x_stride, *x1 = x0 + 16 * x_stride;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int kb = 0; kb < KB; kb++) {
        if (pf6) {
            const char *p6 = pf6 + (long)kb * 2048, *p7 = pf7 + (long)kb * 2048;
            for (int c = 0; c < 1024 && p6 + c < prefetch_end; c += 64) _mm_prefetch(p6 + c, _MM_HINT_T0);
            for (int c = 0; c < 1024 && p7 + c < prefetch_end; c += 64) _mm_prefetch(p7 + c, _MM_HINT_T0);
        }
        _tile_loadd(6, w6 + (long)kb * 512, 64);
        _tile_loadd(7, w7 + (long)kb * 512, 64);
        _tile_loadd(4, x0 + kb * 32, xs);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (rows1 > 0) {
            _tile_loadd(5, x1 + kb * 32, xs);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        if (drain_per_step > 0) drain_epilogue(pending, drain_per_step);
    }
    drain_epilogue(pending, pending->rows);
    _tile_stored(0, pending->acc[0], 64);
    _tile_stored(1, pending->acc[1], 64);
    if (rows1 > 0) {
        _tile_stored(2, pending->acc[2], 64);
        _tile_stored(3, pending->acc[3], 64);
    }
    const long first = (long)m0 * y_stride + n0; /* element offset of the group's output */
    pending->y = mode == OUT_F32 ? (void *)((float *)y + first) : (void *)((uint16_t *)y + first);
    pending->y_stride = y_stride;
    pending->mode = mode;
    pending->rows0 = rows0;
    pending->rows = rows0 + rows1;
    pending->done = 0;
}

/* A thread's units not yet claimed, [front, back), packed in one word: its owner takes
 * them from the front (its stream through the weights), a thread that has run out takes
 * them from the back, and the compare-and-swap on both ends keeps a unit from being
 * claimed twice. One cache line each. */
typedef struct {
    _Alignas(64) _Atomic uint64_t range;
} UnitRange;
#define MAX_UNIT_RANGES 64

static inline uint64_t pack_range(uint32_t front, uint32_t back) {
    return (uint64_t)back << 32 | front;
}

/* the claimed unit, or -1 when the range is empty */
static inline int claim_unit(UnitRange *r, int from_back) {
    uint64_t old = atomic_load_explicit(&r->range, memory_order_relaxed);
    for (;;) {
        const uint32_t front = (uint32_t)old, back = (uint32_t)(old >> 32);
        if (front >= back) return -1;
        const uint64_t claimed = from_back ? pack_range(front, back - 1) : pack_range(front + 1, back);
        if (atomic_compare_exchange_weak_explicit(&r->range, &old, claimed, memory_order_relaxed,
                                                  memory_order_relaxed))
            return (int)(from_back ? back - 1 : front);
    }
}

/* The matmul over `units` units of output columns for all M rows in groups of 32. A unit
 * is a column pair (columns 32 u .. 32 u + 31) or, for OUT_SWIGLU, a 16-column block of
 * the SwiGLU output (gate block u, up block `units` + u of the packed [2 * inter] weight).
 * Each thread owns a contiguous range of units (one stream through the weights, front to
 * back); a thread done with its own takes the others' last units, so that a thread slowed
 * down (another process on its core) does not hold the rest at the closing barrier. */
static void run_units(const uint16_t *x, long x_stride, const uint32_t *wp, void *y,
                      long y_stride, int M, int K, int units, int mode, const char *w_end) {
    const long pair_words = (long)(K / 32) * 512;
#ifdef _OPENMP
    int nr = omp_get_max_threads();
#else
    int nr = 1;
#endif
    if (nr > MAX_UNIT_RANGES) nr = MAX_UNIT_RANGES;
    /* every range is claimed by its owner or by thieves, even in a smaller team */
    UnitRange ranges[MAX_UNIT_RANGES];
    for (int r = 0; r < nr; r++)
        atomic_init(&ranges[r].range, pack_range((uint32_t)((long)units * r / nr),
                                                 (uint32_t)((long)units * (r + 1) / nr)));
#pragma omp parallel num_threads(nr)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num();
#else
        const int t = 0;
#endif
        int configured = -1; /* the rows of the tail group the tiles are configured for */
        PendingEpilogue pending = {.rows = 0, .done = 0};
        for (int step = 0; step < nr;) {
            const int victim = (t + step) % nr;
            const int u = claim_unit(&ranges[victim], victim != t);
            if (u < 0) {
                step++;
                continue;
            }
            const uint32_t *w6, *w7;
            if (mode == OUT_SWIGLU) { /* 16-column block j sits in pair j / 2, half j % 2 */
                const int g = u, up = units + u;
                w6 = wp + (long)(g / 2) * pair_words + (g % 2) * 256;
                w7 = wp + (long)(up / 2) * pair_words + (up % 2) * 256;
            } else {
                w6 = wp + (long)u * pair_words;
                w7 = w6 + 256;
            }
            for (int m0 = 0; m0 < M; m0 += 32) {
                const int left = M - m0;
                const int rows0 = left < 16 ? left : 16;
                const int rows1 = left <= 16 ? 0 : (left - 16 < 16 ? left - 16 : 16);
                const int shape = rows0 * 32 + rows1;
                if (shape != configured) {
                    config_tiles(rows0, rows1);
                    configured = shape;
                }
                /* the first row group of a unit streams the weights: prefetches run
                 * PREFETCH_AHEAD bytes ahead of the tiles it multiplies */
                const int first = m0 == 0;
                column_blocks(x, x_stride, w6, w7, K, y, y_stride, m0, rows0, rows1,
                              mode == OUT_SWIGLU ? 16 * u : 32 * u, mode,
                              first ? (const char *)w6 + PREFETCH_AHEAD : NULL,
                              first ? (const char *)w7 + PREFETCH_AHEAD : NULL, w_end,
                              &pending);
            }
        }
        drain_epilogue(&pending, pending.rows);
        if (configured >= 0) _tile_release();
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

/* The plain matmul's checks and run, writing bf16 (OUT_BF16) or float32 (OUT_F32) y. */
static int matmul_entry(const uint16_t *x, long x_stride, const uint16_t *wpacked, void *y,
                        long y_stride, int M, int N, int K, int mode) {
#ifdef HAVE_LINEAR_AMX
    if (M < 1 || N < 32 || K < 32 || N % 32 != 0 || K % 32 != 0) return -1;
    if (!amx_tiles_granted()) return -1;
    const uint32_t *wp = (const uint32_t *)wpacked;
    run_units(x, x_stride, wp, y, y_stride, M, K, N / 32, mode,
              (const char *)(wp + (long)N * K / 2));
    return 0;
#else
    (void)x; (void)x_stride; (void)wpacked; (void)y; (void)y_stride; (void)M; (void)N; (void)K;
    (void)mode;
    return -1;
#endif
}

/* y [M][N] (row stride y_stride) = x [M][K] (row stride x_stride) w^T, w packed by
 * linear_amx_pack. Returns 0, or -1 where this build, process or these sizes are not
 * covered (nothing written). */
int linear_amx_bf16(const uint16_t *x, long x_stride, const uint16_t *wpacked, uint16_t *y,
                    long y_stride, int M, int N, int K) {
    return matmul_entry(x, x_stride, wpacked, y, y_stride, M, N, K, OUT_BF16);
}

/* As linear_amx_bf16, into y [M][N] float32 (row stride y_stride): each output the
 * bf16-rounded sum widened back to float32, bitwise linear_amx_bf16 followed by a bf16 ->
 * float32 copy. */
int linear_amx_bf16_f32out(const uint16_t *x, long x_stride, const uint16_t *wpacked, float *y,
                           long y_stride, int M, int N, int K) {
    return matmul_entry(x, x_stride, wpacked, y, y_stride, M, N, K, OUT_F32);
}

/* SwiGLU through the tiles: y [M][inter] (row stride y_stride) = silu(gate) * up, where
 * [gate | up] = x [M][K] w^T and w [2 * inter][K] (gate rows, then up rows) was packed by
 * linear_amx_pack; bitwise linear_amx_bf16 followed by silu_mul_bf16, without the
 * [M][2 * inter] intermediate. Returns 0, or -1 where this build, process or these sizes
 * are not covered (inter % 16; nothing written). */
int linear_amx_silu_mul_bf16(const uint16_t *x, long x_stride, const uint16_t *wpacked,
                             uint16_t *y, long y_stride, int M, int inter, int K) {
#ifdef HAVE_LINEAR_AMX
    if (M < 1 || inter < 16 || K < 32 || inter % 16 != 0 || K % 32 != 0) return -1;
    if (!amx_tiles_granted()) return -1;
    const uint32_t *wp = (const uint32_t *)wpacked;
    run_units(x, x_stride, wp, y, y_stride, M, K, inter / 16, OUT_SWIGLU,
              (const char *)(wp + (long)inter * K));
    return 0;
#else
    (void)x; (void)x_stride; (void)wpacked; (void)y; (void)y_stride; (void)M; (void)inter;
    (void)K;
    return -1;
#endif
}
