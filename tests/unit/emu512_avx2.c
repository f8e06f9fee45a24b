/*
 * emu512_avx2.c — the AVX-512 build's matmul driver, in its own configuration (16-row panels,
 * 8-column tiles, 256-block k-chunks, Q8_0 biased to u8 with a -128 * sum(x) correction, Q4_1's
 * min term in its own accumulator), run on any AVX2 machine: kernels/cpu/quant_simd.h
 * instantiated over primitives that do lane by lane, with GCC vector extensions, what the
 * AVX-512 primitives of kernels/cpu/quant_avx512.c do with one instruction each (vpdpbusd,
 * vpmaddwd, vcvtph2ps, masked stores). test_kernels_quant.c holds it to the reference exactly as
 * it holds the real builds, so the driver logic the AVX-512 build runs is tested on machines that
 * lack AVX-512. Test-only: linked into test_kernels_quant (Makefile).
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

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
KN_AI void kn_tilef(km_type ft, const uint8_t *w, size_t w_stride, const uint8_t *x,
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
    kn_quantize_row_ref(KM_TYPE_Q8_0, x, &b, 32);
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
    kn_quantize_row_ref(KM_TYPE_Q8_K, x, y, KN_QK_K);
}

KN_AI void kn_f16_row(const float *x, kn_f16 *y, int64_t n)
{
    kn_quantize_row_ref(KM_TYPE_F16, x, y, n);
}

KN_AI void kn_bf16_row(const float *x, kn_bf16 *y, int64_t n)
{
    kn_quantize_row_ref(KM_TYPE_BF16, x, y, n);
}

#include "kernels/cpu/quant_simd.h"
