/* float32 decode attention for CPUs with AVX2 and FMA but no AVX-512 (kernels/csrc/
 * cpu_attention.c takes its work items from here on such builds; the AVX-512 item there
 * is the model for this one), over float32 caches or int8 cache rows (kernels/kv_int8.py).
 *
 * One work item: KV heads [h0, h1) of sequence n, each with its G query heads, over the
 * keys in runs of up to 8 inside one block. Per run, three passes over the query heads,
 * none waiting on another head's results: the 8 keys' dot products as 8-lane partial
 * sums, summed across lanes 8 keys at once (hsum8x8); the online-softmax update on those
 * 8 scores (exp on 8 lanes); the weighted V rows into the head's accumulators. int8 rows
 * are widened to float32 once for a KV head's G query heads (keys in registers, a run's
 * values into L1) and their scales applied to the 8 scores and the 8 softmax weights, not
 * to the rows.
 *
 * Blocks are scattered over the cache, so the hardware prefetcher cannot see the next
 * rows coming. Their cache lines are requested a few at a time between the heads' dot
 * products and V updates, PREFETCH_AHEAD tokens before they are read: requested all at
 * once at the start of a run (as before), the requests filled the core's miss buffers,
 * the core waited for memory, and then computed with nothing in flight, about 15 GB/s
 * against the 26-31 GB/s a loop that only reads the same blocks reaches; spread out, the
 * kernel reads about 25 GB/s (docs/KERNELS.md, "CPU attention"). Head sizes 64
 * and 128 only (ND = D / 8 vectors a row, a compile-time constant); the caller takes its
 * portable loop for others.
 */
#include "common.h"
#include "kernels.h"

#if defined(AVX2_ONLY)

#define ITEM_MAX_QHEADS 32 /* cpu_attention.c's MAX_ITEM_QHEADS */
#define ITEM_MAX_ND 16     /* D up to 128 */
#define ITEM_MAX_G 16      /* cpu_attention.c's MAX_G */
#define PREFETCH_AHEAD 16 /* tokens: one block at the default block size */

/* Walks the cache lines of a run's K and V rows: `rows` spans of `span` bytes, `stride`
 * apart (one span when the run's rows are contiguous: all of a token's heads), one K and
 * one V line a step; rows = 0 makes every step a no-op. The bookkeeping is a few integer
 * operations and one well-predicted branch a step: a cursor that switched between K and
 * V and counted lines per row cost more than the math it was hidden in. */
typedef struct {
    const char *k, *v;
    long stride, span, off;
    int rows, row;
} pf_cursor;
static inline __attribute__((always_inline)) void pf_step(pf_cursor *c) {
    if (c->row >= c->rows) return;
    const long at = c->row * c->stride + c->off;
    _mm_prefetch(c->k + at, _MM_HINT_T0);
    _mm_prefetch(c->v + at, _MM_HINT_T0);
    c->off += 64;
    if (c->off >= c->span) c->off = 0, c->row++;
}

/* The run's nt int8 value rows of one head (row_stride bytes apart) widened to float32
 * into w[t] (their scales applied outside: see run), once for the head's G query heads */
static inline __attribute__((always_inline)) void widen_rows(const int ND, const char *r,
                                                             long row_stride, int nt,
                                                             __m256 w[8][ITEM_MAX_ND]) {
    for (int t = 0; t < nt; t++)
        for (int j = 0; j < ND; j++)
            w[t][j] = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(r + t * row_stride + 8 * j))));
}

/* The int8 rows' scales (the float32 after a row's D values) of a run's nt rows, one a
 * lane; 0 in the lanes past nt */
static inline __attribute__((always_inline)) __m256 run_scales(const char *r, long stride,
                                                              int D, int nt) {
    __attribute__((aligned(32))) float s[8] = {0};
    for (int t = 0; t < nt; t++) memcpy(&s[t], r + t * stride + D, sizeof(float));
    return _mm256_load_ps(s);
}

/* What an item keeps across its runs: per query head c its query row, accumulators,
 * running maximum m and sum l; per run the scores, the rescale factors and the softmax
 * weights; the widened int8 rows of one head. */
typedef struct {
    __m256 qv[ITEM_MAX_QHEADS][ITEM_MAX_ND], acc[ITEM_MAX_QHEADS][ITEM_MAX_ND];
    __m256 sv[ITEM_MAX_QHEADS];
    float m[ITEM_MAX_QHEADS], l[ITEM_MAX_QHEADS], corr[ITEM_MAX_QHEADS];
    __attribute__((aligned(32))) float p[ITEM_MAX_QHEADS][8];
    __m256 w[8][ITEM_MAX_ND]; /* int8 rows: one head's K or V rows of a run, widened */
} item_state;

/* One run of nt keys (rows kb / vb, tok_stride bytes apart; heads row bytes apart) for
 * the item's nh KV heads: three passes over the run's query heads, each free of the
 * others' results, so the out-of-order core overlaps heads: scores, softmax update,
 * weighted V rows. I8 = 0: float32 rows of D floats; I8 = 1: int8 rows
 * (kernels/kv_int8.py: D int8 values, then their float32 scale). An int8 key's scale
 * multiplies its summed dot product (one lane of the run's 8 scores), a value's scale
 * its softmax weight in the V update (the normalizer l sums the unscaled weights): the
 * rows are widened, never rescaled: each key row once, in registers, for the KV head's G
 * queries; a run's value rows once per KV head, into st->w. ND, I8 and (for full runs)
 * nt are compile-time constants at the call sites: the loops unroll and the branches on
 * them go (G is not: one copy per group size made the object 7x larger and its build
 * 28 s, for ~10 % on int8 rows and nothing on float32). */
static inline __attribute__((always_inline)) void run(const int ND, const int G, const int I8,
                                                      const int nt, const int nh, item_state *st,
                                                      const char *kb, const char *vb,
                                                      long tok_stride, long row, pf_cursor *pc,
                                                      int per_pass, __m256 sc) {
    const int D = ND * 8;
    const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
    const __m256 live = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7),
                                      _mm256_set1_ps((float)nt), _CMP_LT_OQ);
    for (int i = 0; i < nh; i++) {
        const __m256 ks = I8 ? _mm256_mul_ps(sc, run_scales(kb + i * row, tok_stride, D, nt)) : sc;
        if (I8) {
            /* each int8 key row widened once, in registers, for the head's G queries */
            __m256 part[ITEM_MAX_G][8];
            for (int t = 0; t < 8; t++) {
                if (t >= nt) {
                    for (int g = 0; g < G; g++) part[g][t] = _mm256_setzero_ps();
                    continue;
                }
                const char *kr = kb + t * tok_stride + i * row;
                __m256 k[ITEM_MAX_ND];
                for (int j = 0; j < ND; j++)
                    k[j] = _mm256_cvtepi32_ps(
                        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(kr + 8 * j))));
                for (int g = 0; g < G; g++) {
                    const __m256 *qv = st->qv[i * G + g];
                    __m256 d = _mm256_mul_ps(qv[0], k[0]);
                    for (int j = 1; j < ND; j++) d = _mm256_fmadd_ps(qv[j], k[j], d);
                    part[g][t] = d;
                }
            }
            for (int g = 0; g < G; g++) {
                const int c = i * G + g;
                for (int r = 0; r < per_pass; r++) pf_step(pc);
                const __m256 scores = _mm256_mul_ps(hsum8x8(part[g]), ks);
                st->sv[c] = nt == 8 ? scores : _mm256_blendv_ps(neg_inf, scores, live);
            }
            continue;
        }
        for (int g = 0; g < G; g++) {
            const int c = i * G + g;
            __m256 part[8];
            for (int r = 0; r < per_pass; r++) pf_step(pc);
            for (int t = 0; t < 8; t++) {
                if (t >= nt) {
                    part[t] = _mm256_setzero_ps();
                    continue;
                }
                const float *kr = (const float *)(kb + t * tok_stride + i * row);
                __m256 d = _mm256_mul_ps(st->qv[c][0], _mm256_loadu_ps(kr));
                for (int j = 1; j < ND; j++)
                    d = _mm256_fmadd_ps(st->qv[c][j], _mm256_loadu_ps(kr + 8 * j), d);
                part[t] = d;
            }
            const __m256 scores = _mm256_mul_ps(hsum8x8(part), ks);
            st->sv[c] = nt == 8 ? scores : _mm256_blendv_ps(neg_inf, scores, live);
        }
    }
    for (int i = 0; i < nh; i++) {
        const __m256 vs = I8 ? run_scales(vb + i * row, tok_stride, D, nt) : _mm256_setzero_ps();
        for (int g = 0; g < G; g++) {
            const int c = i * G + g;
            const float bm = hmax8(st->sv[c]);
            /* a new maximum rescales what was summed so far (exactly 1 otherwise) */
            st->corr[c] = bm > st->m[c] ? exp_approx(st->m[c] - bm) : 1.0f;
            st->m[c] = bm > st->m[c] ? bm : st->m[c];
            __m256 pv = exp256(_mm256_sub_ps(st->sv[c], _mm256_set1_ps(st->m[c])));
            if (nt < 8) pv = _mm256_and_ps(pv, live);
            st->l[c] = st->l[c] * st->corr[c] + hadd8(pv);
            _mm256_store_ps(st->p[c], I8 ? _mm256_mul_ps(pv, vs) : pv);
        }
    }
    for (int i = 0; i < nh; i++) {
        if (I8) widen_rows(ND, vb + i * row, tok_stride, nt, st->w);
        for (int g = 0; g < G; g++) {
            const int c = i * G + g;
            const __m256 cv = _mm256_set1_ps(st->corr[c]);
            __m256 a[ITEM_MAX_ND]; /* this query head's accumulators, in registers */
            for (int j = 0; j < ND; j++) a[j] = _mm256_mul_ps(st->acc[c][j], cv);
            for (int r = 0; r < per_pass; r++) pf_step(pc);
            for (int t = 0; t < nt; t++) {
                const float *vr =
                    I8 ? (const float *)st->w[t] : (const float *)(vb + t * tok_stride + i * row);
                const __m256 pb = _mm256_set1_ps(st->p[c][t]);
                for (int j = 0; j < ND; j++)
                    a[j] = _mm256_fmadd_ps(pb, _mm256_loadu_ps(vr + 8 * j), a[j]);
            }
            for (int j = 0; j < ND; j++) st->acc[c][j] = a[j];
        }
    }
}

/* One work item: KV heads [h0, h1) of sequence n, its keys in runs of up to 8 inside a
 * block (`run`), the rows PREFETCH_AHEAD tokens on requested during each run. */
static inline __attribute__((always_inline)) void item(
    const int ND, const int G, const int I8, const float *q, long q_stride, const void *k_cache,
    const void *v_cache, const int32_t *tables, long table_stride, const int32_t *lens,
    float *out, int n, int h0, int h1, int H, int Hkv, int block_size, float scale) {
    const int D = ND * 8, nh = h1 - h0, nq = nh * G; /* query heads, c = (h - h0) * G + g */
    const long row = I8 ? D + 4 : D * (long)sizeof(float); /* bytes of one head's row */
    const long tok_stride = (long)Hkv * row;
    const long block_bytes = (long)block_size * tok_stride;
    const char *kc = (const char *)k_cache, *vc = (const char *)v_cache;
    item_state st;
    const __m256 sc = _mm256_set1_ps(scale);
    for (int c = 0; c < nq; c++) {
        const float *qr = q + (long)n * q_stride + (long)(h0 * G + c) * D;
        for (int j = 0; j < ND; j++) {
            st.qv[c][j] = _mm256_loadu_ps(qr + 8 * j);
            st.acc[c][j] = _mm256_setzero_ps();
        }
        st.m[c] = -INFINITY;
        st.l[c] = 0.0f;
    }
    const int len = lens[n], run_bytes = nh * (int)row;
    const int32_t *table = tables + (long)n * table_stride;
    for (int start = 0, nt = 0; start < len; start += nt) {
        const int off = start % block_size, blk = start / block_size;
        nt = len - start < 8 ? len - start : 8;
        if (nt > block_size - off) nt = block_size - off;
        const long at = (long)table[blk] * block_bytes + (long)off * tok_stride + (long)h0 * row;
        /* the rows PREFETCH_AHEAD tokens on, requested a few lines at a time between the
         * query heads' dot products and V updates (see the header) */
        pf_cursor pc = {0};
        if (start + PREFETCH_AHEAD < len) {
            const int s2 = start + PREFETCH_AHEAD, b2 = s2 / block_size, o2 = s2 % block_size;
            int n2 = len - s2 < nt ? len - s2 : nt;
            if (n2 > block_size - o2) n2 = block_size - o2;
            const long e2 = (long)table[b2] * block_bytes + (long)o2 * tok_stride + (long)h0 * row;
            /* from the line the first row starts in (int8 rows need not start on one) */
            const long lead = (long)((uintptr_t)(kc + e2) & 63);
            pc.k = kc + e2 - lead;
            pc.v = vc + e2 - lead;
            pc.stride = tok_stride;
            if (run_bytes == tok_stride) /* every head of the tokens: one span */
                pc.rows = 1, pc.span = lead + n2 * tok_stride;
            else
                pc.rows = n2, pc.span = lead + run_bytes;
        }
        /* steps per query head in each of the two passes */
        const int per_pass = (int)((pc.rows * ((pc.span + 63) / 64) + 2 * nq - 1) / (2 * nq));
        if (nt == 8)
            run(ND, G, I8, 8, nh, &st, kc + at, vc + at, tok_stride, row, &pc, per_pass, sc);
        else
            run(ND, G, I8, nt, nh, &st, kc + at, vc + at, tok_stride, row, &pc, per_pass, sc);
    }
    for (int c = 0; c < nq; c++) {
        float *o = out + ((long)n * H + h0 * G + c) * D;
        const __m256 inv = _mm256_set1_ps(1.0f / st.l[c]);
        for (int j = 0; j < ND; j++) _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(st.acc[c][j], inv));
    }
}

/* One item with the head size as a compile-time constant; 0 where none is built. */
static inline __attribute__((always_inline)) int dispatch(
    const int I8, int D, int G, const float *q, long q_stride, const void *k_cache,
    const void *v_cache, const int32_t *tables, long table_stride, const int32_t *lens,
    float *out, int n, int h0, int h1, int H, int Hkv, int block_size, float scale) {
    if ((h1 - h0) * G > ITEM_MAX_QHEADS || (D != 64 && D != 128)) return 0;
    if (D == 64)
        item(8, G, I8, q, q_stride, k_cache, v_cache, tables, table_stride, lens, out, n, h0, h1,
             H, Hkv, block_size, scale);
    else
        item(16, G, I8, q, q_stride, k_cache, v_cache, tables, table_stride, lens, out, n, h0, h1,
             H, Hkv, block_size, scale);
    return 1;
}

int decode_item_avx2_f32(int D, int G, const float *q, long q_stride, const float *k_cache,
                         const float *v_cache, const int32_t *tables, long table_stride,
                         const int32_t *lens, float *out, int n, int h0, int h1, int H, int Hkv,
                         int block_size, float scale) {
    return dispatch(0, D, G, q, q_stride, k_cache, v_cache, tables, table_stride, lens, out, n,
                    h0, h1, H, Hkv, block_size, scale);
}

int decode_item_avx2_i8_f32(int D, int G, const float *q, long q_stride, const int8_t *k_cache,
                            const int8_t *v_cache, const int32_t *tables, long table_stride,
                            const int32_t *lens, float *out, int n, int h0, int h1, int H,
                            int Hkv, int block_size, float scale) {
    return dispatch(1, D, G, q, q_stride, k_cache, v_cache, tables, table_stride, lens, out, n,
                    h0, h1, H, Hkv, block_size, scale);
}

#else

int decode_item_avx2_f32(int D, int G, const float *q, long q_stride, const float *k_cache,
                         const float *v_cache, const int32_t *tables, long table_stride,
                         const int32_t *lens, float *out, int n, int h0, int h1, int H, int Hkv,
                         int block_size, float scale) {
    (void)D, (void)G, (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)tables;
    (void)table_stride, (void)lens, (void)out, (void)n, (void)h0, (void)h1, (void)H, (void)Hkv;
    (void)block_size, (void)scale;
    return 0; /* AVX-512 builds use their own item; others without AVX2 the portable loop */
}

#endif
