/*
 * ops_avx2.c — the AVX2 (+FMA, F16C) build of the non-matmul kernels (RMS norm, RoPE, SwiGLU,
 * add, f16 conversions, paged attention). Vector bodies are 8 floats wide; the few leftover
 * elements go through the same scalar expressions as ops_ref.c. Held to the reference by
 * tests/unit/test_kernels_ops.c.
 *
 * Attention follows the AVX-512 design (see ops_avx512.c) at half the width: 8-token blocks (one
 * ymm of scores per head) with an online softmax over the pages, each K row converted once for a
 * group of up to 4 query heads, 2 rows at a time, partial sums folded into a score vector with a
 * shuffle tree, V accumulated with several independent FMA chains, next pages prefetched.
 * expf is a Cephes-style polynomial (about 1 ulp); 2^n is applied as two exact power-of-two
 * factors so that subnormal and overflowing results come out as expf's do.
 * Quantized, mixed-format and attn_mass views are handed to attn_kv_avx2.c.
 */
#include <assert.h>
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kernels/cpu/internal.h"
#include "kernels/cpu/attn_kv.h"
#include "kernels/cpu/simd_avx2.h"

#define KN_ATT_MAXQ     32
#define KN_ATT_GROUP    4
#define KN_ATT_PF_PAGES 2
#define KN_ATT_PF_BYTES 4096

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

KN_AI __m256 kn_kv8(const uint16_t *p, const int bf)
{
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (bf) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* Scores of a block of nt <= 8 K rows against NQ query heads: s[h] lane t = scale * q[h]·K[t],
 * lanes >= nt = -inf. */
KN_AI void kn_att_scores(const uint16_t *K, int nt, int hd, const float *q, float scale, __m256 *s,
                         const int NQ, const int BF)
{
    __m256 d[KN_ATT_GROUP][4];
#pragma GCC unroll 4
    for (int sb = 0; sb < 4; sb++) {
        const int r0 = 2 * sb;
        if (r0 >= nt) {
#pragma GCC unroll 4
            for (int h = 0; h < NQ; h++) d[h][sb] = _mm256_setzero_ps();
            continue;
        }
        /* A row past nt re-reads the last valid row (never past the block); masked out below. */
        const uint16_t *k0 = K + (size_t)r0 * hd;
        const uint16_t *k1 = K + (size_t)(r0 + 1 < nt ? r0 + 1 : nt - 1) * hd;
        __m256 acc[KN_ATT_GROUP][2];
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
        for (int c = 0; c < hd; c += 8) {
            const __m256 x0 = kn_kv8(k0 + c, BF), x1 = kn_kv8(k1 + c, BF);
#pragma GCC unroll 4
            for (int h = 0; h < NQ; h++) {
                const __m256 qv = _mm256_loadu_ps(q + (size_t)h * hd + c);
                acc[h][0] = _mm256_fmadd_ps(x0, qv, acc[h][0]);
                acc[h][1] = _mm256_fmadd_ps(x1, qv, acc[h][1]);
            }
        }
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++) d[h][sb] = kn_fold2(acc[h][0], acc[h][1]);
    }
    const __m256 valid = kn_valid8(nt);
    const __m256 vscale = _mm256_set1_ps(scale);
#pragma GCC unroll 4
    for (int h = 0; h < NQ; h++)
        s[h] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                _mm256_mul_ps(kn_fold8(d[h][0], d[h][1], d[h][2], d[h][3]), vscale),
                                valid);
}

/* One block of nt <= 8 rows for NQ query heads: scores, online-softmax update, out += p·V. */
KN_AI void kn_att_block(const uint16_t *K, const uint16_t *V, int nt, int hd, const float *q,
                        float scale, float *o, float *m, __m256 *l, const int NQ, const int BF)
{
    __m256 sc[KN_ATT_GROUP];
    kn_att_scores(K, nt, hd, q, scale, sc, NQ, BF);
    const __m256 valid = kn_valid8(nt);
    float pb[KN_ATT_GROUP][8] __attribute__((aligned(32)));
#pragma GCC unroll 4
    for (int h = 0; h < NQ; h++) {
        const __m256 s = sc[h];
        if (_mm256_movemask_ps(_mm256_cmp_ps(s, _mm256_set1_ps(m[h]), _CMP_GT_OQ))) {
            /* A new maximum: rescale what was accumulated under the old one. */
            const float bm = kn_hmax256(s);
            const float corr = expf(m[h] - bm);
            const __m256 vc = _mm256_set1_ps(corr);
            m[h] = bm;
            l[h] = _mm256_mul_ps(l[h], vc);
            float *oh = o + (size_t)h * hd;
            for (int c = 0; c < hd; c += 8)
                _mm256_storeu_ps(oh + c, _mm256_mul_ps(_mm256_loadu_ps(oh + c), vc));
        }
        const __m256 p = _mm256_and_ps(valid, kn_exp256(_mm256_sub_ps(s, _mm256_set1_ps(m[h]))));
        l[h] = _mm256_add_ps(l[h], p);
        _mm256_store_ps(pb[h], p);
    }

    /* out[h] += sum_t p[h][t] * V[t]; W*8 dimensions at a time keep W*NQ FMA chains in flight. */
    const int W = NQ <= 2 ? 4 : 2;
    int c = 0;
    for (; c + 8 * W <= hd; c += 8 * W) {
        __m256 a[KN_ATT_GROUP][4];
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++)
#pragma GCC unroll 4
            for (int w = 0; w < W; w++) a[h][w] = _mm256_loadu_ps(o + (size_t)h * hd + c + 8 * w);
        for (int t = 0; t < nt; t++) {
            const uint16_t *vr = V + (size_t)t * hd + c;
            __m256 v[4];
#pragma GCC unroll 4
            for (int w = 0; w < W; w++) v[w] = kn_kv8(vr + 8 * w, BF);
#pragma GCC unroll 4
            for (int h = 0; h < NQ; h++) {
                const __m256 ph = _mm256_broadcast_ss(&pb[h][t]);
#pragma GCC unroll 4
                for (int w = 0; w < W; w++) a[h][w] = _mm256_fmadd_ps(ph, v[w], a[h][w]);
            }
        }
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++)
#pragma GCC unroll 4
            for (int w = 0; w < W; w++) _mm256_storeu_ps(o + (size_t)h * hd + c + 8 * w, a[h][w]);
    }
    for (; c < hd; c += 8) {
        __m256 a[KN_ATT_GROUP];
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++) a[h] = _mm256_loadu_ps(o + (size_t)h * hd + c);
        for (int t = 0; t < nt; t++) {
            const __m256 v0 = kn_kv8(V + (size_t)t * hd + c, BF);
#pragma GCC unroll 4
            for (int h = 0; h < NQ; h++)
                a[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(&pb[h][t]), v0, a[h]);
        }
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++) _mm256_storeu_ps(o + (size_t)h * hd + c, a[h]);
    }
}

typedef void (*kn_att_block_fn)(const uint16_t *K, const uint16_t *V, int nt, int hd,
                                const float *q, float scale, float *o, float *m, __m256 *l);

#define KN_ATT_INST(nq, bf)                                                                        \
    static void kn_att_block_##nq##_##bf(const uint16_t *K, const uint16_t *V, int nt, int hd,     \
                                         const float *q, float scale, float *o, float *m,          \
                                         __m256 *l)                                                \
    {                                                                                              \
        kn_att_block(K, V, nt, hd, q, scale, o, m, l, nq, bf);                                     \
    }
KN_ATT_INST(1, 0)
KN_ATT_INST(2, 0)
KN_ATT_INST(3, 0)
KN_ATT_INST(4, 0)
KN_ATT_INST(1, 1)
KN_ATT_INST(2, 1)
KN_ATT_INST(3, 1)
KN_ATT_INST(4, 1)

static const kn_att_block_fn kn_att_blocks[2][KN_ATT_GROUP] = {
    {kn_att_block_1_0, kn_att_block_2_0, kn_att_block_3_0, kn_att_block_4_0},
    {kn_att_block_1_1, kn_att_block_2_1, kn_att_block_3_1, kn_att_block_4_1},
};

static void kn_prefetch_block(const uint8_t *p, size_t bytes)
{
    if (bytes > KN_ATT_PF_BYTES) bytes = KN_ATT_PF_BYTES;
    for (size_t i = 0; i < bytes; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T0);
}

void kn_attention_avx2(const kn_kv_view *kv, int head_dim, const float *q, int n_q, float scale,
                       float *out)
{
    /* fp8/int8/int4 pages, mixed-format views and views that want attn_mass: attn_kv_avx2.c */
    if (kn_attention_kv_wants(kv)) {
        kn_attention_kv_avx2(kv, head_dim, q, n_q, scale, out);
        return;
    }
    const int pt = kv->page_tokens, hd = head_dim, n_ctx = kv->n_ctx;
    assert(pt > 0 && hd > 0 && n_q > 0 && n_ctx >= 0);
    assert(q != out);
    assert(kv->format == KN_KV_F16 || kv->format == KN_KV_BF16);
    if (hd % 8) {
        /* Head sizes that are not a multiple of 8 do not occur in the models we serve. */
        kn_attention_ref(kv, head_dim, q, n_q, scale, out);
        return;
    }
    memset(out, 0, sizeof(float) * (size_t)n_q * hd);
    if (n_ctx == 0) return;

    const int bf = kv->format == KN_KV_BF16;
    const size_t blk_bytes = (size_t)pt * hd * 2;
    const int n_pages = (n_ctx + pt - 1) / pt;
    for (int h0 = 0; h0 < n_q; h0 += KN_ATT_MAXQ) {
        const int nh = n_q - h0 < KN_ATT_MAXQ ? n_q - h0 : KN_ATT_MAXQ;
        float m[KN_ATT_MAXQ];
        __m256 l[KN_ATT_MAXQ];
        for (int h = 0; h < nh; h++) {
            m[h] = -INFINITY;
            l[h] = _mm256_setzero_ps();
        }
        for (int pg = 0; pg < KN_ATT_PF_PAGES && pg < n_pages; pg++) {
            kn_prefetch_block(kv->pages[pg] + kv->k_off, blk_bytes);
            kn_prefetch_block(kv->pages[pg] + kv->v_off, blk_bytes);
        }
        for (int pg = 0; pg < n_pages; pg++) {
            if (pg + KN_ATT_PF_PAGES < n_pages) {
                kn_prefetch_block(kv->pages[pg + KN_ATT_PF_PAGES] + kv->k_off, blk_bytes);
                kn_prefetch_block(kv->pages[pg + KN_ATT_PF_PAGES] + kv->v_off, blk_bytes);
            }
            const uint16_t *K = (const uint16_t *)(kv->pages[pg] + kv->k_off);
            const uint16_t *V = (const uint16_t *)(kv->pages[pg] + kv->v_off);
            const int np = n_ctx - pg * pt < pt ? n_ctx - pg * pt : pt;
            for (int b = 0; b < np; b += 8) {
                const int nt = np - b < 8 ? np - b : 8;
                for (int g = 0; g < nh; g += KN_ATT_GROUP) {
                    const int gn = nh - g < KN_ATT_GROUP ? nh - g : KN_ATT_GROUP;
                    const size_t qo = (size_t)(h0 + g) * hd;
                    kn_att_blocks[bf][gn - 1](K + (size_t)b * hd, V + (size_t)b * hd, nt, hd,
                                              q + qo, scale, out + qo, m + g, l + g);
                }
            }
        }
        for (int h = 0; h < nh; h++) {
            const __m256 inv = _mm256_set1_ps(1.0f / kn_hsum256(l[h]));
            float *oh = out + (size_t)(h0 + h) * hd;
            for (int c = 0; c < hd; c += 8)
                _mm256_storeu_ps(oh + c, _mm256_mul_ps(_mm256_loadu_ps(oh + c), inv));
        }
    }
}
