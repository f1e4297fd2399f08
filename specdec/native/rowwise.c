/* The row-wise kernels: the residual add and norm, the SwiGLU gate. Each row is one thread's, in
 * one fixed order (the contract in kernels.c). */
#include "common.h"
#include "kernels.h"

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
