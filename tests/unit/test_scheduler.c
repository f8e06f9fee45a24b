/*
 * test_scheduler.c — en_sched_* over the real engine and the default model. The scenarios of
 * tests/unit/sched_scenarios.h (written once, also run on a fake engine by
 * test_scheduler_fake.c): continuous batching with chunked prefill gives the same greedy tokens
 * as each request alone, a full KV store preempts instead of failing, decode_prefill, prefix
 * reuse and salts, 413 and 503, priorities with aging, cancellation, deadlines, stop callbacks
 * and refusals. Here only, because they need the model's real costs or sampler: the step budget
 * cuts prefill chunks by measured cost, a short prompt is not stuck behind a long prefill, and a
 * seeded request continued from its streamed tokens equals the undisturbed run. Without the model
 * every test skips and says so.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"
/* Under the sanitizers the engine is an order of magnitude slower: fewer requests there, and a
 * longer bound per scenario: with the scalar kernels (KVMESH_ISA=scalar, issue 10) under ASan the
 * preemption scenario alone ran past 300 s on a 2-core AMD EPYC (the whole suite takes under 2
 * minutes with the AVX2 path). */
#if defined(__SANITIZE_ADDRESS__)
enum { MAXG = 32, NR = 6 };
#define SCENARIO_TIMEOUT 1200
#else
enum { MAXG = 32, NR = 12 };
#define SCENARIO_TIMEOUT 300
#endif

#include "tests/unit/sched_fixture.h"

static en_model *g_model;
static en_engine *g_engine; /* of the open scenario's scheduler */

static bool need_model(void)
{
    if (access(MODEL, R_OK)) {
        cr_skip_test("needs %s (make deps)", MODEL);
        return false;
    }
    km_errbuf err = {{0}};
    if (!g_model) cr_assert_eq(en_model_load(MODEL, &g_model, &err), 0, "%s", err.msg);
    return true;
}

static void fini(void)
{
    en_model_free(g_model);
    g_model = NULL;
}

TestSuite(sched, .fini = fini, .timeout = SCENARIO_TIMEOUT);

static en_engine *engine(size_t kv_bytes, int max_batch)
{
    en_engine *e;
    km_errbuf err = {{0}};
    en_engine_opts o = {.n_threads = 2, .max_batch_tokens = max_batch, .kv_bytes = kv_bytes};
    cr_assert_eq(en_engine_create(g_model, &o, &e, &err), 0, "%s", err.msg);
    return e;
}

static en_sched *sched(en_engine *e, en_sched_opts o)
{
    en_sched *s;
    km_errbuf err = {{0}};
    cr_assert_eq(en_sched_create(e, g_model, &o, &g_cb, &s, &err), 0, "%s", err.msg);
    return s;
}

static void prompt(int32_t *p, int n, int salt)
{
    for (int i = 0; i < n; i++) p[i] = 300 + (i * 131 + salt * 977) % 30000;
}

/* Each request alone on a fresh engine: the reference. */
static void alone(const int32_t *p, int n, int max_tokens, out *o)
{
    en_engine *e = engine(0, 64);
    en_sched *s = sched(e, (en_sched_opts){.max_running = 1, .max_batch_tokens = 64});
    en_sched_req r = greedy_req(p, n, max_tokens, o);
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    run_all(s);
    en_sched_destroy(s);
    en_engine_destroy(e);
}

/* ---------------------------------------------------------------- the model as a backend */

typedef struct backend backend;
static const backend *model_backend(void);

#define SCENARIO(name)                                                                             \
    static void name(const backend *b);                                                            \
    Test(sched, name)                                                                              \
    {                                                                                              \
        if (need_model()) name(model_backend());                                                   \
    }                                                                                              \
    static void name(const backend *b)

#include "tests/unit/sched_scenarios.h"

static en_sched *model_open(int hot_pages, int max_batch, en_sched_opts o)
{
    g_engine = engine((size_t)hot_pages * 16 * 23040, max_batch); /* f16 pages of 16 tokens */
    return sched(g_engine, o);
}

static void model_close(en_sched *s)
{
    en_sched_destroy(s);
    en_engine_destroy(g_engine);
    g_engine = NULL;
}

static kv_store *model_kv(void)
{
    return en_engine_kv(g_engine);
}

static int model_reference(const int32_t *p, int n, int max_tokens, int32_t *toks)
{
    out o = {0};
    alone(p, n, max_tokens, &o);
    cr_assert(o.ended && !o.code);
    memcpy(toks, o.tok, sizeof(int32_t) * (o.n < MAXG ? o.n : MAXG));
    return o.n;
}

static const backend *model_backend(void)
{
    static const backend be = {.pt = 16,
                               .n_vocab = 49152,
                               .n_batch = NR,
                               .prompt = prompt,
                               .open = model_open,
                               .close = model_close,
                               .kv = model_kv,
                               .reference = model_reference};
    return &be;
}

/* ---------------------------------------------------------------- the model only */

Test(sched, a_step_budget_cuts_prefill_chunks_by_measured_cost_and_changes_no_token)
{
    if (!need_model()) return;
    int32_t p[180];
    prompt(p, 180, 5);
    out ref = {0}, a = {0};
    alone(p, 180, 8, &ref);
    en_engine *e = engine(0, 128);
    /* 1 ms is less than any page of this model's prefill takes: after the first step (nothing
     * measured yet) every step carries the floor, one page of the prompt */
    en_sched *s = sched(e, (en_sched_opts){.max_batch_tokens = 128, .step_budget_ms = 1});
    en_sched_req r = greedy_req(p, 180, 8, &a);
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    cr_assert_gt(en_sched_step(s), 0);
    while (!a.n) {
        en_sched_stats s0, s1;
        en_sched_stats_get(s, &s0);
        cr_assert_gt(s0.ns_per_unit, 0, "the first step taught the cost");
        cr_assert_gt(en_sched_step(s), 0);
        en_sched_stats_get(s, &s1);
        cr_assert_leq(s1.prefill_tokens - s0.prefill_tokens, 16, "one page per step");
    }
    run_all(s);
    en_sched_stats st;
    en_sched_stats_get(s, &st);
    cr_assert_gt(st.budget_cut, 0);
    /* the prompt's last 52 tokens took at least 4 steps (asserted per step above) */
    cr_assert_geq(st.steps, 1 + (180 - 128) / 16, "%llu steps", (unsigned long long)st.steps);
    cr_assert(a.ended && !a.code);
    cr_assert_eq(a.n, ref.n);
    cr_assert_arr_eq(a.tok, ref.tok, sizeof(int32_t) * ref.n, "same tokens as one chunk");
    en_sched_destroy(s);
    en_engine_destroy(e);
}

Test(sched, under_a_step_budget_a_short_prompt_is_not_stuck_behind_a_long_prefill)
{
    if (!need_model()) return;
    int32_t lp[180], sp[20];
    prompt(lp, 180, 11);
    prompt(sp, 20, 12);
    out ref = {0}, lo = {0}, sh = {0};
    alone(sp, 20, 4, &ref);
    en_engine *e = engine(0, 128);
    en_sched *s = sched(e, (en_sched_opts){.max_batch_tokens = 128, .step_budget_ms = 1});
    en_sched_req r = greedy_req(lp, 180, 4, &lo);
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    cr_assert_gt(en_sched_step(s), 0); /* the long prompt is admitted and prefilling */
    r = greedy_req(sp, 20, 4, &sh);
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    for (int i = 0; i < 100 && !sh.n; i++) cr_assert_geq(en_sched_step(s), 0);
    cr_assert_gt(sh.n, 0);
    cr_assert_eq(lo.n, 0, "the short prompt's first token came after the long one's");
    run_all(s);
    cr_assert_eq(sh.n, ref.n);
    cr_assert_arr_eq(sh.tok, ref.tok, sizeof(int32_t) * ref.n, "same tokens as alone");
    cr_assert(lo.ended && !lo.code);
    en_sched_destroy(s);
    en_engine_destroy(e);
}

/* A migration continues a request from its prompt plus the tokens already streamed: a seeded,
 * sampled request continued that way (n_generated) gives the tokens of the undisturbed run. */
Test(sched, a_seeded_request_continued_from_its_streamed_tokens_equals_the_undisturbed_run)
{
    if (!need_model()) return;
    enum { N = 60, G = 24, K = 9 };
    int32_t p[N + G];
    prompt(p, N, 3);
    out full = {0}, tail = {0};
    en_engine *e = engine(0, 64);
    en_sched *s = sched(e, (en_sched_opts){.max_batch_tokens = 64});
    en_sched_req r = greedy_req(p, N, G, &full);
    r.sample.temperature = 0.9f;
    r.sample.top_k = 50;
    r.sample.repeat_penalty = 1.1f;
    r.sample.seed = 1234;
    r.ignore_eos = 1;
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    run_all(s);
    cr_assert_eq(full.n, G);
    /* the "next worker": a fresh engine, the prompt plus the first K tokens */
    en_sched_destroy(s);
    en_engine_destroy(e);
    e = engine(0, 64);
    s = sched(e, (en_sched_opts){.max_batch_tokens = 64});
    memcpy(p + N, full.tok, sizeof(int32_t) * K);
    r.tokens = p;
    r.n_tokens = N + K;
    r.max_tokens = G - K;
    r.n_generated = K;
    r.user = &tail;
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    run_all(s);
    cr_assert_eq(tail.n, G - K);
    cr_assert_arr_eq(tail.tok, full.tok + K, sizeof(int32_t) * (G - K),
                     "the continuation differs from the undisturbed run");
    en_sched_destroy(s);
    en_engine_destroy(e);
}
