/*
 * test_sparse.c — query-aware sparse attention (docs/sparse.md): kvshard's key summaries (min and
 * max of every key channel over a page, in f16 rounded outward, for every format, computed as
 * attention reads the keys, kept in RAM when a page leaves the hot tier), the page scores of every
 * instruction set against the scalar reference (the same pages selected), the selection's rules
 * (sink, window, budget), and the attention over the selected pages against a double-precision
 * softmax over exactly those tokens, and against dense attention when the budget covers the whole
 * context.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvshard/internal.h"

#define HD 64
#define NL 2
#define NH 2
#define PT 16

static uint32_t g_rng = 7;
static float frand(void)
{
    g_rng = g_rng * 1664525u + 1013904223u;
    return ((g_rng >> 8) / 16777216.0f) * 2.0f - 1.0f;
}

/* n tokens of random K/V written into a new sequence of store s the way the engine writes them
 * (reserve, then write). */
static void fill_seq(kv_store *s, int n, kv_seq **q)
{
    cr_assert_eq(kv_seq_create(s, q), 0);
    float k[NH * HD], v[NH * HD];
    for (int t = 0; t < n; t++) {
        cr_assert_eq(kv_seq_reserve(s, *q, t + 1), 0);
        for (int l = 0; l < NL; l++) {
            /* a few loud channels, and pages that differ in level, as real keys do */
            for (int i = 0; i < NH * HD; i++) {
                k[i] = frand() * (i % 16 == 3 ? 6.0f : 1.0f) + 0.5f * sinf((float)(t / PT + i));
                v[i] = frand();
            }
            kv_seq_write(s, *q, l, t, k, v);
        }
    }
    cr_assert_eq(kv_seq_reserve(s, *q, n), 0); /* the catch-up: full pages summarized */
}

/* A store of NL layers and NH kv heads in format fmt with n tokens in one sequence. */
static void make_seq(kv_format fmt, int n, size_t host, kv_store **s, kv_seq **q)
{
    kv_config c = {.n_layers = NL,
                   .n_kv_heads = NH,
                   .head_dim = HD,
                   .page_tokens = PT,
                   .format = fmt,
                   .hot_bytes = (size_t)64 << 20,
                   .host_bytes = host,
                   .sync_promote = 1,
                   .summaries = 1};
    km_errbuf err;
    cr_assert_eq(kv_store_create(&c, s, &err), 0, "%s", err.msg);
    fill_seq(*s, n, q);
}

/* Every (layer, kv head) summary of q's first n_pages full pages bounds the keys attention reads,
 * within one f16 step, and the page after them has none. */
static void check_summaries(kv_store *s, kv_seq *q, int n_pages, const char *what)
{
    const kn_f16 *sums[128];
    for (int l = 0; l < NL; l++)
        for (int h = 0; h < NH; h++) {
            kv_seq_summaries(s, q, l, h, n_pages + 1, sums);
            cr_assert_null(sums[n_pages], "the partial last page has no summary");
            for (int p = 0; p < n_pages; p++) {
                cr_assert_not_null(sums[p], "%s page %d", what, p);
                for (int c = 0; c < HD; c++) {
                    float mn = INFINITY, mx = -INFINITY, k[HD], v[HD];
                    for (int t = p * PT; t < (p + 1) * PT; t++) {
                        cr_assert_eq(kv_seq_read(s, q, l, h, t, k, v), 0);
                        mn = fminf(mn, k[c]);
                        mx = fmaxf(mx, k[c]);
                    }
                    /* f16 rounded outward: a bound, at most one f16 step away */
                    const float lo = kn_f16_to_f32(sums[p][c]), hi = kn_f16_to_f32(sums[p][HD + c]);
                    cr_assert(lo <= mn && mn - lo <= fabsf(mn) / 1024 + 6e-8f, "%s min %g of %g",
                              what, lo, mn);
                    cr_assert(hi >= mx && hi - mx <= fabsf(mx) / 1024 + 6e-8f, "%s max %g of %g",
                              what, hi, mx);
                }
            }
        }
}

Test(sparse, summaries_bound_the_keys_attention_reads_in_every_format_in_f16)
{
    for (int f = 0; f < KV_FORMAT_COUNT; f++) {
        kv_store *s;
        kv_seq *q;
        make_seq((kv_format)f, 5 * PT + 7, 0, &s, &q);
        check_summaries(s, q, 5, kv_format_name((kv_format)f));
        kv_seq_destroy(s, q);
        kv_store_destroy(s);
    }
}

Test(sparse, pages_reserved_in_turn_have_adjacent_summaries_and_freed_slots_serve_again)
{
    kv_store *s;
    kv_seq *q;
    make_seq(KN_KV_F16, KV_SUM_SLAB * PT + 3, 0, &s, &q); /* a slab full and one page more */
    const kn_f16 *sums[KV_SUM_SLAB + 2];
    kv_seq_summaries(s, q, 1, 1, KV_SUM_SLAB, sums);
    for (int p = 1; p < KV_SUM_SLAB; p++)
        cr_assert_eq(sums[p], sums[p - 1] + 2 * HD, "page %d streams after page %d", p, p - 1);
    kv_seq_destroy(s, q); /* not published: the pages and their summary slots are freed */
    kv_seq *a, *b;
    fill_seq(s, 3 * PT + 1, &a);                 /* the second slab's next slots */
    fill_seq(s, (KV_SUM_SLAB - 2) * PT + 5, &b); /* the rest of it, then freed slots */
    check_summaries(s, a, 3, "after the first slab was freed");
    check_summaries(s, b, KV_SUM_SLAB - 2, "in freed slots");
    kv_seq_destroy(s, a);
    kv_seq_destroy(s, b);
    kv_store_destroy(s);
}

Test(sparse, a_page_keeps_its_summary_on_the_host_tier_and_a_new_format_recomputes_it)
{
    kv_store *s;
    kv_seq *q;
    const int n = 4 * PT;
    make_seq(KN_KV_F16, n, (size_t)64 << 20, &s, &q);
    km_pagehash hashes[4];
    int32_t tokens[4 * PT];
    for (int i = 0; i < n; i++) tokens[i] = i;
    for (int i = 0; i < 4; i++) hashes[i] = (km_pagehash){0x1234u + i, 0x99u};
    cr_assert_eq(kv_seq_publish(s, q, hashes, tokens, n), 4);
    kv_seq_destroy(s, q);
    cr_assert_eq(kv_store_evict_oldest_fraction(s, 1.0), 4);
    for (int i = 0; i < 4; i++) {
        kv_page *p = kv_index_find(s, hashes[i]);
        cr_assert_not_null(p);
        cr_assert_eq(p->tier, KV_TIER_HOST);
        cr_assert_not_null(p->sum, "the summary stays in RAM");
        for (int l = 0; l < NL; l++) cr_assert(p->sum_ok[l]);
    }
    /* attached again: the summaries are there without a reserve */
    cr_assert_eq(kv_seq_create(s, &q), 0);
    cr_assert_eq(kv_seq_attach(s, q, hashes, tokens, 4), 4);
    kv_seq_wait_ready(s, q);
    const kn_f16 *sums[4];
    kv_seq_summaries(s, q, 1, 1, 4, sums);
    for (int i = 0; i < 4; i++) cr_assert_not_null(sums[i]);
    /* recovery level 2 re-encodes every page: summaries are stale until the next reserve */
    cr_assert_gt(kv_store_convert(s, KN_KV_INT8), 0);
    kv_seq_summaries(s, q, 0, 0, 4, sums);
    for (int i = 0; i < 4; i++) cr_assert_null(sums[i]);
    cr_assert_eq(kv_seq_reserve(s, q, n + 1), 0);
    kv_seq_summaries(s, q, 0, 0, 4, sums);
    for (int i = 0; i < 4; i++) cr_assert_not_null(sums[i]);
    kv_seq_destroy(s, q);
    kv_store_destroy(s);
}

Test(sparse, selection_keeps_sink_and_window_and_the_best_scores_within_the_budget)
{
    float score[10] = {0, 5, 1, 9, 9, 2, 7, 0, 3, 4}, tmp[10];
    int sel[10];
    kn_sparse_cfg c = {.budget_pages = 6, .sink_pages = 1, .window_pages = 2};
    int n = kn_sparse_select(score, 10, &c, tmp, sel);
    int want[] = {0, 1, 3, 4, 6, 8, 9};
    (void)want;
    cr_assert_eq(n, 6);
    int expect[] = {0, 3, 4, 6, 8, 9}; /* sink 0, window 8 9, then 9 9 7 */
    for (int i = 0; i < n; i++) cr_assert_eq(sel[i], expect[i], "sel[%d] = %d", i, sel[i]);
    c.budget_pages = 7; /* ties go to the lower index: 5 (page 1) */
    n = kn_sparse_select(score, 10, &c, tmp, sel);
    cr_assert_eq(n, 7);
    cr_assert_eq(sel[1], 1);
    c.budget_pages = 20;
    cr_assert_eq(kn_sparse_select(score, 10, &c, tmp, sel), 10, "all fit");
    c.budget_pages = 1; /* sink and window are kept even past the budget */
    cr_assert_eq(kn_sparse_select(score, 10, &c, tmp, sel), 3);
}

/* Naive attention in double over the tokens of the selected pages of (layer, head). */
static void naive(kv_store *s, kv_seq *q, int l, int h, int n_ctx, const int *sel, int n_sel,
                  const float *qv, int n_q, float scale, float *out)
{
    for (int g = 0; g < n_q; g++) {
        double m = -INFINITY, sum = 0, acc[HD] = {0};
        float k[HD], v[HD];
        for (int pass = 0; pass < 2; pass++)
            for (int i = 0; i < n_sel; i++)
                for (int t = sel[i] * PT; t < (sel[i] + 1) * PT && t < n_ctx; t++) {
                    kv_seq_read(s, q, l, h, t, k, v);
                    double d = 0;
                    for (int c = 0; c < HD; c++) d += (double)qv[g * HD + c] * k[c];
                    d *= scale;
                    if (!pass) {
                        m = d > m ? d : m;
                        continue;
                    }
                    const double w = exp(d - m);
                    sum += w;
                    for (int c = 0; c < HD; c++) acc[c] += w * v[c];
                }
        for (int c = 0; c < HD; c++) out[g * HD + c] = (float)(acc[c] / sum);
    }
}

Test(sparse, every_isa_selects_the_reference_pages_and_attends_exactly_over_them)
{
    const kn_ops *ref = kn_ops_get(KN_ISA_SCALAR);
    const kn_kv_format fmts[] = {KN_KV_F16, KN_KV_INT8, KN_KV_INT4};
    for (int fi = 0; fi < 3; fi++) {
        kv_store *s;
        kv_seq *q;
        const int n = 40 * PT + 5, np = 41, n_q = 3;
        make_seq(fmts[fi], n, 0, &s, &q);
        kn_sparse_scratch scr;
        cr_assert_eq(kn_sparse_scratch_init(&scr, 64), 0);
        const kn_f16 *sums[64];
        float qv[3 * HD], sref[64], sisa[64], tmp[64], out[3 * HD], want[3 * HD];
        int selr[64], seli[64];
        for (int trial = 0; trial < 20; trial++) {
            const int l = trial % NL, h = (trial / NL) % NH;
            /* odd trials score with radius 0.5 (an estimate, not a bound) */
            const float rad = trial % 2 ? 0.5f : 1.0f;
            const kn_sparse_cfg c = {
                .budget_pages = 8, .sink_pages = 1, .window_pages = 2, .radius = rad};
            for (int i = 0; i < n_q * HD; i++) qv[i] = frand() * 2.0f;
            kv_seq_summaries(s, q, l, h, np, sums);
            ref->page_scores(sums, np, HD, qv, n_q, rad, sref);
            for (int p = 0; rad == 1.0f && p < np - 1; p++) { /* the bound holds for every key */
                float k[HD], v[HD];
                for (int t = p * PT; t < (p + 1) * PT; t++) {
                    kv_seq_read(s, q, l, h, t, k, v);
                    for (int g = 0; g < n_q; g++) {
                        float d = 0;
                        for (int x = 0; x < HD; x++) d += qv[g * HD + x] * k[x];
                        cr_assert_leq(d, sref[p] + 1e-3f);
                    }
                }
            }
            cr_assert(isinf(sref[np - 1]), "the partial page is always kept");
            const int nr = kn_sparse_select(sref, np, &c, tmp, selr);
            cr_assert_eq(nr, 8);
            for (int isa = 0; isa < KN_ISA_COUNT; isa++) {
                const kn_ops *o = kn_ops_get((kn_isa)isa);
                if (!o) continue;
                o->page_scores(sums, np, HD, qv, n_q, rad, sisa);
                for (int p = 0; p < np; p++) {
                    if (isinf(sref[p]))
                        cr_assert(isinf(sisa[p]), "%s", o->name);
                    else
                        cr_assert_float_eq(sisa[p], sref[p], 1e-3f * (1 + fabsf(sref[p])), "%s",
                                           o->name);
                }
                cr_assert_eq(kn_sparse_select(sisa, np, &c, tmp, seli), nr);
                cr_assert_arr_eq(seli, selr, sizeof(int) * nr, "%s selects the reference's pages",
                                 o->name);
                kn_kv_view view;
                kv_seq_view(s, q, l, h, n, &view);
                cr_assert_eq(
                    kn_sparse_attention(o, &view, sums, &c, &scr, HD, qv, n_q, 0.125f, out), nr);
                naive(s, q, l, h, n, selr, nr, qv, n_q, 0.125f, want);
                for (int i = 0; i < n_q * HD; i++)
                    cr_assert_float_eq(out[i], want[i], 2e-4f, "%s %s [%d]", o->name,
                                       kv_format_name(fmts[fi]), i);
                /* a budget over the whole context: dense attention, bit for bit */
                const kn_sparse_cfg all = {.budget_pages = np, .sink_pages = 1, .window_pages = 2};
                cr_assert_eq(
                    kn_sparse_attention(o, &view, sums, &all, &scr, HD, qv, n_q, 0.125f, out), np);
                o->attention(&view, HD, qv, n_q, 0.125f, want);
                cr_assert_arr_eq(out, want, sizeof(float) * n_q * HD);
            }
        }
        kn_sparse_scratch_free(&scr);
        kv_seq_destroy(s, q);
        kv_store_destroy(s);
    }
}
