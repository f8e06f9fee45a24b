/*
 * router.c — the kvmesh-router daemon's life cycle and loop (router.h, "the router daemon"):
 * create (model metadata, prefix index, metrics, worker slots, then every socket), run, stop,
 * destroy, and the loop that drains every socket. What happens to a request is in the other
 * files of router/ (internal.h has the map).
 *
 * Why it is built this way:
 *  - One libuv loop on one thread: ZeroMQ sockets are watched through their descriptors
 *    (uv_poll on ZMQ_FD) and drained until ZMQ_EVENTS says empty, from the poll callbacks and
 *    from a uv_check after every loop iteration (ZMQ_FD is edge-like: a send can swallow a
 *    notification, the check catches it). HTTP, timers and signals share the loop, so request
 *    state needs no lock and a token goes from a worker to its client inside one callback.
 *  - Request ids toward workers are the router's own, new for every attempt (clients' ids are
 *    unique only per client; a late frame of an abandoned attempt can never be mistaken).
 *  - The worker slot array is allocated whole at start: a controller's view may connect workers
 *    at run time (view.c), and libuv handles live inside the slots and must not move.
 *  - A tick (every RT_TICK_MS) expires replays and queued requests, ages the view, retries the
 *    queue and sweeps the index's expired pending marks; nothing else is timer driven.
 *  - Destroying the router answers every request it still holds with 503, so no client waits
 *    forever for a router that is gone.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>
#include <zmq.h>

#include "router/internal.h"

/* ---------------------------------------------------------------- the loop */

/* One worker's sockets, in one pass: its answers, its connection events, its KV events (a
 * handler may release w: a released slot's sockets are NULL and read as empty). */
static int rt_pump_worker(rt_router *r, rt_wk *w)
{
    int got = 0;
    for (int i = 0; i < 256 && km_zsock_readable(w->dealer); i++) {
        if (km_zrecv(w->dealer, &r->zm, 0, NULL)) continue;
        const km_zframe *b = km_zmsg_body(&r->zm);
        if (b) rt_on_worker_frame(r, w, b);
        got++;
    }
    if (km_zsock_readable(w->mon)) {
        rt_read_monitor(r, w);
        got++;
    }
    for (int i = 0; i < 256 && w->sub && km_zsock_readable(w->sub); i++) {
        if (km_zrecv(w->sub, &r->zm, 0, NULL)) continue;
        const km_zframe *b = km_zmsg_body(&r->zm);
        if (b) rt_on_sub_frame(r, w, b);
        got++;
    }
    return got;
}

/* Drains every ZeroMQ socket until none has anything to read (r->pump: rt_pump). */
static void pump(rt_router *r)
{
    if (r->pumping || r->stopping) return;
    r->pumping = true;
    for (int rounds = 0; rounds < 64; rounds++) {
        int got = 0;
        if (km_zsock_readable(r->fmon)) {
            rt_read_front_monitor(r);
            got++;
        }
        for (int i = 0; i < 256 && km_zsock_readable(r->front); i++) {
            /* connection events first, before every message: a request must never be taken
             * for the connection that had its descriptor before (clients.c) */
            if (km_zsock_readable(r->fmon)) rt_read_front_monitor(r);
            if (km_zrecv(r->front, &r->zm, 0, NULL)) {
                r->n_bad_frames++;
                continue;
            }
            rt_on_front_message(r, &r->zm);
            got++;
        }
        for (int k = 0; k < r->n_w; k++) got += rt_pump_worker(r, &r->w[k]);
        for (int i = 0; r->vsub && i < 64 && km_zsock_readable(r->vsub); i++) {
            if (km_zrecv(r->vsub, &r->zm, 0, NULL)) {
                rt_view_bad(r, "unreadable message");
                continue;
            }
            rt_on_view_message(r, &r->zm);
            got++;
        }
        if (!got) break;
    }
    r->pumping = false;
}

static void on_check(uv_check_t *c)
{
    rt_pump(c->data);
}

static void on_tick(uv_timer_t *t)
{
    rt_router *r = t->data;
    uint64_t now = rt_now_ms();
    rt_sync_expire(r, now);
    /* queued requests past their deadline or the queue timeout, and the queue itself */
    for (rt_rq *q = r->qhead; q;) {
        rt_rq *next = q->qnext;
        if (r->c.queue_timeout_ms && km_now_ns() - q->t_arrive > r->c.queue_timeout_ms * 1000000ull)
            rt_rq_fail(r, q, KM_CODE_UNAVAILABLE, rt_retry_after_ms(r),
                       "no worker could take the request in time");
        q = next;
    }
    rt_view_check_age(r, now);
    if (now - r->last_expire_ms >= 1000) {
        r->last_expire_ms = now;
        rt_rq_expire(r, km_now_ns());
    }
    rt_pump_queue(r);
    if (now - r->last_sweep_ms > 5000) {
        r->last_sweep_ms = now;
        rt_index_sweep(r->index, now);
    }
    rt_pump(r);
}

static void on_stop_async(uv_async_t *a)
{
    rt_router *r = a->data;
    uv_stop(&r->loop);
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
    c->max_queue_per_key = 256;
    c->max_attempts = 3;
    c->default_max_tokens = 256;
    c->max_ctx = 4096;
    c->sync_timeout_ms = 3000;
    c->index_pages = 1u << 18;
    c->pending_ttl_ms = 30000;
    c->max_http_body = 4u << 20;
    c->max_http_buffered = 256u << 20;
    c->max_n = 8;
    c->max_prompt_bytes = 1u << 20;
    c->request_timeout_ms = 600000;
    c->queue_timeout_ms = 60000;
    c->migrate_replay = false;
    c->view_timeout_ms = 5000;
}

/* The model's tokenizer and fingerprint, the prefix index, the metrics, the worker slots. */
static int open_state(rt_router *r, const rt_config *c, km_errbuf *err)
{
    int rc;
    const char *path = c->model_path ? c->model_path : md_default_model_path();
    if ((rc = md_model_info_open(path, &r->model, err))) return rc;
    r->tok = md_model_info_tokenizer(r->model);
    r->chat = md_model_info_chat(r->model);
    snprintf(r->model_name, sizeof r->model_name, "%s", md_model_info_name(r->model));
    snprintf(r->fp, sizeof r->fp, "%s",
             c->fingerprint ? c->fingerprint : md_model_info_fingerprint(r->model));
    rt_chunk_setup(r);
    if ((rc = rt_index_create(c->index_pages ? c->index_pages : (1u << 18),
                              c->pending_ttl_ms ? c->pending_ttl_ms : 30000, &r->index)))
        return km_errf(err, rc, "router: prefix index of %zu pages", c->index_pages);
    if ((rc = km_metrics_create(&r->metrics))) return rc;
    /* every slot at once: a view may add workers later, and their uv handles must not move */
    r->w = calloc(RT_MAX_WORKERS, sizeof *r->w);
    if (!r->w) return km_errf(err, KM_ENOMEM, "router: out of memory");
    for (int i = 0; i < c->n_workers; i++) {
        for (int j = 0; j < i; j++)
            if (!strcmp(c->workers[j].id, c->workers[i].id))
                return km_errf(err, KM_EINVAL, "router: worker id '%s' given twice",
                               c->workers[i].id);
        if ((rc = rt_worker_slot_init(r, c->workers[i].id, c->workers[i].requests_url,
                                      c->workers[i].events_url, NULL, err)))
            return rc;
    }
    return rt_register_metrics(r, err);
}

/* The client front, every worker's DEALER and events SUB, the view SUB, HTTP and admin. */
static int open_sockets(rt_router *r, const rt_config *c, km_errbuf *err)
{
    int rc;
    r->zctx = km_zctx_create();
    if (!r->zctx) return km_errf(err, KM_EIO, "router: zmq context");
    km_zsock_opts zo;
    km_zsock_opts_default(&zo);
    if ((rc = km_sec_daemon_start(r->zctx, c->sec, r->metrics, &r->zap, err)) ||
        (rc = km_zsock_open(r->zctx, KM_ZROUTER, &zo, &r->front, err)) ||
        (rc = km_zsec_server(c->sec, r->front, KM_ROLE_CLIENT | KM_ROLE_OPERATOR, err)) ||
        (rc = km_zsock_bind(r->front, c->front_url, err)) ||
        (rc = km_zsock_last_endpoint(r->front, r->front_ep, sizeof r->front_ep, err)))
        return rc;
    if ((rc = rt_front_monitor_open(r, err)) || (rc = rt_open_poll(r, &r->p_front, r->front, err)))
        return rc;
    for (int i = 0; i < r->n_w; i++)
        if ((rc = rt_worker_open(r, &r->w[i], err))) return rc;
    if (c->controller_url && *c->controller_url) {
        if ((rc = km_zsock_open(r->zctx, KM_ZSUB, &zo, &r->vsub, err)) ||
            (rc = km_zsock_subscribe(r->vsub, "view", 4, err)) ||
            (rc = km_zsec_client(c->sec, r->vsub, "controller", err)) ||
            (rc = km_zsock_connect(r->vsub, c->controller_url, err)) ||
            (rc = rt_open_poll(r, &r->p_vsub, r->vsub, err)))
            return rc;
    }
    if (c->api_keys && (rc = km_apikeys_open(c->api_keys, &r->apikeys, err))) return rc;
    if ((rc = rt_tenants_open(c->client_tenants, &r->tenants, err))) return rc;
    if ((rc = rt_front_start(r, err))) return rc;
    if (c->admin_port >= 0) {
        km_admin_opts ao = {.host = c->admin_host ? c->admin_host : "127.0.0.1",
                            .port = c->admin_port,
                            .metrics = r->metrics};
        if ((rc = km_admin_start(&ao, &r->admin, err))) return rc;
    }
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
    r->pump = pump;
    r->redispatch = rt_dispatch;
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
    if ((rc = open_state(r, c, err)) || (rc = open_sockets(r, c, err))) {
        rt_router_destroy(r);
        return rc;
    }
    uv_check_start(&r->check, on_check);
    uv_timer_start(&r->tick, on_tick, RT_TICK_MS, RT_TICK_MS);
    KM_INFO("router_start",
            "model=%s fingerprint=%s front=%s http_port=%d http_tls=%s workers=%d mode=%s "
            "controller=%s view_timeout_ms=%u",
            r->model_name, r->fp, r->front_ep, rt_router_http_port(r),
            km_http_server_tls(r->http) ? "on" : "off", r->n_w, rt_mode_name(r->c.policy.mode),
            r->vsub ? r->ctl_url : "-", r->c.view_timeout_ms);
    *out = r;
    return 0;
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
    return r && r->http ? km_http_server_port(r->http) : -1;
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
            if (q->fops->origin != RQ_ZMQ || r->front)
                rt_rq_reply_error(r, q, KM_CODE_UNAVAILABLE, 0, "router shutting down");
            rt_rq_end(r, q);
        }
    while (r->qhead) rt_rq_end(r, r->qhead);
    if (r->admin) km_admin_stop(r->admin);
    if (r->running) {
        if (r->http) km_http_server_stop(r->http);
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
        km_zsock_close(w->sub);
        rt_evstream_destroy(w->evs);
        rt_replay_clear(w);
        free(w->replay);
    }
    if (r->front && r->fmon) zmq_socket_monitor(r->front, NULL, 0);
    if (r->fmon) zmq_close(r->fmon);
    free(r->conn_gen);
    km_zsock_close(r->front);
    km_zsock_close(r->vsub);
    km_zap_stop(r->zap);
    if (r->zctx) km_zctx_destroy(r->zctx);
    rt_index_destroy(r->index);
    km_metrics_destroy(r->metrics);
    km_buf_free(&r->out);
    km_zmsg_clear(&r->zm);
    free(r->w);
    md_model_info_close(r->model);
    free(r->chunk_pre);
    km_apikeys_close(r->apikeys);
    rt_tenants_close(r->tenants);
    rt_fair_free(r);
    free(r);
}
