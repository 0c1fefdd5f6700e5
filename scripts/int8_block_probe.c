/* Probe behind docs/KERNELS.md's "Zen 4 (2026-12-07): ... the block formats' ceiling
 * measured": one thread's rate of 512-bit VPDPBUSD alone (the int8 probe of
 * bench_engine.py / bench_int8_dot.py) and of the same instructions in a block format's
 * mix, operands in registers or L1: per 32-value block and 16 output columns 8 VPDPBUSD,
 * then the block's scaling, 8 output vectors a round (a 4-row x 2-panel tile). Three
 * mixes:
 *   - Q4_1 x Q8, as kernels/csrc/int8_panels.c scales a block (int32 -> float,
 *     d_w * d_x, two FMAs);
 *   - Q4_0 x Q8 (no m_w term; the -8 offset taken off in integers);
 *   - Q4_1 with one activation scale a row instead of one a block (a numerics change
 *     llama.cpp does not make).
 * Prints int8 multiply-adds per ns and each mix's ratio to VPDPBUSD alone: the most such a
 * matmul can reach on this core, before loads.
 * Not part of the build; on a CPU with AVX512-VNNI (argument: millions of VPDPBUSD rounds
 * of 16, default 20; tests/test_int8_block_probe.py runs 1):
 *   gcc -O3 -march=native -o /tmp/int8_block_probe scripts/int8_block_probe.c && \
 *       /tmp/int8_block_probe */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SETS 8 /* output vectors a round: the tile's 4 rows x 2 panels */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* 16 independent VPDPBUSD chains: its latency x issue rate, with slack */
static __attribute__((noinline)) int dot_only(long iters) {
    __m512i w = _mm512_set1_epi8(7), x = _mm512_set1_epi8(1), a[16];
    for (int c = 0; c < 16; c++) a[c] = _mm512_setzero_si512();
    for (long it = 0; it < iters; it++) {
        __asm__ volatile("" : "+v"(x));
        for (int c = 0; c < 16; c++) a[c] = _mm512_dpbusd_epi32(a[c], w, x);
    }
    for (int c = 1; c < 16; c++) a[0] = _mm512_add_epi32(a[0], a[c]);
    return _mm512_reduce_add_epi32(a[0]);
}

/* SETS output vectors a round, each one block: 8 VPDPBUSD into a fresh int32 sum, then
 * acc += float(sum) * (d_w * d_x) + m_w * s_x with the scales read from L1 every round (in
 * a kernel they change with every block). Written in assembly: compilers spill the
 * accumulators of a C version of this loop, which then measures the spills. Registers:
 * sums zmm0-7, accumulators zmm8-15, activation bytes zmm16-23, the weight run zmm24. */
#define DOTS                                                                             \
    "vpdpbusd %%zmm16, %%zmm24, %%zmm0\n\t vpdpbusd %%zmm17, %%zmm24, %%zmm1\n\t"        \
    "vpdpbusd %%zmm18, %%zmm24, %%zmm2\n\t vpdpbusd %%zmm19, %%zmm24, %%zmm3\n\t"        \
    "vpdpbusd %%zmm20, %%zmm24, %%zmm4\n\t vpdpbusd %%zmm21, %%zmm24, %%zmm5\n\t"        \
    "vpdpbusd %%zmm22, %%zmm24, %%zmm6\n\t vpdpbusd %%zmm23, %%zmm24, %%zmm7\n\t"
/* The scaling of sum i into acc 8+i, one macro per format (scales read from L1 as a kernel
 * reads them, a new block's every round: d_w zmm25, m_w zmm26, d_x / s_x / 8 * S_x per row
 * at 128 / 160 / 192 bytes):
 * Q4_1 x Q8 (the kernels' mix): acc += float(sum) * (d_w * d_x) + m_w * s_x. */
#define SCALE_Q4_1(i, acc)                                                               \
    "vcvtdq2ps %%zmm" #i ", %%zmm" #i "\n\t"                                             \
    "vmulps 4*" #i "+128(%[sc])%{1to16%}, %%zmm25, %%zmm27\n\t"                          \
    "vfmadd231ps %%zmm27, %%zmm" #i ", %%zmm" #acc "\n\t"                                \
    "vfmadd231ps 4*" #i "+160(%[sc])%{1to16%}, %%zmm26, %%zmm" #acc "\n\t"
/* Q4_0 x Q8: weights d_w * (q - 8), the offset taken off in integers (sum - 8 * S_x),
 * then acc += float(sum) * (d_w * d_x): no m_w term */
#define SCALE_Q4_0(i, acc)                                                               \
    "vpsubd 4*" #i "+192(%[sc])%{1to16%}, %%zmm" #i ", %%zmm" #i "\n\t"                  \
    "vcvtdq2ps %%zmm" #i ", %%zmm" #i "\n\t"                                             \
    "vmulps 4*" #i "+128(%[sc])%{1to16%}, %%zmm25, %%zmm27\n\t"                          \
    "vfmadd231ps %%zmm27, %%zmm" #i ", %%zmm" #acc "\n\t"
/* Q4_1 with one activation scale per row (not llama.cpp's Q8 blocks: d_x applied once
 * after the row's blocks): acc += float(sum) * d_w + m_w * S_x */
#define SCALE_ROW(i, acc)                                                                \
    "vcvtdq2ps %%zmm" #i ", %%zmm" #i "\n\t"                                             \
    "vfmadd231ps %%zmm25, %%zmm" #i ", %%zmm" #acc "\n\t"                                \
    "vfmadd231ps 4*" #i "+160(%[sc])%{1to16%}, %%zmm26, %%zmm" #acc "\n\t"

/* SETS output vectors a round, each one block: 8 VPDPBUSD into a fresh int32 sum, then
 * the block's scaling. Written in assembly: compilers spill the accumulators of a C
 * version of this loop, which then measures the spills. Registers: sums zmm0-7,
 * accumulators zmm8-15, activation bytes zmm16-23, the weight run zmm24. */
#define BLOCK_LOOP(name, SCALE)                                                          \
    static __attribute__((noinline)) float name(long iters, const float *scales) {      \
        float out[16] __attribute__((aligned(64)));                                      \
        __asm__ volatile(                                                                \
            "vpternlogd $0xff, %%zmm24, %%zmm24, %%zmm24\n\t" /* weights: bytes 255 */   \
            "vpabsb %%zmm24, %%zmm16\n\t"                     /* activations: all 1 */   \
            "vmovdqa64 %%zmm16, %%zmm17\n\t vmovdqa64 %%zmm16, %%zmm18\n\t"              \
            "vmovdqa64 %%zmm16, %%zmm19\n\t vmovdqa64 %%zmm16, %%zmm20\n\t"              \
            "vmovdqa64 %%zmm16, %%zmm21\n\t vmovdqa64 %%zmm16, %%zmm22\n\t"              \
            "vmovdqa64 %%zmm16, %%zmm23\n\t"                                             \
            "vpxord %%zmm8, %%zmm8, %%zmm8\n\t vpxord %%zmm9, %%zmm9, %%zmm9\n\t"        \
            "vpxord %%zmm10, %%zmm10, %%zmm10\n\t vpxord %%zmm11, %%zmm11, %%zmm11\n\t"  \
            "vpxord %%zmm12, %%zmm12, %%zmm12\n\t vpxord %%zmm13, %%zmm13, %%zmm13\n\t"  \
            "vpxord %%zmm14, %%zmm14, %%zmm14\n\t vpxord %%zmm15, %%zmm15, %%zmm15\n\t"  \
            "1:\n\t"                                                                     \
            "vpxord %%zmm0, %%zmm0, %%zmm0\n\t vpxord %%zmm1, %%zmm1, %%zmm1\n\t"        \
            "vpxord %%zmm2, %%zmm2, %%zmm2\n\t vpxord %%zmm3, %%zmm3, %%zmm3\n\t"        \
            "vpxord %%zmm4, %%zmm4, %%zmm4\n\t vpxord %%zmm5, %%zmm5, %%zmm5\n\t"        \
            "vpxord %%zmm6, %%zmm6, %%zmm6\n\t vpxord %%zmm7, %%zmm7, %%zmm7\n\t"        \
            DOTS DOTS DOTS DOTS DOTS DOTS DOTS DOTS /* the block's 8 runs of 4 bytes */ \
            "vmovups (%[sc]), %%zmm25\n\t vmovups 64(%[sc]), %%zmm26\n\t"                \
            SCALE(0, 8) SCALE(1, 9) SCALE(2, 10) SCALE(3, 11)                            \
            SCALE(4, 12) SCALE(5, 13) SCALE(6, 14) SCALE(7, 15)                          \
            "dec %[n]\n\t jnz 1b\n\t"                                                    \
            "vaddps %%zmm8, %%zmm9, %%zmm8\n\t vaddps %%zmm10, %%zmm11, %%zmm10\n\t"     \
            "vaddps %%zmm12, %%zmm13, %%zmm12\n\t vaddps %%zmm14, %%zmm15, %%zmm14\n\t"  \
            "vaddps %%zmm8, %%zmm10, %%zmm8\n\t vaddps %%zmm12, %%zmm14, %%zmm12\n\t"    \
            "vaddps %%zmm8, %%zmm12, %%zmm8\n\t vmovaps %%zmm8, %[out]\n\t"              \
            : [n] "+r"(iters), [out] "=m"(out)                                           \
            : [sc] "r"(scales)                                                           \
            : "cc", "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6",    \
              "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14",       \
              "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22",    \
              "xmm23", "xmm24", "xmm25", "xmm26", "xmm27");                              \
        return out[0];                                                                   \
    }

BLOCK_LOOP(block_q4_1, SCALE_Q4_1)
BLOCK_LOOP(block_q4_0, SCALE_Q4_0)
BLOCK_LOOP(block_row_scale, SCALE_ROW)

int main(int argc, char **argv) {
    /* d_w x 16, m_w x 16, then per row d_x, s_x (float) and 8 * S_x (int32) x SETS */
    static float scales[32 + 3 * SETS] __attribute__((aligned(64)));
    for (int i = 0; i < 32 + 2 * SETS; i++) scales[i] = 1e-3f * (float)(1 + i % 5);
    for (int i = 0; i < SETS; i++) {
        const int eight_s = 8 * (i + 1);
        memcpy(&scales[32 + 2 * SETS + i], &eight_s, sizeof eight_s);
    }
    const long n = (argc > 1 ? atol(argv[1]) : 20) * 1000000L;
    if (n <= 0) {
        fprintf(stderr, "int8_block_probe: the argument is millions of rounds (> 0)\n");
        return 2;
    }
    float (*const mixes[3])(long, const float *) = {block_q4_1, block_q4_0, block_row_scale};
    volatile float sink = 0;
    printf("| VPDPBUSD alone (MAC/ns) | Q4_1 x Q8 mix (MAC/ns) | ratio | Q4_0 x Q8 ratio | "
           "Q4_1, one x scale a row: ratio |\n|---|---|---|---|---|\n");
    for (int rep = 0; rep < 3; rep++) {
        double t = now();
        sink += (float)dot_only(n);
        const double alone = n * 16.0 * 64 / (now() - t) / 1e9;
        const long rounds = n * 16 / (SETS * 8);
        double mixed[3];
        for (int m = 0; m < 3; m++) {
            t = now();
            sink += mixes[m](rounds, scales);
            mixed[m] = rounds * (double)SETS * 8 * 64 / (now() - t) / 1e9;
        }
        printf("| %.0f | %.0f | %.3f | %.3f | %.3f |\n", alone, mixed[0], mixed[0] / alone,
               mixed[1] / alone, mixed[2] / alone);
    }
    (void)sink;
    return 0;
}
