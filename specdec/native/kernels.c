/* specdec's native kernels: the per-layer work of a decoder forward between its linears.
 *
 * A decoder step's work outside the weights is ~20 small torch ops a layer (norms, rotary, the KV
 * write, attention, the MLP's gate), each mostly dispatch around little arithmetic
 * (docs/performance.md, "The target step at the floor"). These kernels do that work in three calls
 * a layer (or one call for all the layers: sd_forward_decoder, below), on fp32 tensors laid out as
 * specdec.runner lays them out. The library's parts: rowwise.c (the residual add and norm, the
 * SwiGLU gate), attention.c (rotary, the KV write, attention), linear.c (the fp32 linears on
 * panel-packed weights), quant.c and q4_0.c ... q6_k.c (the quantised linears, quant.h), and this
 * file (the decoder stack); kernels.h and quant.h declare what the stack calls.
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
#include "kernels.h"
#include "quant.h"

/* ---- A whole decoder stack in one call ----
 *
 * What specdec.runner does between the embedding and the lm_head, layer after layer, with the same
 * kernels in the same order (so the same bits), but without ~7 Python-to-C calls a layer
 * (docs/performance.md, "One call a step"). Llama (gated: RMSNorm, rotary, SwiGLU on a gate/up
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
