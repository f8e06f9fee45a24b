/*
 * dispatch.c — choosing a worker for a request (internal.h): the candidates' state, the prefix
 * index's match for the request's page-hash chain, the cost model (route.h, rt_pick), and then
 * the request frame to the chosen worker — or the router queue when no worker can take it, or
 * parking behind an earlier request that is computing the same prefix on the chosen worker.
 *
 * Why parking: two requests of one tenant arriving together would both compute the tenant's
 * prefix, since the second cannot hit pages the first has not finished. The second waits for the
 * first's first token (its prefix pages are then cached) and is dispatched again.
 */
#include <assert.h>
#include <stdio.h>
#include <string.h>

#include "router/internal.h"

bool rt_member_routable(bool connected, bool view_fresh, bool in_view, km_member_state state)
{
    if (!connected) return false; /* the router's own liveness always has a veto */
    if (!view_fresh) return true;
    /* a fresh view is the membership: a slot it does not name (never joined, or forgotten by
     * the controller) gets nothing, however alive its connection looks */
    return in_view && state == KM_MEMBER_READY;
}

/* May w get a new request now: its connection is up, it did not just refuse one (503/529), and a
 * fresh view, when it names w, says "ready". */
bool rt_wk_routable(rt_router *r, rt_wk *w, uint64_t now)
{
    if (w->draining && now >= w->draining_until_ms) w->draining = false;
    return !w->draining && rt_member_routable(w->connected, r->view_fresh, w->in_view, w->member);
}

uint32_t rt_retry_after_ms(rt_router *r)
{
    double cap = 0;
    for (int i = 0; i < r->n_w; i++)
        if (r->w[i].connected) cap += r->c.max_inflight;
    double est = (r->ewma_total_ms > 0 ? r->ewma_total_ms : 1000.0) * (r->n_queued + 1) /
                 (cap > 0 ? cap : 1);
    if (est < 100) est = 100;
    if (est > 30000) est = 30000;
    return (uint32_t)est;
}

/* A request at worker `w` still computing the prompt prefix that q starts with (same first
 * page: same salt and same leading tokens). */
static rt_rq *prefilling_owner(rt_router *r, const rt_rq *q, int w)
{
    for (int b = 0; b < RT_RQ_BUCKETS; b++)
        for (rt_rq *o = r->buckets[b]; o; o = o->hnext)
            if (o != q && o->worker == w && !o->t_first && o->n_chain >= 4 &&
                km_pagehash_eq(o->key, q->key))
                return o;
    return NULL;
}

/* A prefix no worker holds: each candidate's prefill backlog, the prompt tokens of its requests
 * that have no first token yet less what was predicted cached, so that first prefills spread
 * over the workers instead of stacking on the one rendezvous prefers (a worker computing two
 * prefixes is busier than one serving two hits, which requests in flight do not tell). */
static void cold_backlog(rt_router *r, const rt_rq *q, rt_candidate *cand)
{
    for (int i = 0; i < r->n_w; i++)
        if (cand[i].cached_tokens > 0) return;
    for (int b = 0; b < RT_RQ_BUCKETS; b++)
        for (const rt_rq *o = r->buckets[b]; o; o = o->hnext)
            if (o != q && o->worker >= 0 && !o->t_first && o->n_prompt > o->predicted)
                cand[o->worker].backlog += o->n_prompt - o->predicted;
}

/* The request frame to worker pick (tokens = prompt + generated so far, or the prompt alone for
 * a replay), and q's accounting. Returns 0, or a negative km_err when q was failed and freed. */
static int send_to(rt_router *r, rt_rq *q, int pick, int n_ctx, uint32_t remaining, bool from_queue,
                   uint64_t now)
{
    rt_wk *w = &r->w[pick];
    if (q->attempts > 0) {
        /* a new id per attempt: frames still coming from an earlier attempt (a canceled replay,
         * a worker that was only cut off) can never be taken for this one's */
        rt_rq_unlink(r, q);
        q->rid = ++r->next_rid;
        rt_rq_link(r, q);
    }
    km_msg msg;
    km_msg_init(&msg, KM_MSG_REQUEST);
    msg.req = q->q;
    msg.req.id = q->rid;
    msg.req.model = w->r->model_name;
    msg.req.prompt = NULL;
    msg.req.prompt_len = 0;
    msg.req.tokens = q->tokens;
    msg.req.n_tokens = (uint32_t)n_ctx;
    msg.req.max_tokens = remaining ? remaining : q->max_tokens;
    /* a continuation: the sampler's draws go on after the streamed tokens (exact when seeded) */
    msg.req.generated = n_ctx > q->n_prompt ? (uint32_t)(n_ctx - q->n_prompt) : 0;
    msg.req.stream = true;
    msg.req.cache_salt = q->salt;
    msg.req.stop = (const char *const *)q->stop;
    msg.req.logit_bias = q->bias;
    msg.req.chunks = q->chunks;
    msg.req.grammar = q->grammar;
    rt_pull_hint(r, q, &msg.req); /* pull.c: pull the prefix another worker holds */
    /* pd.c: a prefill worker computes it now */
    msg.req.pd = q->pd && msg.req.pull_from;
    if (q->deadline_ns) {
        uint64_t left = (q->deadline_ns - km_now_ns()) / 1000000ull;
        msg.req.deadline_ms = left ? (uint32_t)(left > UINT32_MAX ? UINT32_MAX : left) : 1;
    }
    km_errbuf err = {{0}};
    int rc = km_msg_encode(&msg, &r->lim, &r->out, &err);
    if (!rc) rc = km_zsend(w->dealer, &(km_zframe){r->out.data, r->out.len}, 1, KM_ZDONTWAIT, &err);
    if (rc) {
        char m2[KM_PROTO_MAX_MESSAGE];
        snprintf(m2, sizeof m2, "router could not forward the request: %s", err.msg);
        rt_rq_fail(r, q, rc == KM_EAGAIN ? KM_CODE_OVERLOADED : KM_CODE_INTERNAL,
                   rc == KM_EAGAIN ? rt_retry_after_ms(r) : 0, m2);
        return rc;
    }
    if (from_queue) rt_queue_remove(r, q);
    assert(q->worker < 0 && !q->queued && !q->parked); /* at one worker at a time */
    q->worker = pick;
    q->attempts++;
    q->base = q->replay ? 0 : q->n_gen;
    q->gen_at_send = q->n_gen;
    q->att_next = 0;
    if (!q->t_sent) q->t_sent = km_now_ns();
    w->inflight++;
    w->routed++;
    r->n_inflight++;
    rt_fair_count(r, q, 0, 1);
    km_gauge_set(w->s_inflight, w->inflight);
    km_counter_inc(w->s_routed);
    km_gauge_set(r->s_inflight_all, r->n_inflight);
    if (q->attempts == 1) {
        r->predicted_tokens += (uint64_t)(q->predicted < q->n_prompt ? q->predicted : q->n_prompt);
        km_counter_add(r->s_predicted,
                       (uint64_t)(q->predicted < q->n_prompt ? q->predicted : q->n_prompt));
    }
    rt_index_mark_pending(r->index, pick, q->chain, q->n_chain, now);
    KM_DEBUG("route", "rid=%llu worker=%s prompt=%d predicted_cached=%.0f inflight=%d attempt=%d",
             (unsigned long long)q->rid, w->id, q->n_prompt, q->predicted, w->inflight,
             q->attempts);
    return 0;
}

/* Sends q to a worker, or queues it. Returns 0, or a negative km_err when q was failed and
 * freed. */
int rt_dispatch(rt_router *r, rt_rq *q, bool from_queue)
{
    uint64_t t0 = km_now_ns();
    if (q->deadline_ns && t0 >= q->deadline_ns) {
        rt_rq_fail(r, q, KM_CODE_DEADLINE, 0, "deadline passed before a worker could take it");
        return KM_ETIMEDOUT;
    }
    uint32_t remaining =
        q->max_tokens > (uint32_t)q->n_gen ? q->max_tokens - (uint32_t)q->n_gen : 0;
    if (q->replay) remaining = q->max_tokens;
    if (q->n_gen > 0 && remaining == 0) {
        rt_rq_finish(r, q, KM_FINISH_LENGTH, 0, NULL);
        return 0;
    }
    rt_candidate cand[RT_MAX_WORKERS];
    uint64_t mask = 0, holders = 0; /* may take it; may only hand over pages of it */
    uint64_t now = rt_now_ms();
    int room = rt_fair_room(r, q); /* past --max-inflight: router/fair.c */
    for (int i = 0; i < r->n_w; i++) {
        rt_wk *w = &r->w[i];
        bool usable = rt_wk_routable(r, w, now);
        cand[i] =
            (rt_candidate){.id = w->id,
                           .usable = usable,
                           .inflight = w->inflight,
                           .slots = r->c.worker_slots,
                           .max_inflight = r->c.max_inflight > 0 ? r->c.max_inflight + room : 0};
        if (usable) mask |= 1ull << i;
        if (r->c.policy.mode == RT_MODE_KV && rt_wk_serves_pages(r, w)) holders |= 1ull << i;
    }
    rt_pd_mask(r, cand, mask);
    /* The chain covers the prompt; after a migration the worker also gets the generated tokens
     * (uncached anywhere but on the dead worker), which costs the same everywhere. */
    rt_match m;
    rt_index_match(r->index, q->chain, q->n_chain, mask | holders, r->c.policy.tier_credit,
                   r->c.page_tokens, now, &m);
    for (int i = 0; i < r->n_w; i++) cand[i].cached_tokens = cand[i].usable ? m.credit[i] : 0;
    if (q->n_chunk_chain) rt_chunk_credit(r, q, mask | holders, &m, now, cand);
    rt_pull_price(r, &m, cand); /* pull.c: a prefix another worker holds, priced as a pull */
    rt_chunk_pull_price(r, q, &m, mask | holders, cand); /* pull.c: chunks held elsewhere */
    if (r->c.policy.mode == RT_MODE_KV) cold_backlog(r, q, cand);
    int n_ctx = q->replay ? q->n_prompt : q->n_prompt + q->n_gen;
    /* a tenant at --max-inflight-per-key waits in the queue even when a worker is free */
    int pick = rt_fair_held(r, q)
                   ? -1
                   : rt_pick(&r->c.policy, cand, r->n_w, n_ctx, q->key, &r->policy_state);
    km_hist_observe(r->s_decision, (km_now_ns() - t0) / 1e9);
    if (pick < 0) {
        if (!from_queue) {
            if (q->attempts == 0 && !q->waited && rt_fair_refuse(r, q)) {
                char msg[160];
                snprintf(msg, sizeof msg,
                         "rate limit: this key's tenant has %d requests queued at the router "
                         "already (--max-queue-per-key); other keys are served",
                         r->c.max_queue_per_key);
                rt_rq_fail(r, q, KM_CODE_RATE_LIMIT, rt_retry_after_ms(r), msg);
                return KM_EOVERLOAD;
            }
            if (r->n_queued >= r->c.max_queue && q->attempts == 0 && !q->waited) {
                r->n_overloaded++;
                km_counter_inc(r->s_overloaded);
                char msg[160];
                snprintf(msg, sizeof msg, "cluster overloaded: %d requests queued at the router",
                         r->n_queued);
                rt_rq_fail(r, q, KM_CODE_OVERLOADED, rt_retry_after_ms(r), msg);
                return KM_EOVERLOAD;
            }
            rt_queue_push(r, q, q->attempts > 0);
        }
        return 0;
    }
    rt_wk *w = &r->w[pick];
    if (r->c.policy.mode == RT_MODE_KV && q->n_chain >= 4 && !q->migrations) {
        rt_rq *owner = prefilling_owner(r, q, pick);
        if (owner) {
            if (from_queue) rt_queue_remove(r, q);
            q->parked = true;
            q->waited = true;
            q->owner = owner;
            q->wnext = owner->waiters;
            owner->waiters = q;
            KM_DEBUG("park", "rid=%llu behind=%llu worker=%s", (unsigned long long)q->rid,
                     (unsigned long long)owner->rid, w->id);
            return 0;
        }
    }
    q->predicted = m.credit[pick];
    rt_pull_advise(r, q, pick, &m);
    rt_pd_advise(r, q, pick, &m, n_ctx, mask);
    rt_chunk_pull_advise(r, q, pick, &m, mask | holders); /* pull.c: chunks held elsewhere */
    return send_to(r, q, pick, n_ctx, remaining, from_queue, now);
}

void rt_pump_queue(rt_router *r)
{
    rt_rq *q;
    while ((q = rt_fair_next(r))) {
        if (rt_dispatch(r, q, true) == 0 && q->queued) {
            /* nothing could take it: the others cannot either, unless their deadline passed */
            for (rt_rq *p = r->qhead; p;) {
                rt_rq *pn = p->qnext;
                if (p != q && p->deadline_ns && km_now_ns() >= p->deadline_ns)
                    rt_rq_fail(r, p, KM_CODE_DEADLINE, 0, "deadline passed while queued");
                p = pn;
            }
            return;
        }
    }
}
