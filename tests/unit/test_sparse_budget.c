/*
 * test_sparse_budget.c — sparse attention budgets per (layer, kv head) (engine/sparse_budget.c,
 * docs/sparse.md "Per-head budgets") with the real model: a table of shares reaches each head's
 * page choice (a local head's views hold its sink and window pages only, a retrieval head's more,
 * the mean kept); the head probe measures softmax shares that add up to one; the shares it fits
 * spend the mean budget; and the shares file's reader refuses what is not a table for the model.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "tests/unit/model_fixture.h"

#define CTX  250 /* prefilled tokens: 16 pages of 16 with the decoded one */
#define MEAN 128 /* --sparse-attn: 8 pages */
#define MINP 3   /* sink and window pages */

/* Prefills CTX pseudo-random tokens with engine e, then decodes one; fills the sparse counts of
 * that decode step alone. */
static void prefill_and_decode(en_engine *e, en_sparse_stats *step)
{
    int32_t ids[CTX + 1], pos[CTX + 1];
    kv_seq *seqs[CTX + 1], *q;
    uint8_t want[CTX + 1] = {0};
    for (int i = 0; i <= CTX; i++) ids[i] = (int32_t)((i * 7919u + 13u) % 20000u) + 100;
    cr_assert_eq(kv_seq_create(en_engine_kv(e), &q), 0);
    for (int i = 0; i <= CTX; i++) pos[i] = i, seqs[i] = q;
    want[CTX - 1] = 1;
    const float *lg;
    en_batch pre = {.n_tokens = CTX, .tokens = ids, .pos = pos, .seqs = seqs, .logits = want};
    cr_assert_eq(en_engine_step(e, &pre, &lg), 1);
    en_sparse_stats a, b;
    en_engine_sparse_stats(e, &a);
    uint8_t one = 1;
    en_batch dec = {
        .n_tokens = 1, .tokens = ids + CTX, .pos = pos + CTX, .seqs = seqs, .logits = &one};
    cr_assert_eq(en_engine_step(e, &dec, &lg), 1);
    en_engine_sparse_stats(e, &b);
    step->pages_selected = b.pages_selected - a.pages_selected;
    step->pages_skipped = b.pages_skipped - a.pages_skipped;
    kv_seq_destroy(en_engine_kv(e), q);
}

Test(sparse_budget, a_table_gives_local_heads_sink_and_window_and_retrieval_heads_more,
     .init = setup, .fini = teardown, .timeout = 600)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    const en_hparams *hp = en_model_hparams(g_model);
    const int nl = hp->n_layers, kvh = hp->n_head_kv;
    cr_assert_eq(kvh, 3, "the table below is written for 3 kv heads");
    float *shares = malloc(sizeof(float) * nl * kvh);
    for (int l = 0; l < nl; l++) /* head 0 local, head 1 little, head 2 retrieves */
        shares[l * kvh + 0] = 0, shares[l * kvh + 1] = 1, shares[l * kvh + 2] = 1000;
    en_engine_opts o = {.n_threads = 2,
                        .max_batch_tokens = CTX,
                        .sparse_attn = MEAN,
                        .sparse_dense_layers = -1,
                        .sparse_shares = shares};
    en_engine *e;
    km_errbuf err = {{0}};
    cr_assert_eq(en_engine_create(g_model, &o, &e, &err), 0, "%s", err.msg);
    free(shares); /* the engine keeps its own copy */
    /* 8 pages a head on average: 24 a layer, 3 to each small share, 18 to the retrieval head */
    for (int l = 0; l < nl; l++) {
        cr_assert_eq(en_engine_sparse_budget(e, l, 0), MINP, "layer %d head 0", l);
        cr_assert_eq(en_engine_sparse_budget(e, l, 1), MINP, "layer %d head 1", l);
        cr_assert_eq(en_engine_sparse_budget(e, l, 2), 3 * MEAN / 16 - 2 * MINP, "layer %d", l);
    }
    /* 16 pages in view: heads 0 and 1 attend 3 of them each; head 2's 18 hold them all, so it
     * attends densely (not a sparse view) */
    en_sparse_stats st;
    prefill_and_decode(e, &st);
    const int np = (CTX + 16) / 16;
    cr_assert_eq(st.pages_selected, (uint64_t)nl * 2 * MINP);
    cr_assert_eq(st.pages_skipped, (uint64_t)nl * 2 * (np - MINP));
    en_engine_destroy(e);

    /* the same mean without a table: every head's view holds 8 pages */
    o.sparse_shares = NULL;
    cr_assert_eq(en_engine_create(g_model, &o, &e, &err), 0, "%s", err.msg);
    cr_assert_eq(en_engine_sparse_budget(e, nl - 1, 0), MEAN / 16);
    prefill_and_decode(e, &st);
    cr_assert_eq(st.pages_selected, (uint64_t)nl * kvh * (MEAN / 16));
    en_engine_destroy(e);
}

Test(sparse_budget, the_dense_layers_keep_their_attention_under_a_table, .init = setup,
     .fini = teardown, .timeout = 600)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    const en_hparams *hp = en_model_hparams(g_model);
    const int nl = hp->n_layers, kvh = hp->n_head_kv;
    float *shares = malloc(sizeof(float) * nl * kvh);
    for (int i = 0; i < nl * kvh; i++) shares[i] = (float)(i % kvh == 1 ? 5 : 1);
    en_engine_opts o = {
        .n_threads = 1, .max_batch_tokens = 16, .sparse_attn = MEAN, .sparse_shares = shares};
    en_engine *e;
    km_errbuf err = {{0}};
    cr_assert_eq(en_engine_create(g_model, &o, &e, &err), 0, "%s", err.msg);
    cr_assert_eq(en_engine_sparse_budget(e, 0, 1), 0, "layer 0 stays dense (default 2 layers)");
    cr_assert_eq(en_engine_sparse_budget(e, 1, 0), 0);
    long sum = 0;
    for (int l = 2; l < nl; l++)
        for (int h = 0; h < kvh; h++) sum += en_engine_sparse_budget(e, l, h);
    /* the sparse layers' mean is the budget, to rounding */
    cr_assert_leq(labs(sum - (long)(nl - 2) * kvh * (MEAN / 16)), (long)(nl - 2) * kvh / 2);
    cr_assert_gt(en_engine_sparse_budget(e, 5, 1), en_engine_sparse_budget(e, 5, 0));
    /* a new mean keeps the proportions */
    cr_assert_eq(en_engine_set_sparse(e, 2 * MEAN), 0);
    cr_assert_gt(en_engine_sparse_budget(e, 5, 0), MEAN / 16 / 2);
    en_engine_destroy(e);
    /* shares only for the dense layers: the sparse ones keep the uniform budget */
    for (int i = 0; i < nl * kvh; i++) shares[i] = i < 2 * kvh ? 1.0f : 0.0f;
    cr_assert_eq(en_engine_create(g_model, &o, &e, &err), 0, "%s", err.msg);
    cr_assert_eq(en_engine_sparse_budget(e, 7, 2), MEAN / 16);
    en_engine_destroy(e);
    free(shares);
}

Test(sparse_budget, the_probe_measures_shares_of_the_attention_and_they_fit_the_mean, .init = setup,
     .fini = teardown, .timeout = 600)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    const en_hparams *hp = en_model_hparams(g_model);
    const int heads = hp->n_layers * hp->n_head_kv, np = (CTX + 16) / 16;
    /* sparse, so that the pages keep summaries, and set dense */
    en_engine_opts o = {
        .n_threads = 2, .max_batch_tokens = CTX, .sparse_attn = MEAN, .head_probe_from = CTX - 40};
    en_engine *e;
    km_errbuf err = {{0}};
    cr_assert_eq(en_engine_create(g_model, &o, &e, &err), 0, "%s", err.msg);
    cr_assert_eq(en_engine_set_sparse(e, 0), 0);
    en_sparse_stats st;
    prefill_and_decode(e, &st);
    cr_assert_eq(st.pages_selected, 0, "the probe's attention is dense");
    double *local = malloc(sizeof(double) * heads), *rank = malloc(sizeof(double) * heads * np);
    double *found = malloc(sizeof(double) * heads * np);
    cr_assert_eq(en_engine_head_probe(e, np, local, rank, found), 41, "the last 41 positions");
    int sharp = 0, misranked = 0;
    for (int i = 0; i < heads; i++) {
        double sum = local[i], by_score = local[i];
        for (int k = 0; k < np; k++) {
            sum += rank[i * np + k];
            by_score += found[i * np + k];
            if (k) cr_assert_leq(rank[i * np + k], rank[i * np + k - 1] + 1e-9, "head %d", i);
            misranked += found[i * np + k] < rank[i * np + k] - 1e-9;
        }
        cr_assert_float_eq(sum, 1.0, 1e-3, "head %d: the softmax adds up to one (%f)", i, sum);
        cr_assert_float_eq(by_score, 1.0, 1e-3, "head %d: the same pages by score", i);
        sharp += local[i] > 0.9;
    }
    cr_assert_gt(misranked, 0, "the summaries' ranking is not the attention's");
    cr_assert_gt(sharp, 0, "some heads keep nearly all their attention on sink and window");
    float *shares = malloc(sizeof(float) * heads);
    en_sparse_shares_from_probe(local, rank, heads, np, 6, shares);
    double total = 0;
    for (int i = 0; i < heads; i++) {
        cr_assert_geq(shares[i], (float)MINP);
        total += shares[i];
    }
    cr_assert_float_eq(total, 6.0 * heads, 1e-6, "the mean budget spent page by page");
    en_engine_destroy(e);
    o.head_probe_from = 0;
    cr_assert_eq(en_engine_create(g_model, &o, &e, &err), 0, "%s", err.msg);
    cr_assert_eq(en_engine_head_probe(e, np, local, rank, NULL), KM_EINVAL, "no probe");
    en_engine_destroy(e);
    free(local), free(rank), free(found), free(shares);
}

/* ------------------------------------------------------------------ the file */

static int parse(const char *text, float *s, km_errbuf *err)
{
    return en_sparse_shares_parse(text, strlen(text), 2, 3, s, err);
}

Test(sparse_budget, a_shares_file_parses_with_comments_and_any_layer_order)
{
    float s[6];
    km_errbuf err = {{0}};
    const char *ok = "# made by hand\n\nkvmesh-sparse-shares 1\nshape 2 3  # 2 layers\n"
                     "layer 1 4 5 6\r\n\tlayer 0 1 0 2.5e1\n";
    cr_assert_eq(parse(ok, s, &err), 0, "%s", err.msg);
    const float want[6] = {1, 0, 25, 4, 5, 6};
    cr_assert_arr_eq(s, want, sizeof want);
}

Test(sparse_budget, a_bad_shares_file_is_refused_with_its_line)
{
    static const struct {
        const char *text, *says;
    } bad[] = {
        {"", "no `shape`"},
        {"shape 2 3\n", "line 1: expected `kvmesh-sparse-shares 1`"},
        {"kvmesh-sparse-shares 2\n", "line 1"},
        {"kvmesh-sparse-shares 1\nshape 30 3\n", "line 2: shape 30 x 3, but the model has 2"},
        {"kvmesh-sparse-shares 1\nshape 2\n", "line 2: expected `shape"},
        {"kvmesh-sparse-shares 1\nshape 2 3\nlayer 0 1 1 1\n", "layer 1 has no shares"},
        {"kvmesh-sparse-shares 1\nshape 2 3\nlayer 0 1 1 1\nlayer 0 1 1 1\n", "line 4: layer 0 "
                                                                              "given twice"},
        {"kvmesh-sparse-shares 1\nshape 2 3\nlayer 2 1 1 1\n", "line 3: expected `layer"},
        {"kvmesh-sparse-shares 1\nshape 2 3\nlayer -1 1 1 1\n", "line 3"},
        {"kvmesh-sparse-shares 1\nshape 2 3\nlayer 0 1 1\n", "line 3: 2 shares, not 3"},
        {"kvmesh-sparse-shares 1\nshape 2 3\nlayer 0 1 1 1 1\n", "line 3: more than 3"},
        {"kvmesh-sparse-shares 1\nshape 2 3\nlayer 0 1 -1 1\n", "share `-1`"},
        {"kvmesh-sparse-shares 1\nshape 2 3\nlayer 0 1 nan 1\n", "share `nan`"},
        {"kvmesh-sparse-shares 1\nshape 2 3\nlayer 0 1 inf 1\n", "share `inf`"},
        {"kvmesh-sparse-shares 1\nshape 2 3\nlayer 0 1 1e9 1\n", "share `1e9`"},
        {"kvmesh-sparse-shares 1\nshape 2 3\nlayer 0 1 2x 1\n", "share `2x`"},
        {"kvmesh-sparse-shares 1\nshape 2 3\nlayer 0 0 0 0\nlayer 1 0 0 0\n", "every share is 0"},
        {"kvmesh-sparse-shares 1\nshape 2 3\nlayers 0 1 1 1\n", "line 3"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        float s[6];
        km_errbuf err = {{0}};
        cr_assert_eq(parse(bad[i].text, s, &err), KM_EINVAL, "case %zu accepted", i);
        cr_assert(strstr(err.msg, bad[i].says), "case %zu: \"%s\" lacks \"%s\"", i, err.msg,
                  bad[i].says);
    }
    char big[2048];
    memset(big, '#', sizeof big - 1);
    big[sizeof big - 1] = 0;
    float s[6];
    km_errbuf err = {{0}};
    cr_assert_eq(parse(big, s, &err), KM_EINVAL);
    cr_assert(strstr(err.msg, "line 1: longer than"), "%s", err.msg);
    const char nul[] = "kvmesh-sparse-shares 1\0\n";
    cr_assert_eq(en_sparse_shares_parse(nul, sizeof nul - 1, 2, 3, s, &err), KM_EINVAL);
}

Test(sparse_budget, a_written_file_reads_back_for_its_model_and_not_for_a_missing_path,
     .init = setup, .fini = teardown)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    const en_hparams *hp = en_model_hparams(g_model);
    const int heads = hp->n_layers * hp->n_head_kv;
    float *s = malloc(sizeof(float) * heads), *back = NULL;
    for (int i = 0; i < heads; i++) s[i] = (float)(3 + i % 7) * 0.5f;
    char path[] = "/tmp/kvmesh-shares-XXXXXX";
    const int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    FILE *f = fdopen(fd, "w");
    cr_assert_eq(en_sparse_shares_write(f, g_model, s, "two lines\nof comment"), 0);
    fclose(f);
    km_errbuf err = {{0}};
    cr_assert_eq(en_sparse_shares_load(path, g_model, &back, &err), 0, "%s", err.msg);
    cr_assert_arr_eq(back, s, sizeof(float) * heads);
    unlink(path);
    free(back);
    cr_assert_eq(en_sparse_shares_load(path, g_model, &back, &err), KM_EIO);
    cr_assert(strstr(err.msg, path), "%s", err.msg);
    cr_assert_null(back);
    free(s);
}
