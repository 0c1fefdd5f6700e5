/* AMX tile setup shared by the tile kernels (prefill_amx.c, linear_amx.c): Linux's
 * permission for the tile state and the tile configuration. Header-only (static inline);
 * everything here is compiled only where the compiler targets AMX. */
#ifndef SARAZMQ_AMX_H
#define SARAZMQ_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX_TILES 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) AmxTileConfig;

/* Linux hands out the tile state only on request (once per process, for every thread):
 * 1 granted, 0 not. Called before the parallel regions (its cache is not atomic). */
static inline int amx_tiles_granted(void) {
    static int state = -1; /* -1 not asked yet */
    if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
}

/* Configures this thread's tiles 0-7, each rows[t] rows of 64 bytes (tile state is per
 * thread: every thread of a parallel region loads it). */
static inline void amx_configure(const uint8_t rows[8]) {
    AmxTileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = rows[t];
        cfg.colsb[t] = 64;
    }
    /* not _tile_loadconfig: GCC's version tells the compiler that LDTILECFG reads only
     * the configuration's first 8 bytes, so the stores of the rest may be dropped or moved
     * past it (seen as a fault on LDTILECFG once the stack slot was shared); here the
     * operand is the whole 64-byte structure */
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}
#endif

#endif
