/*
 * attn_kv_avx512.c — attention over quantized and mixed-format KV pages with AVX-512.
 *
 * Single-format fp8 and int8 views (head_dim % 16 == 0, no attn_mass) take a fast path built
 * like the f16 kernel of ops_avx512.c: pages walked 16 tokens (one zmm of scores) at a time with
 * an online softmax, each K row decoded once for a group of up to 4 query heads, 4 rows at a
 * time, partial sums folded with a shuffle tree, V accumulated 64 dimensions at a time, vector
 * expf, next pages prefetched. A row's 16-channel group is exactly one zmm, so its scale is one
 * broadcast multiply; a block's scales are converted to floats once (vcvtph2ps) for all heads.
 * E4M3 is decoded by bit manipulation into f16 (the sign-extended byte shifted left by 7, bit 14
 * cleared, is e4m3 * 2^-8) and vcvtph2ps; int8 by widening.
 *
 * Everything else (int4, mixed formats, attn_mass, other head sizes) decodes one row at a time,
 * 16 channels per instruction sequence, into attn_kv.h's body shared with the reference.
 */
#include <immintrin.h>

#include "kernels/cpu/attn_kv.h"
#include "kernels/cpu/simd_avx512.h"

static inline __m512 kn_kv_fp8x16(const uint8_t *p)
{
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h =
        _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                        _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7));
    return _mm512_cvtph_ps(h);
}

/* 16 int4 channels (8 bytes) as floats 0..15, in channel order. */
static inline __m512 kn_kv_int4x16(const uint8_t *p)
{
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i lo = _mm_and_si128(w, _mm_set1_epi16(15)), hi = _mm_srli_epi16(w, 4);
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_or_si128(lo, _mm_slli_epi16(hi, 8))));
}

static inline __attribute__((always_inline)) void
kn_kv_row_avx512(kn_kv_format f, const kn_kv_blk *b, int t, int hd, int v, float *row)
{
    int c = 0;
    const int n16 = hd & ~15;
    switch (f) {
    case KN_KV_F16: {
        const uint8_t *src = (v ? b->v : b->k) + (size_t)t * hd * 2;
        for (; c < n16; c += 16)
            _mm512_store_ps(row + c,
                            _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 2 * c))));
        break;
    }
    case KN_KV_BF16: {
        const uint8_t *src = (v ? b->v : b->k) + (size_t)t * hd * 2;
        for (; c < n16; c += 16) {
            __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + 2 * c)));
            _mm512_store_ps(row + c, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
        }
        break;
    }
    case KN_KV_FP8: {
        const uint8_t *src = (v ? b->v : b->k) + (size_t)t * hd, *scs = v ? b->vs : b->ks;
        for (; c < n16; c += 16) { /* 16 lanes never straddle two scale groups */
            const __m512 sc = _mm512_set1_ps(kn_kv_group_scale(scs, t, hd, c) * 256.0f);
            _mm512_store_ps(row + c, _mm512_mul_ps(kn_kv_fp8x16(src + c), sc));
        }
        break;
    }
    case KN_KV_INT8: {
        const uint8_t *src = (v ? b->v : b->k) + (size_t)t * hd, *scs = v ? b->vs : b->ks;
        for (; c < n16; c += 16) { /* 16 lanes never straddle two scale groups */
            const __m512 sc = _mm512_set1_ps(kn_kv_group_scale(scs, t, hd, c));
            __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + c)));
            _mm512_store_ps(row + c, _mm512_mul_ps(_mm512_cvtepi32_ps(w), sc));
        }
        break;
    }
    case KN_KV_INT4: {
        const uint8_t *src = (v ? b->v : b->k) + (size_t)t * (hd / 2);
        if (!v) {
            for (; c < n16; c += 16) {
                __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b->ks + 2 * c)));
                __m512 m =
                    _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b->ks + 2 * (hd + c))));
                _mm512_store_ps(row + c, _mm512_fmadd_ps(kn_kv_int4x16(src + c / 2), s, m));
            }
        } else if (hd % 32 == 0) {
            const uint8_t *g = b->vs + (size_t)t * (hd / 32) * 4;
            for (; c < hd; c += 16) {
                const uint8_t *gp = g + (size_t)(c / 32) * 4;
                __m512 s = _mm512_set1_ps(kn_kv_h2f(gp)), m = _mm512_set1_ps(kn_kv_h2f(gp + 2));
                _mm512_store_ps(row + c, _mm512_fmadd_ps(kn_kv_int4x16(src + c / 2), s, m));
            }
        }
        break;
    }
    }
    if (c < hd) kn_kv_row_tail(f, b, t, hd, v, c, row);
}

static inline __attribute__((always_inline)) float kn_kv_dot_avx512(const float *a, const float *b,
                                                                    int n)
{
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    float s = _mm512_reduce_add_ps(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline __attribute__((always_inline)) void kn_kv_axpy_avx512(float *y, float a,
                                                                    const float *x, int n)
{
    const __m512 va = _mm512_set1_ps(a);
    int i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i,
                         _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

/* ---------------------------------------------------------------- fp8/int8 fast path */

#define KN_KVF_MAXQ     32 /* query heads whose softmax state is on the stack at once */
#define KN_KVF_GROUP    4  /* query heads that share one pass over a K/V row */
#define KN_KVF_PF_PAGES 2  /* pages prefetched ahead */
#define KN_KVF_PF_BYTES 4096

/* 16 channels (one scale group) of an fp8 (FP8 = 1) or int8 row times their scale sc (for fp8,
 * sc carries the 2^8 of the f16 trick). Equal, bit for bit, to kn_kv_row_tail's values. */
KN_AI __m512 kn_kvf_row16(const uint8_t *p, const float *sc, const int FP8)
{
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m512 x;
    if (FP8) {
        /* sign-extended byte << 7: the sign lands in bits 15 and 14, the other 7 bits in 13..7;
         * with bit 14 cleared this is the f16 of e4m3(b) * 2^-8, subnormals included */
        const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                           _mm256_set1_epi16((short)0xbf80));
        x = _mm512_cvtph_ps(h);
    } else {
        x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    }
    return _mm512_mul_ps(x, _mm512_set1_ps(*sc));
}

/* n f16 scales to floats times mul. */
static inline void kn_kvf_scales(const uint8_t *src, int n, float mul, float *dst)
{
    for (int i = 0; i < n; i += 16) {
        const __mmask16 k = kn_mask16(n - i);
        const __m512 x = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, src + 2 * (size_t)i));
        _mm512_mask_storeu_ps(dst + i, k, _mm512_mul_ps(x, _mm512_set1_ps(mul)));
    }
}

/* Scores of nt <= 16 rows of K (hd bytes a row; ks: their float scales, hd/16 a row) against NQ
 * query heads: s[h] lane t = scale * q[h]·K[t], lanes >= nt = -inf. */
KN_AI void kn_kvf_scores(const uint8_t *K, const float *ks, int nt, int hd, const float *q,
                         float scale, __m512 *s, const int NQ, const int FP8)
{
    const int ng = hd / 16;
    __m512 d[KN_KVF_GROUP][4];
#pragma GCC unroll 4
    for (int sb = 0; sb < 4; sb++) {
        const int r0 = 4 * sb;
        if (r0 >= nt) {
#pragma GCC unroll 4
            for (int h = 0; h < NQ; h++) d[h][sb] = _mm512_setzero_ps();
            continue;
        }
        /* Rows past nt re-read the last valid row (never past the block); masked out below. */
        const int r1 = r0 + 1 < nt ? r0 + 1 : nt - 1, r2 = r0 + 2 < nt ? r0 + 2 : nt - 1;
        const int r3 = r0 + 3 < nt ? r0 + 3 : nt - 1;
        const uint8_t *k0 = K + (size_t)r0 * hd, *k1 = K + (size_t)r1 * hd;
        const uint8_t *k2 = K + (size_t)r2 * hd, *k3 = K + (size_t)r3 * hd;
        const float *s0 = ks + r0 * ng, *s1 = ks + r1 * ng, *s2 = ks + r2 * ng, *s3 = ks + r3 * ng;
        __m512 acc[KN_KVF_GROUP][4];
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++)
            acc[h][0] = acc[h][1] = acc[h][2] = acc[h][3] = _mm512_setzero_ps();
        for (int c = 0, g = 0; c < hd; c += 16, g++) {
            const __m512 x0 = kn_kvf_row16(k0 + c, s0 + g, FP8);
            const __m512 x1 = kn_kvf_row16(k1 + c, s1 + g, FP8);
            const __m512 x2 = kn_kvf_row16(k2 + c, s2 + g, FP8);
            const __m512 x3 = kn_kvf_row16(k3 + c, s3 + g, FP8);
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
KN_AI void kn_kvf_block(const uint8_t *K, const uint8_t *V, const float *ks, const float *vs,
                        int nt, int hd, const float *q, float scale, float *o, float *m, __m512 *l,
                        const int NQ, const int FP8)
{
    const int ng = hd / 16;
    __m512 sc[KN_KVF_GROUP];
    kn_kvf_scores(K, ks, nt, hd, q, scale, sc, NQ, FP8);
    const __mmask16 valid = kn_mask16(nt);
    float pb[KN_KVF_GROUP][16] __attribute__((aligned(64)));
#pragma GCC unroll 4
    for (int h = 0; h < NQ; h++) {
        const __m512 s = sc[h];
        if (_mm512_cmp_ps_mask(s, _mm512_set1_ps(m[h]), _CMP_GT_OQ)) {
            /* A new maximum: rescale what was accumulated under the old one. */
            const float bm = _mm512_reduce_max_ps(s);
            const __m512 vc = _mm512_set1_ps(expf(m[h] - bm));
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
        __m512 a[KN_KVF_GROUP][4];
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++)
            for (int w = 0; w < 4; w++) a[h][w] = _mm512_loadu_ps(o + (size_t)h * hd + c + 16 * w);
        for (int t = 0; t < nt; t++) {
            const uint8_t *vr = V + (size_t)t * hd + c;
            const float *sr = vs + t * ng + c / 16;
            const __m512 v0 = kn_kvf_row16(vr, sr, FP8), v1 = kn_kvf_row16(vr + 16, sr + 1, FP8);
            const __m512 v2 = kn_kvf_row16(vr + 32, sr + 2, FP8);
            const __m512 v3 = kn_kvf_row16(vr + 48, sr + 3, FP8);
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
        __m512 a[KN_KVF_GROUP];
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++) a[h] = _mm512_loadu_ps(o + (size_t)h * hd + c);
        for (int t = 0; t < nt; t++) {
            const __m512 v0 = kn_kvf_row16(V + (size_t)t * hd + c, vs + t * ng + c / 16, FP8);
#pragma GCC unroll 4
            for (int h = 0; h < NQ; h++) a[h] = _mm512_fmadd_ps(_mm512_set1_ps(pb[h][t]), v0, a[h]);
        }
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++) _mm512_storeu_ps(o + (size_t)h * hd + c, a[h]);
    }
}

typedef void (*kn_kvf_block_fn)(const uint8_t *K, const uint8_t *V, const float *ks,
                                const float *vs, int nt, int hd, const float *q, float scale,
                                float *o, float *m, __m512 *l);

#define KN_KVF_INST(nq, fp8)                                                                       \
    static void kn_kvf_block_##nq##_##fp8(const uint8_t *K, const uint8_t *V, const float *ks,     \
                                          const float *vs, int nt, int hd, const float *q,         \
                                          float scale, float *o, float *m, __m512 *l)              \
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
    float ks[16 * (KN_KV_MAX_HD / 16)], vs[16 * (KN_KV_MAX_HD / 16)];
    for (int h0 = 0; h0 < n_q; h0 += KN_KVF_MAXQ) {
        const int nh = n_q - h0 < KN_KVF_MAXQ ? n_q - h0 : KN_KVF_MAXQ;
        float m[KN_KVF_MAXQ];
        __m512 l[KN_KVF_MAXQ];
        for (int h = 0; h < nh; h++) {
            m[h] = -INFINITY;
            l[h] = _mm512_setzero_ps();
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
            for (int b = 0; b < np; b += 16) {
                const int nt = np - b < 16 ? np - b : 16;
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
            const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(l[h]));
            float *oh = out + (size_t)(h0 + h) * hd;
            for (int c = 0; c < hd; c += 16)
                _mm512_storeu_ps(oh + c, _mm512_mul_ps(_mm512_loadu_ps(oh + c), inv));
        }
    }
    return 1;
}

void kn_attention_kv_avx512(const kn_kv_view *kv, int head_dim, const float *q, int n_q,
                            float scale, float *out)
{
    if (kn_kvf_attention(kv, head_dim, q, n_q, scale, out)) return;
    kn_attn_kv_body(kv, head_dim, q, n_q, scale, out, kn_kv_row_avx512, kn_kv_dot_avx512,
                    kn_kv_axpy_avx512);
}
