/*
 * quant_avx2.c — the AVX2 + FMA + F16C primitives of the quantized matrix multiply and of the
 * activation quantization; the drivers are quant_simd.h's, shared with quant_avx512.c. Held to
 * quant_ref.c by tests/unit/test_kernels_quant.c.
 *
 * Panels are 8 rows (one ymm lane of 4 quant bytes each); micro-tiles up to 4 activation rows.
 * Without VNNI the products go through vpmaddubsw (u8 x s8 -> pairs of int16):
 *   Q4_0/Q4_1/Q4_K  nibbles are 0..15, so the 8 pair-sums of a 32-element block stay below 2^15
 *                   and are added in int16, widened once per block with vpmaddwd
 *   Q6_K            quants 0..63: two pair-sums are added in int16, then widened
 *   Q8_0            s8 x s8 through ggml's sign trick: |w| (u8) x sign(x, w), widened per step
 * Integer block sums are exact; offsets (-8, -32) are integer corrections from the activation
 * sums, so the float part is one step per block as in the AVX-512 build.
 *
 * Float weights use direct 4 x 2 register tiles reduced at the end, the k tail in scalar.
 * Activation quantization is bit-identical to the reference (its Q8_0/Q8_1 are ggml's AVX2
 * code's results).
 */
#include <assert.h>
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kernels/cpu/internal.h"
#include "kernels/cpu/simd_avx2.h"

#define KN_SFX       avx2
#define KN_PR        8         /* weight rows per panel */
#define KN_NT        4         /* activation rows per micro-tile */
#define KN_NC        64        /* activation rows per column chunk */
#define KN_KC        32        /* 32-element blocks per k-chunk */
#define KN_KCK       4         /* super-blocks per k-chunk */
#define KN_XTAB      (64 * 32) /* activation table entries */
#define KN_S8_BIAS   0         /* Q8_0 by the sign trick: no bias */
#define KN_FT_N      2         /* float-tile columns */
#define KN_MIN_APART 0         /* Q4_1's min term in the main accumulator: registers are few */

typedef __m256i kn_vi;
typedef __m256 kn_vf;

KN_AI kn_vi kn_vi_ld(const void *p)
{
    return _mm256_loadu_si256((const __m256i *)p);
}
KN_AI kn_vi kn_vi_set1(int32_t v)
{
    return _mm256_set1_epi32(v);
}
KN_AI kn_vi kn_vi_zero(void)
{
    return _mm256_setzero_si256();
}
KN_AI kn_vi kn_vi_and(kn_vi a, kn_vi b)
{
    return _mm256_and_si256(a, b);
}
KN_AI kn_vi kn_vi_or(kn_vi a, kn_vi b)
{
    return _mm256_or_si256(a, b);
}
KN_AI kn_vi kn_vi_add(kn_vi a, kn_vi b)
{
    return _mm256_add_epi32(a, b);
}
KN_AI kn_vi kn_vi_srli(kn_vi a, int n)
{
    return _mm256_srli_epi32(a, n);
}
KN_AI kn_vi kn_vi_slli(kn_vi a, int n)
{
    return _mm256_slli_epi32(a, n);
}
KN_AI kn_vi kn_vi_srai(kn_vi a, int n)
{
    return _mm256_srai_epi32(a, n);
}
KN_AI kn_vi kn_vi_madd16(kn_vi a, kn_vi b)
{
    return _mm256_madd_epi16(a, b);
}
KN_AI kn_vf kn_vf_zero(void)
{
    return _mm256_setzero_ps();
}
KN_AI kn_vf kn_vf_set1(float v)
{
    return _mm256_set1_ps(v);
}
KN_AI kn_vf kn_vf_add(kn_vf a, kn_vf b)
{
    return _mm256_add_ps(a, b);
}
KN_AI kn_vf kn_vf_mul(kn_vf a, kn_vf b)
{
    return _mm256_mul_ps(a, b);
}
KN_AI kn_vf kn_vf_fma(kn_vf a, kn_vf b, kn_vf c)
{
    return _mm256_fmadd_ps(a, b, c);
}
KN_AI kn_vf kn_vf_fnma(kn_vf a, kn_vf b, kn_vf c)
{
    return _mm256_fnmadd_ps(a, b, c);
}
KN_AI kn_vf kn_vf_cvt(kn_vi a)
{
    return _mm256_cvtepi32_ps(a);
}
KN_AI kn_vf kn_vf_ld_f16(const void *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

static const int32_t kn_mask_tab[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

/* Writes (first k-chunk) or adds (later ones) the first nr lanes of an 8-row accumulator. */
KN_AI void kn_store_rows(float *yp, int nr, kn_vf acc, int first)
{
    if (nr == KN_PR) {
        if (!first) acc = _mm256_add_ps(acc, _mm256_loadu_ps(yp));
        _mm256_storeu_ps(yp, acc);
        return;
    }
    const __m256i mask = _mm256_loadu_si256((const __m256i *)(kn_mask_tab + 8 - nr));
    if (!first) acc = _mm256_add_ps(acc, _mm256_maskload_ps(yp, mask));
    _mm256_maskstore_ps(yp, mask, acc);
}

/* v, opaque to the optimizer: keeps GCC from re-associating an accumulation chain into a tree
 * (which computes every product first and spills them: 16 ymm registers are few). */
KN_AI __m256i kn_keep(__m256i v)
{
    __asm__("" : "+x"(v));
    return v;
}

KN_AI kn_vi kn_bcast32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32((int)v);
}

/* s[i] = c[i * c_stride] (0 without c) + the dot of n vectors of u8 weights with the n
 * activation groups at x + i * x_stride, for the N activation rows of a tile: vpmaddubsw
 * pair-sums added in int16 lim at a time (they stay below 2^15 for w <= 15 and lim 8, or w <= 63
 * and lim 2), then widened by vpmaddwd. Each weight vector is loaded once for all N rows. split:
 * two int16 chains, for latency when few rows share the weights. */
KN_AI void kn_dot_u8(const kn_vi *w, const int n, const int lim, const uint8_t *x, size_t x_stride,
                     const int N, const int32_t *c, int c_stride, kn_vi *s, const int split)
{
    const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
    for (int j0 = 0; j0 < n; j0 += lim) {
        __m256i t[KN_NT], u[KN_NT];
#pragma GCC unroll 4
        for (int i = 0; i < N; i++) {
            t[i] = _mm256_maddubs_epi16(w[j0], kn_bcast32(x + (size_t)i * x_stride + 4 * j0));
            u[i] = _mm256_setzero_si256();
        }
#pragma GCC unroll 8
        for (int j = j0 + 1; j < j0 + lim; j++) {
            const __m256i wj = w[j];
#pragma GCC unroll 4
            for (int i = 0; i < N; i++) {
                const __m256i p =
                    _mm256_maddubs_epi16(wj, kn_bcast32(x + (size_t)i * x_stride + 4 * j));
                if (split && (j & 1))
                    u[i] = kn_keep(_mm256_add_epi16(u[i], p));
                else
                    t[i] = kn_keep(_mm256_add_epi16(t[i], p));
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < N; i++) {
            if (split) t[i] = _mm256_add_epi16(t[i], u[i]);
            const __m256i p = _mm256_madd_epi16(t[i], ones);
            s[i] = j0 ? _mm256_add_epi32(s[i], p) : p;
        }
    }
    if (c)
#pragma GCC unroll 4
        for (int i = 0; i < N; i++)
            s[i] = _mm256_add_epi32(s[i], _mm256_set1_epi32(c[(size_t)i * (size_t)c_stride]));
}

/* A 32-element block: nibbles (0..15; elements 0..15 in the low nibbles of groups 0..3, 16..31
 * in the high ones), or for Q8_0 |w| and the signed bytes for the sign trick. */
typedef struct kn_w32 {
    kn_vi q[8], sg[8];
} kn_w32;

KN_AI void kn_w32_prep(int q8, const uint8_t *g, kn_w32 *w)
{
    if (q8) {
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const __m256i r = kn_vi_ld(g + (size_t)j * 32);
            w->sg[j] = r;
            w->q[j] = _mm256_sign_epi8(r, r);
        }
        return;
    }
    const __m256i lo = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        const __m256i r = kn_vi_ld(g + (size_t)j * 32);
        w->q[j] = _mm256_and_si256(r, lo);
        w->q[j + 4] = _mm256_and_si256(_mm256_srli_epi32(r, 4), lo);
    }
}

/* s[i] = the integer dot of the block with activation block xq + i * x_stride (+ c[i*c_stride]),
 * i < N. */
KN_AI void kn_w32_dot(int q8, const kn_w32 *w, const uint8_t *xq, size_t x_stride, const int N,
                      const int32_t *c, int c_stride, kn_vi *s, const int split)
{
    if (!q8) {
        kn_dot_u8(w->q, 8, 8, xq, x_stride, N, c, c_stride, s, split);
        return;
    }
    (void)c, (void)c_stride; /* the sign trick needs no correction */
    /* |x_q| <= 127 (our quantizers never give -128), so sign() cannot overflow */
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s2[KN_NT];
#pragma GCC unroll 4
    for (int i = 0; i < N; i++) s[i] = s2[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        const __m256i q = w->q[j], sg = w->sg[j];
#pragma GCC unroll 4
        for (int i = 0; i < N; i++) {
            const __m256i xv = kn_bcast32(xq + (size_t)i * x_stride + 4 * j);
            const __m256i p =
                _mm256_madd_epi16(_mm256_maddubs_epi16(q, _mm256_sign_epi8(xv, sg)), ones);
            if (split && (j & 1))
                s2[i] = kn_keep(_mm256_add_epi32(s2[i], p));
            else
                s[i] = kn_keep(_mm256_add_epi32(s[i], p));
        }
    }
    if (split)
#pragma GCC unroll 4
        for (int i = 0; i < N; i++) s[i] = _mm256_add_epi32(s[i], s2[i]);
}

/* ------------------------------------------------------------------ float weights */

KN_AI __m256 kn_loadf(md_type ft, const void *p, int64_t j)
{
    switch (ft) {
    case MD_TYPE_F16:
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const kn_f16 *)p + j)));
    case MD_TYPE_BF16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const kn_bf16 *)p + j))), 16));
    default:
        return _mm256_loadu_ps((const float *)p + j);
    }
}

KN_AI float kn_scalarf(md_type ft, const void *p, int64_t j)
{
    switch (ft) {
    case MD_TYPE_F16:
        return _cvtsh_ss(((const kn_f16 *)p)[j]);
    case MD_TYPE_BF16: {
        const uint32_t u = (uint32_t)((const kn_bf16 *)p)[j] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    default:
        return ((const float *)p)[j];
    }
}

KN_AI void kn_tilef(md_type ft, const uint8_t *w, size_t w_stride, const uint8_t *x,
                    size_t x_stride, int64_t k, int R, int N, float *y, size_t y_stride)
{
    __m256 acc[4][2];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int i = 0; i < N; i++) acc[r][i] = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= k; j += 8) {
        __m256 xv[2];
#pragma GCC unroll 2
        for (int i = 0; i < N; i++) xv[i] = kn_loadf(ft, x + (size_t)i * x_stride, j);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256 wv = kn_loadf(ft, w + (size_t)r * w_stride, j);
#pragma GCC unroll 2
            for (int i = 0; i < N; i++) acc[r][i] = _mm256_fmadd_ps(wv, xv[i], acc[r][i]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int i = 0; i < N; i++) {
            float s = kn_hsum256(acc[r][i]);
            for (int64_t t = j; t < k; t++)
                s += kn_scalarf(ft, w + (size_t)r * w_stride, t) *
                     kn_scalarf(ft, x + (size_t)i * x_stride, t);
            y[(size_t)i * y_stride + (size_t)r] = s;
        }
}

/* ------------------------------------------------------------------ activation quantization */

KN_AI int kn_hsum_i32(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
    return _mm_cvtsi128_si32(s);
}

/* The largest lane, reduced in the order ggml's quantizer reduces it (which lane wins a NaN). */
KN_AI float kn_q8_hmax(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* One Q8_0/Q8_1 block exactly as ggml's AVX2 quantize_row_q8_0/q8_1; returns the sum of the
 * stored quants. */
KN_AI int kn_q8_block(const float *x, int8_t *qs, kn_f16 *dout, float *dval)
{
    __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
    __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 a = _mm256_andnot_ps(sign, v0);
    a = _mm256_max_ps(a, _mm256_andnot_ps(sign, v1));
    a = _mm256_max_ps(a, _mm256_andnot_ps(sign, v2));
    a = _mm256_max_ps(a, _mm256_andnot_ps(sign, v3));
    const float amax = kn_q8_hmax(a);
    const float d = amax / 127.f;
    const float id = amax != 0.0f ? 127.f / amax : 0.0f;
    const __m256 mul = _mm256_set1_ps(id);
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, mul));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, mul));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, mul));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, mul));
    i0 = _mm256_packs_epi32(i0, i1);
    i2 = _mm256_packs_epi32(i2, i3);
    i0 = _mm256_packs_epi16(i0, i2);
    i0 = _mm256_permutevar8x32_epi32(i0, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)qs, i0);
    *dout = _cvtss_sh(d, 0);
    *dval = d;
    /* sum of the stored int8: sad of (q + 128) against 0, less 32 * 128 */
    const __m256i s =
        _mm256_sad_epu8(_mm256_xor_si256(i0, _mm256_set1_epi8((char)0x80)), _mm256_setzero_si256());
    return kn_hsum_i32(s) - 4096;
}

/* One Q8_K block (ggml's quantize_row_q8_K_ref) into y (unaligned). */
KN_AI void kn_q8K_block(const float *x, uint8_t *y)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    kn_block_q8_K blk;
    __m256 a = _mm256_setzero_ps();
    for (int j = 0; j < 32; j++)
        a = _mm256_max_ps(a, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * j)));
    const float amax = kn_q8_hmax(a);
    memset(&blk, 0, sizeof blk);
    if (amax == 0.0f) {
        memcpy(y, &blk, sizeof blk);
        return;
    }
    float max = 0;
    const __m256 va = _mm256_set1_ps(amax);
    for (int j = 0; j < 32; j++) {
        const int hit = _mm256_movemask_ps(
            _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * j)), va, _CMP_EQ_OQ));
        if (hit) {
            max = x[8 * j + __builtin_ctz((unsigned)hit)];
            break;
        }
    }
    const float iscale = -127.f / max;
    blk.d = 1 / iscale;
    /* iscale overflows only for |max| < ~3.7e-37; ggml's nearest_int then maps every element to
     * a value whose int8 is 0 */
    if (isinf(iscale)) {
        memcpy(y, &blk, sizeof blk);
        return;
    }
    /* |iscale * x| <= 127 here, where rounding to nearest even equals nearest_int */
    const __m256 vs = _mm256_set1_ps(iscale);
    for (int j = 0; j < 16; j++) {
        __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * j), vs));
        __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * j + 8), vs));
        q0 = _mm256_min_epi32(q0, _mm256_set1_epi32(127));
        q1 = _mm256_min_epi32(q1, _mm256_set1_epi32(127));
        blk.bsums[j] = (int16_t)kn_hsum_i32(_mm256_add_epi32(q0, q1));
        __m256i p = _mm256_packs_epi32(q0, q1); /* 0..3 8..11 4..7 12..15 */
        p = _mm256_permute4x64_epi64(p, 0xD8);  /* 0..15 as int16 */
        const __m128i b8 =
            _mm_packs_epi16(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
        _mm_storeu_si128((__m128i *)(blk.qs + 16 * j), b8);
    }
    memcpy(y, &blk, sizeof blk);
}

KN_AI void kn_f16_row(const float *x, kn_f16 *y, int64_t n)
{
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i *)(y + j), _mm256_cvtps_ph(_mm256_loadu_ps(x + j), 0));
    for (; j < n; j++) y[j] = _cvtss_sh(x[j], 0);
}

KN_AI void kn_bf16_row(const float *x, kn_bf16 *y, int64_t n)
{
    int64_t j = 0;
    const __m256i abs = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    for (; j + 8 <= n; j += 8) {
        const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(x + j));
        const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs), inf);
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(
            _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
        r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(64)),
                               nan);
        const __m128i p =
            _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        _mm_storeu_si128((__m128i *)(y + j), p);
    }
    if (j < n) kn_quantize_row_ref(MD_TYPE_BF16, x + j, y + j, n - j);
}

#include "kernels/cpu/quant_simd.h"
