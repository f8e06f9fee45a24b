/*
 * test_engine_blend.c — chunk reuse (engine/blend.c, docs/blend.md) with the real model: a key
 * re-rotated to a new position is the key computed there (up to rounding: float, then each KV
 * format's own quantization); a chunk reused at the start of a prompt gives full recomputation's
 * logits; elsewhere, recomputing tokens brings the logits closer to full recomputation than
 * reusing alone (MoE layers too); a blend prefill run in pieces gives one pass's logits bit for
 * bit; chunk pages are cached per tenant, apart from prefix chains; bad segments are refused.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/engine.h"
#include "tests/unit/model_fixture.h"

static en_engine *engine(kv_format f)
{
    en_engine_opts o = {.n_threads = 2, .max_batch_tokens = 256, .kv_format = f};
    en_engine *e;
    km_errbuf err = {{0}};
    cr_assert_eq(en_engine_create(g_model, &o, &e, &err), 0, "%s", err.msg);
    return e;
}

static int encode(const char *text, int32_t *out, int max)
{
    int n = md_tok_encode(en_model_tokenizer(g_model), text, strlen(text), 0, 0, out, max);
    cr_assert(n > 0 && n <= max);
    return n;
}

/* Every position of ids computed through every layer into q; the last one's logits copied. */
static void prefill(en_engine *e, kv_seq *q, const int32_t *ids, int n, float *logits)
{
    const float *lg = NULL;
    en_blend_stats st;
    cr_assert_eq(en_blend_prefill(e, q, ids, n, 0, NULL, 0, NULL, &st, &lg), 0);
    cr_assert_eq(st.computed, n);
    if (logits) memcpy(logits, lg, sizeof(float) * en_model_hparams(g_model)->n_vocab);
}

/* KL(p || q) of the softmaxes of two logit rows. */
static double kl(const float *p, const float *q, int n)
{
    double mp = -INFINITY, mq = -INFINITY, sp = 0, sq = 0, d = 0;
    for (int i = 0; i < n; i++) mp = fmax(mp, p[i]), mq = fmax(mq, q[i]);
    for (int i = 0; i < n; i++) sp += exp(p[i] - mp), sq += exp(q[i] - mq);
    for (int i = 0; i < n; i++) {
        const double lp = p[i] - mp - log(sp), lq = q[i] - mq - log(sq);
        d += exp(lp) * (lp - lq);
    }
    return d;
}

Test(engine_blend, rerotation_is_rope_at_the_new_position, .init = setup, .fini = teardown)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    const en_hparams *hp = en_model_hparams(g_model);
    en_engine *e = engine(KN_KV_F16);
    const int kvd = hp->n_head_kv * hp->head_dim;
    const int moves[][2] = {{0, 37}, {5, 1000}, {900, 3}, {0, 4000}, {2047, 2048}};
    float x[1024], a[1024], b[1024], cs[256];
    cr_assert(kvd <= 1024 && hp->n_rot <= 256);
    for (int i = 0; i < kvd; i++) x[i] = sinf(0.37f * (float)i) * (1.0f + (float)(i % 7));
    for (size_t m = 0; m < sizeof moves / sizeof moves[0]; m++) {
        memcpy(a, x, sizeof(float) * kvd), memcpy(b, x, sizeof(float) * kvd);
        kn_rope_cache(cs, hp->n_rot, moves[m][0], hp->rope_base);
        kn_ops_best()->rope(a, hp->n_head_kv, hp->head_dim, hp->n_rot, cs, hp->rope_neox);
        en_blend_rerotate(e, a, moves[m][0], moves[m][1]);
        kn_rope_cache(cs, hp->n_rot, moves[m][1], hp->rope_base);
        kn_ops_best()->rope(b, hp->n_head_kv, hp->head_dim, hp->n_rot, cs, hp->rope_neox);
        double err = 0;
        for (int i = 0; i < kvd; i++) err = fmax(err, fabs(a[i] - b[i]));
        cr_log_info("%d -> %d: %.2e", moves[m][0], moves[m][1], err);
        /* float angles pos * theta_i are off by ~1e-7 x pos radians; |x| <= 7 */
        const int far = moves[m][0] > moves[m][1] ? moves[m][0] : moves[m][1];
        cr_expect_leq(err, 7 * 1e-6 * (far + 64), "%d -> %d", moves[m][0], moves[m][1]);
    }
    en_engine_destroy(e);
}

/* Layer 0 sees no context: a chunk's layer-0 K/V copied from where it was computed alone to
 * another position equal those computed there, up to the format's rounding of the rotated K
 * (relative to the row's largest |k|: the format's step). */
static void layer0_equal(kv_format f, double k_tol, double v_tol)
{
    const en_hparams *hp = en_model_hparams(g_model);
    en_engine *e = engine(f);
    kv_store *kv = en_engine_kv(e);
    int32_t ids[160];
    const int np = encode("Before anything else, a preface of unrelated words that shifts the "
                          "chunk to a new place in the prompt.",
                          ids, 64);
    const int nc = encode("The licensee may copy and distribute verbatim copies of the program's "
                          "source code as received, in any medium, provided that each copy "
                          "carries an appropriate copyright notice.",
                          ids + np, 96);
    kv_seq *alone, *full, *moved;
    cr_assert_eq(kv_seq_create(kv, &alone), 0);
    cr_assert_eq(kv_seq_create(kv, &full), 0);
    cr_assert_eq(kv_seq_create(kv, &moved), 0);
    prefill(e, alone, ids + np, nc, NULL);
    prefill(e, full, ids, np + nc, NULL);
    cr_assert_eq(en_blend_copy(e, alone, 0, moved, np, nc), 0);
    double kerr = 0, verr = 0;
    float k0[256], v0[256], k1[256], v1[256];
    for (int i = 0; i < nc; i++)
        for (int h = 0; h < hp->n_head_kv; h++) {
            cr_assert_eq(kv_seq_read(kv, full, 0, h, np + i, k0, v0), 0);
            cr_assert_eq(kv_seq_read(kv, moved, 0, h, np + i, k1, v1), 0);
            float km = 1e-6f, vm = 1e-6f;
            for (int d = 0; d < hp->head_dim; d++)
                km = fmaxf(km, fabsf(k0[d])), vm = fmaxf(vm, fabsf(v0[d]));
            for (int d = 0; d < hp->head_dim; d++) {
                kerr = fmax(kerr, fabs(k0[d] - k1[d]) / km);
                verr = fmax(verr, fabs(v0[d] - v1[d]) / vm);
            }
        }
    cr_log_info("%s: re-rotated K within %.2e, V within %.2e of the row's largest",
                kv_format_name(f), kerr, verr);
    cr_expect_leq(kerr, k_tol, "%s K", kv_format_name(f));
    cr_expect_leq(verr, v_tol, "%s V", kv_format_name(f));
    kv_seq_destroy(kv, alone);
    kv_seq_destroy(kv, full);
    kv_seq_destroy(kv, moved);
    en_engine_destroy(e);
}

Test(engine_blend, copied_keys_equal_recomputed_per_format, .init = setup, .fini = teardown,
     .timeout = 300)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    layer0_equal(KN_KV_F16, 2e-3, 0);     /* f16: 2^-11 relative, once more on the rotated K */
    layer0_equal(KN_KV_BF16, 2e-2, 0);    /* bf16: 2^-8 */
    layer0_equal(KN_KV_INT8, 2e-2, 1e-2); /* int8: 1/127 of the row scale, twice */
}

/* Prompt pieces for the blend tests: a system line, two documents, a question. */
static const char *k_sys = "You answer questions about the documents below.";
static const char *k_doc1 =
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this "
    "software and associated documentation files, to deal in the Software without restriction, "
    "including without limitation the rights to use, copy, modify, merge and publish it.";
static const char *k_doc2 =
    "This library is free software; you can redistribute it and/or modify it under the terms of "
    "the GNU Lesser General Public License as published by the Free Software Foundation; either "
    "version 2.1 of the License, or any later version.";
static const char *k_q = " Question: which document lets anyone merge the software? Answer:";

Test(engine_blend, chunk_at_the_start_is_full_recomputation, .init = setup, .fini = teardown,
     .timeout = 300)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    const int nv = en_model_hparams(g_model)->n_vocab;
    en_engine *e = engine(KN_KV_F16);
    kv_store *kv = en_engine_kv(e);
    int32_t ids[256];
    const int nd = encode(k_doc1, ids, 128), nq = encode(k_q, ids + nd, 64), n = nd + nq;
    float *full = malloc(sizeof(float) * nv), *blend = malloc(sizeof(float) * nv);
    kv_seq *q, *c;
    cr_assert_eq(kv_seq_create(kv, &q), 0);
    prefill(e, q, ids, n, full);
    kv_seq_destroy(kv, q);

    const en_blend_key key = {.seed = en_blend_chunk_seed(km_pagehash_seed(NULL, 0, 7, "t", 1))};
    cr_assert_eq(en_blend_chunk_store(e, &key, ids, nd), 0);
    const int held = en_blend_chunk_attach(e, &key, ids, nd, &c);
    cr_assert_eq(held, nd / 16 * 16, "held %d of %d", held, nd);
    cr_assert_eq(kv_seq_create(kv, &q), 0);
    cr_assert_eq(en_blend_copy(e, c, 0, q, 0, held), 0);
    const en_blend_seg seg = {0, held};
    en_blend_stats st;
    const float *lg;
    for (int f = 0; f < 2; f++) { /* fraction 0 and 0.5: the same, nothing drifted */
        const en_blend_opts o = {.fraction = f ? 0.5f : 0, .reuse_last = 1};
        if (f) {
            kv_seq_destroy(kv, q);
            cr_assert_eq(kv_seq_create(kv, &q), 0);
            cr_assert_eq(en_blend_copy(e, c, 0, q, 0, held), 0);
        }
        cr_assert_eq(en_blend_prefill(e, q, ids, n, 0, &seg, 1, &o, &st, &lg), 0);
        memcpy(blend, lg, sizeof(float) * nv);
        cr_assert_eq(st.reused, held);
        cr_assert_eq(st.computed, n - held);
        cr_assert_eq(en_argmax(blend, nv), en_argmax(full, nv));
        for (int v = 0; v < nv; v++) cr_assert_float_eq(blend[v], full[v], 2e-3f, "logit %d", v);
    }
    kv_seq_destroy(kv, q);
    kv_seq_destroy(kv, c);
    free(full);
    free(blend);
    en_engine_destroy(e);
}

/* Largest difference between two sequences' K/V of layer l over positions [0, n). */
static float kv_diff(kv_store *kv, const kv_seq *a, const kv_seq *b, int l, int n)
{
    const en_hparams *hp = en_model_hparams(g_model);
    float ka[64], va[64], kb[64], vb[64], d = 0;
    cr_assert_leq(hp->head_dim, 64);
    for (int i = 0; i < n; i++)
        for (int h = 0; h < hp->n_head_kv; h++) {
            cr_assert_eq(kv_seq_read(kv, a, l, h, i, ka, va), 0);
            cr_assert_eq(kv_seq_read(kv, b, l, h, i, kb, vb), 0);
            for (int j = 0; j < hp->head_dim; j++)
                d = fmaxf(d, fmaxf(fabsf(ka[j] - kb[j]), fabsf(va[j] - vb[j])));
        }
    return d;
}

/* en_batch.depth_kv (the probe): tokens of depth d also write layer d's K/V, those a full
 * computation writes there; without it, layer d is not written. */
/* The logits of ids' last token, every token computed (in a sequence of its own). */
static void full_logits(en_engine *e, const int32_t *ids, int n, float *out)
{
    kv_seq *q;
    cr_assert_eq(kv_seq_create(en_engine_kv(e), &q), 0);
    prefill(e, q, ids, n, out);
    kv_seq_destroy(en_engine_kv(e), q);
}

/* The two-document prompt of the tests below: the system line, doc2, doc1, the question; *ns is
 * the system line's length, len the documents'. Returns the prompt's. */
static int two_docs(int32_t *ids, int *ns, int *len)
{
    *ns = encode(k_sys, ids, 64);
    len[0] = encode(k_doc2, ids + *ns, 128);
    len[1] = encode(k_doc1, ids + *ns + len[0], 128);
    return *ns + len[0] + len[1] + encode(k_q, ids + *ns + len[0] + len[1], 64);
}

/* Its documents cached alone (each at a position other than its place) and attached: c[d] holds
 * document d's pages, seg[d] its place in the prompt and the tokens held. */
static void store_docs(en_engine *e, const int32_t *ids, int ns, const int *len, en_blend_seg *seg,
                       kv_seq **c)
{
    const en_blend_key key = {.seed = en_blend_chunk_seed(km_pagehash_seed(NULL, 0, 7, NULL, 0))};
    const int at[2] = {ns, ns + len[0]};
    for (int d = 0; d < 2; d++) {
        cr_assert_eq(en_blend_chunk_store(e, &key, ids + at[d], len[d]), 0);
        seg[d] = (en_blend_seg){at[d], en_blend_chunk_attach(e, &key, ids + at[d], len[d], &c[d])};
        cr_assert_gt(seg[d].n, 0);
    }
}

Test(engine_blend, depth_kv_writes_the_next_layers_kv_and_no_more, .init = setup, .fini = teardown,
     .timeout = 300)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    en_engine *e = engine(KN_KV_F16);
    kv_store *kv = en_engine_kv(e);
    int32_t ids[128], pos[128];
    int16_t depth[128];
    uint8_t want[128] = {0};
    kv_seq *a, *b[2], *sb[2][128];
    const int n = encode(k_doc1, ids, 128);
    cr_assert_eq(kv_seq_create(kv, &a), 0);
    prefill(e, a, ids, n, NULL);
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(kv_seq_create(kv, &b[k]), 0);
        for (int i = 0; i < n; i++) pos[i] = i, depth[i] = 1, sb[k][i] = b[k];
        const en_batch bt = {.n_tokens = n,
                             .tokens = ids,
                             .pos = pos,
                             .seqs = sb[k],
                             .logits = want,
                             .depth = depth,
                             .depth_kv = k};
        cr_assert_geq(en_engine_step(e, &bt, NULL), 0);
        cr_assert_float_eq(kv_diff(kv, a, b[k], 0, n), 0, 1e-3f, "layer 0 computed");
    }
    cr_assert_float_eq(kv_diff(kv, a, b[1], 1, n), 0, 1e-3f, "depth_kv: layer 1's K/V written");
    cr_assert_gt(kv_diff(kv, a, b[0], 1, n), 0.1f, "without it, layer 1 not written");
    cr_assert_gt(kv_diff(kv, a, b[1], 2, n), 0.1f, "nor layer 2 with it");
    kv_seq_destroy(kv, a);
    kv_seq_destroy(kv, b[0]);
    kv_seq_destroy(kv, b[1]);
    en_engine_destroy(e);
}

Test(engine_blend, recompute_moves_toward_full_recomputation, .init = setup, .fini = teardown,
     .timeout = 600)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    const en_hparams *hp = en_model_hparams(g_model);
    const int nv = hp->n_vocab;
    en_engine *e = engine(KN_KV_F16);
    kv_store *kv = en_engine_kv(e);
    int32_t ids[512];
    int ns, len[2];
    const int n = two_docs(ids, &ns, len);
    float *full = malloc(sizeof(float) * nv), *blend = malloc(sizeof(float) * nv);
    kv_seq *q, *c[2];
    full_logits(e, ids, n, full);
    /* the documents cached alone (doc1 first: both at positions other than here) */
    en_blend_seg seg[2];
    store_docs(e, ids, ns, len, seg, c);
    const float fr[] = {0, 0.15f, 1};
    double d[3];
    int recomputed[3];
    for (int f = 0; f < 3; f++) {
        cr_assert_eq(kv_seq_create(kv, &q), 0);
        for (int s = 0; s < 2; s++)
            cr_assert_eq(en_blend_copy(e, c[s], 0, q, seg[s].start, seg[s].n), 0);
        const en_blend_opts o = {.fraction = fr[f], .reuse_last = 1};
        en_blend_stats st;
        const float *lg;
        /* the system line is a prefix computed earlier */
        prefill(e, q, ids, ns, NULL);
        cr_assert_eq(en_blend_prefill(e, q, ids, n, ns, seg, 2, &o, &st, &lg), 0);
        memcpy(blend, lg, sizeof(float) * nv);
        for (int v = 0; v < nv; v++) cr_assert(isfinite(blend[v]));
        d[f] = kl(full, blend, nv), recomputed[f] = st.recomputed;
        cr_assert_eq(st.reused, seg[0].n + seg[1].n);
        cr_log_info("fraction %.2f: %d of %d reused tokens recomputed, %ld token-layers, "
                    "KL to full %.4f",
                    fr[f], st.recomputed, st.reused, st.token_layers, d[f]);
        kv_seq_destroy(kv, q);
    }
    const int reused = seg[0].n + seg[1].n;
    cr_expect_eq(recomputed[0], 0);
    /* twice the mean share in the first layer past the probe */
    int first = 0; /* rank r goes past the probe when r < 2 x fraction x reused */
    while (first < reused && first < 2.0 * fr[1] * reused) first++;
    cr_expect_eq(recomputed[1], first);
    cr_expect_eq(recomputed[2], reused);
    cr_expect_lt(d[2], d[0], "recomputing everything past half the layers beats reuse alone");
    cr_expect_lt(d[1], d[0], "recomputing 15%% beats reuse alone");
    /* by default the last chunk, the one the question follows, is computed in full */
    cr_assert_eq(kv_seq_create(kv, &q), 0);
    for (int s = 0; s < 2; s++)
        cr_assert_eq(en_blend_copy(e, c[s], 0, q, seg[s].start, seg[s].n), 0);
    prefill(e, q, ids, ns, NULL);
    en_blend_stats st;
    const float *lg;
    const en_blend_opts o = {.fraction = 0};
    cr_assert_eq(en_blend_prefill(e, q, ids, n, ns, seg, 2, &o, &st, &lg), 0);
    const double d_last = kl(full, lg, nv);
    cr_log_info("fraction 0, last chunk computed: %d reused, KL to full %.4f", st.reused, d_last);
    cr_expect_eq(st.reused, seg[0].n);
    cr_expect_eq(st.computed, n - ns - seg[0].n);
    cr_expect_lt(d_last, d[0], "computing the last chunk beats reusing it");
    kv_seq_destroy(kv, q);
    for (int s = 0; s < 2; s++) kv_seq_destroy(kv, c[s]);
    free(full);
    free(blend);
    en_engine_destroy(e);
}

/* en_blend_run in small pieces, the prompt after the last chunk then prefilled apart: the logits
 * of one en_blend_prefill, bit for bit (what lets the scheduler cut a blend prefill). */
Test(engine_blend, a_prefill_in_pieces_is_the_prefill_in_one_pass, .init = setup, .fini = teardown,
     .timeout = 600)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    const int nv = en_model_hparams(g_model)->n_vocab;
    en_engine *e = engine(KN_KV_F16);
    kv_store *kv = en_engine_kv(e);
    int32_t ids[512];
    int ns, len[2];
    const int n = two_docs(ids, &ns, len);
    en_blend_seg seg[2];
    kv_seq *c[2], *q[2];
    store_docs(e, ids, ns, len, seg, c);
    const en_blend_opts o = {.fraction = 0.15f, .reuse_last = 1};
    const int end = seg[1].start + seg[1].n;
    float *one = malloc(sizeof(float) * nv);
    en_blend_stats st[2];
    const float *lg = NULL;
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(kv_seq_create(kv, &q[k]), 0);
        for (int s = 0; s < 2; s++)
            cr_assert_eq(en_blend_copy(e, c[s], 0, q[k], seg[s].start, seg[s].n), 0);
        prefill(e, q[k], ids, ns, NULL);
    }
    cr_assert_eq(en_blend_prefill(e, q[0], ids, n, ns, seg, 2, &o, &st[0], &lg), 0);
    memcpy(one, lg, sizeof(float) * nv);
    en_blend_run *b;
    cr_assert_eq(en_blend_run_begin(e, q[1], ids, n, ns, end, seg, 2, &o, &b), 0);
    /* priced: a probe token counts 2 layers (layer 0 and the probe layer's K/V) */
    const double L = en_model_hparams(g_model)->n_layers;
    double cost;
    cr_assert_eq(en_blend_run_price(b, 1000, 1, 0, 14 / L, &cost), 14, "7 probe tokens fit");
    cr_assert_float_eq(cost, 14 / L, 1e-9);
    cr_assert_eq(en_blend_run_price(b, 1000, 1, 0, 0, &cost), 2, "one token at least");
    int pieces = 0;
    while (!en_blend_run_done(b)) {
        double per_token, per_pos;
        const long p1 = en_blend_run_price(b, 40, 1, 0, INFINITY, &per_token);
        const long p2 = en_blend_run_price(b, 40, 0, 1, INFINITY, &per_pos);
        const long tl = en_blend_run_step(b, 40, NULL);
        cr_assert_eq(p1, tl, "the price is of what the step runs");
        cr_assert_eq(p2, tl);
        cr_assert_float_eq(per_token, tl / L, 1e-9);
        cr_assert_geq(per_pos, (ns + 1) * per_token - 1e-6, "at the tokens' own positions");
        cr_assert_gt(tl, 0, "a piece runs at least a token");
        cr_assert_leq(tl, 40, "of at most 40 token-layers (a token has at most 30)");
        pieces++;
    }
    cr_assert_eq(en_blend_run_step(b, 40, NULL), 0, "nothing after the end");
    cr_assert_eq(en_blend_run_price(b, 40, 1, 1, INFINITY, &cost), 0);
    en_blend_run_end(b, &st[1]);
    cr_assert_gt(pieces, 8, "in many pieces (%d)", pieces);
    cr_assert_eq(st[1].reused, st[0].reused);
    cr_assert_eq(st[1].recomputed, st[0].recomputed);
    cr_assert_eq(st[1].computed, st[0].computed - (n - end));
    lg = NULL;
    cr_assert_eq(en_blend_prefill(e, q[1], ids, n, end, NULL, 0, NULL, NULL, &lg), 0);
    cr_assert_arr_eq(lg, one, sizeof(float) * nv, "the same logits, bit for bit");
    for (int k = 0; k < 2; k++) kv_seq_destroy(kv, q[k]);
    for (int s = 0; s < 2; s++) kv_seq_destroy(kv, c[s]);
    free(one);
    en_engine_destroy(e);
}

/* A blend prefill of an MoE model: the prompt ids, the chunks stored and
 * copied in as in the tests above, then en_blend_prefill with o; the last token's logits. */
static void moe_blend(en_engine *e, const int32_t *ids, int n, int ns, const en_blend_seg *seg,
                      kv_seq *const *c, const en_blend_opts *o, int piece, float *out)
{
    kv_store *kv = en_engine_kv(e);
    kv_seq *q;
    cr_assert_eq(kv_seq_create(kv, &q), 0);
    for (int s = 0; s < 2; s++)
        cr_assert_eq(en_blend_copy(e, c[s], 0, q, seg[s].start, seg[s].n), 0);
    prefill(e, q, ids, ns, NULL);
    const float *lg = NULL;
    if (!piece) {
        cr_assert_eq(en_blend_prefill(e, q, ids, n, ns, seg, 2, o, NULL, &lg), 0);
    } else { /* in pieces of `piece` (token, layer) pairs, then the question apart */
        en_blend_run *b;
        const int end = seg[1].start + seg[1].n;
        cr_assert_eq(en_blend_run_begin(e, q, ids, n, ns, end, seg, 2, o, &b), 0);
        while (!en_blend_run_done(b)) cr_assert_gt(en_blend_run_step(b, piece, NULL), 0);
        en_blend_run_end(b, NULL);
        cr_assert_eq(en_blend_prefill(e, q, ids, n, end, NULL, 0, NULL, NULL, &lg), 0);
    }
    memcpy(out, lg, sizeof(float) * en_model_hparams(g_model)->n_vocab);
    kv_seq_destroy(kv, q);
}

/* MoE layers take the blend path (en_batch.depth: each layer's experts run for the tokens still
 * active there), on the mirror model (top 4 of 8, sparse routing that rounding cannot flip
 * into another output): everything recomputed through it (the probe at the last layer) is full
 * recomputation; mixed depths give one pass's logits in pieces, and move toward full. */
Test(engine_blend, moe_layers_take_the_blend_path, .init = setup, .fini = teardown, .timeout = 600)
{
    const char *path = "models/SmolLM2-135M-Instruct-MoE8-top4-mirror.Q4_1.gguf";
    if (!g_model || access(path, R_OK)) cr_skip_test("%s absent: run `make deps`", path);
    en_model *dense = g_model;
    km_errbuf err = {{0}};
    cr_assert_eq(en_model_load(path, &g_model, &err), 0, "%s", err.msg); /* the helpers' model */
    const en_hparams *hp = en_model_hparams(g_model);
    const int nv = hp->n_vocab;
    cr_assert_gt(hp->n_expert, 0);
    en_engine *e = engine(KN_KV_F16);
    kv_store *kv = en_engine_kv(e);
    int32_t ids[512];
    int ns, len[2];
    const int n = two_docs(ids, &ns, len);
    float *full = malloc(sizeof(float) * nv), *lg[4];
    for (int k = 0; k < 4; k++) lg[k] = malloc(sizeof(float) * nv);
    kv_seq *c[2];
    full_logits(e, ids, n, full);
    en_blend_seg seg[2];
    store_docs(e, ids, ns, len, seg, c);
    const en_blend_opts all = {.fraction = 1, .probe_layer = hp->n_layers - 1, .reuse_last = 1},
                        none = {.reuse_last = 1}, half = {.fraction = 0.5f, .reuse_last = 1};
    moe_blend(e, ids, n, ns, seg, c, &all, 0, lg[0]);
    moe_blend(e, ids, n, ns, seg, c, &none, 0, lg[1]);
    moe_blend(e, ids, n, ns, seg, c, &half, 0, lg[2]);
    moe_blend(e, ids, n, ns, seg, c, &half, 40, lg[3]);
    float worst = 0;
    for (int v = 0; v < nv; v++) worst = fmaxf(worst, fabsf(lg[0][v] - full[v]));
    const double d0 = kl(full, lg[1], nv), d5 = kl(full, lg[2], nv);
    cr_log_info("MoE: all recomputed within %.2e of full; KL to full: reuse %.4f, half %.4f", worst,
                d0, d5);
    cr_expect_leq(worst, 1e-3f, "everything recomputed is full recomputation");
    cr_expect_arr_eq(lg[3], lg[2], sizeof(float) * nv, "in pieces: one pass's logits, bit for bit");
    cr_expect_lt(d5, d0, "recomputing half beats reuse alone");
    for (int s = 0; s < 2; s++) kv_seq_destroy(kv, c[s]);
    for (int k = 0; k < 4; k++) free(lg[k]);
    free(full);
    en_engine_destroy(e);
    en_model_free(g_model);
    g_model = dense;
}

Test(engine_blend, chunks_stay_with_their_tenant_and_apart_from_prefixes, .init = setup,
     .fini = teardown, .timeout = 300)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    en_engine *e = engine(KN_KV_F16);
    kv_store *kv = en_engine_kv(e);
    int32_t ids[128];
    const int nd = encode(k_doc1, ids, 128);
    const km_pagehash ta = km_pagehash_seed(NULL, 0, 7, "a", 1),
                      tb = km_pagehash_seed(NULL, 0, 7, "b", 1);
    const en_blend_key ka = {.seed = en_blend_chunk_seed(ta)},
                       kb = {.seed = en_blend_chunk_seed(tb)};
    cr_assert_eq(en_blend_chunk_store(e, &ka, ids, nd), 0);
    kv_seq *c;
    cr_assert_eq(en_blend_chunk_attach(e, &kb, ids, nd, &c), 0);
    cr_assert_null(c);
    km_pagehash h[8];
    const int np = km_pagehash_chain(ta, ids, nd, 16, h, 8);
    cr_assert_eq(kv_store_held(kv, h, ids, np, NULL), 0, "a chunk is no prefix");
    /* a chunk whose second page differs is served its first page only */
    int32_t other[128];
    memcpy(other, ids, sizeof(int32_t) * nd);
    other[20] ^= 1;
    cr_assert_eq(en_blend_chunk_attach(e, &ka, other, nd, &c), 16);
    kv_seq_destroy(kv, c);
    cr_assert_eq(en_blend_chunk_attach(e, &ka, ids, nd, &c), nd / 16 * 16);
    kv_seq_destroy(kv, c);
    /* after a preamble: another chain; the chunk's tokens held past the preamble */
    int32_t pre[16];
    for (int i = 0; i < 16; i++) pre[i] = 198;
    const en_blend_key kp = {ka.seed, pre, 16}, bad = {ka.seed, pre, 5};
    cr_assert_eq(en_blend_chunk_attach(e, &kp, ids, nd, &c), 0);
    cr_assert_eq(en_blend_chunk_store(e, &kp, ids, nd), 0);
    cr_assert_eq(en_blend_chunk_attach(e, &kp, ids, nd, &c), nd / 16 * 16);
    kv_seq_destroy(kv, c);
    /* a second chunk after the same preamble: cached in full too (the preamble page is shared) */
    cr_assert_eq(en_blend_chunk_store(e, &kp, other, nd), 0);
    cr_assert_eq(en_blend_chunk_attach(e, &kp, other, nd, &c), nd / 16 * 16);
    kv_seq_destroy(kv, c);
    cr_assert_eq(en_blend_chunk_attach(e, &kp, ids, nd, &c), nd / 16 * 16);
    float k0[64], v0[64], k1[64], v1[64];
    kv_seq *plain;
    cr_assert_eq(en_blend_chunk_attach(e, &ka, ids, nd, &plain), nd / 16 * 16);
    cr_assert_eq(kv_seq_read(kv, c, 0, 0, 16, k0, v0), 0);
    cr_assert_eq(kv_seq_read(kv, plain, 0, 0, 0, k1, v1), 0);
    cr_assert_arr_eq(v0, v1, sizeof v0, "the chunk's first token sits past the preamble");
    kv_seq_destroy(kv, c);
    kv_seq_destroy(kv, plain);
    cr_assert_eq(en_blend_chunk_store(e, &bad, ids, nd), KM_EINVAL, "not a whole page");
    en_engine_destroy(e);
}

Test(engine_blend, bad_segments_are_refused, .init = setup, .fini = teardown)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    en_engine *e = engine(KN_KV_F16);
    kv_store *kv = en_engine_kv(e);
    kv_seq *q;
    cr_assert_eq(kv_seq_create(kv, &q), 0);
    int32_t ids[64];
    for (int i = 0; i < 64; i++) ids[i] = 100 + i;
    const en_blend_seg bad[][2] = {
        {{10, 0}, {30, 4}},  /* empty */
        {{10, 10}, {15, 4}}, /* overlapping */
        {{30, 4}, {10, 4}},  /* out of order */
        {{50, 14}, {0, 0}},  /* past the prompt's last token */
        {{2, 4}, {0, 0}},    /* inside what the sequence holds already */
    };
    const int nseg[] = {2, 2, 2, 1, 1};
    for (size_t i = 0; i < sizeof nseg / sizeof nseg[0]; i++)
        cr_expect_eq(en_blend_prefill(e, q, ids, 64, 8, bad[i], nseg[i], NULL, NULL, NULL),
                     KM_EINVAL, "case %zu", i);
    kv_seq_destroy(kv, q);
    en_engine_destroy(e);
}
