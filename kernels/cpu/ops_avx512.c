/*
 * ops_avx512.c — the AVX-512 build of the non-matmul kernels (RMS norm, RoPE, SwiGLU, add, f16
 * conversions, paged attention). Compiled with AVX-512 F/BW/VL/DQ (+F16C); tails are masked, so
 * no scalar loops remain except where noted. Held to ops_ref.c by tests/unit/test_kernels_ops.c.
 *
 * Paged attention, the kernel that matters at long context, is attn_simd.h's body (shared with
 * ops_avx2.c) over the primitives at the end of this file: 16-token blocks (one zmm of scores per
 * head), K rows scored 4 at a time, 16x16 partials folded with shuffle trees, V accumulated 64
 * dimensions at a time. expf is a Cephes-style polynomial (about 1 ulp) with AVX-512 scalef for
 * the exponent. Quantized, mixed-format and attn_mass views are handed to attn_kv_avx512.c.
 */
#include <assert.h>
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kernels/cpu/internal.h"
#include "kernels/cpu/attn_kv.h"
#include "kernels/cpu/simd_avx512.h"

/* ---------------------------------------------------------------- expf */

/* ---------------------------------------------------------------- element-wise */

void kn_rmsnorm_avx512(float *y, const float *x, const float *w, int n, float eps)
{
    /* Squares in float, sums in double lanes: the same values ggml adds, in another order. */
    __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
    for (int i = 0; i < n; i += 16) {
        const __m512 v = _mm512_maskz_loadu_ps(kn_mask16(n - i), x + i);
        const __m512 sq = _mm512_mul_ps(v, v);
        s0 = _mm512_add_pd(s0, _mm512_cvtps_pd(_mm512_castps512_ps256(sq)));
        s1 = _mm512_add_pd(
            s1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sq), 1))));
    }
    const double sum = _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
    const float mean = (float)(sum / n);
    const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(mean + eps));
    for (int i = 0; i < n; i += 16) {
        const __mmask16 k = kn_mask16(n - i);
        const __m512 v = _mm512_maskz_loadu_ps(k, x + i);
        _mm512_mask_storeu_ps(
            y + i, k, _mm512_mul_ps(_mm512_mul_ps(v, scale), _mm512_maskz_loadu_ps(k, w + i)));
    }
}

void kn_rope_avx512(float *x, int n_heads, int head_dim, int n_rot, const float *cs, int neox)
{
    assert(n_rot % 2 == 0 && n_rot <= head_dim);
    const int half = n_rot / 2;
    /* neox: cos and sin of 16 consecutive pairs, de-interleaved from 32 cache floats. */
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int h = 0; h < n_heads; h++) {
        float *v = x + (size_t)h * head_dim;
        if (!neox) {
            /* x[2i], x[2i+1] sit at the same offsets as cos, sin in the cache. */
            for (int i = 0; i < n_rot; i += 16) {
                const __mmask16 k = kn_mask16(n_rot - i);
                const __m512 xv = _mm512_maskz_loadu_ps(k, v + i);
                const __m512 c = _mm512_maskz_loadu_ps(k, cs + i);
                const __m512 xs = _mm512_permute_ps(xv, 0xB1); /* swap within pairs */
                const __m512 sn = _mm512_mul_ps(xs, _mm512_movehdup_ps(c));
                /* even: x0*cos - x1*sin, odd: x1*cos + x0*sin */
                _mm512_mask_storeu_ps(v + i, k, _mm512_fmaddsub_ps(xv, _mm512_moveldup_ps(c), sn));
            }
        } else {
            for (int i = 0; i < half; i += 16) {
                const int m = half - i;
                const __mmask16 k = kn_mask16(m);
                const __m512 a = _mm512_maskz_loadu_ps(k, v + i);
                const __m512 b = _mm512_maskz_loadu_ps(k, v + i + half);
                const __m512 lo = _mm512_maskz_loadu_ps(kn_mask16(2 * m), cs + 2 * i);
                const __m512 hi = _mm512_maskz_loadu_ps(kn_mask16(2 * m - 16), cs + 2 * i + 16);
                const __m512 c = _mm512_permutex2var_ps(lo, ev, hi);
                const __m512 s = _mm512_permutex2var_ps(lo, od, hi);
                _mm512_mask_storeu_ps(v + i, k, _mm512_fmsub_ps(a, c, _mm512_mul_ps(b, s)));
                _mm512_mask_storeu_ps(v + i + half, k, _mm512_fmadd_ps(a, s, _mm512_mul_ps(b, c)));
            }
        }
    }
}

void kn_silu_mul_avx512(float *y, const float *g, const float *u, int n)
{
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int i = 0; i < n; i += 16) {
        const __mmask16 k = kn_mask16(n - i);
        const __m512 gv = _mm512_maskz_loadu_ps(k, g + i);
        const __m512 e = kn_exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
        _mm512_mask_storeu_ps(y + i, k, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(k, u + i)));
    }
}

void kn_add_avx512(float *y, const float *x, int n)
{
    for (int i = 0; i < n; i += 16) {
        const __mmask16 k = kn_mask16(n - i);
        _mm512_mask_storeu_ps(
            y + i, k,
            _mm512_add_ps(_mm512_maskz_loadu_ps(k, y + i), _mm512_maskz_loadu_ps(k, x + i)));
    }
}

void kn_f32_to_f16_avx512(const float *x, kn_f16 *y, int64_t n)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256(
            (__m256i *)(y + i),
            _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    if (i < n) {
        const __mmask16 k = kn_mask16((int)(n - i));
        _mm256_mask_storeu_epi16(y + i, k,
                                 _mm512_cvtps_ph(_mm512_maskz_loadu_ps(k, x + i),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
}

void kn_f16_to_f32_avx512(const kn_f16 *x, float *y, int64_t n)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(x + i))));
    if (i < n) {
        const __mmask16 k = kn_mask16((int)(n - i));
        _mm512_mask_storeu_ps(y + i, k, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, x + i)));
    }
}

/* ---------------------------------------------------------------- attention */

/* The primitives of attn_simd.h's attention: 16-token blocks (one zmm of scores per head), K rows
 * scored 4 at a time, V accumulated 4 vectors (64 dimensions) at a time. */
#define KN_SFX        avx512
#define KN_AL         16
#define KN_AR         4
#define KN_ATT_VW(NQ) 4

typedef __m512 kn_af;

KN_AI kn_af kn_af_zero(void)
{
    return _mm512_setzero_ps();
}
KN_AI kn_af kn_af_set1(float x)
{
    return _mm512_set1_ps(x);
}
KN_AI kn_af kn_af_ld(const float *p)
{
    return _mm512_loadu_ps(p);
}
KN_AI void kn_af_st(float *p, kn_af v)
{
    _mm512_storeu_ps(p, v);
}
KN_AI kn_af kn_af_add(kn_af a, kn_af b)
{
    return _mm512_add_ps(a, b);
}
KN_AI kn_af kn_af_sub(kn_af a, kn_af b)
{
    return _mm512_sub_ps(a, b);
}
KN_AI kn_af kn_af_mul(kn_af a, kn_af b)
{
    return _mm512_mul_ps(a, b);
}
KN_AI kn_af kn_af_fma(kn_af a, kn_af b, kn_af c)
{
    return _mm512_fmadd_ps(a, b, c);
}
KN_AI kn_af kn_af_exp(kn_af x)
{
    return kn_exp512(x);
}
KN_AI float kn_af_hmax(kn_af v)
{
    return _mm512_reduce_max_ps(v);
}
KN_AI float kn_af_hsum(kn_af v)
{
    return _mm512_reduce_add_ps(v);
}
KN_AI int kn_af_any_gt(kn_af v, float x)
{
    return _mm512_cmp_ps_mask(v, _mm512_set1_ps(x), _CMP_GT_OQ) != 0;
}
/* lanes >= n replaced by fill */
KN_AI kn_af kn_af_first(kn_af v, int n, float fill)
{
    return _mm512_mask_blend_ps(kn_mask16(n), _mm512_set1_ps(fill), v);
}
KN_AI kn_af kn_af_fold_rows(const kn_af acc[KN_AR])
{
    return kn_fold4(acc[0], acc[1], acc[2], acc[3]);
}
KN_AI kn_af kn_af_fold_groups(kn_af d0, kn_af d1, kn_af d2, kn_af d3)
{
    return kn_fold16(d0, d1, d2, d3);
}

/* Channels [c, c+16) of row t of a block: f16/bf16 converted; fp8/int8 decoded (the f16 trick
 * for e4m3: the value times 2^-8, which the scale carries back) times the row's scale of the
 * 16-channel group, equal, bit for bit, to kn_kv_row_tail's values; int4 (a V row: sc holds its
 * (scale, min) per 32-channel group, which 16 lanes never straddle) as n * scale + min in one
 * FMA, as attn_kv_avx512.c. */
KN_AI kn_af kn_att_row(const int FMT, const uint8_t *blk, int t, int hd, int c, const float *sc)
{
    if (FMT == KN_KV_INT4)
        return _mm512_fmadd_ps(kn_kv_int4x16(blk + (size_t)t * (hd / 2) + c / 2),
                               _mm512_set1_ps(sc[2 * (c / 32)]),
                               _mm512_set1_ps(sc[2 * (c / 32) + 1]));
    if (FMT == KN_KV_F16 || FMT == KN_KV_BF16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 2 * ((size_t)t * hd + c)));
        if (FMT == KN_KV_BF16)
            return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        return _mm512_cvtph_ps(h);
    }
    const __m128i b = _mm_loadu_si128((const __m128i *)(blk + (size_t)t * hd + c));
    kn_af x;
    if (FMT == KN_KV_FP8) /* the sign-extended byte << 7 with bit 14 cleared: e4m3(b) * 2^-8 */
        x = _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                             _mm256_set1_epi16((short)0xbf80)));
    else
        x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    return _mm512_mul_ps(x, _mm512_set1_ps(sc[c / 16]));
}

/* Channels [c, c+16) of row t of an int4 K block as floats 0..15 (the caller applies the page's
 * per-channel scale and min). */
KN_AI kn_af kn_att_nib(const uint8_t *blk, int t, int hd, int c)
{
    return kn_kv_int4x16(blk + (size_t)t * (hd / 2) + c / 2);
}

/* n f16 scales to floats times mul. */
KN_AI void kn_att_scales(const uint8_t *src, int n, float mul, float *dst)
{
    for (int i = 0; i < n; i += 16) {
        const __mmask16 k = kn_mask16(n - i);
        const __m512 x = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, src + 2 * (size_t)i));
        _mm512_mask_storeu_ps(dst + i, k, _mm512_mul_ps(x, _mm512_set1_ps(mul)));
    }
}

/* Head sizes that are not a multiple of 16 do not occur in the models we serve; the AVX2 build
 * covers multiples of 8, the reference everything else. */
KN_AI void kn_att_narrow(const kn_kv_view *kv, int hd, const float *q, int n_q, float scale,
                         float *out)
{
    if (hd % 8 == 0)
        kn_attention_avx2(kv, hd, q, n_q, scale, out);
    else
        kn_attention_ref(kv, hd, q, n_q, scale, out);
}

#include "kernels/cpu/attn_simd.h"
