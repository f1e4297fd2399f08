/* Linear layers on GGUF-quantised weights, computed in their own format.
 *
 * y[m, n] = act(x[m, k] @ W^T + bias) + residual, W [n, k] as llama.cpp stores it: blocks of 32
 * (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) or super-blocks of 256 (Q4_K, Q5_K, Q6_K) along k, each with
 * small integer weights and fp16 scales. Each format's file (q4_0.c ...) unpacks its GGUF blocks
 * once, at load, into panels of 16 output columns (sd_pack_quant), and instantiates the kernels
 * below on them; quant.c quantises x, picks the instruction set and splits the panels between
 * threads.
 *
 * Arithmetic. Each row of x is quantised per block of 32 to int8 (x ~ s * qx, s = max|x| / 127),
 * the block's products are summed exactly in int32, then scaled once:
 *     w = d (q - z)      (Q4_0 z = 8, Q5_0 z = 16, Q8_0 z = 0, Q6_K z = 32, d per 16 for Q6_K)
 *       d * s * (sum(q qx) - z sum(qx))
 *     w = d q + m        (Q4_1, Q5_1; the K-quants with d = d_super * sc, m = -dmin_super * mn)
 *       d * s * sum(q qx) + m * sum(x)
 * A row's result depends on that row alone: its own quantised x, integer sums that are exact
 * whatever their order, and one fixed order of float operations per output. The multi-row pass
 * streams each panel block once, unpacks it once, and loops the rows inside: k + 1 rows of a
 * verify cost little more than one row's weights, and each row computes bit for bit what it
 * computes alone (batch invariance, what makes speculative output equal plain decoding).
 *
 * Packed layout, per panel (16 columns, contiguous) and GGUF block ("unit": 32 or 256 k): a head
 * of the unit's scales (format-specific: fp16 d, fp16 m or dmin, the K-quants' 6-bit sub-scales
 * as bytes), then per sub-block of 32 k its quants in 4-byte lanes, lane c = column c:
 *   bit planes (5-bit: 1, 6-bit: 2): for vector j (k = 4j .. 4j + 3) and half h (columns 8h ..
 *     8h + 7), a 32-bit mask at (j * 2 + h) * 4, bit t = bit (4 + plane) of column 8h + t / 4 at
 *     k = 4j + t % 4 (64 bytes a plane);
 *   nibbles (4, 5 and 6-bit), 256 bytes: byte v * 64 + c * 4 + i holds column c's low 4 bits at
 *     k = 4v + i (low nibble) and k = 16 + 4v + i (high nibble), v < 4;
 *   bytes (8-bit), 512 bytes: byte j * 64 + c * 4 + i = column c's signed q at k = 4j + i.
 * Vector j of a sub-block, 64 bytes, is thus 16 lanes of 4 consecutive k: one AVX2
 * vpmaddubsw + vpmaddwd per half against x's 4 bytes broadcast sums 32 products. The packed
 * bytes match the file's within 3 % (Q8_0: 544 against 544 bytes a block of 16 columns; Q4_K:
 * 2368 against 2304, the sub-scales as whole bytes).
 */
#pragma once
#include "common.h"

enum { SD_Q4_0, SD_Q4_1, SD_Q5_0, SD_Q5_1, SD_Q8_0, SD_Q4_K, SD_Q5_K, SD_Q6_K, SD_QFORMATS };

#define QBLOCK 32
#define QCHUNK 32        /* rows per pass over a panel (more rows: another pass, the panel in cache) */
#define QPREFETCH 1024   /* bytes a pass prefetches ahead of the block it computes */

/* Bytes of one sub-block's quants: planes, then nibbles or bytes. */
#define SUB_BYTES(bits) ((bits) == 8 ? 512 : 256 + ((bits) - 4) * 64)

/* Scale families (the head's layout): */
enum {
    SC_D,   /* fp16 d[16] (Q4_0, Q5_0, Q8_0) */
    SC_DM,  /* fp16 d[16], fp16 m[16] (Q4_1, Q5_1) */
    SC_K,   /* fp16 d[16], fp16 dmin[16], u8 sc[8][16], u8 mn[8][16] (Q4_K, Q5_K) */
    SC_Q6K, /* fp16 d[16], int8 sc[16][16] (Q6_K: a scale per 16 k) */
};

/* x's quantised rows and the arguments of a pass. */
typedef struct {
    const int8_t *xq;         /* [m, k] */
    const float *xs, *xsum;   /* [m, k / 32]: each block's scale s and sum(x) */
    const int32_t *xqs;       /* [m, k / 32, 2]: sum(qx) over k 0..15 and 16..31 of each block */
    const int32_t *xq128;     /* [m, k / 32]: 128 * sum(qx) (the VNNI kernel's Q8_0 offset) */
    const uint8_t *w;
    const float *bias, *residual;
    float *y;
    int64_t m, k, n;
    int act, fmt;
    int64_t p_base; /* the panel w starts at (a part of a weight of several formats: sd_linear_quant_parts) */
} sd_qargs;

typedef void (*sd_qpanels_fn)(const sd_qargs *, int64_t, int64_t);

/* A format: its GGUF block and packed unit, the packer and the kernels (quant.c's table). */
typedef struct {
    const char *name;
    int64_t unit;       /* k per GGUF block */
    int64_t src_bytes;  /* bytes of one GGUF block */
    int64_t unit_bytes; /* packed bytes of one unit of a panel */
    void (*pack)(const uint8_t *w, int64_t n, int64_t k, uint8_t *out);
    sd_qpanels_fn avx2, base;
} sd_qformat;

extern const sd_qformat sd_q4_0, sd_q4_1, sd_q5_0, sd_q5_1, sd_q8_0, sd_q4_k, sd_q5_k, sd_q6_k;

void sd_linear_quant(const float *x, int64_t m, int64_t k, const uint8_t *w, int fmt, int64_t n, const float *bias,
                     const float *residual, int act, float *y, uint8_t *scratch);
void sd_linear_quant_parts(const float *x, int64_t m, int64_t k, const uint8_t *w, const int64_t *parts,
                           int64_t nparts, int64_t n, const float *bias, const float *residual, int act, float *y,
                           uint8_t *scratch);

INLINE float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else { /* subnormal: normalise */
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000 | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

INLINE uint32_t load_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* A legacy block's 32 weights from its 16 bytes of nibbles (k = i low, k = 16 + i high) and, for
 * Q5_0 / Q5_1, its 32 high bits (bit k; 0 for the 4-bit formats). */
INLINE void decode_nibbles(const uint8_t *qs, uint32_t qh, uint8_t q[32]) {
    for (int i = 0; i < 16; i++) {
        q[i] = (uint8_t)((qs[i] & 15) | ((qh >> i) & 1) << 4);
        q[16 + i] = (uint8_t)((qs[i] >> 4) | ((qh >> (16 + i)) & 1) << 4);
    }
}

/* ---- Packing: GGUF blocks to panels ----
 * A format gives, per GGUF block, sub-block s's 32 integer weights (unsigned, or the signed
 * bytes of Q8_0) and column c's entries of the unit's head. */
typedef void (*sd_decode_fn)(const uint8_t *blk, int s, uint8_t q[32]);
typedef void (*sd_head_fn)(const uint8_t *blk, uint8_t *head, int c);

/* Column c's sub-block (quants q) into its packed place `dst`. */
INLINE void put_sub(uint8_t *dst, int bits, int c, const uint8_t q[32]) {
    if (bits == 8) {
        for (int j = 0; j < 32; j++) dst[(j / 4) * 64 + c * 4 + j % 4] = q[j];
        return;
    }
    int planes = bits - 4;
    uint8_t *nib = dst + planes * 64;
    for (int j = 0; j < 16; j++) nib[(j / 4) * 64 + c * 4 + j % 4] = (uint8_t)((q[j] & 15) | (q[16 + j] & 15) << 4);
    for (int pl = 0; pl < planes; pl++)
        for (int kk = 0; kk < 32; kk++)
            if ((q[kk] >> (4 + pl)) & 1) {
                uint8_t *mask = dst + pl * 64 + ((kk / 4) * 2 + c / 8) * 4;
                uint32_t m = load_u32(mask) | 1u << ((c % 8) * 4 + kk % 4);
                memcpy(mask, &m, 4);
            }
}

INLINE void pack_panels(const uint8_t *w, int64_t n, int64_t k, uint8_t *out, const sd_qformat *f, int bits,
                        int64_t head_bytes, sd_decode_fn decode, sd_head_fn head) {
    int64_t nu = k / f->unit, np = (n + PANEL - 1) / PANEL, spu = f->unit / QBLOCK, sub = SUB_BYTES(bits);
    memset(out, 0, np * nu * f->unit_bytes); /* columns past n: all scales 0 */
#pragma omp parallel for if (n * k >= (1 << 16))
    for (int64_t p = 0; p < np; p++)
        for (int64_t u = 0; u < nu; u++) {
            uint8_t *dst = out + (p * nu + u) * f->unit_bytes;
            for (int c = 0; c < PANEL; c++) {
                int64_t col = p * PANEL + c;
                if (col >= n) continue;
                const uint8_t *blk = w + (col * nu + u) * f->src_bytes;
                head(blk, dst, c);
                for (int s = 0; s < spu; s++) {
                    uint8_t q[32];
                    decode(blk, s, q);
                    put_sub(dst + head_bytes + s * sub, bits, c, q);
                }
            }
        }
}

/* ---- The portable kernel (any CPU; the reference the vector kernel is tested against) ---- */

/* Column c's weight at k = 4j + i of a packed sub-block. */
INLINE int32_t qvalue(const uint8_t *q, const int bits, int j, int c, int i) {
    if (bits == 8) return (int8_t)q[j * 64 + c * 4 + i];
    int planes = bits - 4;
    uint8_t byte = q[planes * 64 + (j & 3) * 64 + c * 4 + i];
    int32_t v = j < 4 ? byte & 15 : byte >> 4;
    for (int pl = 0; pl < planes; pl++) v |= (int32_t)((load_u32(q + pl * 64 + (j * 2 + c / 8) * 4) >> ((c % 8) * 4 + i)) & 1) << (4 + pl);
    return v;
}

INLINE v16 half16(const uint8_t *p) {
    float f[16];
    for (int c = 0; c < 16; c++) {
        uint16_t h;
        memcpy(&h, p + 2 * c, 2);
        f[c] = half_to_float(h);
    }
    return load16(f);
}

INLINE v16 bytes16(const uint8_t *p, int is_signed) {
    float f[16];
    for (int c = 0; c < 16; c++) f[c] = is_signed ? (float)(int8_t)p[c] : (float)p[c];
    return load16(f);
}

/* A unit's scales for sub-block s: d (k 0..15, or all 32), dh (k 16..31), m. */
INLINE void scales_base(const int fam, const uint8_t *head, int s, v16 *d, v16 *dh, v16 *m) {
    v16 d0 = half16(head);
    if (fam == SC_D) { *d = *dh = d0; *m = splat(0.0f); }
    else if (fam == SC_DM) { *d = *dh = d0; *m = half16(head + 32); }
    else if (fam == SC_K) {
        *d = *dh = d0 * bytes16(head + 64 + s * 16, 0);
        *m = -(half16(head + 32) * bytes16(head + 192 + s * 16, 0));
    } else {
        *d = d0 * bytes16(head + 32 + 2 * s * 16, 1);
        *dh = d0 * bytes16(head + 32 + (2 * s + 1) * 16, 1);
        *m = splat(0.0f);
    }
}

/* acc + the block's contribution for one row (the same expression in every kernel). */
INLINE v16 qepilogue(const int fam, const int z, v16 acc, v16i lo, v16i hi, v16 d, v16 dh, v16 m, float xs,
                     float xsum, int32_t qlo, int32_t qhi) {
    v16 s = splat(xs);
    if (fam == SC_Q6K)
        return acc + d * (s * __builtin_convertvector(lo - z * qlo, v16))
               + dh * (s * __builtin_convertvector(hi - z * qhi, v16));
    v16 t = d * (s * __builtin_convertvector(lo + hi - z * (qlo + qhi), v16));
    if (fam == SC_DM || fam == SC_K) t += m * splat(xsum);
    return acc + t;
}

INLINE void store_q(const sd_qargs *a, int64_t row, int64_t p, v16 acc) {
    linear_args la = {NULL, NULL, a->bias, a->residual, a->y, a->m, a->k, a->n, a->act, NULL};
    store_panel(&la, row, p, acc);
}

INLINE void qpanels_base(const sd_qargs *a, int64_t p0, int64_t p1, const int bits, const int64_t unit,
                         const int64_t head, const int fam, const int z) {
    const int64_t k = a->k, nb = k / QBLOCK, spu = unit / QBLOCK, sub = SUB_BYTES(bits), ub = head + spu * sub;
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t *pw = a->w + (p - a->p_base) * (k / unit) * ub;
        for (int64_t r = 0; r < a->m; r++) {
            v16 acc = splat(0.0f);
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *u = pw + (b / spu) * ub, *q = u + head + (b % spu) * sub;
                const int8_t *x = a->xq + r * k + b * QBLOCK;
                int32_t lo[16], hi[16];
                for (int c = 0; c < 16; c++) {
                    lo[c] = hi[c] = 0;
                    for (int j = 0; j < 8; j++)
                        for (int i = 0; i < 4; i++) {
                            int32_t prod = qvalue(q, bits, j, c, i) * x[4 * j + i];
                            if (j < 4) lo[c] += prod; else hi[c] += prod;
                        }
                }
                v16 d, dh, m;
                v16i vlo, vhi;
                memcpy(&vlo, lo, sizeof vlo);
                memcpy(&vhi, hi, sizeof vhi);
                scales_base(fam, u, (int)(b % spu), &d, &dh, &m);
                int64_t at = r * nb + b;
                acc = qepilogue(fam, z, acc, vlo, vhi, d, dh, m, a->xs[at], a->xsum[at], a->xqs[2 * at], a->xqs[2 * at + 1]);
            }
            store_q(a, r, p, acc);
        }
    }
}

/* ---- The AVX2 kernel (x86-64-v3: AVX2, FMA, F16C; every x86 CPU since 2013-2015) ---- */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define SD_AVX2 __attribute__((target("arch=x86-64-v3")))
#define SD_HAVE_AVX2 1

/* 32 bits to 32 bytes, 0xff where the bit is set. */
SD_AVX2 INLINE __m256i bits_to_bytes(uint32_t bits) {
    const __m256i shuf = _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202,
                                            0x0303030303030303);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf);
    v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
}

/* Eight fp16 (columns 8h .. 8h + 7) as floats. */
SD_AVX2 INLINE __m256 half8_avx2(const uint8_t *p, int h) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * h)));
}

/* Eight bytes (columns 8h .. 8h + 7) as floats, signed or not. */
SD_AVX2 INLINE __m256 bytes8_avx2(const uint8_t *p, int h, const int is_signed) {
    __m128i b = _mm_loadl_epi64((const __m128i *)(p + 8 * h));
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

/* A unit's scales for sub-block s by half (columns 0..7, 8..15), as scales_base computes them;
 * in __m256 halves throughout: GCC moves a v16 through memory on AVX2 (the K-quants' scales were
 * ~38 % of a one-row pass that way). */
SD_AVX2 INLINE void scales_avx2(const int fam, const uint8_t *head, int s, __m256 d[2], __m256 dh[2], __m256 m[2]) {
    for (int h = 0; h < 2; h++) {
        __m256 d0 = half8_avx2(head, h);
        if (fam == SC_D) { d[h] = dh[h] = d0; m[h] = _mm256_setzero_ps(); }
        else if (fam == SC_DM) { d[h] = dh[h] = d0; m[h] = half8_avx2(head + 32, h); }
        else if (fam == SC_K) {
            d[h] = dh[h] = _mm256_mul_ps(d0, bytes8_avx2(head + 64 + s * 16, h, 0));
            m[h] = _mm256_xor_ps(_mm256_mul_ps(half8_avx2(head + 32, h), bytes8_avx2(head + 192 + s * 16, h, 0)),
                                 _mm256_set1_ps(-0.0f));
        } else {
            d[h] = _mm256_mul_ps(d0, bytes8_avx2(head + 32 + 2 * s * 16, h, 1));
            dh[h] = _mm256_mul_ps(d0, bytes8_avx2(head + 32 + (2 * s + 1) * 16, h, 1));
            m[h] = _mm256_setzero_ps();
        }
    }
}

/* Vector j, half h of a packed sub-block as bytes: unsigned 0 .. 2^bits - 1, or Q8_0's signed. */
SD_AVX2 INLINE __m256i unpack_avx2(const uint8_t *q, const int bits, int j, int h) {
    if (bits == 8) return _mm256_loadu_si256((const __m256i *)(q + j * 64 + h * 32));
    const int planes = bits - 4;
    const __m256i low = _mm256_set1_epi8(15);
    __m256i nib = _mm256_loadu_si256((const __m256i *)(q + planes * 64 + (j & 3) * 64 + h * 32));
    __m256i v = j < 4 ? _mm256_and_si256(nib, low) : _mm256_and_si256(_mm256_srli_epi16(nib, 4), low);
    for (int pl = 0; pl < planes; pl++)
        v = _mm256_or_si256(v, _mm256_and_si256(bits_to_bytes(load_u32(q + pl * 64 + (j * 2 + h) * 4)),
                                                _mm256_set1_epi8((char)(16 << pl))));
    return v;
}

/* A block's weights, unpacked once for all the rows of a pass. */
typedef struct {
    __m256i w[8][2], wa[8][2]; /* vector j, half h (8-bit: w signed, wa = |w|) */
    __m256 d[2], dh[2], m[2];  /* scales by half: columns 0..7, 8..15 */
} qblock_avx2;

/* R rows from `row` of x against one unpacked block: acc[r][h] += the block's sums, scaled (the
 * same operations for every row, whatever R: a row's bits never depend on its neighbours). */
SD_AVX2 INLINE void qrows_avx2(const sd_qargs *a, const qblock_avx2 *blk, int64_t row, int64_t b, const int R,
                               const int bits, const int fam, const int z, __m256 acc[][2]) {
    const int64_t k = a->k, nb = k / QBLOCK;
    /* products summed in int16 before widening: at most 4 of 31 * 127 * 2 (5-bit), 2 of 63 * 127 * 2
     * (6-bit); Q8_0's sign trick gives up to 2 * 127 * 127 a product: one at a time */
    const int group = bits == 8 ? 1 : bits == 6 ? 2 : 4;
    const int split = fam == SC_Q6K; /* separate sums for k 0..15 and 16..31 */
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s[2][2][2]; /* row, lo/hi (split only), half */
#pragma GCC unroll 2
    for (int r = 0; r < R; r++)
        for (int l = 0; l < 2; l++)
            for (int h = 0; h < 2; h++) s[r][l][h] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int g = 0; g < 8; g += group) {
        __m256i p16[2][2];
#pragma GCC unroll 4
        for (int j = g; j < g + group; j++) {
            __m256i xb[2];
#pragma GCC unroll 2
            for (int r = 0; r < R; r++)
                xb[r] = _mm256_set1_epi32((int)load_u32((const uint8_t *)(a->xq + (row + r) * k + b * QBLOCK + 4 * j)));
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++)
#pragma GCC unroll 2
                for (int r = 0; r < R; r++) {
                    __m256i prod = bits == 8 ? _mm256_maddubs_epi16(blk->wa[j][h], _mm256_sign_epi8(xb[r], blk->w[j][h]))
                                             : _mm256_maddubs_epi16(blk->w[j][h], xb[r]);
                    p16[r][h] = j == g ? prod : _mm256_add_epi16(p16[r][h], prod);
                }
        }
        const int l = split && g >= 4;
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++)
#pragma GCC unroll 2
            for (int r = 0; r < R; r++) s[r][l][h] = _mm256_add_epi32(s[r][l][h], _mm256_madd_epi16(p16[r][h], ones));
    }
#pragma GCC unroll 2
    for (int r = 0; r < R; r++) {
        const int64_t at = (row + r) * nb + b;
        const __m256 xs = _mm256_set1_ps(a->xs[at]);
        const int32_t qlo = a->xqs[2 * at], qhi = a->xqs[2 * at + 1];
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m256 t;
            if (split) {
                __m256 flo = _mm256_cvtepi32_ps(_mm256_sub_epi32(s[r][0][h], _mm256_set1_epi32(z * qlo)));
                __m256 fhi = _mm256_cvtepi32_ps(_mm256_sub_epi32(s[r][1][h], _mm256_set1_epi32(z * qhi)));
                t = _mm256_add_ps(_mm256_mul_ps(blk->d[h], _mm256_mul_ps(xs, flo)),
                                  _mm256_mul_ps(blk->dh[h], _mm256_mul_ps(xs, fhi)));
            } else {
                __m256i sum = z ? _mm256_sub_epi32(s[r][0][h], _mm256_set1_epi32(z * (qlo + qhi))) : s[r][0][h];
                t = _mm256_mul_ps(blk->d[h], _mm256_mul_ps(xs, _mm256_cvtepi32_ps(sum)));
                if (fam == SC_DM || fam == SC_K) t = _mm256_add_ps(t, _mm256_mul_ps(blk->m[h], _mm256_set1_ps(a->xsum[at])));
            }
            acc[r][h] = _mm256_add_ps(acc[r][h], t);
        }
    }
}

/* Panels [p0, p1): per panel, passes of up to QCHUNK rows; per block, the weights unpacked once
 * and every row of the pass against them, two at a time. */
SD_AVX2 INLINE void qpanels_avx2(const sd_qargs *a, int64_t p0, int64_t p1, const int bits, const int64_t unit,
                                 const int64_t head, const int fam, const int z) {
    const int64_t k = a->k, nb = k / QBLOCK, spu = unit / QBLOCK, sub = SUB_BYTES(bits), ub = head + spu * sub;
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t *pw = a->w + (p - a->p_base) * (k / unit) * ub;
        for (int64_t m0 = 0; m0 < a->m; m0 += QCHUNK) {
            const int64_t rows = a->m - m0 < QCHUNK ? a->m - m0 : QCHUNK;
            __m256 acc[QCHUNK][2];
            for (int64_t r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *u = pw + (b / spu) * ub, *q = u + head + (b % spu) * sub;
                if (m0 == 0)
                    for (int64_t c = 0; c < sub; c += 64) _mm_prefetch((const char *)q + QPREFETCH + c, _MM_HINT_T0);
                qblock_avx2 blk;
#pragma GCC unroll 8
                for (int j = 0; j < 8; j++)
#pragma GCC unroll 2
                    for (int h = 0; h < 2; h++) {
                        blk.w[j][h] = unpack_avx2(q, bits, j, h);
                        if (bits == 8) blk.wa[j][h] = _mm256_abs_epi8(blk.w[j][h]);
                    }
                scales_avx2(fam, u, (int)(b % spu), blk.d, blk.dh, blk.m);
                int64_t r = 0;
                for (; r + 2 <= rows; r += 2) qrows_avx2(a, &blk, m0 + r, b, 2, bits, fam, z, acc + r);
                if (r < rows) qrows_avx2(a, &blk, m0 + r, b, 1, bits, fam, z, acc + r);
            }
            for (int64_t r = 0; r < rows; r++) {
                v16 v;
                memcpy(&v, &acc[r][0], 32);
                memcpy((char *)&v + 32, &acc[r][1], 32);
                store_q(a, m0 + r, p, v);
            }
        }
    }
}
#define SD_AVX2_FN(NAME, BITS, UNIT, HEAD, FAM, Z) \
    SD_AVX2 static void NAME(const sd_qargs *a, int64_t p0, int64_t p1) { qpanels_avx2(a, p0, p1, BITS, UNIT, HEAD, FAM, Z); }
#else
#define SD_AVX2_FN(NAME, BITS, UNIT, HEAD, FAM, Z)
#endif

/* A format file's kernels and descriptor: FMT (its name), BITS, UNIT, HEAD bytes, scale family,
 * zero point z; its decode and head functions must be defined before. */
#if defined(SD_HAVE_AVX2)
#define SD_AVX2_PTR(NAME) NAME##_avx2
#else
#define SD_AVX2_PTR(NAME) NULL
#endif
#define SD_QFORMAT(NAME, LABEL, BITS, UNIT, SRC, HEAD, FAM, Z)                                      \
    static void NAME##_base(const sd_qargs *a, int64_t p0, int64_t p1) {                            \
        qpanels_base(a, p0, p1, BITS, UNIT, HEAD, FAM, Z);                                          \
    }                                                                                               \
    SD_AVX2_FN(NAME##_avx2, BITS, UNIT, HEAD, FAM, Z)                                               \
    static void NAME##_pack(const uint8_t *w, int64_t n, int64_t k, uint8_t *out);                 \
    const sd_qformat sd_##NAME = {LABEL, UNIT, SRC, HEAD + (UNIT / QBLOCK) * SUB_BYTES(BITS), NAME##_pack, \
                                  SD_AVX2_PTR(NAME), NAME##_base};                                  \
    static void NAME##_pack(const uint8_t *w, int64_t n, int64_t k, uint8_t *out) {                \
        pack_panels(w, n, k, out, &sd_##NAME, BITS, HEAD, NAME##_decode, NAME##_head);             \
    }
