/*
 * quant_avx512.c — the AVX-512 (F/BW/VL/DQ + VNNI) primitives of the quantized matrix multiply
 * and of the activation quantization; the drivers are quant_simd.h's, shared with
 * quant_avx2.c. Held to quant_ref.c by tests/unit/test_kernels_quant.c.
 *
 * Panels are 16 rows (one zmm lane of 4 quant bytes each); micro-tiles up to 8 activation rows.
 * A 4-byte activation group broadcast to all lanes feeds one vpdpbusd (u8 weights x s8
 * activations) that advances 16 dot products by 4 products each; Q8_0's signed weights are biased
 * to u8 by +128 (KN_S8_BIAS: the integer sum starts at -128 * sum(x_q)). With one or two
 * activation rows the 8-deep vpdpbusd chains are split in two for latency. k-chunks are 256
 * blocks (k up to 8192 in one pass), so decode streams each panel once. (An AMX-INT8 path was
 * built and measured no faster on this hardware; docs/kernels.md says why.)
 *
 * Float weights (F32, F16, BF16) use a direct 4 x 4 register tile of row-by-column dot products
 * reduced at the end; BF16 uses vdpbf16ps when the CPU has AVX512_BF16 (checked at run time,
 * since the table only requires VNNI), as ggml does. Activation quantization is bit-identical to
 * the reference.
 */
#include <assert.h>
#include <immintrin.h>
#include <string.h>

#include "kernels/cpu/internal.h"
#include "kernels/cpu/simd_avx512.h"

#define KN_SFX       avx512
#define KN_PR        16        /* weight rows per panel: one int32 lane each */
#define KN_NT        8         /* activation rows per micro-tile */
#define KN_NC        64        /* activation rows per column chunk (activation table) */
#define KN_KC        256       /* 32-element blocks per k-chunk */
#define KN_KCK       4         /* 256-element super-blocks per k-chunk */
#define KN_XTAB      (64 * 32) /* activation table entries */
#define KN_S8_BIAS   128       /* Q8_0 weights biased to u8 */
#define KN_FT_N      4         /* float-tile columns */
#define KN_MIN_APART 1         /* Q4_1's min term in an accumulator of its own */

typedef __m512i kn_vi;
typedef __m512 kn_vf;

KN_AI kn_vi kn_vi_ld(const void *p)
{
    return _mm512_loadu_si512(p);
}
KN_AI kn_vi kn_vi_set1(int32_t v)
{
    return _mm512_set1_epi32(v);
}
KN_AI kn_vi kn_vi_zero(void)
{
    return _mm512_setzero_si512();
}
KN_AI kn_vi kn_vi_and(kn_vi a, kn_vi b)
{
    return _mm512_and_si512(a, b);
}
KN_AI kn_vi kn_vi_or(kn_vi a, kn_vi b)
{
    return _mm512_or_si512(a, b);
}
KN_AI kn_vi kn_vi_add(kn_vi a, kn_vi b)
{
    return _mm512_add_epi32(a, b);
}
KN_AI kn_vi kn_vi_srli(kn_vi a, int n)
{
    return _mm512_srli_epi32(a, n);
}
KN_AI kn_vi kn_vi_slli(kn_vi a, int n)
{
    return _mm512_slli_epi32(a, n);
}
KN_AI kn_vi kn_vi_srai(kn_vi a, int n)
{
    return _mm512_srai_epi32(a, n);
}
KN_AI kn_vi kn_vi_madd16(kn_vi a, kn_vi b)
{
    return _mm512_madd_epi16(a, b);
}
KN_AI kn_vf kn_vf_zero(void)
{
    return _mm512_setzero_ps();
}
KN_AI kn_vf kn_vf_set1(float v)
{
    return _mm512_set1_ps(v);
}
KN_AI kn_vf kn_vf_add(kn_vf a, kn_vf b)
{
    return _mm512_add_ps(a, b);
}
KN_AI kn_vf kn_vf_mul(kn_vf a, kn_vf b)
{
    return _mm512_mul_ps(a, b);
}
KN_AI kn_vf kn_vf_fma(kn_vf a, kn_vf b, kn_vf c)
{
    return _mm512_fmadd_ps(a, b, c);
}
KN_AI kn_vf kn_vf_fnma(kn_vf a, kn_vf b, kn_vf c)
{
    return _mm512_fnmadd_ps(a, b, c);
}
KN_AI kn_vf kn_vf_cvt(kn_vi a)
{
    return _mm512_cvtepi32_ps(a);
}
KN_AI kn_vf kn_vf_ld_f16(const void *p)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* Writes (first k-chunk) or adds (later ones) the first nr lanes of a 16-row accumulator. */
KN_AI void kn_store_rows(float *yp, int nr, kn_vf acc, int first)
{
    const __mmask16 mask = kn_mask16(nr);
    if (!first) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, yp));
    _mm512_mask_storeu_ps(yp, mask, acc);
}

KN_AI kn_vi kn_bcast32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32((int)v);
}

/* s[i] = c[i * c_stride] (0 without c) + the dot of n vectors of u8 weights with the n activation
 * groups at x + i * x_stride, for the N activation rows of a tile, one vpdpbusd each (lim is AVX2's
 * concern: VNNI accumulates in int32). split: two chains, for latency when few rows share the
 * weights. */
KN_AI void kn_dot_u8(const kn_vi *w, const int n, const int lim, const uint8_t *x, size_t x_stride,
                     const int N, const int32_t *c, int c_stride, kn_vi *s, const int split)
{
    (void)lim;
    __m512i s2[KN_NT];
#pragma GCC unroll 8
    for (int i = 0; i < N; i++) {
        s[i] = c ? _mm512_set1_epi32(c[(size_t)i * (size_t)c_stride]) : _mm512_setzero_si512();
        s2[i] = _mm512_setzero_si512();
    }
#pragma GCC unroll 8
    for (int j = 0; j < n; j++) {
#pragma GCC unroll 8
        for (int i = 0; i < N; i++) {
            const __m512i xv = kn_bcast32(x + (size_t)i * x_stride + 4 * j);
            if (split && (j & 1))
                s2[i] = _mm512_dpbusd_epi32(s2[i], w[j], xv);
            else
                s[i] = _mm512_dpbusd_epi32(s[i], w[j], xv);
        }
    }
    if (split)
#pragma GCC unroll 8
        for (int i = 0; i < N; i++) s[i] = _mm512_add_epi32(s[i], s2[i]);
}

/* A 32-element block as u8: nibbles (elements 0..15 in the low nibbles of groups 0..3, 16..31
 * in the high ones), or Q8_0's bytes biased by +128. */
typedef struct kn_w32 {
    kn_vi q[8];
} kn_w32;

KN_AI void kn_w32_prep(int q8, const uint8_t *g, kn_w32 *w)
{
    if (q8) {
        const __m512i sign = _mm512_set1_epi8((char)0x80);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) w->q[j] = _mm512_xor_si512(kn_vi_ld(g + (size_t)j * 64), sign);
        return;
    }
    const __m512i lo = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        const __m512i r = kn_vi_ld(g + (size_t)j * 64);
        w->q[j] = _mm512_and_si512(r, lo);
        w->q[j + 4] = _mm512_and_si512(_mm512_srli_epi32(r, 4), lo);
    }
}

/* s[i] = c[i * c_stride] + the integer dot of the block with activation block xq + i * x_stride,
 * i < N (c carries Q4_0's and Q8_0's bias corrections). */
KN_AI void kn_w32_dot(int q8, const kn_w32 *w, const uint8_t *xq, size_t x_stride, const int N,
                      const int32_t *c, int c_stride, kn_vi *s, const int split)
{
    (void)q8;
    kn_dot_u8(w->q, 8, 8, xq, x_stride, N, c, c_stride, s, split);
}

/* ------------------------------------------------------------------ float weights */

/* 16 elements of a float-type row as f32 (masked for the tail). */
KN_AI __m512 kn_loadf(md_type ft, const void *p, int64_t j, __mmask16 mask)
{
    switch (ft) {
    case MD_TYPE_F16:
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, (const kn_f16 *)p + j));
    case MD_TYPE_BF16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, (const kn_bf16 *)p + j)), 16));
    default:
        return _mm512_maskz_loadu_ps(mask, (const float *)p + j);
    }
}

/* Y for R weight rows x N activation rows: vector partial sums over k, reduced at the end. */
KN_AI void kn_tilef_fma(md_type ft, const uint8_t *w, size_t w_stride, const uint8_t *x,
                        size_t x_stride, int64_t k, int R, int N, float *y, size_t y_stride)
{
    __m512 acc[4][4];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 16
        for (int i = 0; i < N; i++) acc[r][i] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= k; j += 16) {
        __m512 xv[4];
#pragma GCC unroll 16
        for (int i = 0; i < N; i++) xv[i] = kn_loadf(ft, x + (size_t)i * x_stride, j, 0xFFFF);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const __m512 wv = kn_loadf(ft, w + (size_t)r * w_stride, j, 0xFFFF);
#pragma GCC unroll 16
            for (int i = 0; i < N; i++) acc[r][i] = _mm512_fmadd_ps(wv, xv[i], acc[r][i]);
        }
    }
    if (j < k) {
        const __mmask16 mask = (__mmask16)((1u << (k - j)) - 1);
        __m512 xv[4];
#pragma GCC unroll 16
        for (int i = 0; i < N; i++) xv[i] = kn_loadf(ft, x + (size_t)i * x_stride, j, mask);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const __m512 wv = kn_loadf(ft, w + (size_t)r * w_stride, j, mask);
#pragma GCC unroll 16
            for (int i = 0; i < N; i++) acc[r][i] = _mm512_fmadd_ps(wv, xv[i], acc[r][i]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 16
        for (int i = 0; i < N; i++)
            y[(size_t)i * y_stride + (size_t)r] = _mm512_reduce_add_ps(acc[r][i]);
}

/* BF16 pairs through vdpbf16ps (products exact, sums in f32 with denormals flushed). */
__attribute__((target("avx512bf16"))) KN_AI void kn_tile_bf16dp(const uint8_t *w, size_t w_stride,
                                                                const uint8_t *x, size_t x_stride,
                                                                int64_t k, int R, int N, float *y,
                                                                size_t y_stride)
{
    __m512 acc[4][4];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 16
        for (int i = 0; i < N; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 32) {
        const __mmask32 mask = k - j >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << (k - j)) - 1);
        __m512bh xv[4];
#pragma GCC unroll 16
        for (int i = 0; i < N; i++)
            xv[i] = (__m512bh)_mm512_maskz_loadu_epi16(
                mask, (const kn_bf16 *)(x + (size_t)i * x_stride) + j);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(
                mask, (const kn_bf16 *)(w + (size_t)r * w_stride) + j);
#pragma GCC unroll 16
            for (int i = 0; i < N; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], wv, xv[i]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 16
        for (int i = 0; i < N; i++)
            y[(size_t)i * y_stride + (size_t)r] = _mm512_reduce_add_ps(acc[r][i]);
}

static int kn_has_bf16dp(void)
{
    static int has = -1;
    if (has < 0) {
        __builtin_cpu_init();
        has = __builtin_cpu_supports("avx512bf16") ? 1 : 0;
    }
    return has;
}

KN_AI void kn_tilef(md_type ft, const uint8_t *w, size_t w_stride, const uint8_t *x,
                    size_t x_stride, int64_t k, int R, int N, float *y, size_t y_stride)
{
    if (ft == MD_TYPE_BF16 && kn_has_bf16dp())
        kn_tile_bf16dp(w, w_stride, x, x_stride, k, R, N, y, y_stride);
    else
        kn_tilef_fma(ft, w, w_stride, x, x_stride, k, R, N, y, y_stride);
}

/* ------------------------------------------------------------------ activation quantization */

/* Q8_0 / Q8_1 one block: ggml's x86 quantize_row_q8_0/q8_1 (see quant_ref.c). */
KN_AI int kn_q8_block(const float *x, int8_t *qs, kn_f16 *dout, float *dval)
{
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const __m512 a = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1));
    const float amax = _mm512_reduce_max_ps(a);
    const float d = amax / 127.f;
    const float id = amax != 0.0f ? 127.f / amax : 0.0f;
    const __m512 vid = _mm512_set1_ps(id);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
    _mm_storeu_si128((__m128i *)qs, _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)(qs + 16), _mm512_cvtsepi32_epi8(q1));
    *dout = _cvtss_sh(d, 0);
    *dval = d;
    /* the sum of the stored (saturated) values; they differ from q only in all-subnormal blocks */
    const __m512i lo = _mm512_set1_epi32(-128), hi = _mm512_set1_epi32(127);
    const __m512i c0 = _mm512_min_epi32(_mm512_max_epi32(q0, lo), hi);
    const __m512i c1 = _mm512_min_epi32(_mm512_max_epi32(q1, lo), hi);
    return _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
}

/* One Q8_K block (ggml's quantize_row_q8_K_ref) into y (unaligned). */
KN_AI void kn_q8K_block(const float *x, uint8_t *y)
{
    kn_block_q8_K blk;
    __m512 v[16], a = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) {
        v[j] = _mm512_loadu_ps(x + 16 * j);
        a = _mm512_max_ps(a, _mm512_abs_ps(v[j]));
    }
    const float amax = _mm512_reduce_max_ps(a);
    if (amax == 0.0f) { /* also all -0.0 */
        memset(&blk, 0, sizeof blk);
        memcpy(y, &blk, sizeof blk);
        return;
    }
    /* the signed value of the first element of largest magnitude */
    float max = 0;
    const __m512 va = _mm512_set1_ps(amax);
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_abs_ps(v[j]), va, _CMP_EQ_OQ);
        if (hit) {
            max = x[16 * j + __builtin_ctz(hit)];
            break;
        }
    }
    const float iscale = -127.f / max;
    /* ggml's nearest_int through the float adder, then MIN(127, v) and an int8 store; the _round
     * forms keep the compiler from fusing the multiply and the add. */
    const __m512 vs = _mm512_set1_ps(iscale), magic = _mm512_set1_ps(12582912.f);
    const __m512i mant = _mm512_set1_epi32(0x007fffff), bias = _mm512_set1_epi32(0x00400000);
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) {
        const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        const __m512 tv = _mm512_add_round_ps(_mm512_mul_round_ps(v[j], vs, rn), magic, rn);
        __m512i q = _mm512_sub_epi32(_mm512_and_si512(_mm512_castps_si512(tv), mant), bias);
        q = _mm512_min_epi32(q, _mm512_set1_epi32(127));
        q = _mm512_srai_epi32(_mm512_slli_epi32(q, 24), 24); /* the int8 it becomes */
        _mm_storeu_si128((__m128i *)(blk.qs + 16 * j), _mm512_cvtepi32_epi8(q));
        blk.bsums[j] = (int16_t)_mm512_reduce_add_epi32(q);
    }
    blk.d = 1 / iscale;
    memcpy(y, &blk, sizeof blk);
}

KN_AI void kn_f16_row(const float *x, kn_f16 *y, int64_t n)
{
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 mask = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(mask, x + j);
        _mm256_mask_storeu_epi16(y + j, mask,
                                 _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
}

KN_AI void kn_bf16_row(const float *x, kn_bf16 *y, int64_t n)
{
    const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 mask = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        const __m512i u = _mm512_castps_si512(_mm512_maskz_loadu_ps(mask, x + j));
        const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, abs), inf);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
        r = _mm512_mask_mov_epi32(r, nan,
                                  _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(64)));
        _mm256_mask_storeu_epi16(y + j, mask, _mm512_cvtepi32_epi16(r));
    }
}

#include "kernels/cpu/quant_simd.h"
