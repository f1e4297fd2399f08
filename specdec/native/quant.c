/* The quantised linears' driver: x quantised per row, the instruction set chosen once, the panels
 * split between threads (quant.h says what is computed; the formats live in q4_0.c ... q6_k.c).
 *
 * Instruction sets: AVX2 (x86-64-v3) for every format, the portable kernel elsewhere (and for
 * tests: SPECDEC_NATIVE_ISA=baseline), and on CPUs with AVX-512 VNNI, for Q4_1 and Q8_0, the
 * VNNI kernel below, which reads its own layout of those two formats (sd_pack_quant packs for the
 * kernel that will read the weight). Every kernel computes each row alone, so a verify's rows
 * are bit-identical to one-row steps on any of them; two kernels differ in rounding only.
 */
#include "quant.h"

#include <stdio.h>

static const sd_qformat *const FORMATS[SD_QFORMATS] = {&sd_q4_0, &sd_q4_1, &sd_q5_0, &sd_q5_1,
                                                       &sd_q8_0, &sd_q4_k, &sd_q5_k, &sd_q6_k};

/* ---- Q4_1 and Q8_0 on AVX-512 VNNI (vpdpbusd: 64 byte products an instruction) ----
 *
 * Packed per (panel of 16 columns, block of 32), panels in groups of 4 with each group's blocks
 * interleaved (block b of its 4 panels, then block b + 1 ...), 4 consecutive k of a column in
 * each 32-bit lane:
 *   Q4_1: fp16 d[16], fp16 m[16], uint8 q[4][64]: vector v, lane c, byte i = column c's GGUF byte
 *         4v + i (low nibble: k = 4v + i, high nibble: k = 16 + 4v + i)
 *   Q8_0: fp16 d[16], 32 bytes unused, uint8 q[8][64]: vector v, lane c, byte i = q + 128 at k = 4v + i
 * VNNI multiplies unsigned by signed bytes: the weights are the unsigned side (Q8_0's offset by
 * 128, which comes back off as 128 * sum(qx) per row and block). */

#define QPANELS 4 /* panels per tile */
#define QMAXR 2   /* rows per tile */
#define VPREFETCH 2 /* groups of blocks ahead */
#define QHEAD 64 /* bytes of scales before a packed block's quants */

static int64_t vnni_panel_bytes(int fmt) { return QHEAD + (fmt == SD_Q4_1 ? 256 : 512); }

static int64_t vnni_bytes(int64_t n, int64_t k, int fmt) {
    int64_t groups = ((n + PANEL - 1) / PANEL + QPANELS - 1) / QPANELS;
    return groups * QPANELS * (k / QBLOCK) * vnni_panel_bytes(fmt);
}

/* Where panel p's block b starts. */
INLINE int64_t qblock_at(int64_t p, int64_t b, int64_t nb, int64_t pb) {
    return (((p / QPANELS) * nb + b) * QPANELS + p % QPANELS) * pb;
}

/* acc += the block's scaled sums (the same epilogue in both builds): d, m the block's scales;
 * xs, xsum, xq128 the row's, broadcast */
INLINE v16 qscale(int fmt, v16 d, v16 m, v16i sums, v16 xs, v16 xsum, v16i xq128, v16 acc) {
    if (fmt == SD_Q4_1) return acc + d * xs * __builtin_convertvector(sums, v16) + m * xsum;
    return acc + d * xs * __builtin_convertvector(sums - xq128, v16);
}

#if defined(SD_HAVE_AVX2)
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

/* One block's byte products of `rows` rows of x's quants (x: the block's first, row 0) against
 * the blocks blk of `panels` panels, into s (Q4_1: the low nibbles against k 0..15 and the high
 * against 16..31; Q8_0: k 0..31). */
VNNI INLINE void qdots_vnni(const sd_qargs *a, const uint8_t *const *blk, const int8_t *x, const int rows,
                            const int panels, const int fmt, __m512i s[][QPANELS]) {
    const int64_t k = a->k;
    const __m512i low = _mm512_set1_epi8(15);
    if (fmt == SD_Q4_1) {
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) {
            __m512i lo[QPANELS], hi[QPANELS];
#pragma GCC unroll 8
            for (int p = 0; p < panels; p++) {
                __m512i q = _mm512_loadu_si512(blk[p] + QHEAD + v * 64);
                lo[p] = _mm512_and_si512(q, low);
                hi[p] = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
            }
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++) {
                int32_t xl, xh;
                memcpy(&xl, x + r * k + 4 * v, 4);
                memcpy(&xh, x + r * k + 16 + 4 * v, 4);
                __m512i bl = _mm512_set1_epi32(xl), bh = _mm512_set1_epi32(xh);
#pragma GCC unroll 8
                for (int p = 0; p < panels; p++)
                    s[r][p] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[r][p], lo[p], bl), hi[p], bh);
            }
        }
    } else {
#pragma GCC unroll 8
        for (int v = 0; v < 8; v++) {
            __m512i q[QPANELS];
#pragma GCC unroll 8
            for (int p = 0; p < panels; p++) q[p] = _mm512_loadu_si512(blk[p] + QHEAD + v * 64);
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++) {
                int32_t xv;
                memcpy(&xv, x + r * k + 4 * v, 4);
                __m512i bx = _mm512_set1_epi32(xv);
#pragma GCC unroll 8
                for (int p = 0; p < panels; p++) s[r][p] = _mm512_dpbusd_epi32(s[r][p], q[p], bx);
            }
        }
    }
}

/* acc += block b's products s of rows [m0, m0 + rows), scaled by the blocks' and the rows' scales. */
VNNI INLINE void qscale_vnni(const sd_qargs *a, const uint8_t *const *blk, int64_t m0, int64_t b, int64_t nb,
                             const int rows, const int panels, const int fmt, __m512i s[][QPANELS],
                             v16 acc[][QPANELS]) {
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) {
        int64_t at = (m0 + r) * nb + b;
        v16 xs = (v16)_mm512_set1_ps(a->xs[at]), xsum = (v16)_mm512_set1_ps(a->xsum[at]);
        v16i xq128 = (v16i)_mm512_set1_epi32(a->xq128[at]);
#pragma GCC unroll 8
        for (int p = 0; p < panels; p++) {
            v16 d = (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk[p]));
            v16 m = fmt == SD_Q4_1 ? (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk[p] + 32))) : xs;
            acc[r][p] = qscale(fmt, d, m, (v16i)s[r][p], xs, xsum, xq128, acc[r][p]);
        }
    }
}

/* `rows` rows (1 or 2) against `panels` panels (1 .. QPANELS) from (m0, p0). */
VNNI INLINE void qtile_vnni(const sd_qargs *a, int64_t m0, int64_t p0, const int rows, const int panels,
                            const int fmt) {
    const int64_t k = a->k, nb = k / QBLOCK, pb = vnni_panel_bytes(fmt);
    v16 acc[QMAXR][QPANELS];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 8
        for (int p = 0; p < panels; p++) acc[r][p] = splat(0.0f);
    for (int64_t b = 0; b < nb; b++) {
        __m512i s[QMAXR][QPANELS];
        const uint8_t *blk[QPANELS];
#pragma GCC unroll 8
        for (int p = 0; p < panels; p++) blk[p] = a->w + qblock_at(p0 + p, b, nb, pb);
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++)
#pragma GCC unroll 8
            for (int p = 0; p < panels; p++) s[r][p] = _mm512_setzero_si512();
        const int8_t *x = a->xq + m0 * k + b * QBLOCK;
        /* the hardware prefetchers alone left this at half the memory's speed */
#pragma GCC unroll 8
        for (int p = 0; p < panels; p++)
#pragma GCC unroll 16
            for (int64_t c = 0; c < pb; c += 64) _mm_prefetch((const char *)blk[p] + VPREFETCH * QPANELS * pb + c, _MM_HINT_T0);
        qdots_vnni(a, blk, x, rows, panels, fmt, s);
        qscale_vnni(a, blk, m0, b, nb, rows, panels, fmt, s, acc);
    }
    linear_args la = {NULL, NULL, a->bias, a->residual, a->y, a->m, a->k, a->n, a->act};
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 8
        for (int p = 0; p < panels; p++) store_panel(&la, m0 + r, p0 + p, acc[r][p]);
}

#define QTILE_CASE(FMT)                                                                            \
    if (panels == QPANELS) {                                                                       \
        if (rows == 2) qtile_vnni(a, m0, p, 2, QPANELS, FMT);                                      \
        else qtile_vnni(a, m0, p, 1, QPANELS, FMT);                                                \
    } else                                                                                         \
        for (int q = 0; q < panels; q++) {                                                         \
            if (rows == 2) qtile_vnni(a, m0, p + q, 2, 1, FMT);                                    \
            else qtile_vnni(a, m0, p + q, 1, 1, FMT);                                              \
        }

VNNI static void qlinear_panels_vnni(const sd_qargs *a, int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p += QPANELS) {
        int panels = p1 - p < QPANELS ? (int)(p1 - p) : QPANELS;
        for (int64_t m0 = 0; m0 < a->m; m0 += QMAXR) {
            int rows = a->m - m0 < QMAXR ? (int)(a->m - m0) : QMAXR;
            if (a->fmt == SD_Q4_1) { QTILE_CASE(SD_Q4_1) } else { QTILE_CASE(SD_Q8_0) }
        }
    }
}
#endif


/* Pack a GGUF tensor's blocks, w [n][k / 32 blocks] of Q4_1 (d, m fp16; 16 bytes of nibbles) or
 * Q8_0 (d fp16; 32 int8) as llama.cpp stores them, into panels (above). k must be a multiple of
 * 32 (GGUF's own rule for these types). */
static void vnni_pack(const uint8_t *w, int64_t n, int64_t k, int fmt, uint8_t *out) {
    int64_t nb = k / QBLOCK, np = (n + PANEL - 1) / PANEL, pb = vnni_panel_bytes(fmt);
    int64_t src = fmt == SD_Q4_1 ? 20 : 34; /* GGUF block bytes */
    memset(out, 0, vnni_bytes(n, k, fmt)); /* zero columns, the last group's padding: d = m = 0 */
#pragma omp parallel for if (n * k >= (1 << 16))
    for (int64_t p = 0; p < np; p++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *dst = out + qblock_at(p, b, nb, pb);
            for (int64_t c = 0; c < PANEL; c++) {
                int64_t col = p * PANEL + c;
                if (col >= n) continue;
                const uint8_t *blk = w + (col * nb + b) * src;
                memcpy(dst + 2 * c, blk, 2); /* d */
                if (fmt == SD_Q4_1) {
                    memcpy(dst + 32 + 2 * c, blk + 2, 2); /* m */
                    for (int j = 0; j < 16; j++) dst[QHEAD + (j / 4) * 64 + c * 4 + j % 4] = blk[4 + j];
                } else {
                    for (int j = 0; j < 32; j++) dst[QHEAD + (j / 4) * 64 + c * 4 + j % 4] = (uint8_t)(blk[2 + j] ^ 0x80);
                }
            }
        }
}


/* ---- Dispatch ---- */

enum { ISA_BASE, ISA_AVX2, ISA_VNNI };

/* The best instruction set here, capped by SPECDEC_NATIVE_ISA (avx512 | avx2 | baseline). */
static int machine_isa(void) {
    static int isa = -1;
    if (isa >= 0) return isa; /* the same answer on every thread: a benign race */
    int found = ISA_BASE;
#if defined(SD_HAVE_AVX2)
    const char *cap = getenv("SPECDEC_NATIVE_ISA");
    int allow512 = !cap || !strcmp(cap, "avx512"), allow2 = allow512 || !strcmp(cap, "avx2");
    __builtin_cpu_init();
    if (allow2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        found = ISA_AVX2;
    if (allow512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vnni"))
        found = ISA_VNNI;
#endif
    return isa = found;
}

/* The kernel that computes format fmt here. */
static int fmt_isa(int fmt) {
    int isa = machine_isa();
    if (isa == ISA_VNNI && fmt != SD_Q4_1 && fmt != SD_Q8_0) isa = ISA_AVX2;
    return isa;
}

static const char *ISA_NAMES[] = {"baseline", "avx2", "avx512-vnni"};

/* The instruction set of format fmt's kernel ("avx2", "avx512-vnni" or "baseline"), NULL for an
 * unknown format. */
const char *sd_quant_isa(int fmt) {
    if (fmt < 0 || fmt >= SD_QFORMATS) return NULL;
    return ISA_NAMES[fmt_isa(fmt)];
}

/* The format's GGUF block: weights along k, bytes (0 for an unknown format). */
int64_t sd_quant_block(int fmt, int64_t *bytes) {
    if (fmt < 0 || fmt >= SD_QFORMATS) return 0;
    if (bytes) *bytes = FORMATS[fmt]->src_bytes;
    return FORMATS[fmt]->unit;
}

/* The format's name (Q4_0 ...), NULL past the last. */
const char *sd_quant_name(int fmt) { return fmt >= 0 && fmt < SD_QFORMATS ? FORMATS[fmt]->name : NULL; }

/* Bytes of a packed [n, k] weight of format fmt (k a multiple of the format's block), -1 when
 * the format or the shape is invalid. `generic`: in the layout of the AVX2 and portable kernels
 * whatever this CPU has (a part of a weight of several formats, sd_linear_quant_parts). */
int64_t sd_quant_bytes_as(int64_t n, int64_t k, int fmt, int generic) {
    if (fmt < 0 || fmt >= SD_QFORMATS || n <= 0 || k <= 0 || k % FORMATS[fmt]->unit) return -1;
    if (!generic && fmt_isa(fmt) == ISA_VNNI) return vnni_bytes(n, k, fmt);
    return (n + PANEL - 1) / PANEL * (k / FORMATS[fmt]->unit) * FORMATS[fmt]->unit_bytes;
}

int64_t sd_quant_bytes(int64_t n, int64_t k, int fmt) { return sd_quant_bytes_as(n, k, fmt, 0); }

/* Pack w, a GGUF tensor's blocks [n][k / unit blocks] as llama.cpp stores them, into out
 * (sd_quant_bytes_as(n, k, fmt, generic) bytes): for the kernel that computes fmt here, or
 * (`generic`) for the AVX2 and portable kernels. */
void sd_pack_quant_as(const uint8_t *w, int64_t n, int64_t k, int fmt, int generic, uint8_t *out) {
    if (!generic && fmt_isa(fmt) == ISA_VNNI) vnni_pack(w, n, k, fmt, out);
    else FORMATS[fmt]->pack(w, n, k, out);
}

void sd_pack_quant(const uint8_t *w, int64_t n, int64_t k, int fmt, uint8_t *out) { sd_pack_quant_as(w, n, k, fmt, 0, out); }

INLINE float hmax8(v8 v) {
    float f[8];
    memcpy(f, &v, sizeof f);
    float m = f[0];
    for (int i = 1; i < 8; i++) m = f[i] > m ? f[i] : m;
    return m;
}

INLINE float hsum8(v8 v) {
    float f[8];
    memcpy(f, &v, sizeof f);
    return ((f[0] + f[4]) + (f[2] + f[6])) + ((f[1] + f[5]) + (f[3] + f[7]));
}

/* x's rows quantised per block of 32 into scratch (m * (k + 20 * k / 32) bytes): s = max|x| / 127,
 * q = x / s rounded to nearest, ties to even (1.5 * 2^23 added and taken away: exact for |x / s|
 * <= 127), sum(x) in one fixed tree. A row's quants depend on that row alone. */
CLONES static void quantise_rows(const float *x, int64_t m, int64_t k, uint8_t *scratch, sd_qargs *a) {
    int64_t nb = k / QBLOCK;
    int8_t *xq = (int8_t *)scratch;
    float *xs = (float *)(scratch + m * k), *xsum = xs + m * nb;
    int32_t *xq128 = (int32_t *)(xsum + m * nb), *xqs = xq128 + m * nb;
    const v8i magnitude = (v8i){0} + 0x7fffffff;
    const v8 shifter = splat8(12582912.0f), lim = splat8(127.0f);
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + r * k + b * QBLOCK;
            v8 v[4], mx = {0};
            for (int i = 0; i < 4; i++) {
                v[i] = load8(xb + 8 * i);
                mx = vmax8((v8)((v8i)v[i] & magnitude), mx);
            }
            float amax = hmax8(mx), sum = hsum8((v[0] + v[1]) + (v[2] + v[3]));
            float s = amax / 127.0f, inv = s > 0.0f ? 1.0f / s : 0.0f;
            int32_t qs[2] = {0, 0};
            for (int i = 0; i < 4; i++) {
                v8 t = (v[i] * splat8(inv) + shifter) - shifter;
                t = vmin8(vmax8(t, -lim), lim);
                v8i q = __builtin_convertvector(t, v8i);
                int32_t lanes[8];
                memcpy(lanes, &q, sizeof lanes);
                for (int l = 0; l < 8; l++) {
                    xq[r * k + b * QBLOCK + 8 * i + l] = (int8_t)lanes[l];
                    qs[i / 2] += lanes[l];
                }
            }
            int64_t at = r * nb + b;
            xs[at] = s;
            xsum[at] = sum;
            xq128[at] = 128 * (qs[0] + qs[1]);
            xqs[2 * at] = qs[0];
            xqs[2 * at + 1] = qs[1];
        }
    a->xq = xq;
    a->xs = xs;
    a->xsum = xsum;
    a->xq128 = xq128;
    a->xqs = xqs;
}

/* A pass's arguments, x quantised into scratch (the weight and format are the caller's). */
static sd_qargs pass_args(const float *x, int64_t m, int64_t k, int64_t n, const float *bias, const float *residual,
                          int act, float *y, uint8_t *scratch) {
    sd_qargs a = {0};
    quantise_rows(x, m, k, scratch, &a);
    a.bias = bias;
    a.residual = residual;
    a.y = y;
    a.m = m;
    a.k = k;
    a.n = n;
    a.act = act;
    return a;
}

static sd_qpanels_fn generic_kernel(int fmt) {
#if defined(SD_HAVE_AVX2)
    if (fmt_isa(fmt) != ISA_BASE) return FORMATS[fmt]->avx2;
#endif
    return FORMATS[fmt]->base;
}

/* y[m, n] = act(x @ W^T + bias) + residual on W packed by sd_pack_quant. scratch: m * (k + 20 * k
 * / 32) bytes for x's quants, scales and sums. */
void sd_linear_quant(const float *x, int64_t m, int64_t k, const uint8_t *w, int fmt, int64_t n, const float *bias,
                     const float *residual, int act, float *y, uint8_t *scratch) {
    if (fmt_isa(fmt) != ISA_VNNI) {
        int64_t part[3] = {fmt, n, 0};
        sd_linear_quant_parts(x, m, k, w, part, 1, n, bias, residual, act, y, scratch);
        return;
    }
    sd_qargs a = pass_args(x, m, k, n, bias, residual, act, y, scratch);
    a.w = w;
    a.fmt = fmt;
    int64_t np = (n + PANEL - 1) / PANEL;
#pragma omp parallel if (m * n * k >= (1 << 15))
    {
        int64_t p0, p1;
#if defined(SD_HAVE_AVX2)
        if (thread_panels(np, QPANELS, &p0, &p1)) qlinear_panels_vnni(&a, p0, p1);
#endif
    }
}

/* The same on a weight of several formats stacked along n (a fused q/k/v or gate/up whose members
 * a GGUF file stores in different types), each part in the generic layout (sd_pack_quant_as):
 * parts[3i .. 3i + 2] = part i's format, rows (a multiple of 16 but for the last) and byte
 * offset into w. x is quantised once; the threads split the panels of all parts. */
void sd_linear_quant_parts(const float *x, int64_t m, int64_t k, const uint8_t *w, const int64_t *parts,
                           int64_t nparts, int64_t n, const float *bias, const float *residual, int act, float *y,
                           uint8_t *scratch) {
    sd_qargs a = pass_args(x, m, k, n, bias, residual, act, y, scratch);
    int64_t np = (n + PANEL - 1) / PANEL;
#pragma omp parallel if (m * n * k >= (1 << 15))
    {
        int64_t p0, p1;
        if (thread_panels(np, 1, &p0, &p1)) {
            int64_t first = 0;
            for (int64_t i = 0; i < nparts; i++) {
                int64_t count = (parts[3 * i + 1] + PANEL - 1) / PANEL, lo = p0 > first ? p0 : first,
                        hi = p1 < first + count ? p1 : first + count;
                if (lo < hi) {
                    sd_qargs own = a;
                    own.fmt = (int)parts[3 * i];
                    own.w = w + parts[3 * i + 2];
                    own.p_base = first;
                    generic_kernel(own.fmt)(&own, lo, hi);
                }
                first += count;
            }
        }
    }
}
