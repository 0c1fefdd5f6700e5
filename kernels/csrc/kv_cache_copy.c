/* Copies between a step's K/V rows, the paged caches and contiguous buffers: the cache
 * writes of every attention path and the block gather of the torch fallbacks. Plain C
 * (memcpy per row or block), dtype-agnostic: element widths come in bytes. */
#include <string.h>

#include "kernels.h"

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
 * row_bytes bytes (a block of all heads). The torch path (index_select) crawls over blocks
 * scattered over a multi-GB cache (docs/KERNELS.md); this one prefetches ahead. */
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
