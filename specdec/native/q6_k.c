/* Q6_K: super-blocks of 256 k: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 signed 8-bit
 * scales (one per 16 k), fp16 d; w = d sc (q - 32). Value 128n + 32p + l (n < 2, p < 4, l < 32)
 * takes its low nibble from byte 64n + l + 32 (p & 1) (the high nibble for p >= 2) and its
 * high bits from bits 2p of byte 128 + 32n + l. */
#include "quant.h"

static void q6_k_decode(const uint8_t *blk, int s, uint8_t q[32]) {
    int n = s / 4, part = s % 4;
    const uint8_t *ql = blk + 64 * n + 32 * (part & 1), *qh = blk + 128 + 32 * n;
    for (int l = 0; l < 32; l++) {
        int low = part >= 2 ? ql[l] >> 4 : ql[l] & 15;
        q[l] = (uint8_t)(low | ((qh[l] >> (2 * part)) & 3) << 4);
    }
}

static void q6_k_head(const uint8_t *blk, uint8_t *head, int c) {
    memcpy(head + 2 * c, blk + 208, 2);
    for (int i = 0; i < 16; i++) head[32 + i * 16 + c] = blk[192 + i];
}

SD_QFORMAT(q6_k, "Q6_K", 6, 256, 210, 288, SC_Q6K, 32)
