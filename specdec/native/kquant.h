/* What Q4_K and Q5_K share: super-blocks of 256 k, fp16 d and dmin, then 12 bytes holding each
 * of the 8 sub-blocks' 6-bit scale sc and min mn (llama.cpp's get_scale_min_k4); w = d sc q -
 * dmin mn over sub-block s. */
#pragma once
#include "quant.h"

INLINE void k4_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *mn = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* Column c's head entries: d, dmin, and per sub-block sc and mn as whole bytes. */
INLINE void k4_head(const uint8_t *blk, uint8_t *head, int c) {
    memcpy(head + 2 * c, blk, 2);
    memcpy(head + 32 + 2 * c, blk + 2, 2);
    for (int s = 0; s < 8; s++) k4_scale_min(s, blk + 4, head + 64 + s * 16 + c, head + 192 + s * 16 + c);
}
