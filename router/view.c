/*
 * view.c — the router's use of the controller's cluster view: first its pure rules (route.h,
 * "cluster view"): how two spellings of a worker's endpoint are recognised as the same worker,
 * and which workers may get new requests given the router's own liveness and the view; then the
 * daemon applying each view it receives (internal.h): member states, workers connected at run
 * time, a dead member's requests migrated, a stale view ignored.
 *
 * With --controller the view narrows the router's own liveness, never widens it: a worker gets
 * new requests only when its connection is up *and* a fresh view names it "ready" (a slot the
 * view does not name gets nothing); a view that says "dead" or "left" migrates its requests
 * through the same path as a disconnect (rt_migrate_all). Members the router does not know are
 * connected at run time into spare worker slots, and a slot a view added is released again (sockets
 * closed, pages forgotten, the slot reused) once fresh views have not named it for --view-timeout
 * and it has nothing in flight: a controller forgets members that stay silent (its --forget-after),
 * and so a router's 64 slots do not fill up with workers that came and went. A view older than
 * --view-timeout is ignored, so a controller outage leaves the router serving on its own
 * liveness, as it did before controllers existed.
 *
 * Why it is built this way: the controller names workers by the endpoints their heartbeats
 * report (the worker's bound address, e.g. tcp://127.0.0.1:7100), while the router's --workers
 * list is written by a person or by `kvmesh up` (tcp://localhost:7100 works as well). The router
 * matches the two by endpoint, not by id, because the endpoint is what it is connected to; a
 * loopback or wildcard host is therefore normalised to 127.0.0.1 before comparing. The decision
 * "routable or not" is one small function so that the rule the router daemon applies is the rule
 * the unit tests check.
 */
#include <ctype.h>
#include <stdio.h>
#include <string.h>
#include <zmq.h>

#include "router/internal.h"

int rt_endpoint_norm(const char *url, char *out, size_t cap)
{
    if (!url || !out || !cap) return KM_EINVAL;
    const char *sep = strstr(url, "://");
    if (!sep) {
        if ((size_t)snprintf(out, cap, "%s", url) >= cap) return KM_ERANGE;
        return 0;
    }
    char scheme[16];
    size_t sl = (size_t)(sep - url);
    if (sl >= sizeof scheme) return KM_EINVAL;
    for (size_t i = 0; i < sl; i++) scheme[i] = (char)tolower((unsigned char)url[i]);
    scheme[sl] = 0;
    const char *host = sep + 3;
    if (strcmp(scheme, "tcp")) { /* ipc://, inproc://: the path is the identity */
        if ((size_t)snprintf(out, cap, "%s://%s", scheme, host) >= cap) return KM_ERANGE;
        return 0;
    }
    /* host ends at the last ':' (the port); an IPv6 host is bracketed */
    const char *colon = strrchr(host, ':');
    if (!colon || colon == host) return KM_EINVAL;
    char h[256];
    size_t hl = (size_t)(colon - host);
    if (hl >= sizeof h) return KM_ERANGE;
    for (size_t i = 0; i < hl; i++) h[i] = (char)tolower((unsigned char)host[i]);
    h[hl] = 0;
    static const char *const loop[] = {"localhost", "0.0.0.0", "*", "[::1]", "[::]", "::1"};
    for (size_t i = 0; i < sizeof loop / sizeof *loop; i++)
        if (!strcmp(h, loop[i])) {
            snprintf(h, sizeof h, "127.0.0.1");
            break;
        }
    if ((size_t)snprintf(out, cap, "tcp://%s%s", h, colon) >= cap) return KM_ERANGE;
    return 0;
}

bool rt_endpoint_same(const char *a, const char *b)
{
    if (!a || !b || !*a || !*b) return false;
    char na[512], nb[512];
    if (rt_endpoint_norm(a, na, sizeof na) || rt_endpoint_norm(b, nb, sizeof nb))
        return !strcmp(a, b);
    return !strcmp(na, nb);
}

bool rt_member_migrates(bool view_fresh, bool in_view, km_member_state state)
{
    return view_fresh && in_view && (state == KM_MEMBER_DEAD || state == KM_MEMBER_LEFT);
}

/* ---------------------------------------------------------------- the daemon's use of the view */

void rt_view_bad(rt_router *r, const char *why)
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
        rt_worker_down(r, same_id, "moved"); /* its requests migrate, its pages are forgotten */
        if (same_id->dealer) zmq_disconnect(same_id->dealer, same_id->req_url);
        if (same_id->ev_url[0]) zmq_disconnect(same_id->sub, same_id->ev_url);
        snprintf(same_id->req_url, sizeof same_id->req_url, "%s", vw->requests);
        snprintf(same_id->ev_url, sizeof same_id->ev_url, "%s", vw->events ? vw->events : "");
        if (km_zsock_connect(same_id->dealer, same_id->req_url, &err) ||
            (same_id->ev_url[0] && rt_sub_connect(r, same_id, &err)))
            KM_WARN("worker_move_failed", "worker=%s msg=\"%s\"", same_id->id, err.msg);
        return same_id;
    }
    int n_free = 0;
    for (int k = 0; k < r->n_w; k++) n_free += r->w[k].free;
    if (r->n_w >= RT_MAX_WORKERS && !n_free) {
        if (!r->slots_full_warned)
            KM_WARN("worker_not_added", "worker=%s why=\"all %d worker slots are taken\"", vw->id,
                    RT_MAX_WORKERS);
        r->slots_full_warned = true;
        return NULL;
    }
    rt_wk *w = NULL;
    int rc = rt_worker_slot_init(r, vw->id, vw->requests, vw->events, &w, &err);
    if (rc) w = NULL;
    if (w && (rc = rt_worker_open(r, w, &err))) {
        rt_evstream_destroy(w->evs);
        bool last = w->idx == r->n_w - 1;
        memset(w, 0, sizeof *w);
        w->free = true;
        if (last) r->n_w--;
        w = NULL;
    }
    if (!w) {
        KM_WARN("worker_not_added", "worker=%s requests=%s msg=\"%s\"", vw->id, vw->requests,
                err.msg);
        return NULL;
    }
    w->from_view = true;
    rt_register_worker_metrics(r, w, &err);
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
        for (int k = 0; k < r->n_w && !w; k++) {
            if (r->w[k].free || r->w[k].closing) continue;
            if (has_ep ? rt_endpoint_same(r->w[k].req_url, vw->requests)
                       : !strcmp(r->w[k].id, vw->id) || !strcmp(r->w[k].view_id, vw->id))
                w = &r->w[k]; /* no endpoint (no heartbeat with one yet): by id, never added */
        }
        bool gone = vw->state == KM_MEMBER_DEAD || vw->state == KM_MEMBER_LEFT;
        if (!w && (!has_ep || gone)) continue; /* nothing to connect */
        if (!w) {
            /* the same id under an endpoint no member of this view claims: it moved */
            rt_wk *same_id = NULL;
            for (int k = 0; k < r->n_w && !same_id; k++)
                if (r->w[k].id[0] &&
                    (!strcmp(r->w[k].id, vw->id) || !strcmp(r->w[k].view_id, vw->id)))
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
        rt_pull_view(w, vw);
        w->role = vw->role;
    }
    for (int k = 0; k < r->n_w; k++) {
        rt_wk *w = &r->w[k];
        if (w->free || w->closing) continue;
        if (seen[k]) {
            w->absent_since_ms = 0;
            continue;
        }
        set_member(r, w, false, KM_MEMBER_STARTING, 0);
        if (!w->absent_since_ms) w->absent_since_ms = now;
        if (w->from_view && !w->inflight && now - w->absent_since_ms >= r->c.view_timeout_ms)
            rt_worker_release(r, w);
    }
    /* the dead ones' requests go elsewhere, as on a disconnect */
    for (int k = 0; k < r->n_w; k++) {
        rt_wk *w = &r->w[k];
        if (w->free || w->closing) continue;
        if (w->inflight > 0 && rt_member_migrates(r->view_fresh, w->in_view, w->member)) {
            KM_WARN("worker_dead_in_view", "worker=%s inflight=%d controller=%s", w->id,
                    w->inflight, r->ctl_id);
            w->view_migrated += (uint64_t)w->inflight;
            rt_migrate_all(r, w, "the controller says the worker is dead", w->connected);
        }
    }
    rt_pump_queue(r);
}

void rt_on_view_message(rt_router *r, const km_zmsg *zm)
{
    if (zm->n != 2 || zm->part[0].len != 4 || memcmp(zm->part[0].data, "view", 4)) {
        rt_view_bad(r, "not a two-part [\"view\", frame] message");
        return;
    }
    km_msg m;
    km_errbuf err = {{0}};
    if (km_msg_decode(zm->part[1].data, zm->part[1].len, &r->lim, &m, &err)) {
        rt_view_bad(r, err.msg);
        return;
    }
    if (m.type != KM_MSG_VIEW) {
        char why[64];
        snprintf(why, sizeof why, "a '%s' frame on the view topic", km_msg_type_name(m.type));
        rt_view_bad(r, why);
    } else {
        apply_view(r, &m.view);
    }
    km_msg_clear(&m);
}

/* From the tick: a view older than --view-timeout stops counting (the router's own liveness
 * decides alone until the next one). */
void rt_view_check_age(rt_router *r, uint64_t now)
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
        rt_pump_queue(r); /* workers the view held back may take the queue now */
    }
}
