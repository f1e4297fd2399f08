/* Q4_K: super-blocks of 256 k (kquant.h's scales), then 128 bytes of nibbles: sub-blocks 2i and
 * 2i + 1 in the low and high nibbles of bytes 32i .. 32i + 31. */
#include "kquant.h"

static void q4_k_decode(const uint8_t *blk, int s, uint8_t q[32]) {
    const uint8_t *qs = blk + 16 + 32 * (s / 2);
    for (int l = 0; l < 32; l++) q[l] = s % 2 ? qs[l] >> 4 : qs[l] & 15;
}

static void q4_k_head(const uint8_t *blk, uint8_t *head, int c) { k4_head(blk, head, c); }

SD_QFORMAT(q4_k, "Q4_K", 4, 256, 144, 320, SC_K, 0)
