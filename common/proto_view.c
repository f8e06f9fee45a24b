/*
 * proto_view.c — the cluster view (docs/protocol.md section 13): the controller's picture of
 * every worker (membership state, recovery level, endpoints, load, recent recovery actions),
 * published to routers and answered to an operator's `status`. One codec.
 *
 * Worker ids are unique within a view (a router matches members to its workers by them and by
 * endpoint); everything but the id and state of a worker is optional, so a controller may list a
 * worker before its first heartbeat with endpoints arrived.
 */
#include <stdio.h>
#include <string.h>

#include "common/proto_internal.h"

/* ---------------------------------------------------------------- validation */

static int view_validate_worker(const km_msg_view *v, uint32_t i, km_errbuf *err)
{
    const km_view_worker *w = &v->workers[i];
    char what[64];
    const struct {
        const char *field, *value;
        bool required;
    } names[] = {{"id", w->id, true},          {"requests", w->requests, false},
                 {"events", w->events, false}, {"admin", w->admin, false},
                 {"model", w->model, false},   {"fingerprint", w->fingerprint, false}};
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
        snprintf(what, sizeof what, "view.workers[%u].%s", i, names[k].field);
        CK(km_val_name(what, names[k].value, names[k].required, names[k].required ? 1 : 0,
                       KM_PROTO_MAX_NAME, err));
    }
    for (uint32_t j = 0; j < i; j++)
        if (strcmp(w->id, v->workers[j].id) == 0)
            VFAIL("view.workers: duplicate id '%s' (entries %u and %u)", w->id, j, i);
    if ((unsigned)w->state >= KM_MEMBER_STATE_COUNT)
        VFAIL("view.workers[%u].state: unknown state %d", i, (int)w->state);
    if (w->level > 3) VFAIL("view.workers[%u].level: %u outside [0, 3]", i, w->level);
    if (w->kv_format && !km_proto_is_format(w->kv_format))
        VFAIL("view.workers[%u].kv_format: unknown KV format '%s'", i, w->kv_format);
    snprintf(what, sizeof what, "view.workers[%u].pressure", i);
    CK(km_val_nonneg(what, w->pressure, err));
    if (w->peer_addr && (w->peer_addr_len < 1 || w->peer_addr_len > KM_PROTO_MAX_PEER_ADDR))
        VFAIL("view.workers[%u].peer_addr: %u bytes outside [1, %d]", i, w->peer_addr_len,
              KM_PROTO_MAX_PEER_ADDR);
    if ((unsigned)w->role >= KM_WROLE_COUNT)
        VFAIL("view.workers[%u].role: unknown role %d", i, (int)w->role);
    const struct {
        const char *field;
        double value;
    } rates[] = {{"prefill_tps", w->prefill_tps},
                 {"xfer_rate_bps", w->xfer_rate_bps},
                 {"xfer_lat_ms", w->xfer_lat_ms}};
    for (size_t k = 0; k < sizeof rates / sizeof rates[0]; k++) {
        snprintf(what, sizeof what, "view.workers[%u].%s", i, rates[k].field);
        CK(km_val_nonneg(what, rates[k].value, err));
    }
    snprintf(what, sizeof what, "view.workers[%u].xfer_pairs", i);
    CK(km_val_xfer_pairs(what, w->xfer_pairs, w->n_xfer_pairs, err));
    if (w->n_history > KM_PROTO_MAX_HISTORY)
        VFAIL("view.workers[%u].history: %u entries, limit %d", i, w->n_history,
              KM_PROTO_MAX_HISTORY);
    if (w->n_history && !w->history)
        VFAIL("view.workers[%u].history: NULL with n_history %u", i, w->n_history);
    for (uint32_t k = 0; k < w->n_history; k++) {
        const km_recovery_action *a = &w->history[k];
        if (a->level > 3)
            VFAIL("view.workers[%u].history[%u].level: %u outside [0, 3]", i, k, a->level);
        snprintf(what, sizeof what, "view.workers[%u].history[%u].reason", i, k);
        CK(km_val_name(what, a->reason, true, 1, KM_PROTO_MAX_NAME, err));
    }
    return 0;
}

static int view_validate(const km_msg *m, const km_proto_limits *lim, km_errbuf *err)
{
    const km_msg_view *v = &m->view;
    CK(km_val_name("view.controller", v->controller, true, 1, KM_PROTO_MAX_NAME, err));
    if (v->n_workers > KM_PROTO_MAX_VIEW_WORKERS)
        VFAIL("view.workers: %u entries, limit %d", v->n_workers, KM_PROTO_MAX_VIEW_WORKERS);
    if (v->n_workers && !v->workers) VFAIL("view.workers: NULL with n_workers %u", v->n_workers);
    for (uint32_t i = 0; i < v->n_workers; i++) CK(view_validate_worker(v, i, err));
    return 0;
}

/* ---------------------------------------------------------------- encoding */

static void view_action(km_enc *e, const void *arg)
{
    const km_recovery_action *a = arg;
    km_enc_u64(e, "at_ms", a->at_ms);
    km_enc_u64(e, "level", a->level);
    km_enc_str(e, "reason", a->reason);
    km_enc_bool(e, "ok", a->ok);
}

static void view_worker(km_enc *e, const void *arg)
{
    const km_view_worker *w = arg;
    km_enc_str(e, "id", w->id);
    km_enc_str(e, "state", km_proto_member_names[w->state]);
    km_enc_u64(e, "level", w->level);
    km_enc_str(e, "requests", w->requests);
    km_enc_str(e, "events", w->events);
    km_enc_str(e, "admin", w->admin);
    km_enc_str(e, "model", w->model);
    km_enc_str(e, "fingerprint", w->fingerprint);
    km_enc_str(e, "kv_format", w->kv_format);
    km_enc_f64(e, "pressure", w->pressure);
    km_enc_u64(e, "last_seen_ms", w->last_seen_ms);
    km_enc_u64(e, "running", w->running);
    km_enc_u64(e, "queue_depth", w->queue_depth);
    km_enc_bin(e, "peer_addr", w->peer_addr, w->peer_addr_len);
    if (w->prefill_tps > 0) km_enc_f64(e, "prefill_tps", w->prefill_tps);
    if (w->xfer_rate_bps > 0) km_enc_f64(e, "xfer_rate_bps", w->xfer_rate_bps);
    if (w->xfer_lat_ms > 0) km_enc_f64(e, "xfer_lat_ms", w->xfer_lat_ms);
    if (w->page_bytes) km_enc_u64(e, "page_bytes", w->page_bytes);
    if (w->xfer_bytes_in) km_enc_u64(e, "xfer_bytes_in", w->xfer_bytes_in);
    if (w->xfer_bytes_out) km_enc_u64(e, "xfer_bytes_out", w->xfer_bytes_out);
    if (w->n_xfer_pairs) km_enc_xfer_pairs(e, "xfer_pairs", w->xfer_pairs, w->n_xfer_pairs);
    if (w->role != KM_WROLE_BOTH) km_enc_str(e, "role", km_proto_role_names[w->role]);
    if (km_enc_begin(e, "history")) {
        e->rc |= msgpack_pack_array(&e->pk, w->n_history);
        for (uint32_t i = 0; i < w->n_history; i++) km_enc_map(e, view_action, &w->history[i]);
    }
}

static void view_encode(km_enc *e, const km_msg *m)
{
    const km_msg_view *v = &m->view;
    km_enc_str(e, "controller", v->controller);
    km_enc_u64(e, "epoch", v->epoch);
    km_enc_u64(e, "seq", v->seq);
    if (km_enc_begin(e, "workers")) {
        e->rc |= msgpack_pack_array(&e->pk, v->n_workers);
        for (uint32_t i = 0; i < v->n_workers; i++) km_enc_map(e, view_worker, &v->workers[i]);
    }
}

/* ---------------------------------------------------------------- decoding */

static int view_decode_worker(km_dec *d, const msgpack_object_map *mp, km_view_worker *w)
{
    int st = 0;
    size_t n0 = strlen(d->path);
    CK(km_dec_str(d, mp, "id", true, KM_PROTO_MAX_NAME, false, &w->id, NULL));
    CK(km_dec_enum(d, mp, "state", true, km_proto_member_names, KM_MEMBER_STATE_COUNT, &st));
    w->state = (km_member_state)st;
    CK(km_dec_u32(d, mp, "level", false, &w->level));
    CK(km_dec_str(d, mp, "requests", false, KM_PROTO_MAX_NAME, false, &w->requests, NULL));
    CK(km_dec_str(d, mp, "events", false, KM_PROTO_MAX_NAME, false, &w->events, NULL));
    CK(km_dec_str(d, mp, "admin", false, KM_PROTO_MAX_NAME, false, &w->admin, NULL));
    CK(km_dec_str(d, mp, "model", false, KM_PROTO_MAX_NAME, false, &w->model, NULL));
    CK(km_dec_str(d, mp, "fingerprint", false, KM_PROTO_MAX_NAME, false, &w->fingerprint, NULL));
    CK(km_dec_str(d, mp, "kv_format", false, KM_PROTO_MAX_NAME, false, &w->kv_format, NULL));
    CK(km_dec_num(d, mp, "pressure", false, &w->pressure));
    CK(km_dec_uint(d, mp, "last_seen_ms", false, UINT64_MAX, &w->last_seen_ms));
    CK(km_dec_u32(d, mp, "running", false, &w->running));
    CK(km_dec_u32(d, mp, "queue_depth", false, &w->queue_depth));
    CK(km_dec_bin(d, mp, "peer_addr", false, KM_PROTO_MAX_PEER_ADDR, &w->peer_addr,
                  &w->peer_addr_len));
    CK(km_dec_num(d, mp, "prefill_tps", false, &w->prefill_tps));
    int role = KM_WROLE_BOTH;
    CK(km_dec_enum(d, mp, "role", false, km_proto_role_names, KM_WROLE_COUNT, &role));
    w->role = (km_worker_role)role;
    CK(km_dec_num(d, mp, "xfer_rate_bps", false, &w->xfer_rate_bps));
    CK(km_dec_num(d, mp, "xfer_lat_ms", false, &w->xfer_lat_ms));
    CK(km_dec_uint(d, mp, "page_bytes", false, UINT64_MAX, &w->page_bytes));
    CK(km_dec_uint(d, mp, "xfer_bytes_in", false, UINT64_MAX, &w->xfer_bytes_in));
    CK(km_dec_uint(d, mp, "xfer_bytes_out", false, UINT64_MAX, &w->xfer_bytes_out));
    CK(km_dec_xfer_pairs(d, mp, "xfer_pairs", n0, &w->xfer_pairs, &w->n_xfer_pairs));
    const msgpack_object_array *a;
    void *mem;
    CK(km_dec_array(d, mp, "history", false, KM_PROTO_MAX_HISTORY, sizeof(km_recovery_action), &a,
                    &mem));
    km_recovery_action *h = mem;
    for (uint32_t i = 0; a && i < a->size; i++) {
        const msgpack_object_map *em;
        CK(km_dec_array_map(d, a, i, n0, ".history", &em));
        CK(km_dec_uint(d, em, "at_ms", false, UINT64_MAX, &h[i].at_ms));
        CK(km_dec_u32(d, em, "level", true, &h[i].level));
        CK(km_dec_str(d, em, "reason", true, KM_PROTO_MAX_NAME, false, &h[i].reason, NULL));
        CK(km_dec_bool(d, em, "ok", false, &h[i].ok));
    }
    km_dec_path_set(d, n0);
    w->history = h;
    w->n_history = a ? a->size : 0;
    return 0;
}

static int view_decode(km_dec *d, const msgpack_object_map *mp)
{
    km_msg_view *v = &d->m->view;
    size_t n0 = strlen(d->path);
    CK(km_dec_str(d, mp, "controller", true, KM_PROTO_MAX_NAME, false, &v->controller, NULL));
    CK(km_dec_uint(d, mp, "epoch", false, UINT64_MAX, &v->epoch));
    CK(km_dec_uint(d, mp, "seq", true, UINT64_MAX, &v->seq));
    const msgpack_object_array *a;
    void *mem;
    CK(km_dec_array(d, mp, "workers", true, KM_PROTO_MAX_VIEW_WORKERS, sizeof(km_view_worker), &a,
                    &mem));
    km_view_worker *w = mem;
    for (uint32_t i = 0; a && i < a->size; i++) {
        const msgpack_object_map *em;
        CK(km_dec_array_map(d, a, i, n0, ".workers", &em));
        CK(view_decode_worker(d, em, &w[i]));
    }
    km_dec_path_set(d, n0);
    v->workers = w;
    v->n_workers = a ? a->size : 0;
    return 0;
}

const km_proto_codec km_proto_codec_view = {view_validate, view_encode, view_decode};
