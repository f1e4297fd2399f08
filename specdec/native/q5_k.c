/* Q5_K: super-blocks of 256 k (kquant.h's scales), 32 bytes of high bits (bit s of byte l: sub-
 * block s, k = l), then 128 bytes of low nibbles as Q4_K's. */
#include "kquant.h"

static void q5_k_decode(const uint8_t *blk, int s, uint8_t q[32]) {
    const uint8_t *qh = blk + 16, *qs = blk + 48 + 32 * (s / 2);
    for (int l = 0; l < 32; l++) q[l] = (uint8_t)((s % 2 ? qs[l] >> 4 : qs[l] & 15) | ((qh[l] >> s) & 1) << 4);
}

static void q5_k_head(const uint8_t *blk, uint8_t *head, int c) { k4_head(blk, head, c); }

SD_QFORMAT(q5_k, "Q5_K", 5, 256, 176, 320, SC_K, 0)
