/* The int8-cache parts of prefill_attention_f32.c (prefill_attention_i8_f32), included there
 * once, after its PF_* definitions: phase 2 inlines them with the head size and the key
 * format as compile-time constants, so they live beside it rather than in a file of their
 * own. AVX512-VNNI builds only (HAVE_PREFILL_I8).
 *
 * The keys and values stay integers. Each query row is rounded to int16 (within 1 / 65,534
 * of its largest element) and its dot products with the int8 keys are exact int32 sums
 * (VPDPWSSD), scaled once by both rows' scales. After the softmax, each step's
 * probabilities, times their V rows' scales, are rounded to int16 the same way and
 * multiplied into the int8 values by VPDPWSSD again. The float path did both products in
 * float32 FMAs over the context dequantized first (docs/KERNELS.md, "Prefill attention
 * over int8 caches"). */
#ifndef SARAZMQ_PREFILL_INT8_H
#define SARAZMQ_PREFILL_INT8_H

#if defined(INT8_DPBUSD512)
/* int8 caches (kv_int8.c's rows: D int8 values, then their float32 scale), AVX512-VNNI:
 * the keys and values stay integers. Keys 16 piece .. 16 piece + 15 of KV head h: K as
 * int16 pairs [D/2][16] (32-bit word p of lane t: dims 2p, 2p + 1 of key t), V as int16
 * pairs [8][D] (word d of pair k: dim d of keys 2k, 2k + 1), and the rows' scales dk[16],
 * dv[16]; keys past k_len zeros. */
static void pack_piece_i8(const int8_t *k_cache, const int8_t *v_cache, const int32_t *table,
                          int k_len, int piece, int h, int Hkv, int D, int block_size,
                          int32_t *kp, float *dk, int32_t *vp, float *dv) {
    const long row = (long)D + 4, tok_stride = (long)Hkv * row;
    const long block_elems = (long)block_size * tok_stride;
    const int8_t *krow[PF_PIECE], *vrow[PF_PIECE];
    for (int t = 0; t < PF_PIECE; t++) {
        const int j = piece * PF_PIECE + t;
        krow[t] = vrow[t] = NULL;
        dk[t] = dv[t] = 0.0f;
        if (j >= k_len) continue;
        const long base = (long)table[j / block_size] * block_elems +
                          (long)(j % block_size) * tok_stride + (long)h * row;
        krow[t] = k_cache + base;
        vrow[t] = v_cache + base;
        memcpy(&dk[t], krow[t] + D, sizeof(float));
        memcpy(&dv[t], vrow[t] + D, sizeof(float));
    }
    for (int t = 0; t < PF_PIECE; t++) {
        __attribute__((aligned(64))) int32_t pairs[PF_MAX_D / 2];
        for (int d = 0; d < D; d += 32)
            _mm512_store_si512(pairs + d / 2,
                               krow[t] ? _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(krow[t] + d)))
                                       : _mm512_setzero_si512());
        for (int p = 0; p < D / 2; p++) kp[p * PF_PIECE + t] = pairs[p];
    }
    const __m512i low = _mm512_set1_epi32(0xFFFF);
    for (int k2 = 0; k2 < PF_PIECE / 2; k2++)
        for (int d = 0; d < D; d += 16) {
            const int8_t *a = vrow[2 * k2], *b = vrow[2 * k2 + 1];
            const __m512i lo = a ? _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(a + d))) : _mm512_setzero_si512();
            const __m512i hi = b ? _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + d))) : _mm512_setzero_si512();
            _mm512_storeu_si512(vp + (long)k2 * D + d,
                                _mm512_or_si512(_mm512_and_si512(lo, low), _mm512_slli_epi32(hi, 16)));
        }
}

/* A step's probabilities p[0 .. n) (n a multiple of 16) of one row, each times its V row's
 * scale, as int16 pairs (words k: keys 2k, 2k + 1) rounded to 32767 / their largest;
 * returns that scale back (0 where the step has no visible key) */
static inline float quantize_p16(const float *p, const float *dv, int n, int32_t *pairs) {
    __attribute__((aligned(64))) float w[PF_STEP];
    __m512 mx = _mm512_setzero_ps();
    for (int c = 0; c < n; c += 16) {
        const __m512 x = _mm512_mul_ps(_mm512_load_ps(p + c), _mm512_loadu_ps(dv + c));
        _mm512_store_ps(w + c, x);
        mx = _mm512_max_ps(mx, x);
    }
    const float amax = _mm512_reduce_max_ps(mx); /* p >= 0, scales > 0 */
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
    for (int c = 0; c < n; c += 16)
        _mm256_storeu_si256((__m256i *)(pairs + c / 2),
                            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(w + c), inv))));
    return amax / 32767.0f;
}

/* o[r][j .. j + 31] += ps[r] * sum over the step's n keys of pp[r] (pairs) times the int16
 * V pairs vs: exact int32 sums (VPDPWSSD, |sum| <= 64 * 32767 * 128 < 2^31) scaled once */
static inline __attribute__((always_inline)) void add_pv_i16(const int D, const int32_t *vs,
                                                             int n, int32_t pp[][PF_STEP / 2],
                                                             const float *ps,
                                                             float o[][PF_MAX_D], int j) {
    __m512i a[PF_ROWS][2];
#pragma GCC unroll 12
    for (int r = 0; r < PF_ROWS; r++) a[r][0] = a[r][1] = _mm512_setzero_si512();
    for (int k2 = 0; k2 < n / 2; k2++) {
        const __m512i v0 = _mm512_loadu_si512(vs + (long)k2 * D + j);
        const __m512i v1 = _mm512_loadu_si512(vs + (long)k2 * D + j + 16);
#pragma GCC unroll 12
        for (int r = 0; r < PF_ROWS; r++) {
            const __m512i pb = _mm512_set1_epi32(pp[r][k2]);
            a[r][0] = _mm512_dpwssd_epi32(a[r][0], v0, pb);
            a[r][1] = _mm512_dpwssd_epi32(a[r][1], v1, pb);
            __asm__("" : "+v"(a[r][0]), "+v"(a[r][1])); /* as in scores16_i16 */
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < PF_ROWS; r++) {
        const __m512 sc = _mm512_set1_ps(ps[r]);
        pf_store(o[r] + j, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][0]), sc, pf_load(o[r] + j)));
        pf_store(o[r] + j + 16,
                 _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][1]), sc, pf_load(o[r] + j + 16)));
    }
}

/* A query row as int16: q16 = round(q * 32767 / max|q|), returned scale max|q| / 32767
 * (0 and zeros for a zero row): within 1 / 65534 of max|q| per element, where the cache's
 * int8 keys are within 1 / 254 of theirs. */
static inline float quantize_q16(const float *q, int D, int16_t *q16) {
    __m512 mx = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(q + d)));
    const float amax = _mm512_reduce_max_ps(mx);
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
    for (int d = 0; d < D; d += 16)
        _mm256_store_si256((__m256i *)(q16 + d),
                           _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(q + d), inv))));
    return amax / 32767.0f;
}

/* The scores of the PF_ROWS int16 rows q16[r] against the packed int8 piece k, each dot
 * product exact in int32 (VPDPWSSD: two dims a lane, |sum| <= 128 * 127 * 32767 < 2^31),
 * times the key's scale and the row's (rs[r]: its q16 scale times the softmax scale). */
static inline __attribute__((always_inline)) void scores16_i16(
    const int D, const int16_t (*q16)[PF_MAX_D], const float *rs, const int32_t *k,
    const float *dk, float s[][PF_STEP], int col) {
    __m512i a[PF_ROWS];
#pragma GCC unroll 12
    for (int r = 0; r < PF_ROWS; r++) a[r] = _mm512_setzero_si512();
    for (int p = 0; p < D / 2; p++) {
        const __m512i kv = _mm512_load_si512(k + p * PF_PIECE);
#pragma GCC unroll 12
        for (int r = 0; r < PF_ROWS; r++) {
            int32_t pair;
            memcpy(&pair, q16[r] + 2 * p, sizeof pair);
            a[r] = _mm512_dpwssd_epi32(a[r], kv, _mm512_set1_epi32(pair));
            /* a running register: left free, GCC copies each sum around its
             * instruction (two moves per VPDPWSSD) */
            __asm__("" : "+v"(a[r]));
        }
    }
    const __m512 kscale = _mm512_load_ps(dk);
#pragma GCC unroll 12
    for (int r = 0; r < PF_ROWS; r++)
        pf_store(s[r] + col, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a[r]), kscale),
                                           _mm512_set1_ps(rs[r])));
}
#define HAVE_PREFILL_I8 1
#endif

#endif
