/*
 * ops_avx2.c — the AVX2 (+FMA, F16C) build of the non-matmul kernels (RMS norm, RoPE, SwiGLU,
 * add, f16 conversions, paged attention). Vector bodies are 8 floats wide; the few leftover
 * elements go through the same scalar expressions as ops_ref.c. Held to the reference by
 * tests/unit/test_kernels_ops.c.
 *
 * Paged attention is attn_simd.h's body, shared with ops_avx512.c, over the primitives at the end
 * of this file: 8-token blocks (one ymm of scores per head), K rows scored 2 at a time. expf is a
 * Cephes-style polynomial (about 1 ulp); 2^n is applied as two exact power-of-two factors so that
 * subnormal and overflowing results come out as expf's do. Quantized, mixed-format and attn_mass
 * views are handed to attn_kv_avx2.c.
 */
#include <assert.h>
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kernels/cpu/internal.h"
#include "kernels/cpu/attn_kv.h"
#include "kernels/cpu/simd_avx2.h"

/* ---------------------------------------------------------------- expf */

/* ---------------------------------------------------------------- element-wise */

void kn_rmsnorm_avx2(float *y, const float *x, const float *w, int n, float eps)
{
    /* Squares in float, sums in double lanes: the same values ggml adds, in another order. */
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256 sq = _mm256_mul_ps(v, v);
        s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(sq)));
        s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(sq, 1)));
    }
    s0 = _mm256_add_pd(s0, s1);
    __m128d h = _mm_add_pd(_mm256_castpd256_pd128(s0), _mm256_extractf128_pd(s0, 1));
    double sum = _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
    for (; i < n; i++) sum += (double)(x[i] * x[i]);
    const float mean = (float)(sum / n);
    const float sc = 1.0f / sqrtf(mean + eps);
    const __m256 scale = _mm256_set1_ps(sc);
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), scale),
                                              _mm256_loadu_ps(w + i)));
    for (; i < n; i++) y[i] = x[i] * sc * w[i];
}

void kn_rope_avx2(float *x, int n_heads, int head_dim, int n_rot, const float *cs, int neox)
{
    assert(n_rot % 2 == 0 && n_rot <= head_dim);
    const int half = n_rot / 2;
    /* neox: de-interleave 8 (cos, sin) pairs; permute within lanes, then gather the halves. */
    const __m256i deint = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (int h = 0; h < n_heads; h++) {
        float *v = x + (size_t)h * head_dim;
        int i = 0;
        if (!neox) {
            for (; i + 8 <= n_rot; i += 8) {
                const __m256 xv = _mm256_loadu_ps(v + i), c = _mm256_loadu_ps(cs + i);
                const __m256 xs = _mm256_permute_ps(xv, 0xB1); /* swap within pairs */
                const __m256 sn = _mm256_mul_ps(xs, _mm256_movehdup_ps(c));
                _mm256_storeu_ps(v + i, _mm256_fmaddsub_ps(xv, _mm256_moveldup_ps(c), sn));
            }
            for (i /= 2; i < half; i++) {
                const float c = cs[2 * i], s = cs[2 * i + 1], x0 = v[2 * i], x1 = v[2 * i + 1];
                v[2 * i] = x0 * c - x1 * s;
                v[2 * i + 1] = x0 * s + x1 * c;
            }
        } else {
            for (; i + 8 <= half; i += 8) {
                const __m256 a = _mm256_loadu_ps(v + i), b = _mm256_loadu_ps(v + i + half);
                const __m256 lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(cs + 2 * i), deint);
                const __m256 hi = _mm256_permutevar8x32_ps(_mm256_loadu_ps(cs + 2 * i + 8), deint);
                const __m256 c = _mm256_permute2f128_ps(lo, hi, 0x20);
                const __m256 s = _mm256_permute2f128_ps(lo, hi, 0x31);
                _mm256_storeu_ps(v + i, _mm256_fmsub_ps(a, c, _mm256_mul_ps(b, s)));
                _mm256_storeu_ps(v + i + half, _mm256_fmadd_ps(a, s, _mm256_mul_ps(b, c)));
            }
            for (; i < half; i++) {
                const float c = cs[2 * i], s = cs[2 * i + 1], x0 = v[i], x1 = v[i + half];
                v[i] = x0 * c - x1 * s;
                v[i + half] = x0 * s + x1 * c;
            }
        }
    }
}

void kn_silu_mul_avx2(float *y, const float *g, const float *u, int n)
{
    const __m256 one = _mm256_set1_ps(1.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = kn_exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        _mm256_storeu_ps(
            y + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

void kn_add_avx2(float *y, const float *x, int n)
{
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_loadu_ps(x + i)));
    for (; i < n; i++) y[i] += x[i];
}

void kn_f32_to_f16_avx2(const float *x, kn_f16 *y, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(
            (__m128i *)(y + i),
            _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++) y[i] = kn_f32_to_f16(x[i]);
}

void kn_f16_to_f32_avx2(const kn_f16 *x, float *y, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))));
    for (; i < n; i++) y[i] = kn_f16_to_f32(x[i]);
}

/* ---------------------------------------------------------------- attention */

/* The primitives of attn_simd.h's attention: 8-token blocks (one ymm of scores per head), K rows
 * scored 2 at a time, V accumulated 4 vectors (32 dimensions) at a time for up to 2 heads, 2 for
 * more. */
#define KN_SFX        avx2
#define KN_AL         8
#define KN_AR         2
#define KN_ATT_VW(NQ) ((NQ) <= 2 ? 4 : 2)

typedef __m256 kn_af;

KN_AI kn_af kn_af_zero(void)
{
    return _mm256_setzero_ps();
}
KN_AI kn_af kn_af_set1(float x)
{
    return _mm256_set1_ps(x);
}
KN_AI kn_af kn_af_ld(const float *p)
{
    return _mm256_loadu_ps(p);
}
KN_AI void kn_af_st(float *p, kn_af v)
{
    _mm256_storeu_ps(p, v);
}
KN_AI kn_af kn_af_add(kn_af a, kn_af b)
{
    return _mm256_add_ps(a, b);
}
KN_AI kn_af kn_af_sub(kn_af a, kn_af b)
{
    return _mm256_sub_ps(a, b);
}
KN_AI kn_af kn_af_mul(kn_af a, kn_af b)
{
    return _mm256_mul_ps(a, b);
}
KN_AI kn_af kn_af_fma(kn_af a, kn_af b, kn_af c)
{
    return _mm256_fmadd_ps(a, b, c);
}
KN_AI kn_af kn_af_exp(kn_af x)
{
    return kn_exp256(x);
}
KN_AI float kn_af_hmax(kn_af v)
{
    return kn_hmax256(v);
}
KN_AI float kn_af_hsum(kn_af v)
{
    return kn_hsum256(v);
}
KN_AI int kn_af_any_gt(kn_af v, float x)
{
    return _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(x), _CMP_GT_OQ));
}
/* lanes >= n replaced by fill */
KN_AI kn_af kn_af_first(kn_af v, int n, float fill)
{
    return _mm256_blendv_ps(_mm256_set1_ps(fill), v, kn_valid8(n));
}
KN_AI kn_af kn_af_fold_rows(const kn_af acc[KN_AR])
{
    return kn_fold2(acc[0], acc[1]);
}
KN_AI kn_af kn_af_fold_groups(kn_af d0, kn_af d1, kn_af d2, kn_af d3)
{
    return kn_fold8(d0, d1, d2, d3);
}

/* Channels [c, c+8) of row t of a block: f16/bf16 converted; fp8/int8 decoded (kn_kv_fp8x8's
 * f16 trick: the value times 2^-8, which the scale carries back) times the row's scale of
 * their 16-channel group, equal bit for bit to kn_kv_row_tail's values; int4 (a V row: sc holds
 * its (scale, min) per 32-channel group) as n * scale + min in one FMA, as attn_kv_avx2.c. */
KN_AI kn_af kn_att_row(const int FMT, const uint8_t *blk, int t, int hd, int c, const float *sc)
{
    if (FMT == KN_KV_INT4)
        return _mm256_fmadd_ps(kn_kv_int4x8(blk + (size_t)t * (hd / 2) + c / 2),
                               _mm256_set1_ps(sc[2 * (c / 32)]),
                               _mm256_set1_ps(sc[2 * (c / 32) + 1]));
    if (FMT == KN_KV_F16 || FMT == KN_KV_BF16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)(blk + 2 * ((size_t)t * hd + c)));
        if (FMT == KN_KV_BF16)
            return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        return _mm256_cvtph_ps(h);
    }
    const __m128i b = _mm_loadl_epi64((const __m128i *)(blk + (size_t)t * hd + c));
    kn_af x;
    if (FMT == KN_KV_FP8) /* the sign-extended byte << 7 with bit 14 cleared: e4m3(b) * 2^-8 */
        x = _mm256_cvtph_ps(
            _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm_set1_epi16((short)0xbf80)));
    else
        x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    return _mm256_mul_ps(x, _mm256_set1_ps(sc[c / 16]));
}

/* Channels [c, c+8) of row t of an int4 K block as floats 0..15 (the caller applies the page's
 * per-channel scale and min). */
KN_AI kn_af kn_att_nib(const uint8_t *blk, int t, int hd, int c)
{
    return kn_kv_int4x8(blk + (size_t)t * (hd / 2) + c / 2);
}

/* n f16 scales to floats times mul. */
KN_AI void kn_att_scales(const uint8_t *src, int n, float mul, float *dst)
{
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(
            dst + i,
            _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * (size_t)i))),
                          _mm256_set1_ps(mul)));
    for (; i < n; i++) dst[i] = kn_kv_h2f(src + 2 * (size_t)i) * mul;
}

/* Head sizes that are not a multiple of 8 do not occur in the models we serve. */
KN_AI void kn_att_narrow(const kn_kv_view *kv, int hd, const float *q, int n_q, float scale,
                         float *out)
{
    kn_attention_ref(kv, hd, q, n_q, scale, out);
}

#include "kernels/cpu/attn_simd.h"
