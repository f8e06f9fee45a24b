/*
 * roles.c — roles follow the load (controller.h, docs/disaggregation.md "Roles follow the
 * load"): which worker moves between the prefill and the decode pool, and when.
 *
 * Built like the recovery policy: a pure function of the members' loads and a caller's clock,
 * so that every window and hold is unit-tested with a fake clock
 * (tests/unit/test_controller_roles.c) and the daemon only sends what it decides. The controller,
 * not a router, decides: it alone sees every worker's heartbeat (routers are replicas that each see
 * only their own traffic, and two of them deciding alone would move two workers for one burst), and
 * it already changes workers (recovery) with acknowledgements, logs and counters.
 *
 * Per step, over ready members with role prefill or decode:
 *   prefill load = (running + queued) per prefill worker (everything there is a prompt);
 *   decode load  = queued per decode worker (running streams are its normal work);
 *   a pool misses when its load is above queue_target, or when a busy member's p90 (TTFT for
 *   prefill, time per output token for decode) is above its target;
 *   a pool has room when it does not miss and its load spread over one worker fewer would still
 *   be within queue_target, and it has two workers or more (never its last one).
 * Moves, at most one in flight:
 *   prefill missed for window, decode has room -> a decode worker becomes prefill;
 *   decode missed for window, prefill has room -> a prefill worker becomes decode;
 *   neither missed for window -> a worker lent to the other pool goes back ("calm").
 * The worker picked has held its role for hold_ms, is preferably one lent from the pool it goes
 * to, then the least loaded. A worker's own ("home") role is the one the controller first saw,
 * or one an operator set; after a move the windows start over.
 */
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "controller/controller.h"

enum { CTL_POOL_PREFILL, CTL_POOL_DECODE, CTL_POOLS };

/* Role change ids are in their own range, far above the policy's action ids (which count up
 * from 1), so that a worker's admin_reply finds its owner by id alone. */
#define CTL_ROLE_ID_BASE (1ull << 62)

typedef struct ctl_role_entry {
    char id[KM_PROTO_MAX_NAME + 1];
    km_worker_role home, role; /* its own role; the one its heartbeats show */
    uint64_t since_ms;         /* when it took role (or was first seen) */
    uint64_t pending_id;       /* a set_role sent and not yet shown; 0 = none */
    km_worker_role pending_to;
    uint64_t pending_at_ms;
    bool seen;
} ctl_role_entry;

struct ctl_roles {
    ctl_roles_cfg cfg;
    ctl_role_entry *e;
    int n, cap;
    uint64_t miss_since[CTL_POOLS], calm_since; /* 0 = not now */
    uint64_t next_id;
};

/* The figures of one pool at one step. */
typedef struct ctl_pool {
    int n;
    uint64_t requests; /* as queue_target counts them */
    double latency;    /* worst busy p90 (TTFT or time per output token), ms */
    const char *miss;  /* static reason, NULL when the pool meets its targets */
} ctl_pool;

void ctl_roles_cfg_default(ctl_roles_cfg *c)
{
    *c = (ctl_roles_cfg){.on = true,
                         .ttft_target_ms = 10000,
                         .itl_target_ms = 250,
                         .queue_target = 4,
                         .window_ms = 30000,
                         .hold_ms = 120000,
                         .change_timeout_ms = 10000};
}

int ctl_roles_create(const ctl_roles_cfg *cfg, ctl_roles **out)
{
    *out = NULL;
    if (!cfg || cfg->queue_target < 0 || cfg->window_ms < 0 || cfg->hold_ms < 0) return KM_EINVAL;
    ctl_roles *r = calloc(1, sizeof *r);
    if (!r) return KM_ENOMEM;
    r->cfg = *cfg;
    r->cap = KM_PROTO_MAX_VIEW_WORKERS;
    r->e = calloc((size_t)r->cap, sizeof *r->e);
    if (!r->e) {
        free(r);
        return KM_ENOMEM;
    }
    r->next_id = CTL_ROLE_ID_BASE;
    *out = r;
    return 0;
}

void ctl_roles_destroy(ctl_roles *r)
{
    if (!r) return;
    free(r->e);
    free(r);
}

static ctl_role_entry *entry_of(ctl_roles *r, const char *worker)
{
    for (int i = 0; i < r->n; i++)
        if (!strcmp(r->e[i].id, worker)) return &r->e[i];
    return NULL;
}

/* Follows what the heartbeats show: a new member, a change of ours that landed, or a role
 * someone else set (an operator, a restarted worker), which becomes the member's own. Members
 * gone from the policy are dropped. */
static void roles_track(ctl_roles *r, const ctl_role_load *w, int n, uint64_t now_ms)
{
    for (int i = 0; i < r->n; i++) r->e[i].seen = false;
    for (int k = 0; k < n; k++) {
        if (!w[k].worker) continue;
        ctl_role_entry *e = entry_of(r, w[k].worker);
        if (!e) {
            if (r->n == r->cap) continue;
            e = &r->e[r->n++];
            memset(e, 0, sizeof *e);
            snprintf(e->id, sizeof e->id, "%s", w[k].worker);
            e->home = e->role = w[k].role;
            e->since_ms = now_ms;
        } else if (w[k].role != e->role) {
            if (!(e->pending_id && w[k].role == e->pending_to)) e->home = w[k].role;
            e->role = w[k].role;
            e->since_ms = now_ms;
            e->pending_id = 0;
        } else if (e->pending_id && r->cfg.change_timeout_ms > 0 &&
                   now_ms - e->pending_at_ms >= (uint64_t)r->cfg.change_timeout_ms) {
            e->pending_id = 0; /* never shown: given up, the member is as its heartbeats say */
        }
        e->seen = true;
    }
    for (int i = 0; i < r->n;)
        if (r->e[i].seen)
            i++;
        else
            r->e[i] = r->e[--r->n];
}

static bool roles_pending(const ctl_roles *r)
{
    for (int i = 0; i < r->n; i++)
        if (r->e[i].pending_id) return true;
    return false;
}

static int pool_of(km_worker_role role)
{
    return role == KM_WROLE_PREFILL  ? CTL_POOL_PREFILL
           : role == KM_WROLE_DECODE ? CTL_POOL_DECODE
                                     : -1;
}

static double pool_load(const ctl_pool *p)
{
    return p->n ? (double)p->requests / p->n : 0;
}

/* Can pool p give one worker away and still meet its targets? */
static bool pool_room(const ctl_roles *r, const ctl_pool *p)
{
    return p->n >= 2 && !p->miss && (double)p->requests / (p->n - 1) <= r->cfg.queue_target;
}

static void pools_measure(const ctl_roles *r, const ctl_role_load *w, int n, ctl_pool pool[2])
{
    memset(pool, 0, sizeof *pool * CTL_POOLS);
    for (int k = 0; k < n; k++) {
        int p = w[k].ready ? pool_of(w[k].role) : -1;
        if (p < 0) continue;
        pool[p].n++;
        uint32_t busy = w[k].running + w[k].queue_depth;
        pool[p].requests += p == CTL_POOL_PREFILL ? busy : w[k].queue_depth;
        double lat = p == CTL_POOL_PREFILL ? w[k].ttft_ms : w[k].itl_ms;
        /* an idle member's quantiles are those of requests long gone: not the pool's now */
        if (busy && lat > pool[p].latency) pool[p].latency = lat;
    }
    const int64_t target[CTL_POOLS] = {r->cfg.ttft_target_ms, r->cfg.itl_target_ms};
    static const char *const why[CTL_POOLS][2] = {{"prefill_queue", "prefill_ttft"},
                                                  {"decode_queue", "decode_itl"}};
    for (int p = 0; p < CTL_POOLS; p++) {
        if (pool_load(&pool[p]) > r->cfg.queue_target)
            pool[p].miss = why[p][0];
        else if (target[p] > 0 && pool[p].latency > (double)target[p])
            pool[p].miss = why[p][1];
    }
}

/* The member of pool `from` to move to pool `to`: held its role long enough; one lent by `to`
 * first, then the least loaded. lent_only: only a lent one. -1 when none. */
static int pick(const ctl_roles *r, const ctl_role_load *w, int n, int from, int to, bool lent_only,
                uint64_t now_ms)
{
    const km_worker_role to_role = to == CTL_POOL_PREFILL ? KM_WROLE_PREFILL : KM_WROLE_DECODE;
    int best = -1;
    bool best_lent = false;
    uint32_t best_load = 0;
    for (int k = 0; k < n; k++) {
        if (!w[k].ready || pool_of(w[k].role) != from) continue;
        const ctl_role_entry *e = entry_of((ctl_roles *)r, w[k].worker);
        if (!e || now_ms - e->since_ms < (uint64_t)r->cfg.hold_ms) continue;
        bool lent = e->home == to_role;
        if (lent_only && !lent) continue;
        uint32_t load = w[k].running + w[k].queue_depth;
        if (best < 0 || (lent && !best_lent) || (lent == best_lent && load < best_load)) {
            best = k;
            best_lent = lent;
            best_load = load;
        }
    }
    return best;
}

static void since(uint64_t *t, bool cond, uint64_t now_ms)
{
    if (!cond)
        *t = 0;
    else if (!*t)
        *t = now_ms;
}

static bool lasted(const ctl_roles *r, uint64_t t, uint64_t now_ms)
{
    return t && now_ms - t >= (uint64_t)r->cfg.window_ms;
}

int ctl_roles_step(ctl_roles *r, const ctl_role_load *w, int n, uint64_t now_ms,
                   ctl_role_change *out)
{
    roles_track(r, w, n, now_ms);
    ctl_pool pool[CTL_POOLS];
    pools_measure(r, w, n, pool);
    /* Windows run only while nothing is in flight: a moved worker takes load from the next
     * requests only, so its pools are judged afresh from when its heartbeats show the change. */
    bool judge = pool[CTL_POOL_PREFILL].n && pool[CTL_POOL_DECODE].n && !roles_pending(r);
    for (int p = 0; p < CTL_POOLS; p++) since(&r->miss_since[p], judge && pool[p].miss, now_ms);
    since(&r->calm_since, judge && !pool[0].miss && !pool[1].miss, now_ms);
    if (!r->cfg.on || !judge) return 0;

    int k = -1, to = 0;
    const char *reason = NULL;
    for (int p = 0; p < CTL_POOLS && k < 0; p++) {
        int q = 1 - p; /* the pool that would give a worker to p */
        if (!lasted(r, r->miss_since[p], now_ms) || !pool_room(r, &pool[q])) continue;
        k = pick(r, w, n, q, p, false, now_ms);
        to = p, reason = pool[p].miss;
    }
    for (int p = 0; p < CTL_POOLS && k < 0 && lasted(r, r->calm_since, now_ms); p++) {
        if (!pool_room(r, &pool[p])) continue;
        k = pick(r, w, n, p, 1 - p, true, now_ms);
        to = 1 - p, reason = "calm";
    }
    if (k < 0) return 0;

    ctl_role_entry *e = entry_of(r, w[k].worker);
    assert(e); /* roles_track added every member it was given */
    memset(out, 0, sizeof *out);
    snprintf(out->worker, sizeof out->worker, "%s", e->id);
    out->id = r->next_id++;
    out->from = w[k].role;
    out->to = to == CTL_POOL_PREFILL ? KM_WROLE_PREFILL : KM_WROLE_DECODE;
    out->reason = reason;
    out->n_prefill = pool[CTL_POOL_PREFILL].n;
    out->n_decode = pool[CTL_POOL_DECODE].n;
    out->prefill_load = pool_load(&pool[CTL_POOL_PREFILL]);
    out->decode_load = pool_load(&pool[CTL_POOL_DECODE]);
    out->ttft_ms = pool[CTL_POOL_PREFILL].latency;
    out->itl_ms = pool[CTL_POOL_DECODE].latency;
    e->pending_id = out->id;
    e->pending_to = out->to;
    e->pending_at_ms = now_ms;
    r->miss_since[0] = r->miss_since[1] = r->calm_since = 0;
    return 1;
}

int ctl_roles_done(ctl_roles *r, uint64_t id, bool ok)
{
    for (int i = 0; id && i < r->n; i++) {
        if (r->e[i].pending_id != id) continue;
        if (!ok) r->e[i].pending_id = 0; /* refused or not sent: the member stays as it is */
        return 0;
    }
    return KM_ENOTFOUND;
}
