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
 * Query head h uses KV head h / (H / Hkv) (grouped-query attention); all G = H / Hkv
 * query heads of a KV head share one pass over its keys and values. Work items, parallel
 * over OpenMP threads: on the AVX-512 path (head sizes 64 and 128) a sequence's KV heads
 * together, and with fewer than 4 sequences each over one range of its keys, the ranges
 * merged by their softmax maxima and sums; on the portable path (sequence, KV head) pairs.
 * Math is float32 throughout (bf16 q.k products exact in float32), as SDPA's CPU kernel.
 */
#include <stdlib.h>

#include "common.h"
#include "kernels.h"

#ifdef _OPENMP
#include <omp.h>
static inline int omp_threads(void) { return omp_get_max_threads(); }
#else
static inline int omp_threads(void) { return 1; }
#endif

#define MAX_D 256
#define MAX_G 16
#define MAX_ITEM_QHEADS 32 /* query heads of one decode work item (>= MAX_G) */
#define MAX_BLOCK 128
#define MAX_SPLITS 8 /* key ranges per decode work item when sequences are few */

static inline void widen_f32(const float *src, float *dst, int n) { memcpy(dst, src, n * sizeof(float)); }

static inline void widen_bf16(const uint16_t *src, float *dst, int n) {
    /* through bf()'s memcpy: stores through a uint32_t pointer into these float rows
     * broke strict aliasing, and -O3 without AVX2 read the rows before they were written */
#pragma omp simd
    for (int i = 0; i < n; i++) dst[i] = bf(src[i]);
}

static inline float narrow_f32(float x) { return x; }

static inline uint16_t narrow_bf16(float f) { return to_bf(f); } /* inputs are finite */

/* Online-softmax update of G query rows with one block of nt keys/values (float32 rows
 * rs elements apart). D is a compile-time constant at every call site (always_inline),
 * so the d loops are fully vectorized and unrolled. */
static inline __attribute__((always_inline)) void attend_block(
    const int D, const int G, const int nt, const float *kf, const float *vf, const long rs,
    float qf[][MAX_D], float acc[][MAX_D], float *m, float *l) {
    float s[MAX_G][MAX_BLOCK];
    for (int g = 0; g < G; g++) {
        for (int t = 0; t < nt; t++) {
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < D; d++) dot += qf[g][d] * kf[t * rs + d];
            s[g][t] = dot;
        }
        float mx = m[g];
        for (int t = 0; t < nt; t++) mx = s[g][t] > mx ? s[g][t] : mx;
        const float corr = exp_approx(m[g] - mx); /* 0 on the first block (m = -inf) */
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < nt; t++) {
            s[g][t] = exp_approx(s[g][t] - mx);
            sum += s[g][t];
        }
        l[g] = l[g] * corr + sum;
        m[g] = mx;
        float a[MAX_D];
        for (int d = 0; d < D; d++) a[d] = acc[g][d] * corr;
        for (int t = 0; t < nt; t++) {
            const float p = s[g][t];
#pragma omp simd
            for (int d = 0; d < D; d++) a[d] += p * vf[t * rs + d];
        }
        for (int d = 0; d < D; d++) acc[g][d] = a[d];
    }
}


#if defined(__AVX512F__)
/* Hand-vectorized path for AVX-512 CPUs and head sizes that are multiples of 16
 * (ND = D / 16 vectors per row, a compile-time constant at each call site). */

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }

static inline __m512 load16_bf16(const uint16_t *p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* Requests the cache lines of one key row's head into L2. */
static inline __attribute__((always_inline)) void prefetch_row(const char *p, int bytes) {
    for (int b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

/* Query rows and key dot products per element type. Q_T is what one query row is kept as,
 * QLOAD fills it, KDOT returns the 16 partial products of a query row with one key row (to
 * be summed horizontally by hsum16). The float32 path (and bf16 without VDPBF16PS)
 * widens to float32 and multiplies 16 elements at a time. */
#define DEFINE_FMA_KDOT(NAME, T, LOAD16)                                                       \
    static inline __attribute__((always_inline)) __m512 NAME(const int ND, const __m512 *qv,  \
                                                             const T *kr) {                    \
        __m512 d = _mm512_mul_ps(qv[0], LOAD16(kr));                                           \
        for (int j = 1; j < ND; j++) d = _mm512_fmadd_ps(qv[j], LOAD16(kr + 16 * j), d);       \
        return d;                                                                              \
    }
#define FMA_QLOAD(LOAD16, qv, qr, ND) \
    for (int j = 0; j < ND; j++) qv[j] = LOAD16(qr + 16 * j)
#define F32_QLOAD(qv, qr, ND) FMA_QLOAD(load16_f32, qv, qr, ND)
DEFINE_FMA_KDOT(f32_kdot, float, load16_f32)
/* V rows: f32 as is */
static inline __attribute__((always_inline)) void f32_vload(const int ND, __m512 *vv,
                                                            const float *vr) {
    for (int j = 0; j < ND; j++) vv[j] = load16_f32(vr + 16 * j);
}

#if defined(__AVX512BF16__)
/* bf16 queries stay bf16: VDPBF16PS multiplies adjacent bf16 pairs exactly and adds them in
 * float32, one instruction per 32 key elements (no widening of the keys). */
typedef __m512bh bf16_q_t;
#define BF16_QLOAD(qv, qr, ND) \
    for (int j = 0; j < ND / 2; j++) qv[j] = (__m512bh)_mm512_loadu_si512(qr + 32 * j)
static inline __attribute__((always_inline)) __m512 bf16_kdot(const int ND, const bf16_q_t *qv,
                                                              const uint16_t *kr) {
    __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0],
                                (__m512bh)_mm512_loadu_si512(kr));
    for (int j = 1; j < ND / 2; j++)
        d = _mm512_dpbf16_ps(d, qv[j], (__m512bh)_mm512_loadu_si512(kr + 32 * j));
    return d;
}
#else
typedef __m512 bf16_q_t;
#define BF16_QLOAD(qv, qr, ND) FMA_QLOAD(load16_bf16, qv, qr, ND)
DEFINE_FMA_KDOT(bf16_kdot, uint16_t, load16_bf16)
#endif
/* V rows: 32 bf16 at a time widened in place, even elements (shift up) into vector 2c and
 * odd ones (high halves masked) into 2c + 1, so the accumulators hold the head's dims
 * permuted: vector 2c lane i is dim 32c + 2i, vector 2c + 1 lane i is dim 32c + 2i + 1. */
static inline __attribute__((always_inline)) void bf16_vload(const int ND, __m512 *vv,
                                                             const uint16_t *vr) {
    for (int c = 0; c < ND / 2; c++) {
        const __m512i x = _mm512_loadu_si512(vr + 32 * c);
        vv[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        vv[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000)));
    }
}
static inline __attribute__((always_inline)) void f32_store_out(const int ND, float *o,
                                                                const __m512 *acc, float inv) {
    const __m512 iv = _mm512_set1_ps(inv);
    for (int j = 0; j < ND; j++) _mm512_storeu_ps(o + 16 * j, _mm512_mul_ps(acc[j], iv));
}
static inline __attribute__((always_inline)) void bf16_store_out(const int ND, uint16_t *o,
                                                                 const __m512 *acc, float inv) {
    __attribute__((aligned(64))) float tmp[2][16];
    const __m512 iv = _mm512_set1_ps(inv);
    for (int c = 0; c < ND / 2; c++) {
        _mm512_store_ps(tmp[0], _mm512_mul_ps(acc[2 * c], iv));
        _mm512_store_ps(tmp[1], _mm512_mul_ps(acc[2 * c + 1], iv));
        for (int i = 0; i < 16; i++) {
            o[32 * c + 2 * i] = narrow_bf16(tmp[0][i]);
            o[32 * c + 2 * i + 1] = narrow_bf16(tmp[1][i]);
        }
    }
}
/* int8 cache rows: 16 int8 widened to float32; a row's scale is the float32 after its D
 * values. */
static inline __m512 load16_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline __attribute__((always_inline)) float i8_row_scale(const int ND, const int8_t *r) {
    float s;
    memcpy(&s, r + 16 * ND, sizeof s);
    return s;
}
static inline __attribute__((always_inline)) __m512 i8_kdot(const int ND, const __m512 *qv,
                                                            const int8_t *kr) {
    __m512 d = _mm512_mul_ps(qv[0], load16_i8(kr));
    for (int j = 1; j < ND; j++) d = _mm512_fmadd_ps(qv[j], load16_i8(kr + 16 * j), d);
    return _mm512_mul_ps(d, _mm512_set1_ps(i8_row_scale(ND, kr)));
}
static inline __attribute__((always_inline)) void i8_vload(const int ND, __m512 *vv,
                                                           const int8_t *vr) {
    const __m512 s = _mm512_set1_ps(i8_row_scale(ND, vr));
    for (int j = 0; j < ND; j++) vv[j] = _mm512_mul_ps(load16_i8(vr + 16 * j), s);
}
/* bf16 output of accumulators that hold the dims in order (not bf16_vload's order) */
static inline __attribute__((always_inline)) void bf16_store_out_in_order(const int ND,
                                                                          uint16_t *o,
                                                                          const __m512 *acc,
                                                                          float inv) {
    __attribute__((aligned(64))) float tmp[16];
    const __m512 iv = _mm512_set1_ps(inv);
    for (int j = 0; j < ND; j++) {
        _mm512_store_ps(tmp, _mm512_mul_ps(acc[j], iv));
        for (int i = 0; i < 16; i++) o[16 * j + i] = narrow_bf16(tmp[i]);
    }
}

/* One work item: KV heads [h0, h1) of sequence n, each with its G query heads, over the
 * sequence's keys in runs of up to 16 keys inside one block. Per run: the partial dot
 * products of every (query head, key), read in memory order (key rows, then heads), 16
 * keys' worth summed at once per query head by hsum16; an online-softmax update; the
 * weighted V rows. With several heads per item (enough sequences to share out), each
 * block's K and V are read front to back. Blocks are scattered over the cache, so the
 * hardware prefetcher cannot see the next one coming: each run requests the next block's
 * rows (into L2), spread between its own math: that reads the KV near twice as fast as
 * one head per item with the whole item requested up front (docs/KERNELS.md, "CPU
 * attention"). ND = D / 16 and G are compile-time constants at the call
 * sites (always_inline). */
#define DEFINE_ITEM_AVX512(NAME, T, KT, RX, Q_T, QLOAD, KDOT, VLOAD, STORE_OUT)                \
    static inline __attribute__((always_inline)) void NAME(                                    \
        const int ND, const int G, const T *q, long q_stride, const KT *k_cache,               \
        const KT *v_cache, const int32_t *tables, long table_stride, const int32_t *lens,      \
        T *out, int n, int h0, int h1, int H, int Hkv, int block_size, float scale, int k0,    \
        int k1, float *split_out) {                                                            \
        const int D = ND * 16, nq = (h1 - h0) * G; /* query heads, c = (h - h0) * G + g */     \
        const int RD = D + (RX); /* a cache row: D elements (+ the int8 rows' scale) */        \
        (void)lens; /* the keys are k0 .. k1 - 1 */                                            \
        const long tok_stride = (long)Hkv * RD;                                                \
        const long block_elems = (long)block_size * tok_stride;                                \
        Q_T qv[MAX_ITEM_QHEADS][MAX_D / 16];                                                   \
        __m512 acc[MAX_ITEM_QHEADS][MAX_D / 16];                                               \
        __m512 part[MAX_ITEM_QHEADS][16];                                                      \
        float m[MAX_ITEM_QHEADS], l[MAX_ITEM_QHEADS];                                          \
        __attribute__((aligned(64))) float p[MAX_G][16];                                       \
        const __m512 sc = _mm512_set1_ps(scale);                                               \
        const __m512 neg_inf = _mm512_set1_ps(-INFINITY);                                      \
        for (int c = 0; c < nq; c++) {                                                         \
            QLOAD(qv[c], q + (long)n * q_stride + (long)(h0 * G + c) * D, ND);                 \
            for (int j = 0; j < ND; j++) acc[c][j] = _mm512_setzero_ps();                      \
            m[c] = -INFINITY;                                                                  \
            l[c] = 0.0f;                                                                       \
        }                                                                                      \
        const int len = k1;                                                                    \
        const int32_t *table = tables + (long)n * table_stride;                                \
        for (int start = k0, nt = 0; start < len; start += nt) {                               \
            const int off = start % block_size, blk = start / block_size;                      \
            nt = len - start < 16 ? len - start : 16;                                          \
            if (nt > block_size - off) nt = block_size - off;                                  \
            const KT *kb = k_cache + (long)table[blk] * block_elems + (long)off * tok_stride + \
                           (long)h0 * RD;                                                      \
            const KT *vb = v_cache + (kb - k_cache);                                           \
            /* The next block's K and V rows at this run's offsets are requested one    \
             * (row, head) at a time between the dot products below: spread out, the      \
             * requests overlap the math; a block's worth at once stalls it (much slower); \
             * the V rows requested here rather than beside the V updates wait longer     \
             * in the queue before use (docs/KERNELS.md, "CPU attention"). */             \
            const int next_rows = (blk + 1) * block_size < len                                 \
                                      ? len - (blk + 1) * block_size - off : 0;                \
            const long next = next_rows > 0 ? (long)table[blk + 1] * block_elems +             \
                                                  (long)off * tok_stride + (long)h0 * RD       \
                                            : 0;                                               \
            const __mmask16 live = (__mmask16)((1u << nt) - 1u);                               \
            for (int t = 0; t < 16; t++)                                                       \
                for (int i = 0; i < h1 - h0; i++) {                                            \
                    if (t < nt && t < next_rows) {                                             \
                        prefetch_row((const char *)(k_cache + next + t * tok_stride + i * RD), \
                                     RD * (int)sizeof(KT));                                    \
                        prefetch_row((const char *)(v_cache + next + t * tok_stride + i * RD), \
                                     RD * (int)sizeof(KT));                                    \
                    }                                                                          \
                    for (int g = 0; g < G; g++)                                                \
                        part[i * G + g][t] = t < nt ? KDOT(ND, qv[i * G + g],                  \
                                                           kb + t * tok_stride + i * RD)       \
                                                    : _mm512_setzero_ps();                     \
                }                                                                              \
            for (int i = 0; i < h1 - h0; i++) {                                                \
                for (int g = 0; g < G; g++) {                                                  \
                    const int c = i * G + g;                                                   \
                    const __m512 sv = _mm512_mask_mov_ps(                                      \
                        neg_inf, live, _mm512_mul_ps(hsum16(part[c]), sc));                 \
                    const float bm = _mm512_reduce_max_ps(sv);                                 \
                    if (bm > m[c]) { /* a new maximum: rescale what was summed so far */       \
                        const float corr = exp_approx(m[c] - bm); /* 0 on the first run */      \
                        const __m512 cv = _mm512_set1_ps(corr);                                \
                        for (int j = 0; j < ND; j++) acc[c][j] = _mm512_mul_ps(acc[c][j], cv); \
                        l[c] *= corr;                                                          \
                        m[c] = bm;                                                             \
                    }                                                                          \
                    const __m512 pv = _mm512_maskz_mov_ps(                                     \
                        live, exp512(_mm512_sub_ps(sv, _mm512_set1_ps(m[c]))));                \
                    l[c] += _mm512_reduce_add_ps(pv);                                          \
                    _mm512_store_ps(p[g], pv);                                                 \
                }                                                                              \
                __m512 a[MAX_G][MAX_D / 16]; /* this head's accumulators, in registers */     \
                for (int g = 0; g < G; g++)                                                    \
                    for (int j = 0; j < ND; j++) a[g][j] = acc[i * G + g][j];                  \
                for (int t = 0; t < nt; t++) {                                                 \
                    __m512 vv[MAX_D / 16];                                                     \
                    VLOAD(ND, vv, vb + t * tok_stride + i * RD);                               \
                    for (int g = 0; g < G; g++) {                                              \
                        const __m512 pb = _mm512_set1_ps(p[g][t]);                             \
                        for (int j = 0; j < ND; j++) a[g][j] = _mm512_fmadd_ps(pb, vv[j], a[g][j]); \
                    }                                                                          \
                }                                                                              \
                for (int g = 0; g < G; g++)                                                    \
                    for (int j = 0; j < ND; j++) acc[i * G + g][j] = a[g][j];                  \
            }                                                                                  \
        }                                                                                      \
        if (split_out) { /* a range of the keys: the raw state, for combine_split */           \
            for (int c = 0; c < nq; c++) {                                                     \
                float *pc = split_out + (long)c * (D + 2);                                     \
                for (int j = 0; j < ND; j++) _mm512_storeu_ps(pc + 16 * j, acc[c][j]);         \
                pc[D] = m[c];                                                                  \
                pc[D + 1] = l[c];                                                              \
            }                                                                                  \
            return;                                                                            \
        }                                                                                      \
        for (int c = 0; c < nq; c++)                                                           \
            STORE_OUT(ND, out + ((long)n * H + h0 * G + c) * D, acc[c], 1.0f / l[c]);          \
    }

DEFINE_ITEM_AVX512(item_avx512_f32, float, float, 0, __m512, F32_QLOAD, f32_kdot, f32_vload,
                   f32_store_out)
DEFINE_ITEM_AVX512(item_avx512_bf16, uint16_t, uint16_t, 0, bf16_q_t, BF16_QLOAD, bf16_kdot,
                   bf16_vload, bf16_store_out)
/* int8 cache rows (kernels/kv_int8.py): D int8 values then their float32 scale; bf16
 * queries widened to float32. The key's scale multiplies its 16 partial products, the
 * value's its widened row; the accumulators keep the dims in order. */
#define I8_QLOAD(qv, qr, ND) FMA_QLOAD(load16_bf16, qv, qr, ND)
DEFINE_ITEM_AVX512(item_avx512_i8, uint16_t, int8_t, 4, __m512, I8_QLOAD, i8_kdot, i8_vload,
                   bf16_store_out_in_order)
/* the same rows under float32 queries (float32 models with an int8 cache) */
DEFINE_ITEM_AVX512(item_avx512_i8_f32, float, int8_t, 4, __m512, F32_QLOAD, i8_kdot, i8_vload,
                   f32_store_out)
/* Merges the S key splits of one item (parts: S consecutive blocks of nq rows of D + 2
 * floats: the accumulators as the item keeps them, then m and l) into its nq output rows:
 * out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, M the largest m_s. Splits
 * without keys (m = -inf, l = 0) weigh nothing. */
#define DEFINE_COMBINE(NAME, T, STORE_OUT)                                                     \
    static void NAME(int ND, const float *parts, int S, long stride, int nq, T *out) {          \
        const int D = ND * 16;                                                                 \
        for (int c = 0; c < nq; c++) {                                                         \
            float mx = -INFINITY;                                                              \
            for (int s = 0; s < S; s++) {                                                      \
                const float ms = parts[s * stride + (long)c * (D + 2) + D];                    \
                mx = ms > mx ? ms : mx;                                                        \
            }                                                                                  \
            __m512 acc[MAX_D / 16];                                                            \
            for (int j = 0; j < ND; j++) acc[j] = _mm512_setzero_ps();                         \
            float l = 0.0f;                                                                    \
            for (int s = 0; s < S; s++) {                                                      \
                const float *pc = parts + s * stride + (long)c * (D + 2);                      \
                if (pc[D + 1] == 0.0f) continue; /* no keys in this split */                   \
                const float w = exp_approx(pc[D] - mx);                                        \
                const __m512 wv = _mm512_set1_ps(w);                                           \
                for (int j = 0; j < ND; j++)                                                   \
                    acc[j] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(pc + 16 * j), acc[j]);        \
                l += w * pc[D + 1];                                                            \
            }                                                                                  \
            STORE_OUT(ND, out + (long)c * D, acc, 1.0f / l);                                   \
        }                                                                                      \
    }
DEFINE_COMBINE(combine_split_f32, float, f32_store_out)
DEFINE_COMBINE(combine_split_bf16, uint16_t, bf16_store_out)
DEFINE_COMBINE(combine_split_i8, uint16_t, bf16_store_out_in_order)
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

/* 0 when the decode kernels cover these sizes and every sequence's keys lie in the cache;
 * -1 for a size beyond their limits, -2 for a length or block id outside the cache. */
int decode_attention_check(const int32_t *tables, long table_stride, const int32_t *lens,
                           int nd, int H, int Hkv, int D, int block_size, long num_blocks) {
    if (D > MAX_D || Hkv < 1 || H % Hkv != 0 || H / Hkv > MAX_G || block_size > MAX_BLOCK)
        return -1;
    return tables_in_range(tables, table_stride, lens, nd, block_size, num_blocks) ? 0 : -2;
}

/* KV heads per decode work item: a sequence's KV heads together (as many as
 * MAX_ITEM_QHEADS query heads allow) when there are enough sequences to share out, else
 * single heads (more items than threads). */
static inline int heads_per_item(int nd, int H, int Hkv) {
    const int fit = MAX_ITEM_QHEADS / (H / Hkv);
    return nd >= 4 ? (Hkv < fit ? Hkv : fit) : 1;
}

/* The portable item (no AVX-512): KV heads [h0, h1) of sequence n, each with its G query
 * heads, block by block, every head of the item per block, so a block's rows are read
 * front to back once; the next block's rows are requested while this one is summed
 * (blocks are scattered, the hardware prefetcher cannot see them coming). float32 rows
 * are read in place, bf16 rows widened into a buffer first. */
#define DEFINE_DECODE(NAME, T, WIDEN, NARROW, AVX_ITEM, AVX_SPLIT)                          \
    static inline __attribute__((always_inline)) void NAME##_item(                             \
        const int D, const T *q, long q_stride, const T *k_cache, const T *v_cache,            \
        const int32_t *tables, long table_stride, const int32_t *lens, T *out, int n, int h0,  \
        int h1, int H, int Hkv, int block_size, float scale) {                                 \
        const int G = H / Hkv, nq = (h1 - h0) * G;                                             \
        const long tok_stride = (long)Hkv * D;                                                 \
        const long block_elems = (long)block_size * tok_stride;                                \
        const int in_place = sizeof(T) == sizeof(float);                                       \
        float qf[MAX_ITEM_QHEADS][MAX_D], acc[MAX_ITEM_QHEADS][MAX_D];                         \
        float m[MAX_ITEM_QHEADS], l[MAX_ITEM_QHEADS];                                          \
        float kf[MAX_BLOCK * MAX_D], vf[MAX_BLOCK * MAX_D];                                    \
        for (int c = 0; c < nq; c++) {                                                         \
            WIDEN(q + (long)n * q_stride + (long)(h0 * G + c) * D, qf[c], D);                  \
            for (int d = 0; d < D; d++) qf[c][d] *= scale;                                     \
            for (int d = 0; d < D; d++) acc[c][d] = 0.0f;                                      \
            m[c] = -INFINITY;                                                                  \
            l[c] = 0.0f;                                                                       \
        }                                                                                      \
        const int len = lens[n];                                                               \
        const int32_t *table = tables + (long)n * table_stride;                                \
        const int row_bytes = (h1 - h0) * D * (int)sizeof(T);                                  \
        for (int start = 0; start < len; start += block_size) {                                \
            const int nt = len - start < block_size ? len - start : block_size;                \
            const long base = (long)table[start / block_size] * block_elems + (long)h0 * D;    \
            if (start + block_size < len) {                                                    \
                const int nn = len - start - block_size < block_size ? len - start - block_size \
                                                                     : block_size;             \
                const long next = (long)table[start / block_size + 1] * block_elems +          \
                                  (long)h0 * D;                                                \
                for (int t = 0; t < nn; t++)                                                   \
                    for (int b = 0; b < row_bytes; b += 64) {                                  \
                        __builtin_prefetch((const char *)(k_cache + next + t * tok_stride) + b, 0, 2); \
                        __builtin_prefetch((const char *)(v_cache + next + t * tok_stride) + b, 0, 2); \
                    }                                                                          \
            }                                                                                  \
            for (int h = h0; h < h1; h++) {                                                    \
                const long hb = base + (long)(h - h0) * D;                                     \
                const float *kr = (const float *)(const void *)(k_cache + hb);                 \
                const float *vr = (const float *)(const void *)(v_cache + hb);                 \
                long rs = tok_stride;                                                          \
                if (!in_place) {                                                               \
                    for (int t = 0; t < nt; t++) {                                             \
                        WIDEN(k_cache + hb + t * tok_stride, kf + t * D, D);                   \
                        WIDEN(v_cache + hb + t * tok_stride, vf + t * D, D);                   \
                    }                                                                          \
                    kr = kf, vr = vf, rs = D;                                                  \
                }                                                                              \
                const int c0 = (h - h0) * G;                                                   \
                attend_block(D, G, nt, kr, vr, rs, qf + c0, acc + c0, m + c0, l + c0);         \
            }                                                                                  \
        }                                                                                      \
        for (int c = 0; c < nq; c++) {                                                         \
            T *o = out + ((long)n * H + h0 * G + c) * D;                                       \
            const float inv = 1.0f / l[c];                                                     \
            for (int d = 0; d < D; d++) o[d] = NARROW(acc[c][d] * inv);                        \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    /* Returns 0; -1 when a size is beyond the kernel's limits (the caller falls back);     \
     * -2, touching nothing, when a length or block id would reach outside the cache. */     \
    int NAME(const T *q, long q_stride, const T *k_cache, const T *v_cache,                    \
             const int32_t *tables, long table_stride, const int32_t *lens, T *out, int nd,    \
             int H, int Hkv, int D, int block_size, float scale, long num_blocks) {            \
        const int rc = decode_attention_check(tables, table_stride, lens, nd, H, Hkv, D,       \
                                              block_size, num_blocks);                         \
        if (rc != 0) return rc;                                                                \
        if (nd < 4 && AVX_SPLIT(q, q_stride, k_cache, v_cache, tables, table_stride, lens, out, \
                                nd, H, Hkv, D, block_size, scale))                             \
            return 0;                                                                          \
        const int per_item = heads_per_item(nd, H, Hkv);                                       \
        const int groups = (Hkv + per_item - 1) / per_item;                                    \
        _Pragma("omp parallel for schedule(dynamic, 1)")                                       \
        for (long item = 0; item < (long)nd * groups; item++) {                                \
            const int n = (int)(item / groups), h0 = (int)(item % groups) * per_item;          \
            const int h1 = h0 + per_item < Hkv ? h0 + per_item : Hkv;                          \
            /* constant head sizes get their own fully unrolled copy */                        \
            if (AVX_ITEM(D, H / Hkv, q, q_stride, k_cache, v_cache, tables, table_stride,      \
                         lens, out, n, h0, h1, H, Hkv, block_size, scale, 0, lens[n],          \
                         NULL))                                                                \
                continue;                                                                      \
            if (D == 64)                                                                       \
                NAME##_item(64, q, q_stride, k_cache, v_cache, tables, table_stride, lens, out,  \
                            n, h0, h1, H, Hkv, block_size, scale);                             \
            else if (D == 128)                                                                 \
                NAME##_item(128, q, q_stride, k_cache, v_cache, tables, table_stride, lens,     \
                            out, n, h0, h1, H, Hkv, block_size, scale);                        \
            else                                                                               \
                NAME##_item(D, q, q_stride, k_cache, v_cache, tables, table_stride, lens, out,   \
                            n, h0, h1, H, Hkv, block_size, scale);                             \
        }                                                                                      \
        return 0;                                                                              \
    }

#ifdef HAVE_AVX512_ITEM
/* Runs the AVX-512 item with D and G as compile-time constants (one unrolled copy per
 * pair, registers for queries and accumulators); returns 0 where no copy exists, and the
 * caller takes the portable path. */
#define ITEM_CASE(ITEM, ND, G_)                                                                \
    case G_:                                                                                   \
        ITEM(ND, G_, q, q_stride, k_cache, v_cache, tables, table_stride, lens, out, n, h0, h1, \
             H, Hkv, block_size, scale, k0, k1, split_out);                                         \
        return 1;
#define ITEM_SWITCH(ITEM, ND)                                                                  \
    switch (G) {                                                                               \
        ITEM_CASE(ITEM, ND, 1) ITEM_CASE(ITEM, ND, 2) ITEM_CASE(ITEM, ND, 3)                   \
        ITEM_CASE(ITEM, ND, 4) ITEM_CASE(ITEM, ND, 5) ITEM_CASE(ITEM, ND, 6)                   \
        ITEM_CASE(ITEM, ND, 7) ITEM_CASE(ITEM, ND, 8)                                          \
    default:                                                                                   \
        ITEM(ND, G, q, q_stride, k_cache, v_cache, tables, table_stride, lens, out, n, h0, h1, \
             H, Hkv, block_size, scale, k0, k1, split_out);                                         \
        return 1;                                                                              \
    }
#define DEFINE_AVX_DISPATCH(NAME, T, KT, ITEM)                                                 \
    static int NAME(int D, int G, const T *q, long q_stride, const KT *k_cache,                \
                    const KT *v_cache, const int32_t *tables, long table_stride,               \
                    const int32_t *lens, T *out, int n, int h0, int h1, int H, int Hkv,        \
                    int block_size, float scale, int k0, int k1, float *split_out) {           \
        if (D == 64) { ITEM_SWITCH(ITEM, 4) }                                                  \
        if (D == 128) { ITEM_SWITCH(ITEM, 8) }                                                 \
        return 0;                                                                              \
    }
DEFINE_AVX_DISPATCH(avx_item_f32, float, float, item_avx512_f32)
DEFINE_AVX_DISPATCH(avx_item_bf16, uint16_t, uint16_t, item_avx512_bf16)
DEFINE_AVX_DISPATCH(avx_item_i8, uint16_t, int8_t, item_avx512_i8)
DEFINE_AVX_DISPATCH(avx_item_i8_f32, float, int8_t, item_avx512_i8_f32)

/* Decode attention for fewer sequences than it takes to keep the threads busy (nd < 4):
 * items are still a sequence's KV heads together (whole cache rows, read in memory order),
 * each over one of S ranges of its keys, S chosen for about two items per thread; the
 * ranges are merged by their softmax maxima and sums (combine_split). Per-head items, the
 * alternative, read a third of each row and leave threads idle (3 heads on 2 threads),
 * much slower at one sequence (docs/KERNELS.md, "CPU attention"). Returns 1 when done; 0 for head sizes without an AVX-512
 * copy, one split, or no memory for the partial results (the caller's path then runs). */
#define DEFINE_SPLIT_DECODE(NAME, T, KT, ITEM, COMBINE)                                        \
    static int NAME(const T *q, long q_stride, const KT *k_cache, const KT *v_cache,           \
                    const int32_t *tables, long table_stride, const int32_t *lens, T *out,     \
                    int nd, int H, int Hkv, int D, int block_size, float scale) {              \
        if (D != 64 && D != 128) return 0;                                                     \
        const int G = H / Hkv, fit = MAX_ITEM_QHEADS / G;                                      \
        const int per_item = Hkv < fit ? Hkv : fit, groups = (Hkv + per_item - 1) / per_item;  \
        const long base_items = (long)nd * groups;                                             \
        long splits = (2L * omp_threads() + base_items - 1) / base_items;                      \
        if (splits > MAX_SPLITS) splits = MAX_SPLITS;                                          \
        if (splits < 2) return 0;                                                              \
        const int S = (int)splits;                                                             \
        const long stride = (long)per_item * G * (D + 2); /* floats of one partial result */   \
        float *parts = (float *)malloc(sizeof(float) * (size_t)(base_items * S * stride));     \
        if (parts == NULL) return 0;                                                           \
        _Pragma("omp parallel for schedule(dynamic, 1)")                                       \
        for (long item = 0; item < base_items * S; item++) {                                   \
            const long bi = item / S;                                                          \
            const int s = (int)(item % S), n = (int)(bi / groups);                             \
            const int h0 = (int)(bi % groups) * per_item;                                      \
            const int h1 = h0 + per_item < Hkv ? h0 + per_item : Hkv;                          \
            const int len = lens[n], chunk = ((len + S - 1) / S + 15) / 16 * 16;               \
            const int k0 = s * chunk < len ? s * chunk : len;                                  \
            const int k1 = k0 + chunk < len ? k0 + chunk : len;                                \
            ITEM(D, G, q, q_stride, k_cache, v_cache, tables, table_stride, lens, out, n, h0,  \
                 h1, H, Hkv, block_size, scale, k0, k1, parts + item * stride);                \
        }                                                                                      \
        for (long bi = 0; bi < base_items; bi++) {                                             \
            const int n = (int)(bi / groups), h0 = (int)(bi % groups) * per_item;             \
            const int h1 = h0 + per_item < Hkv ? h0 + per_item : Hkv;                          \
            COMBINE(D / 16, parts + bi * S * stride, S, stride, (h1 - h0) * G,                 \
                    out + ((long)n * H + (long)h0 * G) * D);                                   \
        }                                                                                      \
        free(parts);                                                                           \
        return 1;                                                                              \
    }
DEFINE_SPLIT_DECODE(split_decode_f32, float, float, avx_item_f32, combine_split_f32)
DEFINE_SPLIT_DECODE(split_decode_bf16, uint16_t, uint16_t, avx_item_bf16, combine_split_bf16)
DEFINE_SPLIT_DECODE(split_decode_i8, uint16_t, int8_t, avx_item_i8, combine_split_i8)
DEFINE_SPLIT_DECODE(split_decode_i8_f32, float, int8_t, avx_item_i8_f32, combine_split_f32)

#define ITEM_F32 avx_item_f32
#define ITEM_BF16 avx_item_bf16
#define SPLIT_F32 split_decode_f32
#define SPLIT_BF16 split_decode_bf16
#define I8_BF16_BUILT 1
#define I8_F32_BUILT 1
#define ITEM_I8_BF16 avx_item_i8
#define SPLIT_I8_BF16 split_decode_i8
#define ITEM_I8_F32 avx_item_i8_f32
#define SPLIT_I8_F32 split_decode_i8_f32
#else
/* float32 items on AVX2 + FMA builds (kernels/csrc/decode_attention_avx2.c; 0 elsewhere
 * and for head sizes it does not take: the portable loop below) */
#define ITEM_F32(D_, G_, q_, qs_, kc_, vc_, tb_, ts_, ln_, o_, n_, h0_, h1_, H_, Hkv_, bs_, sc_, \
                 k0_, k1_, split_)                                                              \
    decode_item_avx2_f32(D_, G_, q_, qs_, kc_, vc_, tb_, ts_, ln_, o_, n_, h0_, h1_, H_, Hkv_,  \
                         bs_, sc_)
#define ITEM_BF16(...) 0
#define SPLIT_F32(...) 0
#define SPLIT_BF16(...) 0
/* int8 rows: float32 queries on AVX2 + FMA builds (decode_attention_avx2.c; every item
 * the entry below makes at head sizes 64 and 128), bf16 queries on AVX-512 only */
/* stands in for a kernel this build lacks (its arguments count as used) */
static inline int not_built(int first, ...) {
    (void)first;
    return 0;
}
#define I8_BF16_BUILT 0
#define ITEM_I8_BF16(...) not_built(__VA_ARGS__)
#define SPLIT_I8_BF16(...) not_built(0, __VA_ARGS__)
#if defined(AVX2_ONLY)
#define I8_F32_BUILT 1
#define ITEM_I8_F32(D_, G_, q_, qs_, kc_, vc_, tb_, ts_, ln_, o_, n_, h0_, h1_, H_, Hkv_, bs_,   \
                    sc_, k0_, k1_, split_)                                                      \
    decode_item_avx2_i8_f32(D_, G_, q_, qs_, kc_, vc_, tb_, ts_, ln_, o_, n_, h0_, h1_, H_,     \
                            Hkv_, bs_, sc_)
#else
#define I8_F32_BUILT 0
#define ITEM_I8_F32(...) not_built(__VA_ARGS__)
#endif
#define SPLIT_I8_F32(...) not_built(0, __VA_ARGS__)
#endif

DEFINE_DECODE(paged_decode_attention_f32, float, widen_f32, narrow_f32, ITEM_F32, SPLIT_F32)
DEFINE_DECODE(paged_decode_attention_bf16, uint16_t, widen_bf16, narrow_bf16, ITEM_BF16,
              SPLIT_BF16)

/* Decode attention over an int8 cache (kernels/kv_int8.py: rows of D int8 values and
 * their float32 scale), queries and output of T: bf16 on AVX-512 builds, float32 on
 * AVX-512 and AVX2 builds, head sizes 64 and 128. Returns as the other decode entries: 0,
 * -1 (not covered: the caller takes the torch path over dequantized rows), -2 (a length
 * or block id outside the cache). */
#define DEFINE_I8_DECODE(NAME, T, BUILT, ITEM, SPLIT)                                          \
    int NAME(const T *q, long q_stride, const int8_t *k_cache, const int8_t *v_cache,          \
             const int32_t *tables, long table_stride, const int32_t *lens, T *out, int nd,    \
             int H, int Hkv, int D, int block_size, float scale, long num_blocks) {            \
        if (!(BUILT) || (D != 64 && D != 128)) return -1;                                      \
        const int rc = decode_attention_check(tables, table_stride, lens, nd, H, Hkv, D,       \
                                              block_size, num_blocks);                         \
        if (rc != 0) return rc;                                                                \
        if (nd < 4 && SPLIT(q, q_stride, k_cache, v_cache, tables, table_stride, lens, out,    \
                            nd, H, Hkv, D, block_size, scale))                                 \
            return 0;                                                                          \
        const int G = H / Hkv, per_item = heads_per_item(nd, H, Hkv);                          \
        const int groups = (Hkv + per_item - 1) / per_item;                                    \
        _Pragma("omp parallel for schedule(dynamic, 1)")                                       \
        for (long item = 0; item < (long)nd * groups; item++) {                                \
            const int n = (int)(item / groups), h0 = (int)(item % groups) * per_item;          \
            const int h1 = h0 + per_item < Hkv ? h0 + per_item : Hkv;                          \
            (void)ITEM(D, G, q, q_stride, k_cache, v_cache, tables, table_stride, lens, out,   \
                       n, h0, h1, H, Hkv, block_size, scale, 0, lens[n], NULL);                \
        }                                                                                      \
        return 0;                                                                              \
    }
DEFINE_I8_DECODE(paged_decode_attention_i8_bf16, uint16_t, I8_BF16_BUILT, ITEM_I8_BF16,
                 SPLIT_I8_BF16)
DEFINE_I8_DECODE(paged_decode_attention_i8_f32, float, I8_F32_BUILT, ITEM_I8_F32, SPLIT_I8_F32)
