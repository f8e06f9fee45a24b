/*
 * quant_simd.h — the quantized matrix multiply and the activation quantization of the SIMD
 * builds, written once: the weight-type switch, the k-chunk / column-chunk / panel loops, the
 * micro-tiles, the activation-side tables and the K-quant scale unpacking. Private to kernels/cpu.
 * quant_avx2.c and quant_avx512.c define the primitives listed below and then include this file,
 * so both run the same driver with their own vector width and dot-product instructions (as
 * ggml's mul_mat is written once against its per-type traits). tests/unit/test_kernels_quant.c
 * holds every path to quant_ref.c.
 *
 * How it computes Y[i][r] = dot(W row r, X row i):
 *  - Panels of PR weight rows (one per 32-bit lane) in the layout of packed.h: a block's 4-byte
 *    groups of the PR rows side by side, so a group of an activation row broadcast to every lane
 *    advances PR dot products by 4 products. matmul_packed reads a matrix packed once at load;
 *    matmul packs each panel's k-chunk into a per-thread buffer first (pack.c) and runs the
 *    same code, so both give the same Y bit for bit.
 *  - The integer sum of each 32-element block (16 for Q6_K) is exact and is scaled into a float
 *    accumulator once per block, as in ggml:
 *      Q4_1:  acc += (d_w * d_x) * isum, acc += m_w * s_x (with KN_MIN_APART the second goes to
 *             its own accumulator, added at the end: half the dependency chain, two more
 *             registers per activation row)
 *      Q4_0:  isum starts at -8 * sum(x_q) (nibbles are u8 0..15)
 *      Q8_0:  isum starts at -KN_S8_BIAS * sum(x_q) (AVX-512 biases the weights to u8; AVX2 uses
 *             ggml's sign trick and no bias)
 *      Q4_K:  per super-block g = sum_j (d*sc_j) * isum_j - dmin * sum_j m_j * bsum_j, acc += d_x*g
 *      Q6_K:  isum_j starts at -32 * bsum_j (Q8_K's own 16-sums), g = sum_j (d*sc_j) * isum_j
 *    The activation-side numbers (d_x, s_x, corrections) of a column chunk are read once into a
 *    small table.
 *  - A micro-tile keeps PR rows x N <= KN_NT activation rows of accumulators in registers. With
 *    at most KN_NT activation rows (decode) each block is unpacked in registers and used at once
 *    while the next panel is prefetched; with more, a panel's k-chunk is unpacked once into a
 *    per-thread buffer and swept by every column tile.
 *  - Batch invariance: the k-chunking is the same for every m, and every tile width runs the same
 *    float operations per output, so a row's result does not depend on how many activation rows
 *    share the call (the engine promises that a token's logits do not depend on the batch).
 *
 * Primitives the including file defines first:
 *   KN_SFX        name suffix (avx2, avx512): this file defines kn_matmul_<sfx> and the rest of
 *                 the matmul half of kn_ops
 *   KN_PR         weight rows per panel (32-bit lanes); KN_NT widest micro-tile; KN_KC 32-element
 *                 blocks per k-chunk; KN_KCK super-blocks per k-chunk; KN_XTAB entries of the
 *                 activation table; KN_S8_BIAS (see Q8_0 above); KN_FT_N float-tile columns
 *   kn_vi, kn_vf  KN_PR x int32 and x float vectors, with kn_vi_ld (unaligned PR dwords),
 *                 kn_vi_set1, kn_vi_zero, kn_vi_and, kn_vi_or, kn_vi_add, kn_vi_srli, kn_vi_slli,
 *                 kn_vi_srai (32-bit lanes), kn_vi_madd16 (vpmaddwd), kn_vf_zero, kn_vf_set1,
 *                 kn_vf_add, kn_vf_mul, kn_vf_fma (a*b+c), kn_vf_fnma (c-a*b), kn_vf_cvt,
 *                 kn_vf_ld_f16 (PR halves to floats)
 *   kn_store_rows(y, nr, acc, first)   y[0..nr) = acc (first k-chunk) or += acc
 *   kn_dot_u8(w, n, lim, x, x_stride, N, c, c_stride, s, split)   s[i] = c[i*c_stride] (0
 *                                      when c is NULL) + sum_j<n (u8 lanes of w[j]) . (4 s8 at
 *                                      x + i*x_stride + 4j) for the N rows of a tile; lim:
 *                                      products of at most lim vectors may be summed in int16
 *                                      (w <= 15: 8; w <= 63: 2); split: two chains
 *   kn_w32, kn_w32_prep(q8, g, w), kn_w32_dot(q8, w, x, x_stride, N, c, c_stride, s, split)
 *                                      one 32-element block of a panel unpacked from its groups
 *                                      at g (q8: Q8_0's signed bytes, else nibbles), and its
 *                                      integer dots with N activation blocks
 *   KN_MIN_APART  Q4_1's min term in an accumulator of its own (1) or in the main one (0)
 *   kn_tilef(ft, ...)                  a float-weight tile (R rows x N columns, reduced at the end)
 *   kn_q8_block, kn_q8K_block, kn_f16_row, kn_bf16_row   activation quantization, bit-identical
 *                                      to quant_ref.c
 */
#ifndef KN_CPU_QUANT_SIMD_H
#define KN_CPU_QUANT_SIMD_H

#include <assert.h>
#include <string.h>

#include "kernels/cpu/internal.h"
#include "kernels/cpu/packed.h"

#ifndef KN_AI
#define KN_AI static inline __attribute__((always_inline))
#endif

#define KN_CAT_(a, b) a##b
#define KN_CAT(a, b)  KN_CAT_(a, b)
#define KN_FN(name)   KN_CAT(name, KN_SFX)

#define KN_VB (4 * KN_PR) /* bytes of one group vector (PR dwords) */

/* Tile widths: every width up to KN_NT for the unpacked-in-registers tiles (one call per panel),
 * powers of two for the buffered ones (a remainder runs as several tiles), which keeps the
 * number of instantiations, and the compile time, down. */
#define KN_CASE(n, CALL)                                                                           \
    case n:                                                                                        \
        CALL(n);                                                                                   \
        break;
#if KN_NT == 8
#define KN_SWITCH_N(N, CALL)                                                                       \
    switch (N) {                                                                                   \
        KN_CASE(1, CALL)                                                                           \
        KN_CASE(2, CALL)                                                                           \
        KN_CASE(3, CALL)                                                                           \
        KN_CASE(4, CALL) KN_CASE(5, CALL) KN_CASE(6, CALL) KN_CASE(7, CALL) default : CALL(8);     \
    }
#define KN_P2(n) ((n) >= 8 ? 8 : (n) >= 4 ? 4 : (n) >= 2 ? 2 : 1)
#define KN_SWITCH_P2(N, CALL)                                                                      \
    switch (N) {                                                                                   \
        KN_CASE(1, CALL) KN_CASE(2, CALL) KN_CASE(4, CALL) default : CALL(8);                      \
    }
#elif KN_NT == 4
#define KN_SWITCH_N(N, CALL)                                                                       \
    switch (N) {                                                                                   \
        KN_CASE(1, CALL) KN_CASE(2, CALL) KN_CASE(3, CALL) default : CALL(4);                      \
    }
#define KN_P2(n) ((n) >= 4 ? 4 : (n) >= 2 ? 2 : 1)
#define KN_SWITCH_P2(N, CALL)                                                                      \
    switch (N) {                                                                                   \
        KN_CASE(1, CALL) KN_CASE(2, CALL) default : CALL(4);                                       \
    }
#else
#error "KN_NT must be 4 or 8"
#endif

KN_AI uint32_t kn_ld32(const void *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

KN_AI float kn_h2f(const void *p)
{
    kn_f16 h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h); /* F16C, which every SIMD build has: bit-identical to kn_f16_to_f32 */
}

/* Software prefetch of the next panel's k-chunk while the current panel is computed (the
 * hardware prefetcher alone leaves DRAM bandwidth unused at m = 1; docs/kernels.md): at block b
 * of this panel, block b of the next one (gs bytes, a multiple of 64; a compile-time constant
 * where this is inlined, so it costs the prefetches and no loop). next is NULL for the last
 * panel of a range. Into L2 (KN_PF_HINT), not L1: into L1 the misses of a cold matrix queue
 * behind each other and the matmul ran at half the speed (docs/kernels.md, "How the matmul is
 * tiled", has the figures). */
#define KN_PF_HINT _MM_HINT_T1
KN_AI void kn_pf_block(const uint8_t *next, size_t gs, int b)
{
    if (!next) return;
    for (size_t o = 0; o < gs; o += 64)
        _mm_prefetch((const char *)next + (size_t)b * gs + o, KN_PF_HINT);
}

/* ------------------------------------------------------------------ Q4_0, Q4_1, Q8_0 */

typedef struct kn_fmt32 {
    md_type t;
    int xbytes, xq; /* activation block size, offset of its quants */
    int q8;         /* signed 8-bit weights (Q8_0) */
    int bias;       /* weight = stored value - bias */
    int has_min;    /* Q4_1 */
    int G, F;       /* groups and f16 fields per block (packed.h) */
} kn_fmt32;

static const kn_fmt32 kn_fmt_q4_0 = {MD_TYPE_Q4_0, sizeof(kn_block_q8_0), 2, 0, 8, 0, 4, 1};
static const kn_fmt32 kn_fmt_q4_1 = {MD_TYPE_Q4_1, sizeof(kn_block_q8_1), 4, 0, 0, 1, 4, 2};
static const kn_fmt32 kn_fmt_q8_0 = {
    MD_TYPE_Q8_0, sizeof(kn_block_q8_0), 2, 1, KN_S8_BIAS, 0, 8, 1};

/* The activation-side table of a column chunk; entry (i, b) at [i * ld + b], ld being the
 * k-chunk's block count, so that a few activation rows can take a long chunk and many rows a
 * short one. */
typedef struct kn_x32 {
    int ld;
    float d[KN_XTAB], s[KN_XTAB]; /* d_x; s_x (Q8_1) */
    int32_t c[KN_XTAB];           /* integer offset correction */
} kn_x32;

static void kn_xprep32(const kn_fmt32 *f, const uint8_t *x, size_t x_stride, int nc, int64_t b0,
                       int nb, kn_x32 *xp)
{
    xp->ld = nb;
    for (int i = 0; i < nc; i++) {
        const uint8_t *xb = x + (size_t)i * x_stride + (size_t)b0 * (size_t)f->xbytes;
        for (int b = 0; b < nb; b++, xb += f->xbytes) {
            const int e = i * nb + b;
            xp->d[e] = kn_h2f(xb);
            xp->s[e] = f->has_min ? kn_h2f(xb + 2) : 0.0f;
            int sum = 0;
            if (f->bias)
                for (int j = 0; j < 32; j++) sum += (int8_t)xb[f->xq + j];
            xp->c[e] = -f->bias * sum;
        }
    }
}

/* N activation rows of a tile against one panel's k-chunk of nb blocks. The blocks are unpacked
 * from their groups at qg (prepped = 0) or come unpacked in P (prepped = 1); their f16 scales are
 * at qf. xb: the tile's first activation row at block 0 of the chunk; xi: its row in the table. */
KN_AI void kn_tile32(const kn_fmt32 *f, const kn_w32 *P, const int prepped, const uint8_t *qg,
                     const uint8_t *qf, int nb, const uint8_t *xb, size_t x_stride,
                     const kn_x32 *xp, int xi, const int N, float *yp, size_t y_stride, int nr,
                     int first, const uint8_t *next)
{
    const size_t gs = (size_t)f->G * KN_VB, fs = (size_t)f->F * 2 * KN_PR;
    const int split = N <= 2;
    kn_vf acc[KN_NT], accm[KN_NT];
#pragma GCC unroll 8
    for (int i = 0; i < N; i++) acc[i] = accm[i] = kn_vf_zero();
    const int32_t *c0 = f->bias ? xp->c + (size_t)xi * (size_t)xp->ld : NULL;
    for (int b = 0; b < nb; b++) {
        kn_pf_block(next, gs, b);
        kn_w32 wl;
        const kn_w32 *w = &wl;
        if (prepped)
            w = &P[b];
        else
            kn_w32_prep(f->q8, qg + (size_t)b * gs, &wl);
        const kn_vf d = kn_vf_ld_f16(qf + (size_t)b * fs);
        const kn_vf mw = f->has_min ? kn_vf_ld_f16(qf + (size_t)b * fs + 2 * KN_PR) : kn_vf_zero();
        const uint8_t *xq = xb + (size_t)b * (size_t)f->xbytes + (size_t)f->xq;
        kn_vi s[KN_NT];
        kn_w32_dot(f->q8, w, xq, x_stride, N, c0 ? c0 + b : NULL, xp->ld, s, split);
#pragma GCC unroll 8
        for (int i = 0; i < N; i++) {
            const int e = (xi + i) * xp->ld + b;
            acc[i] = kn_vf_fma(kn_vf_cvt(s[i]), kn_vf_mul(d, kn_vf_set1(xp->d[e])), acc[i]);
            if (f->has_min && KN_MIN_APART)
                accm[i] = kn_vf_fma(mw, kn_vf_set1(xp->s[e]), accm[i]);
            else if (f->has_min)
                acc[i] = kn_vf_fma(mw, kn_vf_set1(xp->s[e]), acc[i]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < N; i++)
        kn_store_rows(yp + (size_t)i * y_stride, nr,
                      KN_MIN_APART ? kn_vf_add(acc[i], accm[i]) : acc[i], first);
}

/* Where a panel's k-chunk lies: in the packed matrix, or packed now into the thread's buffer. */
typedef struct kn_src {
    const uint8_t *qg, *qf;
    const uint8_t *next; /* the next panel's groups of this k-chunk, to prefetch; or NULL */
} kn_src;

/* Room for one panel k-chunk of any type, packed on the fly when matmul gets GGUF rows (one
 * buffer per thread). */
#define KN_RAW_BYTES                                                                               \
    (KN_KC * KN_PR * 34 > KN_KCK * KN_PR * 210 ? KN_KC * KN_PR * 34 : KN_KCK * KN_PR * 210)
static __thread uint8_t kn_raw[KN_RAW_BYTES] __attribute__((aligned(64)));

static void kn_panel_src(const kn_pfmt *pf, const uint8_t *w, size_t w_stride,
                         const uint8_t *packed, size_t panel_bytes, int64_t p0, int64_t r1,
                         int64_t nb_all, int64_t b0, int nb, uint8_t *raw, kn_src *src)
{
    const size_t gs = (size_t)pf->G * KN_VB, fs = (size_t)pf->F * 2 * KN_PR;
    const int nr = r1 - p0 < KN_PR ? (int)(r1 - p0) : KN_PR;
    src->next = NULL;
    if (packed) {
        const uint8_t *panel = packed + (size_t)(p0 / KN_PR) * panel_bytes;
        src->qg = panel + (size_t)b0 * gs;
        src->qf = panel + (size_t)nb_all * gs + (size_t)b0 * fs;
        if (p0 + KN_PR < r1) { /* the next panel's groups of this k-chunk, and its scales */
            src->next = src->qg + panel_bytes;
            for (size_t o = 0; o < (size_t)nb * fs; o += 64)
                _mm_prefetch((const char *)src->qf + panel_bytes + o, KN_PF_HINT);
        }
    } else {
        kn_pack_panel(pf, KN_PR, w, w_stride, p0, nr, b0, nb, raw, raw + (size_t)nb * gs);
        src->qg = raw;
        src->qf = raw + (size_t)nb * gs;
    }
}

KN_AI void kn_matmul32(const kn_fmt32 *f, const uint8_t *w, size_t w_stride, const uint8_t *packed,
                       const uint8_t *x, size_t x_stride, int64_t k, int m, float *y,
                       size_t y_stride, int64_t r0, int64_t r1)
{
    static __thread kn_w32 prep[KN_KC] __attribute__((aligned(64)));
    kn_x32 xp;
    const kn_pfmt *pf = kn_pfmt_of(f->t);
    const size_t panel_bytes = packed ? kn_packed_panel_bytes(pf, KN_PR, k) : 0;
    const size_t gs = (size_t)f->G * KN_VB;
    const int64_t nb_all = k / 32;
    /* The k-chunk is the same for every m: partial sums of a chunk are added to Y, so a chunking
     * that depended on m would make an output's last bits depend on how many rows share the call.
     * Many activation rows take fewer columns per chunk instead, so the table still fits. */
    const int64_t kc_used = nb_all < KN_KC ? nb_all : KN_KC;
    int ncmax = (int)(KN_XTAB / (kc_used > 0 ? kc_used : 1)) & ~(KN_NT - 1);
    if (ncmax > KN_NC) ncmax = KN_NC;
    if (ncmax < KN_NT) ncmax = KN_NT;
    for (int64_t b0 = 0; b0 < nb_all; b0 += KN_KC) {
        const int nb = nb_all - b0 < KN_KC ? (int)(nb_all - b0) : KN_KC;
        const int first = b0 == 0;
        for (int c0 = 0; c0 < m; c0 += ncmax) {
            const int nc = m - c0 < ncmax ? m - c0 : ncmax;
            const uint8_t *xc = x + (size_t)c0 * x_stride;
            kn_xprep32(f, xc, x_stride, nc, b0, nb, &xp);
            const uint8_t *xb = xc + (size_t)b0 * (size_t)f->xbytes;
            for (int64_t p0 = r0; p0 < r1; p0 += KN_PR) {
                const int nr = r1 - p0 < KN_PR ? (int)(r1 - p0) : KN_PR;
                float *yp = y + (size_t)c0 * y_stride + (size_t)p0;
                kn_src s;
                kn_panel_src(pf, w, w_stride, packed, panel_bytes, p0, r1, nb_all, b0, nb, kn_raw,
                             &s);
                if (nc <= KN_NT) {
#define KN_CALL(N)                                                                                 \
    kn_tile32(f, NULL, 0, s.qg, s.qf, nb, xb, x_stride, &xp, 0, N, yp, y_stride, nr, first, s.next)
                    KN_SWITCH_N(nc, KN_CALL)
#undef KN_CALL
                    continue;
                }
                for (int b = 0; b < nb; b++) {
                    kn_pf_block(s.next, gs, b);
                    kn_w32_prep(f->q8, s.qg + (size_t)b * gs, &prep[b]);
                }
                for (int t = 0; t < nc;) {
                    const int n = KN_P2(nc - t);
                    const uint8_t *xt = xb + (size_t)t * x_stride;
                    float *yt = yp + (size_t)t * y_stride;
#define KN_CALL(N)                                                                                 \
    kn_tile32(f, prep, 1, s.qg, s.qf, nb, xt, x_stride, &xp, t, N, yt, y_stride, nr, first, NULL)
                    KN_SWITCH_P2(n, KN_CALL)
#undef KN_CALL
                    t += n;
                }
            }
        }
    }
}

/* ------------------------------------------------------------------ Q4_K, Q6_K */

typedef struct kn_w4K {
    kn_vi q[8][8]; /* sub-block j (32 elements): q[j][jj] lane r = 4 quants of row r */
    kn_vf dsc[8];  /* d * sc_j per row */
    kn_vi mn[4];   /* (m_2t | m_2t+1 << 16) per row, for vpmaddwd against bsum pairs */
    kn_vf dmin;
} kn_w4K;

typedef struct kn_w6K {
    kn_vi q[16][4]; /* sub-block j (16 elements), u8 0..63 */
    kn_vf dsc[16];  /* d * sc_j per row */
} kn_w6K;

typedef struct kn_xK {
    float d[KN_NC][KN_KCK];
    int32_t c[KN_NC][KN_KCK][16]; /* Q4_K: bsum pairs as int16x2; Q6_K: -32 * bsums[j] */
} kn_xK;

static void kn_xprepK(int is_q6, const uint8_t *x, size_t x_stride, int nc, int64_t b0, int nb,
                      kn_xK *xp)
{
    for (int i = 0; i < nc; i++)
        for (int b = 0; b < nb; b++) {
            const kn_block_q8_K *xb =
                (const kn_block_q8_K *)(x + (size_t)i * x_stride) + (size_t)(b0 + b);
            float d;
            int16_t bs[16];
            memcpy(&d, &xb->d, sizeof d);
            memcpy(bs, xb->bsums, sizeof bs);
            xp->d[i][b] = d;
            if (is_q6) {
                for (int j = 0; j < 16; j++) xp->c[i][b][j] = -32 * bs[j];
            } else {
                for (int t = 0; t < 4; t++) {
                    const int lo = bs[4 * t] + bs[4 * t + 1], hi = bs[4 * t + 2] + bs[4 * t + 3];
                    xp->c[i][b][t] = (int32_t)(((uint32_t)lo & 0xFFFF) | ((uint32_t)hi << 16));
                }
            }
        }
}

KN_AI kn_vi kn_byte_lane(kn_vi z, int u) /* byte u of each dword, zero-extended */
{
    return kn_vi_and(kn_vi_srli(z, 8 * u), kn_vi_set1(0xFF));
}

/* Sub-block j of a Q4_K super-block: its quants are the low (j even) or high (j odd) nibbles of
 * qs bytes 32*(j/2).., packed groups 8*(j/2).. */
KN_AI void kn_q4K_sub(const uint8_t *g, int j, kn_vi q[8])
{
    const kn_vi lo = kn_vi_set1(0x0F0F0F0F);
#pragma GCC unroll 8
    for (int jj = 0; jj < 8; jj++) {
        const kn_vi r = kn_vi_ld(g + (size_t)(8 * (j / 2) + jj) * KN_VB);
        q[jj] = kn_vi_and(j & 1 ? kn_vi_srli(r, 4) : r, lo);
    }
}

/* The 12 scale bytes (groups 32..34) as dwords u0..u2 per lane, then ggml's utmp unpacking
 * lane-wise: scales are the bytes of (u0 & k1, u1'), mins the bytes of (u1 & k1, u3'). */
KN_AI void kn_q4K_scales(const uint8_t *g, const uint8_t *h, kn_vf dsc[8], kn_vi mn[4], kn_vf *dmin)
{
    const kn_vi u0 = kn_vi_ld(g + 32 * KN_VB), u1 = kn_vi_ld(g + 33 * KN_VB),
                u2 = kn_vi_ld(g + 34 * KN_VB);
    const kn_vi k1 = kn_vi_set1(0x3f3f3f3f), k2 = kn_vi_set1(0x0f0f0f0f),
                k3 = kn_vi_set1(0x03030303);
    const kn_vi sc0 = kn_vi_and(u0, k1);
    const kn_vi sc1 = kn_vi_or(kn_vi_and(u2, k2), kn_vi_slli(kn_vi_and(kn_vi_srli(u0, 6), k3), 4));
    const kn_vi mn0 = kn_vi_and(u1, k1);
    const kn_vi mn1 =
        kn_vi_or(kn_vi_and(kn_vi_srli(u2, 4), k2), kn_vi_slli(kn_vi_and(kn_vi_srli(u1, 6), k3), 4));
    const kn_vf d = kn_vf_ld_f16(h);
    *dmin = kn_vf_ld_f16(h + 2 * KN_PR);
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++)
        dsc[j] = kn_vf_mul(d, kn_vf_cvt(kn_byte_lane(j < 4 ? sc0 : sc1, j % 4)));
#pragma GCC unroll 4
    for (int t = 0; t < 4; t++) {
        const kn_vi z = t < 2 ? mn0 : mn1;
        const int u = 2 * (t % 2);
        mn[t] = kn_vi_or(kn_byte_lane(z, u), kn_vi_slli(kn_byte_lane(z, u + 1), 16));
    }
}

/* Sub-block sb (16 elements) of a Q6_K super-block, assembled in the transposed domain: a dword of
 * ql (bytes l..l+3 of a 32-byte half) and the same dword of qh hold every bit of elements l..,
 * 32+l.., 64+l.., 96+l.. of the row. Packed groups: ql 0..31, qh 32..47. */
KN_AI void kn_q6K_sub(const uint8_t *g, int sb, kn_vi q[4])
{
    const kn_vi m4 = kn_vi_set1(0x0F0F0F0F), m2 = kn_vi_set1(0x30303030);
    const int h = sb / 8, c = sb % 2, kind = (sb % 8) / 2;
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        const kn_vi L = kn_vi_ld(g + (size_t)(16 * h + (kind & 1 ? 8 : 0) + 4 * c + j) * KN_VB);
        const kn_vi H = kn_vi_ld(g + (size_t)(32 + 8 * h + 4 * c + j) * KN_VB);
        const kn_vi lo = kind < 2 ? L : kn_vi_srli(L, 4);
        const kn_vi hi = kind == 0   ? kn_vi_slli(H, 4)
                         : kind == 1 ? kn_vi_slli(H, 2)
                         : kind == 2 ? H
                                     : kn_vi_srli(H, 2);
        q[j] = kn_vi_or(kn_vi_and(lo, m4), kn_vi_and(hi, m2));
    }
}

/* The 16 int8 scales (groups 48..51) times d. */
KN_AI void kn_q6K_scales(const uint8_t *g, const uint8_t *h, kn_vf dsc[16])
{
    const kn_vf d = kn_vf_ld_f16(h);
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) {
        const kn_vi z = kn_vi_ld(g + (size_t)(48 + j / 4) * KN_VB);
        dsc[j] = kn_vf_mul(d, kn_vf_cvt(kn_vi_srai(kn_vi_slli(z, 24 - 8 * (j % 4)), 24)));
    }
}

typedef union kn_wK {
    kn_w4K q4;
    kn_w6K q6;
} kn_wK;

static void kn_prepK(int q6, const uint8_t *g, const uint8_t *h, kn_wK *P)
{
    if (q6) {
        for (int j = 0; j < 16; j++) kn_q6K_sub(g, j, P->q6.q[j]);
        kn_q6K_scales(g, h, P->q6.dsc);
    } else {
        for (int j = 0; j < 8; j++) kn_q4K_sub(g, j, P->q4.q[j]);
        kn_q4K_scales(g, h, P->q4.dsc, P->q4.mn, &P->q4.dmin);
    }
}

#define KN_G4K 35 /* groups per Q4_K super-block */
#define KN_G6K 52

/* N activation rows of a tile against one panel's k-chunk of nb super-blocks, unpacked from
 * their groups at qg (prepped = 0) or coming unpacked in P (prepped = 1). */
KN_AI void kn_tileK(const int q6, const kn_wK *P, const int prepped, const uint8_t *qg,
                    const uint8_t *qf, int nb, const uint8_t *xb, size_t x_stride, const kn_xK *xp,
                    int xi, const int N, float *yp, size_t y_stride, int nr, int first)
{
    const int split = N <= 2, nsub = q6 ? 16 : 8;
    const size_t gs = (size_t)(q6 ? KN_G6K : KN_G4K) * KN_VB, fs = (size_t)(q6 ? 2 : 4) * KN_PR;
    kn_vf acc[KN_NT];
#pragma GCC unroll 8
    for (int i = 0; i < N; i++) acc[i] = kn_vf_zero();
    for (int b = 0; b < nb; b++) {
        const uint8_t *g = qg + (size_t)b * gs, *h = qf + (size_t)b * fs;
        const uint8_t *xq = xb + (size_t)b * sizeof(kn_block_q8_K) + offsetof(kn_block_q8_K, qs);
        kn_vf dscl[16], dmin = kn_vf_zero();
        kn_vi mnl[4];
        const kn_vf *dsc = dscl;
        const kn_vi *mn = mnl;
        if (prepped && q6) {
            dsc = P[b].q6.dsc;
        } else if (prepped) {
            dsc = P[b].q4.dsc;
            mn = P[b].q4.mn;
            dmin = P[b].q4.dmin;
        } else if (q6) {
            kn_q6K_scales(g, h, dscl);
        } else {
            kn_q4K_scales(g, h, dscl, mnl, &dmin);
        }
        kn_vf gacc[KN_NT];
#pragma GCC unroll 8
        for (int i = 0; i < N; i++) gacc[i] = kn_vf_zero();
        for (int j = 0; j < nsub; j++) {
            kn_vi ql[8], s[KN_NT];
            const kn_vi *q = ql;
            if (prepped)
                q = q6 ? P[b].q6.q[j] : P[b].q4.q[j];
            else if (q6)
                kn_q6K_sub(g, j, ql);
            else
                kn_q4K_sub(g, j, ql);
            if (q6) /* 16 elements of 0..63, starting at -32 * bsum_j */
                kn_dot_u8(q, 4, 2, xq + 16 * j, x_stride, N, &xp->c[xi][b][j],
                          (int)(sizeof xp->c[0] / sizeof(int32_t)), s, 0);
            else
                kn_dot_u8(q, 8, 8, xq + 32 * j, x_stride, N, NULL, 0, s, split);
#pragma GCC unroll 8
            for (int i = 0; i < N; i++) gacc[i] = kn_vf_fma(kn_vf_cvt(s[i]), dsc[j], gacc[i]);
        }
#pragma GCC unroll 8
        for (int i = 0; i < N; i++) {
            if (!q6) { /* - dmin * sum_j m_j * bsum_j, exact in int32 */
                kn_vi ms = kn_vi_madd16(mn[0], kn_vi_set1(xp->c[xi + i][b][0]));
#pragma GCC unroll 4
                for (int t = 1; t < 4; t++)
                    ms = kn_vi_add(ms, kn_vi_madd16(mn[t], kn_vi_set1(xp->c[xi + i][b][t])));
                gacc[i] = kn_vf_fnma(kn_vf_cvt(ms), dmin, gacc[i]);
            }
            acc[i] = kn_vf_fma(gacc[i], kn_vf_set1(xp->d[xi + i][b]), acc[i]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < N; i++) kn_store_rows(yp + (size_t)i * y_stride, nr, acc[i], first);
}

KN_AI void kn_matmulK(const int is_q6, const uint8_t *w, size_t w_stride, const uint8_t *packed,
                      const uint8_t *x, size_t x_stride, int64_t k, int m, float *y,
                      size_t y_stride, int64_t r0, int64_t r1)
{
    static __thread kn_wK prep[KN_KCK] __attribute__((aligned(64)));
    kn_xK xp;
    const kn_pfmt *pf = kn_pfmt_of(is_q6 ? MD_TYPE_Q6_K : MD_TYPE_Q4_K);
    const size_t panel_bytes = packed ? kn_packed_panel_bytes(pf, KN_PR, k) : 0;
    const size_t gs = (size_t)pf->G * KN_VB, fs = (size_t)pf->F * 2 * KN_PR;
    const int64_t nb_all = k / KN_QK_K;
    for (int64_t b0 = 0; b0 < nb_all; b0 += KN_KCK) {
        const int nb = nb_all - b0 < KN_KCK ? (int)(nb_all - b0) : KN_KCK;
        const int first = b0 == 0;
        for (int c0 = 0; c0 < m; c0 += KN_NC) {
            const int nc = m - c0 < KN_NC ? m - c0 : KN_NC;
            const uint8_t *xc = x + (size_t)c0 * x_stride;
            kn_xprepK(is_q6, xc, x_stride, nc, b0, nb, &xp);
            const uint8_t *xb = xc + (size_t)b0 * sizeof(kn_block_q8_K);
            for (int64_t p0 = r0; p0 < r1; p0 += KN_PR) {
                const int nr = r1 - p0 < KN_PR ? (int)(r1 - p0) : KN_PR;
                float *yp = y + (size_t)c0 * y_stride + (size_t)p0;
                kn_src s;
                /* no software prefetch here: ~50 lines a super-block come in bursts that
                 * measured slower than the hardware prefetchers alone */
                kn_panel_src(pf, w, w_stride, packed, panel_bytes, p0, r1, nb_all, b0, nb, kn_raw,
                             &s);
                if (nc <= KN_NT) {
#define KN_CALL(N)                                                                                 \
    kn_tileK(is_q6, NULL, 0, s.qg, s.qf, nb, xb, x_stride, &xp, 0, N, yp, y_stride, nr, first)
                    KN_SWITCH_N(nc, KN_CALL)
#undef KN_CALL
                    continue;
                }
                for (int b = 0; b < nb; b++)
                    kn_prepK(is_q6, s.qg + (size_t)b * gs, s.qf + (size_t)b * fs, &prep[b]);
                for (int t = 0; t < nc;) {
                    const int n = KN_P2(nc - t);
                    const uint8_t *xt = xb + (size_t)t * x_stride;
                    float *yt = yp + (size_t)t * y_stride;
#define KN_CALL(N)                                                                                 \
    kn_tileK(is_q6, prep, 1, s.qg, s.qf, nb, xt, x_stride, &xp, t, N, yt, y_stride, nr, first)
                    KN_SWITCH_P2(n, KN_CALL)
#undef KN_CALL
                    t += n;
                }
            }
        }
    }
}

/* ------------------------------------------------------------------ F32, F16, BF16 */

/* 4 x KN_FT_N tiles; the row and column remainders run as 1-wide tiles. Float weights are never
 * packed. */
KN_AI void kn_matmulf(const md_type ft, const uint8_t *w, size_t w_stride, const uint8_t *x,
                      size_t x_stride, int64_t k, int m, float *y, size_t y_stride, int64_t r0,
                      int64_t r1)
{
    for (int64_t r = r0; r < r1;) {
        const int R = r1 - r >= 4 ? 4 : 1;
        for (int i = 0; i < m;) {
            const int N = m - i >= KN_FT_N ? KN_FT_N : 1;
            const uint8_t *wr = w + (size_t)r * w_stride, *xi = x + (size_t)i * x_stride;
            float *yo = y + (size_t)i * y_stride + (size_t)r;
            if (R == 4 && N == KN_FT_N)
                kn_tilef(ft, wr, w_stride, xi, x_stride, k, 4, KN_FT_N, yo, y_stride);
            else if (R == 4)
                kn_tilef(ft, wr, w_stride, xi, x_stride, k, 4, 1, yo, y_stride);
            else if (N == KN_FT_N)
                kn_tilef(ft, wr, w_stride, xi, x_stride, k, 1, KN_FT_N, yo, y_stride);
            else
                kn_tilef(ft, wr, w_stride, xi, x_stride, k, 1, 1, yo, y_stride);
            i += N;
        }
        r += R;
    }
}

/* ------------------------------------------------------------------ the kn_ops entries */

static void kn_matmul_any(md_type wt, const void *w, size_t w_stride, const void *packed,
                          const void *x, size_t x_stride, int64_t k, int m, float *y,
                          size_t y_stride, int64_t r0, int64_t r1)
{
    if (r0 >= r1 || m <= 0) return;
    assert(k % (wt == MD_TYPE_Q4_K || wt == MD_TYPE_Q6_K ? KN_QK_K : 32) == 0 ||
           wt == MD_TYPE_F32 || wt == MD_TYPE_F16 || wt == MD_TYPE_BF16);
    if (k <= 0) { /* an empty dot: zeros, as the reference writes */
        for (int i = 0; i < m; i++)
            for (int64_t r = r0; r < r1; r++) y[(size_t)i * y_stride + (size_t)r] = 0.0f;
        return;
    }
    switch (wt) {
    case MD_TYPE_Q4_0:
        kn_matmul32(&kn_fmt_q4_0, w, w_stride, packed, x, x_stride, k, m, y, y_stride, r0, r1);
        break;
    case MD_TYPE_Q4_1:
        kn_matmul32(&kn_fmt_q4_1, w, w_stride, packed, x, x_stride, k, m, y, y_stride, r0, r1);
        break;
    case MD_TYPE_Q8_0:
        kn_matmul32(&kn_fmt_q8_0, w, w_stride, packed, x, x_stride, k, m, y, y_stride, r0, r1);
        break;
    case MD_TYPE_Q4_K:
        kn_matmulK(0, w, w_stride, packed, x, x_stride, k, m, y, y_stride, r0, r1);
        break;
    case MD_TYPE_Q6_K:
        kn_matmulK(1, w, w_stride, packed, x, x_stride, k, m, y, y_stride, r0, r1);
        break;
    case MD_TYPE_F32: /* float weights are never packed */
        kn_matmulf(MD_TYPE_F32, w, w_stride, x, x_stride, k, m, y, y_stride, r0, r1);
        break;
    case MD_TYPE_F16:
        kn_matmulf(MD_TYPE_F16, w, w_stride, x, x_stride, k, m, y, y_stride, r0, r1);
        break;
    case MD_TYPE_BF16:
        kn_matmulf(MD_TYPE_BF16, w, w_stride, x, x_stride, k, m, y, y_stride, r0, r1);
        break;
    default:
        assert(!"kn_matmul: unsupported weight type");
    }
}

void KN_FN(kn_matmul_)(md_type wt, const void *w, size_t w_stride, const void *x, size_t x_stride,
                       int64_t k, int m, float *y, size_t y_stride, int64_t r0, int64_t r1)
{
    kn_matmul_any(wt, w, w_stride, NULL, x, x_stride, k, m, y, y_stride, r0, r1);
}

void KN_FN(kn_matmul_packed_)(md_type wt, const void *packed, int64_t rows, const void *x,
                              size_t x_stride, int64_t k, int m, float *y, size_t y_stride,
                              int64_t r0, int64_t r1)
{
    assert(packed && r0 % KN_PR == 0 && r1 <= rows && kn_pfmt_of(wt));
    (void)rows;
    kn_matmul_any(wt, NULL, 0, packed, x, x_stride, k, m, y, y_stride, r0, r1);
}

size_t KN_FN(kn_pack_size_)(md_type wt, int64_t rows, int64_t k)
{
    return kn_packed_size(wt, KN_PR, rows, k);
}

void KN_FN(kn_pack_)(md_type wt, const void *w, size_t w_stride, int64_t rows, int64_t k, void *out)
{
    kn_pack_matrix(wt, KN_PR, w, w_stride, rows, k, out);
}

void KN_FN(kn_quantize_row_)(md_type t, const float *x, void *vy, int64_t n)
{
    uint8_t *y = vy;
    switch (t) {
    case MD_TYPE_Q8_0:
        assert(n % KN_QK8_0 == 0);
        for (int64_t i = 0; i < n / KN_QK8_0; i++, x += KN_QK8_0, y += sizeof(kn_block_q8_0)) {
            kn_f16 d;
            float dv;
            kn_q8_block(x, (int8_t *)(y + 2), &d, &dv);
            memcpy(y, &d, 2);
        }
        break;
    case MD_TYPE_Q8_1:
        assert(n % KN_QK8_1 == 0);
        for (int64_t i = 0; i < n / KN_QK8_1; i++, x += KN_QK8_1, y += sizeof(kn_block_q8_1)) {
            kn_f16 d;
            float dv;
            const int sum = kn_q8_block(x, (int8_t *)(y + 4), &d, &dv);
            const kn_f16 s = _cvtss_sh(dv * (float)sum, 0);
            memcpy(y, &d, 2);
            memcpy(y + 2, &s, 2);
        }
        break;
    case MD_TYPE_Q8_K:
        assert(n % KN_QK_K == 0);
        for (int64_t i = 0; i < n / KN_QK_K; i++, x += KN_QK_K, y += sizeof(kn_block_q8_K))
            kn_q8K_block(x, y);
        break;
    case MD_TYPE_F16:
        kn_f16_row(x, (kn_f16 *)vy, n);
        break;
    case MD_TYPE_BF16:
        kn_bf16_row(x, (kn_bf16 *)vy, n);
        break;
    case MD_TYPE_F32:
        memmove(vy, x, (size_t)n * sizeof(float));
        break;
    default:
        assert(!"kn_quantize_row: unsupported type");
    }
}

/* Dequantization runs once per token for the embedding row: the reference is fast enough. */
void KN_FN(kn_dequantize_row_)(md_type t, const void *x, float *y, int64_t n)
{
    kn_dequantize_row_ref(t, x, y, n);
}

#endif /* KN_CPU_QUANT_SIMD_H */
