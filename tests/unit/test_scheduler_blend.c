/*
 * test_scheduler_blend.c — chunks served by the scheduler (en_sched_req.chunks, scheduler_blend.c,
 * docs/blend.md "Serving") with the real model: a chunk seen first is computed with its prompt
 * and stored after the request, so the next prompt that carries it elsewhere reuses it; the pages
 * from the first reused chunk on are never published as prefix pages; chunks never cross
 * tenants; a stale chunk page (its hash, another chunk's tokens) is caught by token-id
 * verification and the chunk computed in full; an MoE model reuses chunks as the dense one does;
 * bad segments are refused at submit.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/engine.h"
#include "tests/unit/model_fixture.h"

TestSuite(sched_blend, .init = setup, .fini = teardown, .timeout = 300);

/* What one request gave back. */
typedef struct got {
    int32_t tok[16];
    int n, done, error;
    en_sched_usage u;
} got;

static int on_token(void *ctx, void *user, int index, int32_t token)
{
    got *g = user;
    if (g->n < 16) g->tok[g->n++] = token;
    return 0;
}

static void on_done(void *ctx, void *user, km_finish f, const en_sched_usage *u)
{
    got *g = user;
    g->done = 1;
    g->u = *u;
}

static void on_error(void *ctx, void *user, int code, const char *m, const en_sched_usage *u)
{
    got *g = user;
    g->error = code;
    g->u = *u;
}

static const char *k_doc[3] = {
    "The quick brown fox jumps over the lazy dog near the river bank, where the old miller keeps "
    "his wheel turning through the long summer days and the children watch the water.",
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this software "
    "and associated documentation files, to deal in the software without restriction.",
    "In the beginning the universe was created. This has made a lot of people very angry and "
    "been widely regarded as a bad move, said the book that travellers carry everywhere."};

static int encode(const char *s, int32_t *out, int max)
{
    int n = md_tok_encode(en_model_tokenizer(g_model), s, strlen(s), 0, 1, out, max);
    cr_assert_gt(n, 0);
    return n < max ? n : max;
}

/* A prompt: a lead line, the documents in the order given (each a chunk), a question (a chunk
 * too: the last chunk is computed in full, docs/blend.md "Quality", so the documents are not). */
typedef struct prompt {
    int32_t ids[512];
    int n;
    en_blend_seg seg[4];
    int n_seg;
} prompt;

static void build(prompt *p, const char *lead, const int *order, int nd, const char *question)
{
    p->n = encode(lead, p->ids, 512);
    p->n_seg = 0;
    for (int i = 0; i < nd; i++) {
        int n = encode(k_doc[order[i]], p->ids + p->n, 512 - p->n);
        p->seg[p->n_seg++] = (en_blend_seg){p->n, n};
        p->n += n;
    }
    int n = encode(question, p->ids + p->n, 512 - p->n);
    p->seg[p->n_seg++] = (en_blend_seg){p->n, n};
    p->n += n;
}

/* Two prompts with the first two documents in opposite orders after different lead lines. */
static void two_prompts(prompt *a, prompt *b)
{
    const int ab[2] = {0, 1}, ba[2] = {1, 0};
    build(a, "Read the two texts below.", ab, 2, " Which animal jumps?");
    build(b, "Here are two documents, answer after them.", ba, 2, " What is granted?");
}

/* kv_bytes 0: the engine's default store; fraction < -1: the default recompute fraction;
 * prefill_chunk 0: max_batch_tokens. */
static en_sched *sched_opts(en_engine **e, size_t kv_bytes, float fraction, int prefill_chunk)
{
    en_engine_opts eo = {.n_threads = 2, .max_batch_tokens = 256, .kv_bytes = kv_bytes};
    km_errbuf err = {{0}};
    cr_assert_eq(en_engine_create(g_model, &eo, e, &err), 0, "%s", err.msg);
    en_sched_opts so = {.max_batch_tokens = 256, .prefill_chunk = prefill_chunk, .cluster_seed = 7};
    if (fraction >= -1) so.blend_fraction = fraction, so.blend_fraction_set = 1;
    so.spec.cost_fixed = true; /* drafts (so pages and preemptions) not priced by timed steps */
    en_sched_cb cb = {.on_token = on_token, .on_done = on_done, .on_error = on_error};
    en_sched *s;
    cr_assert_eq(en_sched_create(*e, g_model, &so, &cb, &s, &err), 0, "%s", err.msg);
    return s;
}

static en_sched *sched_kv(en_engine **e, size_t kv_bytes)
{
    return sched_opts(e, kv_bytes, -2, 0);
}

static en_sched *sched(en_engine **e)
{
    return sched_kv(e, 0);
}

/* Runs one greedy request of 4 tokens to its end, then the chunk stores it queued. */
static got run(en_sched *s, const prompt *p, int chunks, const char *salt)
{
    got g = {0};
    en_sched_req q = {.tokens = p->ids,
                      .n_tokens = p->n,
                      .max_tokens = 4,
                      .chunks = chunks ? p->seg : NULL,
                      .n_chunks = chunks ? p->n_seg : 0,
                      .cache_salt = salt,
                      .cache_salt_len = salt ? strlen(salt) : 0,
                      .user = &g};
    en_sample_params_default(&q.sample);
    q.sample.temperature = 0;
    cr_assert_eq(en_sched_submit(s, &q, NULL), 0);
    for (int i = 0; i < 1000 && (en_sched_pending(s) || en_sched_chunks_waiting(s)); i++)
        cr_assert_geq(en_sched_step(s), 0);
    cr_assert(g.done && !g.error, "request ended (error %d)", g.error);
    cr_assert_eq(en_sched_chunks_waiting(s), 0);
    return g;
}

Test(sched_blend, a_chunk_seen_once_is_reused_elsewhere_and_never_a_prefix)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    en_engine *e;
    en_sched *s = sched(&e);
    prompt a, b;
    two_prompts(&a, &b);
    got ga = run(s, &a, 1, NULL);
    cr_assert_eq(ga.u.chunk_tokens, 0, "nothing cached yet: computed in full");
    en_sched_stats st;
    en_sched_stats_get(s, &st);
    cr_assert_eq(st.chunks_stored, 2, "both chunks stored after the request");

    got gb = run(s, &b, 1, NULL);
    const int want = b.seg[0].n / 16 * 16 + b.seg[1].n / 16 * 16;
    cr_assert_eq(gb.u.chunk_tokens, want, "whole pages of both chunks reused (%d)", want);
    cr_assert_eq(gb.n, 4);
    en_sched_stats_get(s, &st);
    cr_assert_eq(st.chunk_tokens, (uint64_t)want);

    /* the same prompt without chunks: only the pages before the first reused chunk are cached
     * (blended KV is approximate), and its tokens are full recomputation's */
    got gc = run(s, &b, 0, NULL);
    cr_assert_eq(gc.u.cached_tokens, b.seg[0].start / 16 * 16, "no blended page is a prefix");
    cr_assert_eq(gc.u.chunk_tokens, 0);

    /* another tenant finds none of them */
    got gd = run(s, &b, 1, "other");
    cr_assert_eq(gd.u.chunk_tokens, 0, "chunks never cross tenants");
    cr_assert_eq(gd.u.cached_tokens, 0);
    cr_assert_arr_eq(gd.tok, gc.tok, sizeof(int32_t) * 4, "computed in full: the same tokens");
    en_sched_destroy(s);
    en_engine_destroy(e);
}

/* An MoE model serves chunks too (its experts run for the tokens each layer still computes). */
Test(sched_blend, an_moe_model_reuses_chunks)
{
    const char *path = "models/SmolLM2-135M-Instruct-MoE8-top4-mirror.Q4_1.gguf";
    if (!g_model || access(path, R_OK)) cr_skip_test("%s absent: run `make deps`", path);
    en_model *dense = g_model;
    km_errbuf err = {{0}};
    cr_assert_eq(en_model_load(path, &g_model, &err), 0, "%s", err.msg); /* what sched() runs */
    cr_assert_gt(en_model_hparams(g_model)->n_expert, 0);
    en_engine *e;
    en_sched *s = sched(&e);
    prompt a, b;
    two_prompts(&a, &b);
    cr_assert_eq(run(s, &a, 1, NULL).u.chunk_tokens, 0);
    got gb = run(s, &b, 1, NULL);
    const int want = b.seg[0].n / 16 * 16 + b.seg[1].n / 16 * 16;
    cr_assert_eq(gb.u.chunk_tokens, want, "whole pages of both chunks reused (%d)", want);
    /* its greedy tokens are not compared: reused KV is approximate, and on this model the first
     * one differs between kernel builds (the AVX2 build ends the turn at once) */
    en_sched_destroy(s);
    en_engine_destroy(e);
    en_model_free(g_model);
    g_model = dense;
}

/* The last chunk is computed in full: looked up (stored already, so not queued again), never
 * attached; and a fraction of 0 set explicitly is pure reuse, not the default. */
Test(sched_blend, the_last_chunk_is_only_looked_up_and_a_zero_fraction_is_zero)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    for (int k = 0; k < 2; k++) {
        en_engine *e;
        en_sched *s = sched_opts(&e, 0, k ? 0.0f : -2, 0);
        prompt a, b;
        const int abc[3] = {0, 1, 2}, cab[3] = {2, 0, 1};
        build(&a, "Read the texts below.", abc, 3, " Which animal jumps?");
        build(&b, "Here are documents, answer after them.", cab, 3, " What is granted?");
        b.n_seg--; /* the question is no chunk: the last chunk is a document */
        run(s, &a, 1, NULL);
        en_sched_stats st0, st;
        en_sched_stats_get(s, &st0);
        cr_assert_eq(st0.chunks_stored, 3);
        got gb = run(s, &b, 1, NULL);
        en_sched_stats_get(s, &st);
        const int want = b.seg[0].n / 16 * 16 + b.seg[1].n / 16 * 16;
        cr_assert_eq(gb.u.chunk_tokens, want, "the first two documents reused (%d)", want);
        cr_assert_eq(st.chunks_stored, st0.chunks_stored, "the last one held: not stored again");
        cr_assert_eq(st.chunk_misses, st0.chunk_misses, "and not counted a miss");
        if (k)
            cr_assert_eq(st.chunk_recomputed, 0, "fraction 0: pure reuse");
        else
            cr_assert_gt(st.chunk_recomputed, 0, "the default fraction recomputes some");
        en_sched_destroy(s);
        en_engine_destroy(e);
    }
}

/* A blend prefill is cut like an ordinary one: with prefill chunks of 16 tokens, a sequence
 * already decoding gets a token at every step while a prompt with three reused documents is
 * prefilled over several (the blend part in pieces, then the question as a prefill), and the
 * blended prompt's tokens are those of a scheduler that runs its blend part in one piece. */
Test(sched_blend, a_blend_prefill_is_cut_into_steps_and_changes_no_token)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    got one = {0}, cut = {0}, d = {0};
    int steps = 0;
    for (int k = 0; k < 2; k++) {
        en_engine *e;
        en_sched *s = sched_opts(&e, 0, -2, k ? 16 : 0);
        prompt a, b;
        const int abc[3] = {0, 1, 2}, cab[3] = {2, 0, 1};
        build(&a, "Read the texts below.", abc, 3, " Which animal jumps?");
        build(&b, "Here are documents, answer after them.", cab, 3, " What is granted?");
        run(s, &a, 1, NULL);
        if (!k) {
            one = run(s, &b, 1, NULL);
            en_sched_destroy(s);
            en_engine_destroy(e);
            continue;
        }
        /* a sequence decoding (no drafts: one token a step) */
        int32_t ids[8];
        const int n = encode("Count from one to a hundred:", ids, 8);
        en_sched_req qd = {.tokens = ids,
                           .n_tokens = n,
                           .max_tokens = 200,
                           .ignore_eos = 1,
                           .speculate = EN_SPEC_OFF,
                           .user = &d};
        en_sample_params_default(&qd.sample);
        qd.sample.temperature = 0;
        cr_assert_eq(en_sched_submit(s, &qd, NULL), 0);
        while (d.n < 2) cr_assert_gt(en_sched_step(s), 0);
        en_sched_req qb = {.tokens = b.ids,
                           .n_tokens = b.n,
                           .max_tokens = 4,
                           .chunks = b.seg,
                           .n_chunks = b.n_seg,
                           .user = &cut};
        en_sample_params_default(&qb.sample);
        qb.sample.temperature = 0;
        cr_assert_eq(en_sched_submit(s, &qb, NULL), 0);
        for (int before = d.n; !cut.n; before = d.n) {
            cr_assert_gt(en_sched_step(s), 0);
            steps++;
            cr_assert_eq(d.n, before + 1, "the running sequence got a token in step %d", steps);
        }
        for (int i = 0; i < 100000 && en_sched_pending(s); i++) cr_assert_geq(en_sched_step(s), 0);
        cr_assert(cut.done && d.done);
        const int want = b.seg[0].n / 16 * 16 + b.seg[1].n / 16 * 16 + b.seg[2].n / 16 * 16;
        cr_assert_eq(cut.u.chunk_tokens, want, "the three documents reused (%d)", want);
        en_sched_destroy(s);
        en_engine_destroy(e);
    }
    cr_log_info("the blended prompt's first token came after %d steps", steps);
    cr_assert_geq(steps, 3, "the blended prompt is prefilled over several steps (%d)", steps);
    cr_assert_eq(one.u.chunk_tokens, cut.u.chunk_tokens);
    cr_assert_eq(cut.n, 4);
    cr_assert_arr_eq(cut.tok, one.tok, sizeof(int32_t) * 4, "the same greedy tokens");
}

Test(sched_blend, a_stale_chunk_page_is_caught_by_token_ids)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    en_engine *e;
    en_sched *s = sched(&e);
    kv_store *kv = en_engine_kv(e);
    prompt p;
    const int one[1] = {0};
    build(&p, "Read the text below.", one, 1, " Which animal jumps?");
    /* doc 2's KV published under the hashes of doc 0's chunk chain (the preamble first) */
    int32_t pre[16], ids[256], wrong[256];
    cr_assert_geq(encode(EN_SCHED_BLEND_PREAMBLE, pre, 16), 16);
    const int n = p.seg[0].n / 16 * 16;
    memcpy(ids, pre, sizeof pre);
    memcpy(ids + 16, p.ids + p.seg[0].start, sizeof(int32_t) * n);
    memcpy(wrong, pre, sizeof pre);
    cr_assert_geq(encode(k_doc[2], wrong + 16, 240), n);
    char fp[33];
    en_model_fingerprint_hex(g_model, fp);
    const km_pagehash seed = en_blend_chunk_seed(km_pagehash_seed(fp, strlen(fp), 7, NULL, 0));
    km_pagehash h[16];
    const int np = km_pagehash_chain(seed, ids, 16 + n, 16, h, 16);
    kv_seq *q;
    cr_assert_eq(kv_seq_create(kv, &q), 0);
    int32_t pos[256];
    kv_seq *seqs[256];
    for (int i = 0; i < 16 + n; i++) pos[i] = i, seqs[i] = q;
    en_batch bt = {.n_tokens = 16 + n, .tokens = wrong, .pos = pos, .seqs = seqs};
    const float *lg;
    cr_assert_geq(en_engine_step(e, &bt, &lg), 0);
    cr_assert_eq(kv_seq_publish(kv, q, h, wrong, np * 16), np, "the stale pages are indexed");
    kv_seq_destroy(kv, q);

    got g = run(s, &p, 1, NULL);
    cr_assert_eq(g.u.chunk_tokens, 0, "the stale page is refused: the chunk computed in full");
    got ref = run(s, &p, 0, NULL);
    cr_assert_arr_eq(g.tok, ref.tok, sizeof(int32_t) * 4);
    en_sched_destroy(s);
    en_engine_destroy(e);
}

Test(sched_blend, preempted_requests_with_reused_chunks_still_finish)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    en_engine *e;
    /* 24 f16 pages of 16 tokens: far less than 4 sequences of ~100 + 120 tokens want */
    en_sched *s = sched_kv(&e, (size_t)24 * 16 * 23040);
    prompt a, p[4];
    const int ab[2] = {0, 1}, ba[2] = {1, 0};
    build(&a, "Read the two texts below.", ab, 2, " Which animal jumps?");
    run(s, &a, 1, NULL);
    static const char *lead[4] = {"First.", "Second prompt here.", "A third one, longer.",
                                  "And the fourth of them all."};
    got g[4];
    memset(g, 0, sizeof g);
    for (int i = 0; i < 4; i++) {
        build(&p[i], lead[i], ba, 2, " Go on.");
        en_sched_req q = {.tokens = p[i].ids,
                          .n_tokens = p[i].n,
                          .max_tokens = 120,
                          .ignore_eos = 1,
                          .chunks = p[i].seg,
                          .n_chunks = p[i].n_seg,
                          .user = &g[i]};
        en_sample_params_default(&q.sample);
        q.sample.temperature = 0;
        cr_assert_eq(en_sched_submit(s, &q, NULL), 0);
    }
    for (int i = 0; i < 100000 && (en_sched_pending(s) || en_sched_chunks_waiting(s)); i++)
        cr_assert_geq(en_sched_step(s), 0);
    en_sched_stats st;
    en_sched_stats_get(s, &st);
    cr_assert_gt(st.preemptions, 0, "the small store forced preemption");
    cr_assert_gt(st.chunk_tokens, 0, "chunks were reused before");
    int both = 0; /* a request that reused chunks, then was preempted and recomputed */
    for (int i = 0; i < 4; i++) {
        cr_assert(g[i].done && !g[i].error, "request %d ended (error %d)", i, g[i].error);
        cr_assert_eq(g[i].u.completion_tokens, 120, "request %d finished", i);
        both += g[i].u.chunk_tokens > 0 && g[i].u.preemptions > 0;
    }
    cr_assert_gt(both, 0, "no request both reused chunks and was preempted");
    en_sched_destroy(s);
    en_engine_destroy(e);
}

Test(sched_blend, routers_and_workers_hash_chunks_alike)
{
    /* the router's chunk credit (router/chunks.c) builds the chains with common/'s seed */
    const km_pagehash t = km_pagehash_seed("fp", 2, 7, "salt", 4);
    const km_pagehash a = en_blend_chunk_seed(t), b = km_pagehash_chunk_seed(t);
    cr_assert(a.lo == b.lo && a.hi == b.hi);
    cr_assert_str_eq(EN_SCHED_BLEND_PREAMBLE, KM_CHUNK_PREAMBLE);
}

Test(sched_blend, bad_segments_are_refused_at_submit)
{
    if (!g_model) cr_skip_test("model %s absent: run `make deps`", MODEL);
    en_engine *e;
    en_sched *s = sched(&e);
    int32_t ids[40];
    for (int i = 0; i < 40; i++) ids[i] = 100 + i;
    const en_blend_seg bad[4][2] = {
        {{0, 0}, {10, 5}}, {{0, 20}, {10, 5}}, {{30, 20}, {0, 0}}, {{5, 5}, {2, 1}}};
    const int nb[4] = {1, 2, 1, 2};
    for (int i = 0; i < 4; i++) {
        en_sched_req q = {.tokens = ids, .n_tokens = 40, .chunks = bad[i], .n_chunks = nb[i]};
        en_sample_params_default(&q.sample);
        cr_assert_eq(en_sched_submit(s, &q, NULL), KM_EINVAL, "case %d", i);
    }
    cr_assert_eq(en_sched_pending(s), 0);
    en_sched_destroy(s);
    en_engine_destroy(e);
}
