/*
 * test_kvshard_format.c — KV formats end to end: the E4M3 codec, the error of each format's
 * quantization, the disk page versions of the fp8 layout, and the attention kernels over every
 * format (kernels/cpu/attn_kv_*.c): the reference against attention computed in double from the
 * store's own dequantized values, the AVX2 and AVX-512 builds (general and fp8/int8 fast paths)
 * against the reference for many head counts and shapes, every fp8/int8 code through the SIMD
 * decoders, mixed-format sequences, and the h2o mass.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

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

static int has_avx2(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* attention_multi of every table equals, bit for bit, one attention call per token over its own
 * prefix: runs of 1, 3, 8 and 11 tokens (more than the SIMD kernels take at once) ending at the
 * view's last position. */
static void multi_equals_single(const kn_kv_view *v, int hd, int n_q, float scale)
{
    static const int n_toks[] = {1, 3, 8, 11};
    for (size_t k = 0; k < sizeof n_toks / sizeof n_toks[0]; k++) {
        const int nt = n_toks[k];
        if (nt > v->n_ctx) continue;
        const size_t stride = (size_t)n_q * hd + 8; /* rows of the step's q with a gap */
        float *q = malloc(sizeof(float) * stride * nt), *a = malloc(sizeof(float) * stride * nt);
        float *one = malloc(sizeof(float) * n_q * hd);
        for (size_t i = 0; i < stride * nt; i++) q[i] = frand();
        for (int isa = 0; isa < KN_ISA_COUNT; isa++) {
            const kn_ops *o = kn_ops_get((kn_isa)isa);
            if (!o) continue;
            o->attention_multi(v, hd, q, stride, nt, n_q, scale, a, stride);
            for (int t = 0; t < nt; t++) {
                kn_kv_view w = *v;
                w.n_ctx = v->n_ctx - (nt - 1 - t);
                o->attention(&w, hd, q + t * stride, n_q, scale, one);
                cr_assert(!memcmp(one, a + t * stride, sizeof(float) * n_q * hd),
                          "%s %s hd=%d n_ctx=%d n_q=%d: token %d of %d differs from its own call",
                          o->name, kv_format_name(v->format), hd, v->n_ctx, n_q, t, nt);
            }
        }
        free(q), free(a), free(one);
    }
}

/* Whether a SIMD build whose vectors hold `lanes` floats runs the view on its blocked path:
 * every view of these widths, int4 (sealed pages and the f16 tail of the last one) included. */
static int blocked_takes(const kn_kv_view *v, int hd, int n, int pt, int lanes)
{
    int takes = hd % lanes == 0;
    for (int pg = 0; pg < (n + pt - 1) / pt; pg++) {
        const kv_format pf = v->page_formats ? (kv_format)v->page_formats[pg] : v->format;
        takes &= pf == KN_KV_INT4                      ? hd % 32 == 0
                 : pf == KN_KV_F16 || pf == KN_KV_BF16 ? 1
                                                       : hd % 16 == 0;
    }
    return takes;
}

/* n_q query heads (q scaled by q_mul: large values make the softmax peaky, so that the running
 * maximum moves and the rescaling paths run) over the layer-1 view of n positions. */
static void kernels_agree_q(kv_format fmt, int hd, int n, int pt, int n_q, float q_mul)
{
    fx f;
    fx_make(&f, fmt, hd, n, pt);
    float *q = malloc(sizeof(float) * n_q * hd), *ref = malloc(sizeof(float) * n_q * hd);
    float *def = malloc(sizeof(float) * n_q * hd), *fast = malloc(sizeof(float) * n_q * hd);
    for (int i = 0; i < n_q * hd; i++) q[i] = frand() * q_mul;
    const float scale = 1.0f / sqrtf((float)hd);
    kn_kv_view v;
    kv_seq_view(f.s, f.q, 1, 0, n, &v);
    kn_attention_kv_ref(&v, hd, q, n_q, scale, ref);
    attn_double(&f, 1, q, n_q, scale, def);
    cr_assert_leq(max_abs_diff(ref, def, n_q * hd), 2e-5f,
                  "%s hd=%d n=%d pt=%d n_q=%d: reference vs double", kv_format_name(fmt), hd, n, pt,
                  n_q);
    float *disp = malloc(sizeof(float) * n_q * hd);
    /* 2e-6 of the outputs' magnitude (int4's values reach a few units: n * scale + min), times
     * q_mul / 4 for peaky softmaxes, whose float error grows with the scores: with q_mul 12 the
     * reference and the SIMD builds, row path and blocked path alike, differ by 1e-6 to 6e-6
     * depending on the random draw */
    float tol = 0.0f;
    for (int i = 0; i < n_q * hd; i++) tol = fmaxf(tol, fabsf(ref[i]));
    tol = 2e-6f * fmaxf(1.0f, tol) * fmaxf(1.0f, q_mul / 4.0f);
    if (has_avx2()) {
        const int takes = blocked_takes(&v, hd, n, pt, 8);
        cr_assert_eq(kn_att_fast_avx2(&v, hd, q, n_q, scale, fast), takes,
                     "%s hd=%d: the avx2 blocked path %s the view", kv_format_name(fmt), hd,
                     takes ? "refuses" : "takes");
        kn_attention_kv_avx2(&v, hd, q, n_q, scale, fast);
        cr_assert_leq(max_abs_diff(ref, fast, n_q * hd), tol, "%s avx2 hd=%d n=%d pt=%d n_q=%d",
                      kv_format_name(fmt), hd, n, pt, n_q);
        kn_ops_get(KN_ISA_AVX2)->attention(&v, hd, q, n_q, scale, disp);
        cr_assert(!kn_attention_kv_wants(&v) || !memcmp(disp, fast, sizeof(float) * n_q * hd),
                  "the avx2 table dispatches here");
    }
    if (kn_ops_get(KN_ISA_AVX512)) {
        const int takes = blocked_takes(&v, hd, n, pt, 16);
        cr_assert_eq(kn_att_fast_avx512(&v, hd, q, n_q, scale, fast), takes,
                     "%s hd=%d: the avx512 blocked path %s the view", kv_format_name(fmt), hd,
                     takes ? "refuses" : "takes");
        kn_attention_kv_avx512(&v, hd, q, n_q, scale, fast);
        cr_assert_leq(max_abs_diff(ref, fast, n_q * hd), tol, "%s avx512 hd=%d n=%d pt=%d n_q=%d",
                      kv_format_name(fmt), hd, n, pt, n_q);
        kn_ops_get(KN_ISA_AVX512)->attention(&v, hd, q, n_q, scale, disp);
        cr_assert(!kn_attention_kv_wants(&v) || !memcmp(disp, fast, sizeof(float) * n_q * hd),
                  "the avx512 table dispatches here");
    }
    multi_equals_single(&v, hd, n_q, scale);
    free(disp);
    free(q);
    free(ref);
    free(def);
    free(fast);
    fx_free(&f);
}

static void kernels_agree(kv_format fmt, int hd, int n, int pt)
{
    kernels_agree_q(fmt, hd, n, pt, 3, 1.0f);
}

Test(kvshard_format, attention_kernels_match_the_definition_for_every_format)
{
    for (int fmt = 0; fmt < KV_FORMAT_COUNT; fmt++) {
        kernels_agree((kv_format)fmt, 64, 100, 16); /* int4: 6 sealed pages + an f16 tail */
        kernels_agree((kv_format)fmt, 128, 33, 8);
        kernels_agree((kv_format)fmt, 24, 21, 4); /* odd widths take the scalar tails */
    }
}

/* The fp8/int8/int4 fast paths: every query-head grouping (1-4 per pass, more than the 32 kept
 * at once), blocks cut short by the page (page_tokens 4 and 8 < one block) and by n_ctx, head
 * sizes that leave the 64-wide V loop a 16- or 48-channel tail, one position, and peaky
 * softmaxes. int4 views mix sealed int4 pages with the f16 page still filling; the blocked path
 * takes those of head_dim % 32 == 0 (the others keep the row path, also held here). */
Test(kvshard_format, quantized_fast_paths_match_the_reference_in_every_shape)
{
    static const int n_qs[] = {1, 2, 3, 4, 5, 8, 9, 33};
    static const struct {
        int hd, n, pt;
    } shapes[] = {{64, 100, 16}, {64, 1, 16},  {16, 37, 4},  {32, 70, 64},
                  {48, 50, 16},  {80, 19, 32}, {128, 33, 8}, {112, 45, 2}};
    static const kv_format fmts[] = {KN_KV_FP8, KN_KV_INT8, KN_KV_INT4};
    for (int fi = 0; fi < 3; fi++)
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
            for (size_t qi = 0; qi < sizeof n_qs / sizeof n_qs[0]; qi++)
                kernels_agree_q(fmts[fi], shapes[si].hd, shapes[si].n, shapes[si].pt, n_qs[qi],
                                1.0f);
    for (int fi = 0; fi < 3; fi++) {
        kernels_agree_q(fmts[fi], 64, 100, 16, 3, 12.0f);
        kernels_agree_q(fmts[fi], 128, 60, 16, 5, 12.0f);
    }
}

/* Attention over one position is that position's V row, exactly: so every byte value of an fp8
 * or int8 V row, under scales from subnormal to large, comes out of each SIMD decoder equal to
 * the reference's value and to the store's own decoding. */
Test(kvshard_format, simd_decoders_give_every_fp8_and_int8_code_exactly)
{
    static const float scales[] = {1.0f, 3.0e-3f, 6.0e-8f, 1.5e3f, 0.7f};
    for (int fmt = KN_KV_FP8; fmt <= KN_KV_INT8; fmt++) {
        fx f;
        fx_make(&f, (kv_format)fmt, 64, 16, 16);
        kn_kv_view v;
        kv_seq_view(f.s, f.q, 0, 0, 1, &v);
        uint8_t *page = (uint8_t *)v.pages[0];
        float q[64], ref[64], fast[64], kr[64], vr[64];
        for (int i = 0; i < 64; i++) q[i] = frand();
        for (int blk = 0; blk < 4; blk++)
            for (size_t si = 0; si < sizeof scales / sizeof scales[0]; si++) {
                for (int c = 0; c < 64; c++) page[v.v_off + c] = (uint8_t)(blk * 64 + c);
                for (int g = 0; g < 4; g++) { /* a different scale per group */
                    kn_f16 h = kn_f32_to_f16(scales[(si + g) % 5]);
                    memcpy(page + v.v_scale_off + 2 * g, &h, 2);
                }
                kv_seq_read(f.s, f.q, 0, 0, 0, kr, vr);
                kn_attention_kv_ref(&v, 64, q, 1, 0.125f, ref);
                for (int c = 0; c < 64; c++)
                    cr_assert(ref[c] == vr[c] || (isnan(ref[c]) && isnan(vr[c])),
                              "%s code %02x: reference %g, store %g", kv_format_name(fmt),
                              blk * 64 + c, ref[c], vr[c]);
                for (int isa = 0; isa < 2; isa++) {
                    if (isa == 0 && !has_avx2()) continue;
                    if (isa == 1 && !kn_ops_get(KN_ISA_AVX512)) continue;
                    (isa ? kn_attention_kv_avx512 : kn_attention_kv_avx2)(&v, 64, q, 1, 0.125f,
                                                                          fast);
                    for (int c = 0; c < 64; c++)
                        cr_assert(ref[c] == fast[c], "%s %s code %02x scale %g: %g vs %g",
                                  kv_format_name(fmt), isa ? "avx512" : "avx2", blk * 64 + c,
                                  scales[(si + c / 16) % 5], fast[c], ref[c]);
                }
            }
        fx_free(&f);
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

/* One key channel 3000 times larger than the rest: with a scale per 16 channels it sets the step
 * of its own group only, and every other channel keeps E4M3's relative precision (half a step of
 * a 3-bit mantissa, 1/16), down to values far below the outlier. */
Test(kvshard_format, fp8_outlier_channel_blurs_only_its_own_group)
{
    kv_config c = {.n_layers = 1,
                   .n_kv_heads = 1,
                   .head_dim = 64,
                   .page_tokens = 16,
                   .format = KN_KV_FP8,
                   .hot_bytes = (size_t)1 << 20};
    km_errbuf err;
    kv_store *s;
    kv_seq *q;
    cr_assert_eq(kv_store_create(&c, &s, &err), 0, "%s", err.msg);
    cr_assert_eq(kv_seq_create(s, &q), 0);
    cr_assert_eq(kv_seq_reserve(s, q, 1), 0);
    float k[64], v[64], kr[64], vr[64];
    for (int i = 0; i < 64; i++) {
        k[i] = frand() * (i < 32 ? 1.0f : 0.01f); /* small values stay out of the subnormals */
        v[i] = frand();
    }
    k[3] = 3000.0f;
    kv_seq_write(s, q, 0, 0, k, v);
    cr_assert_eq(kv_seq_read(s, q, 0, 0, 0, kr, vr), 0);
    for (int i = 16; i < 64; i++)
        cr_assert_leq(fabsf(kr[i] - k[i]), fabsf(k[i]) / 16 + 1e-6f, "channel %d: %g -> %g", i,
                      k[i], kr[i]);
    cr_assert_leq(fabsf(kr[3] - k[3]), 3000.0f / 16);
    kv_seq_destroy(s, q);
    kv_store_destroy(s);
}

/* Disk page version 2 changed the fp8 layout (a scale per 16 channels instead of per row): a
 * version 1 fp8 file is refused even with a valid checksum and a size that matches (head_dim 16,
 * where both layouts have one scale per row); version 1 files of the other formats, whose
 * layout did not change, are still read. */
Test(kvshard_format, disk_pages_of_the_old_fp8_layout_are_refused)
{
    for (int fmt = 0; fmt < KV_FORMAT_COUNT; fmt++) {
        kv_layout lay;
        kv_layout_init(&lay, (kv_format)fmt, 16, 16, 2, 1);
        uint8_t tokens[16 * 4] = {0};
        uint8_t *payload = calloc(1, lay.page_bytes);
        kv_disk_page p = {.format = (kv_format)fmt,
                          .page_tokens = 16,
                          .n_layers = 2,
                          .n_kv_heads = 1,
                          .head_dim = 16,
                          .hash = {1, 2},
                          .tokens = tokens,
                          .payload = payload,
                          .payload_bytes = lay.page_bytes};
        size_t n = kv_disk_page_size(lay.page_bytes, 16);
        uint8_t *buf = malloc(n);
        cr_assert_eq(kv_disk_page_encode(&p, buf, n), n);
        kv_disk_page d;
        cr_assert_eq(kv_disk_page_parse(buf, n, &d), 0, "%s: version 2 reads back",
                     kv_format_name((kv_format)fmt));
        cr_assert_eq(buf[8], 2);
        buf[8] = 1; /* a version 1 file, checksum made valid again */
        uint64_t h = XXH3_64bits(buf, n - 8);
        for (int i = 0; i < 8; i++) buf[n - 8 + i] = (uint8_t)(h >> (8 * i));
        cr_assert_eq(kv_disk_page_parse(buf, n, &d), fmt == KN_KV_FP8 ? KM_EFORMAT : 0,
                     "%s: version 1", kv_format_name((kv_format)fmt));
        buf[8] = 3;
        h = XXH3_64bits(buf, n - 8);
        for (int i = 0; i < 8; i++) buf[n - 8 + i] = (uint8_t)(h >> (8 * i));
        cr_assert_eq(kv_disk_page_parse(buf, n, &d), KM_EFORMAT, "unknown versions are refused");
        free(buf);
        free(payload);
    }
}

/* Persists two published pages of `fmt` to a disk tier, rewrites every page file as version 1
 * (checksum made valid), reopens the store: returns the pages it then serves; *corrupt gets the
 * pages it refused. */
static int pages_served_from_version1_files(kv_format fmt, uint64_t *corrupt)
{
    char dir[] = "/tmp/kvfmt-XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    kv_config c = {.n_layers = 2,
                   .n_kv_heads = 1,
                   .head_dim = 16,
                   .page_tokens = 4,
                   .format = fmt,
                   .hot_bytes = (size_t)1 << 20,
                   .disk_dir = dir,
                   .sync_promote = 1};
    km_errbuf err;
    kv_store *s;
    kv_seq *q;
    int32_t t[8];
    km_pagehash h[2];
    for (int i = 0; i < 8; i++) t[i] = 100 + i;
    km_pagehash_chain(km_pagehash_seed("m", 1, 9, NULL, 0), t, 8, 4, h, 2);
    cr_assert_eq(kv_store_create(&c, &s, &err), 0, "%s", err.msg);
    cr_assert_eq(kv_seq_create(s, &q), 0);
    cr_assert_eq(kv_seq_reserve(s, q, 8), 0);
    float k[16];
    for (int p = 0; p < 8; p++)
        for (int l = 0; l < 2; l++) {
            for (int i = 0; i < 16; i++) k[i] = frand();
            kv_seq_write(s, q, l, p, k, k);
        }
    cr_assert_eq(kv_seq_publish(s, q, h, t, 8), 2);
    kv_seq_destroy(s, q);
    cr_assert_eq(kv_store_persist(s, 0), 2);
    kv_store_destroy(s);

    DIR *d = opendir(dir);
    struct dirent *e;
    int files = 0;
    while ((e = readdir(d))) {
        if (!strstr(e->d_name, ".kvp")) continue;
        char path[512];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        FILE *f = fopen(path, "r+b");
        cr_assert_not_null(f);
        uint8_t buf[8192];
        size_t n = fread(buf, 1, sizeof buf, f);
        cr_assert(n > 88 && n < sizeof buf);
        cr_assert_eq(buf[8], 2, "written as version 2");
        buf[8] = 1;
        uint64_t x = XXH3_64bits(buf, n - 8);
        for (int i = 0; i < 8; i++) buf[n - 8 + i] = (uint8_t)(x >> (8 * i));
        rewind(f);
        cr_assert_eq(fwrite(buf, 1, n, f), n);
        fclose(f);
        files++;
    }
    closedir(d);
    cr_assert_eq(files, 2);

    cr_assert_eq(kv_store_create(&c, &s, &err), 0, "%s", err.msg);
    const int n = kv_store_lookup(s, h, t, 2, NULL);
    kv_store_stats st;
    kv_store_stats_get(s, &st);
    *corrupt = st.corrupt_pages;
    kv_store_destroy(s);
    d = opendir(dir);
    while ((e = readdir(d))) {
        char path[512];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (e->d_name[0] != '.') unlink(path);
    }
    closedir(d);
    rmdir(dir);
    return n;
}

Test(kvshard_format, a_restarted_store_drops_old_fp8_disk_pages_and_reads_old_f16_ones)
{
    uint64_t corrupt;
    cr_assert_eq(pages_served_from_version1_files(KN_KV_FP8, &corrupt), 0);
    cr_assert_eq(corrupt, 2, "both version 1 fp8 pages refused and counted");
    cr_assert_eq(pages_served_from_version1_files(KN_KV_F16, &corrupt), 2);
    cr_assert_eq(corrupt, 0);
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

/* kv_page_finite reads eight bytes at a time: held to a plain loop over every value and scale of
 * a page of each format, with one infinity or NaN planted at every position in turn. */
static int finite_ref(const kv_layout *L, const uint8_t *page, kv_format f)
{
    if (f == KN_KV_F16 || f == KN_KV_BF16) {
        uint16_t m = f == KN_KV_F16 ? 0x7c00 : 0x7f80;
        for (size_t i = 0; i + 1 < L->page_bytes; i += 2)
            if (((page[i] | page[i + 1] << 8) & m) == m) return 0;
        return 1;
    }
    for (size_t u = 0; u < L->page_bytes / L->unit; u++) {
        const uint8_t *p = page + u * L->unit;
        for (size_t i = L->kd + L->vd; i + 1 < L->unit; i += 2)
            if (((p[i] | p[i + 1] << 8) & 0x7c00) == 0x7c00) return 0;
        for (size_t i = 0; f == KN_KV_FP8 && i < L->kd + L->vd; i++)
            if ((p[i] & 0x7f) == 0x7f) return 0;
    }
    return 1;
}

Test(kvshard_format, a_page_with_an_infinity_or_a_nan_anywhere_is_not_finite)
{
    const kv_format fmts[] = {KN_KV_F16, KN_KV_BF16, KN_KV_FP8, KN_KV_INT8, KN_KV_INT4};
    for (int k = 0; k < 5; k++) {
        kv_config c = {.n_layers = 2,
                       .n_kv_heads = 1,
                       .head_dim = 64,
                       .page_tokens = 4,
                       .format = fmts[k],
                       .hot_bytes = (size_t)8 << 20};
        kv_store *s;
        km_errbuf err;
        cr_assert_eq(kv_store_create(&c, &s, &err), 0, "%s", err.msg);
        const kv_layout *L = &s->lay[fmts[k]];
        uint8_t *page = malloc(L->page_bytes);
        for (size_t i = 0; i < L->page_bytes; i++) page[i] = (uint8_t)(i * 37 % 97); /* finite */
        cr_assert(kv_page_finite(s, page, fmts[k]) && finite_ref(L, page, fmts[k]));
        const uint8_t odd[4][2] = {{0x00, 0x7c}, {0x01, 0xfc}, {0x80, 0x7f}, {0x7f, 0x00}};
        for (size_t i = 0; i + 1 < L->page_bytes; i++) {
            for (int o = 0; o < 4; o++) {
                uint8_t a = page[i], b = page[i + 1];
                page[i] = odd[o][0];
                page[i + 1] = odd[o][1];
                cr_assert_eq(kv_page_finite(s, page, fmts[k]), finite_ref(L, page, fmts[k]),
                             "format %d, bytes %02x %02x at %zu", k, odd[o][0], odd[o][1], i);
                page[i] = a;
                page[i + 1] = b;
            }
        }
        free(page);
        kv_store_destroy(s);
    }
}
