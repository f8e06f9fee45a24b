/*
 * ops_avx512.c — the AVX-512 build of the non-matmul kernels (RMS norm, RoPE, SwiGLU, add, f16
 * conversions, paged attention). Compiled with AVX-512 F/BW/VL/DQ (+F16C); tails are masked, so
 * no scalar loops remain except where noted. Held to ops_ref.c by tests/unit/test_kernels_ops.c.
 *
 * Attention is the kernel that matters: at long context it streams every K and V byte of the
 * sequence once per token and layer, so it is built to run at memory speed:
 *  - the sequence is walked page by page, 16 tokens (one zmm of scores) at a time, with an online
 *    softmax, reading f16/bf16 rows in place and converting them in registers;
 *  - each K row is loaded and converted once for a group of up to 4 query heads (the GQA group),
 *    4 rows at a time, and the 16x16 dot-product partials of a block are folded into one score
 *    vector with a shuffle tree instead of 16 horizontal sums;
 *  - V is accumulated into `out` 64 dimensions at a time with 4*NQ independent FMA chains;
 *  - the next pages' K and V blocks are prefetched, since pages are scattered in memory and the
 *    hardware prefetcher cannot follow a page table.
 * expf is a Cephes-style polynomial (about 1 ulp) with AVX-512 scalef for the exponent.
 * Quantized, mixed-format and attn_mass views are handed to attn_kv_avx512.c.
 */
#include <assert.h>
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kernels/cpu/internal.h"
#include "kernels/cpu/attn_kv.h"
#include "kernels/cpu/simd_avx512.h"

/* Query heads whose softmax state is kept on the stack at once; more are done in further passes. */
#define KN_ATT_MAXQ 32
/* Query heads that share one pass over a K/V row (register budget of the score and PV loops). */
#define KN_ATT_GROUP 4
/* How many pages ahead the K/V blocks are prefetched, and how many bytes of each block. */
#define KN_ATT_PF_PAGES 2
#define KN_ATT_PF_BYTES 4096

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

/* 16 f16 or bf16 values to f32. */
KN_AI __m512 kn_kv16(const uint16_t *p, const int bf)
{
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (bf) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* Scores of a block of nt <= 16 K rows (row-major, hd elements a row) against NQ query heads:
 * s[h] lane t = scale * q[h]·K[t], lanes >= nt = -inf. */
KN_AI void kn_att_scores(const uint16_t *K, int nt, int hd, const float *q, float scale, __m512 *s,
                         const int NQ, const int BF)
{
    __m512 d[KN_ATT_GROUP][4];
#pragma GCC unroll 4
    for (int sb = 0; sb < 4; sb++) {
        const int r0 = 4 * sb;
        if (r0 >= nt) {
#pragma GCC unroll 4
            for (int h = 0; h < NQ; h++) d[h][sb] = _mm512_setzero_ps();
            continue;
        }
        /* Rows past nt re-read the last valid row (never past the block); masked out below. */
        const uint16_t *k0 = K + (size_t)r0 * hd;
        const uint16_t *k1 = K + (size_t)(r0 + 1 < nt ? r0 + 1 : nt - 1) * hd;
        const uint16_t *k2 = K + (size_t)(r0 + 2 < nt ? r0 + 2 : nt - 1) * hd;
        const uint16_t *k3 = K + (size_t)(r0 + 3 < nt ? r0 + 3 : nt - 1) * hd;
        __m512 acc[KN_ATT_GROUP][4];
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++)
            acc[h][0] = acc[h][1] = acc[h][2] = acc[h][3] = _mm512_setzero_ps();
        for (int c = 0; c < hd; c += 16) {
            const __m512 x0 = kn_kv16(k0 + c, BF), x1 = kn_kv16(k1 + c, BF);
            const __m512 x2 = kn_kv16(k2 + c, BF), x3 = kn_kv16(k3 + c, BF);
#pragma GCC unroll 4
            for (int h = 0; h < NQ; h++) {
                const __m512 qv = _mm512_loadu_ps(q + (size_t)h * hd + c);
                acc[h][0] = _mm512_fmadd_ps(x0, qv, acc[h][0]);
                acc[h][1] = _mm512_fmadd_ps(x1, qv, acc[h][1]);
                acc[h][2] = _mm512_fmadd_ps(x2, qv, acc[h][2]);
                acc[h][3] = _mm512_fmadd_ps(x3, qv, acc[h][3]);
            }
        }
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++)
            d[h][sb] = kn_fold4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
    }
    const __mmask16 valid = kn_mask16(nt);
    const __m512 vscale = _mm512_set1_ps(scale);
#pragma GCC unroll 4
    for (int h = 0; h < NQ; h++)
        s[h] = _mm512_mask_blend_ps(
            valid, _mm512_set1_ps(-INFINITY),
            _mm512_mul_ps(kn_fold16(d[h][0], d[h][1], d[h][2], d[h][3]), vscale));
}

/* One block of nt <= 16 rows for NQ query heads: scores, online-softmax update of (m, l), and
 * out += p·V. */
KN_AI void kn_att_block(const uint16_t *K, const uint16_t *V, int nt, int hd, const float *q,
                        float scale, float *o, float *m, __m512 *l, const int NQ, const int BF)
{
    __m512 sc[KN_ATT_GROUP];
    kn_att_scores(K, nt, hd, q, scale, sc, NQ, BF);
    const __mmask16 valid = kn_mask16(nt);
    float pb[KN_ATT_GROUP][16] __attribute__((aligned(64)));
#pragma GCC unroll 4
    for (int h = 0; h < NQ; h++) {
        const __m512 s = sc[h];
        if (_mm512_cmp_ps_mask(s, _mm512_set1_ps(m[h]), _CMP_GT_OQ)) {
            /* A new maximum: rescale what was accumulated under the old one. */
            const float bm = _mm512_reduce_max_ps(s);
            const float corr = expf(m[h] - bm);
            const __m512 vc = _mm512_set1_ps(corr);
            m[h] = bm;
            l[h] = _mm512_mul_ps(l[h], vc);
            float *oh = o + (size_t)h * hd;
            for (int c = 0; c < hd; c += 16)
                _mm512_storeu_ps(oh + c, _mm512_mul_ps(_mm512_loadu_ps(oh + c), vc));
        }
        const __m512 p =
            _mm512_maskz_mov_ps(valid, kn_exp512(_mm512_sub_ps(s, _mm512_set1_ps(m[h]))));
        l[h] = _mm512_add_ps(l[h], p);
        _mm512_store_ps(pb[h], p);
    }

    /* out[h] += sum_t p[h][t] * V[t], 64 dimensions (4*NQ accumulators) at a time. */
    int c = 0;
    for (; c + 64 <= hd; c += 64) {
        __m512 a[KN_ATT_GROUP][4];
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++)
            for (int w = 0; w < 4; w++) a[h][w] = _mm512_loadu_ps(o + (size_t)h * hd + c + 16 * w);
        for (int t = 0; t < nt; t++) {
            const uint16_t *vr = V + (size_t)t * hd + c;
            const __m512 v0 = kn_kv16(vr, BF), v1 = kn_kv16(vr + 16, BF);
            const __m512 v2 = kn_kv16(vr + 32, BF), v3 = kn_kv16(vr + 48, BF);
#pragma GCC unroll 4
            for (int h = 0; h < NQ; h++) {
                const __m512 ph = _mm512_set1_ps(pb[h][t]);
                a[h][0] = _mm512_fmadd_ps(ph, v0, a[h][0]);
                a[h][1] = _mm512_fmadd_ps(ph, v1, a[h][1]);
                a[h][2] = _mm512_fmadd_ps(ph, v2, a[h][2]);
                a[h][3] = _mm512_fmadd_ps(ph, v3, a[h][3]);
            }
        }
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++)
            for (int w = 0; w < 4; w++) _mm512_storeu_ps(o + (size_t)h * hd + c + 16 * w, a[h][w]);
    }
    for (; c < hd; c += 16) {
        __m512 a[KN_ATT_GROUP];
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++) a[h] = _mm512_loadu_ps(o + (size_t)h * hd + c);
        for (int t = 0; t < nt; t++) {
            const __m512 v0 = kn_kv16(V + (size_t)t * hd + c, BF);
#pragma GCC unroll 4
            for (int h = 0; h < NQ; h++) a[h] = _mm512_fmadd_ps(_mm512_set1_ps(pb[h][t]), v0, a[h]);
        }
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++) _mm512_storeu_ps(o + (size_t)h * hd + c, a[h]);
    }
}

typedef void (*kn_att_block_fn)(const uint16_t *K, const uint16_t *V, int nt, int hd,
                                const float *q, float scale, float *o, float *m, __m512 *l);

#define KN_ATT_INST(nq, bf)                                                                        \
    static void kn_att_block_##nq##_##bf(const uint16_t *K, const uint16_t *V, int nt, int hd,     \
                                         const float *q, float scale, float *o, float *m,          \
                                         __m512 *l)                                                \
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

void kn_attention_avx512(const kn_kv_view *kv, int head_dim, const float *q, int n_q, float scale,
                         float *out)
{
    /* fp8/int8/int4 pages, mixed-format views and views that want attn_mass: attn_kv_avx512.c */
    if (kn_attention_kv_wants(kv)) {
        kn_attention_kv_avx512(kv, head_dim, q, n_q, scale, out);
        return;
    }
    const int pt = kv->page_tokens, hd = head_dim, n_ctx = kv->n_ctx;
    assert(pt > 0 && hd > 0 && n_q > 0 && n_ctx >= 0);
    assert(q != out);
    assert(kv->format == KN_KV_F16 || kv->format == KN_KV_BF16);
    if (hd % 16) {
        /* Head sizes that are not a multiple of 16 do not occur in the models we serve; the
         * AVX2 build covers multiples of 8, the reference everything else. */
        if (hd % 8 == 0)
            kn_attention_avx2(kv, head_dim, q, n_q, scale, out);
        else
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
        __m512 l[KN_ATT_MAXQ];
        for (int h = 0; h < nh; h++) {
            m[h] = -INFINITY;
            l[h] = _mm512_setzero_ps();
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
            for (int b = 0; b < np; b += 16) {
                const int nt = np - b < 16 ? np - b : 16;
                for (int g = 0; g < nh; g += KN_ATT_GROUP) {
                    const int gn = nh - g < KN_ATT_GROUP ? nh - g : KN_ATT_GROUP;
                    const size_t qo = (size_t)(h0 + g) * hd;
                    kn_att_blocks[bf][gn - 1](K + (size_t)b * hd, V + (size_t)b * hd, nt, hd,
                                              q + qo, scale, out + qo, m + g, l + g);
                }
            }
        }
        for (int h = 0; h < nh; h++) {
            const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(l[h]));
            float *oh = out + (size_t)(h0 + h) * hd;
            for (int c = 0; c < hd; c += 16)
                _mm512_storeu_ps(oh + c, _mm512_mul_ps(_mm512_loadu_ps(oh + c), inv));
        }
    }
}
