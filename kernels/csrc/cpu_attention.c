/* Paged decode attention for CPUs: every decode's query heads attend over its KV read
 * straight from the paged cache, once, with an online softmax (no gathered copy of K/V).
 *
 * Built by sarazmq.kernels.native with the system C compiler (-O3 -march=native -fopenmp)
 * and called through ctypes; plain C so it builds in about a second and needs no torch
 * headers. The reference is sarazmq.kernels.torch_attention (TorchPagedAttention / SDPA).
 *
 * Layouts (element strides, all row-major):
 *   q       [nd, H, D]      token stride q_stride, head stride D
 *   cache   [num_blocks, block_size, Hkv, D] contiguous (k_cache and v_cache)
 *   tables  [nd, table_stride] int32 block ids
 *   lens    [nd] int32, keys per sequence (>= 1)
 *   out     [nd, H, D] contiguous
 * Query head h uses KV head h / (H / Hkv) (grouped-query attention). Work items are
 * (sequence, KV head) pairs, parallel over OpenMP threads; all G = H / Hkv query heads of
 * a pair share one pass over that head's keys and values. Math is float32 throughout
 * (bf16 inputs are widened exactly), as SDPA's CPU kernel does.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_D 256
#define MAX_G 16
#define MAX_BLOCK 128

/* exp for x <= 0 (softmax arguments after max subtraction), ~2 ulp, vectorizable:
 * x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-7 polynomial, 2^n by exponent bits. */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.42860682030941723212e-6f;
    float p = 1.98412698412698413e-4f;
    p = p * r + 1.38888888888888889e-3f;
    p = p * r + 8.33333333333333333e-3f;
    p = p * r + 4.16666666666666667e-2f;
    p = p * r + 1.66666666666666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline void widen_f32(const float *src, float *dst, int n) { memcpy(dst, src, n * sizeof(float)); }

static inline void widen_bf16(const uint16_t *src, float *dst, int n) {
    uint32_t *d = (uint32_t *)dst;
#pragma omp simd
    for (int i = 0; i < n; i++) d[i] = (uint32_t)src[i] << 16;
}

static inline float narrow_f32(float x) { return x; }

static inline uint16_t narrow_bf16(float f) {
    /* round to nearest even, as torch does (inputs are finite) */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Online-softmax update of G query rows with one block of nt keys/values (float32).
 * D is a compile-time constant at every call site (always_inline), so the d loops are
 * fully vectorized and unrolled. */
static inline __attribute__((always_inline)) void attend_block(
    const int D, const int G, const int nt, const float *kf, const float *vf,
    float qf[MAX_G][MAX_D], float acc[MAX_G][MAX_D], float *m, float *l) {
    float s[MAX_G][MAX_BLOCK];
    for (int g = 0; g < G; g++) {
        for (int t = 0; t < nt; t++) {
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < D; d++) dot += qf[g][d] * kf[t * D + d];
            s[g][t] = dot;
        }
        float mx = m[g];
        for (int t = 0; t < nt; t++) mx = s[g][t] > mx ? s[g][t] : mx;
        const float corr = exp_neg(m[g] - mx); /* 0 on the first block (m = -inf) */
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < nt; t++) {
            s[g][t] = exp_neg(s[g][t] - mx);
            sum += s[g][t];
        }
        l[g] = l[g] * corr + sum;
        m[g] = mx;
        float a[MAX_D];
        for (int d = 0; d < D; d++) a[d] = acc[g][d] * corr;
        for (int t = 0; t < nt; t++) {
            const float p = s[g][t];
#pragma omp simd
            for (int d = 0; d < D; d++) a[d] += p * vf[t * D + d];
        }
        for (int d = 0; d < D; d++) acc[g][d] = a[d];
    }
}


#if defined(__AVX512F__)
/* Hand-vectorized path for AVX-512 CPUs and head sizes that are multiples of 16
 * (ND = D / 16 vectors per row, a compile-time constant at each call site). */
#include <immintrin.h>

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }

static inline __m512 load16_bf16(const uint16_t *p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* exp_neg on 16 lanes */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
    __m512 p = _mm512_set1_ps(1.98412698412698413e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.38888888888888889e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.33333333333333333e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.16666666666666667e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.66666666666666667e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

#define DEFINE_ITEM_AVX512(NAME, T, LOAD16, NARROW)                                            \
    static inline __attribute__((always_inline)) void NAME(                                    \
        const int ND, const T *q, long q_stride, const T *k_cache, const T *v_cache,           \
        const int32_t *tables, long table_stride, const int32_t *lens, T *out, int n, int h,   \
        int H, int Hkv, int block_size, float scale) {                                         \
        const int D = ND * 16, G = H / Hkv;                                                    \
        const long tok_stride = (long)Hkv * D;                                                 \
        const long block_elems = (long)block_size * tok_stride;                                \
        __m512 qv[MAX_G][MAX_D / 16], acc[MAX_G][MAX_D / 16];                                  \
        float m[MAX_G], l[MAX_G];                                                              \
        __attribute__((aligned(64))) float s[MAX_G][16];                                       \
        const __m512 sc = _mm512_set1_ps(scale);                                               \
        for (int g = 0; g < G; g++) {                                                          \
            const T *qr = q + (long)n * q_stride + (long)(h * G + g) * D;                      \
            for (int j = 0; j < ND; j++) {                                                     \
                qv[g][j] = _mm512_mul_ps(LOAD16(qr + 16 * j), sc);                             \
                acc[g][j] = _mm512_setzero_ps();                                               \
            }                                                                                  \
            m[g] = -INFINITY;                                                                  \
            l[g] = 0.0f;                                                                       \
        }                                                                                      \
        const int len = lens[n];                                                               \
        const int32_t *table = tables + (long)n * table_stride;                                \
        /* Ask for this head's whole K/V into L2 up front: the cache lines of scattered      \
         * blocks then arrive in parallel instead of one block's latency at a time */       \
        for (int t0 = 0; t0 < len; t0++) {                                                     \
            const char *kr = (const char *)(k_cache + (long)table[t0 / block_size] *           \
                             block_elems + (long)(t0 % block_size) * tok_stride + (long)h * D); \
            const char *vr = (const char *)v_cache + (kr - (const char *)k_cache);             \
            for (int b = 0; b < D * (int)sizeof(T); b += 64) {                                 \
                _mm_prefetch(kr + b, _MM_HINT_T1);                                             \
                _mm_prefetch(vr + b, _MM_HINT_T1);                                             \
            }                                                                                  \
        }                                                                                      \
        for (int start = 0, nt = 0; start < len; start += nt) {                                \
            /* a run of up to 16 keys inside one block */                                     \
            const int off = start % block_size;                                                \
            nt = len - start < 16 ? len - start : 16;                                          \
            if (nt > block_size - off) nt = block_size - off;                                  \
            const T *kb = k_cache + (long)table[start / block_size] * block_elems +            \
                          (long)off * tok_stride + (long)h * D;                                \
            const T *vb = v_cache + (kb - k_cache);                                            \
            /* Blocks are scattered over the cache, so the hardware prefetcher cannot see    \
             * the next one coming: fetch the run after next now, while this one computes */  \
            const int ahead = start + 2 * 16;                                                  \
            if (ahead < len) {                                                                 \
                const T *kn = k_cache + (long)table[ahead / block_size] * block_elems +        \
                              (long)(ahead % block_size) * tok_stride + (long)h * D;           \
                const int na = block_size - ahead % block_size < 16                            \
                                   ? block_size - ahead % block_size : 16;                     \
                for (int t = 0; t < na; t++)                                                   \
                    for (int b = 0; b < D * (int)sizeof(T); b += 64) {                         \
                        _mm_prefetch((const char *)(kn + t * tok_stride) + b, _MM_HINT_T0);    \
                        _mm_prefetch((const char *)(v_cache + (kn - k_cache) + t * tok_stride) \
                                         + b, _MM_HINT_T0);                                    \
                    }                                                                          \
            }                                                                                  \
            for (int t = 0; t < nt; t++) {                                                     \
                __m512 kv[MAX_D / 16];                                                         \
                for (int j = 0; j < ND; j++) kv[j] = LOAD16(kb + t * tok_stride + 16 * j);     \
                for (int g = 0; g < G; g++) {                                                  \
                    __m512 d = _mm512_mul_ps(qv[g][0], kv[0]);                                 \
                    for (int j = 1; j < ND; j++) d = _mm512_fmadd_ps(qv[g][j], kv[j], d);      \
                    s[g][t] = _mm512_reduce_add_ps(d);                                         \
                }                                                                              \
            }                                                                                  \
            const __mmask16 live = (__mmask16)((1u << nt) - 1u);                               \
            for (int g = 0; g < G; g++) {                                                      \
                const __m512 sv = _mm512_maskz_loadu_ps(live, s[g]);                           \
                const float bm = _mm512_mask_reduce_max_ps(live, sv);                          \
                const float mx = bm > m[g] ? bm : m[g];                                        \
                const float corr = exp_neg(m[g] - mx);                                         \
                const __m512 pv =                                                              \
                    _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(sv, _mm512_set1_ps(mx))));   \
                l[g] = l[g] * corr + _mm512_reduce_add_ps(pv);                                 \
                m[g] = mx;                                                                     \
                _mm512_store_ps(s[g], pv);                                                     \
                const __m512 cv = _mm512_set1_ps(corr);                                        \
                for (int j = 0; j < ND; j++) acc[g][j] = _mm512_mul_ps(acc[g][j], cv);         \
            }                                                                                  \
            for (int t = 0; t < nt; t++) {                                                     \
                __m512 vv[MAX_D / 16];                                                         \
                for (int j = 0; j < ND; j++) vv[j] = LOAD16(vb + t * tok_stride + 16 * j);     \
                for (int g = 0; g < G; g++) {                                                  \
                    const __m512 p = _mm512_set1_ps(s[g][t]);                                  \
                    for (int j = 0; j < ND; j++) acc[g][j] = _mm512_fmadd_ps(p, vv[j], acc[g][j]); \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int g = 0; g < G; g++) {                                                          \
            T *o = out + ((long)n * H + h * G + g) * D;                                        \
            const __m512 inv = _mm512_set1_ps(1.0f / l[g]);                                    \
            __attribute__((aligned(64))) float tmp[16];                                        \
            for (int j = 0; j < ND; j++) {                                                     \
                _mm512_store_ps(tmp, _mm512_mul_ps(acc[g][j], inv));                           \
                for (int i = 0; i < 16; i++) o[16 * j + i] = NARROW(tmp[i]);                   \
            }                                                                                  \
        }                                                                                      \
    }

DEFINE_ITEM_AVX512(item_avx512_f32, float, load16_f32, narrow_f32)
DEFINE_ITEM_AVX512(item_avx512_bf16, uint16_t, load16_bf16, narrow_bf16)
#define HAVE_AVX512_ITEM 1
#endif

/* Whether every block a sequence's keys occupy is a valid block id (and the table is
 * long enough for its length): a bad plan must be an error, not a stray memory access. */
static int tables_in_range(const int32_t *tables, long table_stride, const int32_t *lens,
                           long nd, int block_size, long num_blocks) {
    for (long n = 0; n < nd; n++) {
        const long nblk = ((long)lens[n] + block_size - 1) / block_size;
        if (lens[n] < 1 || nblk > table_stride) return 0;
        for (long b = 0; b < nblk; b++) {
            const int32_t id = tables[n * table_stride + b];
            if (id < 0 || id >= num_blocks) return 0;
        }
    }
    return 1;
}

#define DEFINE_DECODE(NAME, T, WIDEN, NARROW, AVX_ITEM)                                                  \
    static inline __attribute__((always_inline)) void NAME##_item(                             \
        const int D, const T *q, long q_stride, const T *k_cache, const T *v_cache,            \
        const int32_t *tables, long table_stride, const int32_t *lens, T *out, int n, int h,   \
        int H, int Hkv, int block_size, float scale) {                                         \
        const int G = H / Hkv;                                                                 \
        const long tok_stride = (long)Hkv * D;                                                 \
        const long block_elems = (long)block_size * tok_stride;                                \
        float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], m[MAX_G], l[MAX_G];                         \
        float kf[MAX_BLOCK * MAX_D], vf[MAX_BLOCK * MAX_D];                                    \
        for (int g = 0; g < G; g++) {                                                          \
            WIDEN(q + (long)n * q_stride + (long)(h * G + g) * D, qf[g], D);                   \
            for (int d = 0; d < D; d++) qf[g][d] *= scale;                                     \
            for (int d = 0; d < D; d++) acc[g][d] = 0.0f;                                      \
            m[g] = -INFINITY;                                                                  \
            l[g] = 0.0f;                                                                       \
        }                                                                                      \
        const int len = lens[n];                                                               \
        const int32_t *table = tables + (long)n * table_stride;                                \
        for (int start = 0; start < len; start += block_size) {                                \
            const int nt = len - start < block_size ? len - start : block_size;                \
            const long base = (long)table[start / block_size] * block_elems + (long)h * D;     \
            for (int t = 0; t < nt; t++) {                                                     \
                WIDEN(k_cache + base + t * tok_stride, kf + t * D, D);                         \
                WIDEN(v_cache + base + t * tok_stride, vf + t * D, D);                         \
            }                                                                                  \
            attend_block(D, G, nt, kf, vf, qf, acc, m, l);                                     \
        }                                                                                      \
        for (int g = 0; g < G; g++) {                                                          \
            T *o = out + ((long)n * H + h * G + g) * D;                                        \
            const float inv = 1.0f / l[g];                                                     \
            for (int d = 0; d < D; d++) o[d] = NARROW(acc[g][d] * inv);                        \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    /* Returns 0; -1 when a size is beyond the kernel's limits (the caller falls back);     \
     * -2, touching nothing, when a length or block id would reach outside the cache. */     \
    int NAME(const T *q, long q_stride, const T *k_cache, const T *v_cache,                    \
             const int32_t *tables, long table_stride, const int32_t *lens, T *out, int nd,    \
             int H, int Hkv, int D, int block_size, float scale, long num_blocks) {            \
        if (D > MAX_D || Hkv < 1 || H % Hkv != 0 || H / Hkv > MAX_G ||                         \
            block_size > MAX_BLOCK)                                                            \
            return -1;                                                                         \
        if (!tables_in_range(tables, table_stride, lens, nd, block_size, num_blocks))          \
            return -2;                                                                         \
        /* with enough sequences, one thread takes all KV heads of a sequence in a row:   \
         * the heads share cache lines' neighbours, so later heads hit in L2 */              \
        const long chunk = nd >= 4 ? Hkv : 1;                                                  \
        _Pragma("omp parallel for schedule(dynamic, 1)")                                       \
        for (long item = 0; item < (long)nd * Hkv; item += chunk) {                            \
          for (long it = item; it < item + chunk && it < (long)nd * Hkv; it++) {                \
            const int n = (int)(it / Hkv), h = (int)(it % Hkv);                                \
            /* constant head sizes get their own fully unrolled copy */                       \
            if (AVX512_OK && D == 64)                                                          \
                AVX_ITEM(4, q, q_stride, k_cache, v_cache, tables, table_stride, lens, out, n, \
                         h, H, Hkv, block_size, scale);                                        \
            else if (AVX512_OK && D == 128)                                                    \
                AVX_ITEM(8, q, q_stride, k_cache, v_cache, tables, table_stride, lens, out, n, \
                         h, H, Hkv, block_size, scale);                                        \
            else if (D == 64)                                                                  \
                NAME##_item(64, q, q_stride, k_cache, v_cache, tables, table_stride, lens,     \
                            out, n, h, H, Hkv, block_size, scale);                             \
            else if (D == 128)                                                                 \
                NAME##_item(128, q, q_stride, k_cache, v_cache, tables, table_stride, lens,    \
                            out, n, h, H, Hkv, block_size, scale);                             \
            else                                                                               \
                NAME##_item(D, q, q_stride, k_cache, v_cache, tables, table_stride, lens,      \
                            out, n, h, H, Hkv, block_size, scale);                             \
          }                                                                                    \
        }                                                                                      \
        return 0;                                                                              \
    }

#ifdef HAVE_AVX512_ITEM
#define AVX512_OK 1
#define ITEM_F32 item_avx512_f32
#define ITEM_BF16 item_avx512_bf16
#else
#define AVX512_OK 0
#define ITEM_F32 paged_decode_attention_f32_item
#define ITEM_BF16 paged_decode_attention_bf16_item
#endif

DEFINE_DECODE(paged_decode_attention_f32, float, widen_f32, narrow_f32, ITEM_F32)
DEFINE_DECODE(paged_decode_attention_bf16, uint16_t, widen_bf16, narrow_bf16, ITEM_BF16)

/* Writes this step's K and V rows into the paged caches: row i of k (token stride
 * k_stride elements, row_elems contiguous elements) goes to slot slots[i] of k_cache
 * viewed as [num_slots, row_elems]; the same for v. elem_size is the element width in
 * bytes (the copy is dtype-agnostic). Replaces two index_copy_ calls, whose per-call
 * overhead in torch is far above the copy itself for a decode batch. */
int write_kv_cache(const char *k, long k_stride, const char *v, long v_stride, char *k_cache,
                   char *v_cache, const int64_t *slots, long num_tokens, long row_elems,
                   long elem_size, long num_slots) {
    const size_t row_bytes = (size_t)(row_elems * elem_size);
    for (long i = 0; i < num_tokens; i++)
        if (slots[i] < 0 || slots[i] >= num_slots) return -2; /* nothing written */
#pragma omp parallel for schedule(static) if (num_tokens >= 256)
    for (long i = 0; i < num_tokens; i++) {
        const long dst = slots[i] * (long)row_bytes;
        memcpy(k_cache + dst, k + i * k_stride * elem_size, row_bytes);
        memcpy(v_cache + dst, v + i * v_stride * elem_size, row_bytes);
    }
    return 0;
}

/* Copies whole cache blocks into a contiguous buffer: out[i] = cache[blocks[i]], rows of
 * row_bytes bytes (a block of all heads). The torch path (index_select) reaches well under
 * 1 GB/s on blocks scattered over a multi-GB cache; this one prefetches ahead. */
int gather_blocks(const char *cache, long row_bytes, const int32_t *blocks, long n, char *out,
                  long num_blocks) {
    for (long i = 0; i < n; i++)
        if (blocks[i] < 0 || blocks[i] >= num_blocks) return -2; /* nothing copied */
#pragma omp parallel for schedule(static) if (n * row_bytes >= (1L << 20))
    for (long i = 0; i < n; i++) {
        if (i + 2 < n) {
            const char *next = cache + (long)blocks[i + 2] * row_bytes;
            for (long b = 0; b < row_bytes; b += 64) __builtin_prefetch(next + b, 0, 3);
        }
        memcpy(out + i * row_bytes, cache + (long)blocks[i] * row_bytes, (size_t)row_bytes);
    }
    return 0;
}
