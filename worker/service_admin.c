/*
 * service_admin.c — the worker's admin commands (service_internal.h; docs/protocol.md section
 * 9): status (with the KV event replay a router asks for after a gap), evict, set_kv_format,
 * drain, shutdown, and the chaos-only pressure. The controller's recovery levels are these
 * commands: 1 evict, 2 set_kv_format to a smaller format (f16 again is its revert, level 0),
 * 3 drain; each is counted by level and logged as one event=recovery line.
 *
 * Every command gets exactly one `admin_reply`, carrying the worker's state, KV format, load and
 * KV totals whatever the command was; a command naming another worker changes nothing here.
 */
#include <stdio.h>
#include <string.h>

#include "worker/service_internal.h"
#include "worker/service_peer_internal.h"

/* ---------------------------------------------------------------- KV store facts */

static void wk_kv_totals(wk_service *s, uint64_t *pages, uint64_t *bytes)
{
    kv_store_stats st;
    kv_store_stats_get(s->kv, &st);
    *pages = *bytes = 0;
    for (int t = 0; t < KV_TIER_COUNT; t++) {
        *pages += st.tier[t].pages;
        *bytes += st.tier[t].bytes;
    }
}

/* Hot-tier bytes held by live sequences over the hot budget, all shards: pressure as the
 * controller computes it from heartbeats (logged with every recovery action). */
static double wk_hot_pressure(wk_service *s)
{
    kv_store_stats st;
    kv_store_stats_get(s->kv, &st);
    const kv_tier_stats *h = &st.tier[KV_TIER_HOT];
    return h->budget ? (double)h->pinned_bytes / (double)h->budget : 0.0;
}

/* One recovery action carried out: counted by level and logged as one event=recovery line. */
static void wk_recovery_log(wk_service *s, int level, const char *action, bool ok,
                            const char *detail)
{
    if (level >= 0 && level <= 3) km_counter_inc(s->s_rec_level[level]);
    KM_INFO("recovery", "level=%d action=%s worker=%s ok=%d pressure=%.3f %s", level, action,
            s->worker_id, (int)ok, wk_hot_pressure(s), detail ? detail : "");
}

/* Pages peers have read from this worker's transfer node so far. */
static uint64_t wk_pages_out(wk_service *s)
{
    if (!s->peer) return 0;
    pr_stats st;
    pr_node_stats(s->peer->node, &st);
    return st.pages_out;
}

int wk_svc_drain_loss(wk_service *s)
{
    kv_store_stats st;
    kv_store_stats_get(s->kv, &st);
    if (st.tier[KV_TIER_DISK].budget || (s->peer && s->o.peer_view)) return 0;
    return (int)(st.tier[KV_TIER_HOT].pages + st.tier[KV_TIER_HOST].pages);
}

int wk_svc_drain_dropped(wk_service *s, int ram, int persisted)
{
    /* a page two peers read counts twice: with peers this is a floor, without it is exact */
    int64_t kept = persisted >= 0 ? persisted : (int64_t)(wk_pages_out(s) - s->drain_pages_out);
    return ram > kept ? (int)(ram - kept) : 0;
}

void wk_svc_start_drain(wk_service *s, int64_t timeout_ms, const char *why)
{
    if (wk_svc_state(s) != KM_STATE_READY) return;
    s->drain_pages_out = wk_pages_out(s);
    if (timeout_ms <= 0) timeout_ms = s->o.drain_timeout_ms;
    s->drain_deadline_ns = km_now_ns() + wk_ms_ns(timeout_ms);
    wk_svc_set_state(s, KM_STATE_DRAINING);
    wk_svc_ballast_release(s); /* in-flight requests get its pages; the next process starts clean */
    km_counter_inc(s->s_rec_drain);
    KM_INFO("drain_start", "worker=%s reason=%s timeout_ms=%lld inflight=%d", s->worker_id, why,
            (long long)timeout_ms, en_sched_pending(s->sched));
    int loss = wk_svc_drain_loss(s);
    if (loss)
        KM_WARN("drain_drops_cache",
                "worker=%s pages=%d msg=\"no disk tier (--kv-disk-dir) and no peers (--peer-listen "
                "with --peer-view) to take the cached pages: they die with the process\"",
                s->worker_id, loss);
}

/* ---------------------------------------------------------------- chaos: ballast */

void wk_svc_ballast_release(wk_service *s)
{
    if (!s->ballast) return;
    kv_seq_destroy(s->kv, s->ballast);
    s->ballast = NULL;
    s->ballast_pages = 0;
    km_gauge_set(s->s_ballast, 0);
}

/* chaos `pressure`: pins round(fraction x hot budget / page bytes) real pages in a ballast
 * sequence, replacing the previous one (0 only releases it). Pages come from the pool like any
 * sequence's: room is made from cached pages only, never from running sequences, and when the
 * pool runs out the ballast keeps what it got. Returns the pages pinned; msg says what. */
static int wk_ballast_set(wk_service *s, double fraction, char *msg, size_t cap)
{
    wk_svc_ballast_release(s);
    kv_store_stats st;
    kv_store_stats_get(s->kv, &st);
    const size_t pb = wk_svc_ballast_page_bytes(s);
    const int pt = kv_store_page_tokens(s->kv);
    double want_d = fraction * (double)st.tier[KV_TIER_HOT].budget / (double)pb + 0.5;
    int want = want_d > (double)(INT32_MAX / pt) ? INT32_MAX / pt : (int)want_d;
    int got = 0, rc = 0;
    if (want > 0 && !(rc = kv_seq_create(s->kv, &s->ballast)))
        while (got < want && !(rc = kv_seq_reserve(s->kv, s->ballast, (got + 1) * pt))) got++;
    s->ballast_pages = got;
    if (s->ballast && !got) wk_svc_ballast_release(s);
    km_gauge_set(s->s_ballast, (double)wk_svc_ballast_bytes(s));
    if (!want)
        snprintf(msg, cap, "ballast released");
    else if (got < want)
        snprintf(msg, cap, "pinned %d of %d ballast pages (%zu bytes): %s", got, want,
                 wk_svc_ballast_bytes(s),
                 rc == KM_ENOSPC ? "the KV pool has no more room" : km_strerror(rc));
    else
        snprintf(msg, cap, "pinned %d ballast pages (%zu bytes)", got, wk_svc_ballast_bytes(s));
    KM_INFO("chaos_pressure", "worker=%s fraction=%.3f wanted=%d pinned=%d bytes=%zu pressure=%.3f",
            s->worker_id, fraction, want, got, wk_svc_ballast_bytes(s), wk_hot_pressure(s));
    return got;
}

/* ---------------------------------------------------------------- commands */

/* Each command fills rp (ok, code, results) and msg (the reply's message; empty: none). */
typedef struct admin_ctx {
    wk_service *s;
    const km_msg_admin *a;
    km_msg_admin_reply *rp;
    char msg[KM_PROTO_MAX_MESSAGE];
} admin_ctx;

static void admin_fail(admin_ctx *c, int code, const char *msg)
{
    c->rp->ok = false;
    c->rp->code = code;
    snprintf(c->msg, sizeof c->msg, "%s", msg);
}

/* status: the reply itself; with events_since or events_snapshot, a KV event replay (or a
 * snapshot) first, on the same connection (docs/protocol.md section 9). */
static void admin_status(admin_ctx *c, void *sock, const km_zframe *env, int n_env)
{
    wk_service *s = c->s;
    const km_msg_admin *a = c->a;
    if (!a->has_events_since && !a->events_snapshot) return;
    wk_events_pump(s->ev);
    bool was_snap = false;
    int frames =
        wk_events_replay(s->ev, sock, env, n_env, a->events_since, a->events_snapshot, &was_snap);
    snprintf(c->msg, sizeof c->msg, "%s: %d kv frames sent", was_snap ? "snapshot" : "replay",
             frames);
    c->rp->has_events_next = true;
    c->rp->events_next = wk_events_next_seq(s->ev);
    c->rp->events_snapshot = was_snap;
}

/* evict (recovery level 1): the oldest fraction of unpinned pages leave the hot tier. */
static void admin_evict(admin_ctx *c)
{
    wk_service *s = c->s;
    kv_store_stats st0, st1;
    kv_store_stats_get(s->kv, &st0);
    int n = kv_store_evict_oldest_fraction(s->kv, c->a->fraction);
    kv_store_stats_get(s->kv, &st1);
    c->rp->evicted_pages = n > 0 ? (uint64_t)n : 0;
    c->rp->freed_bytes = st0.tier[KV_TIER_HOT].bytes > st1.tier[KV_TIER_HOT].bytes
                             ? st0.tier[KV_TIER_HOT].bytes - st1.tier[KV_TIER_HOT].bytes
                             : 0;
    km_counter_inc(s->s_rec_evict);
    char d[128];
    snprintf(d, sizeof d, "fraction=%.3f pages=%d freed_bytes=%llu", c->a->fraction, n,
             (unsigned long long)c->rp->freed_bytes);
    wk_recovery_log(s, 1, "evict", n >= 0, d);
}

/* set_kv_format: every page converted in place; a smaller format is recovery level 2, f16 again
 * its revert (level 0). */
static void admin_set_kv_format(admin_ctx *c)
{
    wk_service *s = c->s;
    const char *format = c->a->format;
    kv_format f;
    if (kv_format_parse(format, &f)) {
        snprintf(c->msg, sizeof c->msg, "admin.format: unknown KV format '%.64s'", format);
        c->rp->ok = false;
        c->rp->code = KM_CODE_BAD_REQUEST;
        return;
    }
    kv_format before = wk_svc_kv_format(s);
    int n = kv_store_convert(s->kv, f);
    km_gauge_set(s->s_ballast, (double)wk_svc_ballast_bytes(s));
    if (n < 0) {
        c->rp->ok = false;
        c->rp->code = km_proto_code_from_err(n);
        snprintf(c->msg, sizeof c->msg, "conversion to %s stopped: %s", format, km_strerror(n));
    } else {
        c->rp->converted_pages = (uint64_t)n;
    }
    km_counter_inc(s->s_rec_format);
    int level =
        f == KN_KV_F16                                                                        ? 0
        : kv_store_format_page_bytes(s->kv, f) < kv_store_format_page_bytes(s->kv, KN_KV_F16) ? 2
                                                                                              : -1;
    char d[128];
    snprintf(d, sizeof d, "from=%s format=%s converted=%d", kv_format_name(before), format, n);
    if (level >= 0)
        wk_recovery_log(s, level, "set_kv_format", n >= 0, d);
    else
        KM_INFO("set_kv_format", "worker=%s %s", s->worker_id, d);
}

/* What a drain says to a worker that is not ready, after the step or during it. */
static const char *drain_not_ready(km_worker_state st, char *msg, size_t cap)
{
    snprintf(msg, cap, "already %s", km_worker_state_name(st));
    return msg;
}

/* drain (recovery level 3) */
static void admin_drain(admin_ctx *c)
{
    wk_service *s = c->s;
    if (wk_svc_state(s) != KM_STATE_READY) {
        drain_not_ready(wk_svc_state(s), c->msg, sizeof c->msg);
        return;
    }
    char d[96];
    snprintf(d, sizeof d, "timeout_ms=%u inflight=%d", c->a->timeout_ms,
             en_sched_pending(s->sched));
    wk_recovery_log(s, 3, "drain", true, d);
    wk_svc_start_drain(s, c->a->timeout_ms, "admin");
    int loss = wk_svc_drain_loss(s); /* after start: the chaos ballast is released by then */
    if (loss)
        snprintf(c->msg, sizeof c->msg,
                 "draining: %d cached pages will be dropped (no disk tier and no peers to take "
                 "them)",
                 loss);
}

static void admin_shutdown(admin_ctx *c)
{
    wk_service *s = c->s;
    km_counter_inc(s->s_rec_shutdown);
    s->stop_now = true;
    s->exit_code = c->a->restart ? WK_EXIT_RESTART : 0;
    wk_svc_set_state(s, KM_STATE_STOPPING);
    KM_INFO("shutdown", "worker=%s restart=%d", s->worker_id, (int)c->a->restart);
}

/* pressure (chaos tests only): ballast pages pinned in the hot tier */
static void admin_pressure(admin_ctx *c)
{
    wk_service *s = c->s;
    if (!s->o.chaos) return admin_fail(c, KM_CODE_BAD_REQUEST, "pressure needs --chaos");
    if (wk_svc_state(s) != KM_STATE_READY) {
        char m[64];
        snprintf(m, sizeof m, "worker %s: no ballast now", km_worker_state_name(wk_svc_state(s)));
        return admin_fail(c, KM_CODE_UNAVAILABLE, m);
    }
    wk_ballast_set(s, c->a->fraction, c->msg, sizeof c->msg);
}

void wk_svc_quick_take(wk_service *s, wk_quick *q)
{
    en_sched_stats st;
    en_sched_stats_get(s->sched, &st);
    q->format = wk_svc_kv_format(s);
    q->running = (uint32_t)st.running;
    q->queued = (uint32_t)st.queued;
    wk_kv_totals(s, &q->kv_pages, &q->kv_bytes);
    q->drain_loss = wk_svc_drain_loss(s);
}

/* The reply's figures, from the store and scheduler (q NULL) or as taken before a step. */
static void admin_reply_figures(wk_service *s, km_msg_admin_reply *rp, const wk_quick *q)
{
    wk_quick now = {.state_after = -1};
    if (!q) {
        wk_svc_quick_take(s, &now);
        q = &now;
    }
    rp->state = q->state_after >= 0 ? (km_worker_state)q->state_after : wk_svc_state(s);
    rp->kv_format = kv_format_name(q->format);
    rp->role = s->o.role;
    rp->inflight = q->running;
    rp->queued = q->queued;
    rp->kv_pages = q->kv_pages;
    rp->kv_bytes = q->kv_bytes;
}

/* set_role: what the worker's heartbeats say it computes from now on (docs/disaggregation.md).
 * Only the routers act on a role, so requests running here finish here, and those a router sends
 * follow the new role once the controller's view carries it. */
static void admin_set_role(admin_ctx *c)
{
    wk_service *s = c->s;
    km_worker_role role, was = s->o.role;
    if (km_worker_role_parse(c->a->role, &role)) {
        admin_fail(c, KM_CODE_BAD_REQUEST, "role is both, prefill or decode");
        return;
    }
    s->o.role = role;
    wk_svc_snapshot(s); /* the next heartbeat says so */
    KM_INFO("role_changed", "worker=%s from=%s to=%s", s->worker_id, km_worker_role_name(was),
            km_worker_role_name(role));
    snprintf(c->msg, sizeof c->msg, "role %s (was %s)", km_worker_role_name(role),
             km_worker_role_name(was));
}

/* drain or shutdown during a step: what it will do, said now (wk_svc_admin_quick). */
static const char *admin_accept(wk_service *s, wk_quick *q, const km_msg_admin *a, char *msg,
                                size_t cap)
{
    km_worker_state now = q->state_after >= 0 ? (km_worker_state)q->state_after : wk_svc_state(s);
    if (a->cmd == KM_ADMIN_SHUTDOWN) {
        q->state_after = KM_STATE_STOPPING;
        return "shutdown accepted during an engine step: the worker stops when the step ends";
    }
    if (now != KM_STATE_READY) return drain_not_ready(now, msg, cap); /* as admin_drain */
    q->state_after = KM_STATE_DRAINING;
    int n = snprintf(msg, cap,
                     "drain accepted during an engine step: it starts when the step ends, after "
                     "the frames that came before it");
    if (q->drain_loss && n > 0 && (size_t)n < cap)
        snprintf(msg + n, cap - (size_t)n,
                 "; %d cached pages will be dropped (no disk tier and no peers to take them)",
                 q->drain_loss);
    return msg;
}

bool wk_svc_admin_quick(wk_service *s, wk_quick *q, const km_msg_admin *a, km_buf *out)
{
    bool status = a->cmd == KM_ADMIN_STATUS && !a->has_events_since && !a->events_snapshot;
    if (!status && a->cmd != KM_ADMIN_DRAIN && a->cmd != KM_ADMIN_SHUTDOWN) return false;
    if (a->worker && a->worker[0] && strcmp(a->worker, s->worker_id)) return false;
    km_msg m;
    km_msg_init(&m, KM_MSG_ADMIN_REPLY);
    km_msg_admin_reply *rp = &m.admin_reply;
    rp->id = a->id;
    rp->cmd = a->cmd;
    rp->ok = true;
    char msg[KM_PROTO_MAX_MESSAGE];
    int before = q->state_after;
    rp->message =
        status ? "answered during an engine step" : admin_accept(s, q, a, msg, sizeof msg);
    admin_reply_figures(s, rp, q);
    if (!km_msg_encode(&m, &s->lim, out, NULL)) return true;
    q->state_after = before; /* not answered: the loop carries it out as any command */
    return false;
}

void wk_svc_handle_admin(wk_service *s, void *sock, const km_zframe *env, int n_env,
                         const km_msg_admin *a)
{
    km_msg m;
    km_msg_init(&m, KM_MSG_ADMIN_REPLY);
    admin_ctx c = {.s = s, .a = a, .rp = &m.admin_reply};
    c.rp->id = a->id;
    c.rp->cmd = a->cmd;
    c.rp->ok = true;
    /* `worker` names the target: a frame meant for another worker changes nothing here. */
    if (a->worker && a->worker[0] && strcmp(a->worker, s->worker_id)) {
        admin_fail(&c, KM_CODE_NOT_FOUND, "not this worker");
    } else {
        switch (a->cmd) {
        case KM_ADMIN_STATUS:
            admin_status(&c, sock, env, n_env);
            break;
        case KM_ADMIN_EVICT:
            admin_evict(&c);
            break;
        case KM_ADMIN_SET_KV_FORMAT:
            admin_set_kv_format(&c);
            break;
        case KM_ADMIN_DRAIN:
            admin_drain(&c);
            break;
        case KM_ADMIN_SHUTDOWN:
            admin_shutdown(&c);
            break;
        case KM_ADMIN_PRESSURE:
            admin_pressure(&c);
            break;
        case KM_ADMIN_SET_ROLE:
            admin_set_role(&c);
            break;
        default:
            admin_fail(&c, KM_CODE_BAD_REQUEST, "unknown admin command");
        }
    }
    admin_reply_figures(s, c.rp, NULL);
    if (c.msg[0]) c.rp->message = c.msg;
    if (s->reply_sent) return; /* answered during the step it waited for (wk_svc_admin_quick) */
    if (km_msg_encode(&m, &s->lim, &s->out, NULL)) return;
    /* to the controller: the heartbeats that follow the reply must already show what the command
     * changed (the pulse may forward it and beat before the loop's next snapshot) */
    if (sock == s->ctl_loop) wk_svc_snapshot(s);
    wk_svc_send(s, sock, env, n_env, &s->out);
}
