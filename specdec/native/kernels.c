/* specdec's native kernels: the per-layer work of a decoder forward between its linears.
 *
 * A one-row decoder step on a 2-core CPU spends a quarter of its time outside the weights: ~20
 * small torch ops a layer (norms, rotary, the KV write, attention, the MLP's gate), each a few
 * microseconds of dispatch around a few nanoseconds of arithmetic. These kernels do that work in
 * three calls a layer (or one call for all the layers: sd_forward_decoder), on fp32 tensors laid out
 * as specdec.runner lays them out.
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
/* f in every lane by one broadcast (GCC can build splat's literal of a loaded float lane by lane) */
INLINE v16 bcast(float f) { return __builtin_shuffle((v16){f}, (v16i){0}); }

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

/* The value pass for queries [c, c + 4) (lanes; the unused ones hold p = 0) and vectors
 * [e0, e0 + W) of the head dimension: acc = sum_j p_j v_j over each query's own keys in order. */
INLINE void values4(const float *v, int64_t d, int64_t e0, const int W, const float *st, int c, const int64_t *limit,
                    float *const *outs, int nq, const float *sums) {
    v16 acc[4][4] = {{{0}}};
    int64_t common = INT64_MAX, most = 0;
    for (int i = c; i < c + 4 && i < nq; i++) {
        common = limit[i] < common ? limit[i] : common;
        most = limit[i] > most ? limit[i] : most;
    }
    int64_t j = 0;
    for (; j < common; j++) { /* every query of the chunk sees key j */
        const float *vj = v + j * d + e0 * 16;
        v16 vv[4];
        for (int b = 0; b < W; b++) vv[b] = load16(vj + b * 16);
        for (int i = 0; i < 4; i++) {
            v16 p = bcast(st[j * 16 + c + i]);
            for (int b = 0; b < W; b++) acc[i][b] += p * vv[b];
        }
    }
    for (; j < most; j++) { /* the causal edge: only the queries that see key j add it */
        const float *vj = v + j * d + e0 * 16;
        for (int i = 0; i < 4; i++)
            if (c + i < nq && j < limit[c + i]) {
                v16 p = bcast(st[j * 16 + c + i]);
                for (int b = 0; b < W; b++) acc[i][b] += p * load16(vj + b * 16);
            }
    }
    for (int i = 0; i < 4 && c + i < nq; i++)
        for (int b = 0; b < W; b++) store16(outs[c + i] + (e0 + b) * 16, acc[i][b] / splat(sums[c + i]));
}

/* One item of attention: up to 16 queries that read the same keys (one KV head of one segment),
 * one query a vector lane. A segment's queries of KV head g are numbered row-major over the
 * group's heads (query i: row i / group, head g * group + i % group), so a step's rows share every
 * key and value they read: loaded once for 16 queries instead of once per (row, head).
 *
 * Each query's arithmetic depends on nothing but its own inputs (the contract above): its score
 * for key j is q . k_j summed over the head dimension in order (one lane, one FMA per element),
 * its softmax takes the max and the sum over its own keys 0 .. start + row in order (lanes past a
 * query's own keys are set to -inf, then to exactly 0, and are skipped where they would add), and
 * its output sums p_j v_j over those keys in order. Which other queries share its vector, and how
 * many, changes no bit. */
#define KEYS_AHEAD 16 /* keys the score pass prefetches ahead */

CLONES static void attend_group(const attn_args *a, const int64_t *seg, int64_t g, int64_t q0, int nq, float *qt,
                                float *st) {
    const int64_t d = a->d, group = a->heads / a->kv_heads, start = seg[2];
    const float *k = kv_at(a, seg, 0, g), *v = kv_at(a, seg, 1, g);
    int64_t limit[16], keys = 0;
    float *outs[16];
    const float *qs[16];
    int32_t lims[16];
    for (int i = 0; i < 16; i++) {
        limit[i] = 0;
        qs[i] = NULL;
        if (i < nq) {
            int64_t qi = q0 + i, r = qi / group, h = g * group + qi % group, t = seg[4] + r;
            qs[i] = a->qkv + t * a->stride + a->q_off + h * d;
            limit[i] = start + r + 1;
            outs[i] = a->out + t * a->out_stride + h * d;
            keys = limit[i] > keys ? limit[i] : keys;
        }
        lims[i] = (int32_t)limit[i];
    }
    v16i lim;
    memcpy(&lim, lims, sizeof lim);
    for (int64_t e = 0; e < d; e++) { /* the queries transposed: qt[e] holds element e of each, scaled */
        float col[16];
        for (int i = 0; i < 16; i++) col[i] = qs[i] ? qs[i][e] * a->scale : 0.0f;
        memcpy(qt + e * 16, col, sizeof col);
    }
    /* scores, key j in st[j * 16 ..]: eight keys at a time (eight FMA chains in flight), each
     * lane summed over e in order */
    int64_t j = 0;
    for (; j + 8 <= keys; j += 8) {
        const float *k0 = k + j * d;
        /* the keys KEYS_AHEAD on, a line every 16 floats: eight keys are read in eight strided
         * streams, which the hardware's prefetchers follow late (decode attention over 1,000
         * cached tokens: 2.1-2.9 ms a step against 2.7-4.0 without) */
        if (j + KEYS_AHEAD + 8 <= keys)
            for (int64_t f = 0; f < 8 * d; f += 16) __builtin_prefetch(k0 + KEYS_AHEAD * d + f, 0, 3);
        v16 s[8] = {{0}};
        for (int64_t e = 0; e < d; e++) {
            v16 qv = load16(qt + e * 16);
            for (int i = 0; i < 8; i++) s[i] += qv * bcast(k0[i * d + e]);
        }
        for (int i = 0; i < 8; i++) store16(st + (j + i) * 16, s[i]);
    }
    for (; j < keys; j++) {
        v16 s0 = {0};
        for (int64_t e = 0; e < d; e++) s0 += load16(qt + e * 16) * bcast(k[j * d + e]);
        store16(st + j * 16, s0);
    }
    /* softmax per lane over its own keys: max, then exp and the sum in order (lanes past a
     * query's keys -inf, then exactly 0) */
    const v16 ninf = splat(-INFINITY);
    v16 mx = ninf;
    for (j = 0; j < keys; j++) {
        v16i seen = (v16i){0} + (int32_t)j < lim;
        v16 s = (v16)((seen & (v16i)load16(st + j * 16)) | (~seen & (v16i)ninf));
        store16(st + j * 16, s);
        mx = vmax(mx, s);
    }
    mx = (v16)(((v16i){0} < lim) & (v16i)mx); /* unused lanes: 0, not -inf (no inf - inf) */
    v16 sum = {0};
    for (j = 0; j < keys; j++) {
        v16i seen = (v16i){0} + (int32_t)j < lim;
        v16 p = (v16)(seen & (v16i)vexp(load16(st + j * 16) - mx));
        store16(st + j * 16, p);
        sum += p;
    }
    float sums[16];
    memcpy(sums, &sum, sizeof sums);
    /* values, four queries and up to four vectors of the head dimension at a time (its d % 16
     * tail one float at a time, in the same order) */
    int64_t nv = d / 16, d16 = nv * 16;
    for (int64_t e0 = 0; e0 < nv; e0 += 4)
        for (int c = 0; c < nq; c += 4) switch (nv - e0 < 4 ? nv - e0 : 4) {
            case 4: values4(v, d, e0, 4, st, c, limit, outs, nq, sums); break;
            case 3: values4(v, d, e0, 3, st, c, limit, outs, nq, sums); break;
            case 2: values4(v, d, e0, 2, st, c, limit, outs, nq, sums); break;
            default: values4(v, d, e0, 1, st, c, limit, outs, nq, sums); break;
            }
    for (int64_t e = d16; e < d; e++)
        for (int i = 0; i < nq; i++) {
            float o = 0.0f;
            for (j = 0; j < limit[i]; j++) o += st[j * 16 + i] * v[j * d + e];
            outs[i][e] = o / sums[i];
        }
}

/* A segment's items: per KV head, its rows x group queries in chunks of 16. */
INLINE int64_t segment_items(const attn_args *a, const int64_t *seg) {
    return a->kv_heads * ((seg[3] * (a->heads / a->kv_heads) + 15) / 16);
}

CLONES static void attend_item(const attn_args *a, int64_t item, float *qt, float *st) {
    int64_t s = 0, n;
    while (item >= (n = segment_items(a, a->segs + s * 5))) {
        item -= n;
        s++;
    }
    const int64_t *seg = a->segs + s * 5;
    int64_t per_head = n / a->kv_heads, queries = seg[3] * (a->heads / a->kv_heads);
    int64_t g = item / per_head, q0 = item % per_head * 16;
    attend_group(a, seg, g, q0, (int)(queries - q0 < 16 ? queries - q0 : 16), qt, st);
}

/* Returns 0, or -1 when scratch memory could not be allocated (nothing is computed then). */
int sd_attention(float *qkv, int64_t stride, int64_t q_off, int64_t k_off, int64_t v_off, int64_t heads,
                 int64_t kv_heads, int64_t d, const float *cos, const float *sin, const int64_t *segs, int64_t nseg,
                 int64_t layer, float scale, float *out, int64_t out_stride) {
    attn_args a = {qkv, stride, q_off, k_off, v_off, heads, kv_heads, d, cos, sin, segs, nseg, layer, scale,
                   out, out_stride};
    int64_t items = 0, longest = 0, work = 0;
    for (int64_t s = 0; s < nseg; s++) {
        items += segment_items(&a, segs + s * 5);
        int64_t keys = segs[s * 5 + 2] + segs[s * 5 + 3];
        longest = keys > longest ? keys : longest;
        work += segs[s * 5 + 3] * heads * keys;
    }
    int failed = 0;
#pragma omp parallel if (work >= 1024)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int64_t s = 0; s < nseg; s++) {
            int64_t n = segs[s * 5 + 3], per = (n + nt - 1) / nt, r0 = t * per, r1 = r0 + per < n ? r0 + per : n;
            if (r0 < r1) rope_store(qkv, &a, segs + s * 5, r0, r1);
        }
#pragma omp barrier
        /* queries transposed (d x 16), then each key's 16 scores */
        float *scratch = aligned_alloc(64, (size_t)(d * 16 + (longest + 4) * 16) * sizeof(float));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++)
            if (scratch) attend_item(&a, i, scratch, scratch + d * 16);
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* ---- Linear layers on panel-packed weights ----
 *
 * y[M, N] = act(x[M, K] @ W^T + bias) + residual. W [N, K] is packed once (sd_pack_linear) into
 * panels of 16 output columns, each K x 16 floats laid out k-major (the last panel zero-padded),
 * so a pass streams every weight once, sequentially. Each output (m, n) is one vector lane summed
 * over k = 0 .. K-1 in order, one FMA a k: the same additions for a row alone or among any other
 * rows, in any tile shape, on any thread (the contract above). Threads split the panels.
 *
 * Schedule, by the pass's rows M (AVX-512; AVX2 and the baseline take 4 rows x 1 panel tiles):
 *   M <= COL_MAX (a plain step, a verify of up to 16 draft tokens): column passes, every row
 *     against one panel (M accumulators), so the weights are read once for all rows while the
 *     rows' x stays in cache; each pass prefetches its own stream AHEAD bytes ahead. A pass of
 *     M rows then costs about what one row does until the arithmetic outgrows the streaming.
 *     The passes read x transposed (linear_args.xt, each thread's own copy): the rows' k-th
 *     floats share a cache line and one pointer addresses them all.
 *   COL_MAX < M <= COLUMNS_MAX (a few sessions' verifies batched): per panel, column passes of
 *     COL_MAX rows and the rest, the first streaming the panel, the others finding it in cache.
 *   M > COLUMNS_MAX (prefills, large batches): tiles of 6 rows x 4 panels (24 accumulators),
 *     every weight read serving 6 rows; the first row tile streams the group from memory, the
 *     later ones find it in L2 and meanwhile prefetch the next group, so memory keeps streaming.
 * Measured (the embedded target's 121 linears, 2 cores, medians of 15-41 interleaved passes): 17
 * rows cost 1.55x one row in 6 x 4 tiles without prefetching and 1.1-1.2x in column passes; 20
 * to 40 rows 7-19 % less in column passes of 17 + the rest than in 6 x 4 tiles, 48 and more the
 * same (docs/performance.md).
 */

#define PANEL 16
#define PANELS 4     /* panels per group: a 6 x 4 tile's width */
#define AHEAD 4096   /* bytes a column pass prefetches ahead of its loads */
#define COL_MAX 17   /* rows of one column pass */
#define COLUMNS_MAX (3 * COL_MAX) /* passes of at most this many rows run as column passes */

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
    /* column passes: x's rows in blocks of COL_MAX (the last the rest), each block k-major: row
     * m0 + r of the block from m0 (rb rows) at xt[m0 * k + kk * rb + r] */
    const float *xt;
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

/* What a tile prefetches (into L2) while it computes: nothing (NULL), or at its k-th step `per`
 * 64-byte lines, from + k * step + c * gap (c < per), for its first `steps` k. */
typedef struct {
    const float *from;
    int64_t steps, step, gap;
    int per;
} prefetch;

INLINE void prefetch_step(const prefetch *f, int64_t kk) {
    if (!f || kk >= f->steps) return;
    for (int c = 0; c < 4; c++)
        if (c < f->per) __builtin_prefetch(f->from + kk * f->step + c * f->gap, 0, 2);
}

/* One tile: `rows` rows from m0 against `panels` panels from p0, each panel held as 16 / W vectors
 * of W floats (W = 16 with AVX-512; 8 with AVX2, whose 16 registers hold a 4 x 2 tile of 8-float
 * vectors). Every lane is one output summed over k in order, so every shape and width computes
 * the same bits. */
#define LINEAR_TILE(NAME, VEC, W, MAXR, MAXP, BCAST)                                                \
    INLINE void NAME(const linear_args *a, int64_t m0, int64_t p0, const int rows, const int panels, \
                     const prefetch *f) {                                                           \
        enum { PER = PANEL / W };                                                                   \
        VEC acc[MAXR][MAXP * PER];                                                                  \
        const int64_t k = a->k;                                                                     \
        const float *x = a->x + m0 * k;                                                             \
        const float *w0 = a->panels + p0 * k * PANEL;                                               \
        for (int r = 0; r < rows; r++)                                                              \
            for (int b = 0; b < panels * PER; b++) acc[r][b] = (VEC){0};                            \
        for (int64_t kk = 0; kk < k; kk++) {                                                        \
            VEC w[MAXP * PER];                                                                      \
            prefetch_step(f, kk);                                                                   \
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

/* A tile of `rows` (<= MAXR) rows, its row count a constant in each case. */
#define TILE_ROWS(TILE, MAXR, a, m0, p, rows, panels, f)                     \
    switch (rows) {                                                          \
    case 6: if (MAXR >= 6) TILE(a, m0, p, 6, panels, f); break;              \
    case 5: if (MAXR >= 5) TILE(a, m0, p, 5, panels, f); break;              \
    case 4: TILE(a, m0, p, 4, panels, f); break;                             \
    case 3: TILE(a, m0, p, 3, panels, f); break;                             \
    case 2: TILE(a, m0, p, 2, panels, f); break;                             \
    default: TILE(a, m0, p, 1, panels, f); break;                            \
    }

/* Panels [p0, p1) for every row in tiles of TILE_R rows by STEP panels (the last panels one at a
 * time), with the prefetches described above when STEP is a whole group. */
#define LINEAR_TILES(NAME, TILE, TILE_R, STEP)                                                      \
    static void NAME(const linear_args *a, int64_t p0, int64_t p1) {                               \
        const int64_t k = a->k, tiles = (a->m + TILE_R - 1) / TILE_R;                               \
        for (int64_t p = p0; p < p1;) {                                                             \
            int whole = STEP == PANELS && p + STEP <= p1;                                           \
            const float *here = a->panels + p * k * PANEL;                                          \
            /* the next group's k, shared among the later row tiles: all its panels at each k */    \
            int64_t share = tiles > 1 ? (k + tiles - 2) / (tiles - 1) : 0;                          \
            int next = whole && tiles > 1 && p + 2 * STEP <= p1;                                    \
            for (int64_t m0 = 0; m0 < a->m; m0 += TILE_R) {                                         \
                int rows = a->m - m0 < TILE_R ? (int)(a->m - m0) : TILE_R;                          \
                int64_t t = m0 / TILE_R;                                                            \
                int64_t first = (t - 1) * share, steps = k - first < share ? k - first : share;     \
                prefetch later = {here + (STEP * k + first) * PANEL, steps, PANEL, k * PANEL, STEP}; \
                const prefetch *f = t > 0 && next ? &later : NULL;                                  \
                if (whole) {                                                                        \
                    TILE_ROWS(TILE, TILE_R, a, m0, p, rows, STEP, f)                                \
                } else {                                                                            \
                    TILE_ROWS(TILE, TILE_R, a, m0, p, rows, 1, NULL)                                \
                }                                                                                   \
            }                                                                                       \
            p += whole ? STEP : 1;                                                                  \
        }                                                                                           \
    }

/* Rows of the column pass from row m0 of m: COL_MAX, the last pass the rest. */
INLINE int64_t pass_rows(int64_t m, int64_t m0) { return m - m0 < COL_MAX ? m - m0 : COL_MAX; }

/* One column pass: `rows` rows from row m0 against panel p, x read transposed (linear_args.xt:
 * the rows' k-th floats side by side, so one pointer with constant offsets addresses every row;
 * with rows k floats apart GCC runs out of general registers past ~10 rows and keeps row pointers
 * in vector registers). Every lane sums over k in order, as the 6 x 4 tiles do. */
INLINE void column16(const linear_args *a, int64_t m0, int64_t p, const int rows, const prefetch *f) {
    v16 acc[COL_MAX];
    const int64_t k = a->k;
    const float *xt = a->xt + m0 * k;
    const float *w0 = a->panels + p * k * PANEL;
    for (int r = 0; r < rows; r++) acc[r] = (v16){0};
    for (int64_t kk = 0; kk < k; kk++) {
        prefetch_step(f, kk);
        v16 w = load16(w0 + kk * PANEL);
        const float *xk = xt + kk * rows;
        for (int r = 0; r < rows; r++) acc[r] += BCAST16(xk[r]) * w;
    }
    for (int r = 0; r < rows; r++) store_panel(a, m0 + r, p, acc[r]);
}

/* x's rows in linear_args.xt's layout, in a buffer of this thread's (kept and grown: at most
 * COLUMNS_MAX rows of the widest k; OpenMP's threads and the callers' live as long as the
 * process); NULL when it cannot grow. One row is its own transpose: x itself. Each thread
 * transposes the whole of x for itself: no barrier, and no lines written by the other core
 * (measured against halves and a barrier: 3 µs against 11 µs a 17-row call of 576 x 768 more
 * than untransposed). */
static const float *transposed_rows(const float *x, int64_t m, int64_t k) {
    static __thread float *buf = NULL;
    static __thread int64_t cap = 0;
    if (m == 1) return x;
    if (cap < m * k) {
        void *grown = NULL;
        if (posix_memalign(&grown, 64, (size_t)(m * k) * sizeof(float))) return NULL;
        free(buf);
        buf = grown;
        cap = m * k;
    }
    for (int64_t m0 = 0, rb; m0 < m; m0 += rb) {
        rb = pass_rows(m, m0);
        const float *src = x + m0 * k;
        float *dst = buf + m0 * k;
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t r = 0; r < rb; r++) dst[kk * rb + r] = src[r * k + kk];
    }
    return buf;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define COLUMN_CASE(R, M0, F) case R: column16(a, M0, p, R, F); break;
/* A column pass of `rows` rows from row m0 against panel p, its row count a constant in each case. */
#define COLUMN_PASS(rows, m0, f)                                                                    \
    switch (rows) {                                                                                 \
        COLUMN_CASE(1, m0, f) COLUMN_CASE(2, m0, f) COLUMN_CASE(3, m0, f) COLUMN_CASE(4, m0, f)     \
        COLUMN_CASE(5, m0, f) COLUMN_CASE(6, m0, f) COLUMN_CASE(7, m0, f) COLUMN_CASE(8, m0, f)     \
        COLUMN_CASE(9, m0, f) COLUMN_CASE(10, m0, f) COLUMN_CASE(11, m0, f) COLUMN_CASE(12, m0, f) \
        COLUMN_CASE(13, m0, f) COLUMN_CASE(14, m0, f) COLUMN_CASE(15, m0, f) COLUMN_CASE(16, m0, f) \
        default: column16(a, m0, p, COL_MAX, f); break;                                             \
    }
/* Panels [p0, p1) in column passes (M <= COLUMNS_MAX): see the schedule above. */
__attribute__((target("avx512f"))) static void linear_columns_avx512(const linear_args *a, int64_t p0, int64_t p1) {
    const int64_t k = a->k;
    for (int64_t p = p0; p < p1; p++) {
        /* each pass prefetches its own stream AHEAD bytes ahead of its loads (into the next
         * panel's first lines at its end) */
        prefetch own = {a->panels + p * k * PANEL + AHEAD / sizeof(float), k, PANEL, 0, 1};
        /* passes of COL_MAX rows and the rest (pass_rows): the first streams the panel, the
         * others find it in cache */
        for (int64_t m0 = 0, rows; m0 < a->m; m0 += rows) {
            rows = pass_rows(a->m, m0);
            COLUMN_PASS(rows, m0, m0 ? NULL : &own)
        }
    }
}
#endif

/* The instruction set is chosen once, at the first call: AVX-512 (the schedule above), AVX2 + FMA
 * (4 rows x 1 panel), else the baseline (no FMA: other roundings, the same order). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target("avx512f"))) LINEAR_TILES(linear_tiles_avx512, tile16, 6, PANELS)
__attribute__((target("avx512f"))) static void linear_panels_avx512(const linear_args *a, int64_t p0, int64_t p1) {
    /* sd_linear gives x transposed exactly to the passes that run as column passes */
    if (a->xt) linear_columns_avx512(a, p0, p1);
    else linear_tiles_avx512(a, p0, p1);
}
__attribute__((target("arch=x86-64-v3"))) LINEAR_TILES(linear_panels_avx2, tile8, 4, 1)
LINEAR_TILES(linear_panels_base, tile8, 4, 1)
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
LINEAR_TILES(linear_panels_base, tile8, 4, 1)
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

/* This OpenMP thread's share [p0, p1) of np panels: whole tiles of `step` panels each, the last
 * thread takes the rest. False when it has none. */
INLINE int thread_panels(int64_t np, int64_t step, int64_t *p0, int64_t *p1) {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t per = (np / nt + step - 1) / step * step;
    *p0 = t * per < np ? t * per : np;
    *p1 = t == nt - 1 ? np : (*p0 + per < np ? *p0 + per : np);
    return *p0 < *p1;
}

void sd_linear(const float *x, int64_t m, int64_t k, const float *panels, int64_t n, const float *bias,
               const float *residual, int act, float *y) {
    static panels_fn run = NULL;
    if (!run) run = pick_panels(); /* the same answer on every thread: a benign race */
    linear_args a = {x, panels, bias, residual, y, m, k, n, act, NULL};
    int64_t np = (n + PANEL - 1) / PANEL;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    /* column passes take any share of the panels: split them evenly (36 panels: 18 + 18, not 20 + 16) */
    int columns = run == linear_panels_avx512 && m <= COLUMNS_MAX;
#else
    int columns = 0;
#endif
    int64_t step = columns ? 1 : PANELS;
#pragma omp parallel if (m * n * k >= (1 << 15))
    {
        int64_t p0, p1;
        if (thread_panels(np, step, &p0, &p1)) {
            /* column passes read x transposed, each thread its own copy; without the memory for
             * it (xt NULL) the passes run as 6 x 4 tiles: the same bits */
            linear_args own = a;
            if (columns) own.xt = transposed_rows(x, m, k);
            run(&own, p0, p1);
        }
    }
}

/* ---- Linear layers on block-quantized weights (a draft model's GGUF tensors) ----
 *
 * llama.cpp's two formats that this project's draft GGUFs hold, per block of 32 k of one output
 * column: Q4_1 (w = d * q + m, q in 0..15) and Q8_0 (w = d * q, q in -128..127). As llama.cpp
 * does, each row of x is quantised per block to int8 (x ~ s * qx, s = max|x| / 127), and a block's
 * products are summed in int32 with AVX-512 VNNI (vpdpbusd: 64 byte products an instruction), then
 * scaled once: d * s * sum(q qx) (+ m * sum(x) for Q4_1). Drafts need no bitwise contract; the
 * integer sums are exact and the rest is in one fixed order per row anyway.
 *
 * Packed per (panel of 16 columns, block), 4 consecutive k of a column in each 32-bit lane, the
 * GGUF bytes as they are apart from their order:
 *   Q4_1: fp16 d[16], fp16 m[16], uint8 q[4][64]: vector v, lane c, byte i = column c's GGUF byte
 *         4v + i (low nibble: k = 4v + i, high nibble: k = 16 + 4v + i)
 *   Q8_0: fp16 d[16], 32 bytes unused, uint8 q[8][64]: vector v, lane c, byte i = q + 128 at k = 4v + i
 * (0.625 and 1.125 bytes a weight). VNNI multiplies unsigned by signed bytes: the weights are the
 * unsigned side (Q8_0's offset by 128, which comes back off as 128 * sum(qx) per row and block). */

#define QBLOCK 32
#define QPANELS 4 /* panels per tile */
#define QMAXR 2   /* rows per tile */
#define QPREFETCH 2 /* groups of blocks ahead */
#define QHEAD 64 /* bytes of scales before a packed block's quants */
enum { Q4_1 = 0, Q8_0 = 1 };

int64_t sd_quant_panel_bytes(int fmt) { return QHEAD + (fmt == Q4_1 ? 256 : 512); }

/* Bytes of a packed [n, k] weight: panels in groups of QPANELS (the last group zero-padded), each
 * group's blocks interleaved (block b of its 4 panels, then block b + 1 ...) so a tile reads one
 * sequential stream. */
int64_t sd_quant_bytes(int64_t n, int64_t k, int fmt) {
    int64_t groups = ((n + PANEL - 1) / PANEL + QPANELS - 1) / QPANELS;
    return groups * QPANELS * (k / QBLOCK) * sd_quant_panel_bytes(fmt);
}

/* Where panel p's block b starts. */
INLINE int64_t qblock_at(int64_t p, int64_t b, int64_t nb, int64_t pb) {
    return (((p / QPANELS) * nb + b) * QPANELS + p % QPANELS) * pb;
}

static float half_to_float(uint16_t h) {
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

typedef struct {
    const int8_t *xq; /* [m, k] each row's int8 quants */
    const float *xs, *xsum; /* [m, k / 32] per block: the scale s, the sum of x */
    const int32_t *xq128; /* [m, k / 32] per block: 128 * sum(qx) (Q8_0's offset) */
    const uint8_t *w;
    const float *bias, *residual;
    float *y;
    int64_t m, k, n;
    int act, fmt;
} qlinear_args;

/* One block's integer dot products of the portable build: lane c = column c's sum(q qx) for row r
 * (Q8_0: with q + 128), the sums VNNI computes (exact in int32 either way). */
static void qblock_base(const qlinear_args *a, const uint8_t *blk, int64_t r, int64_t b, int32_t *out) {
    const int8_t *x = a->xq + r * a->k + b * QBLOCK;
    for (int c = 0; c < PANEL; c++) {
        int32_t s = 0;
        for (int v = 0; v < (a->fmt == Q4_1 ? 4 : 8); v++)
            for (int i = 0; i < 4; i++) {
                uint8_t byte = blk[QHEAD + v * 64 + c * 4 + i];
                if (a->fmt == Q4_1) s += (byte & 15) * x[4 * v + i] + (byte >> 4) * x[16 + 4 * v + i];
                else s += byte * x[4 * v + i];
            }
        out[c] = s;
    }
}

/* acc += the block's scaled sums (the same epilogue in both builds): d, m the block's scales;
 * xs, xsum, xq128 the row's, broadcast */
INLINE v16 qscale(int fmt, v16 d, v16 m, v16i sums, v16 xs, v16 xsum, v16i xq128, v16 acc) {
    if (fmt == Q4_1) return acc + d * xs * __builtin_convertvector(sums, v16) + m * xsum;
    return acc + d * xs * __builtin_convertvector(sums - xq128, v16);
}

static void qlinear_panels_base(const qlinear_args *a, int64_t p0, int64_t p1) {
    int64_t nb = a->k / QBLOCK, pb = sd_quant_panel_bytes(a->fmt);
    linear_args la = {NULL, NULL, a->bias, a->residual, a->y, a->m, a->k, a->n, a->act};
    for (int64_t p = p0; p < p1; p++)
        for (int64_t r = 0; r < a->m; r++) {
            v16 acc = splat(0.0f);
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = a->w + qblock_at(p, b, nb, pb);
                v16i sums;
                int32_t s[PANEL];
                qblock_base(a, blk, r, b, s);
                memcpy(&sums, s, sizeof sums);
                float d[PANEL], mn[PANEL];
                for (int c = 0; c < PANEL; c++) {
                    uint16_t h[2];
                    memcpy(&h[0], blk + 2 * c, 2);
                    memcpy(&h[1], blk + 32 + 2 * c, 2);
                    d[c] = half_to_float(h[0]);
                    mn[c] = a->fmt == Q4_1 ? half_to_float(h[1]) : 0.0f;
                }
                int32_t q128 = a->xq128[r * nb + b];
                acc = qscale(a->fmt, load16(d), load16(mn), sums, splat(a->xs[r * nb + b]), splat(a->xsum[r * nb + b]),
                             (v16i){q128, q128, q128, q128, q128, q128, q128, q128, q128, q128, q128, q128, q128, q128,
                                    q128, q128}, acc);
            }
            store_panel(&la, r, p, acc);
        }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

/* `rows` rows (1 or 2) against `panels` panels (1 .. QPANELS) from (m0, p0). */
VNNI INLINE void qtile_vnni(const qlinear_args *a, int64_t m0, int64_t p0, const int rows, const int panels,
                            const int fmt) {
    const int64_t k = a->k, nb = k / QBLOCK, pb = sd_quant_panel_bytes(fmt);
    const __m512i low = _mm512_set1_epi8(15);
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
            for (int64_t c = 0; c < pb; c += 64) _mm_prefetch((const char *)blk[p] + QPREFETCH * QPANELS * pb + c, _MM_HINT_T0);
        if (fmt == Q4_1) {
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
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            int64_t at = (m0 + r) * nb + b;
            v16 xs = (v16)_mm512_set1_ps(a->xs[at]), xsum = (v16)_mm512_set1_ps(a->xsum[at]);
            v16i xq128 = (v16i)_mm512_set1_epi32(a->xq128[at]);
#pragma GCC unroll 8
            for (int p = 0; p < panels; p++) {
                v16 d = (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk[p]));
                v16 m = fmt == Q4_1 ? (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk[p] + 32))) : xs;
                acc[r][p] = qscale(fmt, d, m, (v16i)s[r][p], xs, xsum, xq128, acc[r][p]);
            }
        }
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

VNNI static void qlinear_panels_vnni(const qlinear_args *a, int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p += QPANELS) {
        int panels = p1 - p < QPANELS ? (int)(p1 - p) : QPANELS;
        for (int64_t m0 = 0; m0 < a->m; m0 += QMAXR) {
            int rows = a->m - m0 < QMAXR ? (int)(a->m - m0) : QMAXR;
            if (a->fmt == Q4_1) { QTILE_CASE(Q4_1) } else { QTILE_CASE(Q8_0) }
        }
    }
}
#endif

typedef void (*qpanels_fn)(const qlinear_args *, int64_t, int64_t);
static qpanels_fn pick_qpanels(void) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    const char *cap = getenv("SPECDEC_NATIVE_ISA");
    __builtin_cpu_init();
    if ((!cap || !strcmp(cap, "avx512")) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vnni"))
        return qlinear_panels_vnni;
#endif
    return qlinear_panels_base;
}

/* "vnni" or "baseline": the quantised linears' instruction set (the baseline is for tests and
 * machines without it: ~50x slower; specdec prefers llama.cpp's draft there). */
const char *sd_quant_isa(void) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    if (pick_qpanels() == qlinear_panels_vnni) return "vnni";
#endif
    return "baseline";
}


/* Pack a GGUF tensor's blocks, w [n][k / 32 blocks] of Q4_1 (d, m fp16; 16 bytes of nibbles) or
 * Q8_0 (d fp16; 32 int8) as llama.cpp stores them, into panels (above). k must be a multiple of
 * 32 (GGUF's own rule for these types). */
void sd_pack_quant(const uint8_t *w, int64_t n, int64_t k, int fmt, uint8_t *out) {
    int64_t nb = k / QBLOCK, np = (n + PANEL - 1) / PANEL, pb = sd_quant_panel_bytes(fmt);
    int64_t src = fmt == Q4_1 ? 20 : 34; /* GGUF block bytes */
    memset(out, 0, sd_quant_bytes(n, k, fmt)); /* zero columns, the last group's padding: d = m = 0 */
#pragma omp parallel for if (n * k >= (1 << 16))
    for (int64_t p = 0; p < np; p++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *dst = out + qblock_at(p, b, nb, pb);
            for (int64_t c = 0; c < PANEL; c++) {
                int64_t col = p * PANEL + c;
                if (col >= n) continue;
                const uint8_t *blk = w + (col * nb + b) * src;
                memcpy(dst + 2 * c, blk, 2); /* d */
                if (fmt == Q4_1) {
                    memcpy(dst + 32 + 2 * c, blk + 2, 2); /* m */
                    for (int j = 0; j < 16; j++) dst[QHEAD + (j / 4) * 64 + c * 4 + j % 4] = blk[4 + j];
                } else {
                    for (int j = 0; j < 32; j++) dst[QHEAD + (j / 4) * 64 + c * 4 + j % 4] = (uint8_t)(blk[2 + j] ^ 0x80);
                }
            }
        }
}

/* y[m, n] = act(x @ W^T + bias) + residual on W packed by sd_pack_quant. scratch: m * (k + 12 * k / 32)
 * bytes for x's quants, scales and sums. */
void sd_linear_quant(const float *x, int64_t m, int64_t k, const uint8_t *w, int fmt, int64_t n, const float *bias,
                     const float *residual, int act, float *y, uint8_t *scratch) {
    static qpanels_fn run = NULL;
    if (!run) run = pick_qpanels();
    int64_t nb = k / QBLOCK, np = (n + PANEL - 1) / PANEL;
    int8_t *xq = (int8_t *)scratch;
    float *xs = (float *)(scratch + m * k), *xsum = xs + m * nb;
    int32_t *xq128 = (int32_t *)(xsum + m * nb);
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + r * k + b * QBLOCK;
            float amax = 0.0f, sum = 0.0f;
            for (int i = 0; i < QBLOCK; i++) {
                amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
                sum += xb[i];
            }
            float s = amax / 127.0f, inv = s > 0.0f ? 1.0f / s : 0.0f;
            int32_t qsum = 0;
            for (int i = 0; i < QBLOCK; i++) {
                int q = (int)lrintf(xb[i] * inv);
                xq[r * k + b * QBLOCK + i] = (int8_t)q;
                qsum += q;
            }
            xs[r * nb + b] = s;
            xsum[r * nb + b] = sum;
            xq128[r * nb + b] = 128 * qsum;
        }
    qlinear_args a = {xq, xs, xsum, xq128, w, bias, residual, y, m, k, n, act, fmt};
#pragma omp parallel if (m * n * k >= (1 << 15))
    {
        int64_t p0, p1;
        if (thread_panels(np, QPANELS, &p0, &p1)) run(&a, p0, p1);
    }
}

/* ---- A whole decoder stack in one call ----
 *
 * What specdec.runner does between the embedding and the lm_head, layer after layer, with the same
 * kernels in the same order (so the same bits), but without ~7 Python-to-C calls a layer: ~200 a
 * step of a 30-layer model, a few µs each. Llama (gated: RMSNorm, rotary, SwiGLU on a gate/up
 * weight) and GPT-2 (LayerNorm with biases, no rotary, tanh-GELU fused into c_fc). x [T, hidden]
 * is the residual stream (updated in place); on return h holds the final norm of every row. The
 * caller provides the scratch: qkv [T, (heads + 2 kv_heads) d], attn [T, heads d] zeroed (rows
 * outside every segment stay 0), delta [T, hidden], up [T, the up projection's width], act
 * [T, inter] (gated only), and for quantised linears qscratch (sd_linear_quant's, for the widest
 * k). Returns 0, or -1 when attention found no memory. */
typedef struct {
    const void *w;     /* panels (sd_pack_linear) or packed blocks (sd_pack_quant) */
    const float *bias; /* or NULL */
    int64_t n, k;
    int64_t fmt; /* -1: fp32 panels, else the quantised format */
} sd_lin;

typedef struct {
    sd_lin qkv, o, up, down; /* up: gate/up (gated) or c_fc */
    /* the norm after attention, and after the MLP (the next layer's input norm, the final one
     * after the last); biases NULL for RMSNorm */
    const float *ln2_w, *ln2_b, *after_w, *after_b;
} sd_layer;

static void run_linear(const sd_lin *l, const float *x, int64_t m, int act, float *y, uint8_t *qscratch) {
    if (l->fmt < 0) sd_linear(x, m, l->k, (const float *)l->w, l->n, l->bias, NULL, act, y);
    else sd_linear_quant(x, m, l->k, (const uint8_t *)l->w, (int)l->fmt, l->n, l->bias, NULL, act, y, qscratch);
}

int sd_forward_decoder(float *x, int64_t rows, int64_t hidden, const float *ln1_w, const float *ln1_b,
                       const sd_layer *layers, int64_t nlayers, int64_t heads, int64_t kv_heads, int64_t d,
                       int64_t gated, int64_t up_act, const float *cos, const float *sin, const int64_t *segs,
                       int64_t nseg, float scale, float eps, float *h, float *qkv, float *attn, float *delta, float *up,
                       float *act, uint8_t *qscratch) {
    int64_t width = (heads + 2 * kv_heads) * d;
    sd_add_norm(x, NULL, ln1_w, ln1_b, h, rows, hidden, eps);
    for (int64_t i = 0; i < nlayers; i++) {
        const sd_layer *l = layers + i;
        run_linear(&l->qkv, h, rows, 0, qkv, qscratch);
        if (sd_attention(qkv, width, 0, heads * d, (heads + kv_heads) * d, heads, kv_heads, d, cos, sin, segs, nseg, i,
                         scale, attn, heads * d))
            return -1;
        run_linear(&l->o, attn, rows, 0, delta, qscratch);
        sd_add_norm(x, delta, l->ln2_w, l->ln2_b, h, rows, hidden, eps); /* x += attention's projection */
        run_linear(&l->up, h, rows, (int)up_act, up, qscratch);
        if (gated) sd_silu_mul(up, act, rows, l->up.n / 2);
        run_linear(&l->down, gated ? act : up, rows, 0, delta, qscratch);
        sd_add_norm(x, delta, l->after_w, l->after_b, h, rows, hidden, eps); /* x += the MLP's */
    }
    return 0;
}
