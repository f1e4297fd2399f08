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
#include "common.h"
#include "quant.h"

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

#define KEYS_AHEAD 16 /* keys the score pass prefetches ahead */

/* The value pass for queries [c, c + Q) (lanes; the unused ones hold p = 0) and vectors
 * [e0, e0 + W) of the head dimension: acc = sum_j p_j v_j over each query's own keys in order. */
INLINE void values_tile(const float *v, int64_t d, int64_t e0, const int Q, const int W, const float *st, int c,
                        const int64_t *limit, float *const *outs, int nq, const float *sums) {
    v16 acc[4][4] = {{{0}}};
    int64_t common = INT64_MAX, most = 0;
    for (int i = c; i < c + Q && i < nq; i++) {
        common = limit[i] < common ? limit[i] : common;
        most = limit[i] > most ? limit[i] : most;
    }
    int64_t j = 0;
    for (; j < common; j++) { /* every query of the chunk sees key j */
        const float *vj = v + j * d + e0 * 16;
        v16 vv[4];
        for (int b = 0; b < W; b++) vv[b] = load16(vj + b * 16);
        for (int i = 0; i < Q; i++) {
            v16 p = bcast(st[j * 16 + c + i]);
            for (int b = 0; b < W; b++) acc[i][b] += p * vv[b];
        }
    }
    for (; j < most; j++) { /* the causal edge: only the queries that see key j add it */
        const float *vj = v + j * d + e0 * 16;
        for (int i = 0; i < Q; i++)
            if (c + i < nq && j < limit[c + i]) {
                v16 p = bcast(st[j * 16 + c + i]);
                for (int b = 0; b < W; b++) acc[i][b] += p * load16(vj + b * 16);
            }
    }
    for (int i = 0; i < Q && c + i < nq; i++)
        for (int b = 0; b < W; b++) store16(outs[c + i] + (e0 + b) * 16, acc[i][b] / splat(sums[c + i]));
}

/* values_tile for four queries and one vector (e0) in halves: the AVX2 form (see wide_registers). */
INLINE void values_narrow(const float *v, int64_t d, int64_t e0, const float *st, int c, const int64_t *limit,
                          float *const *outs, int nq, const float *sums) {
    v8 acc[4][2] = {{{0}}};
    int64_t common = INT64_MAX, most = 0;
    for (int i = c; i < c + 4 && i < nq; i++) {
        common = limit[i] < common ? limit[i] : common;
        most = limit[i] > most ? limit[i] : most;
    }
    int64_t j = 0;
    for (; j < common; j++) {
        const float *vj = v + j * d + e0 * 16;
        v8 v0 = load8(vj), v1 = load8(vj + 8);
        for (int i = 0; i < 4; i++) {
            v8 p = bcast8(st[j * 16 + c + i]);
            acc[i][0] += p * v0;
            acc[i][1] += p * v1;
        }
    }
    for (; j < most; j++) {
        const float *vj = v + j * d + e0 * 16;
        for (int i = 0; i < 4; i++)
            if (c + i < nq && j < limit[c + i]) {
                v8 p = bcast8(st[j * 16 + c + i]);
                acc[i][0] += p * load8(vj);
                acc[i][1] += p * load8(vj + 8);
            }
    }
    for (int i = 0; i < 4 && c + i < nq; i++) {
        v8 s = (v8){} + sums[c + i];
        store8(outs[c + i] + e0 * 16, acc[i][0] / s);
        store8(outs[c + i] + e0 * 16 + 8, acc[i][1] / s);
    }
}

/* scores_tile in halves, four keys at a time (AVX2: eight accumulators of 16). */
INLINE int64_t scores_narrow(const float *k, int64_t d, const float *qt, float *st, int64_t keys) {
    int64_t j = 0;
    for (; j + 4 <= keys; j += 4) {
        const float *k0 = k + j * d;
        if (j + KEYS_AHEAD + 4 <= keys)
            for (int64_t f = 0; f < 4 * d; f += 16) __builtin_prefetch(k0 + KEYS_AHEAD * d + f, 0, 3);
        v8 s[4][2] = {{{0}}};
        for (int64_t e = 0; e < d; e++) {
            v8 q0 = load8(qt + e * 16), q1 = load8(qt + e * 16 + 8);
            for (int i = 0; i < 4; i++) {
                v8 b = bcast8(k0[i * d + e]);
                s[i][0] += q0 * b;
                s[i][1] += q1 * b;
            }
        }
        for (int i = 0; i < 4; i++) {
            store8(st + (j + i) * 16, s[i][0]);
            store8(st + (j + i) * 16 + 8, s[i][1]);
        }
    }
    for (; j < keys; j++) {
        v8 s0 = {0}, s1 = {0};
        for (int64_t e = 0; e < d; e++) {
            v8 b = bcast8(k[j * d + e]);
            s0 += load8(qt + e * 16) * b;
            s1 += load8(qt + e * 16 + 8) * b;
        }
        store8(st + j * 16, s0);
        store8(st + j * 16 + 8, s1);
    }
    return j;
}

/* The score pass: keys [j0, keys) against the transposed queries, KEYS keys at a time (KEYS FMA
 * chains in flight), each lane summed over e in order; the rest one key at a time. */
INLINE int64_t scores_tile(const float *k, int64_t d, const float *qt, float *st, int64_t keys, const int KEYS) {
    int64_t j = 0;
    for (; j + KEYS <= keys; j += KEYS) {
        const float *k0 = k + j * d;
        /* the keys KEYS_AHEAD on, a line every 16 floats: the keys are read in KEYS strided
         * streams, which the hardware's prefetchers follow late (decode attention over 1,000
         * cached tokens: 2.1-2.9 ms a step against 2.7-4.0 without) */
        if (j + KEYS_AHEAD + KEYS <= keys)
            for (int64_t f = 0; f < KEYS * d; f += 16) __builtin_prefetch(k0 + KEYS_AHEAD * d + f, 0, 3);
        v16 s[8] = {{0}};
        for (int64_t e = 0; e < d; e++) {
            v16 qv = load16(qt + e * 16);
            for (int i = 0; i < KEYS; i++) s[i] += qv * bcast(k0[i * d + e]);
        }
        for (int i = 0; i < KEYS; i++) store16(st + (j + i) * 16, s[i]);
    }
    return j;
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
/* Tile sizes by the vector registers there are: a v16 is one register with AVX-512 (32 of them),
 * two with AVX2 (16): eight keys' scores, or four queries by four vectors of values, would spill
 * there (measured on a 2-core Zen 3: attention over 1,000 cached tokens 1.0 ms a layer with the
 * AVX-512 tiles, 13x what the arithmetic needs). Which tiles change no bit: every lane is summed
 * in the same order whatever the tile. */
static int wide_registers(void) {
    static int wide = -1;
    if (wide < 0) wide = __builtin_cpu_supports("avx512f") ? 1 : 0;
    return wide;
}

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
    for (int64_t e = 0; e < d; e++) { /* the queries transposed: qt[e] holds element e of each, scaled */
        float col[16];
        for (int i = 0; i < 16; i++) col[i] = qs[i] ? qs[i][e] * a->scale : 0.0f;
        memcpy(qt + e * 16, col, sizeof col);
    }
    /* scores, key j in st[j * 16 ..] */
    const int wide = wide_registers();
    int64_t j = wide ? scores_tile(k, d, qt, st, keys, 8) : scores_narrow(k, d, qt, st, keys);
    for (; j < keys; j++) {
        v16 s0 = {0};
        for (int64_t e = 0; e < d; e++) s0 += load16(qt + e * 16) * bcast(k[j * d + e]);
        store16(st + j * 16, s0);
    }
    float sums[16];
    /* softmax per lane over its own keys: max, then exp and the sum in order (lanes past a
     * query's keys -inf, then exactly 0) */
    for (int h = 0; h < 2; h++) { /* in halves of 8 lanes (see wide_registers) */
        v8i lim8;
        memcpy(&lim8, lims + 8 * h, sizeof lim8);
        const v8 ninf = splat8(-INFINITY);
        v8 mx = ninf;
        for (j = 0; j < keys; j++) {
            v8i seen = (v8i){0} + (int32_t)j < lim8;
            v8 s = (v8)((seen & (v8i)load8(st + j * 16 + 8 * h)) | (~seen & (v8i)ninf));
            store8(st + j * 16 + 8 * h, s);
            mx = vmax8(mx, s);
        }
        mx = (v8)(((v8i){0} < lim8) & (v8i)mx); /* unused lanes: 0, not -inf (no inf - inf) */
        v8 sum = {0};
        for (j = 0; j < keys; j++) {
            v8i seen = (v8i){0} + (int32_t)j < lim8;
            v8 p = (v8)(seen & (v8i)vexp8(load8(st + j * 16 + 8 * h) - mx));
            store8(st + j * 16 + 8 * h, p);
            sum += p;
        }
        memcpy(sums + 8 * h, &sum, sizeof sum);
    }
    /* values, Q queries and up to W vectors of the head dimension at a time (AVX-512: 4 x 4,
     * AVX2: 4 x 1 in halves; its d % 16 tail one float at a time, in the same order) */
    int64_t nv = d / 16, d16 = nv * 16;
    if (wide) {
        for (int64_t e0 = 0; e0 < nv; e0 += 4)
            for (int c = 0; c < nq; c += 4) switch (nv - e0 < 4 ? nv - e0 : 4) {
                case 4: values_tile(v, d, e0, 4, 4, st, c, limit, outs, nq, sums); break;
                case 3: values_tile(v, d, e0, 4, 3, st, c, limit, outs, nq, sums); break;
                case 2: values_tile(v, d, e0, 4, 2, st, c, limit, outs, nq, sums); break;
                default: values_tile(v, d, e0, 4, 1, st, c, limit, outs, nq, sums); break;
                }
    } else {
        for (int64_t e0 = 0; e0 < nv; e0++)
            for (int c = 0; c < nq; c += 4) values_narrow(v, d, e0, st, c, limit, outs, nq, sums);
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
    int64_t fmt; /* -1: fp32 panels, -2: parts of several formats (parts), else the quantised format */
    const int64_t *parts; /* fmt -2: sd_linear_quant_parts' table of nparts parts */
    int64_t nparts;
} sd_lin;

typedef struct {
    sd_lin qkv, o, up, down; /* up: gate/up (gated) or c_fc */
    /* the norm after attention, and after the MLP (the next layer's input norm, the final one
     * after the last); biases NULL for RMSNorm */
    const float *ln2_w, *ln2_b, *after_w, *after_b;
} sd_layer;

static void run_linear(const sd_lin *l, const float *x, int64_t m, int act, float *y, uint8_t *qscratch) {
    if (l->fmt == -1) sd_linear(x, m, l->k, (const float *)l->w, l->n, l->bias, NULL, act, y);
    else if (l->fmt == -2)
        sd_linear_quant_parts(x, m, l->k, (const uint8_t *)l->w, l->parts, l->nparts, l->n, l->bias, NULL, act, y,
                              qscratch);
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
