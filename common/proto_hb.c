/*
 * proto_hb.c — the heartbeat (docs/protocol.md section 11): what a worker tells the controller
 * once a second about itself (state, endpoints, capacity, KV use per shard and tier, load,
 * latency quantiles, error counts). One codec, written with the helpers of proto_wire.c.
 *
 * Every section but the worker, seq and state is optional, so a heartbeat from an older worker
 * (without pinned_bytes, tokens_total, kv_format_base) decodes with those at 0 / NULL.
 */
#include <stdio.h>
#include <string.h>

#include "common/proto_internal.h"

/* ---------------------------------------------------------------- validation */

static int hb_validate_endpoints(const km_msg_heartbeat *h, km_errbuf *err)
{
    char what[48];
    if (h->n_endpoints > KM_PROTO_MAX_ENDPOINTS)
        VFAIL("hb.endpoints: %u entries, limit %d", h->n_endpoints, KM_PROTO_MAX_ENDPOINTS);
    if (h->n_endpoints && !h->endpoints) VFAIL("hb.endpoints: NULL");
    for (uint32_t i = 0; i < h->n_endpoints; i++) {
        snprintf(what, sizeof what, "hb.endpoints[%u].name", i);
        CK(km_val_name(what, h->endpoints[i].name, true, 1, KM_PROTO_MAX_NAME, err));
        snprintf(what, sizeof what, "hb.endpoints[%u].url", i);
        CK(km_val_name(what, h->endpoints[i].url, true, 1, KM_PROTO_MAX_NAME, err));
        for (uint32_t j = 0; j < i; j++)
            if (strcmp(h->endpoints[i].name, h->endpoints[j].name) == 0)
                VFAIL("hb.endpoints: duplicate name '%s'", h->endpoints[i].name);
    }
    return 0;
}

static int hb_validate_kv(const km_msg_heartbeat *h, km_errbuf *err)
{
    if (h->n_kv > KM_PROTO_MAX_KV_ENTRIES)
        VFAIL("hb.kv: %u entries, limit %d", h->n_kv, KM_PROTO_MAX_KV_ENTRIES);
    if (h->n_kv && !h->kv) VFAIL("hb.kv: NULL");
    for (uint32_t i = 0; i < h->n_kv; i++) {
        const km_kv_usage *u = &h->kv[i];
        if (u->shard > 65535) VFAIL("hb.kv[%u].shard: %u outside [0, 65535]", i, u->shard);
        if ((unsigned)u->tier >= KM_TIER_COUNT)
            VFAIL("hb.kv[%u].tier: unknown tier %d", i, (int)u->tier);
        if (!km_proto_is_format(u->format))
            VFAIL("hb.kv[%u].format: unknown KV format '%s'", i, u->format ? u->format : "");
        if (u->pinned_bytes > u->bytes)
            VFAIL("hb.kv[%u].pinned_bytes: %llu > bytes %llu", i,
                  (unsigned long long)u->pinned_bytes, (unsigned long long)u->bytes);
    }
    return 0;
}

static int hb_validate_latency_errors(const km_msg_heartbeat *h, km_errbuf *err)
{
    char what[48];
    if (h->n_latency > KM_PROTO_MAX_QUANTILES)
        VFAIL("hb.latency: %u entries, limit %d", h->n_latency, KM_PROTO_MAX_QUANTILES);
    if (h->n_latency && !h->latency) VFAIL("hb.latency: NULL");
    for (uint32_t i = 0; i < h->n_latency; i++) {
        const km_latency_q *q = &h->latency[i];
        if (!(q->q > 0 && q->q <= 1)) VFAIL("hb.latency[%u].q: %g outside (0, 1]", i, q->q);
        snprintf(what, sizeof what, "hb.latency[%u].ttft_ms", i);
        CK(km_val_nonneg(what, q->ttft_ms, err));
        snprintf(what, sizeof what, "hb.latency[%u].tpot_ms", i);
        CK(km_val_nonneg(what, q->tpot_ms, err));
    }
    if (h->n_errors > KM_PROTO_MAX_ERROR_KINDS)
        VFAIL("hb.errors: %u entries, limit %d", h->n_errors, KM_PROTO_MAX_ERROR_KINDS);
    if (h->n_errors && !h->errors) VFAIL("hb.errors: NULL");
    for (uint32_t i = 0; i < h->n_errors; i++) {
        snprintf(what, sizeof what, "hb.errors[%u].name", i);
        CK(km_val_name(what, h->errors[i].name, true, 1, KM_PROTO_MAX_NAME, err));
        for (uint32_t j = 0; j < i; j++)
            if (strcmp(h->errors[i].name, h->errors[j].name) == 0)
                VFAIL("hb.errors: duplicate name '%s'", h->errors[i].name);
    }
    return 0;
}

static int hb_validate(const km_msg *m, const km_proto_limits *lim, km_errbuf *err)
{
    const km_msg_heartbeat *h = &m->hb;
    CK(km_val_name("hb.worker", h->worker, true, 1, KM_PROTO_MAX_NAME, err));
    if ((unsigned)h->state >= KM_STATE_COUNT) VFAIL("hb.state: unknown state %d", (int)h->state);
    if ((unsigned)h->role >= KM_WROLE_COUNT) VFAIL("hb.role: unknown role %d", (int)h->role);
    CK(km_val_name("hb.model", h->model, false, 0, KM_PROTO_MAX_NAME, err));
    if (h->kv_format_base && !km_proto_is_format(h->kv_format_base))
        VFAIL("hb.kv_format_base: unknown KV format '%s'", h->kv_format_base);
    CK(km_val_name("hb.fingerprint", h->fingerprint, false, 0, KM_PROTO_MAX_NAME, err));
    CK(hb_validate_endpoints(h, err));
    CK(hb_validate_kv(h, err));
    CK(km_val_nonneg("hb.decode_tps", h->decode_tps, err));
    CK(km_val_nonneg("hb.prefill_tps", h->prefill_tps, err));
    if (h->peer_addr && (h->peer_addr_len < 1 || h->peer_addr_len > KM_PROTO_MAX_PEER_ADDR))
        VFAIL("hb.peer_addr: %u bytes outside [1, %d]", h->peer_addr_len, KM_PROTO_MAX_PEER_ADDR);
    if (h->has_xfer) {
        CK(km_val_nonneg("hb.xfer.rate_bps", h->xfer.rate_bps, err));
        CK(km_val_nonneg("hb.xfer.latency_ms", h->xfer.latency_ms, err));
        CK(km_val_xfer_pairs("hb.xfer.pairs", h->xfer.pairs, h->xfer.n_pairs, err));
    }
    return hb_validate_latency_errors(h, err);
}

/* ---------------------------------------------------------------- encoding */

static void hb_kv_usage(km_enc *e, const void *arg)
{
    const km_kv_usage *u = arg;
    km_enc_u64(e, "shard", u->shard);
    km_enc_u64(e, "tier", (uint64_t)u->tier);
    km_enc_str(e, "format", u->format);
    km_enc_u64(e, "pages", u->pages);
    km_enc_u64(e, "bytes", u->bytes);
    km_enc_u64(e, "capacity_bytes", u->capacity_bytes);
    km_enc_u64(e, "pinned_bytes", u->pinned_bytes);
}

static void hb_latency(km_enc *e, const void *arg)
{
    const km_latency_q *q = arg;
    km_enc_f64(e, "q", q->q);
    km_enc_f64(e, "ttft_ms", q->ttft_ms);
    km_enc_f64(e, "tpot_ms", q->tpot_ms);
}

static void hb_xfer(km_enc *e, const void *arg)
{
    const km_xfer_stats *x = arg;
    km_enc_u64(e, "bytes_in", x->bytes_in);
    km_enc_u64(e, "bytes_out", x->bytes_out);
    km_enc_u64(e, "pages_in", x->pages_in);
    km_enc_u64(e, "pages_out", x->pages_out);
    km_enc_u64(e, "pulls_ok", x->pulls_ok);
    km_enc_u64(e, "pulls_failed", x->pulls_failed);
    km_enc_u64(e, "offers", x->offers);
    km_enc_f64(e, "rate_bps", x->rate_bps);
    km_enc_f64(e, "latency_ms", x->latency_ms);
    km_enc_u64(e, "page_bytes", x->page_bytes);
    if (x->n_pairs) km_enc_xfer_pairs(e, "pairs", x->pairs, x->n_pairs);
}

static void hb_xfer_pair(km_enc *e, const void *arg)
{
    const km_xfer_pair *p = arg;
    km_enc_str(e, "from", p->from);
    km_enc_f64(e, "rate_bps", p->rate_bps);
    km_enc_f64(e, "latency_ms", p->latency_ms);
}

void km_enc_xfer_pairs(km_enc *e, const char *key, const km_xfer_pair *p, uint32_t n)
{
    if (!km_enc_begin(e, key)) return;
    e->rc |= msgpack_pack_array(&e->pk, n);
    for (uint32_t i = 0; i < n; i++) km_enc_map(e, hb_xfer_pair, &p[i]);
}

int km_dec_xfer_pairs(km_dec *d, const msgpack_object_map *mp, const char *key, size_t n0,
                      const km_xfer_pair **out, uint32_t *n)
{
    const msgpack_object_array *a;
    void *mem;
    char what[64];
    snprintf(what, sizeof what, ".%s", key);
    CK(km_dec_array(d, mp, key, false, KM_PROTO_MAX_XFER_PAIRS, sizeof(km_xfer_pair), &a, &mem));
    km_xfer_pair *p = mem;
    for (uint32_t i = 0; a && i < a->size; i++) {
        const msgpack_object_map *em;
        CK(km_dec_array_map(d, a, i, n0, what, &em));
        CK(km_dec_str(d, em, "from", true, KM_PROTO_MAX_NAME, false, &p[i].from, NULL));
        CK(km_dec_num(d, em, "rate_bps", true, &p[i].rate_bps));
        CK(km_dec_num(d, em, "latency_ms", false, &p[i].latency_ms));
    }
    km_dec_path_set(d, n0);
    *out = p;
    *n = a ? a->size : 0;
    return 0;
}

int km_val_xfer_pairs(const char *what, const km_xfer_pair *p, uint32_t n, km_errbuf *err)
{
    if (n > KM_PROTO_MAX_XFER_PAIRS)
        return km_errf(err, KM_EFORMAT, "%s: %u entries, limit %d", what, n,
                       KM_PROTO_MAX_XFER_PAIRS);
    if (n && !p) return km_errf(err, KM_EFORMAT, "%s: NULL with %u entries", what, n);
    for (uint32_t i = 0; i < n; i++) {
        if (!p[i].from || !p[i].from[0])
            return km_errf(err, KM_EFORMAT, "%s[%u].from: required", what, i);
        if (!(p[i].rate_bps > 0))
            return km_errf(err, KM_EFORMAT, "%s[%u].rate_bps: must be > 0", what, i);
        if (!(p[i].latency_ms >= 0))
            return km_errf(err, KM_EFORMAT, "%s[%u].latency_ms: must be >= 0", what, i);
    }
    return 0;
}

static void hb_encode(km_enc *e, const km_msg *m)
{
    const km_msg_heartbeat *h = &m->hb;
    km_enc_str(e, "worker", h->worker);
    km_enc_u64(e, "seq", h->seq);
    km_enc_u64(e, "uptime_ms", h->uptime_ms);
    km_enc_str(e, "state", km_proto_state_names[h->state]);
    if (km_enc_begin(e, "endpoints")) {
        e->rc |= msgpack_pack_map(&e->pk, h->n_endpoints);
        for (uint32_t i = 0; i < h->n_endpoints; i++) {
            km_enc_key(e, h->endpoints[i].name);
            km_enc_text(e, h->endpoints[i].url, strlen(h->endpoints[i].url));
        }
    }
    km_enc_str(e, "model", h->model);
    km_enc_str(e, "fingerprint", h->fingerprint);
    km_enc_u64(e, "slots", h->slots);
    km_enc_u64(e, "max_ctx", h->max_ctx);
    km_enc_u64(e, "page_tokens", h->page_tokens);
    if (km_enc_begin(e, "kv")) {
        e->rc |= msgpack_pack_array(&e->pk, h->n_kv);
        for (uint32_t i = 0; i < h->n_kv; i++) km_enc_map(e, hb_kv_usage, &h->kv[i]);
    }
    km_enc_u64(e, "rss_bytes", h->rss_bytes);
    km_enc_u64(e, "gpu_bytes", h->gpu_bytes);
    km_enc_u64(e, "queue_depth", h->queue_depth);
    km_enc_u64(e, "running", h->running);
    km_enc_f64(e, "decode_tps", h->decode_tps);
    km_enc_f64(e, "prefill_tps", h->prefill_tps);
    km_enc_u64(e, "tokens_total", h->tokens_total);
    km_enc_str(e, "kv_format_base", h->kv_format_base);
    km_enc_bin(e, "peer_addr", h->peer_addr, h->peer_addr_len);
    if (h->role != KM_WROLE_BOTH) km_enc_str(e, "role", km_proto_role_names[h->role]);
    if (h->has_xfer && km_enc_begin(e, "xfer")) km_enc_map(e, hb_xfer, &h->xfer);
    if (km_enc_begin(e, "latency")) {
        e->rc |= msgpack_pack_array(&e->pk, h->n_latency);
        for (uint32_t i = 0; i < h->n_latency; i++) km_enc_map(e, hb_latency, &h->latency[i]);
    }
    if (km_enc_begin(e, "errors")) {
        e->rc |= msgpack_pack_map(&e->pk, h->n_errors);
        for (uint32_t i = 0; i < h->n_errors; i++) {
            km_enc_key(e, h->errors[i].name);
            e->rc |= msgpack_pack_uint64(&e->pk, h->errors[i].count);
        }
    }
}

/* ---------------------------------------------------------------- decoding */

/* endpoints: a map of name -> URL */
static int hb_decode_endpoints(km_dec *d, const msgpack_object_map *mp, size_t n0)
{
    km_msg_heartbeat *h = &d->m->hb;
    const msgpack_object_map *em;
    void *mem;
    CK(km_dec_named_map(d, mp, "endpoints", KM_PROTO_MAX_ENDPOINTS, sizeof(km_endpoint), &em,
                        &mem));
    if (!em) return 0;
    km_endpoint *ep = mem;
    for (uint32_t i = 0; i < em->size; i++) {
        CK(km_dec_copy_str(d, "hb.endpoints key", &em->ptr[i].key, KM_PROTO_MAX_NAME, false,
                           &ep[i].name, NULL));
        char what[300];
        snprintf(what, sizeof what, "hb.endpoints.%s", ep[i].name);
        CK(km_dec_copy_str(d, what, &em->ptr[i].val, KM_PROTO_MAX_NAME, false, &ep[i].url, NULL));
    }
    h->endpoints = ep;
    h->n_endpoints = em->size;
    km_dec_path_set(d, n0);
    return 0;
}

static int hb_decode_kv(km_dec *d, const msgpack_object_map *mp, size_t n0)
{
    km_msg_heartbeat *h = &d->m->hb;
    const msgpack_object_array *a;
    void *mem;
    CK(km_dec_array(d, mp, "kv", false, KM_PROTO_MAX_KV_ENTRIES, sizeof(km_kv_usage), &a, &mem));
    km_kv_usage *u = mem;
    for (uint32_t i = 0; a && i < a->size; i++) {
        const msgpack_object_map *em;
        CK(km_dec_array_map(d, a, i, n0, ".kv", &em));
        CK(km_dec_u32(d, em, "shard", true, &u[i].shard));
        CK(km_dec_tier(d, em, "tier", true, &u[i].tier));
        CK(km_dec_str(d, em, "format", true, KM_PROTO_MAX_NAME, false, &u[i].format, NULL));
        CK(km_dec_uint(d, em, "pages", false, UINT64_MAX, &u[i].pages));
        CK(km_dec_uint(d, em, "bytes", true, UINT64_MAX, &u[i].bytes));
        CK(km_dec_uint(d, em, "capacity_bytes", false, UINT64_MAX, &u[i].capacity_bytes));
        CK(km_dec_uint(d, em, "pinned_bytes", false, UINT64_MAX, &u[i].pinned_bytes));
    }
    km_dec_path_set(d, n0);
    h->kv = u;
    h->n_kv = a ? a->size : 0;
    return 0;
}

static int hb_decode_latency(km_dec *d, const msgpack_object_map *mp, size_t n0)
{
    km_msg_heartbeat *h = &d->m->hb;
    const msgpack_object_array *a;
    void *mem;
    CK(km_dec_array(d, mp, "latency", false, KM_PROTO_MAX_QUANTILES, sizeof(km_latency_q), &a,
                    &mem));
    km_latency_q *q = mem;
    for (uint32_t i = 0; a && i < a->size; i++) {
        const msgpack_object_map *em;
        CK(km_dec_array_map(d, a, i, n0, ".latency", &em));
        CK(km_dec_num(d, em, "q", true, &q[i].q));
        CK(km_dec_num(d, em, "ttft_ms", false, &q[i].ttft_ms));
        CK(km_dec_num(d, em, "tpot_ms", false, &q[i].tpot_ms));
    }
    km_dec_path_set(d, n0);
    h->latency = q;
    h->n_latency = a ? a->size : 0;
    return 0;
}

/* errors: a map of kind -> count */
static int hb_decode_errors(km_dec *d, const msgpack_object_map *mp, size_t n0)
{
    km_msg_heartbeat *h = &d->m->hb;
    const msgpack_object_map *em;
    void *mem;
    CK(km_dec_named_map(d, mp, "errors", KM_PROTO_MAX_ERROR_KINDS, sizeof(km_error_count), &em,
                        &mem));
    if (!em) return 0;
    km_error_count *ec = mem;
    for (uint32_t i = 0; i < em->size; i++) {
        CK(km_dec_copy_str(d, "hb.errors key", &em->ptr[i].key, KM_PROTO_MAX_NAME, false,
                           &ec[i].name, NULL));
        const msgpack_object *v = &em->ptr[i].val;
        if (v->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
            return DFAIL(d, KM_EFORMAT, "hb.errors.%s: expected an unsigned integer, got %s",
                         ec[i].name, km_dec_type_name(v->type));
        ec[i].count = v->via.u64;
    }
    h->errors = ec;
    h->n_errors = em->size;
    km_dec_path_set(d, n0);
    return 0;
}

/* xfer: a map of transfer statistics */
static int hb_decode_xfer(km_dec *d, const msgpack_object_map *mp, size_t n0)
{
    km_xfer_stats *x = &d->m->hb.xfer;
    const msgpack_object *o;
    CK(km_dec_obj(d, mp, "xfer", false, MSGPACK_OBJECT_MAP, &o));
    if (!o) return 0;
    const msgpack_object_map *xm = &o->via.map;
    km_dec_path_push(d, ".xfer");
    CK(km_dec_check_map(d, xm));
    CK(km_dec_uint(d, xm, "bytes_in", false, UINT64_MAX, &x->bytes_in));
    CK(km_dec_uint(d, xm, "bytes_out", false, UINT64_MAX, &x->bytes_out));
    CK(km_dec_uint(d, xm, "pages_in", false, UINT64_MAX, &x->pages_in));
    CK(km_dec_uint(d, xm, "pages_out", false, UINT64_MAX, &x->pages_out));
    CK(km_dec_uint(d, xm, "pulls_ok", false, UINT64_MAX, &x->pulls_ok));
    CK(km_dec_uint(d, xm, "pulls_failed", false, UINT64_MAX, &x->pulls_failed));
    CK(km_dec_uint(d, xm, "offers", false, UINT64_MAX, &x->offers));
    CK(km_dec_num(d, xm, "rate_bps", false, &x->rate_bps));
    CK(km_dec_num(d, xm, "latency_ms", false, &x->latency_ms));
    CK(km_dec_uint(d, xm, "page_bytes", false, UINT64_MAX, &x->page_bytes));
    CK(km_dec_xfer_pairs(d, xm, "pairs", strlen(d->path), &x->pairs, &x->n_pairs));
    km_dec_path_set(d, n0);
    d->m->hb.has_xfer = true;
    return 0;
}

static int hb_decode(km_dec *d, const msgpack_object_map *mp)
{
    km_msg_heartbeat *h = &d->m->hb;
    int st = 0;
    size_t n0 = strlen(d->path);
    CK(km_dec_str(d, mp, "worker", true, KM_PROTO_MAX_NAME, false, &h->worker, NULL));
    CK(km_dec_uint(d, mp, "seq", true, UINT64_MAX, &h->seq));
    CK(km_dec_uint(d, mp, "uptime_ms", false, UINT64_MAX, &h->uptime_ms));
    CK(km_dec_enum(d, mp, "state", true, km_proto_state_names, KM_STATE_COUNT, &st));
    h->state = (km_worker_state)st;
    CK(hb_decode_endpoints(d, mp, n0));
    CK(km_dec_str(d, mp, "model", false, KM_PROTO_MAX_NAME, false, &h->model, NULL));
    CK(km_dec_str(d, mp, "fingerprint", false, KM_PROTO_MAX_NAME, false, &h->fingerprint, NULL));
    CK(km_dec_u32(d, mp, "slots", false, &h->slots));
    CK(km_dec_u32(d, mp, "max_ctx", false, &h->max_ctx));
    CK(km_dec_u32(d, mp, "page_tokens", false, &h->page_tokens));
    CK(hb_decode_kv(d, mp, n0));
    CK(km_dec_uint(d, mp, "rss_bytes", false, UINT64_MAX, &h->rss_bytes));
    CK(km_dec_uint(d, mp, "gpu_bytes", false, UINT64_MAX, &h->gpu_bytes));
    CK(km_dec_u32(d, mp, "queue_depth", false, &h->queue_depth));
    CK(km_dec_u32(d, mp, "running", false, &h->running));
    CK(km_dec_num(d, mp, "decode_tps", false, &h->decode_tps));
    CK(km_dec_num(d, mp, "prefill_tps", false, &h->prefill_tps));
    CK(km_dec_uint(d, mp, "tokens_total", false, UINT64_MAX, &h->tokens_total));
    CK(km_dec_str(d, mp, "kv_format_base", false, KM_PROTO_MAX_NAME, false, &h->kv_format_base,
                  NULL));
    CK(km_dec_bin(d, mp, "peer_addr", false, KM_PROTO_MAX_PEER_ADDR, &h->peer_addr,
                  &h->peer_addr_len));
    int role = KM_WROLE_BOTH;
    CK(km_dec_enum(d, mp, "role", false, km_proto_role_names, KM_WROLE_COUNT, &role));
    h->role = (km_worker_role)role;
    CK(hb_decode_xfer(d, mp, n0));
    CK(hb_decode_latency(d, mp, n0));
    return hb_decode_errors(d, mp, n0);
}

const km_proto_codec km_proto_codec_hb = {hb_validate, hb_encode, hb_decode};
