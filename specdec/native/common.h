/* What specdec's native kernels share: vector types, element-wise helpers, a linear's output
 * epilogue and the threads' split of panels (the fp32 kernels, quant.c and the format files). */
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
/* Half a v16, for loops whose v16 accumulators would not fit AVX2's 16 registers: GCC keeps an
 * array of v16 wider than the target's registers in memory, and splits every operation on it. */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

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

INLINE v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
INLINE void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }
INLINE v8 bcast8(float f) { return __builtin_shuffle((v8){f}, (v8i){0}); }

/* The sum of a vector's 16 lanes, always in the same tree. */
INLINE float hsum(v16 a) {
    float s[16];
    memcpy(s, &a, sizeof s);
    float t[8], u[4];
    for (int i = 0; i < 8; i++) t[i] = s[i] + s[i + 8];
    for (int i = 0; i < 4; i++) u[i] = t[i] + t[i + 4];
    return (u[0] + u[2]) + (u[1] + u[3]);
}

INLINE v8 splat8(float f) { return (v8){f, f, f, f, f, f, f, f}; }

/* vmax, vmin and vexp of a vector type V (integers VI, broadcast S): the v16 ones, and the
 * v8 ones (suffix 8) for the loops kept in halves. */
#define SD_VECTOR_MATH(SUFFIX, V, VI, S)                                                            \
    INLINE V vmax##SUFFIX(V a, V b) { VI m = a > b; return (V)((m & (VI)a) | (~m & (VI)b)); }      \
    INLINE V vmin##SUFFIX(V a, V b) { VI m = a < b; return (V)((m & (VI)a) | (~m & (VI)b)); }      \
    /* e^x, |relative error| < 2e-7 over the float range: 2^n * e^r, r = x - n ln2 in           \
     * [-ln2/2, ln2/2], e^r by its Taylor polynomial to r^7 (Horner). Below -87.3 it returns      \
     * ~1e-38, not 0. */                                                                        \
    INLINE V vexp##SUFFIX(V x) {                                                                \
        x = vmin##SUFFIX(vmax##SUFFIX(x, S(-87.3f)), S(88.7f));                                 \
        const V shifter = S(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */       \
        V n = (x * S(1.44269504088896341f) + shifter) - shifter;                                \
        V r = (x - n * S(0.693359375f)) - n * S(-2.12194440e-4f);                               \
        V p = S(1.0f / 5040);                                                                   \
        p = p * r + S(1.0f / 720);                                                              \
        p = p * r + S(1.0f / 120);                                                              \
        p = p * r + S(1.0f / 24);                                                               \
        p = p * r + S(1.0f / 6);                                                                \
        p = p * r + S(0.5f);                                                                    \
        p = p * r + S(1.0f);                                                                    \
        p = p * r + S(1.0f);                                                                    \
        VI bits = (__builtin_convertvector(n, VI) + 127) << 23;                                 \
        return p * (V)bits;                                                                     \
    }
SD_VECTOR_MATH(, v16, v16i, splat)
SD_VECTOR_MATH(8, v8, v8i, splat8)

INLINE float sexp(float x) {
    v16 v = vexp(splat(x));
    return v[0];
}

#define PANEL 16

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

/* This OpenMP thread's share [p0, p1) of np panels: whole tiles of `step` panels each, the last
 * thread takes the rest. False when it has none. */
INLINE int thread_panels(int64_t np, int64_t step, int64_t *p0, int64_t *p1) {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t per = (np / nt + step - 1) / step * step;
    *p0 = t * per < np ? t * per : np;
    *p1 = t == nt - 1 ? np : (*p0 + per < np ? *p0 + per : np);
    return *p0 < *p1;
}

