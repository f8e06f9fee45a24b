/*
 * sched_scenarios.h — the scheduler scenarios written once over a `backend` (an engine behind
 * en_sched_engine and what a scenario needs of it) and run on two: the model (test_scheduler.c)
 * and a fake engine that needs no model file (test_scheduler_fake.c). The including file defines
 * SCENARIO(name) to make the Criterion test that runs `static void name(const backend *b)` on
 * its backend, and MAXG and NR before including sched_fixture.h and this file.
 */
#ifndef KM_TEST_SCHED_SCENARIOS_H
#define KM_TEST_SCHED_SCENARIOS_H

#include <string.h>
#include <unistd.h>

#include "tests/unit/sched_fixture.h"

/* What a scenario needs of an engine. One scheduler (and its engine) is open at a time. */
typedef struct backend {
    int pt;      /* page_tokens */
    int n_vocab; /* tokens are in [0, n_vocab) */
    int n_batch; /* requests of the batching scenarios (at most NR) */
    /* n prompt tokens that are never end-of-generation, different per salt */
    void (*prompt)(int32_t *p, int n, int salt);
    /* a scheduler over a fresh engine: hot_pages pages of KV (0: plenty), max_batch tokens */
    en_sched *(*open)(int hot_pages, int max_batch, en_sched_opts o);
    void (*close)(en_sched *s); /* the scheduler and its engine */
    kv_store *(*kv)(void);      /* the open engine's store */
    /* the greedy tokens after p when it runs alone (to max_tokens or end of generation) */
    int (*reference)(const int32_t *p, int n, int max_tokens, int32_t *toks);
    /* called after each step (may be NULL): the fake engine checks the batch's budget there */
    void (*check_steps)(int budget, int chunk);
} backend;

/* o ended normally with the tokens p gets alone. */
static inline void check_alone(const backend *b, const int32_t *p, int n, int max_tokens,
                               const out *o, int i)
{
    int32_t want[MAXG];
    int k = b->reference(p, n, max_tokens, want);
    cr_assert(o->ended && !o->code, "request %d failed (%d)", i, o->code);
    cr_assert_eq(o->n, k, "request %d: %d tokens, alone %d", i, o->n, k);
    cr_assert_arr_eq(o->tok, want, sizeof(int32_t) * k, "request %d differs from it alone", i);
}

/* Once every request ended, no page may stay held: only cached pages remain. */
static inline void check_nothing_pinned(kv_store *kv)
{
    kv_store_stats st;
    kv_store_stats_get(kv, &st);
    cr_assert_eq(st.tier[KV_TIER_HOT].pinned_pages, 0, "%llu pages still held",
                 (unsigned long long)st.tier[KV_TIER_HOT].pinned_pages);
}

/* ---------------------------------------------------------------- scenarios */

static int32_t g_p[NR][200];
static int g_len[NR];

static inline void make_prompts(const backend *b)
{
    for (int i = 0; i < b->n_batch; i++) {
        g_len[i] = 5 + (i * 53) % 180;
        b->prompt(g_p[i], g_len[i], i);
        if (i % 3 == 1) memcpy(g_p[i], g_p[0], sizeof(int32_t) * (g_len[i] < 40 ? g_len[i] : 40));
    }
}

/* n_batch requests, some arriving while the others run, through 8 running sequences, steps of 128
 * tokens and prefill chunks of `chunk`: every request gets the tokens it gets alone. */
static inline void check_batched(const backend *b, int hot_pages, int chunk, int expect_preempt)
{
    make_prompts(b);
    static out got[NR];
    memset(got, 0, sizeof got);
    en_sched *s =
        b->open(hot_pages, 128,
                (en_sched_opts){.max_running = 8, .max_batch_tokens = 128, .prefill_chunk = chunk});
    const int nr = b->n_batch;
    for (int i = 0; i < nr; i++) {
        en_sched_req r = greedy_req(g_p[i], g_len[i], 12 + i % 5, &got[i]);
        cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
        if (i == nr / 2) /* late arrivals join a running batch */
            for (int k = 0; k < 3; k++) cr_assert_geq(en_sched_step(s), 0);
    }
    for (int i = 0; i < 100000 && en_sched_pending(s); i++) {
        cr_assert_geq(en_sched_step(s), 0);
        en_sched_stats st;
        en_sched_stats_get(s, &st);
        cr_assert_leq(st.running, 8);
    }
    cr_assert_eq(en_sched_pending(s), 0);
    if (b->check_steps) b->check_steps(128, chunk);
    en_sched_stats st;
    en_sched_stats_get(s, &st);
    if (expect_preempt) cr_assert_gt(st.preemptions, 0, "a small KV store forces preemption");
    cr_assert_eq(st.completed, (uint64_t)nr);
    b->close(s);
    for (int i = 0; i < nr; i++) check_alone(b, g_p[i], g_len[i], 12 + i % 5, &got[i], i);
}

SCENARIO(batched_chunked_prefill_gives_the_same_greedy_tokens_as_alone)
{
    check_batched(b, 0, 32, 0);
}

SCENARIO(a_full_kv_store_preempts_and_outputs_stay_the_same)
{
    /* 384 tokens (24 pages of the model's 16): far less than 8 running sequences want */
    check_batched(b, 384 / b->pt, 64, 1);
}

SCENARIO(decode_prefill_caps_prompt_tokens_in_steps_that_decode_and_changes_no_token)
{
    int32_t a[9], p[100];
    b->prompt(a, 9, 4);
    b->prompt(p, 100, 9);
    out oa = {0}, ob = {0};
    en_sched *s = b->open(0, 128, (en_sched_opts){.max_batch_tokens = 128, .decode_prefill = 8});
    en_sched_req r = greedy_req(a, 9, 40, &oa);
    r.ignore_eos = 1;
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    cr_assert_gt(en_sched_step(s), 0); /* a is decoding now */
    r = greedy_req(p, 100, 6, &ob);
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    int capped = 0;
    while (!ob.ended) {
        en_sched_stats s0, s1;
        en_sched_stats_get(s, &s0);
        cr_assert_gt(en_sched_step(s), 0);
        en_sched_stats_get(s, &s1);
        if (s1.decode_tokens > s0.decode_tokens && !oa.ended) {
            cr_assert_leq(s1.prefill_tokens - s0.prefill_tokens, 8,
                          "a step that decodes carries at most 8 prompt tokens");
            capped++;
        }
    }
    cr_assert_geq(capped, 100 / 8, "p went in 8 tokens at a time next to a's decodes");
    run_all(s);
    b->close(s);
    check_alone(b, p, 100, 6, &ob, 1);
}

SCENARIO(a_cached_prefix_is_attached_and_only_the_rest_is_prefilled)
{
    const int n = 6 * b->pt + 4;
    int32_t p[100];
    b->prompt(p, n, 7);
    out a = {0}, c = {0}, d = {0};
    en_sched *s = b->open(0, 128, (en_sched_opts){.max_batch_tokens = 128});
    en_sched_req r = greedy_req(p, n, 8, &a);
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    run_all(s);
    en_sched_stats s0, s1;
    en_sched_stats_get(s, &s0);
    r = greedy_req(p, n, 8, &c);
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    run_all(s);
    en_sched_stats_get(s, &s1);
    cr_assert_eq(a.u.cached_tokens, 0);
    cr_assert_eq(c.u.cached_tokens, 6 * b->pt, "6 full pages reused");
    cr_assert_eq(s1.prefill_tokens - s0.prefill_tokens, 4, "only the 4 uncached tokens");
    cr_assert_eq(c.n, a.n);
    cr_assert_arr_eq(a.tok, c.tok, sizeof(int32_t) * (a.n < MAXG ? a.n : MAXG));
    r = greedy_req(p, n, 8, &d); /* another tenant never sees those pages */
    r.cache_salt = "tenant-b";
    r.cache_salt_len = 8;
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    run_all(s);
    cr_assert_eq(d.u.cached_tokens, 0);
    b->close(s);
    check_alone(b, p, n, 8, &c, 1);
}

SCENARIO(a_sequence_that_can_never_fit_fails_without_crashing)
{
    en_sched *s = b->open(4, 128, (en_sched_opts){.max_batch_tokens = 128});
    int32_t p[100];
    b->prompt(p, 6 * b->pt + 4, 3);
    out big = {0}, small = {0};
    en_sched_req r = greedy_req(p, 6 * b->pt + 4, 4, &big);
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    r = greedy_req(p, b->pt + 4, 4, &small);
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    run_all(s);
    cr_assert_eq(big.code, KM_CODE_TOO_LARGE);
    cr_assert(small.ended && !small.code, "the next request is served");
    b->close(s);
    check_alone(b, p, b->pt + 4, 4, &small, 1);
}

SCENARIO(a_sequence_that_fits_but_finds_the_pages_pinned_is_handed_back_not_refused)
{
    en_sched *s = b->open(8, 128, (en_sched_opts){.max_batch_tokens = 128});
    /* a memory-pressure episode: another holder pins 6 of the 8 pages */
    kv_store *kv = b->kv();
    kv_seq *ballast = NULL;
    cr_assert_eq(kv_seq_create(kv, &ballast), 0);
    cr_assert_eq(kv_seq_reserve(kv, ballast, 6 * b->pt), 0);
    const int n = 4 * b->pt - 4; /* 4 pages: more than the 2 free, less than the 8 */
    int32_t p[100];
    b->prompt(p, n, 5);
    out a = {0}, c = {0};
    en_sched_req r = greedy_req(p, n, 4, &a);
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    run_all(s);
    cr_assert_eq(a.code, KM_CODE_UNAVAILABLE, "4 pages would fit an empty cache: retry elsewhere");
    en_sched_stats st;
    en_sched_stats_get(s, &st);
    cr_assert_eq(st.kv_full, 1);
    kv_seq_destroy(kv, ballast);
    r = greedy_req(p, n, 4, &c);
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    run_all(s);
    cr_assert(c.ended && !c.code, "served once the pages are free");
    b->close(s);
}

SCENARIO(higher_priority_first_and_aging_prevents_starvation)
{
    int32_t p[8];
    b->prompt(p, 8, 1);
    for (int aging = 1; aging >= 0; aging--) {
        g_ended = 0;
        en_sched *s = b->open(0, 64,
                              (en_sched_opts){.max_running = 1,
                                              .max_batch_tokens = 64,
                                              .aging_per_s = aging ? 1e9 : 1e-9});
        out first = {0}, lo = {0}, hi = {0};
        en_sched_req r = greedy_req(p, 8, 2, &first);
        cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
        r = greedy_req(p, 8, 2, &lo);
        r.priority = -100;
        r.arrival_ns = km_now_ns() - 1000000000ull; /* waited a second already */
        cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
        r = greedy_req(p, 8, 2, &hi);
        r.priority = 100;
        cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
        run_all(s);
        if (aging)
            cr_assert_lt(lo.order, hi.order, "with aging the older request is admitted first");
        else
            cr_assert_lt(hi.order, lo.order, "without aging the higher priority is first");
        b->close(s);
    }
}

SCENARIO(cancel_deadline_and_stop_end_requests)
{
    en_sched *s = b->open(0, 64, (en_sched_opts){.max_batch_tokens = 64});
    int32_t p[10];
    b->prompt(p, 10, 2);
    out c = {0}, d = {0}, st = {0};
    uint64_t rid;
    en_sched_req r = greedy_req(p, 10, 1000, &c);
    r.ignore_eos = 1;
    cr_assert_eq(en_sched_submit(s, &r, &rid), 0);
    r = greedy_req(p, 10, 1000, &d);
    r.ignore_eos = 1;
    r.deadline_ns = km_now_ns() + 50000000ull;
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    r = greedy_req(p, 10, 1000, &st);
    r.ignore_eos = 1;
    st.stop_at = 3;
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    for (int i = 0; i < 5; i++) cr_assert_geq(en_sched_step(s), 0);
    cr_assert_eq(en_sched_cancel(s, rid), 0);
    for (int i = 0; i < 100000 && !d.ended; i++) { /* steps until the deadline passes */
        cr_assert_geq(en_sched_step(s), 0);
        usleep(1000);
    }
    run_all(s);
    cr_assert_eq(c.finish, KM_FINISH_CANCELED);
    cr_assert_eq(d.finish, KM_FINISH_DEADLINE);
    cr_assert_eq(st.finish, KM_FINISH_STOP);
    cr_assert_eq(st.n, 3);
    cr_assert_eq(en_sched_cancel(s, rid), KM_ENOTFOUND);
    b->close(s);
}

SCENARIO(refusals_are_errors_not_crashes)
{
    en_sched *s =
        b->open(0, 64, (en_sched_opts){.max_batch_tokens = 64, .max_queue = 2, .max_ctx = 64});
    int32_t p[80];
    b->prompt(p, 80, 5);
    out o[3];
    memset(o, 0, sizeof o);
    en_sched_req r = greedy_req(p, 64, 4, &o[0]);
    cr_assert_eq(en_sched_submit(s, &r, NULL), KM_ERANGE, "no room left in max_ctx");
    int32_t keep = p[3];
    p[3] = b->n_vocab;
    r = greedy_req(p, 10, 4, &o[0]);
    cr_assert_eq(en_sched_submit(s, &r, NULL), KM_EINVAL, "a token outside the vocabulary");
    p[3] = keep;
    for (int i = 0; i < 2; i++) {
        r = greedy_req(p, 10, 4, &o[i]);
        cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    }
    r = greedy_req(p, 10, 4, &o[2]);
    cr_assert_eq(en_sched_submit(s, &r, NULL), KM_EOVERLOAD);
    run_all(s);
    b->close(s);
    /* max_tokens is clipped to the context: 60 prompt + 4 */
    s = b->open(0, 64, (en_sched_opts){.max_batch_tokens = 64, .max_ctx = 64});
    out clip = {0};
    r = greedy_req(p, 60, 100, &clip);
    r.ignore_eos = 1;
    cr_assert_eq(en_sched_submit(s, &r, NULL), 0);
    run_all(s);
    cr_assert_eq(clip.n, 4);
    cr_assert_eq(clip.finish, KM_FINISH_LENGTH);
    b->close(s);
}

#endif
