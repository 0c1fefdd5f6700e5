/* Fused elementwise ops of the Llama block for CPUs: RMSNorm with the residual add, RoPE
 * in place, SiLU-and-multiply; and matrix-vector products for decode steps. The
 * elementwise ones each replace 2-9 small torch ops whose dispatch costs more than their
 * math in decode steps (30 layers x a dozen ops per step), and they are faster than the
 * torch ops at every row count (docs/KERNELS.md, "Elementwise kernels").
 *
 * Numerics follow transformers' Llama (and sarazmq.kernels.ops, the torch reference)
 * operation for operation: float32 math, and for bf16 a rounding to bf16 wherever torch
 * stores a bf16 intermediate. Built with -ffp-contract=off so a*b+c is never fused into
 * one rounding where torch rounds twice. Rows are parallel over OpenMP threads when there
 * are enough of them.
 */
#include "common.h"
#include "kernels.h"

#define PAR_ROWS(rows) _Pragma("omp parallel for schedule(static) if (rows >= 32)")

/* One row of rms_norm_f32: ri (optional) += xi, then oi = RMSNorm(ri or xi) * weight.
 * Not inlined: rms_norm_quantize_f32 (act_quant.c) runs this very code, so its rows are
 * bitwise rms_norm_f32's. */
__attribute__((noinline)) void rms_norm_row_f32(const float *xi, float *ri, const float *weight,
                                               float *oi, int hidden, float eps) {
    const float *src = xi;
    if (ri) {
        for (int j = 0; j < hidden; j++) ri[j] = ri[j] + xi[j];
        src = ri;
    }
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int j = 0; j < hidden; j++) ss += src[j] * src[j];
    const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
    for (int j = 0; j < hidden; j++) oi[j] = (src[j] * inv) * weight[j];
}

/* residual (optional) += x, then out = RMSNorm(residual or x) * weight.
 * x, residual, out: [rows, hidden] with row strides; weight [hidden]. */
void rms_norm_f32(const float *x, long x_stride, float *residual, long r_stride,
                  const float *weight, float *out, long o_stride, long rows, int hidden,
                  float eps) {
    PAR_ROWS(rows)
    for (long i = 0; i < rows; i++)
        rms_norm_row_f32(x + i * x_stride, residual ? residual + i * r_stride : NULL, weight,
                         out + i * o_stride, hidden, eps);
}

#if defined(__AVX512F__)
/* One row of rms_norm_bf16 (hidden % 16 == 0) in 16-lane vectors: the residual add and
 * the sum of squares in one pass, the scaling in a second over the row just written
 * (in L1). Roundings as the scalar loop. */
static inline void rms_norm_row_bf16(const uint16_t *xi, uint16_t *ri, const uint16_t *weight,
                                     uint16_t *oi, int hidden, float eps) {
    __m512 ss = _mm512_setzero_ps();
    const uint16_t *src = ri ? ri : xi;
    for (int j = 0; j < hidden; j += 16) {
        __m512 v = bf16x16_load(xi + j);
        if (ri) {
            v = bf16x16_round(_mm512_add_ps(bf16x16_load(ri + j), v));
            bf16x16_store(ri + j, v);
        }
        ss = _mm512_add_ps(ss, _mm512_mul_ps(v, v));
    }
    const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)hidden + eps);
    const __m512 iv = _mm512_set1_ps(inv);
    for (int j = 0; j < hidden; j += 16) {
        const __m512 n = bf16x16_round(_mm512_mul_ps(bf16x16_load(src + j), iv));
        bf16x16_store(oi + j, bf16x16_round(_mm512_mul_ps(n, bf16x16_load(weight + j))));
    }
}
#endif

void rms_norm_bf16(const uint16_t *x, long x_stride, uint16_t *residual, long r_stride,
                   const uint16_t *weight, uint16_t *out, long o_stride, long rows, int hidden,
                   float eps) {
#if defined(__AVX512F__)
    if (hidden % 16 == 0) {
        PAR_ROWS(rows)
        for (long i = 0; i < rows; i++)
            rms_norm_row_bf16(x + i * x_stride, residual ? residual + i * r_stride : NULL, weight,
                              out + i * o_stride, hidden, eps);
        return;
    }
#endif
    PAR_ROWS(rows)
    for (long i = 0; i < rows; i++) {
        const uint16_t *xi = x + i * x_stride;
        const uint16_t *src = xi;
        if (residual) {
            uint16_t *ri = residual + i * r_stride;
            for (int j = 0; j < hidden; j++) ri[j] = to_bf(bf(ri[j]) + bf(xi[j]));
            src = ri;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int j = 0; j < hidden; j++) ss += bf(src[j]) * bf(src[j]);
        const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
        uint16_t *oi = out + i * o_stride;
        for (int j = 0; j < hidden; j++) oi[j] = to_bf(round_bf(bf(src[j]) * inv) * bf(weight[j]));
    }
}

/* RoPE in place (rotate_half convention) on x [rows, heads, D] (row stride x_stride, head
 * stride D), with per-row tables cos [rows, D] and sin_signed [rows, D] (= cat(-sin, sin))
 * already in x's dtype: x = x * cos + cat(x2, x1) * sin_signed. */
void rope_f32(float *x, long x_stride, const float *cos, const float *sin_signed, long rows,
              int heads, int D) {
    const int half = D / 2;
    PAR_ROWS(rows)
    for (long i = 0; i < rows; i++) {
        const float *c = cos + i * (long)D, *s = sin_signed + i * (long)D;
        for (int h = 0; h < heads; h++) {
            float *xh = x + i * x_stride + (long)h * D;
            float tmp[512];
            for (int d = 0; d < D; d++) tmp[d] = xh[d];
            for (int d = 0; d < half; d++) xh[d] = tmp[d] * c[d] + tmp[d + half] * s[d];
            for (int d = half; d < D; d++) xh[d] = tmp[d] * c[d] + tmp[d - half] * s[d];
        }
    }
}

void rope_bf16(uint16_t *x, long x_stride, const uint16_t *cos, const uint16_t *sin_signed,
               long rows, int heads, int D) {
    const int half = D / 2;
    PAR_ROWS(rows)
    for (long i = 0; i < rows; i++) {
        const uint16_t *c = cos + i * (long)D, *s = sin_signed + i * (long)D;
#if defined(__AVX512F__)
        if (half % 16 == 0 && half <= 256) {
            /* 16 lanes at a time, the same roundings as the scalar loop below (bitwise) */
            for (int h = 0; h < heads; h++) {
                uint16_t *xh = x + i * x_stride + (long)h * D;
                for (int d = 0; d < half; d += 16) {
                    const __m512 lo = bf16x16_load(xh + d), hi = bf16x16_load(xh + half + d);
                    const __m512 out_lo = bf16x16_round(
                        _mm512_add_ps(bf16x16_round(_mm512_mul_ps(lo, bf16x16_load(c + d))),
                                      bf16x16_round(_mm512_mul_ps(hi, bf16x16_load(s + d)))));
                    const __m512 out_hi = bf16x16_round(_mm512_add_ps(
                        bf16x16_round(_mm512_mul_ps(hi, bf16x16_load(c + half + d))),
                        bf16x16_round(_mm512_mul_ps(lo, bf16x16_load(s + half + d)))));
                    bf16x16_store(xh + d, out_lo);
                    bf16x16_store(xh + half + d, out_hi);
                }
            }
            continue;
        }
#endif
        for (int h = 0; h < heads; h++) {
            uint16_t *xh = x + i * x_stride + (long)h * D;
            float tmp[512];
            for (int d = 0; d < D; d++) tmp[d] = bf(xh[d]);
            for (int d = 0; d < half; d++)
                xh[d] = to_bf(round_bf(tmp[d] * bf(c[d])) + round_bf(tmp[d + half] * bf(s[d])));
            for (int d = half; d < D; d++)
                xh[d] = to_bf(round_bf(tmp[d] * bf(c[d])) + round_bf(tmp[d - half] * bf(s[d])));
        }
    }
}

/* SwiGLU's activation: out = silu(gate) * up for gate_up [rows, 2 * inter] (gate, then
 * up; row stride gu_stride) into out [rows, inter] (row stride o_stride). silu(g) =
 * g / (1 + exp(-g)) in float32, as torch computes it; bf16 rounds where torch stores a
 * bf16 tensor (after silu, after the product). exp_approx is within ~2 ulp of torch's, so
 * results can differ from torch's in the last bit. */

/* One row of silu_mul_f32 (g: the row's gate, then its up); not inlined, as
 * rms_norm_row_f32, for silu_mul_quantize_f32 */
__attribute__((noinline)) void silu_mul_row_f32(const float *g, float *o, int inter) {
    const float *u = g + inter;
    int j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= inter; j += 16)
        _mm512_storeu_ps(o + j, _mm512_mul_ps(silu16(_mm512_loadu_ps(g + j)),
                                              _mm512_loadu_ps(u + j)));
#elif defined(AVX2_ONLY)
    for (; j + 8 <= inter; j += 8)
        _mm256_storeu_ps(o + j, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + j)),
                                              _mm256_loadu_ps(u + j)));
#endif
    for (; j < inter; j++) o[j] = (g[j] / (1.0f + exp_approx(-g[j]))) * u[j];
}

void silu_mul_f32(const float *gate_up, long gu_stride, float *out, long o_stride, long rows,
                  int inter) {
    PAR_ROWS(rows)
    for (long i = 0; i < rows; i++)
        silu_mul_row_f32(gate_up + i * gu_stride, out + i * o_stride, inter);
}

void silu_mul_bf16(const uint16_t *gate_up, long gu_stride, uint16_t *out, long o_stride,
                   long rows, int inter) {
    PAR_ROWS(rows)
    for (long i = 0; i < rows; i++) {
        const uint16_t *g = gate_up + i * gu_stride, *u = g + inter;
        uint16_t *o = out + i * o_stride;
        int j = 0;
#if defined(__AVX512F__)
        for (; j + 16 <= inter; j += 16) {
            bf16x16_store(o + j, silu_mul16_bf16(bf16x16_load(g + j), bf16x16_load(u + j)));
        }
#endif
        for (; j < inter; j++) {
            const float x = bf(g[j]);
            o[j] = to_bf(round_bf(x / (1.0f + exp_approx(-x))) * bf(u[j]));
        }
    }
}

/* Matrix-vector products for decode steps: y[m][n] = sum_k x[m][k] w[n][k] for a few rows
 * m, float32 accumulation (bf16: VDPBF16PS pairs, one rounding to bf16 at the end, to
 * nearest even). At one or two rows oneDNN (bf16) and MKL (float32) read the weights at a
 * fraction of the machine's bandwidth; here the rows of w are read once, front to back
 * (the hardware prefetcher streams them), 16 output rows at a time: each row's dot
 * product in vector partials, the 16 partial vectors summed across lanes together
 * (hsum16).
 * x: [M, K] row stride x_stride; w: [N, K] contiguous; y: [M, N] row stride y_stride.
 * Returns 0, or -1 (nothing written) when this build or these sizes are not covered. */
#if defined(__AVX512F__)

/* acc += x . w over one vector of VE elements, per element type */
static inline __attribute__((always_inline)) __m512 f32_fma(__m512 acc, const float *x,
                                                            const float *w) {
    return _mm512_fmadd_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(w), acc);
}
static inline __attribute__((always_inline)) void f32_store16(float *y, __m512 v, int nn) {
    _mm512_mask_storeu_ps(y, (__mmask16)((1u << nn) - 1u), v);
}
#if defined(__AVX512BF16__)
static inline __attribute__((always_inline)) __m512 bf16_dp(__m512 acc, const uint16_t *x,
                                                            const uint16_t *w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x),
                            (__m512bh)_mm512_loadu_si512(w));
}
static inline __attribute__((always_inline)) void bf16_store16(uint16_t *y, __m512 v, int nn) {
    _mm256_mask_storeu_epi16(y, (__mmask16)((1u << nn) - 1u), (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

/* NAME: y for all M rows of x, in tiles of 16 output rows; each VE-element piece of a
 * weight row is loaded once for every input row. M is a compile-time constant per case
 * (always_inline), so the M accumulators stay in registers; at M = 1 a second chain
 * halves the dependency latency, and two output rows are summed side by side (four
 * chains: VDPBF16PS's latency bounded the one-row loop), each in the same order as alone. */
#define DEFINE_GEMV(NAME, T, VE, DOT, STORE16)                                                 \
    static inline __attribute__((always_inline)) void NAME##_tile(                             \
        const int M, const T *x, long x_stride, const T *w, T *y, long y_stride, int n0,       \
        int nn, int K) {                                                                       \
        const int KV = K / VE;                                                                 \
        __m512 acc[GEMV_MAX_ROWS][16];                                                         \
        if (M == 1) {                                                                          \
            for (int i = 0; i < 16; i += 2) {                                                  \
                __m512 a0 = _mm512_setzero_ps(), b0 = a0, a1 = a0, b1 = a0;                    \
                if (i < nn) {                                                                  \
                    const T *w0 = w + (long)(n0 + i) * K;                                      \
                    const int two = i + 1 < nn;                                                \
                    const T *w1 = two ? w0 + K : w0;                                           \
                    int kv = 0;                                                                \
                    for (; kv + 1 < KV; kv += 2) {                                             \
                        a0 = DOT(a0, x + VE * kv, w0 + VE * kv);                               \
                        b0 = DOT(b0, x + VE * kv + VE, w0 + VE * kv + VE);                     \
                        if (two) {                                                             \
                            a1 = DOT(a1, x + VE * kv, w1 + VE * kv);                           \
                            b1 = DOT(b1, x + VE * kv + VE, w1 + VE * kv + VE);                 \
                        }                                                                      \
                    }                                                                          \
                    for (; kv < KV; kv++) {                                                    \
                        a0 = DOT(a0, x + VE * kv, w0 + VE * kv);                               \
                        if (two) a1 = DOT(a1, x + VE * kv, w1 + VE * kv);                      \
                    }                                                                          \
                }                                                                              \
                acc[0][i] = _mm512_add_ps(a0, b0);                                             \
                acc[0][i + 1] = _mm512_add_ps(a1, b1);                                         \
            }                                                                                  \
        } else { /* two output rows side by side here too (2 M chains) */                   \
            for (int i = 0; i < 16; i += 2) {                                                  \
                __m512 a[2][GEMV_MAX_ROWS];                                                    \
                for (int m = 0; m < M; m++) a[0][m] = a[1][m] = _mm512_setzero_ps();           \
                if (i < nn) {                                                                  \
                    const T *w0 = w + (long)(n0 + i) * K;                                      \
                    const int two = i + 1 < nn;                                                \
                    for (int kv = 0; kv < KV; kv++) {                                          \
                        for (int m = 0; m < M; m++)                                            \
                            a[0][m] = DOT(a[0][m], x + m * x_stride + VE * kv, w0 + VE * kv);  \
                        if (two)                                                               \
                            for (int m = 0; m < M; m++)                                        \
                                a[1][m] = DOT(a[1][m], x + m * x_stride + VE * kv,             \
                                              w0 + K + VE * kv);                               \
                    }                                                                          \
                }                                                                              \
                for (int j = 0; j < 2; j++) {                                                  \
                    acc[0][i + j] = _mm512_add_ps(a[j][0], _mm512_setzero_ps());               \
                    for (int m = 1; m < M; m++) acc[m][i + j] = a[j][m];                       \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int m = 0; m < M; m++) STORE16(y + (long)m * y_stride + n0, hsum16(acc[m]), nn);  \
    }                                                                                          \
                                                                                               \
    int NAME##_covers(int M, int N, int K) {                                                   \
        return M >= 1 && M <= GEMV_MAX_ROWS && N >= 1 && K >= VE && K % VE == 0;               \
    }                                                                                          \
                                                                                               \
    int NAME(const T *x, long x_stride, const T *w, T *y, long y_stride, int M, int N,         \
             int K) {                                                                          \
        if (!NAME##_covers(M, N, K)) return -1;                                                \
        const long tiles = (N + 15) / 16;                                                      \
        _Pragma("omp parallel for schedule(static)")                                           \
        for (long tile = 0; tile < tiles; tile++) {                                            \
            const int n0 = (int)tile * 16, nn = N - n0 < 16 ? N - n0 : 16;                     \
            switch (M) {                                                                       \
            case 1: NAME##_tile(1, x, x_stride, w, y, y_stride, n0, nn, K); break;             \
            case 2: NAME##_tile(2, x, x_stride, w, y, y_stride, n0, nn, K); break;             \
            case 3: NAME##_tile(3, x, x_stride, w, y, y_stride, n0, nn, K); break;             \
            case 4: NAME##_tile(4, x, x_stride, w, y, y_stride, n0, nn, K); break;             \
            case 5: NAME##_tile(5, x, x_stride, w, y, y_stride, n0, nn, K); break;             \
            case 6: NAME##_tile(6, x, x_stride, w, y, y_stride, n0, nn, K); break;             \
            case 7: NAME##_tile(7, x, x_stride, w, y, y_stride, n0, nn, K); break;             \
            case 8: NAME##_tile(8, x, x_stride, w, y, y_stride, n0, nn, K); break;             \
            default: break; /* NAME##_covers keeps M in 1 .. 8 */                              \
            }                                                                                  \
        }                                                                                      \
        return 0;                                                                              \
    }

DEFINE_GEMV(gemv_f32, float, 16, f32_fma, f32_store16)
#if defined(__AVX512BF16__)
DEFINE_GEMV(gemv_bf16, uint16_t, 32, bf16_dp, bf16_store16)
#define HAVE_GEMV_BF16 1
#endif
#define HAVE_GEMV_F32 1
#endif

/* Builds without the instructions: -1, the caller falls back to torch (AVX2 builds: the
 * float32 kernel is gemv_avx2.c's). */
#if !defined(HAVE_GEMV_F32) && !defined(AVX2_ONLY)
int gemv_f32_covers(int M, int N, int K) {
    (void)M; (void)N; (void)K;
    return 0;
}
int gemv_f32(const float *x, long x_stride, const float *w, float *y, long y_stride, int M,
             int N, int K) {
    (void)x; (void)x_stride; (void)w; (void)y; (void)y_stride; (void)M; (void)N; (void)K;
    return -1;
}
#endif
#ifndef HAVE_GEMV_BF16
int gemv_bf16_covers(int M, int N, int K) {
    (void)M; (void)N; (void)K;
    return 0;
}
int gemv_bf16(const uint16_t *x, long x_stride, const uint16_t *w, uint16_t *y, long y_stride,
              int M, int N, int K) {
    (void)x; (void)x_stride; (void)w; (void)y; (void)y_stride; (void)M; (void)N; (void)K;
    return -1;
}
#endif
