/*
 * fair.c — the router queue shared fairly between tenants (internal.h). A tenant is what a
 * request's cache salt is bound to: a ZeroMQ client key's tenant ("z:NAME", tenants.c) or an
 * API key's ("h:NAME"); unkeyed requests (insecure mode, an HTTP front without keys) are one
 * tenant, "-".
 *
 * Why: the queue was one FIFO, so a key that filled it made every other key wait behind all of
 * its requests (issue 41: 23.5 s instead of 0.01 s). Now the next request out of the queue is
 * the oldest of the tenant with the fewest requests at workers, ties going to the tenant served
 * longest ago; and a keyed tenant may hold at most --max-queue-per-key requests in the queue
 * (beyond: 529 with a retry time, to that tenant only), so one key cannot fill it either.
 * Migrated requests still go first: they were admitted already.
 *
 * Tenants are few (one per key or key group), so the table is a plain array searched by name;
 * past RT_TENANTS_MAX the rest share one entry ("other").
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/internal.h"

enum { RT_TENANTS_MAX = 1024 };

struct rt_tenant_load {
    char name[KM_SEC_NAME_MAX + 3];
    int inflight, queued;
    uint64_t served; /* r->fair_seq when it last had a request sent */
    km_series *s_queued, *s_inflight, *s_refused;
};

static int load_register(rt_router *r, rt_tenant_load *t)
{
    km_metric *m;
    const char *lv[] = {t->name};
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
                           "Requests of the tenant refused because it had --max-queue-per-key "
                           "requests queued already (529).",
                           "tenant", NULL, 0, &m, &err))
        return KM_ENOMEM;
    t->s_refused = km_metric_series(m, lv);
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

void rt_fair_count(rt_router *r, const rt_rq *q, int queued, int inflight)
{
    rt_tenant_load *t = load_of(r, q);
    if (!t) return;
    t->queued += queued;
    t->inflight += inflight;
    if (inflight > 0) t->served = ++r->fair_seq;
    km_gauge_set(t->s_queued, t->queued);
    km_gauge_set(t->s_inflight, t->inflight);
}

bool rt_fair_refuse(rt_router *r, const rt_rq *q)
{
    rt_tenant_load *t = load_of(r, q);
    if (!t || !r->c.max_queue_per_key || !strcmp(t->name, "-") ||
        t->queued < r->c.max_queue_per_key)
        return false;
    km_counter_inc(t->s_refused);
    return true;
}

rt_rq *rt_fair_next(rt_router *r)
{
    rt_rq *best = NULL;
    const rt_tenant_load *bt = NULL;
    for (rt_rq *q = r->qhead; q; q = q->qnext) {
        if (q->attempts > 0) return q; /* migrated: admitted already */
        const rt_tenant_load *t = load_of(r, q);
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
