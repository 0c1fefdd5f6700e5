/* float32 prefill attention for CPUs with AVX2 and FMA but no AVX-512: one chunk of q_len
 * queries at positions k_len - q_len .. k_len - 1 over all k_len keys of its sequence,
 * read from the paged cache (the chunk's own K/V already written there), causal. The
 * contract of prefill_attention.c's bf16 kernel, in float32; the reference is SDPA with
 * a causal mask (sarazmq.kernels.torch_attention).
 *
 * SDPA's CPU kernel, the path float32 chunks took before, splits a chunk of up to 512
 * keys into one key block, so its causal mask saves nothing: it computes the whole
 * square and runs causal chunks at half its unmasked rate (docs/KERNELS.md, "CPU
 * attention"). Here each row group stops at its last row, to 16 keys.
 *
 * Phase 1 packs each KV head's keys in runs of 8: K transposed to [D][8] (a vector holds
 * one dimension of 8 keys, so scores need no horizontal sums), V as [8][D] rows. Phase 2:
 * work items of 6 query rows of one query head, latest rows first; per step of 64 keys
 * (the last one as many 16-key pieces as the rows reach): the rows' scores 16 keys at a
 * time (broadcast query element x packed K: 6 x 2 accumulators, the most AVX2's 16
 * registers hold beside two key vectors and a broadcast; with fewer, the FMA latency
 * bounds it), one online-softmax update per row, then the probabilities times the V rows
 * into the rows' output accumulators (in L1: 6 rows x D floats, 16 columns at a time).
 */
#include <string.h>

#include "common.h"
#include "kernels.h"

#if defined(AVX2_ONLY)
#define HAVE_PREFILL_F32 1

#define PF_ROWS 6 /* query rows per work item (see the header) */
#define PF_MAX_D 128
#define PF_STEP 64 /* keys a step: one softmax update per row */

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

/* Run `run` (keys 8 run .. 8 run + 7) of KV head h: K to kp as [D][8], V to vp as [8][D];
 * keys past k_len as zeros (their probabilities are masked to 0 anyway). */
static void pack_run_f32(const float *k_cache, const float *v_cache, const int32_t *table,
                         int k_len, int run, int h, int Hkv, int D, int block_size, float *kp,
                         float *vp) {
    static const float zeros[PF_MAX_D];
    const long tok_stride = (long)Hkv * D, block_elems = (long)block_size * tok_stride;
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
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(kp + (d0 + i) * 8, r[i]);
    }
    for (int t = 0; t < 8; t++) memcpy(vp + t * D, vrow[t], sizeof(float) * (size_t)D);
}

/* The scores of the PF_ROWS rows qr[r] against the 16 keys of packed runs k0 and
 * k0 + 8 D, scaled, into s[r][col .. col + 15]. */
static inline __attribute__((always_inline)) void scores16(const int D, const float *const *qr,
                                                           const float *k0, __m256 sc,
                                                           float s[][PF_STEP], int col) {
    const float *k1 = k0 + 8L * D;
    __m256 a[PF_ROWS][2]; /* 2 x PF_ROWS accumulators, all in registers once unrolled */
#pragma GCC unroll 8
    for (int r = 0; r < PF_ROWS; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int d = 0; d < D; d++) {
        const __m256 kv0 = _mm256_load_ps(k0 + d * 8), kv1 = _mm256_load_ps(k1 + d * 8);
#pragma GCC unroll 8
        for (int r = 0; r < PF_ROWS; r++) {
            const __m256 qb = _mm256_broadcast_ss(qr[r] + d);
            a[r][0] = _mm256_fmadd_ps(qb, kv0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(qb, kv1, a[r][1]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < PF_ROWS; r++) {
        _mm256_store_ps(s[r] + col, _mm256_mul_ps(a[r][0], sc));
        _mm256_store_ps(s[r] + col + 8, _mm256_mul_ps(a[r][1], sc));
    }
}

/* o[r][j .. j + 15] += sum over the step's n keys of p[r][t] V[t][j .. j + 15] */
static inline __attribute__((always_inline)) void add_pv16(const int D, const float *vs, int n,
                                                           float p[][PF_STEP],
                                                           float o[][PF_MAX_D], int j) {
    __m256 a[PF_ROWS][2];
#pragma GCC unroll 8
    for (int r = 0; r < PF_ROWS; r++) {
        a[r][0] = _mm256_load_ps(o[r] + j);
        a[r][1] = _mm256_load_ps(o[r] + j + 8);
    }
    for (int t = 0; t < n; t++) {
        const __m256 v0 = _mm256_loadu_ps(vs + t * D + j), v1 = _mm256_loadu_ps(vs + t * D + j + 8);
#pragma GCC unroll 8
        for (int r = 0; r < PF_ROWS; r++) {
            const __m256 pr = _mm256_broadcast_ss(&p[r][t]);
            a[r][0] = _mm256_fmadd_ps(pr, v0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(pr, v1, a[r][1]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < PF_ROWS; r++) {
        _mm256_store_ps(o[r] + j, a[r][0]);
        _mm256_store_ps(o[r] + j + 8, a[r][1]);
    }
}

/* PF_ROWS query rows (positions ctx + q0 .. of query head hq; rows past the chunk repeat
 * its last row and are not stored) over the packed keys up to the last row's position,
 * PF_STEP keys a step (the last step only as many 16-key pieces as reach that position):
 * scores, one online-softmax update per row and step, then the V rows. */
static inline __attribute__((always_inline)) void prefill_rows_f32(
    const int D, const float *q, long q_stride, const float *kp, const float *vp, int q0,
    int nr, int ctx, int hq, float scale, float *out, long out_stride) {
    __attribute__((aligned(32))) float o[PF_ROWS][PF_MAX_D];
    __attribute__((aligned(32))) float sp[PF_ROWS][PF_STEP]; /* scores, then probabilities */
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
    const int last = pos[PF_ROWS - 1];
    const __m256 sc = _mm256_set1_ps(scale), neg_inf = _mm256_set1_ps(-INFINITY);
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    for (int key0 = 0; key0 <= last; key0 += PF_STEP) {
        /* keys key0 .. key0 + n - 1 this step, whole 16-key pieces */
        const int n = last - key0 >= PF_STEP ? PF_STEP : (last - key0) / 16 * 16 + 16;
        for (int col = 0; col < n; col += 16)
            scores16(D, qr, kp + (long)(key0 + col) * D, sc, sp, col);
        for (int r = 0; r < PF_ROWS; r++) {
            /* causal: key key0 + t is visible to the row at position pos[r] */
            const __m256 lim = _mm256_set1_ps((float)(pos[r] - key0));
            __m256 mx = neg_inf;
            for (int c = 0; c < n; c += 8) {
                const __m256 live = _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps((float)c)),
                                                  lim, _CMP_LE_OQ);
                const __m256 x = _mm256_blendv_ps(neg_inf, _mm256_load_ps(sp[r] + c), live);
                _mm256_store_ps(sp[r] + c, x);
                mx = _mm256_max_ps(mx, x);
            }
            const float bm = hmax8(mx); /* -inf: no key visible to this row here */
            if (bm > m[r]) { /* a new maximum: rescale what was summed so far */
                const float corr = exp_approx(m[r] - bm); /* ~0 on the first step */
                const __m256 cv = _mm256_set1_ps(corr);
                for (int j = 0; j < D; j += 8)
                    _mm256_store_ps(o[r] + j, _mm256_mul_ps(_mm256_load_ps(o[r] + j), cv));
                l[r] *= corr;
                m[r] = bm;
            }
            const __m256 mv = _mm256_set1_ps(m[r]);
            __m256 sum = _mm256_setzero_ps();
            for (int c = 0; c < n; c += 8) {
                const __m256 x = _mm256_load_ps(sp[r] + c);
                /* masked keys (-inf) to exactly 0: exp256 clamps its input */
                const __m256 pv = _mm256_and_ps(exp256(_mm256_sub_ps(x, mv)),
                                                _mm256_cmp_ps(x, neg_inf, _CMP_NEQ_OQ));
                _mm256_store_ps(sp[r] + c, pv);
                sum = _mm256_add_ps(sum, pv);
            }
            l[r] += hadd8(sum);
        }
        const float *vs = vp + (long)key0 * D;
        for (int j = 0; j < D; j += 16) add_pv16(D, vs, n, sp, o, j);
    }
    for (int r = 0; r < nr && r < PF_ROWS; r++) {
        float *orow = out + (long)(q0 + r) * out_stride + (long)hq * D;
        const __m256 inv = _mm256_set1_ps(1.0f / l[r]);
        for (int j = 0; j < D; j += 8)
            _mm256_storeu_ps(orow + j, _mm256_mul_ps(_mm256_load_ps(o[r] + j), inv));
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
 * floats, 32-byte aligned. */
int prefill_attention_f32(const float *q, long q_stride, const float *k_cache,
                          const float *v_cache, const int32_t *table, int q_len, int k_len,
                          int H, int Hkv, int D, int block_size, float scale, float *out,
                          long out_stride, long num_blocks, float *scratch) {
#ifdef HAVE_PREFILL_F32
    const int rc = prefill_check(table, q_len, k_len, H, Hkv, D, block_size, num_blocks);
    if (rc != 0) return rc;
    if (((uintptr_t)scratch & 31) != 0) return -1;
    const int G = H / Hkv, runs = (k_len + 15) / 16 * 2, ctx = k_len - q_len;
    const long run_elems = 8L * D; /* floats per packed run (K or V) */
    float *kp = scratch, *vp = kp + (long)Hkv * runs * run_elems;
#pragma omp parallel for schedule(static)
    for (long it = 0; it < (long)Hkv * runs; it++) {
        const int h = (int)(it / runs), run = (int)(it % runs);
        pack_run_f32(k_cache, v_cache, table, k_len, run, h, Hkv, D, block_size,
                     kp + it * run_elems, vp + it * run_elems);
    }
    const int groups = (q_len + PF_ROWS - 1) / PF_ROWS;
    /* latest rows first: they have the most keys, so the dynamic schedule ends balanced */
#pragma omp parallel for schedule(dynamic, 1)
    for (long it = 0; it < (long)H * groups; it++) {
        const int grp = groups - 1 - (int)(it / H), hq = (int)(it % H), h = hq / G;
        const int q0 = grp * PF_ROWS, nr = q_len - q0 < PF_ROWS ? q_len - q0 : PF_ROWS;
        const float *kh = kp + (long)h * runs * run_elems, *vh = vp + (long)h * runs * run_elems;
        if (D == 64)
            prefill_rows_f32(64, q, q_stride, kh, vh, q0, nr, ctx, hq, scale, out, out_stride);
        else
            prefill_rows_f32(128, q, q_stride, kh, vh, q0, nr, ctx, hq, scale, out, out_stride);
    }
    return 0;
#else
    PREFILL_NOT_BUILT();
#endif
}
