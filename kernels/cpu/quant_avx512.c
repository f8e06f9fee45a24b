/*
 * quant_avx512.c — AVX-512 (F/BW/VL/DQ + VNNI) quantization and matrix multiply, held to
 * quant_ref.c by tests/unit/test_kernels_quant.c.
 *
 * Quantized matmul: weights are re-laid out on the fly into panels of 16 rows in which one zmm
 * holds, for each of the 16 rows, 4 consecutive quant bytes (lane r = row r). A 4-byte group of
 * an activation row broadcast to all lanes then feeds one vpdpbusd that advances 16 dot products
 * by 4 products each. A micro-tile keeps 16 rows x up to 8 activation rows of float accumulators
 * in registers: every unpacked weight vector is reused for up to 8 activation rows, and every
 * activation group for 16 weight rows. The integer sum of each 32-element block (16 for Q6_K) is
 * exact and is scaled into the float accumulator once per block, as in ggml:
 *   Q4_1:  acc += (d_w * d_x) * isum + m_w * s_x
 *   Q4_0:  isum starts at -8 * sum(x_q), then acc += (d_w * d_x) * isum (nibbles are u8 0..15)
 *   Q8_0:  weights biased to u8 by +128, isum starts at -128 * sum(x_q)
 *   Q4_K:  per super-block g = sum_j (d*sc_j) * isum_j - dmin * sum_j m_j * bsum_j, acc += d_x*g
 *   Q6_K:  isum_j starts at -32 * bsum_j (Q8_K's own 16-sums), g = sum_j (d*sc_j) * isum_j
 * The X-side numbers a tile needs per block (d_x, s_x, the offset corrections) are converted once
 * per column chunk into a small table. For up to 8 activation rows (decode) the panel is built
 * block by block in registers and used at once, with k unsplit up to 8192 so the weights stream
 * in one pass; for more activation rows it is built once per k-chunk into a
 * stack buffer (about 45 KB of stack in all) and swept by every column tile, so its cost is
 * shared by all of them. Building a panel block: 16 row loads and an in-lane 4x4 dword transpose
 * for the quants, one vpgatherdd for the 16 rows' fp16 scales. While a panel is built the next
 * one is software-prefetched a slice per block: 16 interleaved row streams otherwise leave DRAM
 * bandwidth unused (measured 1.8x on the 49152 x 576 output matrix at m = 1). The k-quants get no
 * such prefetch: theirs came in bursts and measured slower. (An AMX-INT8 path was built and
 * measured no faster on this hardware; docs/kernels.md says why.)
 *
 * Float weights (F32, F16, BF16) use a direct 4 x 4 register tile of row-by-column dot products
 * reduced at the end; BF16 uses vdpbf16ps when the CPU has AVX512_BF16 (checked at run time,
 * since the table only requires VNNI), as ggml does.
 *
 * Activation quantization is bit-identical to the reference. Dequantization is used for one
 * embedding row per token only, so it forwards to the reference (it gains nothing here).
 */
#include <assert.h>
#include <immintrin.h>
#include <string.h>

#include "kernels/cpu/internal.h"

#define KN_INLINE static inline __attribute__((always_inline))

#define KN_PR  16 /* weight rows per panel: one int32 lane each */
#define KN_NT  8  /* activation rows per micro-tile */
#define KN_NC  64 /* activation rows per column chunk (X-side table) */
#define KN_KC  32 /* 32-element blocks per k-chunk */
#define KN_KCK 4  /* 256-element super-blocks per k-chunk */

KN_INLINE uint32_t kn_ld32(const void *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

KN_INLINE uint16_t kn_ld16(const void *p)
{
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

KN_INLINE __m512i kn_bcast32(const void *p)
{
    return _mm512_set1_epi32((int)kn_ld32(p));
}

/* Z[j] lane r = bytes [4j, 4j+4) of the 16 bytes at rp[r] + off, r = 0..15. Each A[g] holds rows
 * g, g+4, g+8, g+12 in its 128-bit lanes, so the 4x4 dword transposes inside the lanes leave the
 * rows in natural order. */
KN_INLINE void kn_tr16x4(const uint8_t *const rp[KN_PR], size_t off, __m512i Z[4])
{
    __m512i A[4];
#pragma GCC unroll 16
    for (int g = 0; g < 4; g++) {
        __m512i a = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(rp[g] + off)));
        a = _mm512_inserti32x4(a, _mm_loadu_si128((const __m128i *)(rp[g + 4] + off)), 1);
        a = _mm512_inserti32x4(a, _mm_loadu_si128((const __m128i *)(rp[g + 8] + off)), 2);
        A[g] = _mm512_inserti32x4(a, _mm_loadu_si128((const __m128i *)(rp[g + 12] + off)), 3);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(A[0], A[1]), t1 = _mm512_unpackhi_epi32(A[0], A[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(A[2], A[3]), t3 = _mm512_unpackhi_epi32(A[2], A[3]);
    Z[0] = _mm512_unpacklo_epi64(t0, t2);
    Z[1] = _mm512_unpackhi_epi64(t0, t2);
    Z[2] = _mm512_unpacklo_epi64(t1, t3);
    Z[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* Writes (first k-chunk) or adds (later ones) a 16-row accumulator to Y. */
KN_INLINE void kn_store_rows(float *yp, __mmask16 mask, __m512 acc, int first)
{
    if (!first) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, yp));
    _mm512_mask_storeu_ps(yp, mask, acc);
}

/* ------------------------------------------------------------------ Q4_0, Q4_1, Q8_0 */

typedef struct kn_p32 {
    __m512i q[8]; /* u8 quants: q[j] lane r = row r, k = 4j..4j+3 of the block */
    __m512 d, m;  /* per row: block scale; block min (Q4_1) */
} kn_p32;

/* Entry (i, b) at [i * ld + b]: ld is the k-chunk's block count, so a few activation rows can
 * take a long chunk (decode needs no k-chunking) and many rows a short one. */
typedef struct kn_x32 {
    int ld;
    float d[KN_NC * KN_KC], s[KN_NC * KN_KC]; /* d_x; s_x (Q8_1) */
    int32_t c[KN_NC * KN_KC];                 /* integer offset correction */
} kn_x32;

typedef struct kn_fmt32 {
    int wbytes, wq; /* weight block size, offset of its quants */
    int xbytes, xq; /* activation block size, offset of its quants */
    int bias;       /* weight quant = stored u8 - bias */
    int has_min;
} kn_fmt32;

static const kn_fmt32 kn_fmt_q4_0 = {sizeof(kn_block_q4_0), 2, sizeof(kn_block_q8_0), 2, 8, 0};
static const kn_fmt32 kn_fmt_q4_1 = {sizeof(kn_block_q4_1), 4, sizeof(kn_block_q8_1), 4, 0, 1};
static const kn_fmt32 kn_fmt_q8_0 = {sizeof(kn_block_q8_0), 2, sizeof(kn_block_q8_0), 2, 128, 0};

/* Byte offsets of the panel's 16 rows from its first row (missing rows repeat the last), for
 * vpgatherdd: one gather fetches a per-row dword (the block scales) in a few cycles. */
KN_INLINE __m512i kn_row_offsets(size_t w_stride, int nr)
{
    const __m512i r =
        _mm512_min_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(nr - 1));
    assert(w_stride <= (size_t)INT32_MAX / KN_PR);
    return _mm512_mullo_epi32(r, _mm512_set1_epi32((int)w_stride));
}

/* One block of a 16-row panel: transposed, nibbles unpacked (or int8 biased to u8). */
KN_INLINE void kn_pack32_q(const kn_fmt32 *f, const uint8_t *const rp[KN_PR], int64_t blk,
                           __m512i q[8])
{
    const size_t off = (size_t)blk * (size_t)f->wbytes + (size_t)f->wq;
    __m512i Z[4];
    kn_tr16x4(rp, off, Z);
    if (f->bias == 128) {
        const __m512i sign = _mm512_set1_epi8((char)0x80);
#pragma GCC unroll 16
        for (int j = 0; j < 4; j++) q[j] = _mm512_xor_si512(Z[j], sign);
        kn_tr16x4(rp, off + 16, Z);
#pragma GCC unroll 16
        for (int j = 0; j < 4; j++) q[j + 4] = _mm512_xor_si512(Z[j], sign);
    } else {
        const __m512i lo = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 16
        for (int j = 0; j < 4; j++) {
            q[j] = _mm512_and_si512(Z[j], lo);
            q[j + 4] = _mm512_and_si512(_mm512_srli_epi32(Z[j], 4), lo);
        }
    }
}

/* The scales of block blk for the 16 rows: fp16 d, and m for Q4_1, lead each block. */
KN_INLINE void kn_pack32_dm(const kn_fmt32 *f, const uint8_t *row0, __m512i roff, int64_t blk,
                            __m512 *d, __m512 *m)
{
    const __m512i v = _mm512_i32gather_epi32(roff, row0 + (size_t)blk * (size_t)f->wbytes, 1);
    *d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v));
    *m = f->has_min ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)))
                    : _mm512_setzero_ps();
}

/* The X-side table of a column chunk: nc activation rows, blocks [b0, b0+nb). */
static void kn_xprep32(const kn_fmt32 *f, const uint8_t *x, size_t x_stride, int nc, int64_t b0,
                       int nb, kn_x32 *xp)
{
    const __m256i sign = _mm256_set1_epi8((char)0x80);
    xp->ld = nb;
    for (int i = 0; i < nc; i++) {
        const uint8_t *xb = x + (size_t)i * x_stride + (size_t)b0 * (size_t)f->xbytes;
        for (int b = 0; b < nb; b++, xb += f->xbytes) {
            xp->d[(i)*xp->ld + (b)] = _cvtsh_ss(kn_ld16(xb));
            if (f->has_min) {
                xp->s[(i)*xp->ld + (b)] = _cvtsh_ss(kn_ld16(xb + 2));
                xp->c[(i)*xp->ld + (b)] = 0;
            } else {
                /* sum of the int8 quants: sad of (q + 128) against 0, less 32 * 128 */
                const __m256i q = _mm256_loadu_si256((const __m256i *)(xb + f->xq));
                const __m256i s =
                    _mm256_sad_epu8(_mm256_xor_si256(q, sign), _mm256_setzero_si256());
                const __m128i s2 =
                    _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
                const int sum = (int)(_mm_cvtsi128_si64(s2) + _mm_extract_epi64(s2, 1)) - 4096;
                xp->c[(i)*xp->ld + (b)] = -f->bias * sum;
                xp->s[(i)*xp->ld + (b)] = 0;
            }
        }
    }
}

/* Software prefetch of the next panel while this one is built: exactly the k-chunk's bytes of
 * its rows, a few lines per block. 16 interleaved row streams otherwise leave DRAM bandwidth
 * unused (1.8x on the 49152 x 576 output matrix at m = 1). */
typedef struct kn_pf {
    const uint8_t *row; /* next panel row, at the k-chunk's first block */
    size_t stride, len; /* row stride; bytes of the k-chunk in a row */
    size_t off;
    int rows_left, per_block;
} kn_pf;

KN_INLINE void kn_pf_init(kn_pf *pf, const uint8_t *row, size_t stride, size_t len, int rows,
                          int nb)
{
    pf->row = row;
    pf->stride = stride;
    pf->len = len;
    pf->off = 0;
    pf->rows_left = rows > 0 ? rows : 0;
    const size_t lines = (size_t)pf->rows_left * ((len + 63) / 64);
    pf->per_block = (int)((lines + (size_t)nb - 1) / (size_t)nb);
}

KN_INLINE void kn_pf_step(kn_pf *pf)
{
    for (int u = 0; u < pf->per_block && pf->rows_left > 0; u++) {
        _mm_prefetch((const char *)pf->row + pf->off, _MM_HINT_T0);
        pf->off += 64;
        if (pf->off >= pf->len) {
            pf->off = 0;
            pf->row += pf->stride;
            pf->rows_left--;
        }
    }
}

/* acc[i] (16 rows) += one block's contribution for activation rows i < N of a tile (accm[i]:
 * the Q4_1 min term, kept apart to halve the dependency chain). xb points at the tile's first
 * activation row, block 0 of the k-chunk; xi is the tile's first row in the X-side table. With
 * few rows the 8-deep vpdpbusd chains are split in two for latency. */
KN_INLINE void kn_block32(const kn_fmt32 *f, const __m512i q[8], __m512 d, __m512 mw, int b,
                          const uint8_t *xb, size_t x_stride, const kn_x32 *xp, int xi, int N,
                          __m512 acc[KN_NT], __m512 accm[KN_NT])
{
    const int split = N <= 2;
    __m512i s[KN_NT], s2[2];
#pragma GCC unroll 16
    for (int i = 0; i < N; i++)
        s[i] = f->bias ? _mm512_set1_epi32(xp->c[(xi + i) * xp->ld + (b)]) : _mm512_setzero_si512();
    if (split)
#pragma GCC unroll 16
        for (int i = 0; i < N; i++) s2[i] = _mm512_setzero_si512();
    const uint8_t *xq = xb + (size_t)b * (size_t)f->xbytes + (size_t)f->xq;
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
#pragma GCC unroll 8
        for (int i = 0; i < N; i++) {
            const __m512i xv = kn_bcast32(xq + (size_t)i * x_stride + 4 * j);
            if (split && (j & 1))
                s2[i] = _mm512_dpbusd_epi32(s2[i], q[j], xv);
            else
                s[i] = _mm512_dpbusd_epi32(s[i], q[j], xv);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < N; i++) {
        if (split) s[i] = _mm512_add_epi32(s[i], s2[i]);
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(xp->d[(xi + i) * xp->ld + (b)]));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), scale, acc[i]);
        if (f->has_min)
            accm[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xp->s[(xi + i) * xp->ld + (b)]), accm[i]);
    }
}

/* Few activation rows: each panel block is built in registers and used at once. */
KN_INLINE void kn_fused32(const kn_fmt32 *f, const uint8_t *const rp[KN_PR], size_t w_stride,
                          int nr, int64_t b0, int nb, const uint8_t *xb, size_t x_stride,
                          const kn_x32 *xp, int N, float *yp, size_t y_stride, __mmask16 mask,
                          int first, kn_pf *pf)
{
    const __m512i roff = kn_row_offsets(w_stride, nr);
    __m512 acc[KN_NT], accm[KN_NT];
#pragma GCC unroll 16
    for (int i = 0; i < N; i++) acc[i] = accm[i] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        kn_pf_step(pf);
        __m512i q[8];
        __m512 d, mw;
        kn_pack32_q(f, rp, b0 + b, q);
        kn_pack32_dm(f, rp[0], roff, b0 + b, &d, &mw);
        kn_block32(f, q, d, mw, b, xb, x_stride, xp, 0, N, acc, accm);
    }
#pragma GCC unroll 16
    for (int i = 0; i < N; i++)
        kn_store_rows(yp + (size_t)i * y_stride, mask, _mm512_add_ps(acc[i], accm[i]), first);
}

/* Many activation rows: one micro-tile of N rows over a packed panel. */
KN_INLINE void kn_tile32(const kn_fmt32 *f, const kn_p32 *P, int nb, const uint8_t *xb,
                         size_t x_stride, const kn_x32 *xp, int xi, int N, float *yp,
                         size_t y_stride, __mmask16 mask, int first)
{
    __m512 acc[KN_NT], accm[KN_NT];
#pragma GCC unroll 16
    for (int i = 0; i < N; i++) acc[i] = accm[i] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++)
        kn_block32(f, P[b].q, P[b].d, P[b].m, b, xb, x_stride, xp, xi, N, acc, accm);
#pragma GCC unroll 16
    for (int i = 0; i < N; i++)
        kn_store_rows(yp + (size_t)i * y_stride, mask, _mm512_add_ps(acc[i], accm[i]), first);
}

/* Packs the whole panel for k-chunk [b0, b0+nb). */
KN_INLINE void kn_pack32(const kn_fmt32 *f, const uint8_t *const rp[KN_PR], size_t w_stride, int nr,
                         int64_t b0, int nb, kn_p32 *P, kn_pf *pf)
{
    const __m512i roff = kn_row_offsets(w_stride, nr);
    for (int b = 0; b < nb; b++) {
        kn_pf_step(pf);
        kn_pack32_q(f, rp, b0 + b, P[b].q);
        kn_pack32_dm(f, rp[0], roff, b0 + b, &P[b].d, &P[b].m);
    }
}

/* Packed-panel tiles come in widths 8, 4, 2, 1 only (a remainder runs as several tiles), which
 * keeps the number of instantiations, and the compile time, down. */
#define KN_SWITCH_P2(N, CALL)                                                                      \
    switch (N) {                                                                                   \
    case 1:                                                                                        \
        CALL(1);                                                                                   \
        break;                                                                                     \
    case 2:                                                                                        \
        CALL(2);                                                                                   \
        break;                                                                                     \
    case 4:                                                                                        \
        CALL(4);                                                                                   \
        break;                                                                                     \
    default:                                                                                       \
        CALL(8);                                                                                   \
        break;                                                                                     \
    }

#define KN_SWITCH_N(N, CALL)                                                                       \
    switch (N) {                                                                                   \
    case 1:                                                                                        \
        CALL(1);                                                                                   \
        break;                                                                                     \
    case 2:                                                                                        \
        CALL(2);                                                                                   \
        break;                                                                                     \
    case 3:                                                                                        \
        CALL(3);                                                                                   \
        break;                                                                                     \
    case 4:                                                                                        \
        CALL(4);                                                                                   \
        break;                                                                                     \
    case 5:                                                                                        \
        CALL(5);                                                                                   \
        break;                                                                                     \
    case 6:                                                                                        \
        CALL(6);                                                                                   \
        break;                                                                                     \
    case 7:                                                                                        \
        CALL(7);                                                                                   \
        break;                                                                                     \
    default:                                                                                       \
        CALL(8);                                                                                   \
        break;                                                                                     \
    }

/* Row pointers of the panel at p0 with nr valid rows; missing rows repeat the last one (their
 * results are masked off at the store). */
KN_INLINE __mmask16 kn_panel_rows(const uint8_t *w, size_t w_stride, int64_t p0, int64_t r1,
                                  const uint8_t *rp[KN_PR])
{
    const int nr = r1 - p0 < KN_PR ? (int)(r1 - p0) : KN_PR;
    for (int r = 0; r < KN_PR; r++) rp[r] = w + (size_t)(p0 + (r < nr ? r : nr - 1)) * w_stride;
    return (__mmask16)((1u << nr) - 1);
}

KN_INLINE void kn_matmul32(const kn_fmt32 *f, const uint8_t *w, size_t w_stride, const uint8_t *x,
                           size_t x_stride, int64_t k, int m, float *y, size_t y_stride, int64_t r0,
                           int64_t r1)
{
    kn_x32 xp;
    static __thread kn_p32 panel[KN_NC * KN_KC / KN_NT] __attribute__((aligned(64)));
    const int64_t nb_all = k / 32;
    /* The k-chunk is the same for every m (k up to 8192 in one pass): partial sums of a chunk are
     * added to Y, so a chunking that depended on m would make an output's float order, and thus
     * its last bits, depend on how many rows share the call — and the engine promises that a
     * token's logits do not depend on the batch. Many activation rows take fewer columns per
     * chunk instead, so the X-side table still fits. */
    const int64_t kc = KN_NC * KN_KC / KN_NT;
    const int64_t kc_used = nb_all < kc ? nb_all : kc;
    int ncmax = (int)((KN_NC * KN_KC) / (kc_used > 0 ? kc_used : 1)) & ~(KN_NT - 1);
    if (ncmax > KN_NC) ncmax = KN_NC;
    if (ncmax < KN_NT) ncmax = KN_NT;
    for (int64_t b0 = 0; b0 < nb_all; b0 += kc) {
        const int nb = nb_all - b0 < kc ? (int)(nb_all - b0) : (int)kc;
        const int first = b0 == 0;
        for (int c0 = 0; c0 < m; c0 += ncmax) {
            const int nc = m - c0 < ncmax ? m - c0 : ncmax;
            const uint8_t *xc = x + (size_t)c0 * x_stride;
            kn_xprep32(f, xc, x_stride, nc, b0, nb, &xp);
            const uint8_t *xb = xc + (size_t)b0 * (size_t)f->xbytes;
            for (int64_t p0 = r0; p0 < r1; p0 += KN_PR) {
                const uint8_t *rp[KN_PR];
                const __mmask16 mask = kn_panel_rows(w, w_stride, p0, r1, rp);
                const int nr = __builtin_popcount(mask);
                float *yp = y + (size_t)c0 * y_stride + (size_t)p0;
                kn_pf pf;
                kn_pf_init(&pf, rp[0] + KN_PR * w_stride + (size_t)b0 * (size_t)f->wbytes, w_stride,
                           (size_t)nb * (size_t)f->wbytes,
                           (int)(r1 - p0 - KN_PR < KN_PR ? r1 - p0 - KN_PR : KN_PR), nb);
                if (nc <= KN_NT) {
#define KN_CALL(N)                                                                                 \
    kn_fused32(f, rp, w_stride, nr, b0, nb, xb, x_stride, &xp, N, yp, y_stride, mask, first, &pf)
                    KN_SWITCH_N(nc, KN_CALL)
#undef KN_CALL
                    continue;
                }
                kn_pack32(f, rp, w_stride, nr, b0, nb, panel, &pf);
                int t = 0;
                while (t < nc) {
                    const int n = nc - t >= 8 ? 8 : nc - t >= 4 ? 4 : nc - t >= 2 ? 2 : 1;
                    const uint8_t *xt = xb + (size_t)t * x_stride;
                    float *yt = yp + (size_t)t * y_stride;
#define KN_CALL(N) kn_tile32(f, panel, nb, xt, x_stride, &xp, t, N, yt, y_stride, mask, first)
                    KN_SWITCH_P2(n, KN_CALL)
                    t += n;
#undef KN_CALL
                }
            }
        }
    }
}

static void kn_matmul_q4_0(const void *w, size_t ws, const void *x, size_t xs, int64_t k, int m,
                           float *y, size_t ys, int64_t r0, int64_t r1)
{
    kn_matmul32(&kn_fmt_q4_0, w, ws, x, xs, k, m, y, ys, r0, r1);
}

static void kn_matmul_q4_1(const void *w, size_t ws, const void *x, size_t xs, int64_t k, int m,
                           float *y, size_t ys, int64_t r0, int64_t r1)
{
    kn_matmul32(&kn_fmt_q4_1, w, ws, x, xs, k, m, y, ys, r0, r1);
}

static void kn_matmul_q8_0(const void *w, size_t ws, const void *x, size_t xs, int64_t k, int m,
                           float *y, size_t ys, int64_t r0, int64_t r1)
{
    kn_matmul32(&kn_fmt_q8_0, w, ws, x, xs, k, m, y, ys, r0, r1);
}

/* ------------------------------------------------------------------ Q4_K, Q6_K */

typedef struct kn_p4K {
    __m512i q[8][8]; /* sub-block j (32 elements): q[j][jj] lane r = 4 quants of row r */
    __m512 dsc[8];   /* d * sc_j per row */
    __m512i mn[4];   /* (m_2t | m_2t+1 << 16) per row, for vpmaddwd against bsum pairs */
    __m512 dmin;
} kn_p4K;

typedef struct kn_p6K {
    __m512i q[16][4]; /* sub-block j (16 elements), u8 0..63 */
    __m512 dsc[16];   /* d * sc_j per row */
} kn_p6K;

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
#pragma GCC unroll 16
                for (int j = 0; j < 16; j++) xp->c[i][b][j] = -32 * bs[j];
            } else {
                for (int t = 0; t < 4; t++) {
                    const int lo = bs[4 * t] + bs[4 * t + 1], hi = bs[4 * t + 2] + bs[4 * t + 3];
                    xp->c[i][b][t] = (int32_t)(((uint32_t)lo & 0xFFFF) | ((uint32_t)hi << 16));
                }
            }
        }
}

KN_INLINE __m512i kn_byte_lane(__m512i z, int u) /* byte u of each dword, zero-extended */
{
    return _mm512_and_si512(_mm512_srli_epi32(z, 8 * u), _mm512_set1_epi32(0xFF));
}

/* Two fp16 per row from the dword at row0 + off: low half to *a, high half to *b. */
KN_INLINE void kn_gather_2f16(const uint8_t *row0, __m512i roff, size_t off, __m512 *a, __m512 *b)
{
    const __m512i v = _mm512_i32gather_epi32(roff, row0 + off, 1);
    *a = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v));
    *b = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
}

static void kn_pack_q4K(const uint8_t *const rp[KN_PR], __m512i roff, int64_t blk, kn_p4K *P)
{
    const size_t off = (size_t)blk * sizeof(kn_block_q4_K);
    const __m512i lo = _mm512_set1_epi8(0x0F);
    for (int t = 0; t < 4; t++) { /* 32 bytes of qs: sub-blocks 2t (low) and 2t+1 (high) */
        __m512i Z[4];
        for (int h = 0; h < 2; h++) {
            kn_tr16x4(rp, off + 16 + 32 * (size_t)t + 16 * (size_t)h, Z);
#pragma GCC unroll 16
            for (int j = 0; j < 4; j++) {
                P->q[2 * t][4 * h + j] = _mm512_and_si512(Z[j], lo);
                P->q[2 * t + 1][4 * h + j] = _mm512_and_si512(_mm512_srli_epi32(Z[j], 4), lo);
            }
        }
    }
    /* The 12 scale bytes of the 16 rows as dwords u0..u2 per lane, then ggml's utmp unpacking
     * lane-wise: scales are the bytes of (u0 & k1, u1'), mins the bytes of (u1 & k1, u3'). */
    __m512i U[4];
    kn_tr16x4(rp, off + 4, U);
    const __m512i k1 = _mm512_set1_epi32(0x3f3f3f3f), k2 = _mm512_set1_epi32(0x0f0f0f0f),
                  k3 = _mm512_set1_epi32(0x03030303);
    const __m512i sc0 = _mm512_and_si512(U[0], k1);
    const __m512i sc1 =
        _mm512_or_si512(_mm512_and_si512(U[2], k2),
                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(U[0], 6), k3), 4));
    const __m512i mn0 = _mm512_and_si512(U[1], k1);
    const __m512i mn1 =
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(U[2], 4), k2),
                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(U[1], 6), k3), 4));
    __m512 d;
    kn_gather_2f16(rp[0], roff, off, &d, &P->dmin);
#pragma GCC unroll 16
    for (int j = 0; j < 8; j++)
        P->dsc[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(kn_byte_lane(j < 4 ? sc0 : sc1, j % 4)));
#pragma GCC unroll 16
    for (int t = 0; t < 4; t++) {
        const __m512i z = t < 2 ? mn0 : mn1;
        const int u = 2 * (t % 2);
        P->mn[t] =
            _mm512_or_si512(kn_byte_lane(z, u), _mm512_slli_epi32(kn_byte_lane(z, u + 1), 16));
    }
}

/* Q6_K assembled in the transposed domain: a dword lane of ql (bytes l..l+3 of a 32-byte half)
 * and the same dword of qh hold every bit of elements l.., 32+l.., 64+l.., 96+l.. of the row. */
static void kn_pack_q6K(const uint8_t *const rp[KN_PR], __m512i roff, int64_t blk, kn_p6K *P)
{
    const size_t off = (size_t)blk * sizeof(kn_block_q6_K);
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {     /* 128 elements each */
        for (int c = 0; c < 2; c++) { /* dwords 0..3, then 4..7, of each 32 bytes */
            __m512i L0[4], L1[4], H[4];
            kn_tr16x4(rp, off + 64 * (size_t)h + 16 * (size_t)c, L0);      /* ql[l] */
            kn_tr16x4(rp, off + 64 * (size_t)h + 32 + 16 * (size_t)c, L1); /* ql[32+l] */
            kn_tr16x4(rp, off + 128 + 32 * (size_t)h + 16 * (size_t)c, H); /* qh[l] */
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                const int jj = 4 * c + j;      /* dword of the 32 elements l = 4jj.. */
                const int sb = 8 * h + jj / 4; /* their 16-element sub-block */
                const int q = jj % 4;
                P->q[sb + 0][q] = _mm512_or_si512(_mm512_and_si512(L0[j], m4),
                                                  _mm512_and_si512(_mm512_slli_epi32(H[j], 4), m2));
                P->q[sb + 2][q] = _mm512_or_si512(_mm512_and_si512(L1[j], m4),
                                                  _mm512_and_si512(_mm512_slli_epi32(H[j], 2), m2));
                P->q[sb + 4][q] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(L0[j], 4), m4),
                                                  _mm512_and_si512(H[j], m2));
                P->q[sb + 6][q] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(L1[j], 4), m4),
                                                  _mm512_and_si512(_mm512_srli_epi32(H[j], 2), m2));
            }
        }
    }
    __m512i Z[4];
    kn_tr16x4(rp, off + offsetof(kn_block_q6_K, scales), Z);
    __m512 unused, d; /* the dword ending with d starts at scales[14]: inside the block */
    kn_gather_2f16(rp[0], roff, off + offsetof(kn_block_q6_K, d) - 2, &unused, &d);
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) {
        const __m512i sc = _mm512_srai_epi32(_mm512_slli_epi32(Z[j / 4], 24 - 8 * (j % 4)), 24);
        P->dsc[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
    }
}

KN_INLINE void kn_tile4K(const kn_p4K *P, int nb, const uint8_t *xb, size_t x_stride,
                         const kn_xK *xp, int xi, int N, float *yp, size_t y_stride, __mmask16 mask,
                         int first)
{
    __m512 acc[KN_NT];
#pragma GCC unroll 16
    for (int i = 0; i < N; i++) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *xq = xb + (size_t)b * sizeof(kn_block_q8_K) + offsetof(kn_block_q8_K, qs);
        __m512 g[KN_NT];
#pragma GCC unroll 16
        for (int i = 0; i < N; i++) g[i] = _mm512_setzero_ps();
        for (int j = 0; j < 8; j++) {
            __m512i s[KN_NT];
#pragma GCC unroll 16
            for (int i = 0; i < N; i++) s[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int jj = 0; jj < 8; jj++) {
                const __m512i w = P[b].q[j][jj];
#pragma GCC unroll 8
                for (int i = 0; i < N; i++)
                    s[i] = _mm512_dpbusd_epi32(
                        s[i], w, kn_bcast32(xq + (size_t)i * x_stride + 32 * j + 4 * jj));
            }
#pragma GCC unroll 8
            for (int i = 0; i < N; i++)
                g[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), P[b].dsc[j], g[i]);
        }
#pragma GCC unroll 8
        for (int i = 0; i < N; i++) {
            __m512i ms = _mm512_madd_epi16(P[b].mn[0], _mm512_set1_epi32(xp->c[xi + i][b][0]));
#pragma GCC unroll 16
            for (int t = 1; t < 4; t++)
                ms = _mm512_add_epi32(
                    ms, _mm512_madd_epi16(P[b].mn[t], _mm512_set1_epi32(xp->c[xi + i][b][t])));
            g[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ms), P[b].dmin, g[i]);
            acc[i] = _mm512_fmadd_ps(g[i], _mm512_set1_ps(xp->d[xi + i][b]), acc[i]);
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < N; i++) kn_store_rows(yp + (size_t)i * y_stride, mask, acc[i], first);
}

KN_INLINE void kn_tile6K(const kn_p6K *P, int nb, const uint8_t *xb, size_t x_stride,
                         const kn_xK *xp, int xi, int N, float *yp, size_t y_stride, __mmask16 mask,
                         int first)
{
    __m512 acc[KN_NT];
#pragma GCC unroll 16
    for (int i = 0; i < N; i++) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *xq = xb + (size_t)b * sizeof(kn_block_q8_K) + offsetof(kn_block_q8_K, qs);
        __m512 g[KN_NT];
#pragma GCC unroll 16
        for (int i = 0; i < N; i++) g[i] = _mm512_setzero_ps();
        for (int j = 0; j < 16; j++) {
            __m512i s[KN_NT];
#pragma GCC unroll 16
            for (int i = 0; i < N; i++) s[i] = _mm512_set1_epi32(xp->c[xi + i][b][j]);
#pragma GCC unroll 4
            for (int jj = 0; jj < 4; jj++) {
                const __m512i w = P[b].q[j][jj];
#pragma GCC unroll 8
                for (int i = 0; i < N; i++)
                    s[i] = _mm512_dpbusd_epi32(
                        s[i], w, kn_bcast32(xq + (size_t)i * x_stride + 16 * j + 4 * jj));
            }
#pragma GCC unroll 8
            for (int i = 0; i < N; i++)
                g[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), P[b].dsc[j], g[i]);
        }
#pragma GCC unroll 8
        for (int i = 0; i < N; i++)
            acc[i] = _mm512_fmadd_ps(g[i], _mm512_set1_ps(xp->d[xi + i][b]), acc[i]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < N; i++) kn_store_rows(yp + (size_t)i * y_stride, mask, acc[i], first);
}

static void kn_matmulK(int is_q6, const uint8_t *w, size_t w_stride, const uint8_t *x,
                       size_t x_stride, int64_t k, int m, float *y, size_t y_stride, int64_t r0,
                       int64_t r1)
{
    kn_xK xp;
    union {
        kn_p4K q4[KN_KCK];
        kn_p6K q6[KN_KCK];
    } panel __attribute__((aligned(64)));
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
                const uint8_t *rp[KN_PR];
                const __mmask16 mask = kn_panel_rows(w, w_stride, p0, r1, rp);
                float *yp = y + (size_t)c0 * y_stride + (size_t)p0;
                /* no software prefetch here: ~50 lines a super-block come in bursts that
                 * measured slower than the hardware prefetchers alone */
                const __m512i roff = kn_row_offsets(w_stride, __builtin_popcount(mask));
                for (int b = 0; b < nb; b++) {
                    if (is_q6)
                        kn_pack_q6K(rp, roff, b0 + b, &panel.q6[b]);
                    else
                        kn_pack_q4K(rp, roff, b0 + b, &panel.q4[b]);
                }
                for (int t = 0; t < nc;) {
                    const int n = nc - t >= 8 ? 8 : nc - t >= 4 ? 4 : nc - t >= 2 ? 2 : 1;
                    const uint8_t *xt = xb + (size_t)t * x_stride;
                    float *yt = yp + (size_t)t * y_stride;
                    if (is_q6) {
#define KN_CALL(N) kn_tile6K(panel.q6, nb, xt, x_stride, &xp, t, N, yt, y_stride, mask, first)
                        KN_SWITCH_P2(n, KN_CALL)
#undef KN_CALL
                    } else {
#define KN_CALL(N) kn_tile4K(panel.q4, nb, xt, x_stride, &xp, t, N, yt, y_stride, mask, first)
                        KN_SWITCH_P2(n, KN_CALL)
#undef KN_CALL
                    }
                    t += n;
                }
            }
        }
    }
}

/* ------------------------------------------------------------------ F32, F16, BF16 */

enum { KN_F32, KN_F16, KN_BF16 };

/* 16 elements of a float-type row as f32 (masked for the tail). */
KN_INLINE __m512 kn_loadf(int ft, const void *p, int64_t j, __mmask16 mask)
{
    switch (ft) {
    case KN_F16:
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, (const kn_f16 *)p + j));
    case KN_BF16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, (const kn_bf16 *)p + j)), 16));
    default:
        return _mm512_maskz_loadu_ps(mask, (const float *)p + j);
    }
}

/* Y for R weight rows x N activation rows: vector partial sums over k, reduced at the end. */
KN_INLINE void kn_tilef(int ft, const uint8_t *w, size_t w_stride, const uint8_t *x,
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
__attribute__((target("avx512bf16"))) KN_INLINE void
kn_tile_bf16dp(const uint8_t *w, size_t w_stride, const uint8_t *x, size_t x_stride, int64_t k,
               int R, int N, float *y, size_t y_stride)
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

/* 4 x 4 tiles; the row and column remainders run as 1-wide tiles. */
static void kn_matmulf(int ft, const uint8_t *w, size_t w_stride, const uint8_t *x, size_t x_stride,
                       int64_t k, int m, float *y, size_t y_stride, int64_t r0, int64_t r1)
{
    const int dp = ft == KN_BF16 && kn_has_bf16dp();
    for (int64_t r = r0; r < r1;) {
        const int R = r1 - r >= 4 ? 4 : 1;
        for (int i = 0; i < m;) {
            const int N = m - i >= 4 ? 4 : 1;
            const uint8_t *wr = w + (size_t)r * w_stride, *xi = x + (size_t)i * x_stride;
            float *yo = y + (size_t)i * y_stride + (size_t)r;
            if (dp) {
                if (R == 4 && N == 4)
                    kn_tile_bf16dp(wr, w_stride, xi, x_stride, k, 4, 4, yo, y_stride);
                else if (R == 4)
                    kn_tile_bf16dp(wr, w_stride, xi, x_stride, k, 4, 1, yo, y_stride);
                else if (N == 4)
                    kn_tile_bf16dp(wr, w_stride, xi, x_stride, k, 1, 4, yo, y_stride);
                else
                    kn_tile_bf16dp(wr, w_stride, xi, x_stride, k, 1, 1, yo, y_stride);
            } else {
                if (R == 4 && N == 4)
                    kn_tilef(ft, wr, w_stride, xi, x_stride, k, 4, 4, yo, y_stride);
                else if (R == 4)
                    kn_tilef(ft, wr, w_stride, xi, x_stride, k, 4, 1, yo, y_stride);
                else if (N == 4)
                    kn_tilef(ft, wr, w_stride, xi, x_stride, k, 1, 4, yo, y_stride);
                else
                    kn_tilef(ft, wr, w_stride, xi, x_stride, k, 1, 1, yo, y_stride);
            }
            i += N;
        }
        r += R;
    }
}

void kn_matmul_avx512(km_type wt, const void *w, size_t w_stride, const void *x, size_t x_stride,
                      int64_t k, int m, float *y, size_t y_stride, int64_t r0, int64_t r1)
{
    if (r0 >= r1 || m <= 0) return;
    assert(k % (wt == KM_TYPE_Q4_K || wt == KM_TYPE_Q6_K ? KN_QK_K : 32) == 0 ||
           wt == KM_TYPE_F32 || wt == KM_TYPE_F16 || wt == KM_TYPE_BF16);
    if (k <= 0) { /* an empty dot: zeros, as the reference writes */
        for (int i = 0; i < m; i++)
            for (int64_t r = r0; r < r1; r++) y[(size_t)i * y_stride + (size_t)r] = 0.0f;
        return;
    }
    switch (wt) {
    case KM_TYPE_Q4_0:
        kn_matmul_q4_0(w, w_stride, x, x_stride, k, m, y, y_stride, r0, r1);
        break;
    case KM_TYPE_Q4_1:
        kn_matmul_q4_1(w, w_stride, x, x_stride, k, m, y, y_stride, r0, r1);
        break;
    case KM_TYPE_Q8_0:
        kn_matmul_q8_0(w, w_stride, x, x_stride, k, m, y, y_stride, r0, r1);
        break;
    case KM_TYPE_Q4_K:
        kn_matmulK(0, w, w_stride, x, x_stride, k, m, y, y_stride, r0, r1);
        break;
    case KM_TYPE_Q6_K:
        kn_matmulK(1, w, w_stride, x, x_stride, k, m, y, y_stride, r0, r1);
        break;
    case KM_TYPE_F32:
        kn_matmulf(KN_F32, w, w_stride, x, x_stride, k, m, y, y_stride, r0, r1);
        break;
    case KM_TYPE_F16:
        kn_matmulf(KN_F16, w, w_stride, x, x_stride, k, m, y, y_stride, r0, r1);
        break;
    case KM_TYPE_BF16:
        kn_matmulf(KN_BF16, w, w_stride, x, x_stride, k, m, y, y_stride, r0, r1);
        break;
    default:
        assert(!"kn_matmul: unsupported weight type");
    }
}

/* ------------------------------------------------------------------ activation quantization */

/* Q8_0 / Q8_1 one block: ggml's x86 quantize_row_q8_0/q8_1 (see quant_ref.c). */
KN_INLINE int kn_q8_block(const float *x, int8_t *qs, kn_f16 *dout, float *dval)
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

void kn_quantize_row_avx512(km_type t, const float *x, void *vy, int64_t n)
{
    switch (t) {
    case KM_TYPE_Q8_0: {
        assert(n % KN_QK8_0 == 0);
        uint8_t *y = vy;
        for (int64_t i = 0; i < n / KN_QK8_0; i++, x += KN_QK8_0, y += sizeof(kn_block_q8_0)) {
            kn_f16 d;
            float dv;
            kn_q8_block(x, (int8_t *)(y + 2), &d, &dv);
            memcpy(y, &d, 2);
        }
        break;
    }
    case KM_TYPE_Q8_1: {
        assert(n % KN_QK8_1 == 0);
        uint8_t *y = vy;
        for (int64_t i = 0; i < n / KN_QK8_1; i++, x += KN_QK8_1, y += sizeof(kn_block_q8_1)) {
            kn_f16 d;
            float dv;
            const int sum = kn_q8_block(x, (int8_t *)(y + 4), &d, &dv);
            const kn_f16 s = _cvtss_sh(dv * (float)sum, 0);
            memcpy(y, &d, 2);
            memcpy(y + 2, &s, 2);
        }
        break;
    }
    case KM_TYPE_Q8_K: {
        assert(n % KN_QK_K == 0);
        uint8_t *y = vy;
        for (int64_t i = 0; i < n / KN_QK_K; i++, x += KN_QK_K, y += sizeof(kn_block_q8_K)) {
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
                continue;
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
            /* ggml's nearest_int through the float adder, then MIN(127, v) and an int8 store;
             * the _round forms keep the compiler from fusing the multiply and the add. */
            const __m512 vs = _mm512_set1_ps(iscale), magic = _mm512_set1_ps(12582912.f);
            const __m512i mant = _mm512_set1_epi32(0x007fffff),
                          bias = _mm512_set1_epi32(0x00400000);
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
        break;
    }
    case KM_TYPE_F16: {
        kn_f16 *y = vy;
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 mask = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
            const __m512 v = _mm512_maskz_loadu_ps(mask, x + j);
            _mm256_mask_storeu_epi16(
                y + j, mask, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        break;
    }
    case KM_TYPE_BF16: {
        kn_bf16 *y = vy;
        const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 mask = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
            const __m512i u = _mm512_castps_si512(_mm512_maskz_loadu_ps(mask, x + j));
            const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, abs), inf);
            const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            __m512i r = _mm512_srli_epi32(
                _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
            r = _mm512_mask_mov_epi32(
                r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(64)));
            _mm256_mask_storeu_epi16(y + j, mask, _mm512_cvtepi32_epi16(r));
        }
        break;
    }
    case KM_TYPE_F32:
        memmove(vy, x, (size_t)n * sizeof(float));
        break;
    default:
        assert(!"kn_quantize_row: unsupported type");
    }
}

/* Dequantization runs once per token for the embedding row: the reference is fast enough. */
void kn_dequantize_row_avx512(km_type t, const void *x, float *y, int64_t n)
{
    kn_dequantize_row_ref(t, x, y, n);
}
