/* Probe behind docs/KERNELS.md's "Why there is no AMX-INT8 variant": one thread's AMX
 * tile-product rate for int8 (TDPBUSD) at K = 64 and 32 bytes and bf16 (TDPBF16PS) at 64,
 * and a GGUF-block loop (TDPBUSD over one 32-byte block, tile stored, each row converted,
 * scaled and added into float accumulators with AVX-512). Prints multiply-adds per ns.
 * Not part of the build; on a CPU with AMX:
 *   gcc -O2 -march=native -mamx-tile -mamx-int8 -mamx-bf16 -o /tmp/amx_probe \
 *       scripts/amx_int8_probe.c && /tmp/amx_probe */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct { uint8_t palette_id, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; }
    __attribute__((packed, aligned(64))) Cfg;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void config(int kbytes) {
    Cfg c; memset(&c, 0, sizeof c); c.palette_id = 1;
    for (int t = 0; t < 8; t++) { c.rows[t] = 16; c.colsb[t] = 64; }
    /* tiles 4,5 = A (16 x kbytes), 6,7 = B (kbytes/4 rows x 64) */
    c.colsb[4] = c.colsb[5] = kbytes; c.rows[6] = c.rows[7] = kbytes / 4;
    __asm__ volatile("ldtilecfg %0" : : "m"(c));
}
static uint8_t A[16 * 64] __attribute__((aligned(64)));
static int8_t B[16 * 64] __attribute__((aligned(64)));
static int32_t Cbuf[4][256] __attribute__((aligned(64)));
static float acc[4][256] __attribute__((aligned(64)));
static float ds[64] __attribute__((aligned(64)));

int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023, 18)) { puts("no AMX permission"); return 1; }
    for (int i = 0; i < 1024; i++) { A[i] = i % 15; B[i] = (i % 13) - 6; }
    for (int i = 0; i < 64; i++) ds[i] = 0.01f * (i + 1);
    const long N = 2000000;
    for (int kb = 64; kb >= 32; kb -= 32) {
        config(kb);
        _tile_loadd(4, A, 64); _tile_loadd(5, A, 64); _tile_loadd(6, B, 64); _tile_loadd(7, B, 64);
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        double t = now();
        for (long i = 0; i < N; i++) {
            _tile_dpbusd(0, 4, 6); _tile_dpbusd(1, 4, 7); _tile_dpbusd(2, 5, 6); _tile_dpbusd(3, 5, 7);
        }
        t = now() - t;
        printf("TDPBUSD  K=%2d bytes: %.1f int8 MAC/ns (%.2f ns a tile product)\n", kb, 4.0 * N * 256 * kb / t / 1e9, t / (4.0 * N) * 1e9);
        if (kb == 64) {
            double t2 = now();
            for (long i = 0; i < N; i++) {
                _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
            }
            t2 = now() - t2;
            printf("TDPBF16PS K=64 bytes: %.1f bf16 MAC/ns (%.2f ns a tile product)\n", 4.0 * N * 256 * 32 / t2 / 1e9, t2 / (4.0 * N) * 1e9);
        }
    }
    /* int8 K=32 tiles with each block's result scaled into float accumulators */
    config(32);
    _tile_loadd(4, A, 64); _tile_loadd(5, A, 64); _tile_loadd(6, B, 64); _tile_loadd(7, B, 64);
    const long NB = 400000;
    double t = now();
    for (long i = 0; i < NB; i++) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        _tile_dpbusd(0, 4, 6); _tile_dpbusd(1, 4, 7); _tile_dpbusd(2, 5, 6); _tile_dpbusd(3, 5, 7);
        _tile_stored(0, Cbuf[0], 64); _tile_stored(1, Cbuf[1], 64); _tile_stored(2, Cbuf[2], 64); _tile_stored(3, Cbuf[3], 64);
        const __m512 dx = _mm512_loadu_ps(ds + (i & 31));
        for (int q = 0; q < 4; q++)
            for (int r = 0; r < 16; r++) {
                const __m512 f = _mm512_cvtepi32_ps(_mm512_load_si512(Cbuf[q] + 16 * r));
                const __m512 s = _mm512_mul_ps(dx, _mm512_set1_ps(ds[(r + q) & 63]));
                __m512 a = _mm512_load_ps(acc[q] + 16 * r);
                a = _mm512_fmadd_ps(f, s, a);
                _mm512_store_ps(acc[q] + 16 * r, a);
            }
    }
    t = now() - t;
    printf("int8 K=32 + per-block scaling: %.1f MAC/ns (checksum %g)\n", 4.0 * NB * 256 * 32 / t / 1e9, acc[1][7]);
    return 0;
}
