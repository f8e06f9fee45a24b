/*
 * attn_kv_ref.c — the scalar reference of attention over quantized and mixed-format KV pages
 * (attn_kv.h). Rows are decoded element by element with the definitions of attn_kv.h and dotted
 * in plain float loops; the AVX2 and AVX-512 builds are tested against this one.
 */
#include "kernels/cpu/attn_kv.h"

static void kn_kv_row_ref(kn_kv_format f, const kn_kv_blk *b, int t, int hd, int v, float *row)
{
    kn_kv_row_tail(f, b, t, hd, v, 0, row);
}

static float kn_kv_dot_ref(const float *a, const float *b, int n)
{
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static void kn_kv_axpy_ref(float *y, float a, const float *x, int n)
{
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

void kn_attention_kv_ref(const kn_kv_view *kv, int head_dim, const float *q, int n_q, float scale,
                         float *out)
{
    kn_attn_kv_body(kv, head_dim, q, n_q, scale, out, kn_kv_row_ref, kn_kv_dot_ref, kn_kv_axpy_ref);
}
