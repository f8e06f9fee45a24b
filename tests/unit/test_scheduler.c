/*
 * test_scheduler.c — wk_sched_* over the real engine and the default model: continuous batching
 * with chunked prefill gives the same greedy tokens as each request alone, prefix reuse skips
 * cached prompt tokens, a full KV store preempts instead of failing, a sequence that can never
 * fit fails cleanly, priorities with aging, cancellation, deadlines, stop callbacks and refusals.
 * Without the model every test skips and says so.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "worker/scheduler.h"

#define MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"
/* Under the sanitizers the engine is an order of magnitude slower: fewer requests there. */
#if defined(__SANITIZE_ADDRESS__)
enum { MAXG = 32, NR = 6 };
#else
enum { MAXG = 32, NR = 12 };
#endif

typedef struct out {
    int32_t tok[MAXG];
    int n, ended, code, stop_at;
    km_finish finish;
    wk_sched_usage u;
    int order; /* when it ended */
} out;

static wk_model *g_model;
static int g_ended;

static bool need_model(void)
{
    if (access(MODEL, R_OK)) {
        cr_skip_test("needs %s (make deps)", MODEL);
        return false;
    }
    km_errbuf err = {{0}};
    if (!g_model) cr_assert_eq(wk_model_load(MODEL, &g_model, &err), 0, "%s", err.msg);
    return true;
}

static void fini(void)
{
    wk_model_free(g_model);
    g_model = NULL;
}

TestSuite(sched, .fini = fini, .timeout = 300);

static int on_token(void *ctx, void *user, int index, int32_t token)
{
    out *o = user;
    cr_assert_eq(index, o->n);
    if (o->n < MAXG) o->tok[o->n] = token;
    o->n++;
    return o->stop_at && o->n == o->stop_at;
}

static void on_done(void *ctx, void *user, km_finish f, const wk_sched_usage *u)
{
    out *o = user;
    o->ended = 1;
    o->finish = f;
    o->u = *u;
    o->order = ++g_ended;
}

static void on_error(void *ctx, void *user, int code, const char *msg, const wk_sched_usage *u)
{
    out *o = user;
    o->ended = 1;
    o->code = code;
    o->u = *u;
    o->order = ++g_ended;
}

static wk_engine *engine(size_t kv_bytes, int max_batch)
{
    wk_engine *e;
    km_errbuf err = {{0}};
    wk_engine_opts o = {.n_threads = 2, .max_batch_tokens = max_batch, .kv_bytes = kv_bytes};
    cr_assert_eq(wk_engine_create(g_model, &o, &e, &err), 0, "%s", err.msg);
    return e;
}

static wk_sched *sched(wk_engine *e, wk_sched_opts o)
{
    wk_sched *s;
    km_errbuf err = {{0}};
    wk_sched_cb cb = {on_token, on_done, on_error, NULL};
    cr_assert_eq(wk_sched_create(e, g_model, &o, &cb, &s, &err), 0, "%s", err.msg);
    return s;
}

static void run_all(wk_sched *s)
{
    for (int i = 0; i < 100000 && wk_sched_pending(s); i++) cr_assert_geq(wk_sched_step(s), 0);
    cr_assert_eq(wk_sched_pending(s), 0);
}

static void prompt(int32_t *p, int n, int salt)
{
    for (int i = 0; i < n; i++) p[i] = 300 + (i * 131 + salt * 977) % 30000;
}

static wk_sched_req greedy_req(const int32_t *p, int n, int max_tokens, out *o)
{
    wk_sched_req r = {.tokens = p, .n_tokens = n, .max_tokens = max_tokens, .user = o};
    wk_sample_params_default(&r.sample);
    r.sample.temperature = 0;
    return r;
}

/* Each request alone on a fresh engine: the reference. */
static void alone(const int32_t *p, int n, int max_tokens, out *o)
{
    wk_engine *e = engine(0, 64);
    wk_sched *s = sched(e, (wk_sched_opts){.max_running = 1, .max_batch_tokens = 64});
    wk_sched_req r = greedy_req(p, n, max_tokens, o);
    cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    run_all(s);
    wk_sched_destroy(s);
    wk_engine_destroy(e);
}

static int32_t g_p[NR][200];
static int g_len[NR];

static void make_prompts(void)
{
    for (int i = 0; i < NR; i++) {
        g_len[i] = 5 + (i * 53) % 180;
        prompt(g_p[i], g_len[i], i);
        if (i % 3 == 1) memcpy(g_p[i], g_p[0], sizeof(int32_t) * (g_len[i] < 40 ? g_len[i] : 40));
    }
}

static void check_batched(size_t kv_bytes, int chunk, int expect_preempt)
{
    make_prompts();
    static out ref[NR], got[NR];
    memset(ref, 0, sizeof ref);
    memset(got, 0, sizeof got);
    for (int i = 0; i < NR; i++) alone(g_p[i], g_len[i], 12 + i % 5, &ref[i]);
    wk_engine *e = engine(kv_bytes, 128);
    wk_sched *s = sched(
        e, (wk_sched_opts){.max_running = 8, .max_batch_tokens = 128, .prefill_chunk = chunk});
    for (int i = 0; i < NR; i++) {
        wk_sched_req r = greedy_req(g_p[i], g_len[i], 12 + i % 5, &got[i]);
        cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
        if (i == NR / 2) /* late arrivals join a running batch */
            for (int k = 0; k < 3; k++) wk_sched_step(s);
    }
    run_all(s);
    wk_sched_stats st;
    wk_sched_stats_get(s, &st);
    for (int i = 0; i < NR; i++) {
        cr_assert(got[i].ended && !got[i].code, "request %d failed (%d)", i, got[i].code);
        cr_assert_eq(got[i].n, ref[i].n, "request %d: %d tokens, alone %d", i, got[i].n, ref[i].n);
        cr_assert_arr_eq(got[i].tok, ref[i].tok, sizeof(int32_t) * ref[i].n,
                         "request %d differs from the same request alone", i);
    }
    if (expect_preempt) cr_assert_gt(st.preemptions, 0, "a small KV store forces preemption");
    wk_sched_destroy(s);
    wk_engine_destroy(e);
}

Test(sched, decode_prefill_caps_prompt_tokens_in_steps_that_decode_and_changes_no_token)
{
    if (!need_model()) return;
    make_prompts();
    int32_t p[100];
    prompt(p, 100, 9);
    out ref = {0}, a = {0}, b = {0};
    alone(p, 100, 6, &ref);
    wk_engine *e = engine(0, 128);
    wk_sched *s = sched(e, (wk_sched_opts){.max_batch_tokens = 128, .decode_prefill = 8});
    wk_sched_req r = greedy_req(g_p[0], g_len[0], 40, &a);
    cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    for (int k = 0; k < 3; k++) wk_sched_step(s); /* a is decoding now */
    r = greedy_req(p, 100, 6, &b);
    cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    for (int k = 0; k < 5 && !a.ended; k++) {
        wk_sched_stats s0, s1;
        wk_sched_stats_get(s, &s0);
        cr_assert_geq(wk_sched_step(s), 0);
        wk_sched_stats_get(s, &s1);
        cr_assert_leq(s1.prefill_tokens - s0.prefill_tokens, 8,
                      "a step that decodes carries at most 8 prompt tokens");
    }
    run_all(s);
    cr_assert(b.ended && !b.code);
    cr_assert_eq(b.n, ref.n);
    cr_assert_arr_eq(b.tok, ref.tok, sizeof(int32_t) * ref.n, "same tokens as alone");
    wk_sched_destroy(s);
    wk_engine_destroy(e);
}

Test(sched, a_step_budget_cuts_prefill_chunks_by_measured_cost_and_changes_no_token)
{
    if (!need_model()) return;
    int32_t p[180];
    prompt(p, 180, 5);
    out ref = {0}, a = {0};
    alone(p, 180, 8, &ref);
    wk_engine *e = engine(0, 128);
    /* 1 ms is less than any page of this model's prefill takes: after the first step (nothing
     * measured yet) every step carries the floor, one page of the prompt */
    wk_sched *s = sched(e, (wk_sched_opts){.max_batch_tokens = 128, .step_budget_ms = 1});
    wk_sched_req r = greedy_req(p, 180, 8, &a);
    cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    cr_assert_gt(wk_sched_step(s), 0);
    while (!a.n) {
        wk_sched_stats s0, s1;
        wk_sched_stats_get(s, &s0);
        cr_assert_gt(s0.ns_per_unit, 0, "the first step taught the cost");
        cr_assert_gt(wk_sched_step(s), 0);
        wk_sched_stats_get(s, &s1);
        cr_assert_leq(s1.prefill_tokens - s0.prefill_tokens, 16, "one page per step");
    }
    run_all(s);
    wk_sched_stats st;
    wk_sched_stats_get(s, &st);
    cr_assert_gt(st.budget_cut, 0);
    /* the prompt's last 52 tokens took at least 4 steps (asserted per step above) */
    cr_assert_geq(st.steps, 1 + (180 - 128) / 16, "%llu steps", (unsigned long long)st.steps);
    cr_assert(a.ended && !a.code);
    cr_assert_eq(a.n, ref.n);
    cr_assert_arr_eq(a.tok, ref.tok, sizeof(int32_t) * ref.n, "same tokens as one chunk");
    wk_sched_destroy(s);
    wk_engine_destroy(e);
}

Test(sched, under_a_step_budget_a_short_prompt_is_not_stuck_behind_a_long_prefill)
{
    if (!need_model()) return;
    int32_t lp[180], sp[20];
    prompt(lp, 180, 11);
    prompt(sp, 20, 12);
    out ref = {0}, lo = {0}, sh = {0};
    alone(sp, 20, 4, &ref);
    wk_engine *e = engine(0, 128);
    wk_sched *s = sched(e, (wk_sched_opts){.max_batch_tokens = 128, .step_budget_ms = 1});
    wk_sched_req r = greedy_req(lp, 180, 4, &lo);
    cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    cr_assert_gt(wk_sched_step(s), 0); /* the long prompt is admitted and prefilling */
    r = greedy_req(sp, 20, 4, &sh);
    cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    for (int i = 0; i < 100 && !sh.n; i++) cr_assert_geq(wk_sched_step(s), 0);
    cr_assert_gt(sh.n, 0);
    cr_assert_eq(lo.n, 0, "the short prompt's first token came after the long one's");
    run_all(s);
    cr_assert_eq(sh.n, ref.n);
    cr_assert_arr_eq(sh.tok, ref.tok, sizeof(int32_t) * ref.n, "same tokens as alone");
    cr_assert(lo.ended && !lo.code);
    wk_sched_destroy(s);
    wk_engine_destroy(e);
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
    wk_engine *e = engine(0, 64);
    wk_sched *s = sched(e, (wk_sched_opts){.max_batch_tokens = 64});
    wk_sched_req r = greedy_req(p, N, G, &full);
    r.sample.temperature = 0.9f;
    r.sample.top_k = 50;
    r.sample.repeat_penalty = 1.1f;
    r.sample.seed = 1234;
    r.ignore_eos = 1;
    cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    run_all(s);
    cr_assert_eq(full.n, G);
    /* the "next worker": a fresh engine, the prompt plus the first K tokens */
    wk_sched_destroy(s);
    wk_engine_destroy(e);
    e = engine(0, 64);
    s = sched(e, (wk_sched_opts){.max_batch_tokens = 64});
    memcpy(p + N, full.tok, sizeof(int32_t) * K);
    r.tokens = p;
    r.n_tokens = N + K;
    r.max_tokens = G - K;
    r.n_generated = K;
    r.user = &tail;
    cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    run_all(s);
    cr_assert_eq(tail.n, G - K);
    cr_assert_arr_eq(tail.tok, full.tok + K, sizeof(int32_t) * (G - K),
                     "the continuation differs from the undisturbed run");
    wk_sched_destroy(s);
    wk_engine_destroy(e);
}

Test(sched, batched_chunked_prefill_gives_the_same_greedy_tokens_as_alone)
{
    if (!need_model()) return;
    check_batched(0, 32, 0);
}

Test(sched, a_full_kv_store_preempts_and_outputs_stay_the_same)
{
    if (!need_model()) return;
    /* 24 pages of 16 tokens: far less than 8 running sequences want */
    check_batched((size_t)24 * 16 * 23040, 64, 1);
}

Test(sched, cached_prefix_is_not_prefilled_again)
{
    if (!need_model()) return;
    wk_engine *e = engine(0, 128);
    wk_sched *s = sched(e, (wk_sched_opts){.max_batch_tokens = 128});
    int32_t p[100];
    prompt(p, 100, 7);
    out a = {0}, b = {0};
    wk_sched_req r = greedy_req(p, 100, 8, &a);
    cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    run_all(s);
    wk_sched_stats st0;
    wk_sched_stats_get(s, &st0);
    r = greedy_req(p, 100, 8, &b);
    cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    run_all(s);
    wk_sched_stats st1;
    wk_sched_stats_get(s, &st1);
    cr_assert_eq(a.u.cached_tokens, 0);
    cr_assert_eq(b.u.cached_tokens, 96, "6 full pages reused");
    cr_assert_eq(st1.prefill_tokens - st0.prefill_tokens, 4, "only the 4 uncached tokens");
    cr_assert_arr_eq(a.tok, b.tok, sizeof(int32_t) * 8);
    /* another salt never sees those pages */
    out c = {0};
    r = greedy_req(p, 100, 8, &c);
    r.cache_salt = "tenant-b";
    r.cache_salt_len = 8;
    cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    run_all(s);
    cr_assert_eq(c.u.cached_tokens, 0);
    wk_sched_destroy(s);
    wk_engine_destroy(e);
}

Test(sched, a_sequence_that_can_never_fit_fails_without_crashing)
{
    if (!need_model()) return;
    wk_engine *e = engine((size_t)4 * 16 * 23040, 128); /* 4 pages = 64 tokens */
    wk_sched *s = sched(e, (wk_sched_opts){.max_batch_tokens = 128});
    int32_t p[100];
    prompt(p, 100, 3);
    out a = {0}, b = {0};
    wk_sched_req r = greedy_req(p, 100, 4, &a);
    cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    r = greedy_req(p, 20, 4, &b);
    cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    run_all(s);
    cr_assert_eq(a.code, KM_CODE_TOO_LARGE);
    cr_assert(b.ended && !b.code, "the next request is served");
    cr_assert_eq(b.n, 4);
    wk_sched_destroy(s);
    wk_engine_destroy(e);
}

Test(sched, a_sequence_that_fits_but_finds_the_pages_pinned_is_handed_back_not_refused)
{
    if (!need_model()) return;
    wk_engine *e = engine((size_t)8 * 16 * 23040, 128); /* 8 pages = 128 tokens */
    wk_sched *s = sched(e, (wk_sched_opts){.max_batch_tokens = 128});
    /* a memory-pressure episode: another holder pins 6 of the 8 pages */
    kv_store *kv = wk_engine_kv(e);
    kv_seq *ballast = NULL;
    cr_assert_eq(kv_seq_create(kv, &ballast), 0);
    cr_assert_eq(kv_seq_reserve(kv, ballast, 6 * 16), 0);
    int32_t p[60];
    prompt(p, 60, 5);
    out a = {0};
    wk_sched_req r = greedy_req(p, 60, 4, &a);
    cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    run_all(s);
    cr_assert_eq(a.code, KM_CODE_UNAVAILABLE, "4 pages would fit an empty cache: retry elsewhere");
    wk_sched_stats st;
    wk_sched_stats_get(s, &st);
    cr_assert_eq(st.kv_full, 1);
    kv_seq_destroy(kv, ballast);
    out b = {0};
    r = greedy_req(p, 60, 4, &b);
    cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    run_all(s);
    cr_assert(b.ended && !b.code, "served once the pages are free");
    wk_sched_destroy(s);
    wk_engine_destroy(e);
}

Test(sched, higher_priority_first_and_aging_prevents_starvation)
{
    if (!need_model()) return;
    g_ended = 0;
    wk_engine *e = engine(0, 64);
    wk_sched *s =
        sched(e, (wk_sched_opts){.max_running = 1, .max_batch_tokens = 64, .aging_per_s = 1e9});
    int32_t p[8];
    prompt(p, 8, 1);
    out lo = {0}, hi = {0}, first = {0};
    wk_sched_req r = greedy_req(p, 8, 2, &first);
    cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    /* With huge aging, the older low-priority request wins over a newer high one. */
    r = greedy_req(p, 8, 2, &lo);
    r.priority = -100;
    r.arrival_ns = km_now_ns() - 1000000000ull;
    cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    r = greedy_req(p, 8, 2, &hi);
    r.priority = 100;
    cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    run_all(s);
    cr_assert_lt(lo.order, hi.order, "aged request admitted first");
    wk_sched_destroy(s);
    /* Without aging credit to speak of, priority decides. */
    g_ended = 0;
    s = sched(e, (wk_sched_opts){.max_running = 1, .max_batch_tokens = 64, .aging_per_s = 1e-9});
    memset(&lo, 0, sizeof lo);
    memset(&hi, 0, sizeof hi);
    memset(&first, 0, sizeof first);
    r = greedy_req(p, 8, 2, &first);
    cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    r = greedy_req(p, 8, 2, &lo);
    r.priority = -5;
    cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    r = greedy_req(p, 8, 2, &hi);
    r.priority = 5;
    cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    run_all(s);
    cr_assert_lt(hi.order, lo.order, "higher priority first");
    wk_sched_destroy(s);
    wk_engine_destroy(e);
}

Test(sched, cancel_deadline_and_stop_end_requests)
{
    if (!need_model()) return;
    wk_engine *e = engine(0, 64);
    wk_sched *s = sched(e, (wk_sched_opts){.max_batch_tokens = 64});
    int32_t p[10];
    prompt(p, 10, 2);
    out c = {0}, d = {0}, st = {0};
    uint64_t rid;
    wk_sched_req r = greedy_req(p, 10, 1000, &c);
    r.ignore_eos = 1;
    cr_assert_eq(wk_sched_submit(s, &r, &rid), 0);
    r = greedy_req(p, 10, 1000, &d);
    r.ignore_eos = 1;
    r.deadline_ns = km_now_ns() + 50000000ull;
    cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    r = greedy_req(p, 10, 1000, &st);
    r.ignore_eos = 1;
    st.stop_at = 3;
    cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    for (int i = 0; i < 5; i++) wk_sched_step(s);
    cr_assert_eq(wk_sched_cancel(s, rid), 0);
    run_all(s);
    cr_assert_eq(c.finish, KM_FINISH_CANCELED);
    cr_assert_eq(d.finish, KM_FINISH_DEADLINE);
    cr_assert_eq(st.finish, KM_FINISH_STOP);
    cr_assert_eq(st.n, 3);
    cr_assert_eq(wk_sched_cancel(s, rid), KM_ENOTFOUND);
    wk_sched_destroy(s);
    wk_engine_destroy(e);
}

Test(sched, refusals_are_errors_not_crashes)
{
    if (!need_model()) return;
    wk_engine *e = engine(0, 64);
    wk_sched *s = sched(e, (wk_sched_opts){.max_batch_tokens = 64, .max_queue = 2, .max_ctx = 64});
    int32_t p[80];
    prompt(p, 80, 5);
    out o[4] = {0};
    wk_sched_req r = greedy_req(p, 64, 4, &o[0]);
    cr_assert_eq(wk_sched_submit(s, &r, NULL), KM_ERANGE, "no room left in max_ctx");
    p[3] = 1 << 30;
    r = greedy_req(p, 10, 4, &o[0]);
    cr_assert_eq(wk_sched_submit(s, &r, NULL), KM_EINVAL);
    p[3] = 5;
    for (int i = 0; i < 2; i++) {
        r = greedy_req(p, 10, 4, &o[i]);
        cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    }
    r = greedy_req(p, 10, 4, &o[2]);
    cr_assert_eq(wk_sched_submit(s, &r, NULL), KM_EOVERLOAD);
    /* max_tokens is clipped to the context: 60 prompt + 4 */
    wk_sched_destroy(s);
    s = sched(e, (wk_sched_opts){.max_batch_tokens = 64, .max_ctx = 64});
    out clip = {0};
    r = greedy_req(p, 60, 100, &clip);
    r.ignore_eos = 1;
    cr_assert_eq(wk_sched_submit(s, &r, NULL), 0);
    run_all(s);
    cr_assert_eq(clip.n, 4);
    cr_assert_eq(clip.finish, KM_FINISH_LENGTH);
    wk_sched_destroy(s);
    wk_engine_destroy(e);
}
