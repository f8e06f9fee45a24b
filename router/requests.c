/*
 * requests.c — the router's request table and the end of a request (internal.h): requests by the
 * router's own id (a hash of chains), the bounded router queue, the end of a request's life, and
 * its replies, which go through its front's table (q->fops: clients.c writes `tok`/`done`/`err`
 * frames, front.c SSE chunks or one JSON body), so nothing here depends on the front.
 *
 * A request has exactly one end: rt_rq_finish (done) or rt_rq_fail (err), both of which end it
 * with rt_rq_end; rt_rq_end alone is for a request whose client is already gone.
 *
 * The table's invariants, asserted where they must hold: a request is in the table exactly when
 * its rid is non-zero (given right before it is linked) and no two share a rid; it is at most one
 * of queued, parked or at a worker; each worker's inflight count and the router's total count
 * the requests at it; and it is none of these when it ends.
 */
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/internal.h"

/* ---------------------------------------------------------------- frames to workers */

void rt_send_cancel(rt_router *r, rt_wk *w, uint64_t rid)
{
    km_msg m;
    km_msg_init(&m, KM_MSG_CANCEL);
    m.cancel.id = rid;
    if (!km_msg_encode(&m, &r->lim, &r->out, NULL))
        km_zsend(w->dealer, &(km_zframe){r->out.data, r->out.len}, 1, KM_ZDONTWAIT, NULL);
}

/* ---------------------------------------------------------------- request table */

rt_rq *rt_rq_new(rt_router *r, const rt_front_ops *fops)
{
    rt_rq *q = calloc(1, sizeof *q);
    if (!q) return NULL;
    q->r = r;
    q->fops = fops;
    q->worker = -1;
    q->load = -1;
    q->src_fd = -1;
    q->t_arrive = km_now_ns();
    if (r->c.request_timeout_ms) q->limit_ns = q->t_arrive + r->c.request_timeout_ms * 1000000ull;
    return q;
}

void rt_rq_free(rt_rq *q)
{
    if (!q) return;
    km_buf_free(&q->env_mem);
    free(q->salt);
    for (int i = 0; i < KM_PROTO_MAX_STOP; i++) free(q->stop[i]);
    free(q->bias);
    free(q->chunks);
    free(q->chunk_chain);
    km_buf_free(&q->lp);
    km_buf_free(&q->plp);
    free(q->echo_text);
    free(q->grammar);
    free(q->tool_names);
    free(q->tokens);
    free(q->chain);
    km_buf_free(&q->text);
    free(q);
}

void rt_rq_link(rt_router *r, rt_rq *q)
{
    assert(q->rid && !rt_rq_find(r, q->rid));
    size_t b = q->rid % RT_RQ_BUCKETS;
    q->hnext = r->buckets[b];
    r->buckets[b] = q;
}

void rt_rq_unlink(rt_router *r, rt_rq *q)
{
    rt_rq **pp = &r->buckets[q->rid % RT_RQ_BUCKETS];
    while (*pp && *pp != q) pp = &(*pp)->hnext;
    assert(*pp || !q->rid); /* linked since it got its rid (fails before that end unlinked) */
    if (*pp) *pp = q->hnext;
}

rt_rq *rt_rq_find(rt_router *r, uint64_t rid)
{
    for (rt_rq *q = r->buckets[rid % RT_RQ_BUCKETS]; q; q = q->hnext)
        if (q->rid == rid) return q;
    return NULL;
}

void rt_queue_push(rt_router *r, rt_rq *q, bool front)
{
    assert(!q->queued && !q->parked && q->worker < 0);
    q->queued = true;
    q->qprev = q->qnext = NULL;
    if (!r->qhead) {
        r->qhead = r->qtail = q;
    } else if (front) {
        q->qnext = r->qhead;
        r->qhead->qprev = q;
        r->qhead = q;
    } else {
        q->qprev = r->qtail;
        r->qtail->qnext = q;
        r->qtail = q;
    }
    r->n_queued++;
    km_gauge_set(r->s_queue, r->n_queued);
    rt_fair_count(r, q, 1, 0);
}

void rt_queue_remove(rt_router *r, rt_rq *q)
{
    if (!q->queued) return;
    assert(r->n_queued > 0);
    if (q->qprev)
        q->qprev->qnext = q->qnext;
    else
        r->qhead = q->qnext;
    if (q->qnext)
        q->qnext->qprev = q->qprev;
    else
        r->qtail = q->qprev;
    q->queued = false;
    q->qprev = q->qnext = NULL;
    r->n_queued--;
    km_gauge_set(r->s_queue, r->n_queued);
    rt_fair_count(r, q, -1, 0);
}

void rt_rq_release_worker(rt_router *r, rt_rq *q)
{
    if (q->worker < 0) return;
    rt_wk *w = &r->w[q->worker];
    assert(w->inflight > 0 && r->n_inflight > 0);
    w->inflight--;
    km_gauge_set(w->s_inflight, w->inflight);
    r->n_inflight--;
    km_gauge_set(r->s_inflight_all, r->n_inflight);
    rt_fair_count(r, q, 0, -1);
    q->worker = -1;
}

/* A worker ends a request at its own deadline (done, finish "deadline"); this is for a worker
 * that says nothing, so the router gives it this much longer before it answers itself. */
#define RT_DEADLINE_GRACE_NS 2000000000ull

/* Ends the requests of rids (those still in the table) with 504. */
static void expire_some(rt_router *r, const uint64_t *rids, int n, uint64_t now)
{
    for (int i = 0; i < n; i++) {
        rt_rq *q = rt_rq_find(r, rids[i]);
        if (!q) continue;
        char msg[KM_PROTO_MAX_MESSAGE];
        const char *wid = q->worker >= 0 ? r->w[q->worker].id : NULL;
        if (q->limit_ns && now >= q->limit_ns)
            snprintf(msg, sizeof msg,
                     "request timed out after %u ms (router --request-timeout)%s%s",
                     r->c.request_timeout_ms, wid ? "; worker " : "", wid ? wid : "");
        else
            snprintf(msg, sizeof msg, "deadline passed and %s%s said nothing", wid ? "worker " : "",
                     wid ? wid : "no worker");
        if (q->worker >= 0) rt_send_cancel(r, &r->w[q->worker], q->rid);
        rt_rq_fail(r, q, KM_CODE_DEADLINE, 0, msg);
    }
}

void rt_rq_expire(rt_router *r, uint64_t now)
{
    /* rids first, then each one looked up again: ending one request may dispatch or end others;
     * batches until none is left, so a tick ends every expired request, not the first 256 */
    enum { MAX = 256 };
    uint64_t rids[MAX];
    int n = MAX;
    while (n == MAX) {
        n = 0;
        for (int b = 0; b < RT_RQ_BUCKETS && n < MAX; b++)
            for (rt_rq *q = r->buckets[b]; q && n < MAX; q = q->hnext)
                if ((q->limit_ns && now >= q->limit_ns) ||
                    (q->deadline_ns && now >= q->deadline_ns + RT_DEADLINE_GRACE_NS))
                    rids[n++] = q->rid;
        expire_some(r, rids, n, now);
    }
}

/* q ends while its prompt is on the thread pool: the job's result will be thrown away. */
void rt_rq_detach_tokjob(rt_rq *q)
{
    if (q->tokjob) q->tokjob->q = NULL;
    q->tokjob = NULL;
}

/* Takes q off its owner's waiting list. */
void rt_rq_unpark(rt_rq *q)
{
    if (!q->parked) return;
    rt_rq **pp = &q->owner->waiters;
    while (*pp && *pp != q) pp = &(*pp)->wnext;
    if (*pp) *pp = q->wnext;
    q->parked = false;
    q->owner = NULL;
    q->wnext = NULL;
}

/* The owner's prefix is computed (or the owner is gone): its waiters go on their way, through
 * r->redispatch (rt_dispatch, above this file: ending a request can dispatch others). */
void rt_rq_release_waiters(rt_router *r, rt_rq *owner)
{
    while (owner->waiters) {
        rt_rq *w = owner->waiters;
        owner->waiters = w->wnext;
        w->parked = false;
        w->owner = NULL;
        w->wnext = NULL;
        if (!r->stopping) r->redispatch(r, w, false);
    }
}

void rt_rq_end(rt_router *r, rt_rq *q)
{
    rt_rq_detach_tokjob(q);
    rt_rq_unpark(q);
    rt_queue_remove(r, q);
    rt_rq_release_worker(r, q); /* first: a released waiter must not find q as an owner again */
    rt_rq_release_waiters(r, q);
    rt_rq_unlink(r, q);
    assert(!q->queued && !q->parked && q->worker < 0);
    q->fops->release(q);
    rt_rq_free(q);
}

/* ---------------------------------------------------------------- replies to clients */

void rt_rq_reply_error(rt_router *r, rt_rq *q, int code, uint32_t retry_after, const char *msg)
{
    q->fops->error(r, q, code, retry_after, msg);
}

/* The request failed: one `err` to the client, then it is gone. */
void rt_rq_fail(rt_router *r, rt_rq *q, int code, uint32_t retry_after, const char *msg)
{
    r->n_err++;
    km_counter_inc(r->s_req_err);
    rt_rq_reply_error(r, q, code, retry_after, msg);
    KM_INFO("request_failed", "rid=%llu code=%d attempts=%d msg=\"%s\"", (unsigned long long)q->rid,
            code, q->attempts, msg);
    rt_rq_end(r, q);
}

/* One token's text to the client. */
void rt_rq_deliver(rt_router *r, rt_rq *q, int32_t token, const char *text, size_t len)
{
    rt_fair_tokens(r, q, 1);
    q->fops->token(r, q, token, text, len);
}

void rt_rq_finish(rt_router *r, rt_rq *q, km_finish finish, uint32_t cached, const char *wid)
{
    uint64_t now = km_now_ns();
    double total_ms = (now - q->t_arrive) / 1e6;
    double ttft_ms = q->t_first ? (q->t_first - q->t_arrive) / 1e6 : total_ms;
    double queue_ms = q->t_sent ? (q->t_sent - q->t_arrive) / 1e6 + q->worker_queue_ms : total_ms;
    if (q->router_detok) {
        char tail[16];
        int n = md_detok_flush(&q->dt, tail, sizeof tail);
        if (n > 0) {
            /* the held-back bytes of the last token (streams: done.text, or one more chunk) */
            km_buf_append(&q->text, tail, (size_t)n);
        }
    }
    uint32_t cached_out = q->first_cached_set ? q->first_cached : cached;
    if (cached_out > (uint32_t)q->n_prompt) cached_out = (uint32_t)q->n_prompt;
    r->n_ok++;
    km_counter_inc(r->s_req_ok);
    r->prompt_tokens += (uint64_t)q->n_prompt;
    r->cached_tokens += cached_out;
    km_counter_add(r->s_prompt, (uint64_t)q->n_prompt);
    km_counter_add(r->s_cached, cached_out);
    km_hist_observe(r->s_total, total_ms / 1e3);
    r->ewma_total_ms = r->ewma_total_ms > 0 ? 0.9 * r->ewma_total_ms + 0.1 * total_ms : total_ms;
    rt_rq_done d = {.finish = finish,
                    .cached = cached_out,
                    .worker = wid,
                    .queue_ms = queue_ms,
                    .ttft_ms = ttft_ms,
                    .total_ms = total_ms};
    q->fops->done(r, q, &d);
    KM_DEBUG("request_done",
             "rid=%llu worker=%s prompt=%d cached=%u predicted=%.0f gen=%d "
             "ttft_ms=%.1f total_ms=%.1f attempts=%d",
             (unsigned long long)q->rid, wid ? wid : "-", q->n_prompt, cached_out, q->predicted,
             q->n_gen, ttft_ms, total_ms, q->attempts);
    rt_rq_end(r, q);
}
