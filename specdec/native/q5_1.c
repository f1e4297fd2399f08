/* Q5_1: blocks of 32 k, fp16 d, fp16 m, 32 high bits, 16 bytes of low nibbles; w = d q + m. */
#include "quant.h"

static void q5_1_decode(const uint8_t *blk, int s, uint8_t q[32]) {
    (void)s;
    decode_nibbles(blk + 8, load_u32(blk + 4), q);
}

static void q5_1_head(const uint8_t *blk, uint8_t *head, int c) {
    memcpy(head + 2 * c, blk, 2);
    memcpy(head + 32 + 2 * c, blk + 2, 2);
}

SD_QFORMAT(q5_1, "Q5_1", 5, 32, 24, 64, SC_DM, 0)
