/* ---- Linear layers on panel-packed weights ----
 *
 * y[M, N] = act(x[M, K] @ W^T + bias) + residual. W [N, K] is packed once (sd_pack_linear) into
 * panels of 16 output columns, each K x 16 floats laid out k-major (the last panel zero-padded),
 * so a pass streams every weight once, sequentially. Each output (m, n) is one vector lane summed
 * over k = 0 .. K-1 in order, one FMA a k: the same additions for a row alone or among any other
 * rows, in any tile shape, on any thread (the contract in kernels.c). Threads split the panels.
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
 * Why: docs/performance.md, "The target step at the floor"; what each choice measured against the
 * others: docs/benchmarks.md, "The 17-row verify".
 */
#include "common.h"
#include "kernels.h"

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
 * (measured against halves and a barrier: docs/benchmarks.md, "x transposed for the column
 * passes"). */
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
