/* The fp32 kernels' entry points (rowwise.c, attention.c, linear.c), which kernels.c's decoder
 * stack calls in the order specdec.model.runner does; specdec.native loads each by its name. */
#pragma once
#include <stdint.h>

void sd_add_norm(float *x, const float *delta, const float *w, const float *b, float *out, int64_t rows, int64_t n,
                 float eps);
void sd_silu_mul(const float *gu, float *out, int64_t rows, int64_t inter);
int sd_attention(float *qkv, int64_t stride, int64_t q_off, int64_t k_off, int64_t v_off, int64_t heads,
                 int64_t kv_heads, int64_t d, const float *cos, const float *sin, const int64_t *segs, int64_t nseg,
                 int64_t layer, float scale, float *out, int64_t out_stride);
void sd_pack_linear(const float *w, int64_t n, int64_t k, float *panels);
const char *sd_linear_isa(void);
void sd_linear(const float *x, int64_t m, int64_t k, const float *panels, int64_t n, const float *bias,
               const float *residual, int act, float *y);
