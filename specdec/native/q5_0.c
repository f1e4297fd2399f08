/* Q5_0: blocks of 32 k, fp16 d, 32 high bits (bit k), 16 bytes of low nibbles as Q4_0's;
 * w = d (q - 16). */
#include "quant.h"

static void q5_0_decode(const uint8_t *blk, int s, uint8_t q[32]) {
    (void)s;
    decode_nibbles(blk + 6, load_u32(blk + 2), q);
}

static void q5_0_head(const uint8_t *blk, uint8_t *head, int c) { memcpy(head + 2 * c, blk, 2); }

SD_QFORMAT(q5_0, "Q5_0", 5, 32, 22, 32, SC_D, 16)
