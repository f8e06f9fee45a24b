/*
 * attn_kv_avx2.c — attention over quantized and mixed-format KV pages with AVX2 + FMA + F16C.
 *
 * Single-format fp8 and int8 views (head_dim % 16 == 0, no attn_mass) take a fast path built
 * like the f16 kernel of ops_avx2.c: pages walked 8 tokens (one ymm of scores) at a time with an
 * online softmax, each K row decoded once for a group of up to 4 query heads, 2 rows at a time,
 * partial sums folded with a shuffle tree, V accumulated with several FMA chains, vector expf,
 * next pages prefetched. A 16-channel scale group is two ymm with one broadcast scale; a block's
 * scales are converted to floats once for all heads. E4M3 is decoded 16 bytes at a time by bit
 * manipulation into f16 (the sign-extended byte shifted left by 7, bit 14 cleared, is
 * e4m3 * 2^-8) and vcvtph2ps; int8 by widening.
 *
 * Everything else (int4, mixed formats, attn_mass, other head sizes) decodes one row at a time,
 * 8 channels per instruction sequence, into attn_kv.h's body shared with the reference.
 */
#include <immintrin.h>

#include "kernels/cpu/attn_kv.h"
#include "kernels/cpu/simd_avx2.h"

static inline __m256 kn_kv_fp8x8(const uint8_t *p)
{
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7));
    return _mm256_cvtph_ps(h);
}

/* 8 int4 channels (4 bytes) as floats 0..15, in channel order. */
static inline __m256 kn_kv_int4x8(const uint8_t *p)
{
    int32_t x;
    memcpy(&x, p, 4);
    const __m128i w = _mm_cvtepu8_epi16(_mm_cvtsi32_si128(x));
    const __m128i lo = _mm_and_si128(w, _mm_set1_epi16(15)), hi = _mm_srli_epi16(w, 4);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_or_si128(lo, _mm_slli_epi16(hi, 8))));
}

static inline __attribute__((always_inline)) void kn_kv_row_avx2(kn_kv_format f, const kn_kv_blk *b,
                                                                 int t, int hd, int v, float *row)
{
    int c = 0;
    const int n8 = hd & ~7;
    switch (f) {
    case KN_KV_F16: {
        const uint8_t *src = (v ? b->v : b->k) + (size_t)t * hd * 2;
        for (; c < n8; c += 8)
            _mm256_store_ps(row + c,
                            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * c))));
        break;
    }
    case KN_KV_BF16: {
        const uint8_t *src = (v ? b->v : b->k) + (size_t)t * hd * 2;
        for (; c < n8; c += 8) {
            __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 2 * c)));
            _mm256_store_ps(row + c, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
        break;
    }
    case KN_KV_FP8: {
        const uint8_t *src = (v ? b->v : b->k) + (size_t)t * hd, *scs = v ? b->vs : b->ks;
        for (; c < n8; c += 8) { /* 8 lanes never straddle two scale groups */
            const __m256 sc = _mm256_set1_ps(kn_kv_group_scale(scs, t, hd, c) * 256.0f);
            _mm256_store_ps(row + c, _mm256_mul_ps(kn_kv_fp8x8(src + c), sc));
        }
        break;
    }
    case KN_KV_INT8: {
        const uint8_t *src = (v ? b->v : b->k) + (size_t)t * hd, *scs = v ? b->vs : b->ks;
        for (; c < n8; c += 8) { /* 8 lanes never straddle two scale groups */
            const __m256 sc = _mm256_set1_ps(kn_kv_group_scale(scs, t, hd, c));
            __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + c)));
            _mm256_store_ps(row + c, _mm256_mul_ps(_mm256_cvtepi32_ps(w), sc));
        }
        break;
    }
    case KN_KV_INT4: {
        const uint8_t *src = (v ? b->v : b->k) + (size_t)t * (hd / 2);
        if (!v) {
            for (; c < n8; c += 8) {
                __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b->ks + 2 * c)));
                __m256 m =
                    _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b->ks + 2 * (hd + c))));
                _mm256_store_ps(row + c, _mm256_fmadd_ps(kn_kv_int4x8(src + c / 2), s, m));
            }
        } else if (hd % 32 == 0) {
            const uint8_t *g = b->vs + (size_t)t * (hd / 32) * 4;
            for (; c < hd; c += 8) {
                const uint8_t *gp = g + (size_t)(c / 32) * 4;
                __m256 s = _mm256_set1_ps(kn_kv_h2f(gp)), m = _mm256_set1_ps(kn_kv_h2f(gp + 2));
                _mm256_store_ps(row + c, _mm256_fmadd_ps(kn_kv_int4x8(src + c / 2), s, m));
            }
        }
        break;
    }
    }
    if (c < hd) kn_kv_row_tail(f, b, t, hd, v, c, row);
}

static inline __attribute__((always_inline)) float kn_kv_dot_avx2(const float *a, const float *b,
                                                                  int n)
{
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    float s = _mm_cvtss_f32(r);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline __attribute__((always_inline)) void kn_kv_axpy_avx2(float *y, float a, const float *x,
                                                                  int n)
{
    const __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i,
                         _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

/* ---------------------------------------------------------------- fp8/int8 fast path */

#define KN_KVF_MAXQ     32 /* query heads whose softmax state is on the stack at once */
#define KN_KVF_GROUP    4  /* query heads that share one pass over a K/V row */
#define KN_KVF_PF_PAGES 2  /* pages prefetched ahead */
#define KN_KVF_PF_BYTES 4096

/* 16 channels (one scale group) of an fp8 (FP8 = 1) or int8 row times their scale sc (for fp8,
 * sc carries the 2^8 of the f16 trick), as two vectors. Equal, bit for bit, to
 * kn_kv_row_tail's values. */
KN_AI void kn_kvf_row16(const uint8_t *p, const float *sc, __m256 *lo, __m256 *hi, const int FP8)
{
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    const __m256 s = _mm256_broadcast_ss(sc);
    if (FP8) {
        /* sign-extended byte << 7: the sign lands in bits 15 and 14, the other 7 bits in 13..7;
         * with bit 14 cleared this is the f16 of e4m3(b) * 2^-8, subnormals included */
        const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                           _mm256_set1_epi16((short)0xbf80));
        *lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), s);
        *hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), s);
    } else {
        *lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s);
        *hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))), s);
    }
}

/* n f16 scales to floats times mul. */
static inline void kn_kvf_scales(const uint8_t *src, int n, float mul, float *dst)
{
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(
            dst + i,
            _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * (size_t)i))),
                          _mm256_set1_ps(mul)));
    for (; i < n; i++) dst[i] = kn_kv_h2f(src + 2 * (size_t)i) * mul;
}

/* Scores of nt <= 8 rows of K (hd bytes a row; ks: their float scales, hd/16 a row) against NQ
 * query heads: s[h] lane t = scale * q[h]·K[t], lanes >= nt = -inf. */
KN_AI void kn_kvf_scores(const uint8_t *K, const float *ks, int nt, int hd, const float *q,
                         float scale, __m256 *s, const int NQ, const int FP8)
{
    const int ng = hd / 16;
    __m256 d[KN_KVF_GROUP][4];
#pragma GCC unroll 4
    for (int sb = 0; sb < 4; sb++) {
        const int r0 = 2 * sb;
        if (r0 >= nt) {
#pragma GCC unroll 4
            for (int h = 0; h < NQ; h++) d[h][sb] = _mm256_setzero_ps();
            continue;
        }
        /* A row past nt re-reads the last valid row (never past the block); masked out below. */
        const int r1 = r0 + 1 < nt ? r0 + 1 : nt - 1;
        const uint8_t *k0 = K + (size_t)r0 * hd, *k1 = K + (size_t)r1 * hd;
        const float *s0 = ks + r0 * ng, *s1 = ks + r1 * ng;
        __m256 acc[KN_KVF_GROUP][2];
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
        for (int c = 0, g = 0; c < hd; c += 16, g++) {
            __m256 x0a, x0b, x1a, x1b;
            kn_kvf_row16(k0 + c, s0 + g, &x0a, &x0b, FP8);
            kn_kvf_row16(k1 + c, s1 + g, &x1a, &x1b, FP8);
#pragma GCC unroll 4
            for (int h = 0; h < NQ; h++) {
                const __m256 qa = _mm256_loadu_ps(q + (size_t)h * hd + c);
                const __m256 qb = _mm256_loadu_ps(q + (size_t)h * hd + c + 8);
                acc[h][0] = _mm256_fmadd_ps(x0a, qa, acc[h][0]);
                acc[h][1] = _mm256_fmadd_ps(x1a, qa, acc[h][1]);
                acc[h][0] = _mm256_fmadd_ps(x0b, qb, acc[h][0]);
                acc[h][1] = _mm256_fmadd_ps(x1b, qb, acc[h][1]);
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
KN_AI void kn_kvf_block(const uint8_t *K, const uint8_t *V, const float *ks, const float *vs,
                        int nt, int hd, const float *q, float scale, float *o, float *m, __m256 *l,
                        const int NQ, const int FP8)
{
    const int ng = hd / 16;
    __m256 sc[KN_KVF_GROUP];
    kn_kvf_scores(K, ks, nt, hd, q, scale, sc, NQ, FP8);
    const __m256 valid = kn_valid8(nt);
    float pb[KN_KVF_GROUP][8] __attribute__((aligned(32)));
#pragma GCC unroll 4
    for (int h = 0; h < NQ; h++) {
        const __m256 s = sc[h];
        if (_mm256_movemask_ps(_mm256_cmp_ps(s, _mm256_set1_ps(m[h]), _CMP_GT_OQ))) {
            /* A new maximum: rescale what was accumulated under the old one. */
            const float bm = kn_hmax256(s);
            const __m256 vc = _mm256_set1_ps(expf(m[h] - bm));
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

    /* out[h] += sum_t p[h][t] * V[t]; 16*W dimensions at a time keep 2*W*NQ FMA chains in
     * flight. */
    const int W = NQ <= 2 ? 2 : 1;
    int c = 0;
    for (; c + 16 * W <= hd; c += 16 * W) {
        __m256 a[KN_KVF_GROUP][4];
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++)
#pragma GCC unroll 4
            for (int w = 0; w < 2 * W; w++)
                a[h][w] = _mm256_loadu_ps(o + (size_t)h * hd + c + 8 * w);
        for (int t = 0; t < nt; t++) {
            const uint8_t *vr = V + (size_t)t * hd + c;
            const float *sr = vs + t * ng + c / 16;
            __m256 v[4];
#pragma GCC unroll 2
            for (int w = 0; w < W; w++)
                kn_kvf_row16(vr + 16 * w, sr + w, &v[2 * w], &v[2 * w + 1], FP8);
#pragma GCC unroll 4
            for (int h = 0; h < NQ; h++) {
                const __m256 ph = _mm256_broadcast_ss(&pb[h][t]);
#pragma GCC unroll 4
                for (int w = 0; w < 2 * W; w++) a[h][w] = _mm256_fmadd_ps(ph, v[w], a[h][w]);
            }
        }
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++)
#pragma GCC unroll 4
            for (int w = 0; w < 2 * W; w++)
                _mm256_storeu_ps(o + (size_t)h * hd + c + 8 * w, a[h][w]);
    }
    for (; c < hd; c += 16) {
        __m256 a[KN_KVF_GROUP][2];
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++) {
            a[h][0] = _mm256_loadu_ps(o + (size_t)h * hd + c);
            a[h][1] = _mm256_loadu_ps(o + (size_t)h * hd + c + 8);
        }
        for (int t = 0; t < nt; t++) {
            __m256 v0, v1;
            kn_kvf_row16(V + (size_t)t * hd + c, vs + t * ng + c / 16, &v0, &v1, FP8);
#pragma GCC unroll 4
            for (int h = 0; h < NQ; h++) {
                const __m256 ph = _mm256_broadcast_ss(&pb[h][t]);
                a[h][0] = _mm256_fmadd_ps(ph, v0, a[h][0]);
                a[h][1] = _mm256_fmadd_ps(ph, v1, a[h][1]);
            }
        }
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++) {
            _mm256_storeu_ps(o + (size_t)h * hd + c, a[h][0]);
            _mm256_storeu_ps(o + (size_t)h * hd + c + 8, a[h][1]);
        }
    }
}

typedef void (*kn_kvf_block_fn)(const uint8_t *K, const uint8_t *V, const float *ks,
                                const float *vs, int nt, int hd, const float *q, float scale,
                                float *o, float *m, __m256 *l);

#define KN_KVF_INST(nq, fp8)                                                                       \
    static void kn_kvf_block_##nq##_##fp8(const uint8_t *K, const uint8_t *V, const float *ks,     \
                                          const float *vs, int nt, int hd, const float *q,         \
                                          float scale, float *o, float *m, __m256 *l)              \
    {                                                                                              \
        kn_kvf_block(K, V, ks, vs, nt, hd, q, scale, o, m, l, nq, fp8);                            \
    }
KN_KVF_INST(1, 0)
KN_KVF_INST(2, 0)
KN_KVF_INST(3, 0)
KN_KVF_INST(4, 0)
KN_KVF_INST(1, 1)
KN_KVF_INST(2, 1)
KN_KVF_INST(3, 1)
KN_KVF_INST(4, 1)

static const kn_kvf_block_fn kn_kvf_blocks[2][KN_KVF_GROUP] = {
    {kn_kvf_block_1_0, kn_kvf_block_2_0, kn_kvf_block_3_0, kn_kvf_block_4_0},
    {kn_kvf_block_1_1, kn_kvf_block_2_1, kn_kvf_block_3_1, kn_kvf_block_4_1},
};

static void kn_kvf_prefetch(const uint8_t *p, size_t bytes)
{
    if (bytes > KN_KVF_PF_BYTES) bytes = KN_KVF_PF_BYTES;
    for (size_t i = 0; i < bytes; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T0);
}

static void kn_kvf_prefetch_page(const kn_kv_view *kv, int pg, size_t blk, size_t sblk)
{
    const uint8_t *p = kv->pages[pg];
    kn_kvf_prefetch(p + kv->k_off, blk);
    kn_kvf_prefetch(p + kv->v_off, blk);
    kn_kvf_prefetch(p + kv->k_scale_off, sblk);
    kn_kvf_prefetch(p + kv->v_scale_off, sblk);
}

/* The fast path; 0 when the view is not one it serves. */
static int kn_kvf_attention(const kn_kv_view *kv, int hd, const float *q, int n_q, float scale,
                            float *out)
{
    if ((kv->format != KN_KV_FP8 && kv->format != KN_KV_INT8) || kv->page_formats ||
        kv->attn_mass || hd % 16 || hd > KN_KV_MAX_HD)
        return 0;
    const int pt = kv->page_tokens, n_ctx = kv->n_ctx, ng = hd / 16;
    memset(out, 0, sizeof(float) * (size_t)n_q * hd);
    if (n_ctx <= 0) return 1;
    const int fp8 = kv->format == KN_KV_FP8;
    const float smul = fp8 ? 256.0f : 1.0f; /* the f16 trick's 2^-8, undone in the scale */
    const size_t blk = (size_t)pt * hd, sblk = (size_t)pt * ng * 2;
    const int n_pages = (n_ctx + pt - 1) / pt;
    float ks[8 * (KN_KV_MAX_HD / 16)], vs[8 * (KN_KV_MAX_HD / 16)];
    for (int h0 = 0; h0 < n_q; h0 += KN_KVF_MAXQ) {
        const int nh = n_q - h0 < KN_KVF_MAXQ ? n_q - h0 : KN_KVF_MAXQ;
        float m[KN_KVF_MAXQ];
        __m256 l[KN_KVF_MAXQ];
        for (int h = 0; h < nh; h++) {
            m[h] = -INFINITY;
            l[h] = _mm256_setzero_ps();
        }
        for (int pg = 0; pg < KN_KVF_PF_PAGES && pg < n_pages; pg++)
            kn_kvf_prefetch_page(kv, pg, blk, sblk);
        for (int pg = 0; pg < n_pages; pg++) {
            if (pg + KN_KVF_PF_PAGES < n_pages)
                kn_kvf_prefetch_page(kv, pg + KN_KVF_PF_PAGES, blk, sblk);
            const uint8_t *p = kv->pages[pg];
            const uint8_t *K = p + kv->k_off, *V = p + kv->v_off;
            const uint8_t *KS = p + kv->k_scale_off, *VS = p + kv->v_scale_off;
            const int np = n_ctx - pg * pt < pt ? n_ctx - pg * pt : pt;
            for (int b = 0; b < np; b += 8) {
                const int nt = np - b < 8 ? np - b : 8;
                kn_kvf_scales(KS + (size_t)b * ng * 2, nt * ng, smul, ks);
                kn_kvf_scales(VS + (size_t)b * ng * 2, nt * ng, smul, vs);
                for (int g = 0; g < nh; g += KN_KVF_GROUP) {
                    const int gn = nh - g < KN_KVF_GROUP ? nh - g : KN_KVF_GROUP;
                    const size_t qo = (size_t)(h0 + g) * hd;
                    kn_kvf_blocks[fp8][gn - 1](K + (size_t)b * hd, V + (size_t)b * hd, ks, vs, nt,
                                               hd, q + qo, scale, out + qo, m + g, l + g);
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
    return 1;
}

void kn_attention_kv_avx2(const kn_kv_view *kv, int head_dim, const float *q, int n_q, float scale,
                          float *out)
{
    if (kn_kvf_attention(kv, head_dim, q, n_q, scale, out)) return;
    kn_attn_kv_body(kv, head_dim, q, n_q, scale, out, kn_kv_row_avx2, kn_kv_dot_avx2,
                    kn_kv_axpy_avx2);
}
