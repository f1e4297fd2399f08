/* Q4_0: blocks of 32 k, fp16 d then 16 bytes (k = i in the low nibble of byte i, k = 16 + i in
 * its high nibble); w = d (q - 8). */
#include "quant.h"

static void q4_0_decode(const uint8_t *blk, int s, uint8_t q[32]) {
    (void)s;
    decode_nibbles(blk + 2, 0, q);
}

static void q4_0_head(const uint8_t *blk, uint8_t *head, int c) { memcpy(head + 2 * c, blk, 2); }

SD_QFORMAT(q4_0, "Q4_0", 4, 32, 18, 32, SC_D, 8)
