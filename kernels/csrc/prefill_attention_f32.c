/* float32 prefill attention for CPUs with AVX2 and FMA: one chunk of q_len queries at
 * positions k_len - q_len .. k_len - 1 over all k_len keys of its sequence, read from the
 * paged cache (the chunk's own K/V already written there), causal. The contract of
 * prefill_attention.c's bf16 kernel, in float32; the reference is SDPA with a causal mask
 * (sarazmq.kernels.torch_attention).
 *
 * SDPA's CPU kernel, the path float32 chunks took before, splits a chunk of up to 512
 * keys into one key block, so its causal mask saves nothing: it computes the whole
 * square and runs causal chunks at half its unmasked rate (docs/KERNELS.md, "CPU
 * attention"). Here each row group stops at its last row, to 16 keys.
 *
 * Phase 1 packs each KV head's keys in pieces of 16: K transposed to [D][16] (a vector
 * holds one dimension of 8 or 16 keys, so scores need no horizontal sums), V as [16][D]
 * rows. Phase 2: work items of PF_ROWS query rows of one query head, latest rows first;
 * per step of 64 keys (the last one as many 16-key pieces as the rows reach): the rows'
 * scores a piece at a time (broadcast query element x packed K), one online-softmax
 * update per row, then the probabilities times the V rows into the rows' output
 * accumulators (in L1: PF_ROWS rows x D floats, two vectors of columns at a time).
 *
 * prefill_attention_i8_f32 runs the same phase 2 over an int8 cache read in place (AVX512-
 * VNNI builds): K and V packed as int16 pairs, the products in integers (prefill_int8.h).
 *
 * One source for two widths: 8-lane vectors on AVX2 builds (6 rows: 12 accumulators, the
 * most AVX2's 16 registers hold beside the key vectors and a broadcast; with fewer, the
 * FMA latency bounds it) and 16-lane ones on AVX-512 builds (12 rows: 12 score and 24
 * output accumulators of 32 registers); the pf_* helpers below are the only
 * width-specific code.
 */
#include <string.h>

#include "common.h"
#include "kernels.h"

#if defined(__AVX512F__)
#define HAVE_PREFILL_F32 1
#define PF_LANES 16
#define PF_ROWS 12
typedef __m512 pf_vec;
#define pf_load _mm512_load_ps
#define pf_loadu _mm512_loadu_ps
#define pf_store _mm512_store_ps
#define pf_storeu _mm512_storeu_ps
#define pf_set1 _mm512_set1_ps
#define pf_zero _mm512_setzero_ps
#define pf_fmadd _mm512_fmadd_ps
#define pf_mul _mm512_mul_ps
#define pf_add _mm512_add_ps
#define pf_sub _mm512_sub_ps
#define pf_max _mm512_max_ps
#define pf_exp exp512
#define pf_hmax _mm512_reduce_max_ps
#define pf_hadd _mm512_reduce_add_ps
static inline pf_vec pf_lane_index(void) {
    return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
/* x where idx <= lim, else -inf (keys past the row's position) */
static inline pf_vec pf_visible(pf_vec x, pf_vec idx, pf_vec lim) {
    return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), _mm512_cmp_ps_mask(idx, lim, _CMP_LE_OQ), x);
}
/* p where x is not -inf, else exactly 0 */
static inline pf_vec pf_zero_masked(pf_vec p, pf_vec x) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), p);
}
#elif defined(AVX2_ONLY)
#define HAVE_PREFILL_F32 1
#define PF_LANES 8
#define PF_ROWS 6
typedef __m256 pf_vec;
#define pf_load _mm256_load_ps
#define pf_loadu _mm256_loadu_ps
#define pf_store _mm256_store_ps
#define pf_storeu _mm256_storeu_ps
#define pf_set1 _mm256_set1_ps
#define pf_zero _mm256_setzero_ps
#define pf_fmadd _mm256_fmadd_ps
#define pf_mul _mm256_mul_ps
#define pf_add _mm256_add_ps
#define pf_sub _mm256_sub_ps
#define pf_max _mm256_max_ps
#define pf_exp exp256
#define pf_hmax hmax8
#define pf_hadd hadd8
static inline pf_vec pf_lane_index(void) { return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); }
static inline pf_vec pf_visible(pf_vec x, pf_vec idx, pf_vec lim) {
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, _mm256_cmp_ps(idx, lim, _CMP_LE_OQ));
}
static inline pf_vec pf_zero_masked(pf_vec p, pf_vec x) {
    return _mm256_and_ps(p, _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
}
#endif

#if defined(HAVE_PREFILL_F32)
#define PF_MAX_D 128
#define PF_STEP 64  /* keys a step: one softmax update per row */
#define PF_PIECE 16 /* keys a piece: the causal granularity and the packing unit */
#define PF_KV (PF_PIECE / PF_LANES) /* vectors a piece's dimension holds */

/* r[t] (8 keys' row pieces) -> r[i] (one dimension of the 8 keys) */
static inline __attribute__((always_inline)) void transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* Keys 8 run .. 8 run + 7 of KV head h into their piece (run / 2): K into kp, the piece's
 * [D][16], at lanes 8 (run % 2) ..; V into vp, the piece's [16][D], at rows 8 (run % 2) ..;
 * keys past k_len as zeros (their probabilities are masked to 0 anyway). */
static void pack_run_f32(const float *k_cache, const float *v_cache, const int32_t *table,
                         int k_len, int run, int h, int Hkv, int D, int block_size, float *kp,
                         float *vp) {
    static const float zeros[PF_MAX_D];
    const long tok_stride = (long)Hkv * D, block_elems = (long)block_size * tok_stride;
    const int half = run % 2;
    const float *krow[8], *vrow[8];
    for (int t = 0; t < 8; t++) {
        const int j = run * 8 + t;
        if (j < k_len) {
            const long base = (long)table[j / block_size] * block_elems +
                              (long)(j % block_size) * tok_stride + (long)h * D;
            krow[t] = k_cache + base;
            vrow[t] = v_cache + base;
        } else {
            krow[t] = vrow[t] = zeros;
        }
    }
    for (int d0 = 0; d0 < D; d0 += 8) {
        __m256 r[8];
        for (int t = 0; t < 8; t++) r[t] = _mm256_loadu_ps(krow[t] + d0);
        transpose8(r);
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(kp + (d0 + i) * PF_PIECE + 8 * half, r[i]);
    }
    for (int t = 0; t < 8; t++)
        memcpy(vp + (8 * half + t) * D, vrow[t], sizeof(float) * (size_t)D);
}

#include "prefill_int8.h"

/* The scores of the PF_ROWS rows qr[r] against the packed piece k ([D][16]), scaled, into
 * s[r][col .. col + 15]. */
static inline __attribute__((always_inline)) void scores16(const int D, const float *const *qr,
                                                           const float *k, pf_vec sc,
                                                           float s[][PF_STEP], int col) {
    pf_vec a[PF_ROWS][PF_KV]; /* all in registers once unrolled */
#pragma GCC unroll 12
    for (int r = 0; r < PF_ROWS; r++)
        for (int v = 0; v < PF_KV; v++) a[r][v] = pf_zero();
    for (int d = 0; d < D; d++) {
        pf_vec kv[PF_KV];
        for (int v = 0; v < PF_KV; v++) kv[v] = pf_load(k + d * PF_PIECE + v * PF_LANES);
#pragma GCC unroll 12
        for (int r = 0; r < PF_ROWS; r++) {
            const pf_vec qb = pf_set1(qr[r][d]);
            for (int v = 0; v < PF_KV; v++) a[r][v] = pf_fmadd(qb, kv[v], a[r][v]);
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < PF_ROWS; r++)
        for (int v = 0; v < PF_KV; v++) pf_store(s[r] + col + v * PF_LANES, pf_mul(a[r][v], sc));
}

/* o[r][j .. j + 2 PF_LANES - 1] += sum over the step's n keys of p[r][t] V[t][j ..] */
static inline __attribute__((always_inline)) void add_pv(const int D, const float *vs, int n,
                                                         float p[][PF_STEP],
                                                         float o[][PF_MAX_D], int j) {
    pf_vec a[PF_ROWS][2];
#pragma GCC unroll 12
    for (int r = 0; r < PF_ROWS; r++) {
        a[r][0] = pf_load(o[r] + j);
        a[r][1] = pf_load(o[r] + j + PF_LANES);
    }
    for (int t = 0; t < n; t++) {
        const pf_vec v0 = pf_loadu(vs + t * D + j), v1 = pf_loadu(vs + t * D + j + PF_LANES);
#pragma GCC unroll 12
        for (int r = 0; r < PF_ROWS; r++) {
            const pf_vec pr = pf_set1(p[r][t]);
            a[r][0] = pf_fmadd(pr, v0, a[r][0]);
            a[r][1] = pf_fmadd(pr, v1, a[r][1]);
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < PF_ROWS; r++) {
        pf_store(o[r] + j, a[r][0]);
        pf_store(o[r] + j + PF_LANES, a[r][1]);
    }
}

/* PF_ROWS query rows (positions ctx + q0 .. of query head hq; rows past the chunk repeat
 * its last row and are not stored) over the packed keys up to the last row's position,
 * PF_STEP keys a step (the last step only as many 16-key pieces as reach that position):
 * scores, one online-softmax update per row and step, then the V rows. */
static inline __attribute__((always_inline)) void prefill_rows_f32(
    const int D, const int I16, const float *q, long q_stride, const void *kp, const void *vp,
    const float *dk, const float *dv, int q0, int nr, int ctx, int hq, float scale, float *out,
    long out_stride) {
    __attribute__((aligned(64))) float o[PF_ROWS][PF_MAX_D];
    __attribute__((aligned(64))) float sp[PF_ROWS][PF_STEP]; /* scores, then probabilities */
    float m[PF_ROWS], l[PF_ROWS];
    const float *qr[PF_ROWS];
    int pos[PF_ROWS];
    for (int r = 0; r < PF_ROWS; r++) {
        const int rr = r < nr ? r : nr - 1;
        qr[r] = q + (long)(q0 + rr) * q_stride + (long)hq * D;
        pos[r] = ctx + q0 + rr;
        memset(o[r], 0, sizeof(float) * (size_t)D);
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
#if defined(HAVE_PREFILL_I8)
    /* int8 keys: the rows as int16, each with its scale times the softmax scale */
    __attribute__((aligned(64))) int16_t q16[PF_ROWS][PF_MAX_D];
    float rs[PF_ROWS];
    if (I16)
        for (int r = 0; r < PF_ROWS; r++) rs[r] = quantize_q16(qr[r], D, q16[r]) * scale;
#else
    (void)I16, (void)dk, (void)dv;
#endif
    const int last = pos[PF_ROWS - 1];
    const pf_vec sc = pf_set1(scale), lane = pf_lane_index();
    for (int key0 = 0; key0 <= last; key0 += PF_STEP) {
        /* keys key0 .. key0 + n - 1 this step, whole 16-key pieces */
        const int n = last - key0 >= PF_STEP ? PF_STEP : (last - key0) / PF_PIECE * PF_PIECE + PF_PIECE;
        for (int col = 0; col < n; col += PF_PIECE) {
#if defined(HAVE_PREFILL_I8)
            if (I16) {
                scores16_i16(D, (const int16_t(*)[PF_MAX_D])q16, rs,
                             (const int32_t *)kp + (long)(key0 + col) * (D / 2), dk + key0 + col,
                             sp, col);
                continue;
            }
#endif
            scores16(D, qr, (const float *)kp + (long)(key0 + col) * D, sc, sp, col);
        }
        for (int r = 0; r < PF_ROWS; r++) {
            /* causal: key key0 + t is visible to the row at position pos[r] */
            const pf_vec lim = pf_set1((float)(pos[r] - key0));
            pf_vec mx = pf_set1(-INFINITY);
            for (int c = 0; c < n; c += PF_LANES) {
                const pf_vec x = pf_visible(pf_load(sp[r] + c), pf_add(lane, pf_set1((float)c)), lim);
                pf_store(sp[r] + c, x);
                mx = pf_max(mx, x);
            }
            const float bm = pf_hmax(mx); /* -inf: no key visible to this row here */
            if (bm > m[r]) { /* a new maximum: rescale what was summed so far */
                const float corr = exp_approx(m[r] - bm); /* ~0 on the first step */
                const pf_vec cv = pf_set1(corr);
                for (int j = 0; j < D; j += PF_LANES) pf_store(o[r] + j, pf_mul(pf_load(o[r] + j), cv));
                l[r] *= corr;
                m[r] = bm;
            }
            const pf_vec mv = pf_set1(m[r]);
            pf_vec sum = pf_zero();
            for (int c = 0; c < n; c += PF_LANES) {
                const pf_vec x = pf_load(sp[r] + c);
                /* masked keys (-inf) to exactly 0: the exp clamps its input */
                const pf_vec pv = pf_zero_masked(pf_exp(pf_sub(x, mv)), x);
                pf_store(sp[r] + c, pv);
                sum = pf_add(sum, pv);
            }
            l[r] += pf_hadd(sum);
        }
#if defined(HAVE_PREFILL_I8)
        if (I16) {
            __attribute__((aligned(64))) int32_t pp[PF_ROWS][PF_STEP / 2];
            float ps[PF_ROWS];
            for (int r = 0; r < PF_ROWS; r++) ps[r] = quantize_p16(sp[r], dv + key0, n, pp[r]);
            const int32_t *vs = (const int32_t *)vp + (long)key0 / 2 * D;
            for (int j = 0; j < D; j += 32) add_pv_i16(D, vs, n, pp, ps, o, j);
            continue;
        }
#endif
        const float *vs = (const float *)vp + (long)key0 * D;
        for (int j = 0; j < D; j += 2 * PF_LANES) add_pv(D, vs, n, sp, o, j);
    }
    for (int r = 0; r < nr && r < PF_ROWS; r++) {
        float *orow = out + (long)(q0 + r) * out_stride + (long)hq * D;
        const pf_vec inv = pf_set1(1.0f / l[r]);
        for (int j = 0; j < D; j += PF_LANES) pf_storeu(orow + j, pf_mul(pf_load(o[r] + j), inv));
    }
}
#endif

#if defined(HAVE_PREFILL_F32)
/* Phase 2 of both entries: work items of PF_ROWS query rows of one query head over its KV
 * head's packed keys and values (kp, vp: k_head, v_head 4-byte words a head, floats or,
 * I16, int16 pairs; dk, dv: the int8 rows' scales, PF_PIECE-padded keys a head). */
static void prefill_items(const int I16, const float *q, long q_stride, const float *kp,
                          long k_head, const float *vp, long v_head, const float *dk,
                          const float *dv, int q_len, int k_len, int H, int G, int D,
                          float scale, float *out, long out_stride) {
    const int groups = (q_len + PF_ROWS - 1) / PF_ROWS, ctx = k_len - q_len;
    const long s_head = (k_len + PF_PIECE - 1) / PF_PIECE * PF_PIECE;
    /* latest rows first: they have the most keys, so the dynamic schedule ends balanced */
#pragma omp parallel for schedule(dynamic, 1)
    for (long it = 0; it < (long)H * groups; it++) {
        const int grp = groups - 1 - (int)(it / H), hq = (int)(it % H), h = hq / G;
        const int q0 = grp * PF_ROWS, nr = q_len - q0 < PF_ROWS ? q_len - q0 : PF_ROWS;
        const float *kh = kp + h * k_head, *vh = vp + h * v_head;
        const float *dkh = I16 ? dk + h * s_head : NULL, *dvh = I16 ? dv + h * s_head : NULL;
        if (I16 && D == 64)
            prefill_rows_f32(64, 1, q, q_stride, kh, vh, dkh, dvh, q0, nr, ctx, hq, scale, out, out_stride);
        else if (I16)
            prefill_rows_f32(128, 1, q, q_stride, kh, vh, dkh, dvh, q0, nr, ctx, hq, scale, out, out_stride);
        else if (D == 64)
            prefill_rows_f32(64, 0, q, q_stride, kh, vh, NULL, NULL, q0, nr, ctx, hq, scale, out, out_stride);
        else
            prefill_rows_f32(128, 0, q, q_stride, kh, vh, NULL, NULL, q0, nr, ctx, hq, scale, out, out_stride);
    }
}
#endif

int prefill_f32_supported(void) {
#ifdef HAVE_PREFILL_F32
    return 1;
#else
    return 0;
#endif
}

/* Returns 0; -1 when this build or these sizes have no native float32 prefill (the caller
 * falls back); -2, touching nothing, when a block id would reach outside the cache.
 * q: [q_len, H, D] with token stride q_stride; out: [q_len, H, D] with token stride
 * out_stride; table: the sequence's block ids; scratch: 2 * Hkv * ceil(k_len / 16) * 16 * D
 * floats, 64-byte aligned. */
int prefill_attention_f32(const float *q, long q_stride, const float *k_cache,
                          const float *v_cache, const int32_t *table, int q_len, int k_len,
                          int H, int Hkv, int D, int block_size, float scale, float *out,
                          long out_stride, long num_blocks, float *scratch) {
#ifdef HAVE_PREFILL_F32
    const int rc = prefill_check(table, q_len, k_len, H, Hkv, D, block_size, num_blocks);
    if (rc != 0) return rc;
    if (((uintptr_t)scratch & 63) != 0) return -1; /* aligned vector loads */
    const int G = H / Hkv, runs = (k_len + 15) / 16 * 2;
    const long run_elems = 8L * D; /* floats per packed run (K or V) */
    float *kp = scratch, *vp = kp + (long)Hkv * runs * run_elems;
#pragma omp parallel for schedule(static)
    for (long it = 0; it < (long)Hkv * runs; it++) {
        const int h = (int)(it / runs), run = (int)(it % runs);
        /* the run's piece: runs is even, so it - it % 2 is the piece's first run */
        pack_run_f32(k_cache, v_cache, table, k_len, run, h, Hkv, D, block_size,
                     kp + (it - it % 2) * run_elems, vp + (it - it % 2) * run_elems);
    }
    prefill_items(0, q, q_stride, kp, (long)runs * run_elems, vp, (long)runs * run_elems, NULL,
                  NULL, q_len, k_len, H, G, D, scale, out, out_stride);
    return 0;
#else
    PREFILL_NOT_BUILT();
#endif
}

int prefill_i8_f32_supported(void) {
#ifdef HAVE_PREFILL_I8
    return 1;
#else
    return 0;
#endif
}

/* prefill_attention_f32 over an int8 cache (kv_int8.c's rows, [num_blocks, block_size, Hkv,
 * D + 4]) read in place, on AVX512-VNNI builds (-1 elsewhere: the caller dequantizes the
 * context and runs prefill_attention_f32). Both products are exact integer sums: the int8
 * keys times each query row rounded to int16 (quantize_q16), and the int8 values times
 * each step's probabilities (with their V rows' scales) rounded to int16 (quantize_p16);
 * the softmax is prefill_attention_f32's. scratch: prefill_attention_f32's size or more
 * (the int16 pairs of K and V, then the rows' scales), 64-byte aligned. */
int prefill_attention_i8_f32(const float *q, long q_stride, const int8_t *k_cache,
                             const int8_t *v_cache, const int32_t *table, int q_len, int k_len,
                             int H, int Hkv, int D, int block_size, float scale, float *out,
                             long out_stride, long num_blocks, float *scratch) {
#ifdef HAVE_PREFILL_I8
    const int rc = prefill_check(table, q_len, k_len, H, Hkv, D, block_size, num_blocks);
    if (rc != 0) return rc;
    if (((uintptr_t)scratch & 63) != 0) return -1; /* aligned vector loads */
    const int G = H / Hkv, pieces = (k_len + PF_PIECE - 1) / PF_PIECE;
    const long head_keys = (long)pieces * PF_PIECE, words = Hkv * head_keys * (D / 2);
    /* [Hkv][pieces] of: K pairs [D/2][16], V pairs [8][D] (words), then the scales [16] */
    int32_t *kp = (int32_t *)scratch, *vp = kp + words;
    float *dk = (float *)(vp + words), *dv = dk + Hkv * head_keys;
#pragma omp parallel for schedule(static)
    for (long it = 0; it < (long)Hkv * pieces; it++) {
        const int h = (int)(it / pieces), piece = (int)(it % pieces);
        pack_piece_i8(k_cache, v_cache, table, k_len, piece, h, Hkv, D, block_size,
                      kp + it * PF_PIECE * (D / 2), dk + it * PF_PIECE, vp + it * PF_PIECE * (D / 2),
                      dv + it * PF_PIECE);
    }
    prefill_items(1, q, q_stride, (const float *)kp, head_keys * (D / 2), (const float *)vp,
                  head_keys * (D / 2), dk, dv, q_len, k_len, H, G, D, scale, out, out_stride);
    return 0;
#else
    PREFILL_NOT_BUILT();
#endif
}
