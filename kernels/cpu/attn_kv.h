/*
 * attn_kv.h — attention over quantized and mixed-format KV pages (kvshard's fp8, int8, int4, and
 * sequences whose pages differ in format after a live conversion). Private to kernels/.
 *
 * kn_attention_X (ops_X.c) hands a view here when kn_attention_kv_wants() says so; plain f16/bf16
 * views never come here, so the engine's default numerics do not depend on this file.
 *
 * Block layouts, for one (page, layer, kv head), offsets from the view:
 *   f16/bf16  K and V: [page_tokens][head_dim] 2-byte elements
 *   fp8       K and V: [page_tokens][head_dim] E4M3 bytes (bias 7, max 448, no inf);
 *             k_scale/v_scale: [page_tokens][head_dim / g] f16, g = 16 when head_dim % 16 == 0,
 *             else head_dim; x = e4m3(q) * scale of its group
 *   int8      K and V: [page_tokens][head_dim] signed bytes; scales as fp8; x = q * scale of its
 *             group
 *   int4      K and V: [page_tokens][head_dim / 2] bytes, low nibble = even channel;
 *             k_scale: f16 scale[head_dim] then f16 min[head_dim] (per channel over the page);
 *             v_scale: [page_tokens][head_dim / g] pairs of f16 (scale, min), g = 32 when
 *             head_dim % 32 == 0, else head_dim; x = n * scale + min
 * kvshard/format.c writes exactly these; tests/unit/test_kvshard_format.c checks the two agree.
 *
 * The general kernel decodes one K or V row at a time into a row of floats on the stack (never
 * a copy of the context) and runs the same online softmax as the f16 kernel; the row decoders
 * are the only part that differs between the reference and the SIMD builds, which all share the
 * body below (inlined with their own decoders, dot and axpy). The SIMD builds also have a fast
 * path for the common case, single-format fp8 or int8 views with head_dim % 16 == 0 and no
 * attn_mass: the f16 kernel's blocked structure (several rows per step, vector expf) with the
 * rows decoded in registers (attn_kv_avx2.c, attn_kv_avx512.c).
 */
#ifndef KN_CPU_ATTN_KV_H
#define KN_CPU_ATTN_KV_H

#include <math.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

#include "kernels/kernels.h"

#define KN_KV_MAX_HD 1024 /* largest head_dim the kernels accept */
#define KN_KV_HG     16   /* query heads processed together */
#define KN_KV_CH     32   /* tokens scored per chunk */

void kn_attention_kv_ref(const kn_kv_view *kv, int head_dim, const float *q, int n_q, float scale,
                         float *out);
void kn_attention_kv_avx2(const kn_kv_view *kv, int head_dim, const float *q, int n_q, float scale,
                          float *out);
void kn_attention_kv_avx512(const kn_kv_view *kv, int head_dim, const float *q, int n_q,
                            float scale, float *out);
/* The SIMD builds' blocked attention (attn_simd.h): serves single-format f16, bf16, fp8 and int8
 * views without attn_mass whose head_dim it takes, and returns 0 for any other. */
int kn_att_fast_avx2(const kn_kv_view *kv, int head_dim, const float *q, int n_q, float scale,
                     float *out);
int kn_att_fast_avx512(const kn_kv_view *kv, int head_dim, const float *q, int n_q, float scale,
                       float *out);

/* Views the f16/bf16 kernels must hand here. */
static inline int kn_attention_kv_wants(const kn_kv_view *kv)
{
    return (kv->format != KN_KV_F16 && kv->format != KN_KV_BF16) || kv->page_formats ||
           kv->attn_mass;
}

/* Where one page's blocks are. */
typedef struct kn_kv_blk {
    const uint8_t *k, *v, *ks, *vs;
} kn_kv_blk;

static inline kn_kv_format kn_kv_block(const kn_kv_view *kv, int page, kn_kv_blk *b)
{
    const uint8_t *p = kv->pages[page];
    if (kv->page_formats) {
        kn_kv_format f = (kn_kv_format)kv->page_formats[page];
        const size_t *o = kv->fmt_offs + 4 * (size_t)f;
        *b = (kn_kv_blk){p + o[0], p + o[1], p + o[2], p + o[3]};
        return f;
    }
    *b = (kn_kv_blk){p + kv->k_off, p + kv->v_off, p + kv->k_scale_off, p + kv->v_scale_off};
    return kv->format;
}

static inline int kn_kv_int4_vgroup(int hd)
{
    return hd % 32 == 0 ? 32 : hd;
}
/* Channels per scale of an fp8 or int8 row. */
static inline int kn_kv_group(int hd)
{
    return hd % 16 == 0 ? 16 : hd;
}

static inline float kn_kv_h2f(const uint8_t *p)
{
    kn_f16 h;
    memcpy(&h, p, 2);
#ifdef __F16C__ /* the SIMD builds: one instruction, bit-identical to kn_f16_to_f32 */
    return _cvtsh_ss(h);
#else
    return kn_f16_to_f32(h);
#endif
}

/* Scale of channel c of row t of an fp8 or int8 block. */
static inline float kn_kv_group_scale(const uint8_t *scales, int t, int hd, int c)
{
    const int g = kn_kv_group(hd);
    return kn_kv_h2f(scales + ((size_t)t * (hd / g) + c / g) * 2);
}

/* E4M3 -> float: the byte shifted into an f16 is the value times 2^-8 (subnormals included). */
static inline float kn_kv_e4m3(uint8_t b)
{
    return kn_f16_to_f32((kn_f16)(((b & 0x80) << 8) | ((b & 0x7f) << 7))) * 256.0f;
}

/* Scalar decode of elements [c0, hd) of row t of K (v = 0) or V (v = 1). */
static inline void kn_kv_row_tail(kn_kv_format f, const kn_kv_blk *b, int t, int hd, int v, int c0,
                                  float *row)
{
    switch (f) {
    case KN_KV_F16:
    case KN_KV_BF16: {
        const uint8_t *src = (v ? b->v : b->k) + (size_t)t * hd * 2;
        for (int c = c0; c < hd; c++) {
            kn_f16 h;
            memcpy(&h, src + 2 * (size_t)c, 2);
            row[c] = f == KN_KV_F16 ? kn_f16_to_f32(h) : kn_bf16_to_f32(h);
        }
        break;
    }
    case KN_KV_FP8: {
        const uint8_t *src = (v ? b->v : b->k) + (size_t)t * hd, *scs = v ? b->vs : b->ks;
        for (int c = c0; c < hd; c++)
            row[c] = kn_kv_e4m3(src[c]) * kn_kv_group_scale(scs, t, hd, c);
        break;
    }
    case KN_KV_INT8: {
        const uint8_t *src = (v ? b->v : b->k) + (size_t)t * hd, *scs = v ? b->vs : b->ks;
        for (int c = c0; c < hd; c++)
            row[c] = (float)(int8_t)src[c] * kn_kv_group_scale(scs, t, hd, c);
        break;
    }
    case KN_KV_INT4: {
        const uint8_t *src = (v ? b->v : b->k) + (size_t)t * (hd / 2);
        const int vg = kn_kv_int4_vgroup(hd), ng = hd / vg;
        for (int c = c0; c < hd; c++) {
            const int n = c & 1 ? src[c / 2] >> 4 : src[c / 2] & 15;
            if (!v) {
                row[c] =
                    n * kn_kv_h2f(b->ks + 2 * (size_t)c) + kn_kv_h2f(b->ks + 2 * (size_t)(hd + c));
            } else {
                const uint8_t *g = b->vs + ((size_t)t * ng + c / vg) * 4;
                row[c] = n * kn_kv_h2f(g) + kn_kv_h2f(g + 2);
            }
        }
        break;
    }
    }
}

static inline void kn_kv_atomic_add(float *p, float v)
{
    float old, nw;
    __atomic_load(p, &old, __ATOMIC_RELAXED);
    do {
        nw = old + v;
    } while (!__atomic_compare_exchange(p, &old, &nw, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
}

typedef void (*kn_kv_row_fn)(kn_kv_format f, const kn_kv_blk *b, int t, int hd, int v, float *row);
typedef float (*kn_kv_dot_fn)(const float *a, const float *b, int n);
typedef void (*kn_kv_axpy_fn)(float *y, float a, const float *x, int n);

/* out[h] = softmax(scale * q[h]·K^T) · V over the view, online softmax in chunks of KN_KV_CH
 * tokens; with attn_mass, a second pass adds each page's probability mass. */
static inline __attribute__((always_inline)) void
kn_attn_kv_body(const kn_kv_view *kv, int hd, const float *q, int n_q, float scale, float *out,
                kn_kv_row_fn row_fn, kn_kv_dot_fn dot, kn_kv_axpy_fn axpy)
{
    float row[KN_KV_MAX_HD] __attribute__((aligned(64)));
    float s[KN_KV_HG][KN_KV_CH], m[KN_KV_HG], l[KN_KV_HG];
    const int pt = kv->page_tokens, n_ctx = kv->n_ctx;
    memset(out, 0, sizeof(float) * (size_t)n_q * hd);
    if (n_ctx <= 0 || hd > KN_KV_MAX_HD) return;
    for (int h0 = 0; h0 < n_q; h0 += KN_KV_HG) {
        const int G = n_q - h0 < KN_KV_HG ? n_q - h0 : KN_KV_HG;
        const float *qg = q + (size_t)h0 * hd;
        float *og = out + (size_t)h0 * hd;
        for (int g = 0; g < G; g++) {
            m[g] = -INFINITY;
            l[g] = 0.0f;
        }
        for (int t0 = 0; t0 < n_ctx; t0 += pt) {
            kn_kv_blk b;
            const kn_kv_format f = kn_kv_block(kv, t0 / pt, &b);
            const int np = n_ctx - t0 < pt ? n_ctx - t0 : pt;
            for (int c0 = 0; c0 < np; c0 += KN_KV_CH) {
                const int nc = np - c0 < KN_KV_CH ? np - c0 : KN_KV_CH;
                for (int t = 0; t < nc; t++) {
                    row_fn(f, &b, c0 + t, hd, 0, row);
                    for (int g = 0; g < G; g++) s[g][t] = scale * dot(qg + (size_t)g * hd, row, hd);
                }
                for (int g = 0; g < G; g++) {
                    float mc = m[g];
                    for (int t = 0; t < nc; t++) mc = s[g][t] > mc ? s[g][t] : mc;
                    if (mc > m[g]) {
                        const float corr = expf(m[g] - mc);
                        l[g] *= corr;
                        float *o = og + (size_t)g * hd;
                        for (int d = 0; d < hd; d++) o[d] *= corr;
                        m[g] = mc;
                    }
                    for (int t = 0; t < nc; t++) {
                        s[g][t] = expf(s[g][t] - m[g]);
                        l[g] += s[g][t];
                    }
                }
                for (int t = 0; t < nc; t++) {
                    row_fn(f, &b, c0 + t, hd, 1, row);
                    for (int g = 0; g < G; g++) axpy(og + (size_t)g * hd, s[g][t], row, hd);
                }
            }
        }
        for (int g = 0; g < G; g++) {
            const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
            float *o = og + (size_t)g * hd;
            for (int d = 0; d < hd; d++) o[d] *= inv;
        }
        if (!kv->attn_mass) continue;
        for (int t0 = 0; t0 < n_ctx; t0 += pt) {
            kn_kv_blk b;
            const kn_kv_format f = kn_kv_block(kv, t0 / pt, &b);
            const int np = n_ctx - t0 < pt ? n_ctx - t0 : pt;
            float mass = 0.0f;
            for (int t = 0; t < np; t++) {
                row_fn(f, &b, t, hd, 0, row);
                for (int g = 0; g < G; g++)
                    if (l[g] > 0.0f)
                        mass += expf(scale * dot(qg + (size_t)g * hd, row, hd) - m[g]) / l[g];
            }
            kn_kv_atomic_add(&kv->attn_mass[t0 / pt], mass);
        }
    }
}

#endif
