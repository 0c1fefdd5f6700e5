/* Prefill attention on CPUs with AVX512-BF16 (no AMX): one chunk of queries over its
 * sequence's keys in the paged cache, causal; and the checks every prefill kernel shares
 * (prefill_check, also used by prefill_amx.c and hybrid_step.c). Layouts as
 * cpu_attention.c's; the reference is SDPA with a causal mask
 * (sarazmq.kernels.torch_attention). */
#include <stdlib.h>

#include "common.h"
#include "kernels.h"

int prefill_check(const int32_t *table, int q_len, int k_len, int H, int Hkv, int D,
                  int block_size, long num_blocks) {
    if ((D != 64 && D != 128) || Hkv < 1 || H % Hkv != 0 || q_len < 1 || k_len < q_len ||
        block_size < 1)
        return -1;
    const int nblk = (k_len + block_size - 1) / block_size;
    for (int b = 0; b < nblk; b++)
        if (table[b] < 0 || table[b] >= num_blocks) return -2;
    return 0;
}

/* ------------------------------------------------------------------------------------
 * Prefill attention for bf16 on CPUs with AVX512-BF16: one chunk of q_len queries at
 * absolute positions k_len - q_len .. k_len - 1 over all k_len keys of its sequence, read
 * from the paged cache (the chunk's own K/V are already written there), causal.
 *
 * Phase 1 repacks each KV head's keys in runs of 16 so that VDPBF16PS does the dot
 * products with no horizontal sums: K as [D/2 pairs][16 keys] of 32-bit (two adjacent
 * dims of one key), V as [8 key pairs][D] of 32-bit (one dim of two adjacent keys).
 * Phase 2: work items of R query rows of one query head; per run of 16 keys, R rows of
 * scores (broadcast query pair x packed keys), an online-softmax update in float32, the
 * probabilities rounded to bf16 (as SDPA's CPU kernel does for bf16 before its second
 * matmul) and multiplied into the R output rows (broadcast probability pair x packed V).
 * The reference is SDPA with a causal mask (sarazmq.kernels.torch_attention).
 * ------------------------------------------------------------------------------------ */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_PREFILL_BF16 1

/* Runs of 16 keys: K packed [D/2][16] and V packed [8][D], both 32-bit words (the layouts
 * of AMX's B tiles too: prefill_amx.c packs with this). */
void prefill_pack_kv_run(const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table,
                        int k_len, int run, int h, int Hkv, int D, int block_size,
                        uint32_t *kp, uint32_t *vp) {
    const long tok_stride = (long)Hkv * D, block_elems = (long)block_size * tok_stride;
    const uint16_t *krow[16], *vrow[16];
    for (int t = 0; t < 16; t++) {
        const int j = run * 16 + t;
        if (j < k_len) {
            const long base = (long)table[j / block_size] * block_elems +
                              (long)(j % block_size) * tok_stride + (long)h * D;
            krow[t] = k_cache + base;
            vrow[t] = v_cache + base;
        } else {
            krow[t] = vrow[t] = NULL; /* past the sequence: zeros (masked anyway) */
        }
    }
    for (int p = 0; p < D / 2; p++)
        for (int t = 0; t < 16; t++) {
            uint32_t w = 0;
            if (krow[t]) memcpy(&w, krow[t] + 2 * p, sizeof w);
            kp[p * 16 + t] = w;
        }
    for (int kp2 = 0; kp2 < 8; kp2++) {
        const uint16_t *a = vrow[2 * kp2], *b = vrow[2 * kp2 + 1];
        for (int d = 0; d < D; d++)
            vp[kp2 * D + d] = (uint32_t)(a ? a[d] : 0) | ((uint32_t)(b ? b[d] : 0) << 16);
    }
}

/* R query rows (consecutive positions of query head hq) against the runs of keys up to
 * the last row's position, two runs (32 keys) per step: the softmax bookkeeping per row
 * and the query broadcasts are shared by twice the keys. */
static inline __attribute__((always_inline)) void prefill_rows(
    const int ND, const int R, const uint16_t *q, long q_stride, const uint32_t *kp,
    const uint32_t *vp, int q0, int nr, int ctx, int hq, int D, float scale, uint16_t *out,
    long out_stride) {
    const int DP = ND * 8; /* dim pairs */
    __m512 o[4][8], lsum[4];
    float m[4];
    const uint32_t *qw[4];
    for (int r = 0; r < R; r++) {
        const int rr = r < nr ? r : nr - 1; /* rows past the chunk repeat the last one */
        qw[r] = (const uint32_t *)(q + (long)(q0 + rr) * q_stride + (long)hq * D);
        for (int j = 0; j < ND; j++) o[r][j] = _mm512_setzero_ps();
        m[r] = -INFINITY;
        lsum[r] = _mm512_setzero_ps(); /* per-lane partial sums of the softmax denominator */
    }
    const int last_key = ctx + q0 + nr - 1; /* the last row's own position */
    const int runs = last_key / 16 + 1;
    const __m512 sc = _mm512_set1_ps(scale);
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int run = 0; run < runs; run += 2) {
        const int two = run + 1 < runs; /* a second run in this step */
        const uint32_t *kr0 = kp + (long)run * DP * 16, *kr1 = two ? kr0 + DP * 16 : kr0;
        const uint32_t *vr = vp + (long)run * 8 * D;
        __m512 s0[4], s1[4];
        for (int r = 0; r < R; r++) s0[r] = s1[r] = _mm512_setzero_ps();
        for (int p = 0; p < DP; p++) {
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kr0 + p * 16);
            const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kr1 + p * 16);
            for (int r = 0; r < R; r++) {
                const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qw[r][p]);
                s0[r] = _mm512_dpbf16_ps(s0[r], qb, k0);
                s1[r] = _mm512_dpbf16_ps(s1[r], qb, k1);
            }
        }
        __attribute__((aligned(64))) uint16_t pb[4][32];
        for (int r = 0; r < R; r++) {
            /* causal: key run * 16 + t is visible to the row at position ctx + q0 + r */
            const int limit = ctx + q0 + (r < nr ? r : nr - 1) - run * 16; /* last lane */
            const __mmask16 live0 =
                _mm512_cmple_epi32_mask(lane, _mm512_set1_epi32(limit < 15 ? limit : 15));
            const __mmask16 live1 =
                two ? _mm512_cmple_epi32_mask(lane, _mm512_set1_epi32(limit - 16 < 15 ? limit - 16 : 15))
                    : 0;
            const __m512 x0 = _mm512_mask_mov_ps(neg_inf, live0, _mm512_mul_ps(s0[r], sc));
            const __m512 x1 = _mm512_mask_mov_ps(neg_inf, live1, _mm512_mul_ps(s1[r], sc));
            const float bm = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));
            if (bm > m[r]) {
                const float corr = exp_approx(m[r] - bm); /* 0 on the first step */
                const __m512 cv = _mm512_set1_ps(corr);
                for (int j = 0; j < ND; j++) o[r][j] = _mm512_mul_ps(o[r][j], cv);
                lsum[r] = _mm512_mul_ps(lsum[r], cv);
                m[r] = bm;
            }
            const __m512 mv = _mm512_set1_ps(m[r]);
            const __m512 p0 = _mm512_maskz_mov_ps(live0, exp512(_mm512_sub_ps(x0, mv)));
            const __m512 p1 = _mm512_maskz_mov_ps(live1, exp512(_mm512_sub_ps(x1, mv)));
            lsum[r] = _mm512_add_ps(lsum[r], _mm512_add_ps(p0, p1));
            _mm512_store_si512((__m512i *)pb[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        }
        const int pairs = two ? 16 : 8;
        for (int kk = 0; kk < pairs; kk++) {
            __m512bh vv[8];
            for (int j = 0; j < ND; j++)
                vv[j] = (__m512bh)_mm512_loadu_si512(vr + kk * D + 16 * j);
            for (int r = 0; r < R; r++) {
                uint32_t w;
                memcpy(&w, &pb[r][2 * kk], sizeof w);
                const __m512bh pw = (__m512bh)_mm512_set1_epi32((int)w);
                for (int j = 0; j < ND; j++) o[r][j] = _mm512_dpbf16_ps(o[r][j], pw, vv[j]);
            }
        }
    }
    for (int r = 0; r < nr && r < R; r++) {
        uint16_t *orow = out + (long)(q0 + r) * out_stride + (long)hq * D;
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(lsum[r]));
        for (int j = 0; j < ND; j++)
            _mm256_storeu_si256((__m256i *)(orow + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(o[r][j], inv)));
    }
}
#endif

/* Returns 0; -1 when this build or these sizes have no native prefill (the caller falls
 * back); -2, touching nothing, when a block id would reach outside the cache.
 * q: [q_len, H, D] with token stride q_stride; out: [q_len, H, D] with token stride
 * out_stride; table: the sequence's block ids; scratch: 2 * Hkv * ceil(k_len / 16) * 16 * D
 * bf16 elements. */
int prefill_attention_bf16(const uint16_t *q, long q_stride, const uint16_t *k_cache,
                           const uint16_t *v_cache, const int32_t *table, int q_len, int k_len,
                           int H, int Hkv, int D, int block_size, float scale, uint16_t *out,
                           long out_stride, long num_blocks, uint16_t *scratch) {
#ifdef HAVE_PREFILL_BF16
    const int rc = prefill_check(table, q_len, k_len, H, Hkv, D, block_size, num_blocks);
    if (rc != 0) return rc;
    const int G = H / Hkv, runs = (k_len + 15) / 16, ctx = k_len - q_len;
    const long run_words = 16L * D / 2; /* 32-bit words per packed run (K or V) */
    uint32_t *kp = (uint32_t *)scratch;
    uint32_t *vp = kp + (long)Hkv * runs * run_words;
#pragma omp parallel for schedule(static)
    for (long it = 0; it < (long)Hkv * runs; it++) {
        const int h = (int)(it / runs), run = (int)(it % runs);
        prefill_pack_kv_run(k_cache, v_cache, table, k_len, run, h, Hkv, D, block_size,
                    kp + it * run_words, vp + it * run_words);
    }
    const int R = D == 64 ? 4 : 2; /* rows per item: what the registers hold */
    const int groups = (q_len + R - 1) / R;
    /* latest rows first: they have the most keys, so the dynamic schedule ends balanced */
#pragma omp parallel for schedule(dynamic, 1)
    for (long it = 0; it < (long)H * groups; it++) {
        const int grp = groups - 1 - (int)(it / H), hq = (int)(it % H), h = hq / G;
        const int q0 = grp * R, nr = q_len - q0 < R ? q_len - q0 : R;
        const uint32_t *kh = kp + (long)h * runs * run_words;
        const uint32_t *vh = vp + (long)h * runs * run_words;
        if (D == 64)
            prefill_rows(4, 4, q, q_stride, kh, vh, q0, nr, ctx, hq, 64, scale, out,
                         out_stride);
        else
            prefill_rows(8, 2, q, q_stride, kh, vh, q0, nr, ctx, hq, 128, scale, out,
                         out_stride);
    }
    return 0;
#else
    PREFILL_NOT_BUILT();
#endif
}
