/*
 * metrics.c — the worker's Prometheus series, registered once (docs/operations.md lists them),
 * and what a request's end adds to them and to the heartbeat's latency rings (loop thread).
 */
#include "worker/service_internal.h"

int wk_svc_metrics_init(wk_service *s, km_errbuf *err)
{
    int rc = km_metrics_create(&s->reg);
    if (rc) return km_errf(err, rc, "metrics: cannot create the registry");
    km_metric *m;
#define REG(kind, name, help, labels, bounds, nb)                                                  \
    do {                                                                                           \
        rc = km_metric_register(s->reg, kind, name, help, labels, bounds, nb, &m, err);            \
        if (rc) return rc;                                                                         \
    } while (0)
    static const double lat_b[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                   0.25,  0.5,    1,     2.5,  5,     10,   30};
    static const double itl_b[] = {0.0005, 0.001, 0.002, 0.005, 0.01, 0.02,
                                   0.05,   0.1,   0.2,   0.5,   1,    2.5};
    int nlat = sizeof lat_b / sizeof lat_b[0], nitl = sizeof itl_b / sizeof itl_b[0];
    REG(KM_COUNTER, "kvmesh_worker_requests_total",
        "Requests ended, by outcome (ok, canceled, deadline, error, rejected, handed_back).",
        "outcome", NULL, 0);
    for (int i = 0; i < WK_OUT_COUNT; i++) s->s_req[i] = km_metric_series(m, &wk_out_names[i]);
    REG(KM_COUNTER, "kvmesh_worker_tokens_total",
        "Tokens by kind: prompt (received), cached (prompt tokens served from cached KV), "
        "prefill (computed prompt tokens), generated, chunk (prompt tokens reused from cached "
        "chunks, repaired; not in cached).",
        "kind", NULL, 0);
    const char *k[5] = {"prompt", "cached", "prefill", "generated", "chunk"};
    s->s_tok_prompt = km_metric_series(m, &k[0]);
    s->s_tok_cached = km_metric_series(m, &k[1]);
    s->s_tok_prefill = km_metric_series(m, &k[2]);
    s->s_tok_gen = km_metric_series(m, &k[3]);
    s->s_tok_chunk = km_metric_series(m, &k[4]);
    REG(KM_HISTOGRAM, "kvmesh_worker_ttft_seconds", "Time from arrival to the first token.", NULL,
        lat_b, nlat);
    s->s_ttft = km_metric_series(m, NULL);
    REG(KM_HISTOGRAM, "kvmesh_worker_itl_seconds", "Time between consecutive tokens of a stream.",
        NULL, itl_b, nitl);
    s->s_itl = km_metric_series(m, NULL);
    REG(KM_HISTOGRAM, "kvmesh_worker_queue_seconds", "Time from arrival to admission.", NULL, lat_b,
        nlat);
    s->s_queue = km_metric_series(m, NULL);
    REG(KM_HISTOGRAM, "kvmesh_worker_request_seconds", "Time from arrival to the end.", NULL, lat_b,
        nlat);
    s->s_e2e = km_metric_series(m, NULL);
    REG(KM_GAUGE, "kvmesh_worker_kv_bytes", "KV bytes held, per tier, shard and format.",
        "tier,shard,format", NULL, 0);
    s->m_kv_bytes = m;
    REG(KM_GAUGE, "kvmesh_worker_kv_pages", "KV pages held, per tier, shard and format.",
        "tier,shard,format", NULL, 0);
    s->m_kv_pages = m;
    REG(KM_GAUGE, "kvmesh_worker_kv_chunk_pages",
        "Of the KV pages held, those of chunks (position-free: cached by their own tokens and "
        "reused at any position, docs/blend.md), per tier.",
        "tier", NULL, 0);
    s->m_kv_chunk_pages = m;
    REG(KM_GAUGE, "kvmesh_worker_kv_capacity_bytes", "KV byte budget, per tier, shard and format.",
        "tier,shard,format", NULL, 0);
    s->m_kv_cap = m;
    REG(KM_GAUGE, "kvmesh_kv_pinned_bytes",
        "KV bytes held by live sequences (not reclaimable), per tier, shard and format.",
        "tier,shard,format", NULL, 0);
    s->m_kv_pinned = m;
    REG(KM_COUNTER, "kvmesh_kv_shard_events_total",
        "KV page events per shard: hit (a prefix hit served by the page), demotion (to a lower "
        "tier), eviction (dropped from every tier).",
        "shard,event", NULL, 0);
    s->m_shard_ev = m;
    REG(KM_GAUGE, "kvmesh_kv_expert_group_pages",
        "KV pages per expert group (--kv-shard-key expert: the group of the page's dominant "
        "routed expert) and tier.",
        "group,tier", NULL, 0);
    s->m_grp_pages = m;
    REG(KM_COUNTER, "kvmesh_kv_expert_group_events_total",
        "KV page events per expert group: placed, hit, demotion, eviction.", "group,event", NULL,
        0);
    s->m_grp_ev = m;
    REG(KM_COUNTER, "kvmesh_kv_placements_total",
        "Full pages placed by their dominant expert (--kv-shard-key expert): moved to the "
        "expert's shard (or already there), or stayed (shared, another format, no room).",
        "result", NULL, 0);
    const char *pr[2] = {"moved", "stayed"};
    for (int i = 0; i < 2; i++) s->s_place[i] = km_metric_series(m, &pr[i]);
    REG(KM_COUNTER, "kvmesh_kv_promoted_bytes_total",
        "KV bytes brought up to the hot tier, by reason: a prefix hit or export (prefix), or "
        "the pages a sparse step reads (read).",
        "reason", NULL, 0);
    const char *pw[2] = {"prefix", "read"};
    for (int i = 0; i < 2; i++) s->s_promoted[i] = km_metric_series(m, &pw[i]);
    REG(KM_COUNTER, "kvmesh_worker_sparse_pages_total",
        "Pages of (token, layer, kv head) views under --sparse-attn: attended (selected) or left "
        "out (skipped).",
        "result", NULL, 0);
    const char *sp[2] = {"selected", "skipped"};
    for (int i = 0; i < 2; i++) s->s_sparse[i] = km_metric_series(m, &sp[i]);
    REG(KM_COUNTER, "kvmesh_kv_sparse_demoted_bytes_total",
        "KV bytes of pages a sparse sequence held hot and stopped reading, sent back down to host "
        "RAM or disk.",
        NULL, NULL, 0);
    s->s_demoted = km_metric_series(m, NULL);
    REG(KM_COUNTER, "kvmesh_kv_slice_read_bytes_total",
        "KV bytes a sparse step read from disk as the layer slices it selected, instead of "
        "bringing the pages up whole.",
        NULL, NULL, 0);
    s->s_slice_read = km_metric_series(m, NULL);
    REG(KM_GAUGE, "kvmesh_worker_prefix_hit_ratio",
        "Prompt tokens served from cached KV over prompt tokens, since start.", NULL, NULL, 0);
    s->s_hit = km_metric_series(m, NULL);
    REG(KM_COUNTER, "kvmesh_worker_preemptions_total",
        "Sequences preempted because KV pages ran out.", NULL, NULL, 0);
    s->s_preempt = km_metric_series(m, NULL);
    REG(KM_COUNTER, "kvmesh_worker_tenant_yields_total",
        "Running sequences sent back to the queue so another tenant's requests run "
        "(--max-running-per-tenant).",
        NULL, NULL, 0);
    s->s_yield = km_metric_series(m, NULL);
    REG(KM_COUNTER, "kvmesh_worker_tenant_waits_total",
        "Running sequences that sat out a step so that another tenant's request (of a tenant "
        "under --max-running-per-tenant) got its first token in a step of its own.",
        NULL, NULL, 0);
    s->s_wait = km_metric_series(m, NULL);
    REG(KM_COUNTER, "kvmesh_worker_recovery_actions_total",
        "Recovery actions taken, by action (evict, set_kv_format, drain, shutdown).", "action",
        NULL, 0);
    const char *ra[4] = {"evict", "set_kv_format", "drain", "shutdown"};
    s->s_rec_evict = km_metric_series(m, &ra[0]);
    s->s_rec_format = km_metric_series(m, &ra[1]);
    s->s_rec_drain = km_metric_series(m, &ra[2]);
    s->s_rec_shutdown = km_metric_series(m, &ra[3]);
    REG(KM_COUNTER, "kvmesh_recovery_actions_total",
        "Recovery actions carried out by this worker, by level: 1 evict, 2 set_kv_format to a "
        "smaller format, 3 drain, 0 the revert to f16.",
        "level", NULL, 0);
    const char *lv[4] = {"0", "1", "2", "3"};
    for (int i = 0; i < 4; i++) s->s_rec_level[i] = km_metric_series(m, &lv[i]);
    REG(KM_GAUGE, "kvmesh_worker_ballast_bytes",
        "KV bytes pinned by the chaos `pressure` command's ballast (--chaos).", NULL, NULL, 0);
    s->s_ballast = km_metric_series(m, NULL);
    REG(KM_COUNTER, "kvmesh_worker_bad_frames_total", "Frames rejected, by reason.", "reason", NULL,
        0);
    for (int i = 0; i < WK_BAD_COUNT; i++) s->s_bad[i] = km_metric_series(m, &wk_bad_names[i]);
    REG(KM_COUNTER, "kvmesh_worker_forbidden_total",
        "Frames refused with 403: the sender's key has a role that may not send them.", NULL, NULL,
        0);
    s->s_forbidden = km_metric_series(m, NULL);
    REG(KM_COUNTER, "kvmesh_kv_unauthenticated_pages_total",
        "Disk KV pages dropped, never served, for a missing or wrong MAC (--cluster-secret).", NULL,
        NULL, 0);
    s->s_unauth = km_metric_series(m, NULL);
    REG(KM_GAUGE, "kvmesh_worker_running", "Sequences running.", NULL, NULL, 0);
    s->s_running = km_metric_series(m, NULL);
    REG(KM_GAUGE, "kvmesh_worker_queue_depth", "Requests waiting for a slot.", NULL, NULL, 0);
    s->s_queued = km_metric_series(m, NULL);
    REG(KM_COUNTER, "kvmesh_worker_steps_total", "Engine steps run.", NULL, NULL, 0);
    s->s_steps = km_metric_series(m, NULL);
    static const double step_b[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8};
    REG(KM_HISTOGRAM, "kvmesh_worker_step_seconds",
        "Engine step times (--step-budget bounds the planned ones).", NULL, step_b,
        (int)(sizeof step_b / sizeof step_b[0]));
    s->s_step_time = km_metric_series(m, NULL);
    REG(KM_COUNTER, "kvmesh_worker_kv_event_frames_total", "KV event frames published.", NULL, NULL,
        0);
    s->s_events = km_metric_series(m, NULL);
    REG(KM_GAUGE, "kvmesh_worker_ready", "1 while the worker takes new requests.", NULL, NULL, 0);
    s->s_ready = km_metric_series(m, NULL);
    REG(KM_COUNTER, "kvmesh_worker_spec_tokens_total",
        "Speculative decoding: draft tokens verified, by result (drafted = accepted + rejected).",
        "kind", NULL, 0);
    const char *sk[3] = {"drafted", "accepted", "rejected"};
    for (int i = 0; i < 3; i++) s->s_spec[i] = km_metric_series(m, &sk[i]);
    REG(KM_COUNTER, "kvmesh_worker_spec_verifications_total",
        "Steps in which a request verified draft tokens.", NULL, NULL, 0);
    s->s_spec[3] = km_metric_series(m, NULL);
    REG(KM_COUNTER, "kvmesh_worker_spec_backoffs_total",
        "Requests that stopped drafting after drafts kept failing (until a longer match).", NULL,
        NULL, 0);
    s->s_spec[4] = km_metric_series(m, NULL);
    REG(KM_GAUGE, "kvmesh_worker_spec_accepted_length",
        "Mean draft tokens accepted per verification since start.", NULL, NULL, 0);
    s->s_spec_len = km_metric_series(m, NULL);
    REG(KM_COUNTER, "kvmesh_worker_heartbeats_total", "Heartbeats, by result (sent, dropped).",
        "result", NULL, 0);
    const char *hr[2] = {"sent", "dropped"};
    s->s_hb_sent = km_metric_series(m, &hr[0]);
    s->s_hb_dropped = km_metric_series(m, &hr[1]);
#undef REG
    return 0;
}

void wk_svc_observe_end(wk_service *s, const en_sched_usage *u)
{
    km_counter_add(s->s_tok_prompt, (uint64_t)u->prompt_tokens);
    km_counter_add(s->s_tok_cached, (uint64_t)u->cached_tokens);
    km_counter_add(s->s_tok_chunk, (uint64_t)u->chunk_tokens);
    km_hist_observe(s->s_queue, u->queue_ms / 1e3);
    km_hist_observe(s->s_e2e, u->total_ms / 1e3);
    if (u->completion_tokens > 0) {
        s->ttft_ring[s->n_ttft++ % WK_LAT_RING] = u->ttft_ms;
        if (u->completion_tokens > 1)
            s->tpot_ring[s->n_tpot++ % WK_LAT_RING] =
                (u->total_ms - u->ttft_ms) / (u->completion_tokens - 1);
    }
}
