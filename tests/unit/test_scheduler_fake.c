/*
 * test_scheduler_fake.c — the scheduler (engine/engine.h) over a fake engine behind its engine
 * interface (en_sched_engine), so it is tested without the model file: the fake reserves and
 * writes KV pages exactly as en_engine_step does and its next token is a known function of the
 * token ids it reads back from the sequence's own KV pages, so every expected output is computed
 * and a wrong position, a lost or repeated chunk or a wrongly attached page changes tokens.
 * Scenarios: continuous batching with chunked prefill gives every request the tokens it gets
 * alone, a full KV store preempts instead of failing, decode_prefill caps prompt tokens in steps
 * that decode, a cached prefix is not prefilled again (and never across salts), too large is 413
 * and pinned is 503, priorities with aging, cancellation, deadlines, stop callbacks, refusals,
 * every step's budget and chunk sizes, reattachment after a preemption, decodes never starved by
 * long prefills, engine errors, abort_all and end of generation. Speculative decoding is off
 * here (test_spec_sched covers it on the model): a verification step may hold more tokens of a
 * sequence than a prefill chunk. test_scheduler runs the model-dependent scenarios.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { MAXG = 32, NR = 12 };

typedef struct backend backend;
static const backend *fake_backend(void); /* defined with the fake engine, below */

/* A scenario over the fake engine (written over a backend, as test_scheduler's are). */
#define SCENARIO(name)                                                                             \
    static void name(const backend *b);                                                            \
    Test(sched_fake, name)                                                                         \
    {                                                                                              \
        name(fake_backend());                                                                      \
    }                                                                                              \
    static void name(const backend *b)

#include "tests/unit/sched_scenarios.h"

/* ---------------------------------------------------------------- the fake engine
 * It reserves and writes KV pages exactly as en_engine_step does (so a small store really runs
 * out and the scheduler must preempt), and the token it predicts after position p is a hash of
 * the token ids it reads back from the sequence's own KV pages at positions 0..p. So the output
 * of any request is known without running anything (fake_reference), and a scheduler that feeds
 * a sequence the wrong positions, loses or repeats a chunk, or attaches another prompt's cached
 * pages makes other tokens. It records every step for the budget checks. */

#define FV      512 /* vocabulary: every token id is exact in an f16 K value */
#define FPT     4   /* page_tokens: prompts cross many pages */
#define FEOG    7   /* the end-of-generation token */
#define FMAXB   128 /* most tokens a fake step takes */
#define FSTEPS  8192
#define FPAGE_B ((size_t)FPT * 8 * 2 * 2) /* one layer, one kv head, head_dim 8, f16 K and V */

typedef struct fake {
    kv_store *kv;
    float logits[FMAXB * FV];
    int steps, fail_at;  /* step fail_at (1-based) fails with KM_EIO; 0: none */
    int n_rec;           /* steps recorded below */
    int n[FSTEPS];       /* tokens of each step that computed */
    int longest[FSTEPS]; /* the longest run of one sequence's tokens in it */
} fake;

static fake *g_fake;   /* of the open scheduler */
static bool g_spec_on; /* the next fake_open keeps speculative decoding on */

static uint32_t fake_next(uint32_t h, int32_t token)
{
    return (h ^ (uint32_t)token) * 16777619u;
}

static int32_t fake_pick(uint32_t h)
{
    return (int32_t)((h >> 7) % FV);
}

static int fake_step(void *ctx, const en_batch *b, const float **logits)
{
    fake *f = ctx;
    cr_assert(b->n_tokens >= 1 && b->n_tokens <= FMAXB);
    if (++f->steps == f->fail_at) return KM_EIO;
    for (int i = 0; i < b->n_tokens; i++) { /* as en_engine_step */
        int rc = kv_seq_reserve(f->kv, b->seqs[i], b->pos[i] + 1);
        if (rc) return rc;
    }
    float k[8] = {0}, v[8] = {0};
    int run = 0, longest = 0;
    for (int i = 0; i < b->n_tokens; i++) {
        cr_assert(b->tokens[i] >= 0 && b->tokens[i] < FV);
        if (i) cr_assert(b->seqs[i] != b->seqs[i - 1] || b->pos[i] == b->pos[i - 1] + 1);
        k[0] = v[0] = (float)b->tokens[i];
        kv_seq_write(f->kv, b->seqs[i], 0, b->pos[i], k, v);
        run = i && b->seqs[i] == b->seqs[i - 1] ? run + 1 : 1;
        if (run > longest) longest = run;
    }
    int n_out = 0;
    for (int i = 0; i < b->n_tokens; i++) {
        if (b->logits ? !b->logits[i] : i != b->n_tokens - 1) continue;
        uint32_t h = 2166136261u;
        for (int p = 0; p <= b->pos[i]; p++) {
            cr_assert_eq(kv_seq_read(f->kv, b->seqs[i], 0, 0, p, k, v), 0);
            h = fake_next(h, (int32_t)k[0]);
        }
        float *row = f->logits + (size_t)n_out++ * FV;
        memset(row, 0, sizeof(float) * FV);
        row[fake_pick(h)] = 1.0f;
    }
    if (f->n_rec < FSTEPS) {
        f->n[f->n_rec] = b->n_tokens;
        f->longest[f->n_rec++] = longest;
    }
    *logits = f->logits;
    return n_out;
}

static int fake_is_eog(void *ctx, int32_t token)
{
    return token == FEOG;
}

/* A fake engine over hot_pages pages (and host_pages in a host-RAM tier), and its scheduler. */
static en_sched *fake_open_tiered(int hot_pages, int host_pages, en_sched_opts o)
{
    fake *f = g_fake = calloc(1, sizeof *f);
    cr_assert_not_null(f);
    kv_config c = {.n_layers = 1,
                   .n_kv_heads = 1,
                   .head_dim = 8,
                   .page_tokens = FPT,
                   .hot_bytes = (size_t)hot_pages * FPAGE_B,
                   .host_bytes = (size_t)host_pages * FPAGE_B,
                   .sync_promote = 1};
    km_errbuf err = {{0}};
    cr_assert_eq(kv_store_create(&c, &f->kv, &err), 0, "%s", err.msg);
    cr_assert_eq(kv_store_page_bytes(f->kv), FPAGE_B);
    static const en_hparams hp = {.n_layers = 1,
                                  .n_embd = 8,
                                  .n_ff = 16,
                                  .n_head = 1,
                                  .n_head_kv = 1,
                                  .head_dim = 8,
                                  .n_vocab = FV};
    if (!g_spec_on) o.spec.mode = EN_SPEC_OFF; /* see the file's comment */
    /* drafts priced by the prior line, not by timed steps of a loaded machine (where a 2-token
     * step could time dearer than drafting pays, and no draft was offered) */
    o.spec.cost_fixed = true;
    en_sched_engine eng = {.kv = f->kv,
                           .hp = &hp,
                           .fingerprint = "0123456789abcdef0123456789abcdef",
                           .step = fake_step,
                           .is_eog = fake_is_eog,
                           .ctx = f};
    en_sched *s;
    cr_assert_eq(en_sched_create_on(&eng, &o, &g_cb, &s, &err), 0, "%s", err.msg);
    return s;
}

static en_sched *fake_open(int hot_pages, int max_batch, en_sched_opts o)
{
    cr_assert_leq(max_batch, FMAXB);
    return fake_open_tiered(hot_pages ? hot_pages : 4096, 0, o);
}

static void fake_close(en_sched *s)
{
    en_sched_destroy(s);
    check_nothing_pinned(g_fake->kv);
    kv_store_destroy(g_fake->kv);
    free(g_fake);
    g_fake = NULL;
}

static kv_store *fake_kv(void)
{
    return g_fake->kv;
}

static void fake_prompt(int32_t *p, int n, int salt)
{
    for (int i = 0; i < n; i++) p[i] = 10 + (i * 131 + salt * 977) % (FV - 10);
}

/* What the fake model generates after p: computed, not run. */
static int fake_generate(const int32_t *p, int n, int max_tokens, int ignore_eos, int32_t *toks)
{
    uint32_t h = 2166136261u;
    for (int i = 0; i < n; i++) h = fake_next(h, p[i]);
    int k = 0;
    while (k < max_tokens) {
        int32_t t = fake_pick(h);
        if (t == FEOG && !ignore_eos) break;
        if (k < MAXG) toks[k] = t;
        k++;
        h = fake_next(h, t);
    }
    return k;
}

static int fake_reference(const int32_t *p, int n, int max_tokens, int32_t *toks)
{
    return fake_generate(p, n, max_tokens, 0, toks);
}

/* Every step recorded so far kept within the budget and the chunk size. */
static void fake_check_steps(int budget, int chunk)
{
    for (int i = 0; i < g_fake->n_rec; i++) {
        cr_assert_leq(g_fake->n[i], budget, "step %d: %d tokens, budget %d", i, g_fake->n[i],
                      budget);
        cr_assert_leq(g_fake->longest[i], chunk, "step %d: a chunk of %d tokens, at most %d", i,
                      g_fake->longest[i], chunk);
    }
}

static const backend g_fake_be = {.pt = FPT,
                                  .n_vocab = FV,
                                  .n_batch = NR,
                                  .prompt = fake_prompt,
                                  .open = fake_open,
                                  .close = fake_close,
                                  .kv = fake_kv,
                                  .reference = fake_reference,
                                  .check_steps = fake_check_steps};

static const backend *fake_backend(void)
{
    return &g_fake_be;
}

TestSuite(sched_fake, .timeout = 120);

/* ---------------------------------------------------------------- the fake engine only */

Test(sched_fake, a_preempted_sequence_reattaches_its_published_pages_instead_of_recomputing)
{
    /* 48 tokens hot; the victim's published pages wait on the host tier */
    en_sched *s =
        fake_open_tiered(12, 32, (en_sched_opts){.max_batch_tokens = 16, .max_running = 2});
    int32_t a[30], c[6];
    fake_prompt(a, 30, 1);
    fake_prompt(c, 6, 2);
    out oa = {0}, oc = {0};
    en_sched_req r = greedy_req(a, 30, 8, &oa);
    r.priority = -1; /* the victim */
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    r = greedy_req(c, 6, 30, &oc);
    r.ignore_eos = 1;
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    run_all(s);
    en_sched_stats st;
    en_sched_stats_get(s, &st);
    cr_assert_gt(st.preemptions, 0);
    cr_assert_gt(oa.u.preemptions, 0, "the lower priority one was preempted");
    cr_assert_lt(st.recomputed_tokens, (uint64_t)st.preemptions * FPT,
                 "published pages were reattached: less than a page recomputed");
    check_alone(&g_fake_be, a, 30, 8, &oa, 0);
    int32_t want[MAXG];
    cr_assert_eq(oc.n, fake_generate(c, 6, 30, 1, want));
    cr_assert_arr_eq(oc.tok, want, sizeof(int32_t) * oc.n);
    fake_close(s);
}

Test(sched_fake, a_decoding_sequence_gets_a_token_every_step_while_long_prompts_prefill)
{
    en_sched *s = fake_open(0, 16, (en_sched_opts){.max_batch_tokens = 16});
    int32_t a[5], p[3][100];
    fake_prompt(a, 5, 3);
    out oa = {0}, op[3];
    memset(op, 0, sizeof op);
    en_sched_req r = greedy_req(a, 5, 30, &oa);
    r.ignore_eos = 1;
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    cr_assert_gt(en_sched_step(s), 0); /* a's prompt, and its first token */
    cr_assert_eq(oa.n, 1);
    for (int i = 0; i < 3; i++) {
        fake_prompt(p[i], 100, 10 + i);
        r = greedy_req(p[i], 100, 2, &op[i]);
        cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    }
    for (int step = 2; !oa.ended; step++) {
        cr_assert_gt(en_sched_step(s), 0);
        cr_assert(oa.ended || oa.n == step, "step %d: a has %d tokens", step, oa.n);
    }
    run_all(s);
    fake_check_steps(16, 16);
    fake_close(s);
    for (int i = 0; i < 3; i++) check_alone(&g_fake_be, p[i], 100, 2, &op[i], i);
}

Test(sched_fake, an_engine_error_ends_the_requests_of_its_batch_and_the_next_ones_are_served)
{
    en_sched *s = fake_open(0, 64, (en_sched_opts){.max_batch_tokens = 64});
    g_fake->fail_at = 3;
    int32_t p[2][20];
    out o[3];
    memset(o, 0, sizeof o);
    for (int i = 0; i < 2; i++) {
        fake_prompt(p[i], 20, 20 + i);
        en_sched_req r = greedy_req(p[i], 20, 10, &o[i]);
        r.ignore_eos = 1;
        cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    }
    for (int i = 0; i < 2; i++) cr_assert_gt(en_sched_step(s), 0);
    cr_assert_eq(en_sched_step(s), KM_EIO);
    cr_assert(o[0].ended && o[1].ended);
    cr_assert_eq(o[0].code, km_proto_code_from_err(KM_EIO));
    en_sched_stats st;
    en_sched_stats_get(s, &st);
    cr_assert_eq(st.engine_errors, 1);
    cr_assert_eq(en_sched_pending(s), 0);
    en_sched_req r = greedy_req(p[0], 20, 5, &o[2]);
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    run_all(s);
    check_alone(&g_fake_be, p[0], 20, 5, &o[2], 2);
    fake_close(s);
}

/* What a worker reports during a step (its gate answers `status` then) is read after
 * en_sched_prepare: the running set that step computes, with no engine step run yet. */
Test(sched_fake, prepare_admits_what_the_next_step_runs_without_stepping)
{
    en_sched *s = fake_open(0, 64, (en_sched_opts){.max_batch_tokens = 64, .max_running = 1});
    int32_t p[2][12];
    out o[2];
    memset(o, 0, sizeof o);
    for (int i = 0; i < 2; i++) {
        fake_prompt(p[i], 12, 40 + i);
        en_sched_req r = greedy_req(p[i], 12, 3, &o[i]);
        cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    }
    en_sched_stats st;
    en_sched_stats_get(s, &st);
    cr_assert(st.running == 0 && st.queued == 2);
    en_sched_prepare(s);
    en_sched_stats_get(s, &st);
    cr_assert(st.running == 1 && st.queued == 1, "running %d queued %d", st.running, st.queued);
    cr_assert_eq(g_fake->steps, 0, "no engine step yet");
    run_all(s);
    for (int i = 0; i < 2; i++) check_alone(&g_fake_be, p[i], 12, 3, &o[i], i);
    fake_close(s);
}

Test(sched_fake, abort_all_hands_every_request_back_with_its_computed_pages_published)
{
    en_sched *s = fake_open(0, 64, (en_sched_opts){.max_batch_tokens = 64, .max_running = 1});
    int32_t p[40];
    fake_prompt(p, 40, 30);
    out run = {0}, queued = {0};
    en_sched_req r = greedy_req(p, 40, 50, &run);
    r.ignore_eos = 1;
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    r = greedy_req(p, 8, 5, &queued);
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    cr_assert_gt(en_sched_step(s), 0);
    en_sched_abort_all(s, KM_CODE_UNAVAILABLE, "draining");
    cr_assert_eq(run.code, KM_CODE_UNAVAILABLE);
    cr_assert_eq(queued.code, KM_CODE_UNAVAILABLE);
    cr_assert_eq(en_sched_pending(s), 0);
    km_pagehash seed = km_pagehash_seed("0123456789abcdef0123456789abcdef", 32, 0, NULL, 0);
    km_pagehash h[10];
    int np = km_pagehash_chain(seed, p, 40, FPT, h, 10);
    cr_assert_eq(kv_store_lookup(g_fake->kv, h, p, np, NULL), 10, "the whole prompt is cached");
    fake_close(s);
}

Test(sched_fake, end_of_generation_ends_a_request_unless_it_ignores_it)
{
    int32_t q[6], want[MAXG];
    int k = MAXG;
    for (int salt = 0; salt < 100000 && k >= 8; salt++) { /* a prompt that ends by itself */
        fake_prompt(q, 6, salt);
        int n = fake_generate(q, 6, 8, 1, want);
        for (k = 0; k < n && want[k] != FEOG; k++) continue;
    }
    cr_assert_lt(k, 8, "found a prompt whose output reaches the end-of-generation token");
    en_sched *s = fake_open(0, 64, (en_sched_opts){.max_batch_tokens = 64});
    out e = {0}, all = {0};
    en_sched_req r = greedy_req(q, 6, 8, &e);
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    r = greedy_req(q, 6, 8, &all);
    r.ignore_eos = 1;
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    run_all(s);
    cr_assert_eq(e.finish, KM_FINISH_STOP);
    cr_assert_eq(e.n, k, "ends before the end-of-generation token");
    cr_assert_eq(all.finish, KM_FINISH_LENGTH);
    cr_assert_eq(all.n, 8);
    cr_assert_arr_eq(all.tok, want, sizeof(int32_t) * 8);
    fake_close(s);
    en_sched_engine none = {0};
    km_errbuf err = {{0}};
    cr_assert_eq(en_sched_create_on(&none, NULL, &g_cb, &s, &err), KM_EINVAL);
}

Test(sched_fake, speculative_decoding_changes_no_token_and_drafts_from_earlier_outputs)
{
    /* each prompt twice: the second time the tenant's index holds the first output, so drafts
     * are offered (and accepted) where the fake engine agrees, and nothing changes a token */
    enum { N = 6 };
    int32_t p[N][40];
    out o[2][N];
    memset(o, 0, sizeof o);
    g_spec_on = true;
    en_sched *s = fake_open(0, 128, (en_sched_opts){.max_running = 8, .max_batch_tokens = 128});
    g_spec_on = false;
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < N; i++) {
            fake_prompt(p[i], 40, 50 + i);
            en_sched_req r = greedy_req(p[i], 40, 24, &o[round][i]);
            r.ignore_eos = 1;
            cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
        }
        run_all(s);
    }
    en_sched_stats st;
    en_sched_stats_get(s, &st);
    fake_close(s);
    for (int round = 0; round < 2; round++)
        for (int i = 0; i < N; i++) {
            int32_t want[MAXG];
            int k = fake_generate(p[i], 40, 24, 1, want);
            cr_assert_eq(o[round][i].n, k);
            cr_assert_arr_eq(o[round][i].tok, want, sizeof(int32_t) * k,
                             "round %d request %d changed by drafts", round, i);
        }
    cr_assert_gt(st.spec_accepted, 0, "drafted %llu, accepted none",
                 (unsigned long long)st.spec_drafted);
}

/* Prompt logprobs (echo): every prompt token but the first reported once, in order, from the
 * row of the position before it, even with the prompt's pages cached and the prefill chunked. */
Test(sched_fake, prompt_logprobs_cover_the_whole_prompt_once_cached_or_not)
{
    en_sched *s = fake_open(0, 16, (en_sched_opts){.max_batch_tokens = 16, .prefill_chunk = 8});
    int32_t p[25];
    fake_prompt(p, 25, 7);
    out a = {0}, b = {0};
    en_sched_req r = greedy_req(p, 25, 3, &a); /* caches the prompt's pages */
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    run_all(s);
    cr_assert_eq(a.n_plp, 0);
    r = greedy_req(p, 25, 3, &b);
    r.prompt_logprobs = 1;
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    run_all(s);
    cr_assert_eq(b.u.cached_tokens, 0, "the prompt is computed whole");
    cr_assert_eq(b.n_plp, 24);
    double lse = log(exp(1.0) + (FV - 1)); /* a fake row: 1 at the pick, 0 elsewhere */
    uint32_t h = 2166136261u;
    for (int i = 0; i < 24; i++) {
        cr_assert_eq(b.plp_pos[i], i + 1, "entry %d: position %d", i, b.plp_pos[i]);
        h = fake_next(h, p[i]);
        double want = (p[i + 1] == fake_pick(h) ? 1.0 : 0.0) - lse;
        cr_assert_float_eq(b.plp[i], want, 1e-5, "position %d", i + 1);
    }
    cr_assert_eq(b.n, a.n);
    cr_assert_arr_eq(b.tok, a.tok, sizeof(int32_t) * (size_t)a.n);
    fake_close(s);
}

/* ---------------------------------------------------------------- tenants (scheduler_fair.c) */

enum { FT_A = 6 }; /* requests of the busy tenant */

/* Submits a request of tenant `tenant` for max tokens (ignoring end of generation, so each runs
 * its length). */
static void fair_submit(en_sched *s, int32_t *p, int salt, uint64_t tenant, int max, out *o)
{
    fake_prompt(p, 10, salt);
    en_sched_req r = greedy_req(p, 10, max, o);
    r.ignore_eos = 1;
    r.tenant = tenant;
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
}

static void fair_check(const int32_t *p, int max, const out *o, int i)
{
    int32_t want[MAXG];
    int k = fake_generate(p, 10, max, 1, want);
    cr_assert(o->ended && !o->code, "request %d failed (%d)", i, o->code);
    cr_assert_eq(o->n, k, "request %d: %d tokens, alone %d", i, o->n, k);
    cr_assert_arr_eq(o->tok, want, sizeof(int32_t) * k, "request %d differs from it alone", i);
}

static en_sched_stats fair_stats(const en_sched *s)
{
    en_sched_stats st;
    en_sched_stats_get(s, &st);
    return st;
}

Test(sched_fake, a_tenant_alone_runs_all_it_asks_whatever_its_share)
{
    en_sched *s = fake_open(
        0, 64, (en_sched_opts){.max_batch_tokens = 64, .max_running = 8, .tenant_share = 2});
    int32_t p[FT_A][10];
    out o[FT_A];
    memset(o, 0, sizeof o);
    for (int i = 0; i < FT_A; i++) fair_submit(s, p[i], 60 + i, 7, 20, &o[i]);
    en_sched_prepare(s);
    cr_assert_eq(fair_stats(s).running, FT_A, "nobody else is here: not held");
    run_all(s);
    cr_assert_eq(fair_stats(s).tenant_yields, 0);
    fake_close(s);
    for (int i = 0; i < FT_A; i++) fair_check(p[i], 20, &o[i], i);
}

Test(sched_fake, a_tenant_over_its_share_yields_its_newest_when_another_arrives)
{
    en_sched *s = fake_open(0, 64,
                            (en_sched_opts){.max_batch_tokens = 64,
                                            .max_running = 8,
                                            .tenant_share = 2,
                                            .tenant_linger_ms = 3600000});
    int32_t p[FT_A + 1][10];
    out o[FT_A + 1];
    memset(o, 0, sizeof o);
    for (int i = 0; i < FT_A; i++) fair_submit(s, p[i], 70 + i, 7, 20, &o[i]);
    cr_assert_gt(en_sched_step(s), 0); /* all six prefilled: each has its first token */
    cr_assert_eq(fair_stats(s).running, FT_A);
    fair_submit(s, p[FT_A], 80, 9, 20, &o[FT_A]);
    en_sched_prepare(s);
    en_sched_stats st = fair_stats(s);
    cr_assert_eq(st.running, 3, "the share of 7 and the newcomer of 9");
    cr_assert_eq(st.tenant_yields, FT_A - 2);
    cr_assert_gt(en_sched_step(s), 0);
    cr_assert_eq(o[FT_A].n, 1, "the newcomer's first token in the next step");
    cr_assert_gt(en_sched_step(s), 0); /* that step was the newcomer's alone */
    for (int i = 0; i < FT_A; i++)     /* the two oldest go on, the newest wait */
        cr_assert_eq(o[i].n, i < 2 ? 2 : 1, "request %d has %d tokens", i, o[i].n);
    /* while the other tenant lingers (its request ended: an hour here), 7 stays at its share */
    while (en_sched_pending(s)) {
        cr_assert_geq(en_sched_step(s), 0);
        cr_assert_leq(fair_stats(s).running, 2 + !o[FT_A].ended);
    }
    fake_close(s);
    for (int i = 0; i <= FT_A; i++) /* requeued: tokens unchanged */
        fair_check(p[i], 20, &o[i], i);
}

Test(sched_fake, a_newcomers_first_token_comes_ahead_of_the_tenant_at_its_share)
{
    en_sched *s = fake_open(0, 64,
                            (en_sched_opts){.max_batch_tokens = 64,
                                            .max_running = 8,
                                            .tenant_share = 2,
                                            .tenant_linger_ms = 3600000});
    int32_t p[FT_A + 2][10];
    out o[FT_A + 2];
    memset(o, 0, sizeof o);
    for (int i = 0; i < FT_A; i++) fair_submit(s, p[i], 110 + i, 7, 20, &o[i]);
    cr_assert_gt(en_sched_step(s), 0); /* 7 alone: all six prefilled */
    fair_submit(s, p[FT_A], 120, 9, 3, &o[FT_A]);
    /* 7 is held at its share with four of its requests queued, and the newcomer's step holds
     * its prompt alone: 7's two running ones sit it out */
    int n = en_sched_step(s);
    cr_assert_eq(n, 10, "the newcomer's 10 prompt tokens only, not %d", n);
    cr_assert_eq(o[FT_A].n, 1);
    for (int i = 0; i < FT_A; i++) cr_assert_eq(o[i].n, 1, "request %d went on", i);
    en_sched_stats st = fair_stats(s);
    cr_assert_eq(st.tenant_waits, 2);
    cr_assert_eq(st.queued, FT_A - 2);
    /* then everyone decodes: 7's share and the newcomer */
    cr_assert_eq(en_sched_step(s), 3);
    cr_assert(o[0].n == 2 && o[1].n == 2 && o[FT_A].n == 2);
    /* a second newcomer arriving as the first request ends: its step is its own again */
    while (!o[FT_A].ended) cr_assert_gt(en_sched_step(s), 0);
    fair_submit(s, p[FT_A + 1], 121, 9, 3, &o[FT_A + 1]);
    int before = o[0].n;
    cr_assert_eq(en_sched_step(s), 10);
    cr_assert_eq(o[FT_A + 1].n, 1);
    cr_assert_eq(o[0].n, before);
    run_all(s);
    fake_close(s);
    for (int i = 0; i < FT_A + 2; i++) fair_check(p[i], i < FT_A ? 20 : 3, &o[i], i);
}

Test(sched_fake, the_tenants_at_their_share_never_sit_out_two_steps_in_a_row)
{
    en_sched *s = fake_open(0, 64,
                            (en_sched_opts){.max_batch_tokens = 64,
                                            .max_running = 8,
                                            .tenant_share = 2,
                                            .tenant_linger_ms = 3600000});
    int32_t p[4][10];
    out o[4];
    memset(o, 0, sizeof o);
    fair_submit(s, p[0], 130, 7, 20, &o[0]);
    fair_submit(s, p[1], 131, 7, 20, &o[1]);
    cr_assert_gt(en_sched_step(s), 0);
    fair_submit(s, p[2], 132, 9, 3, &o[2]);
    cr_assert_eq(en_sched_step(s), 10, "9's first token: 7 sits out");
    fair_submit(s, p[3], 133, 10, 3, &o[3]);
    /* 10's first token too, but 7 sat out the step before: it decodes in this one */
    int before = o[0].n;
    cr_assert_eq(en_sched_step(s), 10 + 3, "10's prompt, 9's and 7's decodes");
    cr_assert(o[0].n == before + 1 && o[3].n == 1);
    run_all(s);
    fake_close(s);
    for (int i = 0; i < 4; i++) fair_check(p[i], i < 2 ? 20 : 3, &o[i], i);
}

Test(sched_fake, a_tenant_over_its_share_alone_takes_at_most_tenant_prefill_a_step)
{
    en_sched *s = fake_open(
        0, 64,
        (en_sched_opts){
            .max_batch_tokens = 64, .max_running = 8, .tenant_share = 2, .tenant_prefill = 12});
    int32_t p[FT_A][10];
    out o[FT_A];
    memset(o, 0, sizeof o);
    for (int i = 0; i < FT_A; i++) fair_submit(s, p[i], 140 + i, 7, 20, &o[i]);
    /* six prompts of 10 tokens admitted at once: 12 prompt tokens a step (and the decodes)
     * instead of all 60 in one */
    int first = g_fake->n_rec;
    run_all(s);
    int most = 0;
    for (int i = first; i < g_fake->n_rec; i++)
        if (g_fake->n[i] > most) most = g_fake->n[i];
    cr_assert_leq(most, FT_A + 12, "a step of %d tokens", most);
    cr_assert_eq(fair_stats(s).tenant_yields, 0, "alone: never held");
    fake_close(s);
    for (int i = 0; i < FT_A; i++) fair_check(p[i], 20, &o[i], i);
}

Test(sched_fake, admission_takes_the_tenant_with_the_fewest_running_first)
{
    en_sched *s = fake_open(
        0, 64, (en_sched_opts){.max_batch_tokens = 64, .max_running = 3, .tenant_share = 8});
    int32_t p[5][10];
    out o[5];
    memset(o, 0, sizeof o);
    for (int i = 0; i < 4; i++) fair_submit(s, p[i], 90 + i, 7, 20, &o[i]);
    fair_submit(s, p[4], 95, 9, 20, &o[4]); /* last in, but its tenant runs nothing yet */
    cr_assert_gt(en_sched_step(s), 0);
    cr_assert(o[0].n == 1 && o[4].n == 1 && o[1].n == 1, "7's oldest, 9's, then 7's next");
    cr_assert(o[2].n == 0 && o[3].n == 0);
    run_all(s);
    fake_close(s);
    for (int i = 0; i < 5; i++) fair_check(p[i], 20, &o[i], i);
}

Test(sched_fake, a_tenant_gets_its_batch_back_once_the_other_stopped_lingering)
{
    en_sched *s = fake_open(
        0, 64,
        (en_sched_opts){
            .max_batch_tokens = 64, .max_running = 8, .tenant_share = 2, .tenant_linger_ms = 1});
    int32_t p[FT_A + 1][10];
    out o[FT_A + 1];
    memset(o, 0, sizeof o);
    fair_submit(s, p[FT_A], 100, 9, 3, &o[FT_A]);
    for (int i = 0; i < FT_A; i++) fair_submit(s, p[i], 101 + i, 7, 20, &o[i]);
    en_sched_prepare(s);
    cr_assert_eq(fair_stats(s).running, 3, "9's one and 7's share");
    while (!o[FT_A].ended) cr_assert_gt(en_sched_step(s), 0);
    /* 9 is gone; once its linger (1 ms) is over, 7 runs everything it has */
    for (int i = 0; i < 10000 && fair_stats(s).running < FT_A; i++) {
        usleep(2000);
        en_sched_prepare(s);
    }
    cr_assert_eq(fair_stats(s).running, FT_A);
    run_all(s);
    fake_close(s);
    for (int i = 0; i <= FT_A; i++) fair_check(p[i], i < FT_A ? 20 : 3, &o[i], i);
}
