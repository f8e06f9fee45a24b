/*
 * sched_fixture.h — what the scheduler tests (test_scheduler.c on the model, test_scheduler_fake.c
 * on a fake engine) share: a request's outcome as the callbacks record it, the callbacks, a greedy
 * request and running a scheduler until nothing is held. Define MAXG (tokens kept per request)
 * before including it.
 */
#ifndef KM_TEST_SCHED_FIXTURE_H
#define KM_TEST_SCHED_FIXTURE_H

#include <criterion/criterion.h>

#include "engine/engine.h"

typedef struct out {
    int32_t tok[MAXG];
    int n, ended, code, stop_at;
    km_finish finish;
    en_sched_usage u;
    int order; /* when it ended */
    /* en_sched_req.prompt_logprobs: the positions reported, in order, and their logprobs */
    int n_plp, plp_pos[MAXG];
    float plp[MAXG];
} out;

static int g_ended; /* requests ended so far (out.order) */

static inline int on_token(void *ctx, void *user, int index, int32_t token)
{
    out *o = user;
    cr_assert_eq(index, o->n);
    if (o->n < MAXG) o->tok[o->n] = token;
    o->n++;
    return o->stop_at && o->n == o->stop_at;
}

static inline void on_done(void *ctx, void *user, km_finish f, const en_sched_usage *u)
{
    out *o = user;
    o->ended = 1;
    o->finish = f;
    o->u = *u;
    o->order = ++g_ended;
}

static inline void on_error(void *ctx, void *user, int code, const char *msg,
                            const en_sched_usage *u)
{
    out *o = user;
    o->ended = 1;
    o->code = code;
    o->u = *u;
    o->order = ++g_ended;
}

static inline void on_prompt_logprob(void *ctx, void *user, int pos, const en_logprobs *lp)
{
    out *o = user;
    if (o->n_plp < MAXG) o->plp_pos[o->n_plp] = pos, o->plp[o->n_plp] = lp->logprob;
    o->n_plp++;
}

static const en_sched_cb g_cb = {on_token, on_done, on_error, NULL, on_prompt_logprob};

static inline void run_all(en_sched *s)
{
    for (int i = 0; i < 100000 && en_sched_pending(s); i++) cr_assert_geq(en_sched_step(s), 0);
    cr_assert_eq(en_sched_pending(s), 0);
}

static inline en_sched_req greedy_req(const int32_t *p, int n, int max_tokens, out *o)
{
    en_sched_req r = {.tokens = p, .n_tokens = n, .max_tokens = max_tokens, .user = o};
    en_sample_params_default(&r.sample);
    r.sample.temperature = 0;
    return r;
}

#endif
