/* Prefill attention for bf16 on CPUs with AMX (Intel Sapphire Rapids and later): one chunk
 * of q_len queries at absolute positions k_len - q_len .. k_len - 1 over all k_len keys of
 * its sequence, read from the paged cache (the chunk's own K/V already written there),
 * causal. The same contract as prefill_attention_bf16 (prefill_attention.c), whose packed K/V
 * layouts are exactly AMX's B-tile ("VNNI") layouts: K as [D/2 dim pairs][16 keys] and V
 * as [8 key pairs][D] of 32-bit words.
 *
 * Work items: 16 consecutive query rows of one query head (one A tile). Per step of 32
 * keys: the scores S = Q K^T as two 16 x 16 float32 tiles (TDPBF16PS over D/32 slices of
 * the queries), an online-softmax update in AVX-512 (float32, as SDPA's CPU kernel), the
 * probabilities rounded to bf16 (as SDPA does for bf16 before its second matmul) into an
 * A tile, and P V as D/16 tiles of 16 x 16 float32, added to the rescaled output rows.
 * The matmuls, which the AVX-512 kernel runs as VDPBF16PS (port bound), are ~100x denser
 * on the tiles; what is left is the softmax's vector work.
 *
 * Tiles: 0 queries (16 rows x 32 dims), 1 keys (16 dim pairs x 16 keys), 2 and 3 scores
 * (two runs of 16 keys), 4 probabilities (16 rows x 32 keys), 5 values (16 key pairs x
 * 16 dims), 6 the P V product of 16 dims. Each thread loads the configuration in the
 * parallel region (tile state is per thread) and releases it at the end.
 */
#include <stdlib.h>

#include "common.h"
#include "kernels.h"

#include "amx.h"

#ifdef HAVE_AMX_TILES
#define HAVE_PREFILL_AMX 1
#define AMX_MAX_D 128

/* 2^x for the softmax, ~3e-6 relative (probabilities are rounded to bf16 after, and
 * SDPA's CPU kernel uses a 20-bit exp too): 2^n by VSCALEFPS times a degree-4 polynomial
 * (near-minimax on [-0.5, 0.5]) of the fraction. The scores come in log2 units (scaled by
 * scale * log2 e in the one FMA that subtracts the maximum), so no multiply here. x must
 * be finite; exp2_softmax_clamped also takes -inf (the first step's old maximum). */
static inline __m512 exp2_softmax(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n); /* [-0.5, 0.5] */
    __m512 p = _mm512_set1_ps(9.5759919e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5918328e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4024600e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9312173e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9999928e-1f));
    return _mm512_scalef_ps(p, n); /* n below -149 gives 0 */
}

/* exp2_softmax for inputs that may be -inf (0 then): clamped to -200 first */
static inline __m512 exp2_softmax_clamped(__m512 x) {
    return exp2_softmax(_mm512_max_ps(x, _mm512_set1_ps(-200.0f)));
}

/* the rows (lanes) that see key `key`: those at positions >= it */
static inline __mmask16 live_mask(__m512i positions, int key) {
    return _mm512_cmpge_epi32_mask(positions, _mm512_set1_epi32(key));
}

/* every tile is 16 rows x 64 bytes here */
static const uint8_t TILE_ROWS[8] = {16, 16, 16, 16, 16, 16, 16, 16};

/* K and V of keys 32 g .. 32 g + 31 of KV head h for the tiles: K as it is ([32][D]
 * bf16, key rows), V transposed ([D][32] bf16, V^T rows); keys past k_len are zeros. */
static void pack_group(const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table,
                       int k_len, int g, int h, int Hkv, int D, int block_size, uint16_t *kn,
                       uint16_t *vt) {
    const long tok_stride = (long)Hkv * D, block_elems = (long)block_size * tok_stride;
    for (int t = 0; t < 32; t++) {
        const int j = g * 32 + t;
        if (j >= k_len) {
            memset(kn + t * D, 0, (size_t)D * 2);
            for (int d = 0; d < D; d++) vt[d * 32 + t] = 0;
            continue;
        }
        const long base =
            (long)table[j / block_size] * block_elems + (long)(j % block_size) * tok_stride + (long)h * D;
        memcpy(kn + t * D, k_cache + base, (size_t)D * 2);
        const uint16_t *vrow = v_cache + base;
        for (int d = 0; d < D; d++) vt[d * 32 + t] = vrow[d];
    }
}

/* Rows q0 .. q0 + nr - 1 (nr <= 16) of query head hq over the packed K (kn) and V^T (vt)
 * of its KV head. Everything is computed transposed, a query row per lane: the scores
 * S^T = K Q^T ([32 keys] x [16 rows] per step), so that the softmax's maxima and sums
 * over keys are lane-wise (no horizontal reductions), and O^T = V^T P^T. */
static void amx_rows(const uint16_t *q, long q_stride, const uint16_t *kn, const uint16_t *vt,
                     int q0, int nr, int ctx, int hq, int D, float scale, uint16_t *out,
                     long out_stride) {
    __attribute__((aligned(64))) uint32_t qt[AMX_MAX_D / 2 * 16]; /* Q^T: [D/2 pairs][16 rows] */
    __attribute__((aligned(64))) float st[64 * 16];               /* S^T: [64 keys][16 rows] */
    __attribute__((aligned(64))) uint32_t pt[32 * 16];            /* P^T: [32 key pairs][16 rows] */
    __attribute__((aligned(64))) float ot[AMX_MAX_D * 16];        /* O^T: [D][16 rows] */
    __attribute__((aligned(64))) float step[AMX_MAX_D * 16];      /* this step's V^T P^T */
    const int DP = D / 2;
    int pos[16];
    for (int r = 0; r < 16; r++) {
        const int rr = r < nr ? r : nr - 1; /* rows past the chunk repeat the last one */
        const uint32_t *qw = (const uint32_t *)(q + (long)(q0 + rr) * q_stride + (long)hq * D);
        for (int p = 0; p < DP; p++) qt[p * 16 + r] = qw[p];
        pos[r] = ctx + q0 + rr;
    }
    memset(ot, 0, sizeof(float) * 16 * (size_t)D);
    const __m512i posv = _mm512_loadu_si512(pos);
    /* scores to log2 units: exp(scale s - m) = 2^(scale log2(e) s - m log2(e)) */
    const __m512 sc = _mm512_set1_ps(scale * 1.44269504088896341f);
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    /* (p[2i][r], p[2i+1][r]) pairs from [p 2i lanes | p 2i+1 lanes] */
    const __m512i pair_idx = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
        19, 3, 18, 2, 17, 1, 16, 0);
    __m512 m = neg_inf, l = _mm512_setzero_ps();
    const int nkeys = ctx + q0 + nr; /* keys up to the last row's own position */
    for (int k0 = 0; k0 < nkeys; k0 += 64) {
        const uint16_t *kg = kn + (long)k0 * D; /* 64 key rows */
        const uint16_t *vg = vt + (long)k0 * D; /* two groups of [D][32] */
        _tile_zero(2);
        _tile_zero(3);
        _tile_zero(4);
        _tile_zero(5);
        for (int s = 0; s < D / 32; s++) { /* 32 dims (16 pairs) a slice */
            _tile_loadd(0, qt + s * 256, 64);
            _tile_loadd(1, kg + s * 32, D * 2);
            _tile_dpbf16ps(2, 1, 0);
            _tile_loadd(1, kg + 16 * D + s * 32, D * 2);
            _tile_dpbf16ps(3, 1, 0);
            _tile_loadd(1, kg + 32 * D + s * 32, D * 2);
            _tile_dpbf16ps(4, 1, 0);
            _tile_loadd(1, kg + 48 * D + s * 32, D * 2);
            _tile_dpbf16ps(5, 1, 0);
        }
        _tile_stored(2, st, 64);
        _tile_stored(3, st + 256, 64);
        _tile_stored(4, st + 512, 64);
        _tile_stored(5, st + 768, 64);
        /* causal: key k0 + t is visible to rows at positions >= it; only an item's last
         * steps have keys that some rows must not see */
        const int masked = k0 + 63 > ctx + q0;
        /* the unscaled scores' maximum (scale > 0), in four independent chains */
        __m512 raw_max[4] = {neg_inf, neg_inf, neg_inf, neg_inf};
        for (int t = 0; t < 64; t++) {
            const __m512 v = _mm512_load_ps(st + t * 16);
            __m512 *acc = &raw_max[t & 3];
            *acc = masked ? _mm512_mask_max_ps(*acc, live_mask(posv, k0 + t), *acc, v)
                          : _mm512_max_ps(*acc, v);
        }
        const __m512 step_max = _mm512_max_ps(_mm512_max_ps(raw_max[0], raw_max[1]),
                                              _mm512_max_ps(raw_max[2], raw_max[3]));
        const __m512 mx = _mm512_max_ps(m, _mm512_mul_ps(step_max, sc));
        const __m512 corr = exp2_softmax_clamped(_mm512_sub_ps(m, mx)); /* 0 on the first step */
        m = mx;
        __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int i = 0; i < 32; i++) {
            /* masked lanes may compute anything finite here: they are zeroed below */
            __m512 p0 = exp2_softmax(_mm512_fmsub_ps(_mm512_load_ps(st + 32 * i), sc, mx));
            __m512 p1 = exp2_softmax(_mm512_fmsub_ps(_mm512_load_ps(st + 32 * i + 16), sc, mx));
            if (masked) {
                p0 = _mm512_maskz_mov_ps(live_mask(posv, k0 + 2 * i), p0);
                p1 = _mm512_maskz_mov_ps(live_mask(posv, k0 + 2 * i + 1), p1);
            }
            sum[i & 1] = _mm512_add_ps(sum[i & 1], _mm512_add_ps(p0, p1));
            const __m512i pb = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
            _mm512_store_si512((__m512i *)(pt + i * 16), _mm512_permutexvar_epi16(pair_idx, pb));
        }
        l = _mm512_fmadd_ps(l, corr, _mm512_add_ps(sum[0], sum[1]));
        _tile_loadd(0, pt, 64);       /* P^T of keys 0-31 */
        _tile_loadd(1, pt + 256, 64); /* and 32-63 */
        for (int j = 0; j < D / 16; j += 2) { /* 16 dims a tile, two tiles in flight */
            _tile_zero(6);
            _tile_zero(7);
            _tile_loadd(2, vg + j * 512, 64);
            _tile_loadd(3, vg + 32 * D + j * 512, 64);
            _tile_loadd(4, vg + (j + 1) * 512, 64);
            _tile_loadd(5, vg + 32 * D + (j + 1) * 512, 64);
            _tile_dpbf16ps(6, 2, 0);
            _tile_dpbf16ps(7, 4, 0);
            _tile_dpbf16ps(6, 3, 1);
            _tile_dpbf16ps(7, 5, 1);
            _tile_stored(6, step + j * 256, 64);
            _tile_stored(7, step + (j + 1) * 256, 64);
        }
        for (int d = 0; d < D; d++)
            _mm512_store_ps(ot + d * 16, _mm512_fmadd_ps(_mm512_load_ps(ot + d * 16), corr,
                                                         _mm512_load_ps(step + d * 16)));
    }
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l);
    for (int d = 0; d < D; d++)
        _mm512_store_ps(ot + d * 16, _mm512_mul_ps(_mm512_load_ps(ot + d * 16), inv));
    for (int r = 0; r < nr; r++) {
        uint16_t *orow = out + (long)(q0 + r) * out_stride + (long)hq * D;
        for (int d = 0; d < D; d++) orow[d] = to_bf(ot[d * 16 + r]);
    }
}
#endif

/* 1 when this build has the AMX kernel and the process may use the tiles, else 0 */
int prefill_amx_supported(void) {
#ifdef HAVE_PREFILL_AMX
    return amx_tiles_granted();
#else
    return 0;
#endif
}

/* Returns 0; -1 when this build, this process (tile state refused) or these sizes have no
 * AMX prefill (the caller falls back); -2, touching nothing, when a block id would reach
 * outside the cache. Layouts as prefill_attention_bf16; scratch:
 * 2 * Hkv * ceil(k_len / 64) * 64 * D bf16 elements (K and V^T of each head, whole steps
 * of 64 keys). */
int prefill_attention_amx_bf16(const uint16_t *q, long q_stride, const uint16_t *k_cache,
                               const uint16_t *v_cache, const int32_t *table, int q_len,
                               int k_len, int H, int Hkv, int D, int block_size, float scale,
                               uint16_t *out, long out_stride, long num_blocks,
                               uint16_t *scratch) {
#ifdef HAVE_PREFILL_AMX
    const int rc = prefill_check(table, q_len, k_len, H, Hkv, D, block_size, num_blocks);
    if (rc != 0) return rc;
    if (!amx_tiles_granted()) return -1;
    const int G = H / Hkv, kgroups = (k_len + 63) / 64 * 2, ctx = k_len - q_len;
    const long head_elems = (long)kgroups * 32 * D; /* per KV head, K or V */
    uint16_t *kn = scratch, *vt = scratch + (long)Hkv * head_elems;
#pragma omp parallel for schedule(static)
    for (long it = 0; it < (long)Hkv * kgroups; it++) {
        const int h = (int)(it / kgroups), g = (int)(it % kgroups);
        pack_group(k_cache, v_cache, table, k_len, g, h, Hkv, D, block_size,
                   kn + h * head_elems + (long)g * 32 * D, vt + h * head_elems + (long)g * 32 * D);
    }
    const int groups = (q_len + 15) / 16;
#pragma omp parallel
    {
        amx_configure(TILE_ROWS);
        /* latest rows first: they have the most keys, so the dynamic schedule ends balanced */
#pragma omp for schedule(dynamic, 1)
        for (long it = 0; it < (long)H * groups; it++) {
            const int grp = groups - 1 - (int)(it / H), hq = (int)(it % H), h = hq / G;
            const int q0 = grp * 16, nr = q_len - q0 < 16 ? q_len - q0 : 16;
            amx_rows(q, q_stride, kn + h * head_elems, vt + h * head_elems, q0, nr, ctx, hq, D,
                     scale, out, out_stride);
        }
        _tile_release();
    }
    return 0;
#else
    PREFILL_NOT_BUILT();
#endif
}
