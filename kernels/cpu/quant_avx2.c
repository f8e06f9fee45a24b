/*
 * quant_avx2.c — AVX2 + FMA + F16C quantization and matrix multiply, held to quant_ref.c by
 * tests/unit/test_kernels_quant.c.
 *
 * The tiling is quant_avx512.c's at half the width: weights are re-laid out into panels of 8
 * rows in which one ymm holds 4 consecutive quant bytes of each row (lane r = row r), an
 * activation 4-byte group is broadcast, and a micro-tile keeps 8 weight rows x up to 4
 * activation rows of float accumulators in registers. Without VNNI the products go through
 * vpmaddubsw (u8 x s8 -> pairs of int16):
 *   Q4_0/Q4_1/Q4_K  nibbles are 0..15, so the 8 pair-sums of a 32-element block stay below
 *                   2^15 and are added in int16, widened once per block with vpmaddwd
 *   Q6_K            quants 0..63: two pair-sums are added in int16, then widened
 *   Q8_0            s8 x s8 through ggml's sign trick: |w| (u8) x sign(x, w), widened per step
 * Integer block sums are exact; offsets (-8, -32) are integer corrections from the activation
 * sums, as in quant_avx512.c. The panel for a k-chunk is built once into a stack buffer (about
 * 40 KB of stack in all) and swept by every column tile; scales come by vpgatherdd, and the next
 * panel of a 32-element-block type is prefetched while this one is built.
 *
 * Float weights use direct 4 x 2 register tiles reduced at the end. Activation quantization is
 * bit-identical to the reference (its Q8_0/Q8_1 are ggml's AVX2 code's results). Dequantization
 * runs once per token (embedding row), so it forwards to the reference.
 */
#include <assert.h>
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kernels/cpu/internal.h"

#define KN_INLINE static inline __attribute__((always_inline))

#define KN2_PR  8  /* weight rows per panel */
#define KN2_NT  4  /* activation rows per micro-tile */
#define KN2_NC  64 /* activation rows per column chunk */
#define KN2_KC  32 /* 32-element blocks per k-chunk */
#define KN2_KCK 4  /* super-blocks per k-chunk */

KN_INLINE uint32_t kn2_ld32(const void *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

KN_INLINE uint16_t kn2_ld16(const void *p)
{
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

KN_INLINE __m256i kn2_bcast32(const void *p)
{
    return _mm256_set1_epi32((int)kn2_ld32(p));
}

/* Z[j] lane r = bytes [4j, 4j+4) of the 16 bytes at rp[r] + off, r = 0..7 (A[g] holds rows g and
 * g+4 in its two lanes, so the in-lane transposes leave the rows in natural order). */
KN_INLINE void kn2_tr8x4(const uint8_t *const rp[KN2_PR], size_t off, __m256i Z[4])
{
    __m256i A[4];
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++)
        A[g] = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(rp[g] + off))),
            _mm_loadu_si128((const __m128i *)(rp[g + 4] + off)), 1);
    const __m256i t0 = _mm256_unpacklo_epi32(A[0], A[1]), t1 = _mm256_unpackhi_epi32(A[0], A[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(A[2], A[3]), t3 = _mm256_unpackhi_epi32(A[2], A[3]);
    Z[0] = _mm256_unpacklo_epi64(t0, t2);
    Z[1] = _mm256_unpackhi_epi64(t0, t2);
    Z[2] = _mm256_unpacklo_epi64(t1, t3);
    Z[3] = _mm256_unpackhi_epi64(t1, t3);
}

static const int32_t kn2_mask_tab[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

/* Writes (first k-chunk) or adds (later ones) the first nr lanes of an 8-row accumulator. */
KN_INLINE void kn2_store_rows(float *yp, int nr, __m256 acc, int first)
{
    if (nr == KN2_PR) {
        if (!first) acc = _mm256_add_ps(acc, _mm256_loadu_ps(yp));
        _mm256_storeu_ps(yp, acc);
        return;
    }
    const __m256i mask = _mm256_loadu_si256((const __m256i *)(kn2_mask_tab + 8 - nr));
    if (!first) acc = _mm256_add_ps(acc, _mm256_maskload_ps(yp, mask));
    _mm256_maskstore_ps(yp, mask, acc);
}

KN_INLINE int kn2_panel_rows(const uint8_t *w, size_t w_stride, int64_t p0, int64_t r1,
                             const uint8_t *rp[KN2_PR])
{
    const int nr = r1 - p0 < KN2_PR ? (int)(r1 - p0) : KN2_PR;
    for (int r = 0; r < KN2_PR; r++) rp[r] = w + (size_t)(p0 + (r < nr ? r : nr - 1)) * w_stride;
    return nr;
}

/* Byte offsets of the panel's rows from its first (missing rows repeat the last), for
 * vpgatherdd. */
KN_INLINE __m256i kn2_row_offsets(size_t w_stride, int nr)
{
    assert(w_stride <= (size_t)INT32_MAX / KN2_PR);
    return _mm256_mullo_epi32(
        _mm256_min_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(nr - 1)),
        _mm256_set1_epi32((int)w_stride));
}

KN_INLINE int kn2_tile_width(int left)
{
    return left >= 4 ? 4 : left >= 2 ? 2 : 1;
}

#define KN2_SWITCH(N, CALL)                                                                        \
    switch (N) {                                                                                   \
    case 1:                                                                                        \
        CALL(1);                                                                                   \
        break;                                                                                     \
    case 2:                                                                                        \
        CALL(2);                                                                                   \
        break;                                                                                     \
    default:                                                                                       \
        CALL(4);                                                                                   \
        break;                                                                                     \
    }

/* ------------------------------------------------------------------ Q4_0, Q4_1, Q8_0 */

typedef struct kn2_p32 {
    __m256i q[8];  /* u8 quants (Q8_0: |w|), q[j] lane r = row r, k = 4j..4j+3 */
    __m256i sg[8]; /* Q8_0: the signed weights, for the sign trick */
    __m256 d, m;
} kn2_p32;

typedef struct kn2_x32 {
    float d[KN2_NC][KN2_KC], s[KN2_NC][KN2_KC];
    int32_t c[KN2_NC][KN2_KC];
} kn2_x32;

typedef struct kn2_fmt32 {
    int wbytes, wq, xbytes, xq;
    int q8;      /* s8 weights (Q8_0) */
    int offset;  /* Q4_0: quants are stored + 8 */
    int has_min; /* Q4_1 */
} kn2_fmt32;

static const kn2_fmt32 kn2_fmt_q4_0 = {sizeof(kn_block_q4_0), 2, sizeof(kn_block_q8_0), 2, 0, 8, 0};
static const kn2_fmt32 kn2_fmt_q4_1 = {sizeof(kn_block_q4_1), 4, sizeof(kn_block_q8_1), 4, 0, 0, 1};
static const kn2_fmt32 kn2_fmt_q8_0 = {sizeof(kn_block_q8_0), 2, sizeof(kn_block_q8_0), 2, 1, 0, 0};

/* Software prefetch of the next panel while this one is built: exactly the k-chunk's bytes of
 * its rows, a few lines per block (see quant_avx512.c). */
typedef struct kn2_pf {
    const uint8_t *row; /* next panel row, at the k-chunk's first block */
    size_t stride, len; /* row stride; bytes of the k-chunk in a row */
    size_t off;
    int rows_left, per_block;
} kn2_pf;

KN_INLINE void kn2_pf_init(kn2_pf *pf, const uint8_t *row, size_t stride, size_t len, int rows,
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

KN_INLINE void kn2_pf_step(kn2_pf *pf)
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

static void kn2_pack32(const kn2_fmt32 *f, const uint8_t *const rp[KN2_PR], size_t w_stride, int nr,
                       int64_t b0, int nb, kn2_p32 *P, kn2_pf *pf)
{
    /* vpgatherdd fetches the 8 rows' leading block dword (the scales) */
    const __m256i roff = kn2_row_offsets(w_stride, nr);
    const __m256i lo = _mm256_set1_epi8(0x0F);
    for (int b = 0; b < nb; b++) {
        kn2_pf_step(pf);
        const size_t off = (size_t)(b0 + b) * (size_t)f->wbytes + (size_t)f->wq;
        __m256i Z[4];
        kn2_tr8x4(rp, off, Z);
        if (f->q8) {
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                P[b].sg[j] = Z[j];
                P[b].q[j] = _mm256_sign_epi8(Z[j], Z[j]);
            }
            kn2_tr8x4(rp, off + 16, Z);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                P[b].sg[j + 4] = Z[j];
                P[b].q[j + 4] = _mm256_sign_epi8(Z[j], Z[j]);
            }
        } else {
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                P[b].q[j] = _mm256_and_si256(Z[j], lo);
                P[b].q[j + 4] = _mm256_and_si256(_mm256_srli_epi32(Z[j], 4), lo);
            }
        }
        const __m256i v = _mm256_i32gather_epi32(
            (const int *)(rp[0] + (size_t)(b0 + b) * (size_t)f->wbytes), roff, 1);
        /* the low and high halves of each dword, packed to 8 x u16 */
        const __m256i lo16 = _mm256_blend_epi16(v, _mm256_setzero_si256(), 0xAA);
        const __m256i hi16 = _mm256_srli_epi32(v, 16);
        P[b].d = _mm256_cvtph_ps(
            _mm_packus_epi32(_mm256_castsi256_si128(lo16), _mm256_extracti128_si256(lo16, 1)));
        P[b].m = f->has_min ? _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(hi16),
                                                               _mm256_extracti128_si256(hi16, 1)))
                            : _mm256_setzero_ps();
    }
}

static void kn2_xprep32(const kn2_fmt32 *f, const uint8_t *x, size_t x_stride, int nc, int64_t b0,
                        int nb, kn2_x32 *xp)
{
    const __m256i sign = _mm256_set1_epi8((char)0x80);
    for (int i = 0; i < nc; i++) {
        const uint8_t *xb = x + (size_t)i * x_stride + (size_t)b0 * (size_t)f->xbytes;
        for (int b = 0; b < nb; b++, xb += f->xbytes) {
            xp->d[i][b] = _cvtsh_ss(kn2_ld16(xb));
            xp->s[i][b] = f->has_min ? _cvtsh_ss(kn2_ld16(xb + 2)) : 0.0f;
            xp->c[i][b] = 0;
            if (f->offset) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(xb + f->xq));
                const __m256i s =
                    _mm256_sad_epu8(_mm256_xor_si256(q, sign), _mm256_setzero_si256());
                const __m128i s2 =
                    _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
                const int sum = (int)(_mm_cvtsi128_si64(s2) + _mm_extract_epi64(s2, 1)) - 4096;
                xp->c[i][b] = -f->offset * sum;
            }
        }
    }
}

KN_INLINE void kn2_tile32(const kn2_fmt32 *f, const kn2_p32 *P, int nb, const uint8_t *xb,
                          size_t x_stride, const kn2_x32 *xp, int xi, int N, float *yp,
                          size_t y_stride, int nr, int first)
{
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[KN2_NT];
#pragma GCC unroll 4
    for (int i = 0; i < N; i++) acc[i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *xq = xb + (size_t)b * (size_t)f->xbytes + (size_t)f->xq;
        __m256i s[KN2_NT];
#pragma GCC unroll 4
        for (int i = 0; i < N; i++) s[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const __m256i w = _mm256_load_si256(&P[b].q[j]);
#pragma GCC unroll 4
            for (int i = 0; i < N; i++) {
                const __m256i xv = kn2_bcast32(xq + (size_t)i * x_stride + 4 * j);
                if (f->q8) {
                    const __m256i p = _mm256_maddubs_epi16(w, _mm256_sign_epi8(xv, P[b].sg[j]));
                    s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(p, ones));
                } else {
                    s[i] = _mm256_add_epi16(s[i], _mm256_maddubs_epi16(w, xv));
                }
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < N; i++) {
            __m256i si = f->q8 ? s[i] : _mm256_madd_epi16(s[i], ones);
            if (f->offset) si = _mm256_add_epi32(si, _mm256_set1_epi32(xp->c[xi + i][b]));
            const __m256 scale = _mm256_mul_ps(P[b].d, _mm256_set1_ps(xp->d[xi + i][b]));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), scale, acc[i]);
            if (f->has_min)
                acc[i] = _mm256_fmadd_ps(P[b].m, _mm256_set1_ps(xp->s[xi + i][b]), acc[i]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < N; i++) kn2_store_rows(yp + (size_t)i * y_stride, nr, acc[i], first);
}

KN_INLINE void kn2_matmul32(const kn2_fmt32 *f, const uint8_t *w, size_t w_stride, const uint8_t *x,
                            size_t x_stride, int64_t k, int m, float *y, size_t y_stride,
                            int64_t r0, int64_t r1)
{
    kn2_x32 xp;
    kn2_p32 panel[KN2_KC] __attribute__((aligned(32)));
    const int64_t nb_all = k / 32;
    for (int64_t b0 = 0; b0 < nb_all; b0 += KN2_KC) {
        const int nb = nb_all - b0 < KN2_KC ? (int)(nb_all - b0) : KN2_KC;
        const int first = b0 == 0;
        for (int c0 = 0; c0 < m; c0 += KN2_NC) {
            const int nc = m - c0 < KN2_NC ? m - c0 : KN2_NC;
            const uint8_t *xc = x + (size_t)c0 * x_stride;
            kn2_xprep32(f, xc, x_stride, nc, b0, nb, &xp);
            const uint8_t *xb = xc + (size_t)b0 * (size_t)f->xbytes;
            for (int64_t p0 = r0; p0 < r1; p0 += KN2_PR) {
                const uint8_t *rp[KN2_PR];
                const int nr = kn2_panel_rows(w, w_stride, p0, r1, rp);
                float *yp = y + (size_t)c0 * y_stride + (size_t)p0;
                kn2_pf pf;
                kn2_pf_init(&pf, rp[0] + KN2_PR * w_stride + (size_t)b0 * (size_t)f->wbytes,
                            w_stride, (size_t)nb * (size_t)f->wbytes,
                            (int)(r1 - p0 - KN2_PR < KN2_PR ? r1 - p0 - KN2_PR : KN2_PR), nb);
                kn2_pack32(f, rp, w_stride, nr, b0, nb, panel, &pf);
                for (int t = 0; t < nc;) {
                    const int n = kn2_tile_width(nc - t);
                    const uint8_t *xt = xb + (size_t)t * x_stride;
                    float *yt = yp + (size_t)t * y_stride;
#define KN2_CALL(N) kn2_tile32(f, panel, nb, xt, x_stride, &xp, t, N, yt, y_stride, nr, first)
                    KN2_SWITCH(n, KN2_CALL)
#undef KN2_CALL
                    t += n;
                }
            }
        }
    }
}

static void kn2_matmul_q4_0(const void *w, size_t ws, const void *x, size_t xs, int64_t k, int m,
                            float *y, size_t ys, int64_t r0, int64_t r1)
{
    kn2_matmul32(&kn2_fmt_q4_0, w, ws, x, xs, k, m, y, ys, r0, r1);
}

static void kn2_matmul_q4_1(const void *w, size_t ws, const void *x, size_t xs, int64_t k, int m,
                            float *y, size_t ys, int64_t r0, int64_t r1)
{
    kn2_matmul32(&kn2_fmt_q4_1, w, ws, x, xs, k, m, y, ys, r0, r1);
}

static void kn2_matmul_q8_0(const void *w, size_t ws, const void *x, size_t xs, int64_t k, int m,
                            float *y, size_t ys, int64_t r0, int64_t r1)
{
    kn2_matmul32(&kn2_fmt_q8_0, w, ws, x, xs, k, m, y, ys, r0, r1);
}

/* ------------------------------------------------------------------ Q4_K, Q6_K */

typedef struct kn2_p4K {
    __m256i q[8][8];
    __m256 dsc[8];
    __m256i mn[4];
    __m256 dmin;
} kn2_p4K;

typedef struct kn2_p6K {
    __m256i q[16][4];
    __m256 dsc[16];
} kn2_p6K;

typedef struct kn2_xK {
    float d[KN2_NC][KN2_KCK];
    int32_t c[KN2_NC][KN2_KCK][16];
} kn2_xK;

static void kn2_xprepK(int is_q6, const uint8_t *x, size_t x_stride, int nc, int64_t b0, int nb,
                       kn2_xK *xp)
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

KN_INLINE __m256i kn2_byte_lane(__m256i z, int u)
{
    return _mm256_and_si256(_mm256_srli_epi32(z, 8 * u), _mm256_set1_epi32(0xFF));
}

/* Two fp16 per row from the dword at row0 + off: low half to *a, high half to *b. */
KN_INLINE void kn2_gather_2f16(const uint8_t *row0, __m256i roff, size_t off, __m256 *a, __m256 *b)
{
    const __m256i v = _mm256_i32gather_epi32((const int *)(row0 + off), roff, 1);
    const __m256i lo16 = _mm256_blend_epi16(v, _mm256_setzero_si256(), 0xAA);
    const __m256i hi16 = _mm256_srli_epi32(v, 16);
    *a = _mm256_cvtph_ps(
        _mm_packus_epi32(_mm256_castsi256_si128(lo16), _mm256_extracti128_si256(lo16, 1)));
    *b = _mm256_cvtph_ps(
        _mm_packus_epi32(_mm256_castsi256_si128(hi16), _mm256_extracti128_si256(hi16, 1)));
}

/* As kn_pack_q4K in quant_avx512.c: ggml's utmp scale unpacking done lane-wise on transposed
 * dwords. */
static void kn2_pack_q4K(const uint8_t *const rp[KN2_PR], __m256i roff, int64_t blk, kn2_p4K *P)
{
    const size_t off = (size_t)blk * sizeof(kn_block_q4_K);
    const __m256i lo = _mm256_set1_epi8(0x0F);
    for (int t = 0; t < 4; t++)
        for (int h = 0; h < 2; h++) {
            __m256i Z[4];
            kn2_tr8x4(rp, off + 16 + 32 * (size_t)t + 16 * (size_t)h, Z);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                P->q[2 * t][4 * h + j] = _mm256_and_si256(Z[j], lo);
                P->q[2 * t + 1][4 * h + j] = _mm256_and_si256(_mm256_srli_epi32(Z[j], 4), lo);
            }
        }
    __m256i U[4];
    kn2_tr8x4(rp, off + 4, U);
    const __m256i k1 = _mm256_set1_epi32(0x3f3f3f3f), k2 = _mm256_set1_epi32(0x0f0f0f0f),
                  k3 = _mm256_set1_epi32(0x03030303);
    const __m256i sc0 = _mm256_and_si256(U[0], k1);
    const __m256i sc1 =
        _mm256_or_si256(_mm256_and_si256(U[2], k2),
                        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(U[0], 6), k3), 4));
    const __m256i mn0 = _mm256_and_si256(U[1], k1);
    const __m256i mn1 =
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(U[2], 4), k2),
                        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(U[1], 6), k3), 4));
    __m256 d;
    kn2_gather_2f16(rp[0], roff, off, &d, &P->dmin);
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++)
        P->dsc[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(kn2_byte_lane(j < 4 ? sc0 : sc1, j % 4)));
#pragma GCC unroll 4
    for (int t = 0; t < 4; t++) {
        const __m256i z = t < 2 ? mn0 : mn1;
        const int u = 2 * (t % 2);
        P->mn[t] =
            _mm256_or_si256(kn2_byte_lane(z, u), _mm256_slli_epi32(kn2_byte_lane(z, u + 1), 16));
    }
}

/* As kn_pack_q6K in quant_avx512.c: 6-bit quants assembled in the transposed domain. */
static void kn2_pack_q6K(const uint8_t *const rp[KN2_PR], __m256i roff, int64_t blk, kn2_p6K *P)
{
    const size_t off = (size_t)blk * sizeof(kn_block_q6_K);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++)
        for (int c = 0; c < 2; c++) {
            __m256i L0[4], L1[4], H[4];
            kn2_tr8x4(rp, off + 64 * (size_t)h + 16 * (size_t)c, L0);
            kn2_tr8x4(rp, off + 64 * (size_t)h + 32 + 16 * (size_t)c, L1);
            kn2_tr8x4(rp, off + 128 + 32 * (size_t)h + 16 * (size_t)c, H);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                const int jj = 4 * c + j, sb = 8 * h + jj / 4, q = jj % 4;
                P->q[sb + 0][q] = _mm256_or_si256(_mm256_and_si256(L0[j], m4),
                                                  _mm256_and_si256(_mm256_slli_epi32(H[j], 4), m2));
                P->q[sb + 2][q] = _mm256_or_si256(_mm256_and_si256(L1[j], m4),
                                                  _mm256_and_si256(_mm256_slli_epi32(H[j], 2), m2));
                P->q[sb + 4][q] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(L0[j], 4), m4),
                                                  _mm256_and_si256(H[j], m2));
                P->q[sb + 6][q] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(L1[j], 4), m4),
                                                  _mm256_and_si256(_mm256_srli_epi32(H[j], 2), m2));
            }
        }
    __m256i Z[4];
    kn2_tr8x4(rp, off + offsetof(kn_block_q6_K, scales), Z);
    __m256 unused, d; /* the dword ending with d starts at scales[14]: inside the block */
    kn2_gather_2f16(rp[0], roff, off + offsetof(kn_block_q6_K, d) - 2, &unused, &d);
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) {
        const __m256i sc = _mm256_srai_epi32(_mm256_slli_epi32(Z[j / 4], 24 - 8 * (j % 4)), 24);
        P->dsc[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
    }
}

KN_INLINE void kn2_tile4K(const kn2_p4K *P, int nb, const uint8_t *xb, size_t x_stride,
                          const kn2_xK *xp, int xi, int N, float *yp, size_t y_stride, int nr,
                          int first)
{
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[KN2_NT];
#pragma GCC unroll 4
    for (int i = 0; i < N; i++) acc[i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *xq = xb + (size_t)b * sizeof(kn_block_q8_K) + offsetof(kn_block_q8_K, qs);
        __m256 g[KN2_NT];
#pragma GCC unroll 4
        for (int i = 0; i < N; i++) g[i] = _mm256_setzero_ps();
        for (int j = 0; j < 8; j++) {
            __m256i s[KN2_NT];
#pragma GCC unroll 4
            for (int i = 0; i < N; i++) s[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int jj = 0; jj < 8; jj++) {
                const __m256i w = _mm256_load_si256(&P[b].q[j][jj]);
#pragma GCC unroll 4
                for (int i = 0; i < N; i++)
                    s[i] = _mm256_add_epi16(
                        s[i], _mm256_maddubs_epi16(
                                  w, kn2_bcast32(xq + (size_t)i * x_stride + 32 * j + 4 * jj)));
            }
#pragma GCC unroll 4
            for (int i = 0; i < N; i++)
                g[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s[i], ones)),
                                       P[b].dsc[j], g[i]);
        }
#pragma GCC unroll 4
        for (int i = 0; i < N; i++) {
            __m256i ms = _mm256_madd_epi16(P[b].mn[0], _mm256_set1_epi32(xp->c[xi + i][b][0]));
#pragma GCC unroll 4
            for (int t = 1; t < 4; t++)
                ms = _mm256_add_epi32(
                    ms, _mm256_madd_epi16(P[b].mn[t], _mm256_set1_epi32(xp->c[xi + i][b][t])));
            g[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms), P[b].dmin, g[i]);
            acc[i] = _mm256_fmadd_ps(g[i], _mm256_set1_ps(xp->d[xi + i][b]), acc[i]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < N; i++) kn2_store_rows(yp + (size_t)i * y_stride, nr, acc[i], first);
}

KN_INLINE void kn2_tile6K(const kn2_p6K *P, int nb, const uint8_t *xb, size_t x_stride,
                          const kn2_xK *xp, int xi, int N, float *yp, size_t y_stride, int nr,
                          int first)
{
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[KN2_NT];
#pragma GCC unroll 4
    for (int i = 0; i < N; i++) acc[i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *xq = xb + (size_t)b * sizeof(kn_block_q8_K) + offsetof(kn_block_q8_K, qs);
        __m256 g[KN2_NT];
#pragma GCC unroll 4
        for (int i = 0; i < N; i++) g[i] = _mm256_setzero_ps();
        for (int j = 0; j < 16; j++) {
            const __m256i w0 = P[b].q[j][0], w1 = P[b].q[j][1], w2 = P[b].q[j][2],
                          w3 = P[b].q[j][3];
#pragma GCC unroll 4
            for (int i = 0; i < N; i++) {
                const uint8_t *xj = xq + (size_t)i * x_stride + 16 * j;
                /* quants 0..63: two pair-sums fit int16, four would not */
                const __m256i a = _mm256_add_epi16(_mm256_maddubs_epi16(w0, kn2_bcast32(xj)),
                                                   _mm256_maddubs_epi16(w1, kn2_bcast32(xj + 4)));
                const __m256i c = _mm256_add_epi16(_mm256_maddubs_epi16(w2, kn2_bcast32(xj + 8)),
                                                   _mm256_maddubs_epi16(w3, kn2_bcast32(xj + 12)));
                __m256i s =
                    _mm256_add_epi32(_mm256_madd_epi16(a, ones), _mm256_madd_epi16(c, ones));
                s = _mm256_add_epi32(s, _mm256_set1_epi32(xp->c[xi + i][b][j]));
                g[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), P[b].dsc[j], g[i]);
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < N; i++)
            acc[i] = _mm256_fmadd_ps(g[i], _mm256_set1_ps(xp->d[xi + i][b]), acc[i]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < N; i++) kn2_store_rows(yp + (size_t)i * y_stride, nr, acc[i], first);
}

static void kn2_matmulK(int is_q6, const uint8_t *w, size_t w_stride, const uint8_t *x,
                        size_t x_stride, int64_t k, int m, float *y, size_t y_stride, int64_t r0,
                        int64_t r1)
{
    kn2_xK xp;
    union {
        kn2_p4K q4[KN2_KCK];
        kn2_p6K q6[KN2_KCK];
    } panel __attribute__((aligned(32)));
    const int64_t nb_all = k / KN_QK_K;
    for (int64_t b0 = 0; b0 < nb_all; b0 += KN2_KCK) {
        const int nb = nb_all - b0 < KN2_KCK ? (int)(nb_all - b0) : KN2_KCK;
        const int first = b0 == 0;
        for (int c0 = 0; c0 < m; c0 += KN2_NC) {
            const int nc = m - c0 < KN2_NC ? m - c0 : KN2_NC;
            const uint8_t *xc = x + (size_t)c0 * x_stride;
            kn2_xprepK(is_q6, xc, x_stride, nc, b0, nb, &xp);
            const uint8_t *xb = xc + (size_t)b0 * sizeof(kn_block_q8_K);
            for (int64_t p0 = r0; p0 < r1; p0 += KN2_PR) {
                const uint8_t *rp[KN2_PR];
                const int nr = kn2_panel_rows(w, w_stride, p0, r1, rp);
                float *yp = y + (size_t)c0 * y_stride + (size_t)p0;
                const __m256i roff = kn2_row_offsets(w_stride, nr);
                for (int b = 0; b < nb; b++) {
                    if (is_q6)
                        kn2_pack_q6K(rp, roff, b0 + b, &panel.q6[b]);
                    else
                        kn2_pack_q4K(rp, roff, b0 + b, &panel.q4[b]);
                }
                for (int t = 0; t < nc;) {
                    const int n = kn2_tile_width(nc - t);
                    const uint8_t *xt = xb + (size_t)t * x_stride;
                    float *yt = yp + (size_t)t * y_stride;
                    if (is_q6) {
#define KN2_CALL(N) kn2_tile6K(panel.q6, nb, xt, x_stride, &xp, t, N, yt, y_stride, nr, first)
                        KN2_SWITCH(n, KN2_CALL)
#undef KN2_CALL
                    } else {
#define KN2_CALL(N) kn2_tile4K(panel.q4, nb, xt, x_stride, &xp, t, N, yt, y_stride, nr, first)
                        KN2_SWITCH(n, KN2_CALL)
#undef KN2_CALL
                    }
                    t += n;
                }
            }
        }
    }
}

/* ------------------------------------------------------------------ F32, F16, BF16 */

enum { KN2_F32, KN2_F16, KN2_BF16 };

KN_INLINE __m256 kn2_loadf(int ft, const void *p, int64_t j)
{
    switch (ft) {
    case KN2_F16:
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const kn_f16 *)p + j)));
    case KN2_BF16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const kn_bf16 *)p + j))), 16));
    default:
        return _mm256_loadu_ps((const float *)p + j);
    }
}

KN_INLINE float kn2_scalarf(int ft, const void *p, int64_t j)
{
    switch (ft) {
    case KN2_F16:
        return _cvtsh_ss(((const kn_f16 *)p)[j]);
    case KN2_BF16: {
        const uint32_t u = (uint32_t)((const kn_bf16 *)p)[j] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    default:
        return ((const float *)p)[j];
    }
}

KN_INLINE float kn2_hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

KN_INLINE void kn2_tilef(int ft, const uint8_t *w, size_t w_stride, const uint8_t *x,
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
        for (int i = 0; i < N; i++) xv[i] = kn2_loadf(ft, x + (size_t)i * x_stride, j);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256 wv = kn2_loadf(ft, w + (size_t)r * w_stride, j);
#pragma GCC unroll 2
            for (int i = 0; i < N; i++) acc[r][i] = _mm256_fmadd_ps(wv, xv[i], acc[r][i]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int i = 0; i < N; i++) {
            float s = kn2_hsum(acc[r][i]);
            for (int64_t t = j; t < k; t++)
                s += kn2_scalarf(ft, w + (size_t)r * w_stride, t) *
                     kn2_scalarf(ft, x + (size_t)i * x_stride, t);
            y[(size_t)i * y_stride + (size_t)r] = s;
        }
}

/* 4 x 2 tiles; row and column remainders run as 1-wide tiles. */
static void kn2_matmulf(int ft, const uint8_t *w, size_t w_stride, const uint8_t *x,
                        size_t x_stride, int64_t k, int m, float *y, size_t y_stride, int64_t r0,
                        int64_t r1)
{
    for (int64_t r = r0; r < r1;) {
        const int R = r1 - r >= 4 ? 4 : 1;
        for (int i = 0; i < m;) {
            const int N = m - i >= 2 ? 2 : 1;
            const uint8_t *wr = w + (size_t)r * w_stride, *xi = x + (size_t)i * x_stride;
            float *yo = y + (size_t)i * y_stride + (size_t)r;
            if (R == 4 && N == 2)
                kn2_tilef(ft, wr, w_stride, xi, x_stride, k, 4, 2, yo, y_stride);
            else if (R == 4)
                kn2_tilef(ft, wr, w_stride, xi, x_stride, k, 4, 1, yo, y_stride);
            else if (N == 2)
                kn2_tilef(ft, wr, w_stride, xi, x_stride, k, 1, 2, yo, y_stride);
            else
                kn2_tilef(ft, wr, w_stride, xi, x_stride, k, 1, 1, yo, y_stride);
            i += N;
        }
        r += R;
    }
}

void kn_matmul_avx2(km_type wt, const void *w, size_t w_stride, const void *x, size_t x_stride,
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
        kn2_matmul_q4_0(w, w_stride, x, x_stride, k, m, y, y_stride, r0, r1);
        break;
    case KM_TYPE_Q4_1:
        kn2_matmul_q4_1(w, w_stride, x, x_stride, k, m, y, y_stride, r0, r1);
        break;
    case KM_TYPE_Q8_0:
        kn2_matmul_q8_0(w, w_stride, x, x_stride, k, m, y, y_stride, r0, r1);
        break;
    case KM_TYPE_Q4_K:
        kn2_matmulK(0, w, w_stride, x, x_stride, k, m, y, y_stride, r0, r1);
        break;
    case KM_TYPE_Q6_K:
        kn2_matmulK(1, w, w_stride, x, x_stride, k, m, y, y_stride, r0, r1);
        break;
    case KM_TYPE_F32:
        kn2_matmulf(KN2_F32, w, w_stride, x, x_stride, k, m, y, y_stride, r0, r1);
        break;
    case KM_TYPE_F16:
        kn2_matmulf(KN2_F16, w, w_stride, x, x_stride, k, m, y, y_stride, r0, r1);
        break;
    case KM_TYPE_BF16:
        kn2_matmulf(KN2_BF16, w, w_stride, x, x_stride, k, m, y, y_stride, r0, r1);
        break;
    default:
        assert(!"kn_matmul: unsupported weight type");
    }
}

/* ------------------------------------------------------------------ activation quantization */

KN_INLINE float kn2_hmax(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

KN_INLINE int kn2_hsum_i32(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
    return _mm_cvtsi128_si32(s);
}

/* One Q8_0/Q8_1 block exactly as ggml's AVX2 quantize_row_q8_0/q8_1; returns the sum of the
 * stored quants. */
KN_INLINE int kn2_q8_block(const float *x, int8_t *qs, kn_f16 *dout, float *dval)
{
    __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
    __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 a = _mm256_andnot_ps(sign, v0);
    a = _mm256_max_ps(a, _mm256_andnot_ps(sign, v1));
    a = _mm256_max_ps(a, _mm256_andnot_ps(sign, v2));
    a = _mm256_max_ps(a, _mm256_andnot_ps(sign, v3));
    const float amax = kn2_hmax(a);
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
    return kn2_hsum_i32(s) - 4096;
}

void kn_quantize_row_avx2(km_type t, const float *x, void *vy, int64_t n)
{
    switch (t) {
    case KM_TYPE_Q8_0: {
        assert(n % KN_QK8_0 == 0);
        uint8_t *y = vy;
        for (int64_t i = 0; i < n / KN_QK8_0; i++, x += KN_QK8_0, y += sizeof(kn_block_q8_0)) {
            kn_f16 d;
            float dv;
            kn2_q8_block(x, (int8_t *)(y + 2), &d, &dv);
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
            const int sum = kn2_q8_block(x, (int8_t *)(y + 4), &d, &dv);
            const kn_f16 s = _cvtss_sh(dv * (float)sum, 0);
            memcpy(y, &d, 2);
            memcpy(y + 2, &s, 2);
        }
        break;
    }
    case KM_TYPE_Q8_K: {
        assert(n % KN_QK_K == 0);
        uint8_t *y = vy;
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int64_t i = 0; i < n / KN_QK_K; i++, x += KN_QK_K, y += sizeof(kn_block_q8_K)) {
            kn_block_q8_K blk;
            __m256 a = _mm256_setzero_ps();
            for (int j = 0; j < 32; j++)
                a = _mm256_max_ps(a, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * j)));
            const float amax = kn2_hmax(a);
            memset(&blk, 0, sizeof blk);
            if (amax == 0.0f) {
                memcpy(y, &blk, sizeof blk);
                continue;
            }
            float max = 0;
            const __m256 va = _mm256_set1_ps(amax);
            for (int j = 0; j < 32; j++) {
                const int hit = _mm256_movemask_ps(_mm256_cmp_ps(
                    _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * j)), va, _CMP_EQ_OQ));
                if (hit) {
                    max = x[8 * j + __builtin_ctz((unsigned)hit)];
                    break;
                }
            }
            const float iscale = -127.f / max;
            blk.d = 1 / iscale;
            /* iscale overflows only for |max| < ~3.7e-37; ggml's nearest_int then maps every
             * element to a value whose int8 is 0 */
            if (isinf(iscale)) {
                memcpy(y, &blk, sizeof blk);
                continue;
            }
            /* |iscale * x| <= 127 here, where rounding to nearest even equals nearest_int */
            const __m256 vs = _mm256_set1_ps(iscale);
            for (int j = 0; j < 16; j++) {
                __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * j), vs));
                __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * j + 8), vs));
                q0 = _mm256_min_epi32(q0, _mm256_set1_epi32(127));
                q1 = _mm256_min_epi32(q1, _mm256_set1_epi32(127));
                blk.bsums[j] = (int16_t)kn2_hsum_i32(_mm256_add_epi32(q0, q1));
                __m256i p = _mm256_packs_epi32(q0, q1); /* 0..3 8..11 4..7 12..15 */
                p = _mm256_permute4x64_epi64(p, 0xD8);  /* 0..15 as int16 */
                const __m128i b8 =
                    _mm_packs_epi16(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
                _mm_storeu_si128((__m128i *)(blk.qs + 16 * j), b8);
            }
            memcpy(y, &blk, sizeof blk);
        }
        break;
    }
    case KM_TYPE_F16: {
        kn_f16 *y = vy;
        int64_t j = 0;
        for (; j + 8 <= n; j += 8)
            _mm_storeu_si128((__m128i *)(y + j), _mm256_cvtps_ph(_mm256_loadu_ps(x + j), 0));
        for (; j < n; j++) y[j] = _cvtss_sh(x[j], 0);
        break;
    }
    case KM_TYPE_BF16: {
        kn_bf16 *y = vy;
        int64_t j = 0;
        const __m256i abs = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
        for (; j + 8 <= n; j += 8) {
            const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(x + j));
            const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs), inf);
            const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
            __m256i r = _mm256_srli_epi32(
                _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
            r = _mm256_blendv_epi8(
                r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(64)), nan);
            const __m128i p =
                _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
            _mm_storeu_si128((__m128i *)(y + j), p);
        }
        if (j < n) kn_quantize_row_ref(t, x + j, y + j, n - j);
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
void kn_dequantize_row_avx2(km_type t, const void *x, float *y, int64_t n)
{
    kn_dequantize_row_ref(t, x, y, n);
}
