/*
 * workers.c — the router's links to its workers (internal.h): one DEALER per worker for
 * requests and replays, with a socket monitor for liveness, and the KV event stream every
 * worker publishes, which keeps the prefix index (route.h) in step with the workers' stores.
 *
 * Why it is built this way:
 *  - Workers are told apart by their DEALER socket, and their liveness comes from its monitor: a
 *    disconnect (process killed, ZMTP heartbeat timeout) makes the worker unusable at once and
 *    migrates its requests; a (re)connect asks it for a replay of its KV events from 0.
 *  - Catch-up after an event gap uses the worker's replay: an `admin` status with events_since
 *    (docs/protocol.md section 9); the worker answers with the missing `kv` frames (or a snapshot
 *    of its whole index) on the request connection, then an `admin_reply` with events_next and
 *    events_snapshot. Frames of a replay are buffered until that reply says which it was. When
 *    no answer comes, or the worker cannot replay, its pages are forgotten: a possible cache miss,
 *    never a wrong answer (workers verify every hit).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "router/internal.h"

static void request_sync(rt_router *r, rt_wk *w, uint64_t since);

/* ---------------------------------------------------------------- links */

/* Fills a free worker slot (a released one first, else the next; no sockets yet). */
int rt_worker_slot_init(rt_router *r, const char *id, const char *req, const char *ev, rt_wk **out,
                        km_errbuf *err)
{
    int i = 0;
    while (i < r->n_w && !r->w[i].free) i++;
    if (i >= RT_MAX_WORKERS)
        return km_errf(err, KM_ERANGE, "router: more than %d workers", RT_MAX_WORKERS);
    rt_wk *w = &r->w[i];
    memset(w, 0, sizeof *w);
    w->r = r;
    w->idx = i;
    w->member = KM_MEMBER_STARTING;
    snprintf(w->id, sizeof w->id, "%s", id);
    snprintf(w->req_url, sizeof w->req_url, "%s", req);
    snprintf(w->ev_url, sizeof w->ev_url, "%s", ev ? ev : "");
    int rc = rt_evstream_create(4096, &w->evs);
    if (rc) {
        w->free = true;
        return km_errf(err, rc, "router: event stream for worker '%s'", id);
    }
    if (i == r->n_w) r->n_w++;
    if (out) *out = w;
    return 0;
}

int rt_sub_connect(rt_router *r, rt_wk *w, km_errbuf *err)
{
    /* the worker's own SUB, pinned to its member key (rt_worker_open made it) */
    int rc = km_zsec_client(r->c.sec, w->sub, w->id, err);
    return rc ? rc : km_zsock_connect(w->sub, w->ev_url, err);
}

static void on_release_closed(uv_handle_t *h)
{
    rt_wk *w = h->data;
    if (--w->closing == 0) w->free = true;
}

void rt_worker_release(rt_router *r, rt_wk *w)
{
    if (w->free || w->closing) return;
    KM_INFO("worker_released", "worker=%s requests=%s why=\"no longer in the controller's view\"",
            w->id, w->req_url);
    rt_index_forget_worker(r->index, w->idx);
    km_gauge_set(w->s_up, 0);
    km_gauge_set(w->s_member, -1);
    km_gauge_set(w->s_inflight, 0);
    w->connected = false;
    w->in_view = false;
    w->sync_out = false;
    rt_evstream_destroy(w->evs);
    w->evs = NULL;
    rt_replay_clear(w);
    free(w->replay);
    w->replay = NULL;
    if (w->polls_open) { /* stop watching the descriptors before their sockets close */
        w->closing = 3;
        w->p_dealer.data = w->p_mon.data = w->p_sub.data = w;
        uv_close((uv_handle_t *)&w->p_dealer, on_release_closed);
        uv_close((uv_handle_t *)&w->p_mon, on_release_closed);
        uv_close((uv_handle_t *)&w->p_sub, on_release_closed);
        w->polls_open = false;
    }
    if (w->dealer) zmq_socket_monitor(w->dealer, NULL, 0);
    if (w->mon) zmq_close(w->mon);
    km_zsock_close(w->dealer);
    km_zsock_close(w->sub);
    w->mon = w->dealer = w->sub = NULL;
    w->id[0] = w->view_id[0] = w->req_url[0] = w->ev_url[0] = 0; /* matches nothing any more */
    if (!w->closing) w->free = true;
    rt_update_page_gauges(r);
}

/* The worker's DEALER (with its socket monitor), its events SUB, and their polls on the loop.
 * The monitor's handshake event makes it usable and asks for its replay. */
int rt_worker_open(rt_router *r, rt_wk *w, km_errbuf *err)
{
    km_zsock_opts wo;
    km_zsock_opts_default(&wo);
    int rc = km_zsock_open(r->zctx, KM_ZDEALER, &wo, &w->dealer, err);
    if (rc) return rc;
    /* the worker id's member key: only the holder of its secret can answer (docs/security.md) */
    if ((rc = km_zsec_client(r->c.sec, w->dealer, w->id, err))) {
        km_zsock_close(w->dealer);
        w->dealer = NULL;
        return rc;
    }
    int ivl = 100; /* reconnect quickly to a restarted worker */
    zmq_setsockopt(w->dealer, ZMQ_RECONNECT_IVL, &ivl, sizeof ivl);
    int ivl_max = 1000;
    zmq_setsockopt(w->dealer, ZMQ_RECONNECT_IVL_MAX, &ivl_max, sizeof ivl_max);
    char mon[64];
    snprintf(mon, sizeof mon, "inproc://rt-mon-%p-%d", (void *)r, w->idx);
    rc = rt_monitor_open(r, w->dealer, mon, ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_DISCONNECTED,
                         &w->mon, err);
    if (!rc) rc = km_zsock_connect(w->dealer, w->req_url, err);
    if (!rc && !(rc = km_zsock_open(r->zctx, KM_ZSUB, &wo, &w->sub, err)))
        rc = km_zsock_subscribe(w->sub, "kv.", 3, err);
    if (!rc && w->ev_url[0]) rc = rt_sub_connect(r, w, err);
    if (rc) { /* nothing of w is on the loop yet: undo the sockets */
        zmq_socket_monitor(w->dealer, NULL, 0);
        if (w->mon) zmq_close(w->mon);
        km_zsock_close(w->dealer);
        km_zsock_close(w->sub);
        w->mon = w->dealer = w->sub = NULL;
        return rc;
    }
    if ((rc = rt_open_poll(r, &w->p_dealer, w->dealer, err))) return rc;
    if ((rc = rt_open_poll(r, &w->p_mon, w->mon, err))) {
        uv_close((uv_handle_t *)&w->p_dealer, NULL);
        return rc;
    }
    if ((rc = rt_open_poll(r, &w->p_sub, w->sub, err))) {
        uv_close((uv_handle_t *)&w->p_dealer, NULL);
        uv_close((uv_handle_t *)&w->p_mon, NULL);
        return rc;
    }
    w->polls_open = true;
    return 0;
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
    rt_pump_queue(r);
}

void rt_worker_down(rt_router *r, rt_wk *w, const char *why)
{
    if (!w->connected) return;
    w->connected = false;
    km_gauge_set(w->s_up, 0);
    /* Its hot pages are gone with the process; a restart republishes what survives (disk). */
    rt_index_forget_worker(r->index, w->idx);
    rt_evstream_reset(w->evs);
    w->sync_out = false;
    rt_replay_clear(w);
    rt_update_page_gauges(r);
    KM_WARN("worker_down", "worker=%s why=%s inflight=%d", w->id, why, w->inflight);
    rt_migrate_all(r, w, "worker lost", false);
}

int rt_monitor_open(rt_router *r, void *sock, const char *ep, int events, void **mon,
                    km_errbuf *err)
{
    *mon = NULL;
    if (zmq_socket_monitor(sock, ep, events))
        return km_errf(err, KM_EIO, "router: socket monitor: %s", zmq_strerror(zmq_errno()));
    *mon = zmq_socket(r->zctx, ZMQ_PAIR);
    int linger = 0;
    if (!*mon || zmq_setsockopt(*mon, ZMQ_LINGER, &linger, sizeof linger) || zmq_connect(*mon, ep))
        return km_errf(err, KM_EIO, "router: monitor socket");
    return 0;
}

int rt_monitor_next(void *mon, uint16_t *event, uint32_t *value)
{
    zmq_msg_t ev;
    zmq_msg_init(&ev);
    if (zmq_msg_recv(&ev, mon, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&ev);
        return 0;
    }
    *event = 0;
    *value = 0;
    if (zmq_msg_size(&ev) >= 6) {
        memcpy(event, zmq_msg_data(&ev), 2);
        memcpy(value, (const char *)zmq_msg_data(&ev) + 2, 4);
    }
    bool more = zmq_msg_more(&ev);
    zmq_msg_close(&ev);
    while (more) { /* the endpoint part */
        zmq_msg_t p;
        zmq_msg_init(&p);
        if (zmq_msg_recv(&p, mon, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&p);
            break;
        }
        more = zmq_msg_more(&p);
        zmq_msg_close(&p);
    }
    return 1;
}

void rt_read_monitor(rt_router *r, rt_wk *w)
{
    uint16_t event;
    uint32_t value;
    while (rt_monitor_next(w->mon, &event, &value)) {
        if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
            worker_up(r, w);
        } else if (event == ZMQ_EVENT_DISCONNECTED) {
            /* frames it sent before dying are still queued: take them first */
            while (km_zsock_readable(w->dealer) && km_zrecv(w->dealer, &r->zm, 0, NULL) == 0) {
                const km_zframe *b = km_zmsg_body(&r->zm);
                if (b) rt_on_worker_frame(r, w, b);
            }
            rt_worker_down(r, w, "disconnected");
        }
    }
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

void rt_replay_clear(rt_wk *w)
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
    rt_replay_clear(w);
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
    rt_replay_clear(w);
    w->resyncs++;
    km_counter_inc(r->s_resync);
    KM_WARN("kv_resync", "worker=%s why=\"%s\" next=%llu", w->id, why,
            (unsigned long long)rt_evstream_next(w->evs));
}

void rt_sync_expire(rt_router *r, uint64_t now)
{
    for (int i = 0; i < r->n_w; i++) {
        rt_wk *w = &r->w[i];
        if (w->sync_out && now >= w->sync_deadline_ms)
            forget_and_resync(r, w, "no answer to the replay request");
    }
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
        rt_replay_clear(w);
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
    rt_replay_clear(w);
    /* The replay holds every frame from our position that the worker has; seqs below `next`
     * that it did not send do not exist (a fresh worker numbers from 1). */
    rt_evstream_jump(w->evs, next, apply_event, w);
    if (rt_evstream_waiting(w->evs)) /* a newer gap opened behind the replay */
        request_sync(r, w, rt_evstream_next(w->evs));
    rt_update_page_gauges(r);
}

/* ---------------------------------------------------------------- frames in */

void rt_on_worker_frame(rt_router *r, rt_wk *w, const km_zframe *body)
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
        rt_relay_token(r, w, &m.tok);
        break;
    case KM_MSG_DONE:
        rt_relay_done(r, w, &m.done);
        rt_pump_queue(r);
        break;
    case KM_MSG_ERROR:
        if (w->sync_out && m.error.id == w->sync_id) {
            finish_sync(r, w, NULL);
            break;
        }
        rt_relay_error(r, w, &m.error);
        rt_pump_queue(r);
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

void rt_on_sub_frame(rt_router *r, rt_wk *from, const km_zframe *body)
{
    km_msg m;
    if (km_msg_decode(body->data, body->len, &r->lim, &m, NULL)) {
        r->n_bad_frames++;
        km_counter_inc(r->s_bad);
        return;
    }
    if (m.type == KM_MSG_KV_EVENT) {
        rt_wk *w = worker_by_id(r, m.kv.worker);
        if (w && w != from) {
            km_counter_inc(r->s_ev_foreign);
            KM_WARN("event_refused", "from=%s names=%s why=\"an event names another worker\"",
                    from->id, w->id);
        } else if (w) {
            handle_event(r, w, &m.kv);
            rt_update_page_gauges(r);
        }
    }
    km_msg_clear(&m);
}
