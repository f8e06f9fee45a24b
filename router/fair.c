/*
 * fair.c — the router queue shared fairly between tenants, and each tenant's limits
 * (internal.h). A tenant is what a request's cache salt is bound to: a ZeroMQ client key's tenant
 * ("z:NAME", tenants.c) or an API key's ("h:NAME"); unkeyed requests (insecure mode, an HTTP
 * front without keys) are one tenant, "-", which no per-key limit applies to (it is everyone).
 *
 * Why: the queue was one FIFO, so a key that filled it made every other key wait behind all of
 * its requests (issue 41: 23.5 s instead of 0.01 s). Now the next request out of the queue is
 * the oldest of the tenant with the fewest requests at workers, ties going to the tenant served
 * longest ago. Per keyed tenant, three bounds (docs/router.md, "Tenants"):
 *  - --max-queue-per-key requests in the router queue; beyond it: 429 with a retry time;
 *  - --max-inflight-per-key requests at workers while another tenant is active (has requests
 *    queued or at workers, or had one end within RT_FAIR_LINGER_MS); beyond it a request waits
 *    in the queue, even with a worker free, so one key cannot fill the workers' batches while
 *    another key waits for a first token. A key alone on the cluster is never held: the limit
 *    costs nothing where nobody else asks;
 *  - --max-tokens-per-sec-per-key, a token bucket over prompt and generated tokens, one second
 *    deep: a request is admitted while the bucket is not in debt, its prompt is charged when it
 *    is admitted and each generated token as it arrives; in debt: 429, retry when it is paid.
 * Migrated requests still go first and are never held: they were admitted already.
 * A tenant under its in-flight limit while another is active may also go past --max-inflight at
 * a worker, by what it has left of that limit: a flooding key that filled every worker's
 * --max-inflight before anyone else asked would otherwise make another key's first request wait
 * for one of its own to end; the worker runs it first (its tenant share, --max-running-per-tenant
 * at the worker, engine/scheduler_fair.c).
 *
 * Tenants are few (one per key or key group, which the operator's key files bound), so the
 * table is a plain array searched by name; past RT_TENANTS_MAX the rest share one entry
 * ("other"), which also bounds the metrics' tenant label.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/internal.h"

enum { RT_TENANTS_MAX = 1024 };
/* How long a tenant whose last request ended still counts as active: a client sending one
 * request after another is active between them too. */
enum { RT_FAIR_LINGER_MS = 1000 };

struct rt_tenant_load {
    char name[KM_SEC_NAME_MAX + 3];
    int inflight, queued;
    uint64_t served;  /* r->fair_seq when it last had a request sent */
    double bucket;    /* tokens it may still use (negative: its debt) */
    uint64_t fill_ns; /* when bucket was last filled */
    uint64_t idle_ns; /* when it last had nothing queued nor in flight (0: never had any) */
    km_series *s_queued, *s_inflight, *s_refused[RT_REFUSE_COUNT], *s_tokens;
};

static const char *const refuse_names[RT_REFUSE_COUNT] = {"queue", "tokens"};

static int load_register(rt_router *r, rt_tenant_load *t)
{
    km_metric *m;
    const char *lv[] = {t->name, NULL};
    km_errbuf err = {{0}};
    if (km_metric_register(r->metrics, KM_GAUGE, "kvmesh_router_tenant_queued",
                           "Requests of the tenant waiting in the router queue.", "tenant", NULL, 0,
                           &m, &err))
        return KM_ENOMEM;
    t->s_queued = km_metric_series(m, lv);
    if (km_metric_register(r->metrics, KM_GAUGE, "kvmesh_router_tenant_inflight",
                           "Requests of the tenant at workers.", "tenant", NULL, 0, &m, &err))
        return KM_ENOMEM;
    t->s_inflight = km_metric_series(m, lv);
    if (km_metric_register(r->metrics, KM_COUNTER, "kvmesh_router_tenant_refused_total",
                           "Requests of the tenant refused with 429, by reason: queue "
                           "(--max-queue-per-key), tokens (--max-tokens-per-sec-per-key).",
                           "tenant,reason", NULL, 0, &m, &err))
        return KM_ENOMEM;
    for (int i = 0; i < RT_REFUSE_COUNT; i++) {
        lv[1] = refuse_names[i];
        t->s_refused[i] = km_metric_series(m, lv);
    }
    if (km_metric_register(r->metrics, KM_COUNTER, "kvmesh_router_tenant_tokens_total",
                           "Prompt and generated tokens of the tenant's requests (what "
                           "--max-tokens-per-sec-per-key counts).",
                           "tenant", NULL, 0, &m, &err))
        return KM_ENOMEM;
    t->s_tokens = km_metric_series(m, lv);
    return 0;
}

int rt_fair_tenant(rt_router *r, const char *name)
{
    if (!name || !*name) name = "-";
    for (int i = 0; i < r->n_loads; i++)
        if (!strcmp(r->loads[i].name, name)) return i;
    if (r->n_loads == RT_TENANTS_MAX) return rt_fair_tenant(r, "other");
    if (r->n_loads == r->cap_loads) {
        int cap = r->cap_loads ? r->cap_loads * 2 : 16;
        rt_tenant_load *nl = realloc(r->loads, sizeof *nl * (size_t)cap);
        if (!nl) return -1;
        r->loads = nl;
        r->cap_loads = cap;
    }
    rt_tenant_load *t = &r->loads[r->n_loads];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->bucket = r->c.max_tokens_per_sec_per_key;
    t->fill_ns = km_now_ns();
    if (load_register(r, t)) return -1;
    return r->n_loads++;
}

void rt_fair_free(rt_router *r)
{
    free(r->loads);
    r->loads = NULL;
    r->n_loads = r->cap_loads = 0;
}

static rt_tenant_load *load_of(rt_router *r, const rt_rq *q)
{
    return q->load >= 0 && q->load < r->n_loads ? &r->loads[q->load] : NULL;
}

/* Do the per-key limits apply to t: a keyed tenant, not the unkeyed everyone. */
static bool limited(const rt_tenant_load *t)
{
    return t && strcmp(t->name, "-");
}

void rt_fair_count(rt_router *r, const rt_rq *q, int queued, int inflight)
{
    rt_tenant_load *t = load_of(r, q);
    if (!t) return;
    t->queued += queued;
    t->inflight += inflight;
    if (inflight > 0) t->served = ++r->fair_seq;
    if (!t->queued && !t->inflight) t->idle_ns = km_now_ns();
    km_gauge_set(t->s_queued, t->queued);
    km_gauge_set(t->s_inflight, t->inflight);
}

bool rt_fair_refuse(rt_router *r, const rt_rq *q)
{
    rt_tenant_load *t = load_of(r, q);
    if (!limited(t) || !r->c.max_queue_per_key || t->queued < r->c.max_queue_per_key) return false;
    km_counter_inc(t->s_refused[RT_REFUSE_QUEUE]);
    return true;
}

static bool active(const rt_tenant_load *t, uint64_t now)
{
    return t->queued || t->inflight ||
           (t->idle_ns && now - t->idle_ns < (uint64_t)RT_FAIR_LINGER_MS * 1000000);
}

/* Is a tenant other than t active: is there anyone t's limit makes room for. */
static bool contended(const rt_router *r, const rt_tenant_load *t, uint64_t now)
{
    for (int i = 0; i < r->n_loads; i++)
        if (&r->loads[i] != t && active(&r->loads[i], now)) return true;
    return false;
}

/* Held back: t has --max-inflight-per-key requests at workers already while another tenant is
 * active. contended: -1 not known yet (computed here), else what the caller computed. */
static bool held(const rt_router *r, const rt_tenant_load *t, int *contended_memo)
{
    if (!limited(t) || !r->c.max_inflight_per_key || t->inflight < r->c.max_inflight_per_key)
        return false;
    if (*contended_memo < 0) *contended_memo = contended(r, t, km_now_ns());
    return *contended_memo;
}

bool rt_fair_held(rt_router *r, const rt_rq *q)
{
    int memo = -1;
    return q->attempts == 0 && held(r, load_of(r, q), &memo);
}

int rt_fair_room(rt_router *r, const rt_rq *q)
{
    const rt_tenant_load *t = load_of(r, q);
    int per_key = r->c.max_inflight_per_key;
    if (q->attempts > 0 || !limited(t) || per_key <= 0 || t->inflight >= per_key) return 0;
    return contended(r, t, km_now_ns()) ? per_key - t->inflight : 0;
}

/* The bucket filled up to now (at most one second's worth). */
static void bucket_fill(const rt_router *r, rt_tenant_load *t, uint64_t now)
{
    double rate = r->c.max_tokens_per_sec_per_key;
    if (now > t->fill_ns) t->bucket += rate * (double)(now - t->fill_ns) / 1e9;
    if (t->bucket > rate) t->bucket = rate;
    t->fill_ns = now;
}

uint32_t rt_fair_admit(rt_router *r, const rt_rq *q)
{
    rt_tenant_load *t = load_of(r, q);
    if (!t) return 0;
    km_counter_add(t->s_tokens, (uint64_t)q->n_prompt);
    double rate = r->c.max_tokens_per_sec_per_key;
    if (!limited(t) || rate <= 0) return 0;
    bucket_fill(r, t, km_now_ns());
    if (t->bucket < 0) {
        km_counter_inc(t->s_refused[RT_REFUSE_TOKENS]);
        double ms = ceil(-t->bucket / rate * 1e3) + 1;
        return ms < 1e9 ? (uint32_t)ms : 1000000000u;
    }
    t->bucket -= q->n_prompt;
    return 0;
}

void rt_fair_tokens(rt_router *r, const rt_rq *q, int n)
{
    rt_tenant_load *t = load_of(r, q);
    if (!t) return;
    km_counter_add(t->s_tokens, (uint64_t)n);
    if (limited(t) && r->c.max_tokens_per_sec_per_key > 0) {
        bucket_fill(r, t, km_now_ns());
        t->bucket -= n;
    }
}

rt_rq *rt_fair_next(rt_router *r)
{
    rt_rq *best = NULL;
    const rt_tenant_load *bt = NULL, *last = NULL;
    int memo = -1;
    for (rt_rq *q = r->qhead; q; q = q->qnext) {
        if (q->attempts > 0) return q; /* migrated: admitted already */
        const rt_tenant_load *t = load_of(r, q);
        if (t != last) memo = -1, last = t; /* "another tenant is active" depends on t */
        if (held(r, t, &memo)) continue;
        if (!best) {
            best = q, bt = t;
            continue;
        }
        if (!t || !bt || t == bt) continue; /* the same tenant: its oldest is best already */
        if (t->inflight < bt->inflight || (t->inflight == bt->inflight && t->served < bt->served))
            best = q, bt = t;
    }
    return best;
}
