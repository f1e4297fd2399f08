/* specdec's native kernels: the per-layer work of a decoder forward between its linears.
 *
 * A one-row decoder step on a 2-core CPU spends a quarter of its time outside the weights: ~20
 * small torch ops a layer (norms, rotary, the KV write, attention, the MLP's gate), each a few
 * microseconds of dispatch around a few nanoseconds of arithmetic. These kernels do that work in
 * three calls a layer, on fp32 tensors laid out as specdec.runner lays them out.
 *
 * Row independence is the contract (specdec.runner): every output row, and every (row, head) of
 * attention, is computed by one thread, in one fixed order that depends only on that row's own
 * inputs, never on the rows, sessions or threads beside it. A verify of k + 1 rows therefore
 * computes bit for bit what k + 1 one-row steps compute.
 *
 * Portable by construction: GCC vector extensions (16 floats) compiled once per instruction set
 * with target_clones (AVX-512, x86-64-v3, baseline) and chosen at load time, so one build runs
 * on any x86-64 CPU (and the baseline clone on other architectures). OpenMP parallel regions sit
 * in plain drivers that call the cloned workers (an outlined OpenMP body would not inherit a
 * clone's instruction set); in a torch process they run on torch's own OpenMP pool.
 *
 * Built by specdec.native (cc -O3 -fopenmp -shared), loaded with ctypes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif
#define INLINE static inline __attribute__((always_inline))

INLINE v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
INLINE void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }
INLINE v16 splat(float f) { return (v16){f, f, f, f, f, f, f, f, f, f, f, f, f, f, f, f}; }

/* The sum of a vector's 16 lanes, always in the same tree. */
INLINE float hsum(v16 a) {
    float s[16];
    memcpy(s, &a, sizeof s);
    float t[8], u[4];
    for (int i = 0; i < 8; i++) t[i] = s[i] + s[i + 8];
    for (int i = 0; i < 4; i++) u[i] = t[i] + t[i + 4];
    return (u[0] + u[2]) + (u[1] + u[3]);
}

INLINE v16 vmax(v16 a, v16 b) { v16i m = a > b; return (v16)((m & (v16i)a) | (~m & (v16i)b)); }
INLINE v16 vmin(v16 a, v16 b) { v16i m = a < b; return (v16)((m & (v16i)a) | (~m & (v16i)b)); }

/* e^x, |relative error| < 2e-7 over the float range: 2^n * e^r, r = x - n ln2 in [-ln2/2, ln2/2],
 * e^r by its Taylor polynomial to r^7 (Horner). Below -87.3 it returns ~1e-38, not 0. */
INLINE v16 vexp(v16 x) {
    x = vmin(vmax(x, splat(-87.3f)), splat(88.7f));
    const v16 shifter = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    v16 n = (x * splat(1.44269504088896341f) + shifter) - shifter;
    v16 r = (x - n * splat(0.693359375f)) - n * splat(-2.12194440e-4f);
    v16 p = splat(1.0f / 5040);
    p = p * r + splat(1.0f / 720);
    p = p * r + splat(1.0f / 120);
    p = p * r + splat(1.0f / 24);
    p = p * r + splat(1.0f / 6);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
    return p * (v16)bits;
}

INLINE float sexp(float x) {
    v16 v = vexp(splat(x));
    return v[0];
}

/* ---- Residual add and norm: x += delta (when given, in place), then out = norm(x), per row ----
 * RMSNorm: (x * 1/sqrt(mean(x^2) + eps)) * w. LayerNorm: ((x - mean) * 1/sqrt(var + eps)) * w + b.
 * The add is the residual connection after a projection: one pass over the row instead of a
 * separate add (the same fp32 sum). */

INLINE void add_rows(float *xr, const float *dr, int64_t n, int64_t n16) {
    for (int64_t i = 0; i < n16; i += 16) store16(xr + i, load16(xr + i) + load16(dr + i));
    for (int64_t i = n16; i < n; i++) xr[i] += dr[i];
}

CLONES static void norm_rows(float *x, const float *delta, const float *w, const float *b, float *out, int64_t r0,
                             int64_t r1, int64_t n, float eps) {
    int64_t n16 = n / 16 * 16;
    for (int64_t r = r0; r < r1; r++) {
        float *xr = x + r * n, *o = out + r * n;
        if (delta) add_rows(xr, delta + r * n, n, n16);
        float mean = 0.0f;
        if (b) { /* LayerNorm: centre first */
            v16 acc = splat(0.0f);
            for (int64_t i = 0; i < n16; i += 16) acc += load16(xr + i);
            float sum = hsum(acc);
            for (int64_t i = n16; i < n; i++) sum += xr[i];
            mean = sum / (float)n;
        }
        v16 acc = splat(0.0f);
        for (int64_t i = 0; i < n16; i += 16) {
            v16 c = load16(xr + i) - splat(mean);
            acc += c * c;
        }
        float ss = hsum(acc);
        for (int64_t i = n16; i < n; i++) ss += (xr[i] - mean) * (xr[i] - mean);
        float scale = 1.0f / sqrtf(ss / (float)n + eps);
        if (b) {
            for (int64_t i = 0; i < n16; i += 16)
                store16(o + i, ((load16(xr + i) - splat(mean)) * splat(scale)) * load16(w + i) + load16(b + i));
            for (int64_t i = n16; i < n; i++) o[i] = ((xr[i] - mean) * scale) * w[i] + b[i];
        } else {
            for (int64_t i = 0; i < n16; i += 16) store16(o + i, (load16(xr + i) * splat(scale)) * load16(w + i));
            for (int64_t i = n16; i < n; i++) o[i] = (xr[i] * scale) * w[i];
        }
    }
}

/* b NULL: RMSNorm, else LayerNorm; delta NULL: no residual add. */
void sd_add_norm(float *x, const float *delta, const float *w, const float *b, float *out, int64_t rows, int64_t n,
                 float eps) {
#pragma omp parallel if (rows >= 8)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t per = (rows + nt - 1) / nt, r0 = t * per, r1 = r0 + per < rows ? r0 + per : rows;
        if (r0 < r1) norm_rows(x, delta, w, b, out, r0, r1, n, eps);
    }
}

/* ---- SwiGLU gate: out[r, i] = silu(gu[r, i]) * gu[r, inter + i], gu = [rows, 2 * inter] ---- */

CLONES static void silu_mul_rows(const float *gu, float *out, int64_t r0, int64_t r1, int64_t inter) {
    int64_t n16 = inter / 16 * 16;
    for (int64_t r = r0; r < r1; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < n16; i += 16) {
            v16 gv = load16(g + i);
            store16(o + i, gv / (splat(1.0f) + vexp(-gv)) * load16(u + i));
        }
        for (int64_t i = n16; i < inter; i++) o[i] = g[i] / (1.0f + sexp(-g[i])) * u[i];
    }
}

void sd_silu_mul(const float *gu, float *out, int64_t rows, int64_t inter) {
#pragma omp parallel if (rows >= 8)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t per = (rows + nt - 1) / nt, r0 = t * per, r1 = r0 + per < rows ? r0 + per : rows;
        if (r0 < r1) silu_mul_rows(gu, out, r0, r1, inter);
    }
}

/* ---- Attention over per-session KV buffers ----
 *
 * qkv: [T, stride] packed rows; a row holds q (heads * d floats from q_off), k and v (kv_heads * d
 * from k_off, v_off). cos, sin: [T, d] (transformers' rotary: cos and sin repeated over both
 * halves) or NULL (no rotary). segs: [nseg, 5] int64: the address of the session's KV buffer
 * [layers, 2, kv_heads, capacity, d], its capacity, the segment's start position, its rows and
 * its first packed row. out: [T, out_stride], heads * d floats a row; rows outside every segment
 * are not written.
 */

typedef struct {
    const float *qkv;
    int64_t stride, q_off, k_off, v_off, heads, kv_heads, d;
    const float *cos, *sin;
    const int64_t *segs;
    int64_t nseg, layer;
    float scale;
    float *out;
    int64_t out_stride;
} attn_args;

INLINE float *kv_at(const attn_args *a, const int64_t *seg, int which, int64_t head) {
    float *base = (float *)(intptr_t)seg[0];
    int64_t cap = seg[1];
    return base + (((a->layer * 2 + which) * a->kv_heads + head) * cap) * a->d;
}

/* Rotate one head (d floats, in place) at its row's cos/sin. */
INLINE void rope(float *x, const float *cos, const float *sin, int64_t d) {
    int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* Rows [r0, r1) of segment `seg`: rotate q and k in place, write k and v into the KV buffer. */
CLONES static void rope_store(float *qkv, const attn_args *a, const int64_t *seg, int64_t r0, int64_t r1) {
    int64_t start = seg[2], offset = seg[4], d = a->d;
    for (int64_t r = r0; r < r1; r++) {
        int64_t t = offset + r;
        float *row = qkv + t * a->stride;
        if (a->cos) {
            const float *c = a->cos + t * d, *s = a->sin + t * d;
            for (int64_t h = 0; h < a->heads; h++) rope(row + a->q_off + h * d, c, s, d);
            for (int64_t h = 0; h < a->kv_heads; h++) rope(row + a->k_off + h * d, c, s, d);
        }
        for (int64_t h = 0; h < a->kv_heads; h++) {
            memcpy(kv_at(a, seg, 0, h) + (start + r) * d, row + a->k_off + h * d, d * sizeof(float));
            memcpy(kv_at(a, seg, 1, h) + (start + r) * d, row + a->v_off + h * d, d * sizeof(float));
        }
    }
}

/* The 16 lane sums of 16 vectors, lane j of the result = sum of part[j]'s lanes, by one fixed tree
 * (a transpose folded into the additions: ~3 vector ops a vector instead of a 15-add reduction). */
INLINE v16 reduce16(v16 *part) {
    const v16i lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const v16i hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const v16i lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const v16i hi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const v16i lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const v16i hi3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const v16i lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const v16i hi4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    v16 c[8], e[4], f[2];
    for (int i = 0; i < 8; i++)
        c[i] = __builtin_shuffle(part[2 * i], part[2 * i + 1], lo1) + __builtin_shuffle(part[2 * i], part[2 * i + 1], hi1);
    for (int i = 0; i < 4; i++) e[i] = __builtin_shuffle(c[2 * i], c[2 * i + 1], lo2) + __builtin_shuffle(c[2 * i], c[2 * i + 1], hi2);
    for (int i = 0; i < 2; i++) f[i] = __builtin_shuffle(e[2 * i], e[2 * i + 1], lo3) + __builtin_shuffle(e[2 * i], e[2 * i + 1], hi3);
    return __builtin_shuffle(f[0], f[1], lo4) + __builtin_shuffle(f[0], f[1], hi4);
}

/* One (row, head): softmax(q k^T * scale) v over the session's positions 0 .. start + r. The keys
 * are scored 16 at a time (reduce16), the last keys % 16 one by one; which path scores a key
 * depends only on the row's own key count, so a row's bits never depend on another row. */
CLONES static void attend_one(const attn_args *a, const int64_t *seg, int64_t r, int64_t h, float *scores) {
    int64_t d = a->d, d16 = d / 16 * 16, group = a->heads / a->kv_heads;
    int64_t t = seg[4] + r, keys = seg[2] + r + 1;
    const float *q = a->qkv + t * a->stride + a->q_off + h * d;
    const float *k = kv_at(a, seg, 0, h / group), *v = kv_at(a, seg, 1, h / group);
    float mx = -INFINITY;
    int64_t j = 0;
    if (d16 == d && d <= 256) {
        v16 qv[16], part[16];
        int64_t nv = d / 16;
        for (int64_t i = 0; i < nv; i++) qv[i] = load16(q + i * 16) * splat(a->scale);
        for (; j + 16 <= keys; j += 16) {
            for (int jj = 0; jj < 16; jj++) {
                const float *kj = k + (j + jj) * d;
                v16 acc = qv[0] * load16(kj);
                for (int64_t i = 1; i < nv; i++) acc += qv[i] * load16(kj + i * 16);
                part[jj] = acc;
            }
            v16 s = reduce16(part);
            store16(scores + j, s);
            for (int jj = 0; jj < 16; jj++) mx = s[jj] > mx ? s[jj] : mx;
        }
        for (; j < keys; j++) {
            const float *kj = k + j * d;
            v16 acc = qv[0] * load16(kj);
            for (int64_t i = 1; i < nv; i++) acc += qv[i] * load16(kj + i * 16);
            float s = hsum(acc);
            scores[j] = s;
            mx = s > mx ? s : mx;
        }
    } else {
        for (; j < keys; j++) {
            const float *kj = k + j * d;
            float s = 0.0f;
            for (int64_t i = 0; i < d; i++) s += (q[i] * a->scale) * kj[i];
            scores[j] = s;
            mx = s > mx ? s : mx;
        }
    }
    int64_t k16 = keys / 16 * 16;
    v16 acc = splat(0.0f);
    for (int64_t j = 0; j < k16; j += 16) {
        v16 p = vexp(load16(scores + j) - splat(mx));
        store16(scores + j, p);
        acc += p;
    }
    float sum = hsum(acc);
    for (int64_t j = k16; j < keys; j++) {
        scores[j] = sexp(scores[j] - mx);
        sum += scores[j];
    }
    float *o = a->out + t * a->out_stride + h * d;
    if (d16 == d && d <= 256) {
        v16 ov[16];
        int64_t nv = d / 16;
        for (int64_t i = 0; i < nv; i++) ov[i] = splat(0.0f);
        for (int64_t j = 0; j < keys; j++) {
            v16 p = splat(scores[j]);
            const float *vj = v + j * d;
            for (int64_t i = 0; i < nv; i++) ov[i] += p * load16(vj + i * 16);
        }
        for (int64_t i = 0; i < nv; i++) store16(o + i * 16, ov[i] / splat(sum));
    } else {
        for (int64_t i = 0; i < d; i++) o[i] = 0.0f;
        for (int64_t j = 0; j < keys; j++)
            for (int64_t i = 0; i < d; i++) o[i] += scores[j] * v[j * d + i];
        for (int64_t i = 0; i < d; i++) o[i] /= sum;
    }
}

CLONES static void attend_items(const attn_args *a, int64_t i0, int64_t i1, float *scores) {
    /* items are (segment row, head) pairs numbered segment by segment, row-major over heads */
    int64_t s = 0, base = 0;
    for (int64_t i = i0; i < i1; i++) {
        while (i >= base + a->segs[s * 5 + 3] * a->heads) base += a->segs[s++ * 5 + 3] * a->heads;
        int64_t local = i - base;
        attend_one(a, a->segs + s * 5, local / a->heads, local % a->heads, scores);
    }
}

/* Returns 0, or -1 when scratch memory could not be allocated (nothing is computed then). */
int sd_attention(float *qkv, int64_t stride, int64_t q_off, int64_t k_off, int64_t v_off, int64_t heads,
                 int64_t kv_heads, int64_t d, const float *cos, const float *sin, const int64_t *segs, int64_t nseg,
                 int64_t layer, float scale, float *out, int64_t out_stride) {
    attn_args a = {qkv, stride, q_off, k_off, v_off, heads, kv_heads, d, cos, sin, segs, nseg, layer, scale,
                   out, out_stride};
    int64_t rows = 0, longest = 0;
    for (int64_t s = 0; s < nseg; s++) {
        rows += segs[s * 5 + 3];
        int64_t keys = segs[s * 5 + 2] + segs[s * 5 + 3];
        longest = keys > longest ? keys : longest;
    }
    int64_t items = rows * heads;
    int failed = 0;
#pragma omp parallel if (items * longest >= 1024)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int64_t s = 0; s < nseg; s++) {
            int64_t n = segs[s * 5 + 3], per = (n + nt - 1) / nt, r0 = t * per, r1 = r0 + per < n ? r0 + per : n;
            if (r0 < r1) rope_store(qkv, &a, segs + s * 5, r0, r1);
        }
#pragma omp barrier
        float *scores = malloc((size_t)(longest + 16) * sizeof(float));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        } else {
            int64_t per = (items + nt - 1) / nt, i0 = t * per, i1 = i0 + per < items ? i0 + per : items;
            if (i0 < i1) attend_items(&a, i0, i1, scores);
            free(scores);
        }
    }
    return failed ? -1 : 0;
}

/* ---- Linear layers on panel-packed weights ----
 *
 * y[M, N] = act(x[M, K] @ W^T + bias) + residual. W [N, K] is packed once (sd_pack_linear) into
 * panels of 16 output columns, each K x 16 floats laid out k-major (the last panel zero-padded),
 * so a pass streams every weight exactly once, sequentially, whatever M. Each output (m, n) is one
 * vector lane summed over k = 0 .. K-1 in order: the same additions for a row alone or among any
 * other rows, on any thread (the contract above). Rows are taken 6 at a time against 4 panels
 * (24 accumulators with AVX-512), so the weights read serve 6 rows; a lone row still streams them
 * at memory speed. Threads split the panels.
 */

#define PANEL 16
#define PANELS 4 /* panels per tile */

void sd_pack_linear(const float *w, int64_t n, int64_t k, float *panels) {
    int64_t np = (n + PANEL - 1) / PANEL;
#pragma omp parallel for if (n * k >= (1 << 16))
    for (int64_t p = 0; p < np; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < PANEL; j++) {
                int64_t col = p * PANEL + j;
                panels[(p * k + kk) * PANEL + j] = col < n ? w[col * k + kk] : 0.0f;
            }
}

typedef struct {
    const float *x, *panels, *bias, *residual;
    float *y;
    int64_t m, k, n;
    int act; /* 0 none, 1 tanh-GELU */
} linear_args;

/* 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), tanh(u) = 1 - 2 / (e^(2u) + 1) */
INLINE v16 gelu_tanh(v16 x) {
    v16 u = splat(0.7978845608028654f) * (x + splat(0.044715f) * x * x * x);
    v16 t = splat(1.0f) - splat(2.0f) / (vexp(u + u) + splat(1.0f));
    return splat(0.5f) * x * (splat(1.0f) + t);
}

INLINE void store_panel(const linear_args *a, int64_t row, int64_t p, v16 acc) {
    int64_t col = p * PANEL, valid = a->n - col < PANEL ? a->n - col : PANEL;
    v16 v = acc;
    if (a->bias) {
        v16 b = splat(0.0f);
        memcpy(&b, a->bias + col, valid * sizeof(float));
        v += b;
    }
    if (a->act == 1) v = gelu_tanh(v);
    float *out = a->y + row * a->n + col;
    if (a->residual) {
        v16 r = splat(0.0f);
        memcpy(&r, a->residual + row * a->n + col, valid * sizeof(float));
        v += r;
    }
    if (valid == PANEL) store16(out, v);
    else memcpy(out, &v, valid * sizeof(float));
}

/* One tile: `rows` rows against `panels` panels, each panel held as 16 / W vectors of W floats
 * (W = 16 with AVX-512; 8 with AVX2, whose 16 registers hold a 4 x 2 tile of 8-float vectors).
 * Every lane is one output summed over k in order, so both widths compute the same bits. */
#define LINEAR_TILE(NAME, VEC, W, MAXR, MAXP, BCAST)                                                \
    INLINE void NAME(const linear_args *a, int64_t m0, int64_t p0, const int rows, const int panels) { \
        enum { PER = PANEL / W };                                                                   \
        VEC acc[MAXR][MAXP * PER];                                                                  \
        const int64_t k = a->k;                                                                     \
        const float *x = a->x + m0 * k;                                                             \
        const float *w0 = a->panels + p0 * k * PANEL;                                               \
        for (int r = 0; r < rows; r++)                                                              \
            for (int b = 0; b < panels * PER; b++) acc[r][b] = (VEC){0};                            \
        for (int64_t kk = 0; kk < k; kk++) {                                                        \
            VEC w[MAXP * PER];                                                                      \
            for (int b = 0; b < panels; b++)                                                        \
                for (int h = 0; h < PER; h++) memcpy(&w[b * PER + h], w0 + (b * k + kk) * PANEL + h * W, sizeof(VEC)); \
            for (int r = 0; r < rows; r++) {                                                        \
                float xs = x[r * k + kk];                                                           \
                VEC xv = BCAST(xs);                                                                 \
                for (int b = 0; b < panels * PER; b++) acc[r][b] += xv * w[b];                      \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < rows; r++)                                                              \
            for (int b = 0; b < panels; b++) {                                                      \
                /* through a copy: taking acc's address would keep it out of registers */          \
                float buf[PANEL];                                                                   \
                for (int h = 0; h < PER; h++) {                                                     \
                    VEC v = acc[r][b * PER + h];                                                    \
                    memcpy(buf + h * W, &v, sizeof v);                                              \
                }                                                                                   \
                store_panel(a, m0 + r, p0 + b, load16(buf));                                        \
            }                                                                                       \
    }

typedef float v8 __attribute__((vector_size(32)));
#define BCAST16(f) ((v16){f, f, f, f, f, f, f, f, f, f, f, f, f, f, f, f})
#define BCAST8(f) ((v8){f, f, f, f, f, f, f, f})
LINEAR_TILE(tile16, v16, 16, 6, PANELS, BCAST16)
LINEAR_TILE(tile8, v8, 8, 4, 1, BCAST8)

#define TILE_ROWS(TILE, a, m0, p, rows, panels)                            \
    switch (rows) {                                                          \
    case 6: TILE(a, m0, p, 6, panels); break;                                \
    case 5: TILE(a, m0, p, 5, panels); break;                                \
    case 4: TILE(a, m0, p, 4, panels); break;                                \
    case 3: TILE(a, m0, p, 3, panels); break;                                \
    case 2: TILE(a, m0, p, 2, panels); break;                                \
    default: TILE(a, m0, p, 1, panels); break;                               \
    }

/* Panels [p0, p1) for every row: TILE_R rows by STEP panels a tile (the last panels one at a time). */
#define LINEAR_PANELS(NAME, TILE, TILE_R, STEP)                                              \
    static void NAME(const linear_args *a, int64_t p0, int64_t p1) {                          \
        for (int64_t p = p0; p < p1;) {                                                       \
            int whole = p + STEP <= p1;                                                        \
            for (int64_t m0 = 0; m0 < a->m; m0 += TILE_R) {                                    \
                int rows = a->m - m0 < TILE_R ? (int)(a->m - m0) : TILE_R;                     \
                if (whole) {                                                                   \
                    TILE_ROWS(TILE, a, m0, p, rows, STEP)                                      \
                } else {                                                                       \
                    TILE_ROWS(TILE, a, m0, p, rows, 1)                                         \
                }                                                                              \
            }                                                                                  \
            p += whole ? STEP : 1;                                                             \
        }                                                                                      \
    }

/* The instruction set is chosen once, at the first call: AVX-512 (6 rows x 4 panels a tile),
 * AVX2 + FMA (4 rows x 1 panel), else the baseline (no FMA: other roundings, the same order). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target("avx512f"))) LINEAR_PANELS(linear_panels_avx512, tile16, 6, PANELS)
__attribute__((target("arch=x86-64-v3"))) LINEAR_PANELS(linear_panels_avx2, tile8, 4, 1)
LINEAR_PANELS(linear_panels_base, tile8, 4, 1)
typedef void (*panels_fn)(const linear_args *, int64_t, int64_t);
static panels_fn pick_panels(void) {
    /* SPECDEC_NATIVE_ISA=avx2|baseline: at most that (for tests and comparisons) */
    const char *cap = getenv("SPECDEC_NATIVE_ISA");
    int avx512 = !cap || !strcmp(cap, "avx512"), avx2 = avx512 || !strcmp(cap, "avx2");
    __builtin_cpu_init();
    if (avx512 && __builtin_cpu_supports("avx512f")) return linear_panels_avx512;
    if (avx2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return linear_panels_avx2;
    return linear_panels_base;
}
#else
LINEAR_PANELS(linear_panels_base, tile8, 4, 1)
typedef void (*panels_fn)(const linear_args *, int64_t, int64_t);
static panels_fn pick_panels(void) { return linear_panels_base; }
#endif

const char *sd_linear_isa(void) {
    panels_fn f = pick_panels();
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    if (f == linear_panels_avx512) return "avx512";
    if (f == linear_panels_avx2) return "avx2";
#endif
    return f == linear_panels_base ? "baseline" : "?";
}

void sd_linear(const float *x, int64_t m, int64_t k, const float *panels, int64_t n, const float *bias,
               const float *residual, int act, float *y) {
    static panels_fn run = NULL;
    if (!run) run = pick_panels(); /* the same answer on every thread: a benign race */
    linear_args a = {x, panels, bias, residual, y, m, k, n, act};
    int64_t np = (n + PANEL - 1) / PANEL;
#pragma omp parallel if (m * n * k >= (1 << 15))
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        /* whole tiles of panels per thread; the last thread takes the rest */
        int64_t per = (np / nt + PANELS - 1) / PANELS * PANELS;
        int64_t p0 = t * per, p1 = t == nt - 1 ? np : p0 + per;
        if (p0 > np) p0 = np;
        if (p1 > np) p1 = np;
        if (p0 < p1) run(&a, p0, p1);
    }
}
