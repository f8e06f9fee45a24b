/*
 * metrics.c — the router's Prometheus series (internal.h; docs/router.md "Observability"):
 * request outcomes, migrations, tokens and cache hits, queue and in-flight gauges, decision and
 * latency histograms, event gaps and resyncs, the controller's views; and per worker: up,
 * in flight, routed, pages per tier, membership state and recovery level. Series are looked up
 * once here and kept in the router's structs, so the hot paths only add.
 */
#include "router/internal.h"

/* Registers a family on r->metrics (m: a km_metric * in scope, err the caller's) and keeps the
 * series for the label values lv in dst; returns the error from the enclosing function. */
#define REG(kind, name, help, labels, bounds, nb, lv, dst)                                         \
    do {                                                                                           \
        int rc_ = km_metric_register(r->metrics, kind, name, help, labels, bounds, nb, &m, err);   \
        if (rc_) return rc_;                                                                       \
        dst = km_metric_series(m, lv);                                                             \
    } while (0)

int rt_register_metrics(rt_router *r, km_errbuf *err)
{
    km_metric *m;
    static const double lat[] = {0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1,
                                 0.25,   0.5,    1,     2.5,   5,    10,    30,   60};
    static const double dec[] = {1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 1e-2};
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
    const char *h401[] = {"401"}, *h403[] = {"403"};
    REG(KM_COUNTER, "kvmesh_router_http_auth_refused_total",
        "HTTP requests refused by API key: 401 without a valid key, 403 for a key whose role may "
        "not (--api-keys).",
        "status", NULL, 0, h401, r->s_http_unauthorized);
    REG(KM_COUNTER, "kvmesh_router_http_auth_refused_total",
        "HTTP requests refused by API key: 401 without a valid key, 403 for a key whose role may "
        "not (--api-keys).",
        "status", NULL, 0, h403, r->s_http_forbidden);
    REG(KM_COUNTER, "kvmesh_router_forbidden_total",
        "Client frames refused with 403: the sender's key has a role that may not send them.", NULL,
        NULL, 0, NULL, r->s_forbidden);
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
    REG(KM_COUNTER, "kvmesh_router_events_refused_total",
        "KV events refused because they name another worker than the one whose events connection "
        "they came on (a compromised member forging another's pages).",
        NULL, NULL, 0, NULL, r->s_ev_foreign);
    REG(KM_COUNTER, "kvmesh_router_http_tls_failures_total",
        "HTTPS connections closed for a failed TLS handshake or record (--tls-cert only).", NULL,
        NULL, 0, NULL, r->s_tls_fail);
    REG(KM_COUNTER, "kvmesh_router_http_buffer_full_total",
        "HTTP connections answered 503 and closed because the front held --max-http-buffered "
        "bytes of request input.",
        NULL, NULL, 0, NULL, r->s_http_buffer_full);
    const char *loop[] = {"loop"}, *pool[] = {"pool"};
    REG(KM_COUNTER, "kvmesh_router_prompts_tokenized_total",
        "Text prompts tokenized, by where: on the loop (short ones) or on the thread pool.",
        "where", NULL, 0, loop, r->s_tok_loop);
    REG(KM_COUNTER, "kvmesh_router_prompts_tokenized_total",
        "Text prompts tokenized, by where: on the loop (short ones) or on the thread pool.",
        "where", NULL, 0, pool, r->s_tok_pool);
    REG(KM_COUNTER, "kvmesh_router_requests_abandoned_total",
        "Requests ended because their client went away (ZeroMQ disconnect, HTTP connection "
        "closed); their workers were told to stop.",
        NULL, NULL, 0, NULL, r->s_abandoned);
    REG(KM_COUNTER, "kvmesh_router_views_total", "Controller views applied.", NULL, NULL, 0, NULL,
        r->s_views);
    REG(KM_COUNTER, "kvmesh_router_bad_views_total",
        "Controller view messages that could not be decoded (ignored).", NULL, NULL, 0, NULL,
        r->s_bad_views);
    REG(KM_GAUGE, "kvmesh_router_view_age_seconds",
        "Seconds since the last controller view (-1: none yet, or no --controller).", NULL, NULL, 0,
        NULL, r->s_view_age);
    km_gauge_set(r->s_view_age, -1);
    int prc = rt_pull_metrics(r, err); /* kvmesh_router_pulls_total (pull.c) */
    if (!prc) prc = rt_pd_metrics(r, err);
    if (prc) return prc;
    for (int i = 0; i < r->n_w; i++) {
        int rc = rt_register_worker_metrics(r, &r->w[i], err);
        if (rc) return rc;
    }
    return 0;
}

/* The per-worker series (at start, and for a worker a view adds at run time). */
int rt_register_worker_metrics(rt_router *r, rt_wk *w, km_errbuf *err)
{
    km_metric *m;
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
    return 0;
}

void rt_update_page_gauges(rt_router *r)
{
    for (int i = 0; i < r->n_w; i++)
        for (int t = 0; t < KM_TIER_COUNT; t++)
            km_gauge_set(r->w[i].s_pages[t], (double)rt_index_pages(r->index, i, (km_tier)t));
    km_gauge_set(r->s_index_pages, (double)rt_index_size(r->index));
}
