/* Greedy sampling's argmax over rows of float32 logits: out[i] = the index of row i's
 * largest value, the first one on ties; a row holding a NaN gives its first NaN's index
 * (what torch.max(dim).indices returns). torch's reduction reads a [64, 49,152] logits
 * block at a few GB/s on two threads; here each row is two vector passes (its maximum,
 * then the first index holding it) over data that stays in cache between them. */
#include "common.h"
#include "kernels.h"

static long argmax_row(const float *r, long cols) {
    long j = 0;
    float best = -INFINITY;
    int has_nan = 0;
#if defined(__AVX512F__)
    __m512 mx = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (; j + 16 <= cols; j += 16) {
        const __m512 v = _mm512_loadu_ps(r + j);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, v);
    }
    has_nan = nan != 0;
    best = _mm512_reduce_max_ps(mx);
#endif
    for (; j < cols; j++) {
        if (isnan(r[j])) has_nan = 1;
        else if (r[j] > best) best = r[j];
    }
    j = 0;
#if defined(__AVX512F__)
    const __m512 target = _mm512_set1_ps(best);
    for (; j + 16 <= cols; j += 16) {
        const __m512 v = _mm512_loadu_ps(r + j);
        const __mmask16 hit = has_nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                                      : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
        if (hit) return j + __builtin_ctz((unsigned)hit);
    }
#endif
    for (; j < cols; j++)
        if (has_nan ? isnan(r[j]) : r[j] == best) return j;
    return 0; /* not reached: some element holds the maximum */
}

/* x: [rows, cols] float32, row stride x_stride (elements); out: rows int64 indices. */
void argmax_rows_f32(const float *x, long x_stride, long rows, long cols, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows * cols >= 262144)
    for (long i = 0; i < rows; i++) out[i] = argmax_row(x + i * x_stride, cols);
}
