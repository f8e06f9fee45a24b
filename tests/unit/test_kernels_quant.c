/*
 * test_kernels_quant.c — holds the quantization kernels to their contract: every ISA's
 * quantize_row is bit-identical to the scalar reference, dequantize_row agrees with the block
 * formulas, every ISA's matmul equals the reference matmul to float rounding at awkward shapes
 * (m and row counts that are not multiples of any tile, sub-ranges [r0, r1), padded strides), and
 * the reference equals a double-precision dot of the dequantized operands, which in turn is within
 * quantization error of the float dot. ISAs the CPU lacks are skipped with a message.
 *
 * Weights come two ways: from float through the ggml-identical reference quantizers below
 * (Q4_0, Q4_1, Q8_0 exactly as ggml's quantize_row_*_ref; Q4_K and Q6_K through a simpler
 * scale search, since only the dot numerics must match ggml), and as uniformly random block
 * bytes, which reach every nibble, scale and sign pattern a model file may hold.
 */
#include <criterion/criterion.h>
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/internal.h"
#include "kernels/cpu/packed.h"

/* ------------------------------------------------------------------ helpers */

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint32_t rnd_u32(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

static float rnd_unif(void)
{
    return (float)((rnd_u32() >> 8) * (1.0 / 16777216.0)) * 2.f - 1.f;
}

static float rnd_gauss(void)
{
    float s = 0;
    for (int i = 0; i < 4; i++) s += rnd_unif();
    return s * 0.866f;
}

static const kn_ops *ref(void)
{
    return kn_ops_get(KN_ISA_SCALAR);
}

/* The AVX-512 driver configuration emulated on AVX2 (emu512_avx2.c), or NULL without AVX2. */
KN_DECLARE_ISA(emu512)
static const kn_ops *emu512(void)
{
    static kn_ops t;
    if (!kn_ops_get(KN_ISA_AVX2)) return NULL;
    t = *kn_ops_get(KN_ISA_AVX2);
    t.isa = KN_ISA_AVX512; /* indexes the worst-ratio table */
    t.name = "avx512-emulated";
    t.quantize_row = kn_quantize_row_emu512;
    t.matmul = kn_matmul_emu512;
    t.pack_size = kn_pack_size_emu512;
    t.pack = kn_pack_emu512;
    t.matmul_packed = kn_matmul_packed_emu512;
    return &t;
}

static kn_f16 f2h(float f)
{
    kn_f16 h;
    ref()->quantize_row(MD_TYPE_F16, &f, &h, 1);
    return h;
}

static float h2f(kn_f16 h)
{
    float f;
    ref()->dequantize_row(MD_TYPE_F16, &h, &f, 1);
    return f;
}

static size_t row_bytes(md_type t, int64_t k)
{
    switch (t) {
    case MD_TYPE_F32:
        return (size_t)k * 4;
    case MD_TYPE_F16:
    case MD_TYPE_BF16:
        return (size_t)k * 2;
    case MD_TYPE_Q4_0:
        return (size_t)(k / 32) * sizeof(kn_block_q4_0);
    case MD_TYPE_Q4_1:
        return (size_t)(k / 32) * sizeof(kn_block_q4_1);
    case MD_TYPE_Q8_0:
        return (size_t)(k / 32) * sizeof(kn_block_q8_0);
    case MD_TYPE_Q8_1:
        return (size_t)(k / 32) * sizeof(kn_block_q8_1);
    case MD_TYPE_Q4_K:
        return (size_t)(k / 256) * sizeof(kn_block_q4_K);
    case MD_TYPE_Q6_K:
        return (size_t)(k / 256) * sizeof(kn_block_q6_K);
    case MD_TYPE_Q8_K:
        return (size_t)(k / 256) * sizeof(kn_block_q8_K);
    default:
        return 0;
    }
}

static int block_elems(md_type t)
{
    switch (t) {
    case MD_TYPE_F32:
    case MD_TYPE_F16:
    case MD_TYPE_BF16:
        return 1;
    case MD_TYPE_Q4_K:
    case MD_TYPE_Q6_K:
    case MD_TYPE_Q8_K:
        return 256;
    default:
        return 32;
    }
}

static const char *tname(md_type t)
{
    switch (t) {
    case MD_TYPE_F32:
        return "F32";
    case MD_TYPE_F16:
        return "F16";
    case MD_TYPE_BF16:
        return "BF16";
    case MD_TYPE_Q4_0:
        return "Q4_0";
    case MD_TYPE_Q4_1:
        return "Q4_1";
    case MD_TYPE_Q8_0:
        return "Q8_0";
    case MD_TYPE_Q8_1:
        return "Q8_1";
    case MD_TYPE_Q4_K:
        return "Q4_K";
    case MD_TYPE_Q6_K:
        return "Q6_K";
    case MD_TYPE_Q8_K:
        return "Q8_K";
    default:
        return "?";
    }
}

static const md_type weight_types[] = {MD_TYPE_F32,  MD_TYPE_F16,  MD_TYPE_BF16, MD_TYPE_Q4_0,
                                       MD_TYPE_Q4_1, MD_TYPE_Q8_0, MD_TYPE_Q4_K, MD_TYPE_Q6_K};
#define N_WEIGHT_TYPES (int)(sizeof weight_types / sizeof weight_types[0])

static const char *isa_names[KN_ISA_COUNT] = {"scalar", "avx2", "avx512"};

/* ------------------------------------------------------------------ reference weight quantizers */

static int nearest(float f)
{
    return (int)lrintf(f);
}

/* ggml quantize_row_q4_0_ref */
static void quant_q4_0(const float *x, kn_block_q4_0 *y, int64_t k)
{
    for (int64_t i = 0; i < k / 32; i++, x += 32) {
        float amax = 0, max = 0;
        for (int j = 0; j < 32; j++)
            if (amax < fabsf(x[j])) {
                amax = fabsf(x[j]);
                max = x[j];
            }
        const float d = max / -8, id = d ? 1.0f / d : 0.0f;
        y[i].d = f2h(d);
        for (int j = 0; j < 16; j++) {
            int a = (int8_t)(x[j] * id + 8.5f), b = (int8_t)(x[j + 16] * id + 8.5f);
            y[i].qs[j] = (uint8_t)((a < 15 ? a : 15) | ((b < 15 ? b : 15) << 4));
        }
    }
}

/* ggml quantize_row_q4_1_ref */
static void quant_q4_1(const float *x, kn_block_q4_1 *y, int64_t k)
{
    for (int64_t i = 0; i < k / 32; i++, x += 32) {
        float min = FLT_MAX, max = -FLT_MAX;
        for (int j = 0; j < 32; j++) {
            if (x[j] < min) min = x[j];
            if (x[j] > max) max = x[j];
        }
        const float d = (max - min) / 15, id = d ? 1.0f / d : 0.0f;
        y[i].d = f2h(d);
        y[i].m = f2h(min);
        for (int j = 0; j < 16; j++) {
            int a = (int8_t)((x[j] - min) * id + 0.5f), b = (int8_t)((x[j + 16] - min) * id + 0.5f);
            y[i].qs[j] = (uint8_t)((a < 15 ? a : 15) | ((b < 15 ? b : 15) << 4));
        }
    }
}

/* ggml quantize_row_q8_0_ref (weights: roundf, id = 1/d) */
static void quant_q8_0_w(const float *x, kn_block_q8_0 *y, int64_t k)
{
    for (int64_t i = 0; i < k / 32; i++, x += 32) {
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127, id = d ? 1.0f / d : 0.0f;
        y[i].d = f2h(d);
        for (int j = 0; j < 32; j++) y[i].qs[j] = (int8_t)roundf(x[j] * id);
    }
}

/* Q4_K: per sub-block min/max scale, 6-bit scales and mins (simpler than ggml's search). */
static void quant_q4_K(const float *x, kn_block_q4_K *y, int64_t k)
{
    for (int64_t i = 0; i < k / 256; i++, x += 256) {
        float sc[8], mn[8], maxsc = 0, maxmn = 0;
        for (int j = 0; j < 8; j++) {
            float lo = 0, hi = -FLT_MAX;
            for (int l = 0; l < 32; l++) {
                lo = fminf(lo, x[32 * j + l]);
                hi = fmaxf(hi, x[32 * j + l]);
            }
            sc[j] = (hi - lo) / 15;
            mn[j] = -lo;
            maxsc = fmaxf(maxsc, sc[j]);
            maxmn = fmaxf(maxmn, mn[j]);
        }
        const float d = maxsc / 63, dmin = maxmn / 63;
        y[i].d = f2h(d);
        y[i].dmin = f2h(dmin);
        const float dd = h2f(y[i].d), dm = h2f(y[i].dmin);
        uint8_t ls[8], lm[8], L[256];
        for (int j = 0; j < 8; j++) {
            int a = dd ? nearest(sc[j] / dd) : 0, b = dm ? nearest(mn[j] / dm) : 0;
            ls[j] = (uint8_t)(a < 0 ? 0 : a > 63 ? 63 : a);
            lm[j] = (uint8_t)(b < 0 ? 0 : b > 63 ? 63 : b);
            const float s = dd * ls[j], o = dm * lm[j];
            for (int l = 0; l < 32; l++) {
                int q = s ? nearest((x[32 * j + l] + o) / s) : 0;
                L[32 * j + l] = (uint8_t)(q < 0 ? 0 : q > 15 ? 15 : q);
            }
        }
        memset(y[i].scales, 0, 12);
        for (int j = 0; j < 8; j++) {
            if (j < 4) {
                y[i].scales[j] = ls[j];
                y[i].scales[j + 4] = lm[j];
            } else {
                y[i].scales[j + 4] = (uint8_t)((ls[j] & 0xF) | ((lm[j] & 0xF) << 4));
                y[i].scales[j - 4] |= (uint8_t)((ls[j] >> 4) << 6);
                y[i].scales[j - 0] |= (uint8_t)((lm[j] >> 4) << 6);
            }
        }
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++)
                y[i].qs[32 * j + l] = (uint8_t)(L[64 * j + l] | (L[64 * j + 32 + l] << 4));
    }
}

/* Q6_K: signed 8-bit scale per 16, 6-bit values, ggml's bit layout. */
static void quant_q6_K(const float *x, kn_block_q6_K *y, int64_t k)
{
    for (int64_t i = 0; i < k / 256; i++, x += 256) {
        float sc[16], amaxsc = 0;
        for (int j = 0; j < 16; j++) {
            float amax = 0, max = 0;
            for (int l = 0; l < 16; l++)
                if (fabsf(x[16 * j + l]) > amax) {
                    amax = fabsf(x[16 * j + l]);
                    max = x[16 * j + l];
                }
            sc[j] = max / -32; /* signed, like ggml's make_qx_quants */
            amaxsc = fmaxf(amaxsc, fabsf(sc[j]));
        }
        const float d = amaxsc / 127;
        y[i].d = f2h(d);
        const float dd = h2f(y[i].d);
        uint8_t L[256];
        for (int j = 0; j < 16; j++) {
            int a = dd ? nearest(sc[j] / dd) : 0;
            y[i].scales[j] = (int8_t)(a < -127 ? -127 : a > 127 ? 127 : a);
            const float s = dd * y[i].scales[j];
            for (int l = 0; l < 16; l++) {
                int q = s ? nearest(x[16 * j + l] / s) : 0;
                L[16 * j + l] = (uint8_t)((q < -32 ? -32 : q > 31 ? 31 : q) + 32);
            }
        }
        uint8_t *ql = y[i].ql, *qh = y[i].qh;
        for (int j = 0; j < 256; j += 128, ql += 64, qh += 32)
            for (int l = 0; l < 32; l++) {
                ql[l] = (uint8_t)((L[j + l] & 0xF) | ((L[j + l + 64] & 0xF) << 4));
                ql[l + 32] = (uint8_t)((L[j + l + 32] & 0xF) | ((L[j + l + 96] & 0xF) << 4));
                qh[l] = (uint8_t)((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) |
                                  ((L[j + l + 64] >> 4) << 4) | ((L[j + l + 96] >> 4) << 6));
            }
    }
}

/* Quantizes one weight row of k floats into type t. */
static void quant_weight_row(md_type t, const float *x, void *y, int64_t k)
{
    switch (t) {
    case MD_TYPE_F32:
    case MD_TYPE_F16:
    case MD_TYPE_BF16:
        ref()->quantize_row(t, x, y, k);
        break;
    case MD_TYPE_Q4_0:
        quant_q4_0(x, y, k);
        break;
    case MD_TYPE_Q4_1:
        quant_q4_1(x, y, k);
        break;
    case MD_TYPE_Q8_0:
        quant_q8_0_w(x, y, k);
        break;
    case MD_TYPE_Q4_K:
        quant_q4_K(x, y, k);
        break;
    case MD_TYPE_Q6_K:
        quant_q6_K(x, y, k);
        break;
    default:
        cr_assert_fail("no quantizer for %s", tname(t));
    }
}

/* A scale for random blocks: a normal fp16 of either sign in roughly [2^-10, 2^-4]. */
static kn_f16 rnd_scale(int allow_negative)
{
    float v = ldexpf(1.0f + (float)(rnd_u32() % 1024) / 1024.f, -4 - (int)(rnd_u32() % 7));
    if (allow_negative && (rnd_u32() & 1)) v = -v;
    return f2h(v);
}

/* Fills one weight row with random block bytes (all bit patterns of the quants, sane scales). */
static void random_weight_row(md_type t, void *y, int64_t k)
{
    uint8_t *p = y;
    size_t nbytes = row_bytes(t, k);
    for (size_t i = 0; i < nbytes; i++) p[i] = (uint8_t)rnd_u32();
    switch (t) {
    case MD_TYPE_F32:
        for (int64_t i = 0; i < k; i++) ((float *)y)[i] = rnd_gauss();
        break;
    case MD_TYPE_F16:
        for (int64_t i = 0; i < k; i++) ((kn_f16 *)y)[i] = f2h(rnd_gauss());
        break;
    case MD_TYPE_BF16: {
        float tmp[1];
        for (int64_t i = 0; i < k; i++) {
            tmp[0] = rnd_gauss();
            ref()->quantize_row(MD_TYPE_BF16, tmp, (kn_bf16 *)y + i, 1);
        }
        break;
    }
    case MD_TYPE_Q4_0:
        for (int64_t b = 0; b < k / 32; b++) ((kn_block_q4_0 *)y)[b].d = rnd_scale(1);
        break;
    case MD_TYPE_Q4_1:
        for (int64_t b = 0; b < k / 32; b++) {
            ((kn_block_q4_1 *)y)[b].d = rnd_scale(0);
            ((kn_block_q4_1 *)y)[b].m = f2h(rnd_gauss() * 0.1f);
        }
        break;
    case MD_TYPE_Q8_0:
        for (int64_t b = 0; b < k / 32; b++) ((kn_block_q8_0 *)y)[b].d = rnd_scale(1);
        break;
    case MD_TYPE_Q4_K:
        for (int64_t b = 0; b < k / 256; b++) {
            ((kn_block_q4_K *)y)[b].d = rnd_scale(0);
            ((kn_block_q4_K *)y)[b].dmin = rnd_scale(0);
        }
        break;
    case MD_TYPE_Q6_K:
        for (int64_t b = 0; b < k / 256; b++) ((kn_block_q6_K *)y)[b].d = rnd_scale(1);
        break;
    default:
        break;
    }
}

/* Copy of a Q4_1 / Q4_K row with the quants zeroed: its dequantization is the min term alone. */
static void zero_quants(md_type t, void *y, int64_t k)
{
    if (t == MD_TYPE_Q4_1)
        for (int64_t b = 0; b < k / 32; b++) memset(((kn_block_q4_1 *)y)[b].qs, 0, 16);
    if (t == MD_TYPE_Q4_K)
        for (int64_t b = 0; b < k / 256; b++) memset(((kn_block_q4_K *)y)[b].qs, 0, 128);
}

/* ------------------------------------------------------------------ matmul checking */

typedef struct mm_case {
    md_type wt;
    int64_t rows, k, r0, r1;
    int m;
    int random_bytes; /* 1: random block bytes; 0: quantized from float */
    size_t w_pad, x_pad, y_pad;
} mm_case;

typedef struct mm_data {
    size_t w_stride, x_stride, y_stride;
    uint8_t *w, *x;
    float *wf, *xf;          /* float originals (quantized cases) */
    float *wdq, *wmin, *xdq; /* dequantized rows; wmin: the min term part (Q4_1, Q4_K) */
} mm_data;

static void mm_data_make(const mm_case *c, mm_data *d)
{
    const md_type dt = kn_dot_type(c->wt);
    d->w_stride = row_bytes(c->wt, c->k) + c->w_pad;
    d->x_stride = row_bytes(dt, c->k) + c->x_pad;
    d->y_stride = (size_t)c->rows + c->y_pad;
    d->w = calloc((size_t)c->rows, d->w_stride);
    d->x = calloc((size_t)c->m, d->x_stride);
    d->wf = malloc(sizeof(float) * (size_t)(c->rows * c->k));
    d->xf = malloc(sizeof(float) * (size_t)(c->m * c->k));
    d->wdq = malloc(sizeof(float) * (size_t)(c->rows * c->k));
    d->wmin = calloc((size_t)(c->rows * c->k), sizeof(float));
    d->xdq = malloc(sizeof(float) * (size_t)(c->m * c->k));
    uint8_t *tmp = malloc(d->w_stride);
    for (int64_t r = 0; r < c->rows; r++) {
        float *wr = d->wf + r * c->k;
        /* rows of varied scale and offset, so blocks differ */
        const float scale = 0.05f + 0.5f * fabsf(rnd_unif()), off = 0.02f * rnd_unif();
        for (int64_t j = 0; j < c->k; j++) wr[j] = rnd_gauss() * scale + off;
        uint8_t *wq = d->w + (size_t)r * d->w_stride;
        if (c->random_bytes)
            random_weight_row(c->wt, wq, c->k);
        else
            quant_weight_row(c->wt, wr, wq, c->k);
        ref()->dequantize_row(c->wt, wq, d->wdq + r * c->k, c->k);
        if (c->wt == MD_TYPE_Q4_1 || c->wt == MD_TYPE_Q4_K) {
            memcpy(tmp, wq, d->w_stride);
            zero_quants(c->wt, tmp, c->k);
            ref()->dequantize_row(c->wt, tmp, d->wmin + r * c->k, c->k);
        }
    }
    free(tmp);
    for (int i = 0; i < c->m; i++) {
        float *xr = d->xf + (int64_t)i * c->k;
        const float scale = 0.1f + 2.0f * fabsf(rnd_unif());
        for (int64_t j = 0; j < c->k; j++) xr[j] = rnd_gauss() * scale;
        if (i % 7 == 3 && c->k >= 64) /* an all-zero block */
            memset(xr + 32 * (rnd_u32() % (uint32_t)(c->k / 64)), 0, 32 * sizeof(float));
        uint8_t *xq = d->x + (size_t)i * d->x_stride;
        ref()->quantize_row(dt, xr, xq, c->k);
        ref()->dequantize_row(dt, xq, d->xdq + (int64_t)i * c->k, c->k);
    }
}

static void mm_data_free(mm_data *d)
{
    free(d->w);
    free(d->x);
    free(d->wf);
    free(d->xf);
    free(d->wdq);
    free(d->wmin);
    free(d->xdq);
}

/* Sum over k of |w part| * |x|, the scale float rounding is measured against. */
static double mm_bound(const mm_case *c, const mm_data *d, int64_t r, int i)
{
    const float *w = d->wdq + r * c->k, *wm = d->wmin + r * c->k, *x = d->xdq + (int64_t)i * c->k;
    double b = 0;
    for (int64_t j = 0; j < c->k; j++) b += (fabs(w[j]) + 2 * fabs(wm[j])) * fabs(x[j]);
    return b;
}

static float *mm_run(const kn_ops *ops, const mm_case *c, const mm_data *d)
{
    size_t ny = (size_t)c->m * d->y_stride;
    float *y = malloc(ny * sizeof(float));
    for (size_t i = 0; i < ny; i++) y[i] = -12345.0f;
    ops->matmul(c->wt, d->w, d->w_stride, d->x, d->x_stride, c->k, c->m, y, d->y_stride, c->r0,
                c->r1);
    return y;
}

/* The same product over the matrix packed by ops->pack (psize bytes). */
static float *mm_run_packed(const kn_ops *ops, const mm_case *c, const mm_data *d, size_t psize)
{
    void *packed = aligned_alloc(64, (psize + 63) & ~(size_t)63);
    ops->pack(c->wt, d->w, d->w_stride, c->rows, c->k, packed);
    size_t ny = (size_t)c->m * d->y_stride;
    float *y = malloc(ny * sizeof(float));
    for (size_t i = 0; i < ny; i++) y[i] = -12345.0f;
    ops->matmul_packed(c->wt, packed, c->rows, d->x, d->x_stride, c->k, c->m, y, d->y_stride, c->r0,
                       c->r1);
    free(packed);
    return y;
}

static double worst_ratio[KN_ISA_COUNT][MD_TYPE_COUNT];

/* Runs one case on ops and on the reference; asserts they agree and that nothing outside
 * [r0, r1) x [0, m) was written. */
static void mm_check(const kn_ops *ops, const mm_case *c)
{
    mm_data d;
    mm_data_make(c, &d);
    float *yr = mm_run(ref(), c, &d);
    float *yo = mm_run(ops, c, &d);
    for (int i = 0; i < c->m; i++)
        for (int64_t r = 0; r < (int64_t)d.y_stride; r++) {
            const size_t at = (size_t)i * d.y_stride + (size_t)r;
            if (r < c->r0 || r >= c->r1) {
                cr_assert_eq(yo[at], -12345.0f, "%s %s wrote outside [r0,r1): i=%d r=%lld",
                             ops->name, tname(c->wt), i, (long long)r);
                continue;
            }
            const double tol = 1e-5 * mm_bound(c, &d, r, i) + 1e-30;
            const double err = fabs((double)yo[at] - (double)yr[at]);
            if (err / tol > worst_ratio[ops->isa][c->wt]) worst_ratio[ops->isa][c->wt] = err / tol;
            cr_assert(err <= tol,
                      "%s %s rows=%lld k=%lld m=%d [%lld,%lld) i=%d r=%lld: %.9g vs ref %.9g "
                      "(tol %.3g)",
                      ops->name, tname(c->wt), (long long)c->rows, (long long)c->k, c->m,
                      (long long)c->r0, (long long)c->r1, i, (long long)r, yo[at], yr[at], tol);
        }
    /* Weights packed once give the same Y, bit for bit, as the rows (the engine packs at load),
     * on a range starting at a multiple of KN_PACK_ALIGN. */
    const size_t psize = ops->pack_size(c->wt, c->rows, c->k);
    if (psize) {
        mm_case ca = *c;
        ca.r0 = c->r0 / KN_PACK_ALIGN * KN_PACK_ALIGN;
        float *yu = mm_run(ops, &ca, &d), *yp = mm_run_packed(ops, &ca, &d, psize);
        for (size_t e = 0; e < (size_t)c->m * d.y_stride; e++)
            cr_assert(!memcmp(&yu[e], &yp[e], sizeof(float)),
                      "%s %s packed rows=%lld k=%lld m=%d [%lld,%lld) at %zu: %.9g vs rows %.9g",
                      ops->name, tname(c->wt), (long long)c->rows, (long long)c->k, c->m,
                      (long long)ca.r0, (long long)ca.r1, e, yp[e], yu[e]);
        free(yu);
        free(yp);
    } else {
        cr_assert(ops->isa == KN_ISA_SCALAR || block_elems(c->wt) == 1, "%s packs no %s weights",
                  ops->name, tname(c->wt));
    }
    free(yr);
    free(yo);
    mm_data_free(&d);
}

static int64_t k_for(md_type wt, int variant)
{
    static const int64_t k32[] = {32, 64, 96, 576, 1536, 3200};
    static const int64_t k256[] = {256, 512, 768, 1536, 2304, 4096};
    static const int64_t kf[] = {1, 7, 33, 100, 576, 1536};
    if (block_elems(wt) == 256) return k256[variant % 6];
    if (block_elems(wt) == 32) return k32[variant % 6];
    return kf[variant % 6];
}

/* The packed layout is packed.h's, for both panel heights: a lane of group g of block b of panel
 * p holds the 4 bytes of row p*PR + r at the documented offset of its GGUF block; the f16 fields
 * follow all the groups; missing rows are zeros. The offsets are written out here, apart from
 * pack.c's table. */
static size_t layout_group_src(md_type t, int g)
{
    switch (t) {
    case MD_TYPE_Q4_0:
    case MD_TYPE_Q8_0:
        return 2 + 4 * (size_t)g;
    case MD_TYPE_Q4_1:
        return 4 + 4 * (size_t)g;
    case MD_TYPE_Q4_K:
        return g < 32 ? 16 + 4 * (size_t)g : 4 + 4 * (size_t)(g - 32);
    default: /* Q6_K: ql, qh, scales */
        return g < 32   ? 4 * (size_t)g
               : g < 48 ? 128 + 4 * (size_t)(g - 32)
                        : 192 + 4 * (size_t)(g - 48);
    }
}

Test(kernels_quant, packed_layout_is_the_documented_permutation)
{
    static const md_type types[] = {MD_TYPE_Q4_0, MD_TYPE_Q4_1, MD_TYPE_Q8_0, MD_TYPE_Q4_K,
                                    MD_TYPE_Q6_K};
    static const int groups[] = {4, 4, 8, 35, 52},
                     halves[][2] = {{0, -1}, {0, 2}, {0, -1}, {0, 2}, {208, -1}};
    static const int prs[] = {8, 16};
    for (size_t ti = 0; ti < 5; ti++)
        for (int pi = 0; pi < 2; pi++) {
            const md_type t = types[ti];
            const int pr = prs[pi], G = groups[ti], F = halves[ti][1] < 0 ? 1 : 2;
            const int64_t rows = 2 * pr + 5, k = 3 * block_elems(t);
            const int nb = 3, bb = (int)row_bytes(t, block_elems(t));
            const size_t ws = row_bytes(t, k);
            uint8_t *w = malloc(ws * (size_t)rows);
            for (size_t i = 0; i < ws * (size_t)rows; i++) w[i] = (uint8_t)rnd_u32();
            const size_t size = kn_packed_size(t, pr, rows, k);
            const size_t pb = (size_t)nb * (size_t)pr * (4 * (size_t)G + 2 * (size_t)F);
            cr_assert_eq(size, 3 * ((pb + 63) & ~(size_t)63), "%s pr %d", tname(t), pr);
            uint8_t *pk = aligned_alloc(64, size);
            memset(pk, 0xA5, size);
            kn_pack_matrix(t, pr, w, ws, rows, k, pk);
            for (int64_t row = 0; row < 3 * pr; row++) {
                const uint8_t *panel = pk + (size_t)(row / pr) * (size / 3);
                const int r = (int)(row % pr);
                for (int b = 0; b < nb; b++) {
                    const uint8_t *src = w + (size_t)row * ws + (size_t)b * (size_t)bb;
                    for (int g = 0; g < G; g++) {
                        const uint8_t *at = panel + ((size_t)b * G + g) * 4 * pr + 4 * (size_t)r;
                        uint8_t want[4] = {0, 0, 0, 0};
                        if (row < rows) memcpy(want, src + layout_group_src(t, g), 4);
                        cr_assert(!memcmp(at, want, 4), "%s pr %d row %lld block %d group %d",
                                  tname(t), pr, (long long)row, b, g);
                    }
                    for (int h = 0; h < F; h++) {
                        const uint8_t *at = panel + (size_t)nb * G * 4 * pr +
                                            ((size_t)b * F + h) * 2 * pr + 2 * (size_t)r;
                        uint8_t want[2] = {0, 0};
                        if (row < rows) memcpy(want, src + halves[ti][h], 2);
                        cr_assert(!memcmp(at, want, 2), "%s pr %d row %lld block %d half %d",
                                  tname(t), pr, (long long)row, b, h);
                    }
                }
            }
            free(w);
            free(pk);
        }
    cr_assert_eq(kn_packed_size(MD_TYPE_F16, 8, 16, 64), 0);
}

static void matmul_sweep(const kn_ops *ops, const char *lacks)
{
    if (!ops) cr_skip_test("this CPU lacks %s", lacks);
    static const int ms[] = {1, 2, 3, 5, 8, 13, 32, 33};
    static const int64_t rowss[] = {1, 7, 16, 17, 33, 50, 64};
    for (int t = 0; t < N_WEIGHT_TYPES; t++) {
        const md_type wt = weight_types[t];
        int n = 0;
        for (int mi = 0; mi < 8; mi++)
            for (int ri = 0; ri < 7; ri++, n++) {
                mm_case c = {.wt = wt, .rows = rowss[ri], .m = ms[mi]};
                c.k = k_for(wt, n % 4 + (n % 11 == 0 ? 4 : 0) + (n % 23 == 0 ? 5 : 0));
                c.r0 = 0;
                c.r1 = c.rows;
                if (n % 3 == 1 && c.rows > 2) { /* a sub-range */
                    c.r0 = (int64_t)(rnd_u32() % (uint32_t)(c.rows / 2));
                    c.r1 = c.r0 + 1 + (int64_t)(rnd_u32() % (uint32_t)(c.rows - c.r0));
                }
                c.random_bytes = n % 2;
                /* pads keep the rows' natural (C) alignment but break every SIMD alignment */
                c.w_pad = n % 5 == 2 ? 4 : 0;
                c.x_pad = n % 4 == 3 ? 12 : 0;
                c.y_pad = (size_t)(n % 3);
                mm_check(ops, &c);
            }
    }
    for (int t = 0; t < N_WEIGHT_TYPES; t++)
        cr_log_info("%s %-4s: worst |err|/tol = %.3g", ops->name, tname(weight_types[t]),
                    worst_ratio[ops->isa][weight_types[t]]);
}

Test(kernels_quant, matmul_scalar_matches_itself_on_subranges)
{
    /* The reference on [r0,r1) in pieces equals the reference on the whole range. */
    mm_case c = {.wt = MD_TYPE_Q4_1, .rows = 40, .k = 96, .m = 5, .r0 = 0, .r1 = 40};
    mm_data d;
    mm_data_make(&c, &d);
    float *whole = mm_run(ref(), &c, &d);
    mm_case a = c, b = c;
    a.r1 = 13;
    b.r0 = 13;
    float *ya = mm_run(ref(), &a, &d), *yb = mm_run(ref(), &b, &d);
    for (int i = 0; i < c.m; i++)
        for (int r = 0; r < 40; r++) {
            float v = r < 13 ? ya[i * 40 + r] : yb[i * 40 + r];
            cr_assert_eq(v, whole[i * 40 + r]);
        }
    free(whole);
    free(ya);
    free(yb);
    mm_data_free(&d);
}

Test(kernels_quant, matmul_avx2_matches_reference, .timeout = 300)
{
    matmul_sweep(kn_ops_get(KN_ISA_AVX2), "avx2");
}
Test(kernels_quant, matmul_avx512_matches_reference, .timeout = 300)
{
    matmul_sweep(kn_ops_get(KN_ISA_AVX512), "avx512");
}

/* Batch invariance, the engine's promise that a token's logits do not depend on the batch: an
 * activation row's outputs are the same bits whether it is multiplied alone, in a small tile or
 * in a call of many rows (another code path: a panel unpacked once and swept by column tiles),
 * packed or not. */
static void matmul_batch_invariance(const kn_ops *ops, const char *lacks)
{
    if (!ops) cr_skip_test("this CPU lacks %s", lacks);
    for (int t = 0; t < N_WEIGHT_TYPES; t++) {
        const md_type wt = weight_types[t];
        mm_case c = {.wt = wt, .rows = 40, .m = 70, .r0 = 0, .r1 = 40, .random_bytes = t % 2};
        c.k = block_elems(wt) == 256 ? 1536 : block_elems(wt) == 32 ? 1536 : 200;
        mm_data d;
        mm_data_make(&c, &d);
        const size_t psize = ops->pack_size(wt, c.rows, c.k);
        void *packed = psize ? aligned_alloc(64, (psize + 63) & ~(size_t)63) : NULL;
        if (packed) ops->pack(wt, d.w, d.w_stride, c.rows, c.k, packed);
        float *all = mm_run(ops, &c, &d);
        static const int ms[] = {1, 3, 8};
        for (int mi = 0; mi < 3; mi++)
            for (int i0 = 0; i0 + ms[mi] <= c.m; i0 += 11) {
                float *y = malloc(sizeof(float) * (size_t)ms[mi] * d.y_stride);
                const uint8_t *x = d.x + (size_t)i0 * d.x_stride;
                for (int pass = 0; pass < (packed ? 2 : 1); pass++) {
                    if (pass)
                        ops->matmul_packed(wt, packed, c.rows, x, d.x_stride, c.k, ms[mi], y,
                                           d.y_stride, 0, c.rows);
                    else
                        ops->matmul(wt, d.w, d.w_stride, x, d.x_stride, c.k, ms[mi], y, d.y_stride,
                                    0, c.rows);
                    for (int i = 0; i < ms[mi]; i++)
                        for (int64_t r = 0; r < c.rows; r++) {
                            const size_t a = (size_t)i * d.y_stride + (size_t)r;
                            const size_t b = (size_t)(i0 + i) * d.y_stride + (size_t)r;
                            cr_assert(!memcmp(&y[a], &all[b], sizeof(float)),
                                      "%s %s%s: row %d alone in %d: %.9g vs %.9g in 70", ops->name,
                                      tname(wt), pass ? " packed" : "", i0 + i, ms[mi], y[a],
                                      all[b]);
                        }
                }
                free(y);
            }
        free(all);
        free(packed);
        mm_data_free(&d);
    }
}

Test(kernels_quant, matmul_avx2_rows_do_not_depend_on_the_batch, .timeout = 300)
{
    matmul_batch_invariance(kn_ops_get(KN_ISA_AVX2), "avx2");
}
Test(kernels_quant, matmul_avx512_rows_do_not_depend_on_the_batch, .timeout = 300)
{
    matmul_batch_invariance(kn_ops_get(KN_ISA_AVX512), "avx512");
}

/* Shapes of the default model (k = 576, 1536; Q8_0 output rows), with thread-like row splits. */
static void matmul_model_shapes(const kn_ops *ops, const char *lacks)
{
    if (!ops) cr_skip_test("this CPU lacks %s", lacks);
    static const struct {
        md_type wt;
        int64_t rows, k;
    } shapes[] = {{MD_TYPE_Q4_1, 576, 576},  {MD_TYPE_Q4_1, 192, 576},  {MD_TYPE_Q4_1, 1536, 576},
                  {MD_TYPE_Q4_1, 576, 1536}, {MD_TYPE_Q8_0, 1000, 576}, {MD_TYPE_Q4_0, 288, 576},
                  {MD_TYPE_Q4_K, 96, 1536},  {MD_TYPE_Q6_K, 96, 1536}};
    static const int ms[] = {1, 8, 70};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int mi = 0; mi < 3; mi++)
            for (int part = 0; part < 2; part++) {
                mm_case c = {
                    .wt = shapes[s].wt, .rows = shapes[s].rows, .k = shapes[s].k, .m = ms[mi]};
                c.r0 = part ? shapes[s].rows / 2 : 0; /* the two halves of a 2-thread split */
                c.r1 = part ? shapes[s].rows : shapes[s].rows / 2;
                c.random_bytes = 0;
                mm_check(ops, &c);
            }
}

Test(kernels_quant, matmul_avx2_model_shapes, .timeout = 300)
{
    matmul_model_shapes(kn_ops_get(KN_ISA_AVX2), "avx2");
}
Test(kernels_quant, matmul_avx512_model_shapes, .timeout = 300)
{
    matmul_model_shapes(kn_ops_get(KN_ISA_AVX512), "avx512");
}

/* Rows longer than any k-chunk of the SIMD builds (8192 elements for few activation rows, 1024
 * for many): the chunks' partial sums must add up. */
static void matmul_long_rows(const kn_ops *ops, const char *lacks)
{
    if (!ops) cr_skip_test("this CPU lacks %s", lacks);
    static const md_type types[] = {MD_TYPE_Q4_0, MD_TYPE_Q4_1, MD_TYPE_Q8_0, MD_TYPE_Q4_K,
                                    MD_TYPE_Q6_K};
    static const int ms[] = {1, 3, 9};
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++)
        for (int mi = 0; mi < 3; mi++) {
            mm_case c = {.wt = types[t], .rows = 20, .m = ms[mi], .r0 = 3, .r1 = 19};
            c.k = block_elems(types[t]) == 256 ? 256 * 37 : 32 * 300;
            c.random_bytes = mi % 2;
            mm_check(ops, &c);
        }
}

Test(kernels_quant, matmul_avx2_long_rows, .timeout = 300)
{
    matmul_long_rows(kn_ops_get(KN_ISA_AVX2), "avx2");
}
Test(kernels_quant, matmul_avx512_long_rows, .timeout = 300)
{
    matmul_long_rows(kn_ops_get(KN_ISA_AVX512), "avx512");
}

/* The AVX-512 build's driver configuration (16-row panels, 8-column tiles, 256-block k-chunks,
 * Q8_0 biased to u8) on any AVX2 machine, its primitives emulated lane by lane (emu512_avx2.c):
 * the same checks as the real builds get. */
Test(kernels_quant, matmul_avx512_emulated_matches_reference, .timeout = 300)
{
    matmul_sweep(emu512(), "avx2 to emulate avx512");
}
Test(kernels_quant, matmul_avx512_emulated_model_shapes_and_long_rows, .timeout = 300)
{
    matmul_model_shapes(emu512(), "avx2 to emulate avx512");
    matmul_long_rows(emu512(), "avx2 to emulate avx512");
}
Test(kernels_quant, matmul_avx512_emulated_rows_do_not_depend_on_the_batch, .timeout = 300)
{
    matmul_batch_invariance(emu512(), "avx2 to emulate avx512");
}

/* The reference equals the double-precision dot of the dequantized operands up to float rounding
 * (and, for Q4_1, the fp16 rounding of Q8_1's s), and is within quantization error of the dot of
 * the original floats. */
Test(kernels_quant, reference_matches_dequantized_dot_and_float_dot)
{
    for (int t = 0; t < N_WEIGHT_TYPES; t++) {
        const md_type wt = weight_types[t];
        mm_case c = {.wt = wt, .rows = 9, .m = 4, .k = block_elems(wt) == 256 ? 1024 : 576};
        c.r1 = c.rows;
        mm_data d;
        mm_data_make(&c, &d);
        float *y = mm_run(ref(), &c, &d);
        double rel_w = 0, rel_x = 0;
        for (int64_t r = 0; r < c.rows; r++)
            for (int i = 0; i < c.m; i++) {
                const float *w = d.wdq + r * c.k, *x = d.xdq + (int64_t)i * c.k;
                const float *wf = d.wf + r * c.k, *xf = d.xf + (int64_t)i * c.k;
                double dq = 0, exact = 0, nw = 0, nx = 0, ndw = 0, ndx = 0, sround = 0;
                for (int64_t j = 0; j < c.k; j++) {
                    dq += (double)w[j] * x[j];
                    exact += (double)wf[j] * xf[j];
                    nw += (double)wf[j] * wf[j];
                    nx += (double)xf[j] * xf[j];
                    ndw += ((double)wf[j] - w[j]) * ((double)wf[j] - w[j]);
                    ndx += ((double)xf[j] - x[j]) * ((double)xf[j] - x[j]);
                }
                if (wt == MD_TYPE_Q4_1) /* |m| * |d * sum(q)| * 2^-11 per block */
                    for (int64_t b = 0; b < c.k / 32; b++) {
                        double sx = 0;
                        for (int j = 0; j < 32; j++) sx += x[32 * b + j];
                        sround += fabs(d.wmin[r * c.k + 32 * b]) * fabs(sx) * 0x1p-11;
                    }
                const double yv = y[(size_t)i * d.y_stride + (size_t)r];
                const double tol = 1e-5 * mm_bound(&c, &d, r, i) + sround;
                cr_assert(fabs(yv - dq) <= tol, "%s r=%lld i=%d: ref %.9g vs dequantized dot %.9g",
                          tname(wt), (long long)r, i, yv, dq, tol);
                /* Cauchy-Schwarz: |w.x - wq.xq| <= |w - wq| |x| + |wq| |x - xq| */
                const double qtol = sqrt(ndw) * sqrt(nx) + sqrt(nw + ndw) * 1.01 * sqrt(ndx) + tol;
                cr_assert(fabs(yv - exact) <= qtol, "%s r=%lld i=%d: ref %.9g vs float dot %.9g",
                          tname(wt), (long long)r, i, yv, exact);
                rel_w = fmax(rel_w, sqrt(ndw / nw));
                rel_x = fmax(rel_x, sqrt(ndx / nx));
            }
        /* and the quantizers are as good as their bit widths */
        const double max_rel_w = wt == MD_TYPE_F32    ? 0
                                 : wt == MD_TYPE_F16  ? 1e-3
                                 : wt == MD_TYPE_BF16 ? 4e-3
                                 : wt == MD_TYPE_Q8_0 ? 0.01
                                 : wt == MD_TYPE_Q6_K ? 0.04
                                                      : 0.15;
        cr_assert(rel_w <= max_rel_w, "%s: weight quantization error %.3g", tname(wt), rel_w);
        cr_assert(rel_x <= 0.02, "%s: activation quantization error %.3g", tname(wt), rel_x);
        free(y);
        mm_data_free(&d);
    }
}

/* ------------------------------------------------------------------ quantize_row */

static const md_type act_types[] = {MD_TYPE_Q8_0, MD_TYPE_Q8_1, MD_TYPE_Q8_K,
                                    MD_TYPE_F16,  MD_TYPE_BF16, MD_TYPE_F32};

/* Rows that probe the edges: ties at .5, zero blocks, signed zeros, subnormals, equal-magnitude
 * maxima of opposite sign, huge and tiny values. */
static void fill_probe_row(float *x, int64_t n, int kind)
{
    for (int64_t j = 0; j < n; j++) {
        switch (kind) {
        case 0:
            x[j] = rnd_gauss();
            break;
        case 1: /* amax 127 -> id = 1: x*id hits exact halves */
            x[j] = (j % 32 == 5) ? 127.f : (float)((int)(rnd_u32() % 253) - 126) * 0.5f;
            break;
        case 2:
            x[j] = (j / 32) % 2 ? 0.0f : -0.0f;
            break;
        case 3:
            x[j] = rnd_unif() * 1e-39f;
            break;
        case 4: /* first max-magnitude element is negative, a later one positive */
            x[j] = (j % 256 == 3) ? -3.f : (j % 256 == 200) ? 3.f : rnd_unif();
            break;
        case 5:
            x[j] = rnd_unif() * 6e4f;
            break;
        case 6:
            x[j] = rnd_unif() * 1e-6f;
            break;
        default:
            x[j] = rnd_gauss() * 1e3f * (float)(j % 3);
        }
    }
}

static void quantize_bit_identical(kn_isa isa)
{
    const kn_ops *ops = kn_ops_get(isa);
    if (!ops) cr_skip_test("this CPU lacks %s", isa_names[isa]);
    static const int64_t ns[] = {256, 512, 768, 1536, 4096};
    for (size_t t = 0; t < sizeof act_types / sizeof act_types[0]; t++)
        for (int kind = 0; kind < 8; kind++)
            for (int ni = 0; ni < 5; ni++) {
                const md_type at = act_types[t];
                int64_t n = ns[ni];
                if (block_elems(at) == 1) n += ni; /* odd lengths for the float types */
                float *x = malloc(sizeof(float) * (size_t)n);
                fill_probe_row(x, n, kind);
                const size_t nb = row_bytes(at, n);
                /* +4: a destination with only its natural alignment, and a canary before it */
                uint8_t *a = malloc(nb + 8), *b = malloc(nb + 8);
                memset(a, 0xAA, nb + 8);
                memset(b, 0x55, nb + 8);
                ref()->quantize_row(at, x, a + 4, n);
                ops->quantize_row(at, x, b + 4, n);
                cr_assert(!memcmp(a + 4, b + 4, nb), "%s quantize %s kind %d n %lld differs",
                          ops->name, tname(at), kind, (long long)n);
                cr_assert(b[3] == 0x55 && b[nb + 4] == 0x55, "%s quantize %s wrote outside",
                          ops->name, tname(at));
                free(x);
                free(a);
                free(b);
            }
}

Test(kernels_quant, quantize_row_avx2_bit_identical)
{
    quantize_bit_identical(KN_ISA_AVX2);
}
Test(kernels_quant, quantize_row_avx512_bit_identical)
{
    quantize_bit_identical(KN_ISA_AVX512);
}

Test(kernels_quant, quantize_q8_0_is_ggml_x86)
{
    /* amax 127 makes id exactly 1, so the halves show the rounding: ties go to even, as with
     * ggml's x86 quantize_row_q8_0 (_mm256_round_ps with _MM_ROUND_NEAREST). */
    float x[32] = {127.f, 0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 3.49f, -126.5f};
    kn_block_q8_0 q;
    ref()->quantize_row(MD_TYPE_Q8_0, x, &q, 32);
    static const int8_t want[9] = {127, 0, 2, 2, 0, -2, -2, 3, -126};
    for (int j = 0; j < 9; j++) cr_assert_eq(q.qs[j], want[j], "qs[%d] = %d", j, q.qs[j]);
    cr_assert_eq(q.d, f2h(1.0f));
    kn_block_q8_1 q1;
    ref()->quantize_row(MD_TYPE_Q8_1, x, &q1, 32);
    int sum = 0;
    for (int j = 0; j < 32; j++) sum += q1.qs[j];
    cr_assert_eq(sum, 127 + 0 + 2 + 2 + 0 - 2 - 2 + 3 - 126);
    cr_assert_eq(q1.s, f2h((float)sum));
    /* all-zero block */
    float z[32] = {0};
    ref()->quantize_row(MD_TYPE_Q8_1, z, &q1, 32);
    cr_assert_eq(q1.d, 0);
    cr_assert_eq(q1.s, 0);
}

Test(kernels_quant, quantize_q8_K_is_ggml)
{
    float x[256];
    for (int j = 0; j < 256; j++) x[j] = (float)(j % 17) * 0.25f - 2.f;
    x[10] = -4.f; /* first largest magnitude, negative */
    x[11] = 4.f;
    kn_block_q8_K q;
    ref()->quantize_row(MD_TYPE_Q8_K, x, &q, 256);
    /* iscale = -127/max = 31.75; d = 1/iscale */
    const float iscale = -127.f / -4.f;
    cr_assert_eq(q.d, 1 / iscale);
    cr_assert_eq(q.qs[10], -127);
    cr_assert_eq(q.qs[11], 127);
    for (int j = 0; j < 256; j++) {
        float v = iscale * x[j];
        int want = (int)nearbyintf(v);
        cr_assert_eq(q.qs[j], want > 127 ? 127 : want, "qs[%d]", j);
    }
    for (int b = 0; b < 16; b++) {
        int s = 0;
        for (int l = 0; l < 16; l++) s += q.qs[16 * b + l];
        cr_assert_eq(q.bsums[b], s);
    }
}

__attribute__((target("f16c"))) static kn_f16 hw_f2h(float f)
{
    return _cvtss_sh(f, 0);
}
__attribute__((target("f16c"))) static float hw_h2f(kn_f16 h)
{
    return _cvtsh_ss(h);
}

Test(kernels_quant, f16_conversion_matches_f16c)
{
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("f16c")) cr_skip_test("no F16C to compare with");
    for (uint32_t h = 0; h < 65536; h++) {
        float a = h2f((kn_f16)h), b = hw_h2f((kn_f16)h);
        cr_assert(!memcmp(&a, &b, 4) || (isnan(a) && isnan(b)), "h2f(%04x)", h);
    }
    for (int i = 0; i < 2000000; i++) {
        uint32_t u = rnd_u32() ^ (rnd_u32() << 16);
        if (i % 4 == 1) u = (u & 0x80000000u) | (0x33000000u + (u % 0x14800000u)); /* near half */
        if (i % 4 == 2) u = (u & 0x8000e000u) | 0x38001000u | (u & 0x07fe0000u);   /* ties */
        float f;
        memcpy(&f, &u, 4);
        cr_assert_eq(f2h(f), hw_f2h(f), "f2h(%08x)", u);
    }
    static const uint32_t special[] = {0x477fe000u, 0x477ff000u, 0x477fefffu, 0x33000000u,
                                       0x33000001u, 0x387fe000u, 0x7f800000u, 0x7fc00000u,
                                       0x7f800001u, 0xff800000u, 0x00000001u, 0x80000000u};
    for (size_t i = 0; i < sizeof special / sizeof special[0]; i++) {
        float f;
        memcpy(&f, &special[i], 4);
        cr_assert_eq(f2h(f), hw_f2h(f), "f2h(%08x)", special[i]);
    }
}

Test(kernels_quant, bf16_conversion_rounds_to_nearest_even)
{
    const float in[] = {1.0f,
                        1.00390625f /* tie, even down */,
                        1.01171875f /* tie, up */,
                        0x1.010002p+0f /* just above a tie */,
                        -2.5f,
                        0.0f};
    const kn_bf16 want[] = {0x3f80, 0x3f80, 0x3f82, 0x3f81, 0xc020, 0x0000};
    kn_bf16 got[6];
    ref()->quantize_row(MD_TYPE_BF16, in, got, 6);
    for (int i = 0; i < 6; i++) cr_assert_eq(got[i], want[i], "bf16(%g) = %04x", in[i], got[i]);
    float nan = NAN;
    ref()->quantize_row(MD_TYPE_BF16, &nan, got, 1);
    cr_assert((got[0] & 0x7f80) == 0x7f80 && (got[0] & 0x7f), "NaN stays NaN");
}

/* ------------------------------------------------------------------ dequantize_row */

Test(kernels_quant, dequantize_blocks_by_formula)
{
    kn_block_q4_0 b0 = {.d = f2h(0.5f)};
    kn_block_q4_1 b1 = {.d = f2h(0.25f), .m = f2h(-1.0f)};
    kn_block_q8_0 b8 = {.d = f2h(2.0f)};
    for (int j = 0; j < 16; j++) {
        b0.qs[j] = b1.qs[j] = (uint8_t)(j | ((15 - j) << 4));
        b8.qs[j] = (int8_t)(j - 8);
        b8.qs[j + 16] = (int8_t)(-128 + 17 * j);
    }
    float y0[32], y1[32], y8[32];
    ref()->dequantize_row(MD_TYPE_Q4_0, &b0, y0, 32);
    ref()->dequantize_row(MD_TYPE_Q4_1, &b1, y1, 32);
    ref()->dequantize_row(MD_TYPE_Q8_0, &b8, y8, 32);
    for (int j = 0; j < 16; j++) {
        cr_assert_eq(y0[j], (float)(j - 8) * 0.5f);
        cr_assert_eq(y0[j + 16], (float)(15 - j - 8) * 0.5f);
        cr_assert_eq(y1[j], (float)j * 0.25f - 1.0f);
        cr_assert_eq(y1[j + 16], (float)(15 - j) * 0.25f - 1.0f);
        cr_assert_eq(y8[j], (float)(j - 8) * 2.0f);
        cr_assert_eq(y8[j + 16], (float)(-128 + 17 * j) * 2.0f);
    }
    /* Q4_K: scale/min unpacking, from a float row quantized and dequantized within a step */
    float x[256], y[256];
    for (int j = 0; j < 256; j++) x[j] = sinf((float)j * 0.1f) * (1.0f + (float)(j / 32));
    kn_block_q4_K bk;
    quant_q4_K(x, &bk, 256);
    ref()->dequantize_row(MD_TYPE_Q4_K, &bk, y, 256);
    for (int j = 0; j < 256; j++)
        cr_assert(fabsf(x[j] - y[j]) <= 0.6f * (1.0f + (float)(j / 32)) / 15 * 2.01f + 1e-3f,
                  "q4_K x[%d] = %g, y = %g", j, x[j], y[j]);
    kn_block_q6_K b6;
    quant_q6_K(x, &b6, 256);
    ref()->dequantize_row(MD_TYPE_Q6_K, &b6, y, 256);
    for (int j = 0; j < 256; j++)
        cr_assert(fabsf(x[j] - y[j]) <= (1.0f + (float)(j / 32)) / 32 * 1.1f,
                  "q6_K x[%d] = %g, y = %g", j, x[j], y[j]);
}

static void dequantize_identical(kn_isa isa)
{
    const kn_ops *ops = kn_ops_get(isa);
    if (!ops) cr_skip_test("this CPU lacks %s", isa_names[isa]);
    static const md_type types[] = {MD_TYPE_F32,  MD_TYPE_F16,  MD_TYPE_BF16, MD_TYPE_Q4_0,
                                    MD_TYPE_Q4_1, MD_TYPE_Q8_0, MD_TYPE_Q4_K, MD_TYPE_Q6_K,
                                    MD_TYPE_Q8_1, MD_TYPE_Q8_K};
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        const int64_t n = 1536;
        const size_t nb = row_bytes(types[t], n);
        uint8_t *q = malloc(nb);
        float *x = malloc(sizeof(float) * n), *a = malloc(sizeof(float) * n),
              *b = malloc(sizeof(float) * n);
        if (types[t] == MD_TYPE_Q8_1 || types[t] == MD_TYPE_Q8_K) {
            for (int64_t j = 0; j < n; j++) x[j] = rnd_gauss();
            ref()->quantize_row(types[t], x, q, n);
        } else {
            random_weight_row(types[t], q, n);
        }
        ref()->dequantize_row(types[t], q, a, n);
        ops->dequantize_row(types[t], q, b, n);
        cr_assert(!memcmp(a, b, sizeof(float) * n), "%s dequantize %s differs", ops->name,
                  tname(types[t]));
        free(q);
        free(x);
        free(a);
        free(b);
    }
}

Test(kernels_quant, dequantize_row_avx2_identical)
{
    dequantize_identical(KN_ISA_AVX2);
}
Test(kernels_quant, dequantize_row_avx512_identical)
{
    dequantize_identical(KN_ISA_AVX512);
}

/* k = 0 is an empty dot: every ISA writes zeros over [r0, r1) and nothing else. */
Test(kernels_quant, matmul_empty_k_writes_zeros)
{
    for (int isa = 0; isa < KN_ISA_COUNT; isa++) {
        const kn_ops *ops = kn_ops_get((kn_isa)isa);
        if (!ops) continue;
        for (int t = 0; t < N_WEIGHT_TYPES; t++) {
            uint8_t w[64] = {0}, x[64] = {0};
            float y[2 * 8];
            for (int i = 0; i < 16; i++) y[i] = 7.0f;
            ops->matmul(weight_types[t], w, 0, x, 0, 0, 2, y, 8, 2, 5);
            for (int i = 0; i < 2; i++)
                for (int r = 0; r < 8; r++)
                    cr_assert_eq(y[i * 8 + r], r >= 2 && r < 5 ? 0.0f : 7.0f, "%s %s", ops->name,
                                 tname(weight_types[t]));
        }
    }
}

Test(kernels_quant, dot_types)
{
    cr_assert_eq(kn_dot_type(MD_TYPE_Q4_0), MD_TYPE_Q8_0);
    cr_assert_eq(kn_dot_type(MD_TYPE_Q8_0), MD_TYPE_Q8_0);
    cr_assert_eq(kn_dot_type(MD_TYPE_Q4_1), MD_TYPE_Q8_1);
    cr_assert_eq(kn_dot_type(MD_TYPE_Q4_K), MD_TYPE_Q8_K);
    cr_assert_eq(kn_dot_type(MD_TYPE_Q6_K), MD_TYPE_Q8_K);
    cr_assert_eq(kn_dot_type(MD_TYPE_F16), MD_TYPE_F16);
    cr_assert_eq(kn_dot_type(MD_TYPE_BF16), MD_TYPE_BF16);
    cr_assert_eq(kn_dot_type(MD_TYPE_F32), MD_TYPE_F32);
    for (int t = 0; t < N_WEIGHT_TYPES; t++) cr_assert(kn_weight_type_supported(weight_types[t]));
    cr_assert(!kn_weight_type_supported(MD_TYPE_Q5_K));
    cr_assert(!kn_weight_type_supported(MD_TYPE_Q8_1));
    cr_assert(!kn_weight_type_supported(MD_TYPE_Q2_K));
}
