/* ---- Attention over per-session KV buffers ----
 *
 * qkv: [T, stride] packed rows; a row holds q (heads * d floats from q_off), k and v (kv_heads * d
 * from k_off, v_off). cos, sin: [T, d] (transformers' rotary: cos and sin repeated over both
 * halves) or NULL (no rotary). segs: [nseg, 5] int64: the address of the session's KV buffer
 * [layers, 2, kv_heads, capacity, d], its capacity, the segment's start position, its rows and
 * its first packed row. out: [T, out_stride], heads * d floats a row; rows outside every segment
 * are not written.
 */
#include "common.h"
#include "kernels.h"

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
         * streams, which the hardware's prefetchers follow late (docs/performance.md, "Keys
         * prefetched") */
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
 * Each query's arithmetic depends on nothing but its own inputs (the contract in kernels.c): its score
 * for key j is q . k_j summed over the head dimension in order (one lane, one FMA per element),
 * its softmax takes the max and the sum over its own keys 0 .. start + row in order (lanes past a
 * query's own keys are set to -inf, then to exactly 0, and are skipped where they would add), and
 * its output sums p_j v_j over those keys in order. Which other queries share its vector, and how
 * many, changes no bit. */
/* Tile sizes by the vector registers there are: a v16 is one register with AVX-512 (32 of them),
 * two with AVX2 (16): eight keys' scores, or four queries by four vectors of values, would spill
 * there (docs/performance.md, "Two code-generation faults on AVX2"). Which tiles change no bit:
 * every lane is summed in the same order whatever the tile. */
static int wide_registers(void) {
    static int wide = -1;
    if (wide < 0) wide = __builtin_cpu_supports("avx512f") ? 1 : 0;
    return wide;
}

/* attend_group's queries [q0, q0 + nq) of KV head g (`group` query heads a KV head, the segment
 * from position `start`): each one's output row (outs), its keys 0 .. start + row (limit, and as
 * int32 in lims; 0 in the lanes past nq), and qt, the queries transposed: qt[e] holds element e
 * of each, scaled (0 in the unused lanes). Returns the most keys any of them sees. */
INLINE int64_t group_queries(const attn_args *a, const int64_t *seg, int64_t g, int64_t q0, int nq, int64_t group,
                             int64_t start, float *qt, int64_t *limit, int32_t *lims, float **outs) {
    const int64_t d = a->d;
    int64_t keys = 0;
    const float *qs[16];
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
    for (int64_t e = 0; e < d; e++) {
        float col[16];
        for (int i = 0; i < 16; i++) col[i] = qs[i] ? qs[i][e] * a->scale : 0.0f;
        memcpy(qt + e * 16, col, sizeof col);
    }
    return keys;
}

/* The scores of keys [0, keys), key j's in st[j * 16 ..]: the tiles, then one key at a time. */
INLINE void scores_pass(const float *k, int64_t d, const float *qt, float *st, int64_t keys, int wide) {
    int64_t j = wide ? scores_tile(k, d, qt, st, keys, 8) : scores_narrow(k, d, qt, st, keys);
    for (; j < keys; j++) {
        v16 s0 = {0};
        for (int64_t e = 0; e < d; e++) s0 += load16(qt + e * 16) * bcast(k[j * d + e]);
        store16(st + j * 16, s0);
    }
}

/* Softmax per lane over its own keys, in place in st: max, then exp and the sum in order (lanes
 * past a query's keys -inf, then exactly 0); each lane's sum into sums. */
INLINE void softmax_lanes(float *st, int64_t keys, const int32_t *lims, float *sums) {
    for (int h = 0; h < 2; h++) { /* in halves of 8 lanes (see wide_registers) */
        v8i lim8;
        memcpy(&lim8, lims + 8 * h, sizeof lim8);
        const v8 ninf = splat8(-INFINITY);
        v8 mx = ninf;
        for (int64_t j = 0; j < keys; j++) {
            v8i seen = (v8i){0} + (int32_t)j < lim8;
            v8 s = (v8)((seen & (v8i)load8(st + j * 16 + 8 * h)) | (~seen & (v8i)ninf));
            store8(st + j * 16 + 8 * h, s);
            mx = vmax8(mx, s);
        }
        mx = (v8)(((v8i){0} < lim8) & (v8i)mx); /* unused lanes: 0, not -inf (no inf - inf) */
        v8 sum = {0};
        for (int64_t j = 0; j < keys; j++) {
            v8i seen = (v8i){0} + (int32_t)j < lim8;
            v8 p = (v8)(seen & (v8i)vexp8(load8(st + j * 16 + 8 * h) - mx));
            store8(st + j * 16 + 8 * h, p);
            sum += p;
        }
        memcpy(sums + 8 * h, &sum, sizeof sum);
    }
}

/* The value pass: Q queries and up to W vectors of the head dimension at a time (AVX-512: 4 x 4,
 * AVX2: 4 x 1 in halves; its d % 16 tail one float at a time, in the same order). */
INLINE void values_pass(const float *v, int64_t d, const float *st, int nq, const int64_t *limit, float *const *outs,
                        const float *sums, int wide) {
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
            for (int64_t j = 0; j < limit[i]; j++) o += st[j * 16 + i] * v[j * d + e];
            outs[i][e] = o / sums[i];
        }
}

CLONES static void attend_group(const attn_args *a, const int64_t *seg, int64_t g, int64_t q0, int nq, float *qt,
                                float *st) {
    const int64_t d = a->d, group = a->heads / a->kv_heads, start = seg[2];
    const float *k = kv_at(a, seg, 0, g), *v = kv_at(a, seg, 1, g);
    int64_t limit[16];
    float *outs[16];
    int32_t lims[16];
    int64_t keys = group_queries(a, seg, g, q0, nq, group, start, qt, limit, lims, outs);
    const int wide = wide_registers();
    scores_pass(k, d, qt, st, keys, wide);
    float sums[16];
    softmax_lanes(st, keys, lims, sums);
    values_pass(v, d, st, nq, limit, outs, sums, wide);
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
