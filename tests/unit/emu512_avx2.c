/*
 * emu512_avx2.c — the AVX-512 build's matmul and attention drivers, in their own configuration
 * (matmul: 16-row panels,
 * 8-column tiles, 256-block k-chunks, Q8_0 biased to u8 with a -128 * sum(x) correction, Q4_1's
 * min term in its own accumulator; attention: 16-token blocks, K rows scored 4 at a time), run
 * on any AVX2 machine: kernels/cpu/quant_simd.h and attn_simd.h instantiated over primitives that
 * do lane by lane, with GCC vector extensions, what the AVX-512 primitives of quant_avx512.c and
 * ops_avx512.c do with one instruction each (vpdpbusd, vpmaddwd, vcvtph2ps, masked stores).
 * test_kernels_quant.c and test_kernels_ops.c hold it to the reference as they hold the real
 * builds, so the driver logic the AVX-512 build runs is tested on machines that lack AVX-512.
 * Test-only: linked into those two tests (Makefile).
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kernels/cpu/attn_kv.h"
#include "kernels/cpu/internal.h"

#define KN_AI static inline __attribute__((always_inline))

#define KN_SFX       emu512
#define KN_PR        16
#define KN_NT        8
#define KN_NC        64
#define KN_KC        256
#define KN_KCK       4
#define KN_XTAB      (64 * 32)
#define KN_S8_BIAS   128
#define KN_FT_N      4
#define KN_MIN_APART 1

typedef int32_t kn_vi __attribute__((vector_size(64)));
typedef uint32_t kn_vu __attribute__((vector_size(64)));
typedef float kn_vf __attribute__((vector_size(64)));

KN_AI kn_vi kn_vi_ld(const void *p)
{
    kn_vi v;
    memcpy(&v, p, sizeof v);
    return v;
}
KN_AI kn_vi kn_vi_set1(int32_t v)
{
    return (kn_vi){0} + v;
}
KN_AI kn_vi kn_vi_zero(void)
{
    return (kn_vi){0};
}
KN_AI kn_vi kn_vi_and(kn_vi a, kn_vi b)
{
    return a & b;
}
KN_AI kn_vi kn_vi_or(kn_vi a, kn_vi b)
{
    return a | b;
}
KN_AI kn_vi kn_vi_add(kn_vi a, kn_vi b)
{
    return (kn_vi)((kn_vu)a + (kn_vu)b);
}
KN_AI kn_vi kn_vi_srli(kn_vi a, int n)
{
    return (kn_vi)((kn_vu)a >> n);
}
KN_AI kn_vi kn_vi_slli(kn_vi a, int n)
{
    return (kn_vi)((kn_vu)a << n);
}
KN_AI kn_vi kn_vi_srai(kn_vi a, int n)
{
    return a >> n;
}
/* vpmaddwd: per lane, the two int16 products summed */
KN_AI kn_vi kn_vi_madd16(kn_vi a, kn_vi b)
{
    kn_vi r;
    for (int l = 0; l < KN_PR; l++)
        r[l] = (int16_t)(a[l] & 0xFFFF) * (int16_t)(b[l] & 0xFFFF) +
               (int16_t)((uint32_t)a[l] >> 16) * (int16_t)((uint32_t)b[l] >> 16);
    return r;
}
KN_AI kn_vf kn_vf_zero(void)
{
    return (kn_vf){0};
}
KN_AI kn_vf kn_vf_set1(float v)
{
    return (kn_vf){0} + v;
}
KN_AI kn_vf kn_vf_add(kn_vf a, kn_vf b)
{
    return a + b;
}
KN_AI kn_vf kn_vf_mul(kn_vf a, kn_vf b)
{
    return a * b;
}
KN_AI kn_vf kn_vf_fma(kn_vf a, kn_vf b, kn_vf c)
{
    kn_vf r;
    for (int l = 0; l < KN_PR; l++) r[l] = fmaf(a[l], b[l], c[l]);
    return r;
}
KN_AI kn_vf kn_vf_fnma(kn_vf a, kn_vf b, kn_vf c)
{
    kn_vf r;
    for (int l = 0; l < KN_PR; l++) r[l] = fmaf(-a[l], b[l], c[l]);
    return r;
}
KN_AI kn_vf kn_vf_cvt(kn_vi a)
{
    return __builtin_convertvector(a, kn_vf);
}
KN_AI kn_vf kn_vf_ld_f16(const void *p)
{
    kn_f16 h[KN_PR];
    memcpy(h, p, sizeof h);
    kn_vf r;
    for (int l = 0; l < KN_PR; l++) r[l] = _cvtsh_ss(h[l]);
    return r;
}

KN_AI void kn_store_rows(float *yp, int nr, kn_vf acc, int first)
{
    for (int l = 0; l < nr; l++) yp[l] = first ? acc[l] : acc[l] + yp[l];
}

/* vpdpbusd: per lane, the 4 products of u8 weight bytes and s8 activation bytes summed in */
KN_AI kn_vi kn_dpbusd(kn_vi s, kn_vi w, const uint8_t *x)
{
    for (int l = 0; l < KN_PR; l++) {
        const uint32_t wl = (uint32_t)w[l];
        int32_t d = 0;
        for (int b = 0; b < 4; b++) d += (int32_t)((wl >> (8 * b)) & 0xFF) * (int8_t)x[b];
        s[l] = (int32_t)((uint32_t)s[l] + (uint32_t)d);
    }
    return s;
}

/* As quant_avx512.c's kn_dot_u8. */
KN_AI void kn_dot_u8(const kn_vi *w, const int n, const int lim, const uint8_t *x, size_t x_stride,
                     const int N, const int32_t *c, int c_stride, kn_vi *s, const int split)
{
    (void)lim;
    kn_vi s2[KN_NT];
    for (int i = 0; i < N; i++) {
        s[i] = c ? kn_vi_set1(c[(size_t)i * (size_t)c_stride]) : kn_vi_zero();
        s2[i] = kn_vi_zero();
    }
    for (int j = 0; j < n; j++)
        for (int i = 0; i < N; i++) {
            const uint8_t *xv = x + (size_t)i * x_stride + 4 * j;
            if (split && (j & 1))
                s2[i] = kn_dpbusd(s2[i], w[j], xv);
            else
                s[i] = kn_dpbusd(s[i], w[j], xv);
        }
    if (split)
        for (int i = 0; i < N; i++) s[i] = kn_vi_add(s[i], s2[i]);
}

typedef struct kn_w32 {
    kn_vi q[8];
} kn_w32;

/* As quant_avx512.c's: Q8_0 bytes biased by +128, else nibbles. */
KN_AI void kn_w32_prep(int q8, const uint8_t *g, kn_w32 *w)
{
    if (q8) {
        for (int j = 0; j < 8; j++) w->q[j] = kn_vi_ld(g + (size_t)j * 64) ^ (int32_t)0x80808080;
        return;
    }
    for (int j = 0; j < 4; j++) {
        const kn_vi r = kn_vi_ld(g + (size_t)j * 64);
        w->q[j] = r & 0x0F0F0F0F;
        w->q[j + 4] = kn_vi_srli(r, 4) & 0x0F0F0F0F;
    }
}

KN_AI void kn_w32_dot(int q8, const kn_w32 *w, const uint8_t *xq, size_t x_stride, const int N,
                      const int32_t *c, int c_stride, kn_vi *s, const int split)
{
    (void)q8;
    kn_dot_u8(w->q, 8, 8, xq, x_stride, N, c, c_stride, s, split);
}

/* Float weights and activation quantization are not what this file is for: plain loops and the
 * reference. */
KN_AI void kn_tilef(md_type ft, const uint8_t *w, size_t w_stride, const uint8_t *x,
                    size_t x_stride, int64_t k, int R, int N, float *y, size_t y_stride)
{
    for (int r = 0; r < R; r++)
        for (int i = 0; i < N; i++)
            kn_matmul_ref(ft, w + (size_t)r * w_stride, w_stride, x + (size_t)i * x_stride,
                          x_stride, k, 1, y + (size_t)i * y_stride + (size_t)r, 1, 0, 1);
}

KN_AI int kn_q8_block(const float *x, int8_t *qs, kn_f16 *dout, float *dval)
{
    kn_block_q8_0 b;
    kn_quantize_row_ref(MD_TYPE_Q8_0, x, &b, 32);
    memcpy(qs, b.qs, 32);
    *dout = b.d;
    *dval = _cvtsh_ss(b.d);
    int sum = 0;
    for (int j = 0; j < 32; j++) sum += b.qs[j];
    /* Q8_1's s is fp16(d * sum) with the unrounded d: recompute it as the reference does */
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
    *dval = amax / 127.f;
    return sum;
}

KN_AI void kn_q8K_block(const float *x, uint8_t *y)
{
    kn_quantize_row_ref(MD_TYPE_Q8_K, x, y, KN_QK_K);
}

KN_AI void kn_f16_row(const float *x, kn_f16 *y, int64_t n)
{
    kn_quantize_row_ref(MD_TYPE_F16, x, y, n);
}

KN_AI void kn_bf16_row(const float *x, kn_bf16 *y, int64_t n)
{
    kn_quantize_row_ref(MD_TYPE_BF16, x, y, n);
}

#include "kernels/cpu/quant_simd.h"

/* ------------------------------------------------------------------ attention (attn_simd.h) */

/* ops_avx512.c's attention configuration: 16-token blocks, K rows scored 4 at a time, V 4
 * vectors at a time. The fold primitives here sum each row's partials plainly (the real ones use
 * shuffle trees with the same meaning). */
#define KN_AL         16
#define KN_AR         4
#define KN_ATT_VW(NQ) 4

typedef kn_vf kn_af;

KN_AI kn_af kn_af_zero(void)
{
    return (kn_af){0};
}
KN_AI kn_af kn_af_set1(float x)
{
    return (kn_af){0} + x;
}
KN_AI kn_af kn_af_ld(const float *p)
{
    kn_af v;
    memcpy(&v, p, sizeof v);
    return v;
}
KN_AI void kn_af_st(float *p, kn_af v)
{
    memcpy(p, &v, sizeof v);
}
KN_AI kn_af kn_af_add(kn_af a, kn_af b)
{
    return a + b;
}
KN_AI kn_af kn_af_sub(kn_af a, kn_af b)
{
    return a - b;
}
KN_AI kn_af kn_af_mul(kn_af a, kn_af b)
{
    return a * b;
}
KN_AI kn_af kn_af_fma(kn_af a, kn_af b, kn_af c)
{
    return kn_vf_fma(a, b, c);
}
KN_AI kn_af kn_af_exp(kn_af x)
{
    for (int l = 0; l < KN_AL; l++) x[l] = expf(x[l]);
    return x;
}
KN_AI float kn_af_hmax(kn_af v)
{
    float m = v[0];
    for (int l = 1; l < KN_AL; l++) m = v[l] > m ? v[l] : m;
    return m;
}
KN_AI float kn_af_hsum(kn_af v)
{
    float s = 0.0f;
    for (int l = 0; l < KN_AL; l++) s += v[l];
    return s;
}
KN_AI int kn_af_any_gt(kn_af v, float x)
{
    for (int l = 0; l < KN_AL; l++)
        if (v[l] > x) return 1;
    return 0;
}
KN_AI kn_af kn_af_first(kn_af v, int n, float fill)
{
    for (int l = n < 0 ? 0 : n; l < KN_AL; l++) v[l] = fill;
    return v;
}
/* lane r: row r's sum (r < 4) */
KN_AI kn_af kn_af_fold_rows(const kn_af acc[KN_AR])
{
    kn_af d = {0};
    for (int r = 0; r < KN_AR; r++) d[r] = kn_af_hsum(acc[r]);
    return d;
}
KN_AI kn_af kn_af_fold_groups(kn_af d0, kn_af d1, kn_af d2, kn_af d3)
{
    kn_af s;
    for (int r = 0; r < 4; r++) s[r] = d0[r], s[4 + r] = d1[r], s[8 + r] = d2[r], s[12 + r] = d3[r];
    return s;
}

/* Element e of an int4 block (low nibble first) as a float 0..15. */
KN_AI float kn_att_nib1(const uint8_t *blk, size_t e)
{
    return (float)((blk[e / 2] >> (4 * (e & 1))) & 15);
}

KN_AI kn_af kn_att_nib(const uint8_t *blk, int t, int hd, int c)
{
    kn_af x;
    for (int l = 0; l < KN_AL; l++) x[l] = kn_att_nib1(blk, (size_t)t * hd + (size_t)(c + l));
    return x;
}

KN_AI kn_af kn_att_row(const int FMT, const uint8_t *blk, int t, int hd, int c, const float *sc)
{
    kn_af x;
    for (int l = 0; l < KN_AL; l++) {
        const size_t e = (size_t)t * hd + (size_t)(c + l);
        kn_f16 h;
        if (FMT == KN_KV_INT4) { /* a V row: (scale, min) per 32 channels, one FMA as the build */
            x[l] = fmaf(kn_att_nib1(blk, e), sc[2 * (c / 32)], sc[2 * (c / 32) + 1]);
        } else if (FMT == KN_KV_F16 || FMT == KN_KV_BF16) {
            memcpy(&h, blk + 2 * e, 2);
            x[l] = FMT == KN_KV_F16 ? _cvtsh_ss(h) : kn_bf16_to_f32(h);
        } else if (FMT == KN_KV_FP8) { /* e4m3(b) * 2^-8 through f16; the scale has the 2^8 */
            h = (kn_f16)(((unsigned)(uint16_t)(int8_t)blk[e] << 7) & 0xbf80); /* s-ext'd, shifted */
            x[l] = _cvtsh_ss(h) * sc[c / 16];
        } else {
            x[l] = (float)(int8_t)blk[e] * sc[c / 16];
        }
    }
    return x;
}

KN_AI void kn_att_scales(const uint8_t *src, int n, float mul, float *dst)
{
    for (int i = 0; i < n; i++) {
        kn_f16 h;
        memcpy(&h, src + 2 * (size_t)i, 2);
        dst[i] = _cvtsh_ss(h) * mul;
    }
}

KN_AI void kn_att_narrow(const kn_kv_view *kv, int hd, const float *q, int n_q, float scale,
                         float *out)
{
    kn_attention_ref(kv, hd, q, n_q, scale, out);
}

int kn_att_fast_emu512(const kn_kv_view *kv, int head_dim, const float *q, int n_q, float scale,
                       float *out);

/* As attn_kv_avx512.c's entry, with the reference's row-at-a-time body for the rest. */
void kn_attention_kv_emu512(const kn_kv_view *kv, int head_dim, const float *q, int n_q,
                            float scale, float *out)
{
    if (kn_att_fast_emu512(kv, head_dim, q, n_q, scale, out)) return;
    kn_attention_kv_ref(kv, head_dim, q, n_q, scale, out);
}

#include "kernels/cpu/attn_simd.h"
