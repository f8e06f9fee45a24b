/*
 * service_heartbeat.c — what the worker reports (service_internal.h): its Prometheus series
 * (registered once, updated by the loop; docs/operations.md lists them) and its heartbeat to the
 * controller once a --heartbeat interval (docs/protocol.md section 11): state, endpoints,
 * capacity, KV use per shard and tier, load, rates, latency quantiles and error counts.
 *
 * Liveness is not progress. Heartbeats leave from a thread of their own (the "pulse"), never from
 * the loop that runs engine steps: a prefill step at the end of a long context can take seconds on
 * one thread of a loaded machine, and a heartbeat that waited for it would make the controller
 * declare a busy worker dead (issue 12). The loop publishes a snapshot of what the heartbeat
 * reports (KV use, load, rates, tokens computed, errors) after its steps; the pulse sends the
 * latest snapshot every interval with a fresh seq, uptime, state and RSS. So a heartbeat proves
 * the process is alive, and its tokens_total proves progress: the controller tells "dead" (no
 * heartbeat) from "stalled" (heartbeats, busy, tokens_total not moving) by these two signals.
 *
 * The pulse also owns the controller DEALER (a ZeroMQ socket belongs to one thread): recovery
 * commands from the controller are passed to the loop over an inproc PAIR and carried out between
 * steps (they change the KV store, which a step uses), their replies passed back the same way.
 * Steps are bounded in time (the scheduler's step budget), so a command waits at most one step;
 * a plain `status` on the ROUTER does not wait at all (gate.c).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "worker/service_internal.h"

/* ---------------------------------------------------------------- metrics */

/* A counter brought up to a total kept elsewhere (kvshard's statistics). */
static void wk_counter_sync(km_series *c, uint64_t total)
{
    uint64_t v = km_counter_value(c);
    if (total > v) km_counter_add(c, total - v);
}

/* kvshard's per-shard and per-expert-group counts (docs/operations.md, metrics). */
static void wk_svc_update_shard_counts(wk_service *s)
{
    static const char *const ev[4] = {"hit", "demotion", "eviction", "placed"};
    char id[16];
    for (int sh = 0; sh < kv_store_n_shards(s->kv); sh++) {
        kv_shard_stats st;
        if (kv_store_shard_stats(s->kv, sh, &st)) continue;
        snprintf(id, sizeof id, "%d", sh);
        const uint64_t v[3] = {st.hits, st.demotions, st.evictions};
        for (int i = 0; i < 3; i++) {
            const char *lv[2] = {id, ev[i]};
            wk_counter_sync(km_metric_series(s->m_shard_ev, lv), v[i]);
        }
    }
    for (int g = 0; g < kv_store_n_expert_groups(s->kv); g++) {
        kv_group_stats gs;
        if (kv_store_group_stats(s->kv, g, &gs)) continue;
        snprintf(id, sizeof id, "%d", g);
        for (int t = 0; t < KV_TIER_COUNT; t++) {
            const char *lv[2] = {id, kv_tier_name((kv_tier)t)};
            km_gauge_set(km_metric_series(s->m_grp_pages, lv), (double)gs.pages[t]);
        }
        const uint64_t v[4] = {gs.hits, gs.demotions, gs.evictions, gs.placed};
        for (int i = 0; i < 4; i++) {
            const char *lv[2] = {id, ev[i]};
            wk_counter_sync(km_metric_series(s->m_grp_ev, lv), v[i]);
        }
    }
}

void wk_svc_update_gauges(wk_service *s)
{
    int n_shards = kv_store_n_shards(s->kv);
    for (int sh = 0; sh < n_shards; sh++) {
        kv_shard_stats st;
        if (kv_store_shard_stats(s->kv, sh, &st)) continue;
        char shard[16];
        snprintf(shard, sizeof shard, "%d", sh);
        for (int t = 0; t < KV_TIER_COUNT; t++) {
            if (!st.tier[t].budget && !st.tier[t].pages) continue;
            for (int f = 0; f < KV_FORMAT_COUNT; f++) {
                const char *lv[3] = {kv_tier_name((kv_tier)t), shard, kv_format_name(f)};
                bool cur = (kv_format)f == st.format;
                km_series *b = km_metric_series(s->m_kv_bytes, lv);
                if (!cur && !km_gauge_value(b)) continue; /* never had that format */
                km_gauge_set(b, cur ? (double)st.tier[t].bytes : 0);
                km_gauge_set(km_metric_series(s->m_kv_pages, lv),
                             cur ? (double)st.tier[t].pages : 0);
                km_gauge_set(km_metric_series(s->m_kv_cap, lv),
                             cur ? (double)st.tier[t].budget : 0);
                km_gauge_set(km_metric_series(s->m_kv_pinned, lv),
                             cur ? (double)st.tier[t].pinned_bytes : 0);
            }
        }
    }
    wk_svc_update_shard_counts(s);
    kv_store_stats ks;
    kv_store_stats_get(s->kv, &ks);
    for (int t = 0; t < KV_TIER_COUNT; t++) {
        const char *tier = kv_tier_name((kv_tier)t);
        km_gauge_set(km_metric_series(s->m_kv_chunk_pages, &tier),
                     (double)ks.position_free_pages[t]);
    }
    wk_counter_sync(s->s_place[0], ks.placed_pages - ks.place_fallbacks);
    wk_counter_sync(s->s_place[1], ks.place_fallbacks);
    for (int i = 0; i < KV_PROMOTE_REASONS; i++)
        wk_counter_sync(s->s_promoted[i], ks.promoted_bytes[i]);
    en_sparse_stats sps;
    en_engine_sparse_stats(s->e, &sps);
    wk_counter_sync(s->s_sparse[0], sps.pages_selected);
    wk_counter_sync(s->s_sparse[1], sps.pages_skipped);
    wk_counter_sync(s->s_demoted, ks.held_demoted_bytes);
    wk_counter_sync(s->s_slice_read, ks.slice_disk_bytes);
    if (ks.unauthenticated_pages > s->last_unauth)
        km_counter_add(s->s_unauth, ks.unauthenticated_pages - s->last_unauth);
    s->last_unauth = ks.unauthenticated_pages;
    en_sched_stats ss;
    en_sched_stats_get(s->sched, &ss);
    km_gauge_set(s->s_running, ss.running);
    km_gauge_set(s->s_ballast, (double)wk_svc_ballast_bytes(s));
    km_gauge_set(s->s_queued, ss.queued);
    km_gauge_set(s->s_hit, ss.prompt_tokens ? (double)ss.cached_tokens / ss.prompt_tokens : 0);
    if (ss.preemptions > s->last_preempt)
        km_counter_add(s->s_preempt, ss.preemptions - s->last_preempt);
    s->last_preempt = ss.preemptions;
    if (ss.tenant_yields > s->last_yield)
        km_counter_add(s->s_yield, ss.tenant_yields - s->last_yield);
    s->last_yield = ss.tenant_yields;
    if (ss.tenant_waits > s->last_wait) km_counter_add(s->s_wait, ss.tenant_waits - s->last_wait);
    s->last_wait = ss.tenant_waits;
    const uint64_t spec[5] = {ss.spec_drafted, ss.spec_accepted, ss.spec_rejected, ss.spec_verifies,
                              ss.spec_backoffs};
    for (int i = 0; i < 5; i++) {
        if (spec[i] > s->last_spec[i]) km_counter_add(s->s_spec[i], spec[i] - s->last_spec[i]);
        s->last_spec[i] = spec[i];
    }
    km_gauge_set(s->s_spec_len,
                 ss.spec_verifies ? (double)ss.spec_accepted / (double)ss.spec_verifies : 0);
    uint64_t now = km_now_ns();
    double dt = (now - s->last_rate_ns) / 1e9;
    if (dt >= 0.5) {
        s->decode_tps = (ss.decode_tokens - s->last_decode) / dt;
        s->prefill_tps = (ss.prefill_tokens - s->last_prefill) / dt;
        km_counter_add(s->s_tok_prefill, ss.prefill_tokens - s->last_prefill);
        s->last_decode = ss.decode_tokens;
        s->last_prefill = ss.prefill_tokens;
        s->last_rate_ns = now;
    }
}

/* ---------------------------------------------------------------- heartbeats */

static double wk_quantile(const double *ring, int n, double q, double *tmp)
{
    if (n <= 0) return 0;
    if (n > WK_LAT_RING) n = WK_LAT_RING;
    memcpy(tmp, ring, sizeof *tmp * n);
    /* insertion sort: at most WK_LAT_RING values, once per heartbeat */
    for (int i = 1; i < n; i++) {
        double v = tmp[i];
        int j = i - 1;
        while (j >= 0 && tmp[j] > v) tmp[j + 1] = tmp[j], j--;
        tmp[j + 1] = v;
    }
    int k = (int)(q * (n - 1) + 0.5);
    return tmp[k];
}

static uint64_t wk_rss_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f) return 0;
    unsigned long pages = 0, rss = 0;
    int n = fscanf(f, "%lu %lu", &pages, &rss);
    fclose(f);
    return n == 2 ? (uint64_t)rss * (uint64_t)sysconf(_SC_PAGESIZE) : 0;
}

/* ---------------------------------------------------------------- the snapshot (loop thread) */

void wk_svc_snapshot(wk_service *s)
{
    wk_hb_snap n = {0};
    int n_shards = kv_store_n_shards(s->kv);
    for (int sh = 0; sh < n_shards && n.n_kv < KM_PROTO_MAX_KV_ENTRIES - KV_TIER_COUNT; sh++) {
        kv_shard_stats st;
        if (kv_store_shard_stats(s->kv, sh, &st)) continue;
        for (int t = 0; t < KV_TIER_COUNT; t++) {
            if (!st.tier[t].budget && !st.tier[t].pages) continue;
            n.kv[n.n_kv++] = (km_kv_usage){.shard = (uint32_t)sh,
                                           .tier = (km_tier)t,
                                           .format = kv_format_name(st.format),
                                           .pages = st.tier[t].pages,
                                           .bytes = st.tier[t].bytes,
                                           .capacity_bytes = st.tier[t].budget,
                                           .pinned_bytes = st.tier[t].pinned_bytes};
        }
    }
    en_sched_stats ss;
    en_sched_stats_get(s->sched, &ss);
    n.page_tokens = (uint32_t)kv_store_page_tokens(s->kv);
    n.queue_depth = (uint32_t)ss.queued;
    n.running = (uint32_t)ss.running;
    n.decode_tps = s->decode_tps;
    n.prefill_tps = s->prefill_tps;
    n.tokens_total = ss.prefill_tokens + ss.decode_tokens;
    n.role = s->o.role;
    /* the quantiles sort up to WK_LAT_RING values: once per heartbeat interval is enough */
    uint64_t now = km_now_ns();
    if (now >= s->next_quant_ns) {
        const double qs[3] = {0.5, 0.9, 0.99};
        for (int i = 0; i < 3; i++)
            s->lat[i] =
                (km_latency_q){.q = qs[i],
                               .ttft_ms = wk_quantile(s->ttft_ring, s->n_ttft, qs[i], s->qtmp),
                               .tpot_ms = wk_quantile(s->tpot_ring, s->n_tpot, qs[i], s->qtmp)};
        s->next_quant_ns = now + wk_ms_ns(s->o.heartbeat_ms);
    }
    memcpy(n.lat, s->lat, sizeof n.lat);
    for (int i = 0; i < WK_BAD_COUNT; i++)
        if (s->errors[i]) n.errs[n.n_errs++] = (km_error_count){wk_bad_names[i], s->errors[i]};
    uint64_t send_errors = s->send_errors + atomic_load(&s->gate_send_errors);
    if (send_errors) n.errs[n.n_errs++] = (km_error_count){"send", send_errors};
    if (s->oom_errors) n.errs[n.n_errs++] = (km_error_count){"oom", s->oom_errors};
    if (ss.engine_errors) n.errs[n.n_errs++] = (km_error_count){"engine", ss.engine_errors};
    if (ss.kv_full) n.errs[n.n_errs++] = (km_error_count){"kv_full", ss.kv_full};
    wk_peer_heartbeat(s,
                      &n.peer); /* the transfer node is the loop's: read here, not by the pulse */
    for (uint32_t k = 0; k < n.peer.xfer.n_pairs && k < KM_PROTO_MAX_XFER_PAIRS; k++) {
        snprintf(n.pair_from[k], sizeof n.pair_from[k], "%s", n.peer.xfer.pairs[k].from);
        n.pairs[k] = n.peer.xfer.pairs[k];
    }
    n.peer.xfer.pairs = NULL; /* the pulse points it at its copy */
    pthread_mutex_lock(&s->hb_mu);
    s->snap = n;
    pthread_mutex_unlock(&s->hb_mu);
}

/* ---------------------------------------------------------------- the pulse (its own thread) */

/* One heartbeat from the latest snapshot (dropped, and counted, when it cannot leave now). */
static void wk_pulse_send(wk_service *s, wk_hb_snap *snap, km_buf *out)
{
    pthread_mutex_lock(&s->hb_mu);
    *snap = s->snap;
    pthread_mutex_unlock(&s->hb_mu);
    km_msg m;
    km_msg_init(&m, KM_MSG_HEARTBEAT);
    km_msg_heartbeat *hb = &m.hb;
    hb->worker = s->worker_id;
    hb->seq = ++s->hb_seq;
    hb->uptime_ms = (km_now_ns() - s->start_ns) / 1000000ull;
    hb->kv_format_base = kv_format_name(s->kv_base);
    hb->state = wk_svc_state(s);
    hb->role = snap->role;
    km_endpoint eps[3];
    int ne = 0;
    eps[ne++] = (km_endpoint){"requests", s->ep_requests};
    if (s->ep_events[0]) eps[ne++] = (km_endpoint){"events", s->ep_events};
    if (s->ep_admin[0]) eps[ne++] = (km_endpoint){"admin", s->ep_admin};
    hb->endpoints = eps;
    hb->n_endpoints = (uint32_t)ne;
    hb->model = s->model_base;
    hb->fingerprint = s->fp;
    hb->slots = (uint32_t)s->o.sched.max_running;
    hb->max_ctx = (uint32_t)s->o.sched.max_ctx;
    hb->page_tokens = snap->page_tokens; /* the pulse never touches the store */
    hb->kv = snap->kv;
    hb->n_kv = (uint32_t)snap->n_kv;
    hb->rss_bytes = wk_rss_bytes();
    hb->queue_depth = snap->queue_depth;
    hb->running = snap->running;
    hb->decode_tps = snap->decode_tps;
    hb->prefill_tps = snap->prefill_tps;
    hb->tokens_total = snap->tokens_total;
    hb->latency = snap->lat;
    hb->n_latency = 3;
    hb->errors = snap->errs;
    hb->n_errors = (uint32_t)snap->n_errs;
    hb->peer_addr = snap->peer.peer_addr; /* peer_addr, xfer: taken by the loop (service_peer.c) */
    hb->peer_addr_len = snap->peer.peer_addr_len;
    hb->has_xfer = snap->peer.has_xfer;
    hb->xfer = snap->peer.xfer;
    for (uint32_t k = 0; k < hb->xfer.n_pairs; k++) snap->pairs[k].from = snap->pair_from[k];
    hb->xfer.pairs = hb->xfer.n_pairs ? snap->pairs : NULL;
    km_errbuf err = {{0}};
    if (km_msg_encode(&m, &s->lim, out, &err)) {
        KM_WARN("heartbeat_encode", "msg=\"%s\"", err.msg);
        return;
    }
    km_zframe f = {out->data, out->len};
    if (km_zsend(s->ctl, &f, 1, KM_ZDONTWAIT, NULL))
        km_counter_inc(s->s_hb_dropped);
    else
        km_counter_inc(s->s_hb_sent);
}

/* Moves what is waiting on from (at most max messages) to to, unchanged. */
static void wk_pulse_forward(void *from, void *to, km_zmsg *zm, int max)
{
    for (int i = 0; i < max; i++) {
        int rc = km_zrecv(from, zm, 0, NULL);
        if (rc == KM_EAGAIN) break;
        if (rc) continue;
        km_zsend(to, zm->part, zm->n, KM_ZDONTWAIT, NULL);
    }
    km_zmsg_clear(zm);
}

static void *wk_pulse_main(void *arg)
{
    wk_service *s = arg;
    km_buf out = {0};
    km_zmsg zm = {0};
    wk_hb_snap *snap = malloc(sizeof *snap);
    uint64_t next_hb = km_now_ns();
    while (snap && !atomic_load(&s->hb_stop)) {
        uint64_t now = km_now_ns();
        if (now >= next_hb && !atomic_load(&s->in_command)) {
            wk_pulse_send(s, snap, &out);
            next_hb = now + wk_ms_ns(s->o.heartbeat_ms);
        }
        int64_t left = (int64_t)(next_hb - km_now_ns()) / 1000000;
        int timeout = left < 0 ? 0 : left > 100 ? 100 : (int)left;
        km_zpollitem items[2] = {{.sock = s->ctl, .events = KM_ZPOLLIN},
                                 {.sock = s->ctl_pulse, .events = KM_ZPOLLIN}};
        if (km_zpoll(items, 2, timeout, NULL) <= 0) continue;
        if (items[0].revents & KM_ZPOLLIN) wk_pulse_forward(s->ctl, s->ctl_pulse, &zm, 64);
        if (items[1].revents & KM_ZPOLLIN) wk_pulse_forward(s->ctl_pulse, s->ctl, &zm, 64);
    }
    /* the last word: the loop's final replies, then a heartbeat that says "stopping" */
    if (snap) {
        wk_pulse_forward(s->ctl_pulse, s->ctl, &zm, 64);
        wk_pulse_send(s, snap, &out);
    }
    free(snap);
    km_buf_free(&out);
    km_zmsg_clear(&zm);
    return NULL;
}

int wk_svc_pulse_start(wk_service *s, km_errbuf *err)
{
    if (!s->ctl) return 0;
    char ep[64];
    snprintf(ep, sizeof ep, "inproc://wk-pulse-%p", (void *)s);
    s->ctl_loop = zmq_socket(s->zctx, ZMQ_PAIR);
    s->ctl_pulse = zmq_socket(s->zctx, ZMQ_PAIR);
    if (!s->ctl_loop || !s->ctl_pulse || zmq_bind(s->ctl_pulse, ep) || zmq_connect(s->ctl_loop, ep))
        return km_errf(err, KM_EIO, "heartbeat: cannot open %s: %s", ep, zmq_strerror(zmq_errno()));
    wk_svc_snapshot(s);
    if (pthread_create(&s->hb_thread, NULL, wk_pulse_main, s))
        return km_errf(err, KM_EIO, "heartbeat: cannot start its thread");
    s->hb_started = true;
    return 0;
}

void wk_svc_pulse_stop(wk_service *s)
{
    if (!s->hb_started) return;
    wk_svc_snapshot(s);
    atomic_store(&s->hb_stop, 1);
    pthread_join(s->hb_thread, NULL);
    s->hb_started = false;
}
