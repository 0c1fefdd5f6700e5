/* Writes of this step's K and V rows into an int8 paged KV cache (kernels/kv_int8.py).
 *
 * A cache row is one token's one KV head: D int8 values q and, after them, the float32
 * scale s, so that the row holds x ~= s * q. Symmetric per row: amax = max |x|,
 * s = amax / 127, q = round-half-even(x * (127 / amax)) (all zeros when amax is 0), the
 * float32 operations the torch reference (`quantize_kv_rows`) does, so both give the
 * same bytes. Inputs are bf16 or float32 rows [T, Hkv, D] (token stride free).
 */
#include "common.h"
#include "kernels.h"

/* One row: n = D values from src (bf16 when is_bf16, else float32) into dst (D + 4
 * bytes). */
static inline void quantize_row(const char *src, int is_bf16, int D, int8_t *dst) {
    float x[512];
    for (int d = 0; d < D; d++)
        x[d] = is_bf16 ? bf(((const uint16_t *)src)[d]) : ((const float *)src)[d];
    float amax = 0.0f;
    for (int d = 0; d < D; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
    const float scale = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
#pragma omp simd
    for (int d = 0; d < D; d++) {
        float v = rintf(x[d] * inv); /* the default rounding mode: half to even */
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        dst[d] = (int8_t)v;
    }
    memcpy(dst + D, &scale, sizeof scale);
}

/* k, v: [T, Hkv, D] rows (token strides in elements); caches: [num_slots, Hkv, D + 4]
 * int8; slots[i]: where token i goes. Returns 0; -1 for D beyond 512; -2 (nothing
 * written) for a slot outside the cache. */
int write_kv_cache_int8(const char *k, long k_stride, const char *v, long v_stride,
                        int8_t *k_cache, int8_t *v_cache, const int64_t *slots, long num_tokens,
                        int Hkv, int D, int is_bf16, long num_slots) {
    if (D < 1 || D > 512) return -1;
    for (long i = 0; i < num_tokens; i++)
        if (slots[i] < 0 || slots[i] >= num_slots) return -2;
    const long elem = is_bf16 ? 2 : 4, row = (long)D + 4;
#pragma omp parallel for schedule(static) if (num_tokens >= 64)
    for (long i = 0; i < num_tokens; i++) {
        for (int h = 0; h < Hkv; h++) {
            const long dst = (slots[i] * Hkv + h) * row;
            quantize_row(k + (i * k_stride + (long)h * D) * elem, is_bf16, D, k_cache + dst);
            quantize_row(v + (i * v_stride + (long)h * D) * elem, is_bf16, D, v_cache + dst);
        }
    }
    return 0;
}

/* Reads blocks[0 .. n) of an int8 cache ([num_blocks, block_size, Hkv, D + 4]) as blocks
 * out [n, block_size, Hkv, D] of bf16 (is_bf16) or float32, each value q * s in float32
 * (rounded to nearest even for bf16): the bits of the torch reference
 * `dequantize_kv_rows(rows, dtype)`. A prefill chunk's context, for the prefill kernels.
 * Returns 0; -1 for D beyond 512; -2 (nothing written) for a block id outside the cache. */
static int dequantize_blocks(const int8_t *cache, const int32_t *blocks, long n, int block_size,
                             int Hkv, int D, long num_blocks, void *out, int is_bf16) {
    if (D < 1 || D > 512) return -1;
    for (long b = 0; b < n; b++)
        if (blocks[b] < 0 || blocks[b] >= num_blocks) return -2;
    const long rows_per_block = (long)block_size * Hkv, row = (long)D + 4;
#pragma omp parallel for schedule(static) if (n * rows_per_block >= 256)
    for (long r = 0; r < n * rows_per_block; r++) {
        const long b = r / rows_per_block, within = r % rows_per_block;
        const int8_t *src = cache + ((long)blocks[b] * rows_per_block + within) * row;
        float s;
        memcpy(&s, src + D, sizeof s);
        if (is_bf16) {
            uint16_t *dst = (uint16_t *)out + r * D;
            for (int d = 0; d < D; d++) dst[d] = to_bf((float)src[d] * s);
        } else {
            float *dst = (float *)out + r * D;
#pragma omp simd
            for (int d = 0; d < D; d++) dst[d] = (float)src[d] * s;
        }
    }
    return 0;
}

int dequantize_kv_blocks_int8_bf16(const int8_t *cache, const int32_t *blocks, long n,
                                   int block_size, int Hkv, int D, long num_blocks,
                                   uint16_t *out) {
    return dequantize_blocks(cache, blocks, n, block_size, Hkv, D, num_blocks, out, 1);
}

int dequantize_kv_blocks_int8_f32(const int8_t *cache, const int32_t *blocks, long n,
                                  int block_size, int Hkv, int D, long num_blocks, float *out) {
    return dequantize_blocks(cache, blocks, n, block_size, Hkv, D, num_blocks, out, 0);
}
