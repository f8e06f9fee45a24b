/*
 * router.c — the kvmesh-router daemon (router.h, "the router daemon"): the client front
 * (ZeroMQ ROUTER), one DEALER per worker for requests and replays, one SUB for every worker's KV
 * events, the OpenAI-compatible HTTP front, the request relay with migration, the bounded queue,
 * metrics and status.
 *
 * Why it is built this way:
 *  - One libuv loop on one thread: ZeroMQ sockets are watched through their descriptors
 *    (uv_poll on ZMQ_FD) and drained until ZMQ_EVENTS says empty, from the poll callbacks and
 *    from a uv_check after every loop iteration (ZMQ_FD is edge-like: a send can swallow a
 *    notification, the check catches it). HTTP, timers and signals share the loop, so request
 *    state needs no lock and a token goes from a worker to its client inside one callback.
 *  - Workers are told apart by their DEALER socket, and their liveness comes from a socket
 *    monitor: a disconnect (process killed, ZMTP heartbeat timeout) makes the worker unusable at
 *    once and migrates its requests; a reconnect asks it for a replay of its KV events.
 *  - The router forwards every request as token ids with stream=true, whatever the client asked:
 *    the worker then never tokenizes differently from the router's page-hash chain, and the
 *    router always knows the tokens generated so far, which is what migration needs. A greedy or
 *    seeded request is *replayed* on the next worker (prompt only; the tokens the client already
 *    has are regenerated, checked against what was streamed, and dropped), because only the
 *    same computation path gives the same tokens bit for bit: a prefill of prompt + generated
 *    tokens may round differently from the token-by-token decode that produced them. Other
 *    requests *continue* (prompt + generated tokens go to the next worker; the text of the
 *    continuation is detokenized here so a character split across two workers comes out whole).
 *    Either way indexes continue and the client sees one stream (see migrate_as).
 *  - Request ids toward workers are the router's own, new for every attempt (clients' ids are
 *    unique only per client; a late frame of an abandoned attempt can never be mistaken).
 *  - Catch-up after an event gap uses the worker's replay: an `admin` status frame with
 *    `events_since` (docs/protocol.md section 9); the worker answers with the missing `kv` frames
 *    (or a snapshot of its whole index) on the request connection, then an `admin_reply` with
 *    `events_next` and `events_snapshot`. Frames of a replay are buffered until that reply says
 *    which of the two it was.
 *  - With --controller, the controller's cluster view (a SUB socket on the same loop) narrows
 *    the router's own liveness, never widens it: a worker gets new requests only when its
 *    connection is up *and* a fresh view calls it "ready"; a view that says "dead" migrates its
 *    requests through the same path as a disconnect (migrate_all). Members the router does not
 *    know are connected at run time into spare worker slots (the slot array is allocated whole
 *    at start: libuv handles live inside it and must not move). A view older than
 *    --view-timeout is ignored, so a controller outage leaves the router serving on its own
 *    liveness, as it did before controllers existed. See view.c for the matching rules.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <uv.h>
#include <zmq.h>

#include "router/internal.h"

uint64_t rt_now_ms(void)
{
    return km_now_ns() / 1000000ull;
}

/* ---------------------------------------------------------------- frames */

static int zsend_env(void *sock, const km_zframe *env, int n_env, const km_buf *body)
{
    km_zframe parts[KM_ZMSG_MAX_PARTS];
    int n = 0;
    for (int i = 0; i < n_env && n < KM_ZMSG_MAX_PARTS - 1; i++) parts[n++] = env[i];
    parts[n++] = (km_zframe){body->data, body->len};
    return km_zsend(sock, parts, n, KM_ZDONTWAIT, NULL);
}

static void send_error_env(rt_router *r, const km_zframe *env, int n_env, uint64_t id, int code,
                           uint32_t retry_after, const char *fmt, ...)
    __attribute__((format(printf, 7, 8)));
static void send_error_env(rt_router *r, const km_zframe *env, int n_env, uint64_t id, int code,
                           uint32_t retry_after, const char *fmt, ...)
{
    char msg[KM_PROTO_MAX_MESSAGE];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    km_msg m;
    km_msg_init(&m, KM_MSG_ERROR);
    m.error.id = id;
    m.error.code = code;
    m.error.message = msg;
    m.error.retry_after_ms = retry_after;
    if (!km_msg_encode(&m, &r->lim, &r->out, NULL)) zsend_env(r->front, env, n_env, &r->out);
}

/* ---------------------------------------------------------------- request table */

static void rq_link(rt_router *r, rt_rq *q)
{
    size_t b = q->rid % RT_RQ_BUCKETS;
    q->hnext = r->buckets[b];
    r->buckets[b] = q;
}

static void rq_unlink(rt_router *r, rt_rq *q)
{
    rt_rq **pp = &r->buckets[q->rid % RT_RQ_BUCKETS];
    while (*pp && *pp != q) pp = &(*pp)->hnext;
    if (*pp) *pp = q->hnext;
}

static rt_rq *rq_find(rt_router *r, uint64_t rid)
{
    for (rt_rq *q = r->buckets[rid % RT_RQ_BUCKETS]; q; q = q->hnext)
        if (q->rid == rid) return q;
    return NULL;
}

static void queue_push(rt_router *r, rt_rq *q, bool front)
{
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
}

static void queue_remove(rt_router *r, rt_rq *q)
{
    if (!q->queued) return;
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
}

void rt_rq_free(rt_rq *q)
{
    if (!q) return;
    km_buf_free(&q->env_mem);
    free(q->salt);
    for (int i = 0; i < KM_PROTO_MAX_STOP; i++) free(q->stop[i]);
    free(q->tokens);
    free(q->chain);
    km_buf_free(&q->text);
    free(q);
}

static void worker_release(rt_router *r, rt_rq *q)
{
    if (q->worker < 0) return;
    rt_wk *w = &r->w[q->worker];
    w->inflight--;
    km_gauge_set(w->s_inflight, w->inflight);
    r->n_inflight--;
    km_gauge_set(r->s_inflight_all, r->n_inflight);
    q->worker = -1;
}

/* Ends a request's life in the router (after its final frame went out). */
static int dispatch(rt_router *r, rt_rq *q, bool from_queue);

/* May w get a new request now: its connection is up, it did not just refuse one (503/529), and a
 * fresh view, when it names w, says "ready". */
bool rt_wk_routable(rt_router *r, rt_wk *w, uint64_t now)
{
    if (w->draining && now >= w->draining_until_ms) w->draining = false;
    return !w->draining && rt_member_routable(w->connected, r->view_fresh, w->in_view, w->member);
}

/* Takes q off its owner's waiting list. */
static void unpark(rt_rq *q)
{
    if (!q->parked) return;
    rt_rq **pp = &q->owner->waiters;
    while (*pp && *pp != q) pp = &(*pp)->wnext;
    if (*pp) *pp = q->wnext;
    q->parked = false;
    q->owner = NULL;
    q->wnext = NULL;
}

/* The owner's prefix is computed (or the owner is gone): its waiters go on their way. */
static void release_waiters(rt_router *r, rt_rq *owner)
{
    while (owner->waiters) {
        rt_rq *w = owner->waiters;
        owner->waiters = w->wnext;
        w->parked = false;
        w->owner = NULL;
        w->wnext = NULL;
        if (!r->stopping) dispatch(r, w, false);
    }
}

void rt_rq_end(rt_router *r, rt_rq *q)
{
    unpark(q);
    queue_remove(r, q);
    worker_release(r, q); /* first: a released waiter must not find q as an owner again */
    release_waiters(r, q);
    rq_unlink(r, q);
    if (q->http) rt_http_on_abort(q->http, NULL, NULL);
    rt_rq_free(q);
}

/* ---------------------------------------------------------------- replies to clients */

static void http_send_error(rt_router *r, rt_rq *q, int code, uint32_t retry_after, const char *msg)
{
    rt_oai_err e;
    rt_oai_err_from_code(code, msg, &e);
    km_buf b = {0};
    if (q->http_began) {
        rt_oai_sse_error(&b, &e);
        rt_http_stream_write(q->http, b.data, b.len);
        km_buf_reset(&b);
        rt_oai_sse_done(&b);
        rt_http_stream_write(q->http, b.data, b.len);
        rt_http_stream_end(q->http);
    } else {
        rt_oai_error_json(&b, &e);
        char extra[64] = "";
        if (retry_after)
            snprintf(extra, sizeof extra, "Retry-After: %u\r\n", (retry_after + 999) / 1000);
        rt_http_respond_h(q->http, e.status, "application/json", extra, b.data, b.len);
    }
    km_buf_free(&b);
}

/* The request failed: one `err` to the client, then it is gone. */
static void rq_fail(rt_router *r, rt_rq *q, int code, uint32_t retry_after, const char *msg)
{
    r->n_err++;
    km_counter_inc(r->s_req_err);
    if (q->origin == RQ_ZMQ)
        send_error_env(r, q->env, q->n_env, q->cid, code, retry_after, "%s", msg);
    else if (q->http)
        http_send_error(r, q, code, retry_after, msg);
    KM_INFO("request_failed", "rid=%llu code=%d attempts=%d msg=\"%s\"", (unsigned long long)q->rid,
            code, q->attempts, msg);
    rt_rq_end(r, q);
}

static uint32_t retry_after_ms(rt_router *r)
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

void rt_rq_oai_meta(rt_router *r, rt_rq *q, rt_oai_meta *m, const char *worker)
{
    m->chat = q->http_chat;
    m->id = q->oai_id;
    m->model = r->model_name;
    m->created = q->created;
    m->worker = worker;
}

/* One token's text to the client. */
static void deliver_token(rt_router *r, rt_rq *q, int32_t token, const char *text, size_t len)
{
    uint32_t index = (uint32_t)(q->n_gen - 1);
    if (q->origin == RQ_ZMQ) {
        if (q->client_stream) {
            km_msg m;
            km_msg_init(&m, KM_MSG_TOKEN);
            m.tok.id = q->cid;
            m.tok.index = index;
            m.tok.token = token;
            m.tok.text = text;
            m.tok.text_len = len;
            if (!km_msg_encode(&m, &r->lim, &r->out, NULL))
                zsend_env(r->front, q->env, q->n_env, &r->out);
        } else {
            km_buf_append(&q->text, text, len);
        }
        return;
    }
    if (!q->http) return;
    if (!q->http_stream) {
        km_buf_append(&q->text, text, len);
        return;
    }
    if (len == 0) return;
    rt_oai_meta m;
    rt_rq_oai_meta(r, q, &m, NULL);
    km_buf b = {0};
    if (!rt_oai_sse_chunk(&b, &m, text, len, NULL)) rt_http_stream_write(q->http, b.data, b.len);
    km_buf_free(&b);
}

static void rq_finish(rt_router *r, rt_rq *q, km_finish finish, uint32_t cached, const char *wid)
{
    uint64_t now = km_now_ns();
    double total_ms = (now - q->t_arrive) / 1e6;
    double ttft_ms = q->t_first ? (q->t_first - q->t_arrive) / 1e6 : total_ms;
    double queue_ms = q->t_sent ? (q->t_sent - q->t_arrive) / 1e6 + q->worker_queue_ms : total_ms;
    if (q->router_detok) {
        char tail[16];
        int n = km_detok_flush(&q->dt, tail, sizeof tail);
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
    if (q->origin == RQ_ZMQ) {
        km_msg m;
        km_msg_init(&m, KM_MSG_DONE);
        m.done.id = q->cid;
        m.done.finish = finish;
        /* A stream's done.text is its tail: bytes no token frame could carry (held back for a
         * possible stop string, or an incomplete last character); NULL when there are none. */
        if (!q->client_stream || q->text.len) {
            m.done.text = q->text.data ? (const char *)q->text.data : "";
            m.done.text_len = q->text.len;
        }
        m.done.prompt_tokens = (uint32_t)q->n_prompt;
        m.done.cached_tokens = cached_out;
        m.done.completion_tokens = (uint32_t)q->n_gen;
        m.done.queue_ms = queue_ms;
        m.done.ttft_ms = ttft_ms;
        m.done.total_ms = total_ms;
        m.done.worker = wid;
        m.done.migrations = (uint32_t)q->migrations;
        if (!km_msg_encode(&m, &r->lim, &r->out, NULL))
            zsend_env(r->front, q->env, q->n_env, &r->out);
    } else if (q->http) {
        rt_oai_meta m;
        rt_rq_oai_meta(r, q, &m, wid);
        rt_oai_usage u = {.prompt_tokens = (uint32_t)q->n_prompt,
                          .completion_tokens = (uint32_t)q->n_gen,
                          .cached_tokens = cached_out};
        km_buf b = {0};
        if (q->http_stream) {
            if (q->text.len) { /* the tail: held-back bytes (see rq_finish's ZeroMQ branch) */
                rt_rq_oai_meta(r, q, &m, NULL);
                rt_oai_sse_chunk(&b, &m, (const char *)q->text.data, q->text.len, NULL);
                rt_rq_oai_meta(r, q, &m, wid);
            }
            rt_oai_sse_chunk(&b, &m, NULL, 0, rt_oai_finish(finish));
            if (q->include_usage) rt_oai_sse_usage(&b, &m, &u);
            rt_oai_sse_done(&b);
            rt_http_stream_write(q->http, b.data, b.len);
            rt_http_stream_end(q->http);
        } else {
            rt_oai_response(&b, &m, q->text.data ? (const char *)q->text.data : "", q->text.len,
                            rt_oai_finish(finish), &u);
            char extra[KM_PROTO_MAX_NAME + 64];
            snprintf(extra, sizeof extra, "X-Kvmesh-Worker: %s\r\n", wid ? wid : "");
            rt_http_respond_h(q->http, 200, "application/json", extra, b.data, b.len);
        }
        km_buf_free(&b);
    }
    KM_DEBUG("request_done",
             "rid=%llu worker=%s prompt=%d cached=%u predicted=%.0f gen=%d "
             "ttft_ms=%.1f total_ms=%.1f attempts=%d",
             (unsigned long long)q->rid, wid ? wid : "-", q->n_prompt, cached_out, q->predicted,
             q->n_gen, ttft_ms, total_ms, q->attempts);
    rt_rq_end(r, q);
}

/* ---------------------------------------------------------------- dispatch */

static void pump_queue(rt_router *r);

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

/* Sends q to a worker, or queues it. Returns 0, or a negative km_err when q was failed and
 * freed. */
static int dispatch(rt_router *r, rt_rq *q, bool from_queue)
{
    uint64_t t0 = km_now_ns();
    if (q->deadline_ns && t0 >= q->deadline_ns) {
        rq_fail(r, q, KM_CODE_DEADLINE, 0, "deadline passed before a worker could take it");
        return KM_ETIMEDOUT;
    }
    uint32_t remaining =
        q->max_tokens > (uint32_t)q->n_gen ? q->max_tokens - (uint32_t)q->n_gen : 0;
    if (q->replay) remaining = q->max_tokens;
    if (q->n_gen > 0 && remaining == 0) {
        rq_finish(r, q, KM_FINISH_LENGTH, 0, NULL);
        return 0;
    }
    rt_candidate cand[RT_MAX_WORKERS];
    uint64_t mask = 0;
    uint64_t now = rt_now_ms();
    for (int i = 0; i < r->n_w; i++) {
        rt_wk *w = &r->w[i];
        bool usable = rt_wk_routable(r, w, now);
        cand[i] = (rt_candidate){.id = w->id,
                                 .usable = usable,
                                 .inflight = w->inflight,
                                 .slots = r->c.worker_slots,
                                 .max_inflight = r->c.max_inflight};
        if (usable) mask |= 1ull << i;
    }
    /* The chain covers the prompt; after a migration the worker also gets the generated tokens
     * (uncached anywhere but on the dead worker), which costs the same everywhere. */
    rt_match m;
    rt_index_match(r->index, q->chain, q->n_chain, mask, r->c.policy.tier_credit, r->c.page_tokens,
                   now, &m);
    for (int i = 0; i < r->n_w; i++) cand[i].cached_tokens = m.credit[i];
    int n_ctx = q->replay ? q->n_prompt : q->n_prompt + q->n_gen;
    int pick = rt_pick(&r->c.policy, cand, r->n_w, n_ctx, q->key, &r->policy_state);
    km_hist_observe(r->s_decision, (km_now_ns() - t0) / 1e9);
    if (pick < 0) {
        if (!from_queue) {
            if (r->n_queued >= r->c.max_queue && q->attempts == 0) {
                r->n_overloaded++;
                km_counter_inc(r->s_overloaded);
                char msg[160];
                snprintf(msg, sizeof msg, "cluster overloaded: %d requests queued at the router",
                         r->n_queued);
                rq_fail(r, q, KM_CODE_OVERLOADED, retry_after_ms(r), msg);
                return KM_EOVERLOAD;
            }
            queue_push(r, q, q->attempts > 0);
        }
        return 0;
    }
    rt_wk *w = &r->w[pick];
    if (r->c.policy.mode == RT_MODE_KV && q->n_chain >= 4 && !q->migrations) {
        rt_rq *owner = prefilling_owner(r, q, pick);
        if (owner) {
            if (from_queue) queue_remove(r, q);
            q->parked = true;
            q->owner = owner;
            q->wnext = owner->waiters;
            owner->waiters = q;
            KM_DEBUG("park", "rid=%llu behind=%llu worker=%s", (unsigned long long)q->rid,
                     (unsigned long long)owner->rid, w->id);
            return 0;
        }
    }
    q->predicted = m.credit[pick];
    /* the request frame: tokens = prompt + generated so far */
    if (q->attempts > 0) {
        /* a new id per attempt: frames still coming from an earlier attempt (a canceled replay,
         * a worker that was only cut off) can never be taken for this one's */
        rq_unlink(r, q);
        q->rid = ++r->next_rid;
        rq_link(r, q);
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
    msg.req.stream = true;
    msg.req.cache_salt = q->salt;
    msg.req.stop = (const char *const *)q->stop;
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
        rq_fail(r, q, rc == KM_EAGAIN ? KM_CODE_OVERLOADED : KM_CODE_INTERNAL,
                rc == KM_EAGAIN ? retry_after_ms(r) : 0, m2);
        return rc;
    }
    if (from_queue) queue_remove(r, q);
    q->worker = pick;
    q->attempts++;
    q->base = q->replay ? 0 : q->n_gen;
    q->att_next = 0;
    if (!q->t_sent) q->t_sent = km_now_ns();
    w->inflight++;
    w->routed++;
    r->n_inflight++;
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

static void pump_queue(rt_router *r)
{
    rt_rq *q = r->qhead;
    while (q) {
        rt_rq *next = q->qnext;
        int before = r->n_queued;
        if (dispatch(r, q, true) == 0 && r->n_queued == before && q->queued) {
            /* nothing could take it: later requests cannot either, unless their deadline
             * passed */
            for (rt_rq *p = next; p;) {
                rt_rq *pn = p->qnext;
                if (p->deadline_ns && km_now_ns() >= p->deadline_ns)
                    rq_fail(r, p, KM_CODE_DEADLINE, 0, "deadline passed while queued");
                p = pn;
            }
            return;
        }
        q = next;
    }
}

/* The worker is gone (or refused): send q elsewhere. A greedy or seeded request is replayed:
 * the next worker gets the prompt alone and regenerates the tokens already streamed, which the
 * router checks and drops, so the output is the undisturbed one bit for bit (an engine's prefill
 * of prompt + generated tokens is not bound to reproduce its token-by-token decode exactly, and
 * greedy decoding amplifies the last bit). An unseeded sampled request, or a replay that
 * diverged, continues instead: prompt + streamed tokens, generation goes on from there. */
static void migrate_as(rt_router *r, rt_rq *q, const char *why, bool allow_replay)
{
    rt_wk *w = q->worker >= 0 ? &r->w[q->worker] : NULL;
    if (w) w->migrated_away++;
    worker_release(r, q);
    release_waiters(r, q);
    if (q->attempts >= r->c.max_attempts) {
        char msg[KM_PROTO_MAX_MESSAGE];
        snprintf(msg, sizeof msg, "%s; gave up after %d attempts (%d tokens generated)", why,
                 q->attempts, q->n_gen);
        rq_fail(r, q, KM_CODE_UNAVAILABLE, 0, msg);
        return;
    }
    bool deterministic = q->q.temperature <= 0 || q->q.has_seed;
    q->replay =
        allow_replay && r->c.migrate_replay && deterministic && q->n_gen > 0 && !q->router_detok;
    if (q->n_gen > 0 && !q->replay && !q->router_detok) {
        /* From here on the text is detokenized by the router: prime its detokenizer with the
         * tokens already delivered (their text went out; only the held-back bytes matter). */
        km_detok_init(&q->dt);
        char tmp[512];
        for (int i = 0; i < q->n_gen; i++)
            km_detok_push(r->tok, &q->dt, q->tokens[q->n_prompt + i], tmp, sizeof tmp);
        q->router_detok = true;
    }
    q->migrations++;
    r->n_migrations++;
    km_counter_inc(r->s_migr);
    KM_INFO("migrate", "rid=%llu from=%s generated=%d attempt=%d how=%s why=\"%s\"",
            (unsigned long long)q->rid, w ? w->id : "-", q->n_gen, q->attempts,
            q->replay ? "replay" : "continue", why);
    dispatch(r, q, false);
}

static void migrate(rt_router *r, rt_rq *q, const char *why)
{
    migrate_as(r, q, why, true);
}

/* A replay produced another token than the one streamed (or ended early): stop it and continue
 * from what the client has. */
static void replay_diverged(rt_router *r, rt_rq *q, const char *why)
{
    if (q->worker >= 0) {
        km_msg m;
        km_msg_init(&m, KM_MSG_CANCEL);
        m.cancel.id = q->rid;
        if (!km_msg_encode(&m, &r->lim, &r->out, NULL))
            km_zsend(r->w[q->worker].dealer, &(km_zframe){r->out.data, r->out.len}, 1, KM_ZDONTWAIT,
                     NULL);
    }
    KM_WARN("replay_diverged", "rid=%llu at=%d why=\"%s\"", (unsigned long long)q->rid, q->att_next,
            why);
    q->replay = false;
    q->migrations--; /* the same migration, carried on differently */
    r->n_migrations--;
    migrate_as(r, q, why, false);
}

/* ---------------------------------------------------------------- worker frames */

static void on_worker_token(rt_router *r, rt_wk *w, const km_msg_token *t)
{
    rt_rq *q = rq_find(r, t->id);
    if (!q || q->worker != w->idx) return;    /* canceled, or a frame from an earlier attempt */
    if ((int)t->index != q->att_next) return; /* a repeat (never out of order from a worker) */
    q->att_next++;
    int index = q->base + (int)t->index;
    if (index < q->n_gen) { /* replaying what the client already has */
        if (q->tokens[q->n_prompt + index] != t->token)
            replay_diverged(r, q, "the replay produced another token");
        return;
    }
    q->replay = false;
    if (q->n_prompt + q->n_gen >= q->cap) {
        int cap = q->cap * 2;
        int32_t *nt = realloc(q->tokens, sizeof *nt * (size_t)cap);
        if (!nt) return;
        q->tokens = nt;
        q->cap = cap;
    }
    q->tokens[q->n_prompt + q->n_gen++] = t->token;
    if (!q->t_first) {
        q->t_first = km_now_ns();
        km_hist_observe(r->s_ttft, (q->t_first - q->t_arrive) / 1e9);
    }
    if (q->waiters) release_waiters(r, q);
    if (q->router_detok) {
        char piece[KM_PROTO_MAX_PIECE + 64];
        int n = km_detok_push(r->tok, &q->dt, t->token, piece, sizeof piece);
        deliver_token(r, q, t->token, piece, n > 0 ? (size_t)n : 0);
    } else {
        deliver_token(r, q, t->token, t->text ? t->text : "", t->text ? t->text_len : 0);
    }
}

static void on_worker_done(rt_router *r, rt_wk *w, const km_msg_done *d)
{
    rt_rq *q = rq_find(r, d->id);
    if (!q || q->worker != w->idx) return;
    if (q->replay && q->base + q->att_next < q->n_gen && d->finish != KM_FINISH_CANCELED) {
        replay_diverged(r, q, "the replay ended before the streamed tokens");
        return;
    }
    w->served++;
    w->prompt_tokens += (uint64_t)q->n_prompt;
    uint32_t cached = d->cached_tokens;
    if (!q->first_cached_set) {
        q->first_cached = cached;
        q->first_cached_set = true;
    }
    w->cached_tokens += cached < (uint32_t)q->n_prompt ? cached : (uint32_t)q->n_prompt;
    q->worker_queue_ms += d->queue_ms;
    /* The worker streams every token; its done.text is the tail no token frame carried. When
     * the router detokenizes itself (a continuation after migration) its own flush has it. */
    if (d->text && d->text_len && !q->router_detok) km_buf_append(&q->text, d->text, d->text_len);
    if (d->finish == KM_FINISH_CANCELED && q->origin == RQ_HTTP && !q->http) {
        rt_rq_end(r, q);
        return;
    }
    rq_finish(r, q, d->finish, cached, w->id);
}

static void on_worker_error(rt_router *r, rt_wk *w, const km_msg_error *e)
{
    rt_rq *q = rq_find(r, e->id);
    if (!q || q->worker != w->idx) {
        if (e->id == 0)
            KM_WARN("worker_error", "worker=%s code=%d msg=\"%s\"", w->id, e->code, e->message);
        return;
    }
    if (e->code == KM_CODE_UNAVAILABLE || e->code == KM_CODE_OVERLOADED) {
        /* draining / not ready / full: this worker is out for a moment, try another */
        w->draining = true;
        w->draining_until_ms =
            rt_now_ms() + (e->retry_after_ms ? e->retry_after_ms : (e->code == 503 ? 2000 : 250));
        migrate(r, q, e->message);
        return;
    }
    w->failed++;
    rq_fail(r, q, e->code, e->retry_after_ms, e->message);
}

/* ---------------------------------------------------------------- KV events */

static void apply_event(void *user, const km_msg_kv_event *ev)
{
    rt_wk *w = user;
    rt_router *r = w->r;
    km_pagehash hs[512];
    for (uint32_t i = 0; i < ev->n_hashes;) {
        int n = 0;
        for (; n < 512 && i < ev->n_hashes; n++, i++)
            hs[n] = km_pagehash_from_canonical(ev->hashes + (size_t)i * 16);
        rt_index_apply(r->index, w->idx, ev->kind, ev->tier, ev->from_tier, hs, n);
    }
}

void rt_update_page_gauges(rt_router *r)
{
    for (int i = 0; i < r->n_w; i++)
        for (int t = 0; t < KM_TIER_COUNT; t++)
            km_gauge_set(r->w[i].s_pages[t], (double)rt_index_pages(r->index, i, (km_tier)t));
    km_gauge_set(r->s_index_pages, (double)rt_index_size(r->index));
}

static void replay_clear(rt_wk *w)
{
    for (int i = 0; i < w->n_replay; i++) km_buf_free(&w->replay[i]);
    w->n_replay = 0;
}

/* Asks w for its events from `since` (a replay, or a snapshot when they are gone). */
static void request_sync(rt_router *r, rt_wk *w, uint64_t since)
{
    if (!w->connected) return;
    km_msg m;
    km_msg_init(&m, KM_MSG_ADMIN);
    m.admin.id = ++r->next_admin_id;
    m.admin.cmd = KM_ADMIN_STATUS;
    m.admin.has_events_since = true;
    m.admin.events_since = since;
    if (km_msg_encode(&m, &r->lim, &r->out, NULL)) return;
    if (km_zsend(w->dealer, &(km_zframe){r->out.data, r->out.len}, 1, KM_ZDONTWAIT, NULL)) return;
    replay_clear(w);
    w->sync_out = true;
    w->sync_id = m.admin.id;
    w->sync_deadline_ms = rt_now_ms() + r->c.sync_timeout_ms;
    rt_evstream_set_waiting(w->evs, true);
    KM_DEBUG("kv_sync", "worker=%s since=%llu", w->id, (unsigned long long)since);
}

static void forget_and_resync(rt_router *r, rt_wk *w, const char *why)
{
    rt_index_forget_worker(r->index, w->idx);
    rt_evstream_resync(w->evs, apply_event, w);
    w->sync_out = false;
    replay_clear(w);
    w->resyncs++;
    km_counter_inc(r->s_resync);
    KM_WARN("kv_resync", "worker=%s why=\"%s\" next=%llu", w->id, why,
            (unsigned long long)rt_evstream_next(w->evs));
}

static void handle_event(rt_router *r, rt_wk *w, const km_msg_kv_event *ev)
{
    rt_ev_result res = rt_evstream_push(w->evs, ev, apply_event, w);
    if (res == RT_EV_GAP) {
        km_counter_inc(r->s_gaps);
        if (!w->sync_out) request_sync(r, w, rt_evstream_next(w->evs));
    } else if (res == RT_EV_OVERFLOW) {
        forget_and_resync(r, w, "too many events held behind a gap");
        rt_evstream_push(w->evs, ev, apply_event, w);
    }
}

/* The replay's admin_reply (NULL: an err frame refused it): apply what was buffered. */
static void finish_sync(rt_router *r, rt_wk *w, const km_msg_admin_reply *rp)
{
    w->sync_out = false;
    if (!rp || !rp->ok || !rp->has_events_next) {
        forget_and_resync(r, w, rp && rp->ok ? "worker does not replay events" : "replay refused");
        return;
    }
    uint64_t next = rp->events_next;
    bool snapshot = rp->events_snapshot;
    km_msg m;
    if (snapshot) {
        rt_index_forget_worker(r->index, w->idx);
        for (int i = 0; i < w->n_replay; i++)
            if (!km_msg_decode(w->replay[i].data, w->replay[i].len, &r->lim, &m, NULL)) {
                if (m.type == KM_MSG_KV_EVENT) apply_event(w, &m.kv);
                km_msg_clear(&m);
            }
        replay_clear(w);
        /* continue after the snapshot: held events below `next` are covered by it */
        rt_evstream_jump(w->evs, next, apply_event, w);
        w->snapshots++;
        KM_INFO("kv_snapshot", "worker=%s next=%llu pages=%llu", w->id, (unsigned long long)next,
                (unsigned long long)(rt_index_pages(r->index, w->idx, KM_TIER_HOT) +
                                     rt_index_pages(r->index, w->idx, KM_TIER_HOST) +
                                     rt_index_pages(r->index, w->idx, KM_TIER_DISK)));
        rt_update_page_gauges(r);
        return;
    }
    for (int i = 0; i < w->n_replay; i++)
        if (!km_msg_decode(w->replay[i].data, w->replay[i].len, &r->lim, &m, NULL)) {
            /* a replay sends every frame from `since` the worker has: numbers below its first
             * frame do not exist (a worker numbers from 1) */
            if (m.type == KM_MSG_KV_EVENT && i == 0 && m.kv.seq > rt_evstream_next(w->evs))
                rt_evstream_jump(w->evs, m.kv.seq, apply_event, w);
            if (m.type == KM_MSG_KV_EVENT) rt_evstream_push(w->evs, &m.kv, apply_event, w);
            km_msg_clear(&m);
        }
    replay_clear(w);
    /* The replay holds every frame from our position that the worker has; seqs below `next`
     * that it did not send do not exist (a fresh worker numbers from 1). */
    rt_evstream_jump(w->evs, next, apply_event, w);
    if (rt_evstream_waiting(w->evs)) /* a newer gap opened behind the replay */
        request_sync(r, w, rt_evstream_next(w->evs));
    rt_update_page_gauges(r);
}

/* ---------------------------------------------------------------- socket reading */

static void on_worker_frame(rt_router *r, rt_wk *w, const km_zframe *body)
{
    km_msg m;
    km_errbuf err = {{0}};
    if (km_msg_decode(body->data, body->len, &r->lim, &m, &err)) {
        r->n_bad_frames++;
        km_counter_inc(r->s_bad);
        KM_WARN("bad_worker_frame", "worker=%s msg=\"%s\"", w->id, err.msg);
        return;
    }
    switch (m.type) {
    case KM_MSG_TOKEN:
        on_worker_token(r, w, &m.tok);
        break;
    case KM_MSG_DONE:
        on_worker_done(r, w, &m.done);
        pump_queue(r);
        break;
    case KM_MSG_ERROR:
        if (w->sync_out && m.error.id == w->sync_id) {
            finish_sync(r, w, NULL);
            break;
        }
        on_worker_error(r, w, &m.error);
        pump_queue(r);
        break;
    case KM_MSG_KV_EVENT:
        if (w->sync_out && w->n_replay < RT_REPLAY_MAX) {
            km_buf *b = realloc(w->replay, sizeof *b * (size_t)(w->n_replay + 1));
            if (b) {
                w->replay = b;
                memset(&b[w->n_replay], 0, sizeof *b);
                if (!km_buf_append(&b[w->n_replay], body->data, body->len)) w->n_replay++;
            }
        }
        break;
    case KM_MSG_ADMIN_REPLY:
        if (w->sync_out && m.admin_reply.id == w->sync_id) finish_sync(r, w, &m.admin_reply);
        break;
    default:
        break;
    }
    km_msg_clear(&m);
}

static rt_wk *worker_by_id(rt_router *r, const char *id)
{
    for (int i = 0; i < r->n_w; i++)
        if (!strcmp(r->w[i].id, id)) return &r->w[i];
    /* a --workers name that differs from the worker's own id: the view told us the real one */
    for (int i = 0; i < r->n_w; i++)
        if (!strcmp(r->w[i].view_id, id)) return &r->w[i];
    return NULL;
}

static void on_sub_frame(rt_router *r, const km_zframe *body)
{
    km_msg m;
    if (km_msg_decode(body->data, body->len, &r->lim, &m, NULL)) {
        r->n_bad_frames++;
        km_counter_inc(r->s_bad);
        return;
    }
    if (m.type == KM_MSG_KV_EVENT) {
        rt_wk *w = worker_by_id(r, m.kv.worker);
        if (w) {
            handle_event(r, w, &m.kv);
            rt_update_page_gauges(r);
        }
    }
    km_msg_clear(&m);
}

/* ---------------------------------------------------------------- client requests */

bool rt_model_ok(rt_router *r, const char *model)
{
    const char *dot = strrchr(r->model_name, '.');
    if (dot && strlen(model) == (size_t)(dot - r->model_name) &&
        !strncmp(model, r->model_name, (size_t)(dot - r->model_name)))
        return true;
    return !strcmp(model, r->model_name) || !strcmp(model, "default") ||
           (r->c.model_name && !strcmp(model, r->c.model_name)) || !strcmp(model, r->fp);
}

/* Tokenizes text into q->tokens as the worker does (parse_special on; add_special off for a
 * rendered chat template, which carries its own BOS). */
int rt_rq_tokenize(rt_router *r, rt_rq *q, const char *text, size_t len, int add_special)
{
    int need = km_tok_encode(r->tok, text, len, add_special, 1, NULL, 0);
    if (need < 0) return need;
    q->cap = need + 64;
    q->tokens = malloc(sizeof *q->tokens * (size_t)q->cap);
    if (!q->tokens) return KM_ENOMEM;
    q->n_prompt = km_tok_encode(r->tok, text, len, add_special, 1, q->tokens, q->cap);
    return q->n_prompt < 0 ? q->n_prompt : 0;
}

/* Everything after the prompt is in q->tokens: the chain, the key, then dispatch. */
int rt_rq_start(rt_router *r, rt_rq *q)
{
    if (q->n_prompt <= 0) {
        rq_fail(r, q, KM_CODE_BAD_REQUEST, 0, "the prompt is empty after tokenization");
        return KM_EINVAL;
    }
    if ((uint32_t)q->n_prompt > r->lim.max_prompt_tok) {
        char m[160];
        snprintf(m, sizeof m, "prompt of %d tokens exceeds the limit of %u", q->n_prompt,
                 r->lim.max_prompt_tok);
        rq_fail(r, q, KM_CODE_TOO_LARGE, 0, m);
        return KM_ERANGE;
    }
    km_pagehash seed = km_pagehash_seed(r->fp, strlen(r->fp), r->c.cluster_seed, q->salt,
                                        q->salt ? strlen(q->salt) : 0);
    int np = q->n_prompt / r->c.page_tokens;
    q->chain = malloc(sizeof *q->chain * (size_t)(np ? np : 1));
    if (!q->chain) {
        rq_fail(r, q, KM_CODE_INTERNAL, 0, "out of memory");
        return KM_ENOMEM;
    }
    q->n_chain =
        np ? km_pagehash_chain(seed, q->tokens, q->n_prompt, r->c.page_tokens, q->chain, np) : 0;
    /* the rendezvous key: the first page, or (a prompt shorter than a page) its tokens */
    q->key = q->n_chain > 0 ? q->chain[0] : km_pagehash_next(seed, q->tokens, q->n_prompt);
    if (!q->max_tokens) q->max_tokens = r->c.default_max_tokens;
    q->rid = ++r->next_rid;
    rq_link(r, q);
    r->n_requests++;
    return dispatch(r, q, false);
}

rt_rq *rt_rq_new(rt_router *r, rq_origin origin)
{
    rt_rq *q = calloc(1, sizeof *q);
    if (!q) return NULL;
    q->r = r;
    q->origin = origin;
    q->worker = -1;
    q->t_arrive = km_now_ns();
    return q;
}

/* Copies the sampling fields and owned strings of a decoded request into q. */
static int rq_copy_params(rt_rq *q, const km_msg_request *src)
{
    q->q = *src;
    q->q.model = NULL;
    q->q.prompt = NULL;
    q->q.tokens = NULL;
    q->q.stop = NULL;
    q->q.n_stop = src->n_stop;
    q->q.cache_salt = NULL;
    for (uint32_t i = 0; i < src->n_stop && i < KM_PROTO_MAX_STOP; i++)
        if (!(q->stop[i] = strdup(src->stop[i]))) return KM_ENOMEM;
    if (src->cache_salt && !(q->salt = strdup(src->cache_salt))) return KM_ENOMEM;
    q->max_tokens = src->max_tokens;
    q->client_stream = src->stream;
    if (src->deadline_ms) q->deadline_ns = q->t_arrive + (uint64_t)src->deadline_ms * 1000000ull;
    return 0;
}

static void on_client_request(rt_router *r, const km_zmsg *zm, const km_msg_request *req)
{
    const km_zframe *env = zm->part;
    int n_env = zm->n - 1;
    if (!rt_model_ok(r, req->model)) {
        send_error_env(r, env, n_env, req->id, KM_CODE_NOT_FOUND, 0,
                       "req.model: unknown model '%.256s' (this router serves '%s')", req->model,
                       r->model_name);
        return;
    }
    rt_rq *q = rt_rq_new(r, RQ_ZMQ);
    if (!q) {
        send_error_env(r, env, n_env, req->id, KM_CODE_INTERNAL, 0, "out of memory");
        return;
    }
    q->cid = req->id;
    for (int i = 0; i < n_env; i++) km_buf_append(&q->env_mem, env[i].data, env[i].len);
    size_t off = 0;
    for (int i = 0; i < n_env; i++) {
        q->env[i] = (km_zframe){q->env_mem.data + off, env[i].len};
        off += env[i].len;
    }
    q->n_env = n_env;
    int rc = rq_copy_params(q, req);
    if (!rc && req->tokens && req->n_tokens) {
        q->cap = (int)req->n_tokens + 64;
        q->tokens = malloc(sizeof *q->tokens * (size_t)q->cap);
        if (!q->tokens)
            rc = KM_ENOMEM;
        else {
            memcpy(q->tokens, req->tokens, sizeof *q->tokens * req->n_tokens);
            q->n_prompt = (int)req->n_tokens;
            int nv = km_tok_n_vocab(r->tok);
            for (int i = 0; i < q->n_prompt; i++)
                if (q->tokens[i] >= nv) {
                    send_error_env(r, env, n_env, req->id, KM_CODE_BAD_REQUEST, 0,
                                   "req.tokens[%d]: id %d outside the vocabulary (%d)", i,
                                   q->tokens[i], nv);
                    rt_rq_free(q);
                    return;
                }
        }
    } else if (!rc) {
        rc = rt_rq_tokenize(r, q, req->prompt,
                            req->prompt_len ? req->prompt_len : strlen(req->prompt), 1);
    }
    if (rc) {
        send_error_env(r, env, n_env, req->id, KM_CODE_INTERNAL, 0, "cannot prepare: %s",
                       km_strerror(rc));
        rt_rq_free(q);
        return;
    }
    rt_rq_start(r, q);
}

static bool env_eq(const rt_rq *q, const km_zmsg *zm)
{
    if (q->origin != RQ_ZMQ || q->n_env != zm->n - 1) return false;
    for (int i = 0; i < q->n_env; i++)
        if (q->env[i].len != zm->part[i].len ||
            memcmp(q->env[i].data, zm->part[i].data, q->env[i].len))
            return false;
    return true;
}

void rt_rq_cancel(rt_router *r, rt_rq *q)
{
    if (q->queued || q->parked) {
        unpark(q);
        queue_remove(r, q);
        if (q->origin == RQ_ZMQ) {
            km_msg m;
            km_msg_init(&m, KM_MSG_DONE);
            m.done.id = q->cid;
            m.done.finish = KM_FINISH_CANCELED;
            m.done.prompt_tokens = (uint32_t)q->n_prompt;
            m.done.completion_tokens = (uint32_t)q->n_gen;
            if (!km_msg_encode(&m, &r->lim, &r->out, NULL))
                zsend_env(r->front, q->env, q->n_env, &r->out);
        }
        rt_rq_end(r, q);
        return;
    }
    if (q->worker >= 0) {
        km_msg m;
        km_msg_init(&m, KM_MSG_CANCEL);
        m.cancel.id = q->rid;
        if (!km_msg_encode(&m, &r->lim, &r->out, NULL))
            km_zsend(r->w[q->worker].dealer, &(km_zframe){r->out.data, r->out.len}, 1, KM_ZDONTWAIT,
                     NULL);
    }
}

static void on_client_cancel(rt_router *r, const km_zmsg *zm, uint64_t cid)
{
    for (int b = 0; b < RT_RQ_BUCKETS; b++)
        for (rt_rq *q = r->buckets[b]; q; q = q->hnext)
            if (q->cid == cid && env_eq(q, zm)) {
                rt_rq_cancel(r, q);
                return;
            }
}

static void on_front_message(rt_router *r, const km_zmsg *zm)
{
    const km_zframe *body = km_zmsg_body(zm);
    if (!body || zm->n < 2) return; /* a ROUTER always sees identity + body */
    km_msg m;
    km_errbuf err = {{0}};
    int rc = km_msg_decode(body->data, body->len, &r->lim, &m, &err);
    if (rc) {
        r->n_bad_frames++;
        km_counter_inc(r->s_bad);
        int code = rc == KM_EUNSUPPORTED ? KM_CODE_VERSION
                   : rc == KM_ERANGE     ? KM_CODE_TOO_LARGE
                                         : KM_CODE_BAD_REQUEST;
        /* the id, when the frame had a readable one, makes the error attributable */
        send_error_env(r, zm->part, zm->n - 1, m.rejected_id, code, 0, "%s", err.msg);
        KM_DEBUG("bad_frame", "code=%d msg=\"%s\"", code, err.msg);
        return;
    }
    switch (m.type) {
    case KM_MSG_REQUEST:
        on_client_request(r, zm, &m.req);
        break;
    case KM_MSG_CANCEL:
        on_client_cancel(r, zm, m.cancel.id);
        break;
    default:
        r->n_bad_frames++;
        km_counter_inc(r->s_bad);
        send_error_env(r, zm->part, zm->n - 1, 0, KM_CODE_BAD_REQUEST, 0,
                       "a router does not take '%s' frames from clients", km_msg_type_name(m.type));
        break;
    }
    km_msg_clear(&m);
}

/* ---------------------------------------------------------------- worker liveness */

/* Every request at w goes elsewhere (w is already unusable, so none comes back to it). cancel:
 * tell w to stop them, for a worker that is still connected (the view says dead, but a hung
 * process may wake up and should not spend its slots on abandoned requests). */
static void migrate_all(rt_router *r, rt_wk *w, const char *why, bool cancel)
{
    for (int b = 0; b < RT_RQ_BUCKETS; b++) {
        rt_rq *q = r->buckets[b];
        while (q) {
            rt_rq *next = q->hnext;
            if (q->worker == w->idx) {
                if (cancel) {
                    km_msg m;
                    km_msg_init(&m, KM_MSG_CANCEL);
                    m.cancel.id = q->rid;
                    if (!km_msg_encode(&m, &r->lim, &r->out, NULL))
                        km_zsend(w->dealer, &(km_zframe){r->out.data, r->out.len}, 1, KM_ZDONTWAIT,
                                 NULL);
                }
                migrate(r, q, why);
            }
            q = next;
        }
    }
}

static void worker_down(rt_router *r, rt_wk *w, const char *why)
{
    if (!w->connected) return;
    w->connected = false;
    km_gauge_set(w->s_up, 0);
    /* Its hot pages are gone with the process; a restart republishes what survives (disk). */
    rt_index_forget_worker(r->index, w->idx);
    rt_evstream_reset(w->evs);
    w->sync_out = false;
    replay_clear(w);
    rt_update_page_gauges(r);
    KM_WARN("worker_down", "worker=%s why=%s inflight=%d", w->id, why, w->inflight);
    migrate_all(r, w, "worker lost", false);
}

static void worker_up(rt_router *r, rt_wk *w)
{
    if (w->connected) return;
    w->connected = true;
    w->draining = false;
    w->connects++;
    km_gauge_set(w->s_up, 1);
    KM_INFO("worker_up", "worker=%s requests=%s", w->id, w->req_url);
    rt_evstream_reset(w->evs);
    request_sync(r, w, 0);
    pump_queue(r);
}

static void read_monitor(rt_router *r, rt_wk *w)
{
    for (;;) {
        zmq_msg_t ev;
        zmq_msg_init(&ev);
        if (zmq_msg_recv(&ev, w->mon, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&ev);
            return;
        }
        uint16_t event = 0;
        if (zmq_msg_size(&ev) >= 2) memcpy(&event, zmq_msg_data(&ev), 2);
        bool more = zmq_msg_more(&ev);
        zmq_msg_close(&ev);
        while (more) { /* the endpoint part */
            zmq_msg_t p;
            zmq_msg_init(&p);
            if (zmq_msg_recv(&p, w->mon, ZMQ_DONTWAIT) < 0) {
                zmq_msg_close(&p);
                break;
            }
            more = zmq_msg_more(&p);
            zmq_msg_close(&p);
        }
        if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
            worker_up(r, w);
        } else if (event == ZMQ_EVENT_DISCONNECTED) {
            /* frames it sent before dying are still queued: take them first */
            while (km_zsock_readable(w->dealer) && km_zrecv(w->dealer, &r->zm, 0, NULL) == 0) {
                const km_zframe *b = km_zmsg_body(&r->zm);
                if (b) on_worker_frame(r, w, b);
            }
            worker_down(r, w, "disconnected");
        }
    }
}

static void on_view_message(rt_router *r, const km_zmsg *zm);
static void bad_view(rt_router *r, const char *why);
static void view_check_age(rt_router *r, uint64_t now);

/* Drains every ZeroMQ socket until none has anything to read. */
void rt_pump(rt_router *r)
{
    if (r->pumping || r->stopping) return;
    r->pumping = true;
    for (int rounds = 0; rounds < 64; rounds++) {
        int got = 0;
        for (int i = 0; i < 256 && km_zsock_readable(r->front); i++) {
            if (km_zrecv(r->front, &r->zm, 0, NULL)) {
                r->n_bad_frames++;
                continue;
            }
            on_front_message(r, &r->zm);
            got++;
        }
        for (int k = 0; k < r->n_w; k++) {
            rt_wk *w = &r->w[k];
            for (int i = 0; i < 256 && km_zsock_readable(w->dealer); i++) {
                if (km_zrecv(w->dealer, &r->zm, 0, NULL)) continue;
                const km_zframe *b = km_zmsg_body(&r->zm);
                if (b) on_worker_frame(r, w, b);
                got++;
            }
            if (km_zsock_readable(w->mon)) {
                read_monitor(r, w);
                got++;
            }
        }
        for (int i = 0; i < 256 && km_zsock_readable(r->sub); i++) {
            if (km_zrecv(r->sub, &r->zm, 0, NULL)) continue;
            const km_zframe *b = km_zmsg_body(&r->zm);
            if (b) on_sub_frame(r, b);
            got++;
        }
        for (int i = 0; r->vsub && i < 64 && km_zsock_readable(r->vsub); i++) {
            if (km_zrecv(r->vsub, &r->zm, 0, NULL)) {
                bad_view(r, "unreadable message");
                continue;
            }
            on_view_message(r, &r->zm);
            got++;
        }
        if (!got) break;
    }
    r->pumping = false;
}

static void on_zpoll(uv_poll_t *p, int status, int events)
{
    rt_pump(p->data);
}

static void on_check(uv_check_t *c)
{
    rt_pump(c->data);
}

static void on_tick(uv_timer_t *t)
{
    rt_router *r = t->data;
    uint64_t now = rt_now_ms();
    for (int i = 0; i < r->n_w; i++) {
        rt_wk *w = &r->w[i];
        if (w->sync_out && now >= w->sync_deadline_ms)
            forget_and_resync(r, w, "no answer to the replay request");
    }
    /* queued requests past their deadline or the queue timeout, and the queue itself */
    for (rt_rq *q = r->qhead; q;) {
        rt_rq *next = q->qnext;
        if (r->c.queue_timeout_ms && km_now_ns() - q->t_arrive > r->c.queue_timeout_ms * 1000000ull)
            rq_fail(r, q, KM_CODE_UNAVAILABLE, retry_after_ms(r),
                    "no worker could take the request in time");
        q = next;
    }
    view_check_age(r, now);
    pump_queue(r);
    static uint64_t last_sweep;
    if (now - last_sweep > 5000) {
        last_sweep = now;
        rt_index_sweep(r->index, now);
    }
    rt_pump(r);
}

/* ---------------------------------------------------------------- the controller's view */

static int worker_slot_init(rt_router *r, const char *id, const char *req, const char *ev,
                            km_errbuf *err);
static int worker_open(rt_router *r, rt_wk *w, km_errbuf *err);
static int register_worker_metrics(rt_router *r, rt_wk *w, km_errbuf *err);

static void bad_view(rt_router *r, const char *why)
{
    r->n_bad_views++;
    km_counter_inc(r->s_bad_views);
    KM_WARN("bad_view", "controller=%s msg=\"%s\"", r->ctl_url, why);
}

static const char *member_name(const rt_wk *w)
{
    return w->in_view ? km_member_state_name(w->member) : "none";
}

/* The view names w in `state` at `level` (in_view false: the view no longer names it). */
static void set_member(rt_router *r, rt_wk *w, bool in_view, km_member_state state, uint32_t level)
{
    if (w->in_view == in_view && (!in_view || (w->member == state && w->level == level))) return;
    const char *from = member_name(w);
    uint32_t from_level = w->level;
    w->in_view = in_view;
    if (in_view) {
        w->member = state;
        w->level = level;
    }
    km_gauge_set(w->s_member, in_view ? (double)state : -1);
    km_gauge_set(w->s_level, in_view ? (double)level : 0);
    KM_INFO("member_state",
            "worker=%s from=%s to=%s level=%u from_level=%u inflight=%d controller=%s epoch=%llu",
            w->id, from, member_name(w), w->level, from_level, w->inflight, r->ctl_id,
            (unsigned long long)r->view_epoch);
}

/* A member whose requests endpoint no slot has: w was its slot under an older endpoint (the same
 * id; the worker came back on another port) and moves there, or a new slot is connected. */
static rt_wk *view_adopt(rt_router *r, const km_view_worker *vw, rt_wk *same_id)
{
    km_errbuf err = {{0}};
    if (same_id) {
        KM_INFO("worker_moved", "worker=%s from=%s to=%s events=%s", same_id->id, same_id->req_url,
                vw->requests, vw->events ? vw->events : "-");
        worker_down(r, same_id, "moved"); /* its requests migrate, its pages are forgotten */
        if (same_id->dealer) zmq_disconnect(same_id->dealer, same_id->req_url);
        if (same_id->ev_url[0]) zmq_disconnect(r->sub, same_id->ev_url);
        snprintf(same_id->req_url, sizeof same_id->req_url, "%s", vw->requests);
        snprintf(same_id->ev_url, sizeof same_id->ev_url, "%s", vw->events ? vw->events : "");
        if (km_zsock_connect(same_id->dealer, same_id->req_url, &err) ||
            (same_id->ev_url[0] && km_zsock_connect(r->sub, same_id->ev_url, &err)))
            KM_WARN("worker_move_failed", "worker=%s msg=\"%s\"", same_id->id, err.msg);
        return same_id;
    }
    if (r->n_w >= RT_MAX_WORKERS) {
        if (!r->slots_full_warned)
            KM_WARN("worker_not_added", "worker=%s why=\"all %d worker slots are taken\"", vw->id,
                    RT_MAX_WORKERS);
        r->slots_full_warned = true;
        return NULL;
    }
    int rc = worker_slot_init(r, vw->id, vw->requests, vw->events, &err);
    rt_wk *w = rc ? NULL : &r->w[r->n_w - 1];
    if (w && (rc = worker_open(r, w, &err))) {
        rt_evstream_destroy(w->evs);
        memset(w, 0, sizeof *w);
        r->n_w--;
        w = NULL;
    }
    if (!w) {
        KM_WARN("worker_not_added", "worker=%s requests=%s msg=\"%s\"", vw->id, vw->requests,
                err.msg);
        return NULL;
    }
    w->from_view = true;
    register_worker_metrics(r, w, &err);
    km_gauge_set(w->s_up, 0);
    KM_INFO("worker_added", "worker=%s requests=%s events=%s source=controller", w->id, w->req_url,
            w->ev_url[0] ? w->ev_url : "-");
    return w;
}

static void apply_view(rt_router *r, const km_msg_view *v)
{
    uint64_t now = rt_now_ms();
    bool same_ctl = r->have_view && !strcmp(r->ctl_id, v->controller) && r->view_epoch == v->epoch;
    if (same_ctl && v->seq < r->view_seq) return; /* an older view overtaken by a newer one */
    if (!same_ctl)
        KM_INFO("controller_view", "controller=%s epoch=%llu prev_controller=%s prev_epoch=%llu",
                v->controller, (unsigned long long)v->epoch, r->have_view ? r->ctl_id : "-",
                (unsigned long long)r->view_epoch);
    snprintf(r->ctl_id, sizeof r->ctl_id, "%s", v->controller);
    r->view_epoch = v->epoch;
    r->view_seq = v->seq;
    r->view_at_ms = now;
    r->have_view = true;
    r->n_views++;
    km_counter_inc(r->s_views);
    km_gauge_set(r->s_view_age, 0);
    if (!r->view_fresh) {
        r->view_fresh = true;
        KM_INFO("view_fresh", "controller=%s epoch=%llu seq=%llu workers=%u", r->ctl_id,
                (unsigned long long)r->view_epoch, (unsigned long long)r->view_seq, v->n_workers);
    }
    bool seen[RT_MAX_WORKERS] = {false};
    for (uint32_t i = 0; i < v->n_workers; i++) {
        const km_view_worker *vw = &v->workers[i];
        bool has_ep = vw->requests && *vw->requests;
        rt_wk *w = NULL;
        for (int k = 0; k < r->n_w && !w; k++)
            if (has_ep ? rt_endpoint_same(r->w[k].req_url, vw->requests)
                       : !strcmp(r->w[k].id, vw->id) || !strcmp(r->w[k].view_id, vw->id))
                w = &r->w[k]; /* no endpoint (no heartbeat with one yet): by id, never added */
        if (!w && (!has_ep || vw->state == KM_MEMBER_DEAD)) continue; /* nothing to connect */
        if (!w) {
            /* the same id under an endpoint no member of this view claims: it moved */
            rt_wk *same_id = NULL;
            for (int k = 0; k < r->n_w && !same_id; k++)
                if (!strcmp(r->w[k].id, vw->id) || !strcmp(r->w[k].view_id, vw->id))
                    same_id = &r->w[k];
            for (uint32_t j = 0; same_id && j < v->n_workers; j++)
                if (v->workers[j].requests &&
                    rt_endpoint_same(same_id->req_url, v->workers[j].requests))
                    same_id = NULL;
            w = view_adopt(r, vw, same_id);
            if (!w) continue;
        }
        if (seen[w->idx]) continue; /* two members, one endpoint: the first wins */
        seen[w->idx] = true;
        if (strcmp(w->view_id, vw->id)) {
            if (strcmp(w->id, vw->id))
                KM_INFO("worker_view_id", "worker=%s view_id=%s requests=%s", w->id, vw->id,
                        w->req_url);
            snprintf(w->view_id, sizeof w->view_id, "%s", vw->id);
        }
        set_member(r, w, true, vw->state, vw->level);
    }
    for (int k = 0; k < r->n_w; k++)
        if (!seen[k]) set_member(r, &r->w[k], false, KM_MEMBER_STARTING, 0);
    /* the dead ones' requests go elsewhere, as on a disconnect */
    for (int k = 0; k < r->n_w; k++) {
        rt_wk *w = &r->w[k];
        if (w->inflight > 0 && rt_member_migrates(r->view_fresh, w->in_view, w->member)) {
            KM_WARN("worker_dead_in_view", "worker=%s inflight=%d controller=%s", w->id,
                    w->inflight, r->ctl_id);
            w->view_migrated += (uint64_t)w->inflight;
            migrate_all(r, w, "the controller says the worker is dead", w->connected);
        }
    }
    pump_queue(r);
}

static void on_view_message(rt_router *r, const km_zmsg *zm)
{
    if (zm->n != 2 || zm->part[0].len != 4 || memcmp(zm->part[0].data, "view", 4)) {
        bad_view(r, "not a two-part [\"view\", frame] message");
        return;
    }
    km_msg m;
    km_errbuf err = {{0}};
    if (km_msg_decode(zm->part[1].data, zm->part[1].len, &r->lim, &m, &err)) {
        bad_view(r, err.msg);
        return;
    }
    if (m.type != KM_MSG_VIEW) {
        char why[64];
        snprintf(why, sizeof why, "a '%s' frame on the view topic", km_msg_type_name(m.type));
        bad_view(r, why);
    } else {
        apply_view(r, &m.view);
    }
    km_msg_clear(&m);
}

/* From the tick: a view older than --view-timeout stops counting (the router's own liveness
 * decides alone until the next one). */
static void view_check_age(rt_router *r, uint64_t now)
{
    if (!r->have_view) return;
    uint64_t age = now > r->view_at_ms ? now - r->view_at_ms : 0;
    km_gauge_set(r->s_view_age, (double)age / 1e3);
    if (r->view_fresh && age > r->c.view_timeout_ms) {
        r->view_fresh = false;
        KM_WARN("view_stale",
                "controller=%s epoch=%llu age_ms=%llu timeout_ms=%u fallback=own_liveness",
                r->ctl_id, (unsigned long long)r->view_epoch, (unsigned long long)age,
                r->c.view_timeout_ms);
        pump_queue(r); /* workers the view held back may take the queue now */
    }
}

/* ---------------------------------------------------------------- life cycle */

void rt_config_default(rt_config *c)
{
    memset(c, 0, sizeof *c);
    c->page_tokens = 16;
    c->front_url = "tcp://127.0.0.1:7000";
    c->http_host = "127.0.0.1";
    c->http_port = 8080;
    c->admin_port = -1;
    rt_policy_default(&c->policy);
    c->worker_slots = 8;
    c->max_inflight = 64;
    c->max_queue = 1024;
    c->max_attempts = 3;
    c->default_max_tokens = 256;
    c->sync_timeout_ms = 3000;
    c->index_pages = 1u << 18;
    c->pending_ttl_ms = 30000;
    c->max_http_body = 4u << 20;
    c->queue_timeout_ms = 60000;
    c->migrate_replay = true;
    c->view_timeout_ms = 5000;
}

static int register_worker_metrics(rt_router *r, rt_wk *w, km_errbuf *err);

static int register_metrics(rt_router *r, km_errbuf *err)
{
    km_metric *m;
    static const double lat[] = {0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1,
                                 0.25,   0.5,    1,     2.5,   5,    10,    30,   60};
    static const double dec[] = {1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 1e-2};
#define REG(kind, name, help, labels, bounds, nb, lv, dst)                                         \
    do {                                                                                           \
        int rc_ = km_metric_register(r->metrics, kind, name, help, labels, bounds, nb, &m, err);   \
        if (rc_) return rc_;                                                                       \
        dst = km_metric_series(m, lv);                                                             \
    } while (0)
    const char *ok[] = {"ok"}, *er[] = {"error"};
    REG(KM_COUNTER, "kvmesh_router_requests_total", "Requests ended, by outcome.", "outcome", NULL,
        0, ok, r->s_req_ok);
    REG(KM_COUNTER, "kvmesh_router_requests_total", "Requests ended, by outcome.", "outcome", NULL,
        0, er, r->s_req_err);
    REG(KM_COUNTER, "kvmesh_router_overloaded_total", "Requests refused with 529 (queue full).",
        NULL, NULL, 0, NULL, r->s_overloaded);
    REG(KM_COUNTER, "kvmesh_router_migrations_total", "Requests re-sent to another worker.", NULL,
        NULL, 0, NULL, r->s_migr);
    REG(KM_COUNTER, "kvmesh_router_bad_frames_total",
        "Malformed client frames and HTTP bodies answered with an error.", NULL, NULL, 0, NULL,
        r->s_bad);
    REG(KM_COUNTER, "kvmesh_router_prompt_tokens_total", "Prompt tokens of completed requests.",
        NULL, NULL, 0, NULL, r->s_prompt);
    REG(KM_COUNTER, "kvmesh_router_cached_tokens_total",
        "Prompt tokens the workers served from cached KV.", NULL, NULL, 0, NULL, r->s_cached);
    REG(KM_COUNTER, "kvmesh_router_predicted_cached_tokens_total",
        "Prompt tokens the prefix index predicted cached on the chosen worker.", NULL, NULL, 0,
        NULL, r->s_predicted);
    REG(KM_GAUGE, "kvmesh_router_queue_depth", "Requests waiting in the router.", NULL, NULL, 0,
        NULL, r->s_queue);
    REG(KM_GAUGE, "kvmesh_router_inflight", "Requests at workers.", NULL, NULL, 0, NULL,
        r->s_inflight_all);
    REG(KM_HISTOGRAM, "kvmesh_router_decision_seconds", "Time to pick a worker.", NULL, dec,
        (int)(sizeof dec / sizeof *dec), NULL, r->s_decision);
    REG(KM_HISTOGRAM, "kvmesh_router_ttft_seconds", "Arrival to first token.", NULL, lat,
        (int)(sizeof lat / sizeof *lat), NULL, r->s_ttft);
    REG(KM_HISTOGRAM, "kvmesh_router_request_seconds", "Arrival to the end.", NULL, lat,
        (int)(sizeof lat / sizeof *lat), NULL, r->s_total);
    REG(KM_COUNTER, "kvmesh_router_event_gaps_total", "Gaps seen in workers' KV events.", NULL,
        NULL, 0, NULL, r->s_gaps);
    REG(KM_COUNTER, "kvmesh_router_event_resyncs_total",
        "Times a worker's pages were forgotten because a gap could not be filled.", NULL, NULL, 0,
        NULL, r->s_resync);
    REG(KM_GAUGE, "kvmesh_router_index_pages", "Distinct pages in the prefix index.", NULL, NULL, 0,
        NULL, r->s_index_pages);
    REG(KM_COUNTER, "kvmesh_router_http_requests_total", "HTTP requests received.", NULL, NULL, 0,
        NULL, r->s_http_req);
    REG(KM_COUNTER, "kvmesh_router_views_total", "Controller views applied.", NULL, NULL, 0, NULL,
        r->s_views);
    REG(KM_COUNTER, "kvmesh_router_bad_views_total",
        "Controller view messages that could not be decoded (ignored).", NULL, NULL, 0, NULL,
        r->s_bad_views);
    REG(KM_GAUGE, "kvmesh_router_view_age_seconds",
        "Seconds since the last controller view (-1: none yet, or no --controller).", NULL, NULL, 0,
        NULL, r->s_view_age);
    km_gauge_set(r->s_view_age, -1);
#undef REG
    for (int i = 0; i < r->n_w; i++) {
        int rc = register_worker_metrics(r, &r->w[i], err);
        if (rc) return rc;
    }
    return 0;
}

/* The per-worker series (at start, and for a worker a view adds at run time). */
static int register_worker_metrics(rt_router *r, rt_wk *w, km_errbuf *err)
{
    km_metric *m;
#define REG(kind, name, help, labels, bounds, nb, lv, dst)                                         \
    do {                                                                                           \
        int rc_ = km_metric_register(r->metrics, kind, name, help, labels, bounds, nb, &m, err);   \
        if (rc_) return rc_;                                                                       \
        dst = km_metric_series(m, lv);                                                             \
    } while (0)
    {
        const char *lv[] = {w->id};
        REG(KM_GAUGE, "kvmesh_router_worker_up", "1 while the worker's connection is up.", "worker",
            NULL, 0, lv, w->s_up);
        REG(KM_GAUGE, "kvmesh_router_worker_inflight", "Requests this router has at the worker.",
            "worker", NULL, 0, lv, w->s_inflight);
        REG(KM_COUNTER, "kvmesh_router_routed_total", "Requests sent to the worker.", "worker",
            NULL, 0, lv, w->s_routed);
        static const char *tiers[KM_TIER_COUNT] = {"hot", "host", "disk"};
        for (int t = 0; t < KM_TIER_COUNT; t++) {
            const char *lv2[] = {w->id, tiers[t]};
            REG(KM_GAUGE, "kvmesh_router_worker_kv_pages",
                "KV pages the worker holds, per tier, as its events say.", "worker,tier", NULL, 0,
                lv2, w->s_pages[t]);
        }
        REG(KM_GAUGE, "kvmesh_router_worker_member_state",
            "The worker's state in the controller's view: 0 starting, 1 ready, 2 draining, "
            "3 restarting, 4 dead; -1 not in the view.",
            "worker", NULL, 0, lv, w->s_member);
        REG(KM_GAUGE, "kvmesh_router_worker_recovery_level",
            "The recovery level in effect on the worker, as the controller's view says.", "worker",
            NULL, 0, lv, w->s_level);
        km_gauge_set(w->s_member, w->in_view ? (double)w->member : -1);
    }
#undef REG
    return 0;
}

static int open_poll(rt_router *r, uv_poll_t *p, void *sock, km_errbuf *err)
{
    int fd;
    int rc = km_zsock_fd(sock, &fd, err);
    if (rc) return rc;
    uv_poll_init(&r->loop, p, fd);
    p->data = r;
    uv_poll_start(p, UV_READABLE, on_zpoll);
    return 0;
}

static void on_stop_async(uv_async_t *a)
{
    rt_router *r = a->data;
    uv_stop(&r->loop);
}

/* Fills the next free worker slot (no sockets yet). */
static int worker_slot_init(rt_router *r, const char *id, const char *req, const char *ev,
                            km_errbuf *err)
{
    if (r->n_w >= RT_MAX_WORKERS)
        return km_errf(err, KM_ERANGE, "router: more than %d workers", RT_MAX_WORKERS);
    rt_wk *w = &r->w[r->n_w];
    memset(w, 0, sizeof *w);
    w->r = r;
    w->idx = r->n_w;
    w->member = KM_MEMBER_STARTING;
    snprintf(w->id, sizeof w->id, "%s", id);
    snprintf(w->req_url, sizeof w->req_url, "%s", req);
    snprintf(w->ev_url, sizeof w->ev_url, "%s", ev ? ev : "");
    int rc = rt_evstream_create(4096, &w->evs);
    if (rc) return km_errf(err, rc, "router: event stream for worker '%s'", id);
    r->n_w++;
    return 0;
}

/* The worker's DEALER (with its socket monitor), the SUB's connection to its events, and their
 * polls on the loop. The monitor's handshake event makes it usable and asks for its replay. */
static int worker_open(rt_router *r, rt_wk *w, km_errbuf *err)
{
    km_zsock_opts wo;
    km_zsock_opts_default(&wo);
    int rc = km_zsock_open(r->zctx, KM_ZDEALER, &wo, &w->dealer, err);
    if (rc) return rc;
    int ivl = 100; /* reconnect quickly to a restarted worker */
    zmq_setsockopt(w->dealer, ZMQ_RECONNECT_IVL, &ivl, sizeof ivl);
    int ivl_max = 1000;
    zmq_setsockopt(w->dealer, ZMQ_RECONNECT_IVL_MAX, &ivl_max, sizeof ivl_max);
    char mon[64];
    snprintf(mon, sizeof mon, "inproc://rt-mon-%p-%d", (void *)r, w->idx);
    if (zmq_socket_monitor(w->dealer, mon, ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_DISCONNECTED))
        return km_errf(err, KM_EIO, "router: socket monitor: %s", zmq_strerror(zmq_errno()));
    w->mon = zmq_socket(r->zctx, ZMQ_PAIR);
    int linger = 0;
    if (!w->mon || zmq_setsockopt(w->mon, ZMQ_LINGER, &linger, sizeof linger) ||
        zmq_connect(w->mon, mon))
        rc = km_errf(err, KM_EIO, "router: monitor socket");
    if (!rc) rc = km_zsock_connect(w->dealer, w->req_url, err);
    if (!rc && w->ev_url[0] && (rc = km_zsock_connect(r->sub, w->ev_url, err)))
        zmq_disconnect(w->dealer, w->req_url);
    if (rc) { /* nothing of w is on the loop yet: undo the sockets */
        zmq_socket_monitor(w->dealer, NULL, 0);
        if (w->mon) zmq_close(w->mon);
        km_zsock_close(w->dealer);
        w->mon = w->dealer = NULL;
        return rc;
    }
    if ((rc = open_poll(r, &w->p_dealer, w->dealer, err))) return rc;
    if ((rc = open_poll(r, &w->p_mon, w->mon, err))) {
        uv_close((uv_handle_t *)&w->p_dealer, NULL);
        return rc;
    }
    w->polls_open = true;
    return 0;
}

int rt_router_create(const rt_config *c, rt_router **out, km_errbuf *err)
{
    *out = NULL;
    bool ctl = c->controller_url && *c->controller_url;
    if ((!ctl && !c->n_workers) || c->n_workers < 0 || c->n_workers > RT_MAX_WORKERS)
        return km_errf(err, KM_EINVAL, "router: %d workers (%d..%d)", c->n_workers, ctl ? 0 : 1,
                       RT_MAX_WORKERS);
    if (c->page_tokens <= 0) return km_errf(err, KM_EINVAL, "router: page_tokens must be > 0");
    rt_router *r = calloc(1, sizeof *r);
    if (!r) return km_errf(err, KM_ENOMEM, "router: out of memory");
    r->c = *c;
    if (r->c.worker_slots <= 0) r->c.worker_slots = 8;
    if (r->c.max_attempts <= 0) r->c.max_attempts = 3;
    if (r->c.max_queue < 0) r->c.max_queue = 0;
    if (!r->c.view_timeout_ms) r->c.view_timeout_ms = 5000;
    r->c.workers = NULL; /* the caller's list need not outlive create */
    r->c.controller_url = NULL;
    if (c->controller_url) snprintf(r->ctl_url, sizeof r->ctl_url, "%s", c->controller_url);
    km_proto_limits_default(&r->lim);
    int rc = uv_loop_init(&r->loop);
    if (rc) {
        free(r);
        return km_errf(err, KM_EIO, "router: uv_loop_init: %s", uv_strerror(rc));
    }
    uv_async_init(&r->loop, &r->stop_async, on_stop_async);
    r->stop_async.data = r;
    uv_check_init(&r->loop, &r->check);
    r->check.data = r;
    uv_timer_init(&r->loop, &r->tick);
    r->tick.data = r;
    r->running = true;
    *out = r;

    const char *path = c->model_path ? c->model_path : wk_default_model_path();
    if ((rc = wk_model_load(path, &r->model, err))) goto fail;
    r->tok = wk_model_tokenizer(r->model);
    r->chat = wk_model_chat_kind(r->model);
    snprintf(r->model_name, sizeof r->model_name, "%s", wk_model_name(r->model));
    if (c->fingerprint)
        snprintf(r->fp, sizeof r->fp, "%s", c->fingerprint);
    else
        wk_model_fingerprint_hex(r->model, r->fp);
    r->tokcap = 0;
    if ((rc = rt_index_create(c->index_pages ? c->index_pages : (1u << 18),
                              c->pending_ttl_ms ? c->pending_ttl_ms : 30000, &r->index))) {
        km_errf(err, rc, "router: prefix index of %zu pages", c->index_pages);
        goto fail;
    }
    if ((rc = km_metrics_create(&r->metrics))) goto fail;
    /* every slot at once: a view may add workers later, and their uv handles must not move */
    r->w = calloc(RT_MAX_WORKERS, sizeof *r->w);
    if (!r->w) {
        rc = km_errf(err, KM_ENOMEM, "router: out of memory");
        goto fail;
    }
    for (int i = 0; i < c->n_workers; i++) {
        for (int j = 0; j < i; j++)
            if (!strcmp(c->workers[j].id, c->workers[i].id)) {
                rc =
                    km_errf(err, KM_EINVAL, "router: worker id '%s' given twice", c->workers[i].id);
                goto fail;
            }
        if ((rc = worker_slot_init(r, c->workers[i].id, c->workers[i].requests_url,
                                   c->workers[i].events_url, err)))
            goto fail;
    }
    if ((rc = register_metrics(r, err))) goto fail;

    r->zctx = km_zctx_create();
    if (!r->zctx) {
        rc = km_errf(err, KM_EIO, "router: zmq context");
        goto fail;
    }
    km_zsock_opts zo;
    km_zsock_opts_default(&zo);
    if ((rc = km_zsock_open(r->zctx, KM_ZROUTER, &zo, &r->front, err)) ||
        (rc = km_zsock_bind(r->front, c->front_url, err)) ||
        (rc = km_zsock_last_endpoint(r->front, r->front_ep, sizeof r->front_ep, err)))
        goto fail;
    if ((rc = km_zsock_open(r->zctx, KM_ZSUB, &zo, &r->sub, err)) ||
        (rc = km_zsock_subscribe(r->sub, "kv.", 3, err)))
        goto fail;
    if ((rc = open_poll(r, &r->p_front, r->front, err)) ||
        (rc = open_poll(r, &r->p_sub, r->sub, err)))
        goto fail;
    for (int i = 0; i < r->n_w; i++)
        if ((rc = worker_open(r, &r->w[i], err))) goto fail;
    if (c->controller_url && *c->controller_url) {
        if ((rc = km_zsock_open(r->zctx, KM_ZSUB, &zo, &r->vsub, err)) ||
            (rc = km_zsock_subscribe(r->vsub, "view", 4, err)) ||
            (rc = km_zsock_connect(r->vsub, c->controller_url, err)) ||
            (rc = open_poll(r, &r->p_vsub, r->vsub, err)))
            goto fail;
    }
    if (c->http_host && c->http_port >= 0) {
        rt_http_opts ho = {.host = c->http_host,
                           .port = c->http_port,
                           .max_body = c->max_http_body,
                           .handler = rt_front_on_http,
                           .user = r};
        if ((rc = rt_http_start(&r->loop, &ho, &r->http, err))) goto fail;
    }
    if (c->admin_port >= 0) {
        km_admin_opts ao = {.host = c->admin_host ? c->admin_host : "127.0.0.1",
                            .port = c->admin_port,
                            .metrics = r->metrics};
        if ((rc = km_admin_start(&ao, &r->admin, err))) goto fail;
    }
    uv_check_start(&r->check, on_check);
    uv_timer_start(&r->tick, on_tick, RT_TICK_MS, RT_TICK_MS);
    KM_INFO("router_start",
            "model=%s fingerprint=%s front=%s http_port=%d workers=%d mode=%s controller=%s "
            "view_timeout_ms=%u",
            r->model_name, r->fp, r->front_ep, rt_router_http_port(r), r->n_w,
            rt_mode_name(r->c.policy.mode), r->vsub ? r->ctl_url : "-", r->c.view_timeout_ms);
    return 0;
fail:
    *out = NULL;
    rt_router_destroy(r);
    return rc ? rc : KM_EIO;
}

int rt_router_run(rt_router *r)
{
    rt_pump(r);
    uv_run(&r->loop, UV_RUN_DEFAULT);
    return 0;
}

void rt_router_stop(rt_router *r)
{
    if (r) uv_async_send(&r->stop_async);
}

int rt_router_front_endpoint(const rt_router *r, char *buf, size_t cap)
{
    if (!r || (size_t)snprintf(buf, cap, "%s", r->front_ep) >= cap) return KM_ERANGE;
    return 0;
}

int rt_router_http_port(const rt_router *r)
{
    return r && r->http ? rt_http_port(r->http) : -1;
}

int rt_router_admin_port(const rt_router *r)
{
    return r && r->admin ? km_admin_port(r->admin) : -1;
}

static void close_walk(uv_handle_t *h, void *arg)
{
    if (!uv_is_closing(h)) uv_close(h, NULL);
}

void rt_router_destroy(rt_router *r)
{
    if (!r) return;
    r->stopping = true;
    /* every request still held ends with 503 so no client waits forever */
    for (int b = 0; b < RT_RQ_BUCKETS; b++)
        while (r->buckets[b]) {
            rt_rq *q = r->buckets[b];
            if (q->origin == RQ_ZMQ && r->front)
                send_error_env(r, q->env, q->n_env, q->cid, KM_CODE_UNAVAILABLE, 0,
                               "router shutting down");
            else if (q->http)
                http_send_error(r, q, KM_CODE_UNAVAILABLE, 0, "router shutting down");
            rt_rq_end(r, q);
        }
    while (r->qhead) rt_rq_end(r, r->qhead);
    if (r->admin) km_admin_stop(r->admin);
    if (r->running) {
        if (r->http) rt_http_stop(r->http);
        r->http = NULL;
        uv_walk(&r->loop, close_walk, NULL);
        uv_run(&r->loop, UV_RUN_DEFAULT);
        uv_loop_close(&r->loop);
    }
    for (int i = 0; i < r->n_w; i++) {
        rt_wk *w = &r->w[i];
        if (w->dealer) zmq_socket_monitor(w->dealer, NULL, 0);
        if (w->mon) zmq_close(w->mon);
        km_zsock_close(w->dealer);
        rt_evstream_destroy(w->evs);
        replay_clear(w);
        free(w->replay);
    }
    km_zsock_close(r->front);
    km_zsock_close(r->sub);
    km_zsock_close(r->vsub);
    if (r->zctx) km_zctx_destroy(r->zctx);
    rt_index_destroy(r->index);
    km_metrics_destroy(r->metrics);
    km_buf_free(&r->out);
    km_zmsg_clear(&r->zm);
    free(r->tokbuf);
    free(r->w);
    wk_model_free(r->model);
    free(r);
}
