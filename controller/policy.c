/*
 * policy.c — the controller's recovery policy: one state machine per member, fed decoded
 * heartbeats and a caller's clock, answering with the action to send (controller.h).
 *
 * Built as a pure function of (heartbeats, now_ms) so that every threshold, cooldown and timer
 * is unit-tested with a fake clock and so that a restarted controller, fed the same heartbeats,
 * reaches the same member states. The members live in one array sized at create (a cluster has
 * at most KM_PROTO_MAX_VIEW_WORKERS); looking a worker up is a linear scan, cheap at that size
 * and at one heartbeat per worker per second.
 *
 * Per member:
 *   level 0 --pressure >= high-------------------------------> level 1 (evict)
 *   level 1 --pressure >= high, cooldown since level 1-------> level 2 (fp8)
 *   level 0 --pressure >= high, level 1 fired l1_repeat times in l1_window--> level 2
 *   level 1 --pressure <= low--------------------------------> level 0 (quietly: nothing to undo)
 *   level 2 --pressure <= low for revert_after---------------> level 0 (set_kv_format f16)
 *   level 2 --pressure >= high, cooldown since level 2-------> level 3 (drain)
 *   any     --stall / error storm / RSS or GPU >= their max--> level 3 (drain)
 *   level 3: member "restarting" until a new process (uptime or seq went back) says ready.
 * The member state otherwise follows the heartbeat (starting/ready/draining), "left" at once when
 * the last heartbeat of a worker stopped on purpose says "stopping" (SIGTERM, scale-in), "dead"
 * after dead_after silent intervals, and back to the heartbeat's state when beats resume.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "controller/controller.h"

#define CTL_MAX_L1_FIRES 64 /* l1_repeat is clamped to this */

typedef struct ctl_hist {
    uint64_t at_ms; /* policy clock */
    uint64_t id;    /* action id; 0 for entries that are not commands (re-admission) */
    uint32_t level;
    const char *reason;
    bool ok;
} ctl_hist;

typedef struct ctl_member {
    char id[KM_PROTO_MAX_NAME + 1];
    char requests[KM_PROTO_MAX_NAME + 1], events[KM_PROTO_MAX_NAME + 1],
        admin[KM_PROTO_MAX_NAME + 1];
    char model[KM_PROTO_MAX_NAME + 1], fingerprint[KM_PROTO_MAX_NAME + 1], kv_format[32];
    char kv_base[32]; /* the format the worker was started with (hb.kv_format_base; f16) */
    km_member_state state;
    uint32_t level;
    /* last heartbeat */
    uint64_t last_seen_ms, seq, uptime_ms;
    km_worker_state hb_state;
    double pressure;
    const char *pressure_why; /* static: what the pressure measures ("kv_pressure", "rss", "gpu") */
    uint64_t rss, gpu;
    uint32_t running, queue_depth;
    double ttft_ms, itl_ms; /* the heartbeat's p90s (roles.c); 0 = not reported */
    /* page transfer (hb.peer_addr, hb.xfer): carried into the view for routers' cost model */
    uint8_t peer_addr[KM_PROTO_MAX_PEER_ADDR];
    uint32_t peer_addr_len;
    double prefill_tps, xfer_rate_bps, xfer_lat_ms;
    km_worker_role role; /* hb.role: carried into the view */
    uint64_t page_bytes, xfer_bytes_in, xfer_bytes_out;
    /* hb.xfer.pairs: .from points into pair_from (ctl_member_pairs_point after a move) */
    km_xfer_pair pairs[KM_PROTO_MAX_XFER_PAIRS];
    char pair_from[KM_PROTO_MAX_XFER_PAIRS][KM_PROTO_MAX_NAME + 1];
    uint32_t n_pairs;
    /* timers */
    uint64_t t_l1, t_l2, t_action; /* when level 1 / 2 / any action last fired; 0 = never */
    uint64_t low_since;            /* pressure <= low since (level 2 revert); 0 = not low */
    uint64_t l1_fires[CTL_MAX_L1_FIRES];
    uint32_t n_l1_fires, l1_head; /* ring of level-1 times */
    uint64_t tokens_total, tokens_changed_ms;
    uint64_t err_base, err_base_ms; /* error-storm baseline */
    bool restart_new_process;       /* restarting, and a new process has been heard from */
    /* the last action, to undo it when it could not be delivered */
    uint64_t undo_id;
    km_member_state undo_state;
    uint32_t undo_level;
    /* history ring, oldest at hist_head */
    ctl_hist hist[KM_PROTO_MAX_HISTORY];
    uint32_t n_hist, hist_head;
} ctl_member;

struct ctl_policy {
    ctl_policy_cfg cfg;
    ctl_member *m;
    int n, cap;
    uint64_t version, next_id;
};

void ctl_policy_cfg_default(ctl_policy_cfg *c)
{
    *c = (ctl_policy_cfg){.pressure_high = 0.90,
                          .pressure_low = 0.70,
                          .cooldown_ms = 5000,
                          .l1_repeat = 3,
                          .l1_window_ms = 60000,
                          .revert_after_ms = 30000,
                          .stall_timeout_ms = 15000,
                          .error_storm = 50,
                          .max_rss = 0,
                          .max_gpu = 0,
                          .heartbeat_ms = 1000,
                          .dead_after = 3,
                          .action_timeout_ms = 30000,
                          .forget_after_ms = 600000,
                          .restart_timeout_ms = 120000,
                          .evict_fraction = 0.25,
                          .recovery = true};
}

int ctl_policy_create(const ctl_policy_cfg *cfg, int max_members, ctl_policy **out)
{
    *out = NULL;
    if (!cfg || max_members < 0) return KM_EINVAL;
    if (!(cfg->pressure_low <= cfg->pressure_high) || cfg->heartbeat_ms <= 0) return KM_EINVAL;
    ctl_policy *p = calloc(1, sizeof *p);
    if (!p) return KM_ENOMEM;
    p->cfg = *cfg;
    if (p->cfg.l1_repeat > CTL_MAX_L1_FIRES) p->cfg.l1_repeat = CTL_MAX_L1_FIRES;
    if (p->cfg.dead_after == 0) p->cfg.dead_after = 1;
    p->cap = max_members ? max_members : KM_PROTO_MAX_VIEW_WORKERS;
    p->m = calloc((size_t)p->cap, sizeof *p->m);
    if (!p->m) {
        free(p);
        return KM_ENOMEM;
    }
    p->next_id = 1;
    *out = p;
    return 0;
}

void ctl_policy_destroy(ctl_policy *p)
{
    if (!p) return;
    free(p->m);
    free(p);
}

uint64_t ctl_policy_version(const ctl_policy *p)
{
    return p->version;
}
int ctl_policy_n_members(const ctl_policy *p)
{
    return p->n;
}

int ctl_policy_find(const ctl_policy *p, const char *worker)
{
    if (!worker) return KM_ENOTFOUND;
    for (int i = 0; i < p->n; i++)
        if (!strcmp(p->m[i].id, worker)) return i;
    return KM_ENOTFOUND;
}

int ctl_policy_count(const ctl_policy *p, km_member_state s)
{
    int n = 0;
    for (int i = 0; i < p->n; i++) n += p->m[i].state == s;
    return n;
}

static void copy_str(char *dst, size_t cap, const char *src)
{
    snprintf(dst, cap, "%s", src ? src : "");
}

double ctl_pressure(const km_msg_heartbeat *hb, uint64_t max_rss, uint64_t max_gpu,
                    const char **why)
{
    uint64_t pinned = 0, budget = 0;
    for (uint32_t i = 0; i < hb->n_kv; i++) {
        if (hb->kv[i].tier != KM_TIER_HOT) continue;
        pinned += hb->kv[i].pinned_bytes;
        budget += hb->kv[i].capacity_bytes;
    }
    double pr = budget ? (double)pinned / (double)budget : 0;
    const char *w = "kv_pressure";
    double rss = max_rss ? (double)hb->rss_bytes / (double)max_rss : 0;
    double gpu = max_gpu ? (double)hb->gpu_bytes / (double)max_gpu : 0;
    if (rss > pr) pr = rss, w = "rss";
    if (gpu > pr) pr = gpu, w = "gpu";
    if (why) *why = w;
    return pr;
}

/* The hot tier's format (what set_kv_format changes), else the first entry's. */
static const char *hb_kv_format(const km_msg_heartbeat *hb)
{
    for (uint32_t i = 0; i < hb->n_kv; i++)
        if (hb->kv[i].tier == KM_TIER_HOT && hb->kv[i].format) return hb->kv[i].format;
    return hb->n_kv && hb->kv[0].format ? hb->kv[0].format : "";
}

/* The heartbeat's latency quantile nearest p90 (roles.c compares it with the targets). */
static void hb_p90(const km_msg_heartbeat *hb, double *ttft_ms, double *itl_ms)
{
    const km_latency_q *best = NULL;
    for (uint32_t i = 0; hb->latency && i < hb->n_latency; i++)
        if (!best || fabs(hb->latency[i].q - 0.9) < fabs(best->q - 0.9)) best = &hb->latency[i];
    *ttft_ms = best ? best->ttft_ms : 0;
    *itl_ms = best ? best->tpot_ms : 0;
}

static km_member_state from_worker_state(km_worker_state s)
{
    switch (s) {
    case KM_STATE_STARTING:
        return KM_MEMBER_STARTING;
    case KM_STATE_READY:
        return KM_MEMBER_READY;
    case KM_STATE_STOPPING: /* its last heartbeat: it stopped on purpose */
        return KM_MEMBER_LEFT;
    default: /* draining: route nothing new to it */
        return KM_MEMBER_DRAINING;
    }
}

/* Points each per-holder figure at its own copy of the holder's id (the member moved, or its
 * figures were just copied). */
static void ctl_member_pairs_point(ctl_member *m)
{
    for (uint32_t k = 0; k < m->n_pairs; k++) m->pairs[k].from = m->pair_from[k];
}

/* The worker's transfer node address and measured rates; a new address (a restarted worker's
 * node) changes the view, rates ride along with the next one. */
static void ctl_member_transfer(ctl_policy *p, ctl_member *m, const km_msg_heartbeat *hb)
{
    uint32_t n = hb->peer_addr && hb->peer_addr_len <= sizeof m->peer_addr ? hb->peer_addr_len : 0;
    if (n != m->peer_addr_len || (n && memcmp(m->peer_addr, hb->peer_addr, n))) {
        if (n) memcpy(m->peer_addr, hb->peer_addr, n);
        m->peer_addr_len = n;
        p->version++;
    }
    m->prefill_tps = hb->prefill_tps;
    if (m->role != hb->role) p->version++; /* a new role changes the view at once */
    m->role = hb->role;
    m->xfer_rate_bps = hb->has_xfer ? hb->xfer.rate_bps : 0;
    m->xfer_lat_ms = hb->has_xfer ? hb->xfer.latency_ms : 0;
    m->page_bytes = hb->has_xfer ? hb->xfer.page_bytes : 0;
    m->xfer_bytes_in = hb->has_xfer ? hb->xfer.bytes_in : 0;
    m->xfer_bytes_out = hb->has_xfer ? hb->xfer.bytes_out : 0;
    m->n_pairs = 0;
    for (uint32_t k = 0; hb->has_xfer && k < hb->xfer.n_pairs && k < KM_PROTO_MAX_XFER_PAIRS; k++) {
        snprintf(m->pair_from[k], sizeof m->pair_from[k], "%s", hb->xfer.pairs[k].from);
        m->pairs[k] = hb->xfer.pairs[k];
        m->n_pairs = k + 1;
    }
    ctl_member_pairs_point(m);
}

static uint64_t errors_total(const km_msg_heartbeat *hb)
{
    uint64_t n = 0;
    for (uint32_t i = 0; i < hb->n_errors; i++) n += hb->errors[i].count;
    return n;
}

static void set_state(ctl_policy *p, ctl_member *m, km_member_state s)
{
    if (m->state == s) return;
    m->state = s;
    p->version++;
}

static void set_level(ctl_policy *p, ctl_member *m, uint32_t level)
{
    if (m->level == level) return;
    m->level = level;
    p->version++;
}

static ctl_hist *hist_push(ctl_policy *p, ctl_member *m, uint64_t now_ms, uint64_t id,
                           uint32_t level, const char *reason, bool ok)
{
    uint32_t slot;
    if (m->n_hist < KM_PROTO_MAX_HISTORY) {
        slot = (m->hist_head + m->n_hist++) % KM_PROTO_MAX_HISTORY;
    } else {
        slot = m->hist_head;
        m->hist_head = (m->hist_head + 1) % KM_PROTO_MAX_HISTORY;
    }
    m->hist[slot] =
        (ctl_hist){.at_ms = now_ms, .id = id, .level = level, .reason = reason, .ok = ok};
    p->version++;
    return &m->hist[slot];
}

static ctl_hist *hist_find(ctl_member *m, uint64_t id)
{
    for (uint32_t k = 0; k < m->n_hist; k++) {
        ctl_hist *h = &m->hist[(m->hist_head + k) % KM_PROTO_MAX_HISTORY];
        if (h->id == id) return h;
    }
    return NULL;
}

static uint32_t l1_fires_within(const ctl_policy *p, const ctl_member *m, uint64_t now_ms)
{
    uint32_t n = 0;
    for (uint32_t k = 0; k < m->n_l1_fires; k++)
        if (now_ms - m->l1_fires[k] < (uint64_t)p->cfg.l1_window_ms) n++;
    return n;
}

/* Has the member an action it has not acknowledged yet, sent less than action_timeout ago? */
static bool action_pending(const ctl_policy *p, const ctl_member *m, uint64_t now_ms)
{
    const ctl_hist *h = m->undo_id ? hist_find((ctl_member *)m, m->undo_id) : NULL;
    return h && !h->ok && p->cfg.action_timeout_ms > 0 &&
           now_ms - m->t_action < (uint64_t)p->cfg.action_timeout_ms;
}

/* Records the decision: history, timers, the member's new level and state, and *act. */
static void fire(ctl_policy *p, ctl_member *m, uint32_t level, const char *reason, uint64_t now_ms,
                 ctl_action *act)
{
    memset(act, 0, sizeof *act);
    /* A worker started with fp8 (or a smaller format) has no level 2 left to take. */
    if (level == 2 && strcmp(m->kv_base, "f16") && strcmp(m->kv_base, "bf16")) level = 3;
    copy_str(act->worker, sizeof act->worker, m->id);
    act->id = p->next_id++;
    act->level = level;
    act->reason = reason;
    act->pressure = m->pressure;
    m->undo_id = act->id;
    m->undo_state = m->state;
    m->undo_level = m->level;
    m->t_action = now_ms;
    m->low_since = 0;
    switch (level) {
    case 0:
        act->cmd = KM_ADMIN_SET_KV_FORMAT;
        act->format = m->kv_base;
        set_level(p, m, 0);
        break;
    case 1:
        act->cmd = KM_ADMIN_EVICT;
        act->fraction = p->cfg.evict_fraction;
        m->t_l1 = now_ms;
        if (p->cfg.l1_repeat) {
            uint32_t cap = p->cfg.l1_repeat;
            if (m->n_l1_fires < cap)
                m->l1_fires[m->n_l1_fires++] = now_ms;
            else {
                m->l1_fires[m->l1_head] = now_ms;
                m->l1_head = (m->l1_head + 1) % cap;
            }
        }
        if (m->level < 1) set_level(p, m, 1);
        break;
    case 2:
        act->cmd = KM_ADMIN_SET_KV_FORMAT;
        act->format = "fp8";
        m->t_l2 = now_ms;
        set_level(p, m, 2);
        break;
    default:
        act->cmd = KM_ADMIN_DRAIN;
        set_level(p, m, 3);
        set_state(p, m, KM_MEMBER_RESTARTING);
        m->restart_new_process = false;
        break;
    }
    hist_push(p, m, now_ms, act->id, level, reason, false);
}

/* The policy proper: what a ready member's latest heartbeat calls for. */
static int decide(ctl_policy *p, ctl_member *m, uint64_t now_ms, ctl_action *act)
{
    const ctl_policy_cfg *c = &p->cfg;
    const char *why3 = NULL;
    if (c->max_rss && m->rss >= c->max_rss)
        why3 = "rss";
    else if (c->max_gpu && m->gpu >= c->max_gpu)
        why3 = "gpu";
    else if (c->stall_timeout_ms > 0 && m->tokens_total && m->running + m->queue_depth > 0 &&
             now_ms - m->tokens_changed_ms >= (uint64_t)c->stall_timeout_ms)
        why3 = "stall";
    if (why3) {
        fire(p, m, 3, why3, now_ms, act);
        return 1;
    }
    double pr = m->pressure;
    const char *why = m->pressure_why ? m->pressure_why : "kv_pressure";
    bool cooled_l1 = !m->t_l1 || now_ms - m->t_l1 >= (uint64_t)c->cooldown_ms;
    bool cooled_l2 = !m->t_l2 || now_ms - m->t_l2 >= (uint64_t)c->cooldown_ms;
    bool cooled_any = !m->t_action || now_ms - m->t_action >= (uint64_t)c->cooldown_ms;
    if (pr >= c->pressure_high) {
        m->low_since = 0;
        switch (m->level) {
        case 0:
            if (c->l1_repeat && l1_fires_within(p, m, now_ms) >= c->l1_repeat) {
                if (!cooled_any) return 0;
                fire(p, m, 2, "l1_repeat", now_ms, act);
                return 1;
            }
            if (!cooled_l1) return 0;
            fire(p, m, 1, why, now_ms, act);
            return 1;
        case 1:
            if (!cooled_l1 || !cooled_any) return 0;
            fire(p, m, 2, why, now_ms, act);
            return 1;
        case 2:
            if (!cooled_l2 || !cooled_any) return 0;
            fire(p, m, 3, why, now_ms, act);
            return 1;
        default:
            return 0;
        }
    }
    if (pr <= c->pressure_low) {
        if (m->level == 1) set_level(p, m, 0); /* eviction needs no undoing */
        if (m->level == 2) {
            if (!m->low_since) m->low_since = now_ms;
            if (now_ms - m->low_since >= (uint64_t)c->revert_after_ms) {
                fire(p, m, 0, "low_pressure", now_ms, act);
                return 1;
            }
        }
        return 0;
    }
    m->low_since = 0; /* between the thresholds: hold, and the revert clock starts over */
    return 0;
}

int ctl_policy_heartbeat(ctl_policy *p, const km_msg_heartbeat *hb, uint64_t now_ms,
                         ctl_action *act)
{
    if (!hb || !hb->worker || !hb->worker[0]) return KM_EINVAL;
    int i = ctl_policy_find(p, hb->worker);
    bool fresh = i < 0;
    if (fresh) {
        if (p->n == p->cap) return KM_ENOSPC;
        i = p->n++;
        memset(&p->m[i], 0, sizeof p->m[i]);
        copy_str(p->m[i].id, sizeof p->m[i].id, hb->worker);
        p->m[i].state = from_worker_state(hb->state);
        p->version++;
    }
    ctl_member *m = &p->m[i];
    /* A new process: its uptime or sequence went back. */
    bool new_process = fresh || hb->uptime_ms < m->uptime_ms || hb->seq < m->seq;
    m->last_seen_ms = now_ms;
    m->seq = hb->seq;
    m->uptime_ms = hb->uptime_ms;
    m->hb_state = hb->state;
    m->rss = hb->rss_bytes;
    m->gpu = hb->gpu_bytes;
    m->running = hb->running;
    m->queue_depth = hb->queue_depth;
    hb_p90(hb, &m->ttft_ms, &m->itl_ms);
    m->pressure = ctl_pressure(hb, p->cfg.max_rss, p->cfg.max_gpu, &m->pressure_why);
    for (uint32_t k = 0; k < hb->n_endpoints; k++) {
        const km_endpoint *e = &hb->endpoints[k];
        if (!e->name || !e->url) continue;
        char *dst = !strcmp(e->name, "requests") ? m->requests
                    : !strcmp(e->name, "events") ? m->events
                    : !strcmp(e->name, "admin")  ? m->admin
                                                 : NULL;
        if (dst && strcmp(dst, e->url)) {
            copy_str(dst, sizeof m->requests, e->url);
            p->version++;
        }
    }
    ctl_member_transfer(p, m, hb);
    copy_str(m->model, sizeof m->model, hb->model);
    copy_str(m->fingerprint, sizeof m->fingerprint, hb->fingerprint);
    const char *fmt = hb_kv_format(hb);
    if (strcmp(m->kv_format, fmt)) {
        copy_str(m->kv_format, sizeof m->kv_format, fmt);
        p->version++;
    }
    copy_str(m->kv_base, sizeof m->kv_base, hb->kv_format_base ? hb->kv_format_base : "f16");
    /* level 2 is in effect when the KV runs in a format other than the one it was started with */
    bool fp8 = fmt[0] && strcmp(fmt, m->kv_base);
    uint64_t errs = errors_total(hb);
    if (new_process) {
        m->tokens_total = hb->tokens_total;
        m->tokens_changed_ms = now_ms;
        m->err_base = errs;
        m->err_base_ms = now_ms;
    }

    if (m->state == KM_MEMBER_RESTARTING) {
        if (new_process) m->restart_new_process = true;
        if (!m->restart_new_process || hb->state != KM_STATE_READY) return 0;
        /* the new process is ready: re-admitted, at the level its KV format says */
        set_state(p, m, KM_MEMBER_READY);
        set_level(p, m, fp8 ? 2 : 0);
        m->t_l2 = fp8 ? now_ms : 0;
        m->t_l1 = 0;
        m->n_l1_fires = m->l1_head = 0;
        hist_push(p, m, now_ms, 0, 0, "restarted", true);
        return 0;
    }
    set_state(p, m, from_worker_state(hb->state));
    if (new_process && !fresh) /* restarted behind our back: nothing of the old level is left */
        set_level(p, m, fp8 ? 2 : 0);

    /* Rebuild from what the heartbeat shows: fp8 KV means level 2 is in effect. A heartbeat
     * that left before our set_kv_format arrived may still say f16, hence the grace. */
    if (fp8 && m->level < 2) {
        set_level(p, m, 2);
        m->t_l2 = now_ms;
    } else if (!fp8 && m->level == 2 &&
               (!m->t_action || now_ms - m->t_action >= 2 * (uint64_t)p->cfg.heartbeat_ms)) {
        set_level(p, m, 0);
    } else if (m->level == 3) {
        set_level(p, m, fp8 ? 2 : 0); /* a member back from dead without restarting */
    }

    /* stall and error-storm tracking */
    if (hb->tokens_total != m->tokens_total || hb->running + hb->queue_depth == 0) {
        m->tokens_total = hb->tokens_total;
        m->tokens_changed_ms = now_ms;
    }
    bool storm = false;
    if (errs < m->err_base) { /* counters went back without a new process: rebase */
        m->err_base = errs;
        m->err_base_ms = now_ms;
    } else if (now_ms - m->err_base_ms >= 1000) {
        double rate = (double)(errs - m->err_base) * 1000.0 / (double)(now_ms - m->err_base_ms);
        storm = p->cfg.error_storm > 0 && rate > p->cfg.error_storm;
        m->err_base = errs;
        m->err_base_ms = now_ms;
    }

    if (!p->cfg.recovery || m->state != KM_MEMBER_READY) return 0;
    if (storm) {
        fire(p, m, 3, "errors", now_ms, act);
        return 1;
    }
    return decide(p, m, now_ms, act);
}

int ctl_policy_force(ctl_policy *p, const char *worker, uint32_t level, uint64_t now_ms,
                     ctl_action *act)
{
    if (level < 1 || level > 3) return KM_EINVAL;
    int i = ctl_policy_find(p, worker);
    if (i < 0) return KM_ENOTFOUND;
    fire(p, &p->m[i], level, "operator", now_ms, act); /* level 1 keeps fp8 in effect */
    return 0;
}

static void undo(ctl_policy *p, ctl_member *m)
{
    set_level(p, m, m->undo_level);
    set_state(p, m, m->undo_state);
    m->undo_id = 0;
}

int ctl_policy_ack(ctl_policy *p, const char *worker, uint64_t id, bool ok)
{
    int i = ctl_policy_find(p, worker);
    if (i < 0 || !id) return KM_ENOTFOUND;
    ctl_member *m = &p->m[i];
    ctl_hist *h = hist_find(m, id);
    if (!h) return KM_ENOTFOUND;
    if (ok) {
        if (!h->ok) {
            h->ok = true;
            p->version++;
        }
    } else if (m->undo_id == id) {
        undo(p, m);
    }
    return 0;
}

void ctl_policy_send_failed(ctl_policy *p, const ctl_action *act)
{
    int i = ctl_policy_find(p, act->worker);
    if (i < 0) return;
    ctl_member *m = &p->m[i];
    if (m->undo_id == act->id) undo(p, m);
}

int ctl_policy_tick(ctl_policy *p, uint64_t now_ms)
{
    uint64_t limit = (uint64_t)p->cfg.dead_after * (uint64_t)p->cfg.heartbeat_ms;
    int changed = 0;
    for (int i = 0; i < p->n; i++) {
        ctl_member *m = &p->m[i];
        /* Forgotten: a member table that only grows fills up (and routers' slots with it) as
         * workers come and go under new ids. Nothing is lost: a heartbeat re-adds it. */
        bool gone = m->state == KM_MEMBER_DEAD || m->state == KM_MEMBER_LEFT;
        if (gone && p->cfg.forget_after_ms > 0 &&
            now_ms - m->last_seen_ms >= (uint64_t)p->cfg.forget_after_ms) {
            memmove(m, m + 1, sizeof *m * (size_t)(p->n - i - 1));
            p->n--;
            for (int k = i; k < p->n; k++) ctl_member_pairs_point(&p->m[k]);
            i--;
            p->version++;
            changed++;
            continue;
        }
        if (gone) continue; /* a member that left sends nothing more: it is not dead */
        /* Restarting is expected to be silent while the process comes back, but not forever: a
         * process with no supervisor (or one that cannot start) is dead after restart_timeout. */
        if (m->state == KM_MEMBER_RESTARTING) {
            if (p->cfg.restart_timeout_ms > 0 &&
                now_ms - m->last_seen_ms >= (uint64_t)p->cfg.restart_timeout_ms) {
                set_state(p, m, KM_MEMBER_DEAD);
                changed++;
            }
            continue;
        }
        uint64_t lim = limit;
        /* The worker runs admin commands in its loop: a conversion of a large cache is silent
         * while it lasts. Until the command is acknowledged, give it action_timeout. */
        if (action_pending(p, m, now_ms))
            lim = limit > (uint64_t)p->cfg.action_timeout_ms ? limit
                                                             : (uint64_t)p->cfg.action_timeout_ms;
        if (now_ms - m->last_seen_ms >= lim) {
            set_state(p, m, KM_MEMBER_DEAD);
            changed++;
        }
    }
    return changed;
}

int ctl_policy_view_worker(const ctl_policy *p, int i, uint64_t now_ms, uint64_t wall_now_ms,
                           bool with_history, km_view_worker *out,
                           km_recovery_action hist[KM_PROTO_MAX_HISTORY])
{
    if (i < 0 || i >= p->n) return KM_ENOTFOUND;
    const ctl_member *m = &p->m[i];
    memset(out, 0, sizeof *out);
    out->id = m->id;
    out->state = m->state;
    out->level = m->level;
    out->requests = m->requests[0] ? m->requests : NULL;
    out->events = m->events[0] ? m->events : NULL;
    out->admin = m->admin[0] ? m->admin : NULL;
    out->model = m->model[0] ? m->model : NULL;
    out->fingerprint = m->fingerprint[0] ? m->fingerprint : NULL;
    out->kv_format = m->kv_format[0] ? m->kv_format : NULL;
    out->pressure = isfinite(m->pressure) && m->pressure > 0 ? m->pressure : 0;
    out->last_seen_ms = now_ms >= m->last_seen_ms ? now_ms - m->last_seen_ms : 0;
    out->running = m->running;
    out->queue_depth = m->queue_depth;
    out->peer_addr = m->peer_addr_len ? m->peer_addr : NULL;
    out->peer_addr_len = m->peer_addr_len;
    out->prefill_tps = m->prefill_tps;
    out->role = m->role;
    out->xfer_rate_bps = m->xfer_rate_bps;
    out->xfer_lat_ms = m->xfer_lat_ms;
    out->page_bytes = m->page_bytes;
    out->xfer_bytes_in = m->xfer_bytes_in;
    out->xfer_bytes_out = m->xfer_bytes_out;
    out->xfer_pairs = m->n_pairs ? m->pairs : NULL;
    out->n_xfer_pairs = m->n_pairs;
    if (with_history && hist) {
        for (uint32_t k = 0; k < m->n_hist; k++) {
            const ctl_hist *h = &m->hist[(m->hist_head + k) % KM_PROTO_MAX_HISTORY];
            uint64_t age = now_ms >= h->at_ms ? now_ms - h->at_ms : 0;
            hist[k] = (km_recovery_action){.at_ms = wall_now_ms >= age ? wall_now_ms - age : 0,
                                           .level = h->level,
                                           .reason = h->reason,
                                           .ok = h->ok};
        }
        out->history = hist;
        out->n_history = m->n_hist;
    }
    return 0;
}

int ctl_policy_role_load(const ctl_policy *p, int i, ctl_role_load *out)
{
    if (i < 0 || i >= p->n) return KM_ENOTFOUND;
    const ctl_member *m = &p->m[i];
    *out = (ctl_role_load){.worker = m->id,
                           .ready = m->state == KM_MEMBER_READY,
                           .role = m->role,
                           .running = m->running,
                           .queue_depth = m->queue_depth,
                           .ttft_ms = m->ttft_ms,
                           .itl_ms = m->itl_ms};
    return 0;
}
