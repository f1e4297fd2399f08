/* Q4_1: blocks of 32 k, fp16 d, fp16 m, then 16 bytes of nibbles as Q4_0's; w = d q + m. */
#include "quant.h"

static void q4_1_decode(const uint8_t *blk, int s, uint8_t q[32]) {
    (void)s;
    decode_nibbles(blk + 4, 0, q);
}

static void q4_1_head(const uint8_t *blk, uint8_t *head, int c) {
    memcpy(head + 2 * c, blk, 2);
    memcpy(head + 32 + 2 * c, blk + 2, 2);
}

SD_QFORMAT(q4_1, "Q4_1", 4, 32, 20, 64, SC_DM, 0)
