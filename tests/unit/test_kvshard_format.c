/*
 * test_kvshard_format.c — KV formats end to end: the E4M3 codec, the error of each format's
 * quantization, and the attention kernels over every format (kernels/cpu/attn_kv_*.c): the
 * reference against attention computed in double from the store's own dequantized values, the
 * AVX2 and AVX-512 builds against the reference, mixed-format sequences, and the h2o mass.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/attn_kv.h"
#include "kvshard/internal.h"

Test(kvshard_format, fp8_codec_round_trips_every_finite_e4m3_value)
{
    for (int b = 0; b < 256; b++) {
        if ((b & 0x7f) == 0x7f) continue; /* the two NaN codes are never written */
        float x = kv_fp8_to_f32((uint8_t)b);
        cr_assert_eq(kv_fp8_from_f32(x), (b == 0x80 ? 0x80 : b), "byte %02x", b);
        cr_assert_float_eq(kn_kv_e4m3((uint8_t)b), x, 0.0f, "kernel and store agree on %02x", b);
    }
    cr_assert_eq(kv_fp8_from_f32(1e9f), 0x7e, "saturates at 448");
    cr_assert_eq(kv_fp8_from_f32(-1e9f), 0xfe);
    cr_assert_eq(kv_fp8_from_f32(NAN) & 0x7f, 0x7e, "NaN never becomes a NaN code");
    cr_assert_float_eq(kv_fp8_to_f32(kv_fp8_from_f32(0.3f)), 0.3125f, 0.0f);
    /* Ties to even: 1 + 1/16 lies between 1 and 1.125. */
    cr_assert_float_eq(kv_fp8_to_f32(kv_fp8_from_f32(1.0625f)), 1.0f, 0.0f);
}

/* A store of one layer, one kv head per format, filled with reproducible random K/V. */
typedef struct fx {
    kv_store *s;
    kv_seq *q;
    int hd, n;
    float *k, *v; /* [n][hd] what was written */
} fx;

static uint32_t g_rng = 1;
static float frand(void)
{
    g_rng = g_rng * 1664525u + 1013904223u;
    return ((g_rng >> 8) / 16777216.0f) * 2.0f - 1.0f;
}

static void fx_make(fx *f, kv_format fmt, int hd, int n, int pt)
{
    kv_config c = {.n_layers = 2,
                   .n_kv_heads = 1,
                   .head_dim = hd,
                   .page_tokens = pt,
                   .format = fmt,
                   .hot_bytes = (size_t)64 << 20,
                   .sync_promote = 1};
    km_errbuf err;
    cr_assert_eq(kv_store_create(&c, &f->s, &err), 0, "%s", err.msg);
    cr_assert_eq(kv_seq_create(f->s, &f->q), 0);
    f->hd = hd;
    f->n = n;
    f->k = malloc(sizeof(float) * n * hd);
    f->v = malloc(sizeof(float) * n * hd);
    for (int t = 0; t < n; t++) {
        for (int c2 = 0; c2 < hd; c2++) {
            /* a few outlier channels in K, as real keys have */
            f->k[t * hd + c2] = frand() * (c2 % 16 == 3 ? 8.0f : 1.0f);
            f->v[t * hd + c2] = frand();
        }
        cr_assert_eq(kv_seq_reserve(f->s, f->q, t + 1), 0);
        for (int l = 0; l < 2; l++) kv_seq_write(f->s, f->q, l, t, f->k + t * hd, f->v + t * hd);
    }
    cr_assert_eq(kv_seq_reserve(f->s, f->q, n), 0); /* seals full int4 pages */
}

static void fx_free(fx *f)
{
    kv_seq_destroy(f->s, f->q);
    kv_store_destroy(f->s);
    free(f->k);
    free(f->v);
}

/* Attention in double over the store's dequantized rows: the definition. */
static void attn_double(fx *f, int layer, const float *q, int n_q, float scale, float *out)
{
    int hd = f->hd;
    float *kr = malloc(sizeof(float) * hd), *vr = malloc(sizeof(float) * hd);
    for (int h = 0; h < n_q; h++) {
        double *sc = malloc(sizeof(double) * f->n), mx = -1e300, z = 0;
        for (int t = 0; t < f->n; t++) {
            kv_seq_read(f->s, f->q, layer, 0, t, kr, vr);
            double d = 0;
            for (int c = 0; c < hd; c++) d += (double)q[h * hd + c] * kr[c];
            sc[t] = d * scale;
            mx = fmax(mx, sc[t]);
        }
        double *o = calloc(hd, sizeof(double));
        for (int t = 0; t < f->n; t++) {
            double p = exp(sc[t] - mx);
            z += p;
            kv_seq_read(f->s, f->q, layer, 0, t, kr, vr);
            for (int c = 0; c < hd; c++) o[c] += p * vr[c];
        }
        for (int c = 0; c < hd; c++) out[h * hd + c] = (float)(o[c] / z);
        free(o);
        free(sc);
    }
    free(kr);
    free(vr);
}

static float max_abs_diff(const float *a, const float *b, int n)
{
    float m = 0;
    for (int i = 0; i < n; i++) m = fmaxf(m, fabsf(a[i] - b[i]));
    return m;
}

static void kernels_agree(kv_format fmt, int hd, int n, int pt)
{
    fx f;
    fx_make(&f, fmt, hd, n, pt);
    const int n_q = 3;
    float *q = malloc(sizeof(float) * n_q * hd), *ref = malloc(sizeof(float) * n_q * hd);
    float *def = malloc(sizeof(float) * n_q * hd), *fast = malloc(sizeof(float) * n_q * hd);
    for (int i = 0; i < n_q * hd; i++) q[i] = frand();
    const float scale = 1.0f / sqrtf((float)hd);
    kn_kv_view v;
    kv_seq_view(f.s, f.q, 1, 0, n, &v);
    kn_attention_kv_ref(&v, hd, q, n_q, scale, ref);
    attn_double(&f, 1, q, n_q, scale, def);
    cr_assert_leq(max_abs_diff(ref, def, n_q * hd), 2e-5f, "%s hd=%d n=%d: reference vs double",
                  kv_format_name(fmt), hd, n);
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        kn_attention_kv_avx2(&v, hd, q, n_q, scale, fast);
        cr_assert_leq(max_abs_diff(ref, fast, n_q * hd), 2e-6f, "%s avx2", kv_format_name(fmt));
    }
    if (kn_ops_get(KN_ISA_AVX512)) {
        kn_attention_kv_avx512(&v, hd, q, n_q, scale, fast);
        cr_assert_leq(max_abs_diff(ref, fast, n_q * hd), 2e-6f, "%s avx512", kv_format_name(fmt));
    }
    free(q);
    free(ref);
    free(def);
    free(fast);
    fx_free(&f);
}

Test(kvshard_format, attention_kernels_match_the_definition_for_every_format)
{
    for (int fmt = 0; fmt < KV_FORMAT_COUNT; fmt++) {
        kernels_agree((kv_format)fmt, 64, 100, 16); /* int4: 6 sealed pages + an f16 tail */
        kernels_agree((kv_format)fmt, 128, 33, 8);
        kernels_agree((kv_format)fmt, 24, 21, 4); /* odd widths take the scalar tails */
    }
}

Test(kvshard_format, f16_pages_read_by_attn_kv_equal_the_engine_kernel)
{
    fx f;
    fx_make(&f, KN_KV_F16, 64, 50, 16);
    float q[2 * 64], a[2 * 64], b[2 * 64];
    for (int i = 0; i < 128; i++) q[i] = frand();
    kn_kv_view v;
    kv_seq_view(f.s, f.q, 0, 0, 50, &v);
    kn_ops_get(KN_ISA_SCALAR)->attention(&v, 64, q, 2, 0.125f, a);
    kn_attention_kv_ref(&v, 64, q, 2, 0.125f, b);
    cr_assert_leq(max_abs_diff(a, b, 128), 1e-5f);
    fx_free(&f);
}

static float rel_rms_error(kv_format fmt, int which)
{
    fx f;
    fx_make(&f, fmt, 64, 64, 16);
    float kr[64], vr[64];
    double e = 0, z = 0;
    for (int t = 0; t < 64; t++) {
        kv_seq_read(f.s, f.q, 0, 0, t, kr, vr);
        const float *x = which ? f.v : f.k, *y = which ? vr : kr;
        for (int c = 0; c < 64; c++) {
            e += (double)(x[t * 64 + c] - y[c]) * (x[t * 64 + c] - y[c]);
            z += (double)x[t * 64 + c] * x[t * 64 + c];
        }
    }
    fx_free(&f);
    return (float)sqrt(e / z);
}

Test(kvshard_format, quantization_error_is_what_each_format_promises)
{
    cr_assert_leq(rel_rms_error(KN_KV_F16, 0), 5e-4f);
    cr_assert_leq(rel_rms_error(KN_KV_BF16, 0), 4e-3f);
    cr_assert_leq(rel_rms_error(KN_KV_INT8, 0), 0.02f);
    cr_assert_leq(rel_rms_error(KN_KV_INT8, 1), 0.01f);
    cr_assert_leq(rel_rms_error(KN_KV_FP8, 0), 0.04f);
    cr_assert_leq(rel_rms_error(KN_KV_FP8, 1), 0.04f);
    /* int4 keys per channel: the outlier channels do not flatten the others (KIVI's point). */
    cr_assert_leq(rel_rms_error(KN_KV_INT4, 0), 0.1f);
    cr_assert_leq(rel_rms_error(KN_KV_INT4, 1), 0.1f);
}

Test(kvshard_format, mixed_format_views_use_each_pages_own_format)
{
    fx f;
    fx_make(&f, KN_KV_F16, 64, 40, 16);
    cr_assert_eq(kv_store_convert(f.s, KN_KV_INT8), 3);
    /* New writes into int8, then a page converted to int4 alongside. */
    cr_assert_eq(kv_store_convert(f.s, KN_KV_FP8), 3);
    kn_kv_view v;
    kv_seq_view(f.s, f.q, 0, 0, 40, &v);
    cr_assert_eq(v.format, KN_KV_FP8);
    cr_assert_null(v.page_formats, "all pages converted: a single-format view");
    cr_assert_eq(kv_store_convert(f.s, KN_KV_INT4), 2, "the partial page stays fp8");
    kv_seq_view(f.s, f.q, 0, 0, 40, &v);
    cr_assert_not_null(v.page_formats);
    cr_assert_eq(v.page_formats[0], KN_KV_INT4);
    cr_assert_eq(v.page_formats[2], KN_KV_FP8);
    float q[64], a[64], b[64];
    for (int i = 0; i < 64; i++) q[i] = frand();
    kn_attention_kv_ref(&v, 64, q, 1, 0.125f, a);
    attn_double(&f, 0, q, 1, 0.125f, b);
    cr_assert_leq(max_abs_diff(a, b, 64), 2e-5f);
    fx_free(&f);
}

Test(kvshard_format, attention_mass_per_page_sums_to_the_number_of_heads)
{
    fx f;
    fx_make(&f, KN_KV_INT8, 64, 40, 16);
    kv_seq_policy p = {.kind = KV_SEQ_H2O, .window_pages = 1, .budget_pages = 8};
    cr_assert_eq(kv_seq_set_policy(f.s, f.q, &p), 0);
    kn_kv_view v;
    kv_seq_view(f.s, f.q, 0, 0, 40, &v);
    cr_assert_not_null(v.attn_mass);
    float q[3 * 64], o[3 * 64];
    for (int i = 0; i < 3 * 64; i++) q[i] = frand();
    kn_attention_kv_ref(&v, 64, q, 3, 0.125f, o);
    float sum = v.attn_mass[0] + v.attn_mass[1] + v.attn_mass[2];
    cr_assert_float_eq(sum, 3.0f, 1e-4f);
    fx_free(&f);
}
