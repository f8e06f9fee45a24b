/*
 * ops_ref.c — the scalar reference of every non-matmul kernel (RMS norm, RoPE, SwiGLU, add,
 * f16 conversions, paged attention) and the public scalar conversions of kernels.h.
 *
 * These loops are the definition the AVX2 and AVX-512 builds are tested against, so they are
 * written to be obviously right rather than fast, and they follow llama.cpp's CPU back end
 * (ggml-cpu/ops.cpp) operation for operation where the order of rounding matters:
 *  - rmsnorm sums float squares in double (ggml_float), then scale = 1/sqrtf(mean + eps) in float;
 *  - the RoPE cache advances theta by repeated float multiplication, as ggml_rope_cache_init does;
 *  - f32 -> f16 rounds to nearest even and treats NaN exactly as the F16C instruction does (sign,
 *    quiet bit, top payload bits kept), which is what ggml uses on every x86 with F16C;
 *  - f32 -> bf16 is ggml_compute_fp32_to_bf16 (round to nearest even, NaN forced quiet).
 * Attention is the one place we define our own numerics: a float online softmax over the
 * sequence's pages, read in place (no copy of the context, no allocation). Views in other
 * formats, mixed-format views and views that ask for attn_mass go to attn_kv_ref.c.
 */
#include <assert.h>
#include <math.h>
#include <string.h>

#include "kernels/cpu/internal.h"
#include "kernels/cpu/attn_kv.h"

static inline uint32_t kn_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float kn_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ---------------------------------------------------------------- scalar conversions */

float kn_f16_to_f32(kn_f16 h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0x1f) /* inf, or NaN made quiet with its payload kept */
        return kn_bits_f32(sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0));
    if (e == 0) {
        if (m == 0) return kn_bits_f32(sign);
        /* Subnormal half: normalise. m * 2^-24 with m < 2^10. */
        e = 113; /* biased float exponent of 2^-14 */
        while (!(m & 0x400)) {
            m <<= 1;
            e--;
        }
        return kn_bits_f32(sign | (e << 23) | ((m & 0x3ff) << 13));
    }
    return kn_bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

kn_f16 kn_f32_to_f16(float f)
{
    uint32_t x = kn_f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return sign | 0x7e00 | ((ax >> 13) & 0x3ff); /* NaN */
    if (ax >= 0x477ff000u) return sign | 0x7c00; /* >= 65520 rounds to infinity */
    if (ax >= 0x38800000u) {                     /* normal half: >= 2^-14 */
        uint32_t m = ax - 0x38000000u;           /* rebias 127 -> 15 */
        m += 0xfff + ((m >> 13) & 1);            /* round to nearest even; may carry into e */
        return sign | (uint16_t)(m >> 13);
    }
    if (ax <= 0x33000000u) return sign; /* <= 2^-25: ties to even, i.e. zero */
    /* Subnormal half: k * 2^-24, k = mant * 2^(e-126) rounded to nearest even. */
    uint32_t e = ax >> 23, mant = (ax & 0x7fffff) | 0x800000;
    uint32_t s = 126 - e; /* 14 .. 24 */
    uint32_t k = mant >> s, rem = mant & ((1u << s) - 1), half = 1u << (s - 1);
    if (rem > half || (rem == half && (k & 1))) k++;
    return sign | (uint16_t)k;
}

float kn_bf16_to_f32(kn_bf16 h)
{
    return kn_bits_f32((uint32_t)h << 16);
}

kn_bf16 kn_f32_to_bf16(float f)
{
    uint32_t u = kn_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (kn_bf16)((u >> 16) | 64); /* NaN: force quiet */
    return (kn_bf16)((u + (0x7fff + ((u >> 16) & 1))) >> 16);
}

void kn_f32_to_f16_ref(const float *x, kn_f16 *y, int64_t n)
{
    for (int64_t i = 0; i < n; i++) y[i] = kn_f32_to_f16(x[i]);
}

void kn_f16_to_f32_ref(const kn_f16 *x, float *y, int64_t n)
{
    for (int64_t i = 0; i < n; i++) y[i] = kn_f16_to_f32(x[i]);
}

/* ---------------------------------------------------------------- element-wise */

void kn_rmsnorm_ref(float *y, const float *x, const float *w, int n, float eps)
{
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += (double)(x[i] * x[i]);
    const float mean = (float)(sum / n);
    const float scale = 1.0f / sqrtf(mean + eps);
    for (int i = 0; i < n; i++) y[i] = x[i] * scale * w[i];
}

void kn_rope_cache(float *cs, int n_rot, int pos, float freq_base)
{
    const float theta_scale = powf(freq_base, -2.0f / (float)n_rot);
    float theta = (float)pos;
    for (int i = 0; i < n_rot / 2; i++) {
        cs[2 * i + 0] = cosf(theta);
        cs[2 * i + 1] = sinf(theta);
        theta *= theta_scale;
    }
}

void kn_rope_ref(float *x, int n_heads, int head_dim, int n_rot, const float *cs, int neox)
{
    assert(n_rot % 2 == 0 && n_rot <= head_dim);
    const int half = n_rot / 2;
    for (int h = 0; h < n_heads; h++) {
        float *v = x + (size_t)h * head_dim;
        for (int i = 0; i < half; i++) {
            const float c = cs[2 * i], s = cs[2 * i + 1];
            float *a = neox ? &v[i] : &v[2 * i];
            float *b = neox ? &v[i + half] : &v[2 * i + 1];
            const float x0 = *a, x1 = *b;
            *a = x0 * c - x1 * s;
            *b = x0 * s + x1 * c;
        }
    }
}

void kn_silu_mul_ref(float *y, const float *g, const float *u, int n)
{
    for (int i = 0; i < n; i++) y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

void kn_add_ref(float *y, const float *x, int n)
{
    for (int i = 0; i < n; i++) y[i] += x[i];
}

/* ---------------------------------------------------------------- attention */

/* Scores are computed this many tokens at a time (bounded stack, any page size). */
#define KN_REF_CHUNK 64

static inline float kn_kv_elem(const uint8_t *blk, size_t i, kn_kv_format f)
{
    uint16_t h;
    memcpy(&h, blk + 2 * i, 2);
    return f == KN_KV_BF16 ? kn_bf16_to_f32(h) : kn_f16_to_f32(h);
}

void kn_attention_ref(const kn_kv_view *kv, int head_dim, const float *q, int n_q, float scale,
                      float *out)
{
    /* fp8/int8/int4 pages, mixed-format views and views that want attn_mass: attn_kv_ref.c */
    if (kn_attention_kv_wants(kv)) {
        kn_attention_kv_ref(kv, head_dim, q, n_q, scale, out);
        return;
    }
    const kn_kv_format fmt = kv->format;
    const int pt = kv->page_tokens, hd = head_dim;
    assert(pt > 0 && hd > 0 && n_q > 0 && kv->n_ctx >= 0);
    assert(q != out);
    assert(fmt == KN_KV_F16 || fmt == KN_KV_BF16);
    memset(out, 0, sizeof(float) * (size_t)n_q * hd);
    if (kv->n_ctx == 0) return;

    for (int h = 0; h < n_q; h++) {
        const float *qh = q + (size_t)h * hd;
        float *o = out + (size_t)h * hd;
        float m = -INFINITY, l = 0.0f;
        float s[KN_REF_CHUNK];
        for (int t0 = 0; t0 < kv->n_ctx; t0 += pt) {
            const uint8_t *page = kv->pages[t0 / pt];
            const uint8_t *kb = page + kv->k_off, *vb = page + kv->v_off;
            const int np = kv->n_ctx - t0 < pt ? kv->n_ctx - t0 : pt;
            for (int c0 = 0; c0 < np; c0 += KN_REF_CHUNK) {
                const int nc = np - c0 < KN_REF_CHUNK ? np - c0 : KN_REF_CHUNK;
                /* s[t] = scale * q·k_t; the chunk's maximum joins the running one. */
                float mc = m;
                for (int t = 0; t < nc; t++) {
                    const size_t row = (size_t)(c0 + t) * hd;
                    float dot = 0.0f;
                    for (int d = 0; d < hd; d++) dot += qh[d] * kn_kv_elem(kb, row + d, fmt);
                    s[t] = scale * dot;
                    if (s[t] > mc) mc = s[t];
                }
                /* Rescale what was accumulated under the old maximum. */
                if (mc > m) {
                    const float corr = expf(m - mc);
                    l *= corr;
                    for (int d = 0; d < hd; d++) o[d] *= corr;
                    m = mc;
                }
                for (int t = 0; t < nc; t++) {
                    const size_t row = (size_t)(c0 + t) * hd;
                    const float p = expf(s[t] - m);
                    l += p;
                    for (int d = 0; d < hd; d++) o[d] += p * kn_kv_elem(vb, row + d, fmt);
                }
            }
        }
        for (int d = 0; d < hd; d++) o[d] /= l;
    }
}

/* The definition of attention_multi: one call of attention per token, each over its prefix. */
void kn_attention_multi_ref(const kn_kv_view *kv, int head_dim, const float *q, size_t q_stride,
                            int n_tok, int n_q, float scale, float *out, size_t out_stride)
{
    assert(n_tok >= 1 && kv->n_ctx >= n_tok - 1);
    for (int t = 0; t < n_tok; t++) {
        kn_kv_view w = *kv;
        w.n_ctx = kv->n_ctx - (n_tok - 1 - t);
        kn_attention_ref(&w, head_dim, q + t * q_stride, n_q, scale, out + t * out_stride);
    }
}
