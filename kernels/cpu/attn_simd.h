/*
 * attn_simd.h — the paged attention of the SIMD builds, written once: the page walk with its
 * prefetch, the blocks of KN_AL tokens (one vector of scores per head), the online softmax and
 * the V accumulation, for f16, bf16, fp8, int8 and int4 pages, one format per view or mixed page by
 * page (a sequence during and after a live conversion; int4 sequences, whose last page stays f16
 * until it fills). Private to kernels/cpu; ops_avx2.c and ops_avx512.c define the primitives listed
 * below and include this file, which defines their kn_attention_<sfx> and kn_att_fast_<sfx> (what
 * attn_kv_<sfx>.c runs for the quantized and mixed views it takes). tests/unit/test_kernels_ops.c
 * and tests/unit/test_kvshard_format.c hold both builds to the reference.
 *
 * Attention streams every K and V byte of the sequence once per token and layer, so it is built
 * to run at memory speed:
 *  - the sequence is walked page by page, KN_AL tokens at a time, with an online softmax, the
 *    rows read in place and converted in registers (fp8/int8 rows times their 16-channel scales,
 *    converted to floats once per block for all heads; int4 K as n * scale + min with the page's
 *    per-channel scales converted once per page, int4 V with its row's 32-channel groups);
 *  - each K row is converted once for a group of up to 4 query heads (the GQA group), KN_AR rows
 *    at a time, and the KN_AL x KN_AL dot-product partials of a block are folded into one score
 *    vector with shuffle trees (the builds' kn_af_fold_*) instead of horizontal sums;
 *  - V is accumulated into `out` KN_ATT_VW(NQ) vectors at a time, NQ x that many FMA chains;
 *  - the next pages' K and V blocks are prefetched, since pages are scattered in memory and the
 *    hardware prefetcher cannot follow a page table.
 * A partial block re-reads its last valid row (never past the block: rows past n_ctx may hold
 * anything, NaN included) and masks those lanes.
 *
 * Primitives the including file defines first:
 *   KN_SFX          name suffix (avx2, avx512)
 *   KN_AL, KN_AR    lanes of a vector (tokens of a block), K rows scored together (KN_AL/4)
 *   KN_ATT_VW(NQ)   vectors of V dimensions accumulated per pass for NQ heads
 *   kn_af           a vector of KN_AL floats, with kn_af_zero, kn_af_set1, kn_af_ld, kn_af_st,
 *                   kn_af_add, kn_af_sub, kn_af_mul, kn_af_fma (a*b+c), kn_af_exp (vector expf),
 *                   kn_af_hmax, kn_af_hsum, kn_af_any_gt(v, x) (a lane > x),
 *                   kn_af_first(v, n, fill) (lanes >= n replaced by fill)
 *   kn_af_fold_rows(acc)              KN_AR vectors of partial sums -> one
 *   kn_af_fold_groups(d0, d1, d2, d3) four of those -> the KN_AL row sums in row order
 *   kn_att_row(fmt, blk, t, hd, c, sc)  channels [c, c+KN_AL) of row t of a K or V block as
 *                   floats (fp8/int8: times sc[c/16], the row's scales; int4, V only: n *
 *                   sc[2 (c/32)] + sc[2 (c/32) + 1])
 *   kn_att_nib(blk, t, hd, c)         channels [c, c+KN_AL) of row t of an int4 K block as
 *                   floats 0..15
 *   kn_att_scales(src, n, mul, dst)   n f16 scales to floats times mul
 *   kn_att_narrow(kv, hd, q, n_q, scale, out)   f16/bf16 with head_dim % KN_AL != 0
 */
#ifndef KN_CPU_ATTN_SIMD_H
#define KN_CPU_ATTN_SIMD_H

#include <assert.h>
#include <math.h>
#include <string.h>

#include "kernels/cpu/attn_kv.h"

#ifndef KN_CAT
#define KN_CAT_(a, b) a##b
#define KN_CAT(a, b)  KN_CAT_(a, b)
#endif
#define KN_ATT_FN(name) KN_CAT(name, KN_SFX)

/* Query heads whose softmax state is kept on the stack at once; more are done in further passes. */
#define KN_ATT_MAXQ 32
/* Query tokens of one sequence walked over its pages together (kn_attention_multi_<sfx>). */
#define KN_ATT_MQ 8
/* Query heads that share one pass over a K/V row (register budget of the score and PV loops). */
#define KN_ATT_GROUP 4
/* How many pages ahead the K/V blocks are prefetched, how many bytes of each block, and into
 * which cache (a build may choose another hint: EXTRA_CFLAGS=-DKN_ATT_PF_HINT=_MM_HINT_T0). */
#define KN_ATT_PF_PAGES 2
#define KN_ATT_PF_BYTES 4096
#ifndef KN_ATT_PF_HINT
#define KN_ATT_PF_HINT _MM_HINT_T1
#endif

/* Scores of a block of nt <= KN_AL rows against NQ query heads: s[h] lane t = scale *
 * q[h]·K[t], lanes >= nt = -inf. ks: the rows' float scales (fp8/int8), or the page's scale[hd]
 * then min[hd] (int4). */
KN_AI void kn_att_scores(const int FMT, const uint8_t *K, const float *ks, int nt, int hd,
                         const float *q, float scale, kn_af *s, const int NQ)
{
    const int ng = hd / 16;
    kn_af d[KN_ATT_GROUP][4];
#pragma GCC unroll 4
    for (int sb = 0; sb < 4; sb++) {
        const int r0 = KN_AR * sb;
        if (r0 >= nt) {
#pragma GCC unroll 4
            for (int h = 0; h < NQ; h++) d[h][sb] = kn_af_zero();
            continue;
        }
        /* Rows past nt re-read the last valid row (never past the block); masked out below. */
        int rows[KN_AR];
#pragma GCC unroll 4
        for (int r = 0; r < KN_AR; r++) rows[r] = r0 + r < nt ? r0 + r : nt - 1;
        kn_af acc[KN_ATT_GROUP][KN_AR];
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++)
#pragma GCC unroll 4
            for (int r = 0; r < KN_AR; r++) acc[h][r] = kn_af_zero();
        for (int c = 0; c < hd; c += KN_AL) {
            kn_af x[KN_AR];
#pragma GCC unroll 4
            for (int r = 0; r < KN_AR; r++) {
                if (FMT == KN_KV_INT4) {
                    x[r] = kn_af_fma(kn_att_nib(K, rows[r], hd, c), kn_af_ld(ks + c),
                                     kn_af_ld(ks + hd + c));
                    continue;
                }
                x[r] = kn_att_row(FMT, K, rows[r], hd, c, ks + (size_t)rows[r] * ng);
            }
#pragma GCC unroll 4
            for (int h = 0; h < NQ; h++) {
                const kn_af qv = kn_af_ld(q + (size_t)h * hd + c);
#pragma GCC unroll 4
                for (int r = 0; r < KN_AR; r++) acc[h][r] = kn_af_fma(x[r], qv, acc[h][r]);
            }
        }
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++) d[h][sb] = kn_af_fold_rows(acc[h]);
    }
    const kn_af vscale = kn_af_set1(scale);
#pragma GCC unroll 4
    for (int h = 0; h < NQ; h++)
        s[h] = kn_af_first(kn_af_mul(kn_af_fold_groups(d[h][0], d[h][1], d[h][2], d[h][3]), vscale),
                           nt, -INFINITY);
}

/* One block of nt <= KN_AL rows for NQ query heads: scores, online-softmax update of (m, l), and
 * out += p·V. */
KN_AI void kn_att_block(const int FMT, const uint8_t *K, const uint8_t *V, const float *ks,
                        const float *vs, int nt, int hd, const float *q, float scale, float *o,
                        float *m, kn_af *l, const int NQ)
{
    const int ng = hd / 16;
    kn_af sc[KN_ATT_GROUP];
    kn_att_scores(FMT, K, ks, nt, hd, q, scale, sc, NQ);
    float pb[KN_ATT_GROUP][KN_AL] __attribute__((aligned(64)));
#pragma GCC unroll 4
    for (int h = 0; h < NQ; h++) {
        const kn_af s = sc[h];
        if (kn_af_any_gt(s, m[h])) {
            /* A new maximum: rescale what was accumulated under the old one. */
            const float bm = kn_af_hmax(s);
            const kn_af vc = kn_af_set1(expf(m[h] - bm));
            m[h] = bm;
            l[h] = kn_af_mul(l[h], vc);
            float *oh = o + (size_t)h * hd;
            for (int c = 0; c < hd; c += KN_AL) kn_af_st(oh + c, kn_af_mul(kn_af_ld(oh + c), vc));
        }
        const kn_af p = kn_af_first(kn_af_exp(kn_af_sub(s, kn_af_set1(m[h]))), nt, 0.0f);
        l[h] = kn_af_add(l[h], p);
        kn_af_st(pb[h], p);
    }

    /* out[h] += sum_t p[h][t] * V[t], W vectors of dimensions at a time. */
    const int W = KN_ATT_VW(NQ);
    int c = 0;
    for (; c + KN_AL * W <= hd; c += KN_AL * W) {
        kn_af a[KN_ATT_GROUP][4];
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++)
#pragma GCC unroll 4
            for (int w = 0; w < W; w++) a[h][w] = kn_af_ld(o + (size_t)h * hd + c + KN_AL * w);
        for (int t = 0; t < nt; t++) {
            kn_af v[4];
#pragma GCC unroll 4
            for (int w = 0; w < W; w++)
                v[w] = kn_att_row(FMT, V, t, hd, c + KN_AL * w, vs + (size_t)t * ng);
#pragma GCC unroll 4
            for (int h = 0; h < NQ; h++) {
                const kn_af ph = kn_af_set1(pb[h][t]);
#pragma GCC unroll 4
                for (int w = 0; w < W; w++) a[h][w] = kn_af_fma(ph, v[w], a[h][w]);
            }
        }
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++)
#pragma GCC unroll 4
            for (int w = 0; w < W; w++) kn_af_st(o + (size_t)h * hd + c + KN_AL * w, a[h][w]);
    }
    for (; c < hd; c += KN_AL) {
        kn_af a[KN_ATT_GROUP];
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++) a[h] = kn_af_ld(o + (size_t)h * hd + c);
        for (int t = 0; t < nt; t++) {
            const kn_af v0 = kn_att_row(FMT, V, t, hd, c, vs + (size_t)t * ng);
#pragma GCC unroll 4
            for (int h = 0; h < NQ; h++) a[h] = kn_af_fma(kn_af_set1(pb[h][t]), v0, a[h]);
        }
#pragma GCC unroll 4
        for (int h = 0; h < NQ; h++) kn_af_st(o + (size_t)h * hd + c, a[h]);
    }
}

typedef void (*kn_att_block_fn)(const uint8_t *K, const uint8_t *V, const float *ks,
                                const float *vs, int nt, int hd, const float *q, float scale,
                                float *o, float *m, kn_af *l);

/* One instance per (format, group size): the format's row decoding and the group's register
 * tiles are compiled in. */
#define KN_ATT_INST(fmt, nq)                                                                       \
    static void kn_att_block_##fmt##_##nq(const uint8_t *K, const uint8_t *V, const float *ks,     \
                                          const float *vs, int nt, int hd, const float *q,         \
                                          float scale, float *o, float *m, kn_af *l)               \
    {                                                                                              \
        kn_att_block(fmt, K, V, ks, vs, nt, hd, q, scale, o, m, l, nq);                            \
    }
#define KN_ATT_INST4(fmt)                                                                          \
    KN_ATT_INST(fmt, 1) KN_ATT_INST(fmt, 2) KN_ATT_INST(fmt, 3) KN_ATT_INST(fmt, 4)
KN_ATT_INST4(0) /* KN_KV_F16 */
KN_ATT_INST4(1) /* KN_KV_BF16 */
KN_ATT_INST4(2) /* KN_KV_FP8 */
KN_ATT_INST4(3) /* KN_KV_INT8 */
KN_ATT_INST4(4) /* KN_KV_INT4 */

static const kn_att_block_fn kn_att_blocks[][KN_ATT_GROUP] = {
    {kn_att_block_0_1, kn_att_block_0_2, kn_att_block_0_3, kn_att_block_0_4},
    {kn_att_block_1_1, kn_att_block_1_2, kn_att_block_1_3, kn_att_block_1_4},
    {kn_att_block_2_1, kn_att_block_2_2, kn_att_block_2_3, kn_att_block_2_4},
    {kn_att_block_3_1, kn_att_block_3_2, kn_att_block_3_3, kn_att_block_3_4},
    {kn_att_block_4_1, kn_att_block_4_2, kn_att_block_4_3, kn_att_block_4_4},
};

/* Whether the blocks take pages of format f with this head_dim. */
static int kn_att_takes(kn_kv_format f, int hd)
{
    switch (f) {
    case KN_KV_F16:
    case KN_KV_BF16:
        return 1;
    case KN_KV_FP8:
    case KN_KV_INT8:
        return hd % 16 == 0 && hd <= KN_KV_MAX_HD;
    case KN_KV_INT4:
        return hd % 32 == 0 && hd <= KN_KV_MAX_HD;
    default:
        return 0;
    }
}

/* Bytes of one K (or V) block of a page of format f: pt rows of hd elements. */
static size_t kn_att_blk_bytes(kn_kv_format f, int pt, int hd)
{
    const size_t n = (size_t)pt * hd;
    return f == KN_KV_F16 || f == KN_KV_BF16 ? 2 * n : f == KN_KV_INT4 ? n / 2 : n;
}

/* Always inlined, as every function here that prefetches must be: GCC (12) finds that a static
 * function whose only effect is a prefetch has none, and deletes its calls (make check-prefetch
 * fails if one goes missing; docs/benchmarks.md, "The batch-32 drop, found", tells the story). */
KN_AI void kn_att_prefetch(const uint8_t *p, size_t bytes)
{
    if (bytes > KN_ATT_PF_BYTES) bytes = KN_ATT_PF_BYTES;
    for (size_t i = 0; i < bytes; i += 64) _mm_prefetch((const char *)p + i, KN_ATT_PF_HINT);
}

/* The K and V blocks of page pg and their scales (2 bytes per 16 channels of a row: fp8, int8
 * and int4's V; int4's K: a scale and a min per channel). */
KN_AI void kn_att_prefetch_page(const kn_kv_view *kv, int pg, int hd)
{
    kn_kv_blk b;
    const kn_kv_format f = kn_kv_block(kv, pg, &b);
    const int pt = kv->page_tokens;
    const size_t blk = kn_att_blk_bytes(f, pt, hd), sblk = (size_t)pt * (hd / 16) * 2;
    kn_att_prefetch(b.k, blk);
    kn_att_prefetch(b.v, blk);
    if (f == KN_KV_F16 || f == KN_KV_BF16) return;
    kn_att_prefetch(b.ks, f == KN_KV_INT4 ? 4 * (size_t)hd : sblk);
    kn_att_prefetch(b.vs, sblk);
}

/* Views without attn_mass whose pages (one format, or mixed) the blocks all take (kn_att_takes)
 * and whose head_dim is a multiple of KN_AL, for n_tok <= KN_ATT_MQ consecutive query tokens of
 * the sequence: token t (its n_q heads at q + t * qs, its output at out + t * os) attends to the
 * first kv->n_ctx - (n_tok - 1 - t) positions. Each page and block is read once for all of them,
 * and each token's arithmetic is exactly that of a call for it alone (same blocks, same order):
 * the outputs are bit for bit those of n_tok single calls. Returns 0, doing nothing, for any
 * other view. */
int KN_ATT_FN(kn_att_fast_multi_)(const kn_kv_view *kv, int hd, const float *q, size_t qs,
                                  int n_tok, int n_q, float scale, float *out, size_t os)
{
    if (kv->attn_mass || hd % KN_AL) return 0;
    const int pt = kv->page_tokens, n_ctx = kv->n_ctx, ng = hd / 16;
    assert(pt > 0 && hd > 0 && n_q > 0 && n_ctx >= 0 && n_tok >= 1 && n_tok <= KN_ATT_MQ);
    const int n_pages = (n_ctx + pt - 1) / pt;
    if (!kv->page_formats && !kn_att_takes(kv->format, hd)) return 0;
    for (int pg = 0; kv->page_formats && pg < n_pages; pg++)
        if (!kn_att_takes((kn_kv_format)kv->page_formats[pg], hd)) return 0;
    for (int t = 0; t < n_tok; t++) {
        assert(q + t * qs != out + t * os);
        memset(out + t * os, 0, sizeof(float) * (size_t)n_q * hd);
    }
    if (n_ctx <= 0) return 1;
    float ks[KN_AL * (KN_KV_MAX_HD / 16)], vs[KN_AL * (KN_KV_MAX_HD / 16)];
    float k4[2 * KN_KV_MAX_HD]; /* an int4 page's K scale[hd], min[hd] */
    for (int h0 = 0; h0 < n_q; h0 += KN_ATT_MAXQ) {
        const int nh = n_q - h0 < KN_ATT_MAXQ ? n_q - h0 : KN_ATT_MAXQ;
        float m[KN_ATT_MQ][KN_ATT_MAXQ];
        kn_af l[KN_ATT_MQ][KN_ATT_MAXQ];
        for (int t = 0; t < n_tok; t++)
            for (int h = 0; h < nh; h++) {
                m[t][h] = -INFINITY;
                l[t][h] = kn_af_zero();
            }
        for (int pg = 0; pg < KN_ATT_PF_PAGES && pg < n_pages; pg++)
            kn_att_prefetch_page(kv, pg, hd);
        for (int pg = 0; pg < n_pages; pg++) {
            if (pg + KN_ATT_PF_PAGES < n_pages) kn_att_prefetch_page(kv, pg + KN_ATT_PF_PAGES, hd);
            kn_kv_blk B;
            const kn_kv_format fmt = kn_kv_block(kv, pg, &B);
            const int quant = fmt == KN_KV_FP8 || fmt == KN_KV_INT8, q4 = fmt == KN_KV_INT4;
            const float smul = fmt == KN_KV_FP8 ? 256.0f : 1.0f; /* the f16 trick's 2^-8, undone */
            const size_t rb = kn_att_blk_bytes(fmt, 1, hd);      /* bytes of a row */
            const float *kk = ks;
            if (q4) {
                kn_att_scales(B.ks, 2 * hd, 1.0f, k4);
                kk = k4;
            }
            const int np = n_ctx - pg * pt < pt ? n_ctx - pg * pt : pt;
            for (int b = 0; b < np; b += KN_AL) {
                const int nt = np - b < KN_AL ? np - b : KN_AL;
                if (quant) kn_att_scales(B.ks + (size_t)b * ng * 2, nt * ng, smul, ks);
                /* int4's V: a (scale, min) pair per 32 channels, as many bytes as fp8's */
                if (quant || q4) kn_att_scales(B.vs + (size_t)b * ng * 2, nt * ng, smul, vs);
                const size_t ro = (size_t)b * rb;
                for (int t = 0; t < n_tok; t++) {
                    /* the rows of this block token t sees (earlier tokens see fewer) */
                    const int seen = n_ctx - (n_tok - 1 - t) - (pg * pt + b);
                    if (seen <= 0) continue;
                    const int ntt = seen < nt ? seen : nt;
                    const float *qt = q + t * qs;
                    float *ot = out + t * os;
                    for (int g = 0; g < nh; g += KN_ATT_GROUP) {
                        const int gn = nh - g < KN_ATT_GROUP ? nh - g : KN_ATT_GROUP;
                        const size_t qo = (size_t)(h0 + g) * hd;
                        kn_att_blocks[fmt][gn - 1](B.k + ro, B.v + ro, kk, vs, ntt, hd, qt + qo,
                                                   scale, ot + qo, m[t] + g, l[t] + g);
                    }
                }
            }
        }
        for (int t = 0; t < n_tok; t++) {
            if (n_ctx - (n_tok - 1 - t) <= 0) continue; /* saw nothing: zeros */
            for (int h = 0; h < nh; h++) {
                const kn_af inv = kn_af_set1(1.0f / kn_af_hsum(l[t][h]));
                float *oh = out + t * os + (size_t)(h0 + h) * hd;
                for (int c = 0; c < hd; c += KN_AL)
                    kn_af_st(oh + c, kn_af_mul(kn_af_ld(oh + c), inv));
            }
        }
    }
    return 1;
}

/* One query token: the above with n_tok = 1 (attn_kv_<sfx>.c calls it for the views it hands
 * back). */
int KN_ATT_FN(kn_att_fast_)(const kn_kv_view *kv, int hd, const float *q, int n_q, float scale,
                            float *out)
{
    return KN_ATT_FN(kn_att_fast_multi_)(kv, hd, q, 0, 1, n_q, scale, out, 0);
}

void KN_ATT_FN(kn_attention_)(const kn_kv_view *kv, int head_dim, const float *q, int n_q,
                              float scale, float *out)
{
    /* fp8/int8/int4 pages, mixed-format views and views that want attn_mass: attn_kv_<sfx>.c,
     * which comes back to kn_att_fast_<sfx> for those it takes */
    if (kn_attention_kv_wants(kv)) {
        KN_ATT_FN(kn_attention_kv_)(kv, head_dim, q, n_q, scale, out);
        return;
    }
    assert(kv->format == KN_KV_F16 || kv->format == KN_KV_BF16);
    if (!KN_ATT_FN(kn_att_fast_)(kv, head_dim, q, n_q, scale, out))
        kn_att_narrow(kv, head_dim, q, n_q, scale, out);
}

/* kn_ops.attention_multi: KN_ATT_MQ tokens at a time through the blocked path, or one at a time
 * through kn_attention_<sfx> for the views it does not take (attn_mass, odd head sizes). */
void KN_ATT_FN(kn_attention_multi_)(const kn_kv_view *kv, int head_dim, const float *q,
                                    size_t q_stride, int n_tok, int n_q, float scale, float *out,
                                    size_t out_stride)
{
    assert(n_tok >= 1 && kv->n_ctx >= n_tok - 1);
    for (int t0 = 0; t0 < n_tok; t0 += KN_ATT_MQ) {
        const int n = n_tok - t0 < KN_ATT_MQ ? n_tok - t0 : KN_ATT_MQ;
        kn_kv_view v = *kv;
        v.n_ctx = kv->n_ctx - (n_tok - t0 - n); /* the chunk's last token's */
        const float *qc = q + t0 * q_stride;
        float *oc = out + t0 * out_stride;
        if (KN_ATT_FN(kn_att_fast_multi_)(&v, head_dim, qc, q_stride, n, n_q, scale, oc,
                                          out_stride))
            continue;
        for (int t = 0; t < n; t++) {
            kn_kv_view w = v;
            w.n_ctx = v.n_ctx - (n - 1 - t);
            KN_ATT_FN(kn_attention_)
            (&w, head_dim, qc + t * q_stride, n_q, scale, oc + t * out_stride);
        }
    }
}

#endif /* KN_CPU_ATTN_SIMD_H */
