/*
 * state.c — what every file of the worker daemon reads (service_internal.h): the worker's state
 * (an atomic: the pulse, the gate and the admin HTTP thread read it too), the names its metrics
 * and heartbeats give bad frames and outcomes, and the KV facts the admin commands, the gauges
 * and the heartbeats share. The bottom layer of worker/ (tests/check_layers.sh).
 */
#include "worker/service_internal.h"

const char *const wk_bad_names[WK_BAD_COUNT] = {"malformed",           "too_large",
                                                "unsupported_version", "unexpected_type",
                                                "too_many_parts",      "bad_field"};
const char *const wk_out_names[WK_OUT_COUNT] = {"ok",    "canceled", "deadline",
                                                "error", "rejected", "handed_back"};

void wk_svc_set_state(wk_service *s, km_worker_state st)
{
    atomic_store(&s->state, (int)st);
    km_gauge_set(s->s_ready, st == KM_STATE_READY);
}

km_worker_state wk_svc_state(wk_service *s)
{
    return (km_worker_state)atomic_load(&s->state);
}

kv_format wk_svc_kv_format(wk_service *s)
{
    kv_shard_stats sh;
    if (kv_store_shard_stats(s->kv, 0, &sh)) return KN_KV_F16;
    return sh.format;
}

/* Bytes of one ballast page: the current format's (int4 pages are written in f16 and only
 * sealed once full, which ballast pages never are). */
size_t wk_svc_ballast_page_bytes(wk_service *s)
{
    kv_format f = wk_svc_kv_format(s);
    return kv_store_format_page_bytes(s->kv, f == KN_KV_INT4 ? KN_KV_F16 : f);
}

size_t wk_svc_ballast_bytes(wk_service *s)
{
    return (size_t)s->ballast_pages * wk_svc_ballast_page_bytes(s);
}
