/*
 * test_kernels_ops.c — the non-matmul kernels of kernels.h: the scalar references against
 * independent double-precision formulas, and every AVX2 / AVX-512 kernel against the reference
 * (odd sizes, tails, special values). Attention is checked against a naive double-precision
 * softmax over a contiguous copy of the context, with pages scattered in memory, partial last
 * pages poisoned with NaN, and every head/format/page-size combination the kernels branch on.
 *
 * An instruction set this CPU lacks is skipped with a message. Attention's throughput is a
 * benchmark, not a test: `build/bench/bench_kernels -a` prints it.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t */
#include <xxhash.h>

#include "kernels/kernels.h"

/* ---------------------------------------------------------------- helpers */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static void rng_seed(uint64_t s)
{
    rng_state = s * 0x9E3779B97F4A7C15ull + 1;
}

static uint64_t rng_u64(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* Uniform in [lo, hi). */
static float rng_f(float lo, float hi)
{
    return lo + (hi - lo) * (float)((rng_u64() >> 40) * 0x1.0p-24);
}

static float bits_f(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint32_t f_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static const int sizes[] = {1, 7, 15, 16, 17, 63, 64, 65, 576, 1000};
#define N_SIZES ((int)(sizeof sizes / sizeof sizes[0]))

static const kn_ops *need(kn_isa isa)
{
    const kn_ops *o = kn_ops_get(isa);
    if (!o) cr_skip_test("this CPU lacks %s; skipped", isa == KN_ISA_AVX2 ? "AVX2" : "AVX-512");
    return o;
}

/* |a - b| <= rtol * max(|b|, scale) for every element. */
static void expect_close(const float *a, const float *b, int n, float rtol, float scale,
                         const char *what)
{
    for (int i = 0; i < n; i++) {
        float tol = rtol * fmaxf(fabsf(b[i]), scale);
        if (!(fabsf(a[i] - b[i]) <= tol) && !(isnan(a[i]) && isnan(b[i])) && !(a[i] == b[i])) {
            cr_assert_fail("%s: element %d of %d: got %.9g want %.9g (tol %.3g)", what, i, n, a[i],
                           b[i], tol);
        }
    }
}

/* Each SIMD test body exists once, as fn(ops), and runs as one test per instruction set. */
#define SIMD_TEST(name)                                                                            \
    static void name##_body(const kn_ops *o);                                                      \
    Test(avx2, name)                                                                               \
    {                                                                                              \
        name##_body(need(KN_ISA_AVX2));                                                            \
    }                                                                                              \
    Test(avx512, name)                                                                             \
    {                                                                                              \
        name##_body(need(KN_ISA_AVX512));                                                          \
    }                                                                                              \
    static void name##_body(const kn_ops *o)

Test(dispatch, scalar_table_always_exists_and_best_is_supported)
{
    const kn_ops *r = kn_ops_get(KN_ISA_SCALAR);
    cr_assert_not_null(r);
    cr_assert_eq(r->isa, KN_ISA_SCALAR);
    const kn_ops *b = kn_ops_best();
    cr_assert_not_null(b);
    cr_assert_eq(kn_ops_get(b->isa), b);
}

/* ---------------------------------------------------------------- rmsnorm */

Test(ref, rmsnorm_matches_double_formula)
{
    const kn_ops *r = kn_ops_get(KN_ISA_SCALAR);
    rng_seed(1);
    for (int si = 0; si < N_SIZES; si++) {
        int n = sizes[si];
        float *x = malloc(sizeof(float) * n), *w = malloc(sizeof(float) * n),
              *y = malloc(sizeof(float) * n);
        float *want = malloc(sizeof(float) * n);
        for (int i = 0; i < n; i++) {
            x[i] = rng_f(-3, 3);
            w[i] = rng_f(-1.5f, 1.5f);
        }
        double ss = 0;
        for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
        double sc = 1.0 / sqrt(ss / n + 1e-5);
        for (int i = 0; i < n; i++) want[i] = (float)(x[i] * sc * w[i]);
        r->rmsnorm(y, x, w, n, 1e-5f);
        expect_close(y, want, n, 1e-6f, 1e-30f, "rmsnorm ref vs double");
        /* In place. */
        r->rmsnorm(x, x, w, n, 1e-5f);
        cr_assert_eq(memcmp(x, y, sizeof(float) * n), 0, "in-place rmsnorm differs");
        free(x), free(w), free(y), free(want);
    }
}

SIMD_TEST(rmsnorm_matches_ref)
{
    const kn_ops *r = kn_ops_get(KN_ISA_SCALAR);
    rng_seed(2);
    for (int si = 0; si < N_SIZES; si++) {
        int n = sizes[si];
        float *x = malloc(sizeof(float) * n), *w = malloc(sizeof(float) * n);
        float *y0 = malloc(sizeof(float) * n), *y1 = malloc(sizeof(float) * n);
        for (int i = 0; i < n; i++) {
            x[i] = rng_f(-4, 4) * (i % 5 == 0 ? 100.0f : 1.0f);
            w[i] = rng_f(-2, 2);
        }
        r->rmsnorm(y0, x, w, n, 1e-6f);
        o->rmsnorm(y1, x, w, n, 1e-6f);
        expect_close(y1, y0, n, 1e-6f, 1e-30f, "rmsnorm");
        o->rmsnorm(x, x, w, n, 1e-6f); /* in place */
        cr_assert_eq(memcmp(x, y1, sizeof(float) * n), 0, "in-place rmsnorm differs (n=%d)", n);
        free(x), free(w), free(y0), free(y1);
    }
}

/* ---------------------------------------------------------------- rope */

Test(ref, rope_cache_is_ggml_float_iteration)
{
    const int n_rots[] = {2, 32, 64, 128};
    const int poss[] = {0, 1, 7, 100, 4095, 100000};
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 6; b++) {
            int n_rot = n_rots[a], pos = poss[b];
            float cs[128];
            kn_rope_cache(cs, n_rot, pos, 10000.0f);
            /* ggml_rope_cache_init with freq_scale 1, ext_factor 0, mscale 1. */
            float theta = (float)pos, ts = powf(10000.0f, -2.0f / n_rot);
            for (int i = 0; i < n_rot / 2; i++) {
                cr_assert_eq(f_bits(cs[2 * i]), f_bits(cosf(theta)), "cos n_rot=%d pos=%d i=%d",
                             n_rot, pos, i);
                cr_assert_eq(f_bits(cs[2 * i + 1]), f_bits(sinf(theta)), "sin n_rot=%d pos=%d i=%d",
                             n_rot, pos, i);
                /* And close to the exact angle: the float iteration loses ~i/2 ulp of theta. */
                double exact = pos * pow(10000.0, -2.0 * i / n_rot);
                double tol = 1e-6 + (i + 1) * 0x1.0p-24 * exact;
                cr_assert_leq(fabs(cs[2 * i] - cos(exact)), tol, "cos far from exact (pos=%d i=%d)",
                              pos, i);
                cr_assert_leq(fabs(cs[2 * i + 1] - sin(exact)), tol,
                              "sin far from exact (pos=%d i=%d)", pos, i);
                theta *= ts;
            }
        }
}

/* Rotation with an exact (double) cache rounded to float, against the rotation in double. */
Test(ref, rope_rotates_like_double_formula_both_modes)
{
    const kn_ops *r = kn_ops_get(KN_ISA_SCALAR);
    rng_seed(3);
    const int head_dim = 64, n_heads = 3;
    const int n_rots[] = {64, 32, 2};
    for (int a = 0; a < 3; a++)
        for (int neox = 0; neox < 2; neox++) {
            int n_rot = n_rots[a], pos = 37;
            float cs[64], x[3 * 64], x0[3 * 64];
            double dc[32], ds[32];
            for (int i = 0; i < n_rot / 2; i++) {
                double th = pos * pow(10000.0, -2.0 * i / n_rot);
                dc[i] = cos(th), ds[i] = sin(th);
                cs[2 * i] = (float)dc[i], cs[2 * i + 1] = (float)ds[i];
            }
            for (int i = 0; i < n_heads * head_dim; i++) x[i] = x0[i] = rng_f(-2, 2);
            r->rope(x, n_heads, head_dim, n_rot, cs, neox);
            for (int h = 0; h < n_heads; h++) {
                const float *in = x0 + h * head_dim, *got = x + h * head_dim;
                for (int i = 0; i < n_rot / 2; i++) {
                    int ia = neox ? i : 2 * i, ib = neox ? i + n_rot / 2 : 2 * i + 1;
                    double c = cs[2 * i], s = cs[2 * i + 1];
                    double wa = in[ia] * c - in[ib] * s, wb = in[ia] * s + in[ib] * c;
                    double tol = 1e-6 * (fabs(in[ia]) + fabs(in[ib]));
                    cr_assert_leq(fabs(got[ia] - wa), tol, "rope neox=%d n_rot=%d h=%d i=%d", neox,
                                  n_rot, h, i);
                    cr_assert_leq(fabs(got[ib] - wb), tol, "rope neox=%d n_rot=%d h=%d i=%d", neox,
                                  n_rot, h, i);
                }
                for (int d = n_rot; d < head_dim; d++)
                    cr_assert_eq(f_bits(got[d]), f_bits(in[d]),
                                 "dimension %d >= n_rot=%d was touched", d, n_rot);
            }
        }
}

/* Normal mode on (x0,x1,x2,x3,...) equals NeoX mode on the same pairs laid out as halves. */
Test(ref, rope_normal_and_neox_differ_only_in_pairing)
{
    const kn_ops *r = kn_ops_get(KN_ISA_SCALAR);
    rng_seed(4);
    const int hd = 64, n_rot = 48, half = 24;
    float cs[64], a[64], b[64];
    kn_rope_cache(cs, n_rot, 1234, 10000.0f);
    for (int i = 0; i < hd; i++) a[i] = rng_f(-1, 1);
    for (int i = 0; i < half; i++) b[i] = a[2 * i], b[i + half] = a[2 * i + 1];
    for (int i = n_rot; i < hd; i++) b[i] = a[i];
    r->rope(a, 1, hd, n_rot, cs, 0);
    r->rope(b, 1, hd, n_rot, cs, 1);
    for (int i = 0; i < half; i++) {
        cr_assert_eq(f_bits(a[2 * i]), f_bits(b[i]));
        cr_assert_eq(f_bits(a[2 * i + 1]), f_bits(b[i + half]));
    }
    for (int i = n_rot; i < hd; i++) cr_assert_eq(f_bits(a[i]), f_bits(b[i]));
    /* The two modes really are different rotations of the same vector. */
    float c[64];
    for (int i = 0; i < hd; i++) c[i] = (float)i - 30.0f;
    float d[64];
    memcpy(d, c, sizeof c);
    r->rope(c, 1, hd, n_rot, cs, 0);
    r->rope(d, 1, hd, n_rot, cs, 1);
    cr_assert_neq(memcmp(c, d, sizeof c), 0);
}

SIMD_TEST(rope_matches_ref)
{
    const kn_ops *r = kn_ops_get(KN_ISA_SCALAR);
    rng_seed(5);
    const int n_rots[] = {2, 14, 16, 18, 32, 34, 48, 64, 96, 128};
    for (int a = 0; a < 10; a++)
        for (int extra = 0; extra <= 6; extra += 6)
            for (int neox = 0; neox < 2; neox++) {
                const int n_rot = n_rots[a], hd = n_rot + extra, nh = 3;
                float cs[128], x0[3 * 134], x1[3 * 134];
                kn_rope_cache(cs, n_rot, 517, 500000.0f);
                for (int i = 0; i < nh * hd; i++) x0[i] = x1[i] = rng_f(-3, 3);
                r->rope(x0, nh, hd, n_rot, cs, neox);
                o->rope(x1, nh, hd, n_rot, cs, neox);
                for (int i = 0; i < nh * hd; i++) {
                    /* The fast paths fuse one product into an FMA: compare at the inputs' scale. */
                    cr_assert_leq(fabsf(x1[i] - x0[i]), 1e-6f * 6.0f,
                                  "rope n_rot=%d hd=%d neox=%d i=%d: %g vs %g", n_rot, hd, neox, i,
                                  x1[i], x0[i]);
                    if ((i % hd) >= n_rot) cr_assert_eq(f_bits(x1[i]), f_bits(x0[i]));
                }
            }
}

/* ---------------------------------------------------------------- silu_mul, add */

Test(ref, silu_mul_is_swiglu)
{
    const kn_ops *r = kn_ops_get(KN_ISA_SCALAR);
    const float g[] = {0.0f, 1.0f, -1.0f, 10.0f, -10.0f, 100.0f, -100.0f, 0.5f};
    float u[8], y[8];
    for (int i = 0; i < 8; i++) u[i] = 1.5f;
    r->silu_mul(y, g, u, 8);
    for (int i = 0; i < 8; i++) {
        double want = g[i] / (1.0 + exp(-(double)g[i])) * 1.5;
        cr_assert_leq(fabs(y[i] - want), 1e-6 * fabs(want) + 1e-30, "silu(%g)", g[i]);
    }
}

SIMD_TEST(silu_mul_matches_ref)
{
    const kn_ops *r = kn_ops_get(KN_ISA_SCALAR);
    rng_seed(6);
    const float special[] = {0.0f,   -0.0f,  88.0f,   -88.0f, 88.8f,   -88.8f, 90.0f,
                             -90.0f, 103.0f, -103.0f, 110.0f, -110.0f, 1e-30f, -1e-30f,
                             20.0f,  -20.0f, 87.3f,   -87.4f, 1e6f,    -1e6f};
    for (int si = 0; si < N_SIZES; si++) {
        int n = sizes[si];
        float *g = malloc(sizeof(float) * n), *u = malloc(sizeof(float) * n);
        float *y0 = malloc(sizeof(float) * n), *y1 = malloc(sizeof(float) * n);
        for (int i = 0; i < n; i++) {
            g[i] = i < 20 && n > 20 ? special[i] : rng_f(-12, 12);
            u[i] = rng_f(-3, 3);
        }
        r->silu_mul(y0, g, u, n);
        o->silu_mul(y1, g, u, n);
        expect_close(y1, y0, n, 1e-6f, 1e-35f, "silu_mul");
        free(g), free(u), free(y0), free(y1);
    }
}

SIMD_TEST(add_matches_ref_exactly)
{
    rng_seed(7);
    for (int si = 0; si < N_SIZES; si++) {
        int n = sizes[si];
        float *x = malloc(sizeof(float) * n), *y = malloc(sizeof(float) * n),
              *w = malloc(sizeof(float) * n);
        for (int i = 0; i < n; i++) x[i] = rng_f(-5, 5), y[i] = w[i] = rng_f(-5, 5);
        o->add(y, x, n);
        for (int i = 0; i < n; i++)
            cr_assert_eq(f_bits(y[i]), f_bits(w[i] + x[i]), "add n=%d i=%d", n, i);
        free(x), free(y), free(w);
    }
}

/* ---------------------------------------------------------------- conversions */

Test(ref, f16_to_f32_known_values_and_round_trip)
{
    cr_assert_eq(kn_f16_to_f32(0x3c00), 1.0f);
    cr_assert_eq(kn_f16_to_f32(0xc000), -2.0f);
    cr_assert_eq(kn_f16_to_f32(0x7bff), 65504.0f);
    cr_assert_eq(kn_f16_to_f32(0x0001), 0x1.0p-24f);
    cr_assert_eq(kn_f16_to_f32(0x03ff), 0x1.ff8p-15f);
    cr_assert_eq(kn_f16_to_f32(0x0400), 0x1.0p-14f);
    cr_assert_eq(f_bits(kn_f16_to_f32(0x8000)), 0x80000000u);
    cr_assert(isinf(kn_f16_to_f32(0x7c00)) && kn_f16_to_f32(0x7c00) > 0);
    cr_assert_eq(f_bits(kn_f16_to_f32(0x7c01)), 0x7fc02000u,
                 "signalling NaN is quieted, payload kept");
    /* Every non-NaN half survives f16 -> f32 -> f16; NaNs come back quiet with their payload. */
    for (uint32_t h = 0; h < 65536; h++) {
        kn_f16 back = kn_f32_to_f16(kn_f16_to_f32((kn_f16)h));
        int nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
        cr_assert_eq(back, nan ? (kn_f16)(h | 0x200) : (kn_f16)h,
                     "round trip of 0x%04x gave 0x%04x", h, back);
    }
}

Test(ref, f32_to_f16_rounds_to_nearest_even)
{
    /* Values exactly representable convert exactly; halfway cases go to the even neighbour. */
    cr_assert_eq(kn_f32_to_f16(1.0f), 0x3c00);
    cr_assert_eq(kn_f32_to_f16(1.0f + 0x1.0p-11f), 0x3c00);              /* tie, even down */
    cr_assert_eq(kn_f32_to_f16(1.0f + 0x1.0p-11f + 0x1.0p-20f), 0x3c01); /* above tie */
    cr_assert_eq(kn_f32_to_f16(1.0f + 3 * 0x1.0p-11f), 0x3c02);          /* tie, even up */
    cr_assert_eq(kn_f32_to_f16(65504.0f), 0x7bff);
    cr_assert_eq(kn_f32_to_f16(65519.99f), 0x7bff);
    cr_assert_eq(kn_f32_to_f16(65520.0f), 0x7c00); /* tie to even = infinity */
    cr_assert_eq(kn_f32_to_f16(-1e10f), 0xfc00);
    cr_assert_eq(kn_f32_to_f16(0x1.0p-24f), 0x0001);
    cr_assert_eq(kn_f32_to_f16(0x1.0p-25f), 0x0000); /* tie, even = 0 */
    cr_assert_eq(kn_f32_to_f16(0x1.0p-25f + 0x1.0p-40f), 0x0001);
    cr_assert_eq(kn_f32_to_f16(3 * 0x1.0p-25f), 0x0002); /* tie 1.5 -> 2 */
    cr_assert_eq(kn_f32_to_f16(0x1.ffcp-15f), 0x0400);   /* rounds up to normal */
    cr_assert_eq(kn_f32_to_f16(-0.0f), 0x8000);
    cr_assert_eq(kn_f32_to_f16(bits_f(0x7f800000u)), 0x7c00);
    cr_assert_eq(kn_f32_to_f16(bits_f(0xff800001u)), 0xfe00);
    /* Against a double-precision nearest-even for many random normal-range values. */
    rng_seed(8);
    for (int i = 0; i < 200000; i++) {
        float f = bits_f((uint32_t)rng_u64() & 0x7fffffffu);
        if (!(f < 65504.0f) || f < 0x1.0p-24f) continue;
        kn_f16 h = kn_f32_to_f16(f);
        double d0 = kn_f16_to_f32(h), dn = kn_f16_to_f32(h + 1), dp = h ? kn_f16_to_f32(h - 1) : 0;
        cr_assert_leq(fabs(d0 - f), fabs(dn - f), "0x%08x -> 0x%04x not nearest", f_bits(f), h);
        cr_assert_leq(fabs(d0 - f), fabs(dp - f), "0x%08x -> 0x%04x not nearest", f_bits(f), h);
    }
}

SIMD_TEST(f16_to_f32_bit_exact_all_patterns)
{
    kn_f16 *h = malloc(sizeof(kn_f16) * 65536 + 2);
    float *y0 = malloc(sizeof(float) * 65536), *y1 = malloc(sizeof(float) * 65536);
    for (uint32_t i = 0; i < 65536; i++) h[i] = (kn_f16)i;
    kn_ops_get(KN_ISA_SCALAR)->f16_to_f32(h, y0, 65536);
    o->f16_to_f32(h, y1, 65536);
    for (uint32_t i = 0; i < 65536; i++)
        cr_assert_eq(f_bits(y1[i]), f_bits(y0[i]), "0x%04x: 0x%08x vs ref 0x%08x", i, f_bits(y1[i]),
                     f_bits(y0[i]));
    /* Odd lengths and offsets exercise the tails. */
    for (int si = 0; si < N_SIZES; si++) {
        int n = sizes[si];
        memset(y1, 0xAB, sizeof(float) * 1001);
        o->f16_to_f32(h + 0x3b00 + 1, y1, n);
        for (int i = 0; i < n; i++) cr_assert_eq(f_bits(y1[i]), f_bits(y0[0x3b00 + 1 + i]));
        cr_assert_eq(f_bits(y1[n]), 0xABABABABu, "wrote past n=%d", n);
    }
    free(h), free(y0), free(y1);
}

SIMD_TEST(f32_to_f16_bit_exact_random_and_special)
{
    const kn_ops *r = kn_ops_get(KN_ISA_SCALAR);
    enum { N = 1 << 20 };
    float *x = malloc(sizeof(float) * N);
    kn_f16 *y0 = malloc(sizeof(kn_f16) * N), *y1 = malloc(sizeof(kn_f16) * (N + 1));
    rng_seed(9);
    int n = 0;
    const uint32_t special[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7f800001u,
                                0x7fc00000u, 0xffffffffu, 0x7fbfffffu, 0x00000001u, 0x807fffffu,
                                0x33000000u, 0x33000001u, 0x387fc000u, 0x387fe000u, 0x38800000u,
                                0x477fe000u, 0x477fefffu, 0x477ff000u, 0x7f7fffffu, 0x3f800000u,
                                0x3f801000u, 0x3f803000u, 0x33c00000u, 0xb3400000u};
    for (unsigned i = 0; i < sizeof special / sizeof special[0]; i++) x[n++] = bits_f(special[i]);
    /* Every half's value, its halfway points to both neighbours, and one float either side. */
    for (uint32_t h = 0; h < 0x7c00 && n + 8 < N; h++) {
        float v = kn_f16_to_f32((kn_f16)h), nx = kn_f16_to_f32((kn_f16)(h + 1));
        float mid = (v + nx) / 2;
        uint32_t s = (h & 1) ? 0x80000000u : 0;
        x[n++] = bits_f(f_bits(v) ^ s);
        x[n++] = bits_f(f_bits(mid) ^ s);
        x[n++] = bits_f(f_bits(nextafterf(mid, 0)) ^ s);
        x[n++] = bits_f(f_bits(nextafterf(mid, 1e9f)) ^ s);
    }
    while (n < N) {
        uint32_t u = (uint32_t)rng_u64();
        if (n & 1) u = (u & 0x87ffffffu) | 0x30000000u; /* bias towards the half range */
        x[n++] = bits_f(u);
    }
    r->f32_to_f16(x, y0, N);
    y1[N] = 0xBEEF;
    o->f32_to_f16(x, y1, N);
    for (int i = 0; i < N; i++)
        cr_assert_eq(y1[i], y0[i], "0x%08x: 0x%04x vs ref 0x%04x", f_bits(x[i]), y1[i], y0[i]);
    cr_assert_eq(y1[N], 0xBEEF);
    for (int si = 0; si < N_SIZES; si++) {
        int m = sizes[si];
        y1[m] = 0xBEEF;
        o->f32_to_f16(x + 3, y1, m);
        for (int i = 0; i < m; i++) cr_assert_eq(y1[i], y0[3 + i]);
        cr_assert_eq(y1[m], 0xBEEF, "wrote past n=%d", m);
    }
    free(x), free(y0), free(y1);
}

/* XXH3 of buf fed to update in the pieces cut[] says (lengths, in order), from table o. */
static uint64_t xxh3_in_pieces(const kn_ops *o, const uint8_t *buf, const size_t *cut, int n_cut)
{
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    for (int i = 0; i < n_cut; i++) {
        o->xxh3_update(&st, buf, cut[i]);
        buf += cut[i];
    }
    return XXH3_64bits_digest(&st);
}

/* Lengths around XXH3's internal sizes (stripe 64, block 1024, its 256-byte buffer), a page of
 * the default model (368,640), cut at odd places. */
static const size_t xxh_lens[] = {0,   1,   16,   17,   128,  129,  240,   241,   255,
                                  256, 257, 1023, 1024, 1025, 4096, 61440, 65536, 368640};
#define N_XXH_LENS ((int)(sizeof xxh_lens / sizeof xxh_lens[0]))

static void xxh3_matches(const kn_ops *o, const kn_ops *ref)
{
    enum { N = 368640 + 64 };
    uint8_t *buf = malloc(N);
    rng_seed(21);
    for (int i = 0; i < N; i++) buf[i] = (uint8_t)rng_u64();
    for (int li = 0; li < N_XXH_LENS; li++)
        for (int off = 0; off < 3; off++) { /* misaligned starts too */
            const size_t len = xxh_lens[li];
            const uint64_t want = XXH3_64bits(buf + off, len);
            const size_t whole[1] = {len};
            cr_assert_eq(xxh3_in_pieces(o, buf + off, whole, 1), want, "%s len %zu off %d", o->name,
                         len, off);
            /* the same bytes in uneven pieces: a receiver hashing fragments as they land */
            size_t cut[64], left = len;
            int n = 0;
            while (left && n < 63) {
                size_t c = 1 + rng_u64() % (len / 4 + 64);
                cut[n++] = c < left ? c : left;
                left -= cut[n - 1];
            }
            if (left) cut[n++] = left;
            cr_assert_eq(xxh3_in_pieces(o, buf + off, cut, n), want, "%s len %zu in %d pieces",
                         o->name, len, n);
            if (ref) cr_assert_eq(xxh3_in_pieces(ref, buf + off, cut, n), want);
        }
    free(buf);
}

Test(ref, xxh3_update_is_libxxhash_whole_and_in_pieces)
{
    xxh3_matches(kn_ops_get(KN_ISA_SCALAR), NULL);
}

SIMD_TEST(xxh3_update_equals_the_reference)
{
    xxh3_matches(o, kn_ops_get(KN_ISA_SCALAR));
}

Test(ref, bf16_conversions_match_ggml)
{
    cr_assert_eq(kn_f32_to_bf16(1.0f), 0x3f80);
    cr_assert_eq(kn_f32_to_bf16(bits_f(0x3f808000u)), 0x3f80); /* tie, even down */
    cr_assert_eq(kn_f32_to_bf16(bits_f(0x3f818000u)), 0x3f82); /* tie, even up */
    cr_assert_eq(kn_f32_to_bf16(bits_f(0x3f808001u)), 0x3f81);
    cr_assert_eq(kn_f32_to_bf16(bits_f(0x7f7fffffu)), 0x7f80); /* FLT_MAX rounds to inf */
    cr_assert_eq(kn_f32_to_bf16(bits_f(0xff800000u)), 0xff80);
    cr_assert_eq(kn_f32_to_bf16(bits_f(0x7f800001u)), 0x7fc0); /* NaN forced quiet */
    cr_assert_eq(kn_f32_to_bf16(bits_f(0xffc12345u)), 0xffc1);
    cr_assert_eq(kn_f32_to_bf16(bits_f(0x00018000u)),
                 0x0002); /* subnormals are rounded, not flushed */
    cr_assert_eq(kn_bf16_to_f32(0x3f80), 1.0f);
    for (uint32_t h = 0; h < 65536; h++) {
        float f = kn_bf16_to_f32((kn_bf16)h);
        cr_assert_eq(f_bits(f), h << 16);
        int nan = (h & 0x7f80) == 0x7f80 && (h & 0x7f);
        cr_assert_eq(kn_f32_to_bf16(f), nan ? (kn_bf16)(h | 0x40) : (kn_bf16)h,
                     "bf16 round trip 0x%04x", h);
    }
    /* Against ggml_compute_fp32_to_bf16 written out independently, over random floats. */
    rng_seed(10);
    for (int i = 0; i < 1000000; i++) {
        uint32_t u = (uint32_t)rng_u64();
        uint16_t want = (u & 0x7fffffffu) > 0x7f800000u
                            ? (uint16_t)((u >> 16) | 64)
                            : (uint16_t)((u + (0x7fffu + ((u >> 16) & 1))) >> 16);
        cr_assert_eq(kn_f32_to_bf16(bits_f(u)), want, "0x%08x", u);
    }
}

/* ---------------------------------------------------------------- attention */

/* The AVX-512 build's attention driver (16-token blocks, 4 K rows at a time) with its primitives
 * emulated on AVX2 (emu512_avx2.c), so that machines without AVX-512 test its logic too. */
void kn_attention_emu512(const kn_kv_view *kv, int head_dim, const float *q, int n_q, float scale,
                         float *out);
void kn_attention_multi_emu512(const kn_kv_view *kv, int head_dim, const float *q, size_t q_stride,
                               int n_tok, int n_q, float scale, float *out, size_t out_stride);

/* Every table to hold to the reference: scalar (i = 0), AVX2, AVX-512, the emulated AVX-512
 * driver; NULL where this CPU lacks the instructions. */
enum { ATT_TABLES = 4 };
static const kn_ops *att_table(int i)
{
    static kn_ops emu;
    if (i < KN_ISA_COUNT) return kn_ops_get((kn_isa)i);
    if (!kn_ops_get(KN_ISA_AVX2)) return NULL;
    emu = *kn_ops_get(KN_ISA_AVX2);
    emu.name = "avx512-emulated";
    emu.attention = kn_attention_emu512;
    emu.attention_multi = kn_attention_multi_emu512;
    return &emu;
}

/* A paged context: n_pages separately allocated pages in shuffled order, each holding other
 * blocks around the one under test (filled with NaN so that a stray read shows), the rows past
 * n_ctx of the last page poisoned with NaN too. */
typedef struct att_ctx {
    int n_ctx, hd, pt, n_pages;
    kn_kv_format fmt;
    uint8_t **pages;
    kn_kv_view view;
    float *k, *v; /* contiguous [n_ctx][hd] copies, as the kernel should see them */
} att_ctx;

static uint16_t to_kv(float f, kn_kv_format fmt)
{
    return fmt == KN_KV_BF16 ? kn_f32_to_bf16(f) : kn_f32_to_f16(f);
}
static float from_kv(uint16_t h, kn_kv_format fmt)
{
    return fmt == KN_KV_BF16 ? kn_bf16_to_f32(h) : kn_f16_to_f32(h);
}

static void att_build(att_ctx *c, int n_ctx, int hd, int pt, kn_kv_format fmt, float kmag)
{
    memset(c, 0, sizeof *c);
    c->n_ctx = n_ctx, c->hd = hd, c->pt = pt, c->fmt = fmt;
    c->n_pages = (n_ctx + pt - 1) / pt;
    if (c->n_pages == 0) c->n_pages = 1;
    const size_t blk = (size_t)pt * hd * 2, page_bytes = 5 * blk; /* [junk][K][junk][V][junk] */
    const uint16_t poison = fmt == KN_KV_BF16 ? 0x7fc1 : 0x7e01;
    c->pages = calloc(c->n_pages, sizeof *c->pages);
    int *order = malloc(sizeof(int) * c->n_pages);
    for (int i = 0; i < c->n_pages; i++) order[i] = i;
    for (int i = c->n_pages - 1; i > 0; i--) {
        int j = (int)(rng_u64() % (uint64_t)(i + 1)), t = order[i];
        order[i] = order[j], order[j] = t;
    }
    for (int i = 0; i < c->n_pages; i++) { /* allocate in shuffled order: addresses not monotonic */
        uint8_t *p = malloc(page_bytes);
        for (size_t b = 0; b < page_bytes / 2; b++) memcpy(p + 2 * b, &poison, 2);
        c->pages[order[i]] = p;
    }
    free(order);
    c->k = malloc(sizeof(float) * (size_t)(n_ctx ? n_ctx : 1) * hd);
    c->v = malloc(sizeof(float) * (size_t)(n_ctx ? n_ctx : 1) * hd);
    for (int t = 0; t < n_ctx; t++)
        for (int d = 0; d < hd; d++) {
            uint16_t kh = to_kv(rng_f(-kmag, kmag), fmt), vh = to_kv(rng_f(-2, 2), fmt);
            uint8_t *pg = c->pages[t / pt];
            size_t e = (size_t)(t % pt) * hd + d;
            memcpy(pg + blk + 2 * e, &kh, 2);
            memcpy(pg + 3 * blk + 2 * e, &vh, 2);
            c->k[(size_t)t * hd + d] = from_kv(kh, fmt);
            c->v[(size_t)t * hd + d] = from_kv(vh, fmt);
        }
    c->view.pages = (const uint8_t *const *)c->pages;
    c->view.k_off = blk;
    c->view.v_off = 3 * blk;
    c->view.page_tokens = pt;
    c->view.n_ctx = n_ctx;
    c->view.format = fmt;
}

static void att_free(att_ctx *c)
{
    for (int i = 0; i < c->n_pages; i++) free(c->pages[i]);
    free(c->pages), free(c->k), free(c->v);
}

/* Naive softmax attention in double over the contiguous copy; mass (when not NULL) gets each
 * page's share of the softmax summed over the heads. */
static void att_naive(const att_ctx *c, const float *q, int n_q, float scale, double *out,
                      double *mass)
{
    double *s = malloc(sizeof(double) * (c->n_ctx ? c->n_ctx : 1));
    if (mass)
        for (int p = 0; p < c->n_pages; p++) mass[p] = 0;
    for (int h = 0; h < n_q; h++) {
        double mx = -INFINITY, sum = 0;
        for (int t = 0; t < c->n_ctx; t++) {
            double dot = 0;
            for (int d = 0; d < c->hd; d++)
                dot += (double)q[h * c->hd + d] * c->k[(size_t)t * c->hd + d];
            s[t] = scale * dot;
            if (s[t] > mx) mx = s[t];
        }
        for (int t = 0; t < c->n_ctx; t++) sum += (s[t] = exp(s[t] - mx));
        for (int d = 0; d < c->hd; d++) {
            double acc = 0;
            for (int t = 0; t < c->n_ctx; t++) acc += s[t] * c->v[(size_t)t * c->hd + d];
            out[h * c->hd + d] = acc / sum;
        }
        if (mass)
            for (int t = 0; t < c->n_ctx; t++) mass[t / c->pt] += s[t] / sum;
    }
    free(s);
}

/* Runs every table on one configuration: ref vs naive, each SIMD build vs ref. */
static void att_check(int n_ctx, int hd, int pt, int n_q, kn_kv_format fmt)
{
    att_ctx c;
    /* K and q magnitudes chosen so that scores spread over roughly +-10: a peaked softmax. */
    att_build(&c, n_ctx, hd, pt, fmt, 1.0f);
    float *q = malloc(sizeof(float) * n_q * hd), *o0 = malloc(sizeof(float) * n_q * hd);
    float *o1 = malloc(sizeof(float) * n_q * hd);
    double *want = malloc(sizeof(double) * n_q * hd),
           *want_mass = malloc(sizeof(double) * c.n_pages);
    float *mass = malloc(sizeof(float) * c.n_pages);
    for (int i = 0; i < n_q * hd; i++) q[i] = rng_f(-3, 3);
    const float scale = 1.0f / sqrtf((float)hd);
    att_naive(&c, q, n_q, scale, want, want_mass);
    const kn_ops *r = kn_ops_get(KN_ISA_SCALAR);
    r->attention(&c.view, hd, q, n_q, scale, o0);
    /* Outputs are convex combinations of V rows (|v| <= 2): errors are measured against that. */
    for (int i = 0; i < n_q * hd; i++)
        cr_assert_leq(fabs(o0[i] - want[i]), 2e-5 * 2.0,
                      "ref: n_ctx=%d hd=%d pt=%d n_q=%d fmt=%d i=%d: %.8g vs %.8g", n_ctx, hd, pt,
                      n_q, fmt, i, o0[i], want[i]);
    for (int isa = KN_ISA_AVX2; isa < ATT_TABLES; isa++) {
        const kn_ops *o = att_table(isa);
        if (!o) continue;
        memset(o1, 0xff, sizeof(float) * n_q * hd);
        o->attention(&c.view, hd, q, n_q, scale, o1);
        for (int i = 0; i < n_q * hd; i++)
            cr_assert_leq(fabsf(o1[i] - o0[i]), 1e-5f * 2.0f,
                          "%s: n_ctx=%d hd=%d pt=%d n_q=%d fmt=%d i=%d: %.8g vs ref %.8g", o->name,
                          n_ctx, hd, pt, n_q, fmt, i, o1[i], o0[i]);
    }
    /* attn_mass (h2o's statistic; such views are served by attn_kv_*.c): += each page's share of
     * the softmax summed over the heads, and the same output. */
    for (int isa = 0; isa < ATT_TABLES; isa++) {
        const kn_ops *o = att_table(isa);
        if (!o) continue;
        for (int p = 0; p < c.n_pages; p++) mass[p] = 0.5f;
        c.view.attn_mass = mass;
        o->attention(&c.view, hd, q, n_q, scale, o1);
        c.view.attn_mass = NULL;
        for (int i = 0; i < n_q * hd; i++)
            cr_assert_leq(fabsf(o1[i] - o0[i]), 1e-5f * 2.0f,
                          "%s with attn_mass: i=%d: %.8g vs ref %.8g", o->name, i, o1[i], o0[i]);
        for (int p = 0; p < c.n_pages; p++)
            cr_assert_leq(fabs(mass[p] - 0.5 - want_mass[p]), 1e-5 * n_q,
                          "%s: mass of page %d: %.8g vs %.8g (n_ctx=%d pt=%d n_q=%d)", o->name, p,
                          mass[p] - 0.5, want_mass[p], n_ctx, pt, n_q);
    }
    free(q), free(o0), free(o1), free(want), free(want_mass), free(mass);
    att_free(&c);
}

static void att_skip_msg(void)
{
    static const char *names[] = {"scalar", "AVX2", "AVX-512"};
    for (int isa = KN_ISA_AVX2; isa < KN_ISA_COUNT; isa++)
        if (!kn_ops_get((kn_isa)isa))
            /* Reported, never a failure: Criterion turns a logged warning into a failed run. */
            fprintf(stderr, "[SKIP] this CPU lacks %s: attention checked on the others\n",
                    names[isa]);
}

Test(attention, matches_naive_softmax_f16_and_bf16)
{
    att_skip_msg();
    rng_seed(11);
    const int ctxs[] = {1, 15, 16, 17, 100, 1000};
    const int hds[] = {64, 128};
    const int nqs[] = {1, 3};
    for (int f = 0; f < 2; f++)
        for (int a = 0; a < 6; a++)
            for (int b = 0; b < 2; b++)
                for (int n = 0; n < 2; n++)
                    att_check(ctxs[a], hds[b], 16, nqs[n], f ? KN_KV_BF16 : KN_KV_F16);
}

Test(attention, other_page_sizes_head_counts_and_head_dims)
{
    rng_seed(12);
    /* page sizes below, at and above one SIMD block */
    const int pts[] = {1, 4, 8, 32, 64, 256};
    for (int a = 0; a < 6; a++) {
        att_check(1, 64, pts[a], 3, KN_KV_F16);
        att_check(37, 64, pts[a], 3, KN_KV_F16);
        att_check(300, 128, pts[a], 2, KN_KV_BF16);
    }
    /* group sizes 2 and 4, several groups (5, 7, 9), more heads than one pass holds (40) */
    const int nqs[] = {2, 4, 5, 7, 9, 40};
    for (int n = 0; n < 6; n++) att_check(150, 64, 16, nqs[n], n & 1 ? KN_KV_BF16 : KN_KV_F16);
    /* head dims off the 64-dimension fast path, and the fallbacks (not a multiple of 16 / 8) */
    const int hds[] = {16, 32, 80, 96, 256, 40, 12};
    for (int b = 0; b < 7; b++) att_check(70, hds[b], 16, 3, KN_KV_F16);
}

Test(attention, peaked_and_flat_scores_are_stable)
{
    rng_seed(13);
    /* Very large scores (each new page raises the maximum by a lot) and all-equal scores. */
    att_ctx c;
    att_build(&c, 200, 64, 16, KN_KV_F16, 1.0f);
    float q[64], o0[64], o1[64];
    for (int d = 0; d < 64; d++) q[d] = 0.0f;
    for (int t = 0; t < 200; t++) /* K rows grow with t: scores rise monotonically */
        for (int d = 0; d < 64; d++) {
            kn_f16 h = kn_f32_to_f16((float)t / 8.0f);
            memcpy((uint8_t *)c.pages[t / 16] + c.view.k_off + 2 * ((size_t)(t % 16) * 64 + d), &h,
                   2);
            c.k[t * 64 + d] = kn_f16_to_f32(h);
        }
    for (int pass = 0; pass < 2; pass++) {
        float qv = pass ? 0.0f : 1.0f; /* pass 1: q = 0, every score equal, output = mean of V */
        for (int d = 0; d < 64; d++) q[d] = qv;
        double want[64];
        att_naive(&c, q, 1, 0.125f, want, NULL);
        kn_ops_get(KN_ISA_SCALAR)->attention(&c.view, 64, q, 1, 0.125f, o0);
        for (int d = 0; d < 64; d++)
            cr_assert_leq(fabs(o0[d] - want[d]), 4e-5, "ref pass %d d=%d", pass, d);
        for (int isa = KN_ISA_AVX2; isa < ATT_TABLES; isa++) {
            const kn_ops *o = att_table(isa);
            if (!o) continue;
            o->attention(&c.view, 64, q, 1, 0.125f, o1);
            for (int d = 0; d < 64; d++)
                cr_assert_leq(fabsf(o1[d] - o0[d]), 2e-5f, "%s pass %d d=%d", o->name, pass, d);
        }
    }
    att_free(&c);
}

/* fp8 and int8 pages (attn_kv.h's layout: bytes, then an f16 scale per 16 channels of a row) with
 * random codes and scales: every table, the emulated AVX-512 driver included, agrees with the
 * reference, whose agreement with the definition test_kvshard_format.c checks. */
static void att_check_quant(kn_kv_format fmt, int n_ctx, int hd, int pt, int n_q)
{
    const int ng = hd / 16, n_pages = (n_ctx + pt - 1) / pt;
    const size_t blk = (size_t)pt * hd, sblk = (size_t)pt * ng * 2;
    uint8_t **pages = malloc(sizeof(uint8_t *) * (size_t)n_pages);
    for (int p = 0; p < n_pages; p++) {
        pages[p] = malloc(2 * blk + 2 * sblk);
        for (size_t b = 0; b < 2 * blk; b++) {
            uint8_t v = (uint8_t)rng_u64();
            if (fmt == KN_KV_FP8 && (v & 0x7f) == 0x7f) v ^= 1; /* no NaN code */
            pages[p][b] = v;
        }
        for (size_t b = 0; b < 2 * sblk; b += 2) {
            const kn_f16 h = kn_f32_to_f16(rng_f(0.001f, 0.01f));
            memcpy(pages[p] + 2 * blk + b, &h, 2);
        }
    }
    kn_kv_view v = {.pages = (const uint8_t *const *)pages,
                    .k_off = 0,
                    .v_off = blk,
                    .k_scale_off = 2 * blk,
                    .v_scale_off = 2 * blk + sblk,
                    .page_tokens = pt,
                    .n_ctx = n_ctx,
                    .format = fmt};
    float *q = malloc(sizeof(float) * n_q * hd), *o0 = malloc(sizeof(float) * n_q * hd);
    float *o1 = malloc(sizeof(float) * n_q * hd);
    for (int i = 0; i < n_q * hd; i++) q[i] = rng_f(-3, 3);
    kn_ops_get(KN_ISA_SCALAR)->attention(&v, hd, q, n_q, 0.125f, o0);
    /* |V| <= 448 * 0.01 (fp8) or 127 * 0.01 (int8): errors against that */
    const float tol = 1e-5f * (fmt == KN_KV_FP8 ? 4.48f : 1.27f);
    for (int isa = KN_ISA_AVX2; isa < ATT_TABLES; isa++) {
        const kn_ops *o = att_table(isa);
        if (!o) continue;
        memset(o1, 0xff, sizeof(float) * n_q * hd);
        o->attention(&v, hd, q, n_q, 0.125f, o1);
        for (int i = 0; i < n_q * hd; i++)
            cr_assert_leq(fabsf(o1[i] - o0[i]), tol,
                          "%s fmt=%d n_ctx=%d hd=%d pt=%d n_q=%d i=%d: %.8g vs ref %.8g", o->name,
                          fmt, n_ctx, hd, pt, n_q, i, o1[i], o0[i]);
    }
    for (int p = 0; p < n_pages; p++) free(pages[p]);
    free(pages), free(q), free(o0), free(o1);
}

Test(attention, fp8_and_int8_pages_match_the_reference)
{
    rng_seed(15);
    const int ctxs[] = {1, 15, 17, 100, 300};
    const int hds[] = {64, 128, 96};
    const int nqs[] = {1, 3, 5};
    for (int f = 0; f < 2; f++)
        for (int a = 0; a < 5; a++)
            for (int b = 0; b < 3; b++)
                att_check_quant(f ? KN_KV_INT8 : KN_KV_FP8, ctxs[a], hds[b], a % 2 ? 16 : 32,
                                nqs[(a + b) % 3]);
}

/* attention_multi (a run of consecutive query tokens walking the pages together) equals, bit for
 * bit, one attention call per token over its own prefix, in every table (the emulated AVX-512
 * driver included): runs shorter than, equal to and longer than the 8 the SIMD kernels take at
 * once, pages shorter than a block, contexts that end mid-block, 1-9 query heads. */
Test(attention, multi_token_runs_equal_one_call_per_token)
{
    rng_seed(23);
    static const struct {
        int n_ctx, hd, pt, n_q, n_tok;
    } cs[] = {{1, 64, 16, 3, 1},    {9, 64, 16, 3, 9},    {100, 64, 16, 3, 4},
              {100, 64, 16, 3, 8},  {100, 64, 16, 3, 20}, {37, 128, 4, 5, 11},
              {300, 64, 32, 9, 17}, {70, 96, 8, 1, 3},    {33, 24, 16, 2, 5}};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++)
        for (int f = 0; f < 2; f++) {
            const kn_kv_format fmt = f ? KN_KV_BF16 : KN_KV_F16;
            att_ctx c;
            att_build(&c, cs[i].n_ctx, cs[i].hd, cs[i].pt, fmt, 1.0f);
            const int hd = cs[i].hd, n_q = cs[i].n_q, nt = cs[i].n_tok;
            const size_t stride = (size_t)n_q * hd + 16;
            float *q = malloc(sizeof(float) * stride * nt),
                  *a = malloc(sizeof(float) * stride * nt);
            float *one = malloc(sizeof(float) * n_q * hd);
            for (size_t j = 0; j < stride * nt; j++) q[j] = rng_f(-2, 2);
            for (int isa = 0; isa < ATT_TABLES; isa++) {
                const kn_ops *o = att_table(isa);
                if (!o) continue;
                o->attention_multi(&c.view, hd, q, stride, nt, n_q, 0.125f, a, stride);
                for (int t = 0; t < nt; t++) {
                    kn_kv_view w = c.view;
                    w.n_ctx = c.n_ctx - (nt - 1 - t);
                    o->attention(&w, hd, q + t * stride, n_q, 0.125f, one);
                    cr_assert(!memcmp(one, a + t * stride, sizeof(float) * n_q * hd),
                              "%s fmt=%d case %zu: token %d of %d differs from its own call",
                              o->name, fmt, i, t, nt);
                }
            }
            free(q), free(a), free(one);
            att_free(&c);
        }
}

Test(attention, empty_context_gives_zeros)
{
    att_ctx c;
    att_build(&c, 0, 64, 16, KN_KV_F16, 1.0f);
    float q[64] = {1}, out[64];
    for (int isa = 0; isa < ATT_TABLES; isa++) {
        const kn_ops *o = att_table(isa);
        if (!o) continue;
        memset(out, 0xff, sizeof out);
        o->attention(&c.view, 64, q, 1, 0.125f, out);
        for (int d = 0; d < 64; d++) cr_assert_eq(out[d], 0.0f, "%s", o->name);
    }
    att_free(&c);
}
