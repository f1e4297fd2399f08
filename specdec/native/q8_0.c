/* Q8_0: blocks of 32 k, fp16 d then 32 signed bytes; w = d q. */
#include "quant.h"

static void q8_0_decode(const uint8_t *blk, int s, uint8_t q[32]) {
    (void)s;
    memcpy(q, blk + 2, 32);
}

static void q8_0_head(const uint8_t *blk, uint8_t *head, int c) { memcpy(head + 2 * c, blk, 2); }

SD_QFORMAT(q8_0, "Q8_0", 8, 32, 34, 32, SC_D, 0)
