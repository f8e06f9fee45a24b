/*
 * proto.c — the kvmesh wire protocol: every message as one msgpack map with "v" (version) and
 * "t" (type), encoded from and decoded into km_msg; plus km_buf, the growable byte buffer the
 * encoders here write into. docs/protocol.md is the specification; keep the two in step.
 *
 * Why it is built this way:
 *  - Decoding is two passes. A bounds-checking scan walks the raw bytes first (every length and
 *    element count must fit in what is left of the frame, depth is capped, trailing bytes are an
 *    error), and only then does msgpack-c build its object tree. msgpack-c allocates an array's
 *    elements as soon as it reads the count, so without the scan a 5-byte frame claiming 2^32
 *    elements would ask for 100 GB; after it, the tree is at most a small multiple of the frame.
 *  - Wire types are checked while reading the tree (integers must fit their C field); value
 *    ranges are checked by km_msg_validate, which the encoder also runs, so a sender can never
 *    emit a frame the receiver rejects.
 *  - Everything a decoded message points to lives in its own allocations (mem_), freed at once by
 *    km_msg_clear, so no string outlives or aliases the receive buffer.
 */
#include "common/svc.h"

#include <math.h>
#include <msgpack.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- km_buf */

int km_buf_reserve(km_buf *b, size_t extra)
{
    if (extra <= b->cap - b->len) return 0;
    if (extra > SIZE_MAX / 2 - b->len) return KM_ENOMEM;
    size_t need = b->len + extra;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < need) cap *= 2;
    uint8_t *p = realloc(b->data, cap);
    if (!p) return KM_ENOMEM;
    b->data = p;
    b->cap = cap;
    return 0;
}

int km_buf_append(km_buf *b, const void *p, size_t n)
{
    if (n == 0) return 0;
    int rc = km_buf_reserve(b, n);
    if (rc) return rc;
    memcpy(b->data + b->len, p, n);
    b->len += n;
    return 0;
}

int km_buf_printf(km_buf *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) return KM_EINVAL;
    int rc = km_buf_reserve(b, (size_t)n + 1);
    if (rc) return rc;
    va_start(ap, fmt);
    vsnprintf((char *)b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
    return 0;
}

void km_buf_reset(km_buf *b)
{
    b->len = 0;
}

void km_buf_free(km_buf *b)
{
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}

/* ---------------------------------------------------------------- names */

static const char *const type_names[KM_MSG_TYPE_COUNT] = {
    [KM_MSG_NONE] = "?",       [KM_MSG_REQUEST] = "req",
    [KM_MSG_TOKEN] = "tok",    [KM_MSG_DONE] = "done",
    [KM_MSG_ERROR] = "err",    [KM_MSG_CANCEL] = "cancel",
    [KM_MSG_ADMIN] = "admin",  [KM_MSG_ADMIN_REPLY] = "admin_reply",
    [KM_MSG_HEARTBEAT] = "hb", [KM_MSG_KV_EVENT] = "kv",
    [KM_MSG_VIEW] = "view",
};
static const char *const finish_names[KM_FINISH_COUNT] = {"stop", "length", "canceled", "deadline"};
static const char *const admin_names[KM_ADMIN_CMD_COUNT] = {
    "status", "evict", "set_kv_format", "drain", "shutdown", "recover", "pressure"};
static const char *const state_names[KM_STATE_COUNT] = {"starting", "ready", "draining",
                                                        "stopping"};
static const char *const member_names[KM_MEMBER_STATE_COUNT] = {"starting", "ready", "draining",
                                                                "restarting", "dead"};
static const char *const kind_names[KM_KV_KIND_COUNT] = {"stored", "removed", "tier"};
static const char *const format_names[] = {"f16", "bf16", "fp8", "int8", "int4"};
#define N_FORMATS (sizeof format_names / sizeof format_names[0])

const char *km_msg_type_name(km_msg_type t)
{
    return (unsigned)t < KM_MSG_TYPE_COUNT ? type_names[t] : "?";
}
const char *km_finish_name(km_finish f)
{
    return (unsigned)f < KM_FINISH_COUNT ? finish_names[f] : "?";
}
const char *km_admin_cmd_name(km_admin_cmd c)
{
    return (unsigned)c < KM_ADMIN_CMD_COUNT ? admin_names[c] : "?";
}
const char *km_worker_state_name(km_worker_state s)
{
    return (unsigned)s < KM_STATE_COUNT ? state_names[s] : "?";
}

const char *km_member_state_name(km_member_state s)
{
    return (unsigned)s < KM_MEMBER_STATE_COUNT ? member_names[s] : "?";
}

const char *km_proto_code_name(int code)
{
    switch (code) {
    case KM_CODE_BAD_REQUEST:
        return "bad_request";
    case KM_CODE_NOT_FOUND:
        return "not_found";
    case KM_CODE_TOO_LARGE:
        return "too_large";
    case KM_CODE_VERSION:
        return "unsupported_version";
    case KM_CODE_CANCELED:
        return "canceled";
    case KM_CODE_INTERNAL:
        return "internal";
    case KM_CODE_UNAVAILABLE:
        return "unavailable";
    case KM_CODE_OVERLOADED:
        return "overloaded";
    case KM_CODE_DEADLINE:
        return "deadline";
    }
    return "unknown";
}

int km_proto_code_from_err(int err)
{
    switch (err) {
    case KM_EINVAL:
    case KM_EFORMAT:
    case KM_EPROTO:
        return KM_CODE_BAD_REQUEST;
    case KM_ERANGE:
    case KM_ENOSPC:
        return KM_CODE_TOO_LARGE;
    case KM_ENOTFOUND:
        return KM_CODE_NOT_FOUND;
    case KM_EUNSUPPORTED:
        return KM_CODE_VERSION;
    case KM_EAGAIN:
    case KM_EOVERLOAD:
        return KM_CODE_OVERLOADED;
    case KM_ETIMEDOUT:
        return KM_CODE_DEADLINE;
    case KM_ECANCELED:
        return KM_CODE_CANCELED;
    }
    return KM_CODE_INTERNAL;
}

static int name_index(const char *const *names, int n, const char *s, size_t len)
{
    for (int i = 0; i < n; i++)
        if (names[i] && strlen(names[i]) == len && memcmp(names[i], s, len) == 0) return i;
    return -1;
}

static bool is_format(const char *s)
{
    return s && name_index(format_names, (int)N_FORMATS, s, strlen(s)) >= 0;
}

/* ---------------------------------------------------------------- init, clear, memory */

void km_proto_limits_default(km_proto_limits *l)
{
    l->max_frame = KM_PROTO_MAX_FRAME;
    l->max_prompt_tok = KM_PROTO_MAX_PROMPT_TOK;
    l->max_event_hashes = KM_PROTO_MAX_EVENT_HASHES;
}

static const km_proto_limits *limits_or_default(const km_proto_limits *lim, km_proto_limits *tmp)
{
    if (lim) return lim;
    km_proto_limits_default(tmp);
    return tmp;
}

void km_msg_init(km_msg *m, km_msg_type type)
{
    memset(m, 0, sizeof *m);
    m->type = type;
    if (type == KM_MSG_REQUEST) {
        m->req.temperature = 1.0f;
        m->req.top_p = 1.0f;
        m->req.repeat_penalty = 1.0f;
    } else if (type == KM_MSG_ADMIN_REPLY) {
        m->admin_reply.ok = true;
    }
}

/* Decoded data hangs off mem_ as a list of blocks. */
typedef struct mem_blk {
    struct mem_blk *next;
    max_align_t data[];
} mem_blk;

static void *msg_alloc(km_msg *m, size_t n)
{
    if (n > SIZE_MAX - sizeof(mem_blk)) return NULL;
    mem_blk *b = malloc(sizeof *b + (n ? n : 1));
    if (!b) return NULL;
    b->next = m->mem_;
    m->mem_ = b;
    return b->data;
}

void km_msg_clear(km_msg *m)
{
    if (!m) return;
    mem_blk *b = m->mem_;
    while (b) {
        mem_blk *next = b->next;
        free(b);
        b = next;
    }
    memset(m, 0, sizeof *m);
}

/* ---------------------------------------------------------------- validation */

/* A text field's length: the explicit one, or strlen when it is 0. */
static size_t text_len(const char *s, size_t len)
{
    return s && len == 0 ? strlen(s) : len;
}

#define VFAIL(...) return km_errf(err, KM_EFORMAT, __VA_ARGS__)

static int v_name(const char *what, const char *s, bool required, size_t min, size_t max,
                  km_errbuf *err)
{
    if (!s) {
        if (required) VFAIL("%s: required", what);
        return 0;
    }
    size_t n = strlen(s);
    if (n < min || n > max) VFAIL("%s: length %zu outside [%zu, %zu] bytes", what, n, min, max);
    return 0;
}

static int v_range(const char *what, double x, double lo, double hi, km_errbuf *err)
{
    if (!(x >= lo && x <= hi)) VFAIL("%s: %g outside [%g, %g]", what, x, lo, hi);
    return 0;
}

static int v_nonneg(const char *what, double x, km_errbuf *err)
{
    if (!(x >= 0 && isfinite(x))) VFAIL("%s: %g must be finite and >= 0", what, x);
    return 0;
}

#define CK(x)                                                                                      \
    do {                                                                                           \
        int rc_ = (x);                                                                             \
        if (rc_) return rc_;                                                                       \
    } while (0)

static int validate_request(const km_msg_request *r, const km_proto_limits *lim, km_errbuf *err)
{
    CK(v_name("req.model", r->model, true, 1, KM_PROTO_MAX_NAME, err));
    bool has_text = r->prompt != NULL, has_tok = r->n_tokens > 0;
    if (has_text == has_tok) VFAIL("req: exactly one of prompt and tokens is required");
    if (has_text && text_len(r->prompt, r->prompt_len) > lim->max_frame)
        VFAIL("req.prompt: longer than the frame limit %zu", lim->max_frame);
    if (has_tok) {
        if (!r->tokens) VFAIL("req.tokens: NULL with n_tokens %u", r->n_tokens);
        if (r->n_tokens > lim->max_prompt_tok)
            VFAIL("req.tokens: %u ids, limit %u", r->n_tokens, lim->max_prompt_tok);
        for (uint32_t i = 0; i < r->n_tokens; i++)
            if (r->tokens[i] < 0) VFAIL("req.tokens[%u]: negative id %d", i, r->tokens[i]);
    }
    CK(v_range("req.temperature", r->temperature, 0, 100, err));
    CK(v_range("req.top_k", r->top_k, 0, 1 << 20, err));
    CK(v_range("req.top_p", r->top_p, 0, 1, err));
    CK(v_range("req.min_p", r->min_p, 0, 1, err));
    if (!(r->repeat_penalty > 0 && r->repeat_penalty <= 100))
        VFAIL("req.repeat_penalty: %g outside (0, 100]", r->repeat_penalty);
    CK(v_range("req.repeat_last_n", r->repeat_last_n, 0, 1 << 20, err));
    CK(v_range("req.presence_penalty", r->presence_penalty, -2, 2, err));
    CK(v_range("req.frequency_penalty", r->frequency_penalty, -2, 2, err));
    CK(v_range("req.max_tokens", r->max_tokens, 0, 1 << 20, err));
    if (r->n_stop > KM_PROTO_MAX_STOP)
        VFAIL("req.stop: %u strings, limit %d", r->n_stop, KM_PROTO_MAX_STOP);
    if (r->n_stop && !r->stop) VFAIL("req.stop: NULL with n_stop %u", r->n_stop);
    for (uint32_t i = 0; i < r->n_stop; i++) {
        char what[32];
        snprintf(what, sizeof what, "req.stop[%u]", i);
        CK(v_name(what, r->stop[i], true, 1, KM_PROTO_MAX_NAME, err));
    }
    CK(v_name("req.cache_salt", r->cache_salt, false, 0, KM_PROTO_MAX_NAME, err));
    CK(v_range("req.priority", r->priority, -100, 100, err));
    return 0;
}

static int validate_heartbeat(const km_msg_heartbeat *h, km_errbuf *err)
{
    char what[48];
    CK(v_name("hb.worker", h->worker, true, 1, KM_PROTO_MAX_NAME, err));
    if ((unsigned)h->state >= KM_STATE_COUNT) VFAIL("hb.state: unknown state %d", (int)h->state);
    CK(v_name("hb.model", h->model, false, 0, KM_PROTO_MAX_NAME, err));
    if (h->kv_format_base && !is_format(h->kv_format_base))
        VFAIL("hb.kv_format_base: unknown KV format '%s'", h->kv_format_base);
    CK(v_name("hb.fingerprint", h->fingerprint, false, 0, KM_PROTO_MAX_NAME, err));
    if (h->n_endpoints > KM_PROTO_MAX_ENDPOINTS)
        VFAIL("hb.endpoints: %u entries, limit %d", h->n_endpoints, KM_PROTO_MAX_ENDPOINTS);
    if (h->n_endpoints && !h->endpoints) VFAIL("hb.endpoints: NULL");
    for (uint32_t i = 0; i < h->n_endpoints; i++) {
        snprintf(what, sizeof what, "hb.endpoints[%u].name", i);
        CK(v_name(what, h->endpoints[i].name, true, 1, KM_PROTO_MAX_NAME, err));
        snprintf(what, sizeof what, "hb.endpoints[%u].url", i);
        CK(v_name(what, h->endpoints[i].url, true, 1, KM_PROTO_MAX_NAME, err));
        for (uint32_t j = 0; j < i; j++)
            if (strcmp(h->endpoints[i].name, h->endpoints[j].name) == 0)
                VFAIL("hb.endpoints: duplicate name '%s'", h->endpoints[i].name);
    }
    if (h->n_kv > KM_PROTO_MAX_KV_ENTRIES)
        VFAIL("hb.kv: %u entries, limit %d", h->n_kv, KM_PROTO_MAX_KV_ENTRIES);
    if (h->n_kv && !h->kv) VFAIL("hb.kv: NULL");
    for (uint32_t i = 0; i < h->n_kv; i++) {
        const km_kv_usage *u = &h->kv[i];
        if (u->shard > 65535) VFAIL("hb.kv[%u].shard: %u outside [0, 65535]", i, u->shard);
        if ((unsigned)u->tier >= KM_TIER_COUNT)
            VFAIL("hb.kv[%u].tier: unknown tier %d", i, (int)u->tier);
        if (!is_format(u->format))
            VFAIL("hb.kv[%u].format: unknown KV format '%s'", i, u->format ? u->format : "");
        if (u->pinned_bytes > u->bytes)
            VFAIL("hb.kv[%u].pinned_bytes: %llu > bytes %llu", i,
                  (unsigned long long)u->pinned_bytes, (unsigned long long)u->bytes);
    }
    CK(v_nonneg("hb.decode_tps", h->decode_tps, err));
    CK(v_nonneg("hb.prefill_tps", h->prefill_tps, err));
    if (h->n_latency > KM_PROTO_MAX_QUANTILES)
        VFAIL("hb.latency: %u entries, limit %d", h->n_latency, KM_PROTO_MAX_QUANTILES);
    if (h->n_latency && !h->latency) VFAIL("hb.latency: NULL");
    for (uint32_t i = 0; i < h->n_latency; i++) {
        const km_latency_q *q = &h->latency[i];
        if (!(q->q > 0 && q->q <= 1)) VFAIL("hb.latency[%u].q: %g outside (0, 1]", i, q->q);
        snprintf(what, sizeof what, "hb.latency[%u].ttft_ms", i);
        CK(v_nonneg(what, q->ttft_ms, err));
        snprintf(what, sizeof what, "hb.latency[%u].tpot_ms", i);
        CK(v_nonneg(what, q->tpot_ms, err));
    }
    if (h->n_errors > KM_PROTO_MAX_ERROR_KINDS)
        VFAIL("hb.errors: %u entries, limit %d", h->n_errors, KM_PROTO_MAX_ERROR_KINDS);
    if (h->n_errors && !h->errors) VFAIL("hb.errors: NULL");
    for (uint32_t i = 0; i < h->n_errors; i++) {
        snprintf(what, sizeof what, "hb.errors[%u].name", i);
        CK(v_name(what, h->errors[i].name, true, 1, KM_PROTO_MAX_NAME, err));
        for (uint32_t j = 0; j < i; j++)
            if (strcmp(h->errors[i].name, h->errors[j].name) == 0)
                VFAIL("hb.errors: duplicate name '%s'", h->errors[i].name);
    }
    return 0;
}

static int validate_view(const km_msg_view *v, km_errbuf *err)
{
    char what[64];
    CK(v_name("view.controller", v->controller, true, 1, KM_PROTO_MAX_NAME, err));
    if (v->n_workers > KM_PROTO_MAX_VIEW_WORKERS)
        VFAIL("view.workers: %u entries, limit %d", v->n_workers, KM_PROTO_MAX_VIEW_WORKERS);
    if (v->n_workers && !v->workers) VFAIL("view.workers: NULL with n_workers %u", v->n_workers);
    for (uint32_t i = 0; i < v->n_workers; i++) {
        const km_view_worker *w = &v->workers[i];
#define W_NAME(field, required, min)                                                               \
    do {                                                                                           \
        snprintf(what, sizeof what, "view.workers[%u]." #field, i);                                \
        CK(v_name(what, w->field, required, min, KM_PROTO_MAX_NAME, err));                         \
    } while (0)
        W_NAME(id, true, 1);
        W_NAME(requests, false, 0);
        W_NAME(events, false, 0);
        W_NAME(admin, false, 0);
        W_NAME(model, false, 0);
        W_NAME(fingerprint, false, 0);
#undef W_NAME
        for (uint32_t j = 0; j < i; j++)
            if (strcmp(w->id, v->workers[j].id) == 0)
                VFAIL("view.workers: duplicate id '%s' (entries %u and %u)", w->id, j, i);
        if ((unsigned)w->state >= KM_MEMBER_STATE_COUNT)
            VFAIL("view.workers[%u].state: unknown state %d", i, (int)w->state);
        if (w->level > 3) VFAIL("view.workers[%u].level: %u outside [0, 3]", i, w->level);
        if (w->kv_format && !is_format(w->kv_format))
            VFAIL("view.workers[%u].kv_format: unknown KV format '%s'", i, w->kv_format);
        snprintf(what, sizeof what, "view.workers[%u].pressure", i);
        CK(v_nonneg(what, w->pressure, err));
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
            CK(v_name(what, a->reason, true, 1, KM_PROTO_MAX_NAME, err));
        }
    }
    return 0;
}

int km_msg_validate(const km_msg *m, const km_proto_limits *lim_in, km_errbuf *err)
{
    km_proto_limits tmp;
    const km_proto_limits *lim = limits_or_default(lim_in, &tmp);
    switch (m->type) {
    case KM_MSG_REQUEST:
        return validate_request(&m->req, lim, err);
    case KM_MSG_TOKEN:
        if (!m->tok.text) VFAIL("tok.text: required");
        if (text_len(m->tok.text, m->tok.text_len) > KM_PROTO_MAX_PIECE)
            VFAIL("tok.text: longer than %d bytes", KM_PROTO_MAX_PIECE);
        if (m->tok.token < 0) VFAIL("tok.token: negative id %d", m->tok.token);
        return 0;
    case KM_MSG_DONE: {
        const km_msg_done *d = &m->done;
        if ((unsigned)d->finish >= KM_FINISH_COUNT)
            VFAIL("done.finish: unknown reason %d", (int)d->finish);
        if (d->text && text_len(d->text, d->text_len) > lim->max_frame)
            VFAIL("done.text: longer than the frame limit %zu", lim->max_frame);
        if (d->cached_tokens > d->prompt_tokens)
            VFAIL("done.usage: cached_tokens %u > prompt_tokens %u", d->cached_tokens,
                  d->prompt_tokens);
        CK(v_nonneg("done.timings.queue_ms", d->queue_ms, err));
        CK(v_nonneg("done.timings.ttft_ms", d->ttft_ms, err));
        CK(v_nonneg("done.timings.total_ms", d->total_ms, err));
        return v_name("done.worker", d->worker, false, 0, KM_PROTO_MAX_NAME, err);
    }
    case KM_MSG_ERROR:
        CK(v_range("err.code", m->error.code, 1, 999, err));
        return v_name("err.message", m->error.message, true, 0, KM_PROTO_MAX_MESSAGE, err);
    case KM_MSG_CANCEL:
        return 0;
    case KM_MSG_ADMIN: {
        const km_msg_admin *a = &m->admin;
        if ((unsigned)a->cmd >= KM_ADMIN_CMD_COUNT)
            VFAIL("admin.cmd: unknown command %d", (int)a->cmd);
        if (a->cmd == KM_ADMIN_EVICT && !(a->fraction > 0 && a->fraction <= 1))
            VFAIL("admin.fraction: %g outside (0, 1]", a->fraction);
        if (a->cmd == KM_ADMIN_SET_KV_FORMAT && !is_format(a->format))
            VFAIL("admin.format: '%s' is not one of f16, bf16, fp8, int8, int4",
                  a->format ? a->format : "");
        if (a->cmd == KM_ADMIN_PRESSURE) CK(v_range("admin.fraction", a->fraction, 0, 1, err));
        CK(v_name("admin.worker", a->worker, a->cmd == KM_ADMIN_RECOVER, 1, KM_PROTO_MAX_NAME,
                  err));
        if (a->cmd == KM_ADMIN_RECOVER && !(a->level >= 1 && a->level <= 3))
            VFAIL("admin.level: %u outside [1, 3]", a->level);
        return 0;
    }
    case KM_MSG_ADMIN_REPLY: {
        const km_msg_admin_reply *a = &m->admin_reply;
        if ((unsigned)a->cmd >= KM_ADMIN_CMD_COUNT)
            VFAIL("admin_reply.cmd: unknown command %d", (int)a->cmd);
        if (!a->ok) CK(v_range("admin_reply.code", a->code, 1, 999, err));
        CK(v_name("admin_reply.message", a->message, false, 0, KM_PROTO_MAX_MESSAGE, err));
        if ((unsigned)a->state >= KM_STATE_COUNT)
            VFAIL("admin_reply.state: unknown state %d", (int)a->state);
        if (a->kv_format && !is_format(a->kv_format))
            VFAIL("admin_reply.kv_format: unknown KV format '%s'", a->kv_format);
        return 0;
    }
    case KM_MSG_HEARTBEAT:
        return validate_heartbeat(&m->hb, err);
    case KM_MSG_VIEW:
        return validate_view(&m->view, err);
    case KM_MSG_KV_EVENT: {
        const km_msg_kv_event *k = &m->kv;
        CK(v_name("kv.worker", k->worker, true, 1, KM_PROTO_MAX_NAME, err));
        if ((unsigned)k->kind >= KM_KV_KIND_COUNT) VFAIL("kv.kind: unknown kind %d", (int)k->kind);
        if ((unsigned)k->tier >= KM_TIER_COUNT) VFAIL("kv.tier: unknown tier %d", (int)k->tier);
        if (k->kind == KM_KV_TIER) {
            if ((unsigned)k->from_tier >= KM_TIER_COUNT)
                VFAIL("kv.from_tier: unknown tier %d", (int)k->from_tier);
            if (k->from_tier == k->tier) VFAIL("kv.from_tier: equals tier %d", (int)k->tier);
        }
        if (k->n_hashes > lim->max_event_hashes)
            VFAIL("kv.hashes: %u hashes, limit %u", k->n_hashes, lim->max_event_hashes);
        if (k->n_hashes && !k->hashes) VFAIL("kv.hashes: NULL with n_hashes %u", k->n_hashes);
        return 0;
    }
    default:
        return km_errf(err, KM_EUNSUPPORTED, "unknown message type %d", (int)m->type);
    }
}

/* ---------------------------------------------------------------- encoding */

/* Each encoder runs twice: once counting the map's keys (n), once writing them. */
typedef struct enc {
    msgpack_packer pk;
    bool counting;
    uint32_t n;
    int rc;
} enc;

static int buf_write(void *data, const char *p, size_t len)
{
    return km_buf_append(data, p, len) ? -1 : 0;
}

static void e_key(enc *e, const char *k)
{
    size_t n = strlen(k);
    e->rc |= msgpack_pack_str(&e->pk, n);
    e->rc |= msgpack_pack_str_body(&e->pk, k, n);
}

static void e_strn(enc *e, const char *s, size_t n)
{
    e->rc |= msgpack_pack_str(&e->pk, n);
    e->rc |= msgpack_pack_str_body(&e->pk, s, n);
}

/* The kv_* helpers emit one key/value pair (or count it). */
static void kv_u64(enc *e, const char *k, uint64_t v)
{
    if (e->counting) {
        e->n++;
        return;
    }
    e_key(e, k);
    e->rc |= msgpack_pack_uint64(&e->pk, v);
}

static void kv_i64(enc *e, const char *k, int64_t v)
{
    if (e->counting) {
        e->n++;
        return;
    }
    e_key(e, k);
    e->rc |= msgpack_pack_int64(&e->pk, v);
}

static void kv_f32(enc *e, const char *k, float v)
{
    if (e->counting) {
        e->n++;
        return;
    }
    e_key(e, k);
    e->rc |= msgpack_pack_float(&e->pk, v);
}

static void kv_f64(enc *e, const char *k, double v)
{
    if (e->counting) {
        e->n++;
        return;
    }
    e_key(e, k);
    e->rc |= msgpack_pack_double(&e->pk, v);
}

static void kv_bool(enc *e, const char *k, bool v)
{
    if (e->counting) {
        e->n++;
        return;
    }
    e_key(e, k);
    e->rc |= v ? msgpack_pack_true(&e->pk) : msgpack_pack_false(&e->pk);
}

/* Optional strings are left out when NULL. */
static void kv_strn(enc *e, const char *k, const char *s, size_t len)
{
    if (!s) return;
    if (e->counting) {
        e->n++;
        return;
    }
    e_key(e, k);
    e_strn(e, s, text_len(s, len));
}

static void kv_str(enc *e, const char *k, const char *s)
{
    kv_strn(e, k, s, 0);
}

/* Starts a nested value under key k (the caller writes the value when not counting). */
static bool kv_begin(enc *e, const char *k)
{
    if (e->counting) {
        e->n++;
        return false;
    }
    e_key(e, k);
    return true;
}

/* A nested map written with the same kv_* helpers: counted first, then written. */
static void enc_map(enc *e, void (*body)(enc *, const void *), const void *arg)
{
    enc sub = {.pk = e->pk, .counting = true};
    body(&sub, arg);
    sub.counting = false;
    sub.rc |= msgpack_pack_map(&sub.pk, sub.n);
    body(&sub, arg);
    e->rc |= sub.rc;
}

static void enc_action(enc *e, const void *arg)
{
    const km_recovery_action *a = arg;
    kv_u64(e, "at_ms", a->at_ms);
    kv_u64(e, "level", a->level);
    kv_str(e, "reason", a->reason);
    kv_bool(e, "ok", a->ok);
}

static void enc_view_worker(enc *e, const void *arg)
{
    const km_view_worker *w = arg;
    kv_str(e, "id", w->id);
    kv_str(e, "state", member_names[w->state]);
    kv_u64(e, "level", w->level);
    kv_str(e, "requests", w->requests);
    kv_str(e, "events", w->events);
    kv_str(e, "admin", w->admin);
    kv_str(e, "model", w->model);
    kv_str(e, "fingerprint", w->fingerprint);
    kv_str(e, "kv_format", w->kv_format);
    kv_f64(e, "pressure", w->pressure);
    kv_u64(e, "last_seen_ms", w->last_seen_ms);
    kv_u64(e, "running", w->running);
    kv_u64(e, "queue_depth", w->queue_depth);
    if (kv_begin(e, "history")) {
        e->rc |= msgpack_pack_array(&e->pk, w->n_history);
        for (uint32_t i = 0; i < w->n_history; i++) enc_map(e, enc_action, &w->history[i]);
    }
}

static void enc_view(enc *e, const km_msg_view *v)
{
    kv_str(e, "controller", v->controller);
    kv_u64(e, "epoch", v->epoch);
    kv_u64(e, "seq", v->seq);
    if (kv_begin(e, "workers")) {
        e->rc |= msgpack_pack_array(&e->pk, v->n_workers);
        for (uint32_t i = 0; i < v->n_workers; i++) enc_map(e, enc_view_worker, &v->workers[i]);
    }
}

static void enc_body(enc *e, const km_msg *m)
{
    msgpack_packer *pk = &e->pk;
    switch (m->type) {
    case KM_MSG_REQUEST: {
        const km_msg_request *r = &m->req;
        kv_u64(e, "id", r->id);
        kv_str(e, "model", r->model);
        kv_strn(e, "prompt", r->prompt, r->prompt_len);
        if (r->n_tokens && kv_begin(e, "tokens")) {
            e->rc |= msgpack_pack_array(pk, r->n_tokens);
            for (uint32_t i = 0; i < r->n_tokens; i++)
                e->rc |= msgpack_pack_uint32(pk, (uint32_t)r->tokens[i]);
        }
        kv_f32(e, "temperature", r->temperature);
        kv_i64(e, "top_k", r->top_k);
        kv_f32(e, "top_p", r->top_p);
        kv_f32(e, "min_p", r->min_p);
        kv_f32(e, "repeat_penalty", r->repeat_penalty);
        kv_i64(e, "repeat_last_n", r->repeat_last_n);
        kv_f32(e, "presence_penalty", r->presence_penalty);
        kv_f32(e, "frequency_penalty", r->frequency_penalty);
        if (r->has_seed) kv_u64(e, "seed", r->seed);
        kv_u64(e, "max_tokens", r->max_tokens);
        if (r->n_stop && kv_begin(e, "stop")) {
            e->rc |= msgpack_pack_array(pk, r->n_stop);
            for (uint32_t i = 0; i < r->n_stop; i++) e_strn(e, r->stop[i], strlen(r->stop[i]));
        }
        kv_str(e, "cache_salt", r->cache_salt);
        kv_i64(e, "priority", r->priority);
        kv_u64(e, "deadline_ms", r->deadline_ms);
        kv_bool(e, "stream", r->stream);
        break;
    }
    case KM_MSG_TOKEN:
        kv_u64(e, "id", m->tok.id);
        kv_u64(e, "index", m->tok.index);
        kv_u64(e, "token", (uint64_t)m->tok.token);
        kv_strn(e, "text", m->tok.text, m->tok.text_len);
        break;
    case KM_MSG_DONE: {
        const km_msg_done *d = &m->done;
        kv_u64(e, "id", d->id);
        kv_str(e, "finish", finish_names[d->finish]);
        kv_strn(e, "text", d->text, d->text_len);
        if (kv_begin(e, "usage")) {
            e->rc |= msgpack_pack_map(pk, 3);
            e_key(e, "prompt_tokens");
            e->rc |= msgpack_pack_uint32(pk, d->prompt_tokens);
            e_key(e, "cached_tokens");
            e->rc |= msgpack_pack_uint32(pk, d->cached_tokens);
            e_key(e, "completion_tokens");
            e->rc |= msgpack_pack_uint32(pk, d->completion_tokens);
        }
        if (kv_begin(e, "timings")) {
            e->rc |= msgpack_pack_map(pk, 3);
            e_key(e, "queue_ms");
            e->rc |= msgpack_pack_double(pk, d->queue_ms);
            e_key(e, "ttft_ms");
            e->rc |= msgpack_pack_double(pk, d->ttft_ms);
            e_key(e, "total_ms");
            e->rc |= msgpack_pack_double(pk, d->total_ms);
        }
        kv_str(e, "worker", d->worker);
        if (d->migrations) kv_u64(e, "migrations", d->migrations);
        break;
    }
    case KM_MSG_ERROR:
        kv_u64(e, "id", m->error.id);
        kv_i64(e, "code", m->error.code);
        kv_str(e, "message", m->error.message);
        if (m->error.retry_after_ms) kv_u64(e, "retry_after_ms", m->error.retry_after_ms);
        break;
    case KM_MSG_CANCEL:
        kv_u64(e, "id", m->cancel.id);
        break;
    case KM_MSG_ADMIN: {
        const km_msg_admin *a = &m->admin;
        kv_u64(e, "id", a->id);
        kv_str(e, "cmd", admin_names[a->cmd]);
        if (a->cmd == KM_ADMIN_EVICT || a->cmd == KM_ADMIN_PRESSURE)
            kv_f64(e, "fraction", a->fraction);
        if (a->cmd == KM_ADMIN_SET_KV_FORMAT) kv_str(e, "format", a->format);
        if (a->cmd == KM_ADMIN_DRAIN && a->timeout_ms) kv_u64(e, "timeout_ms", a->timeout_ms);
        if (a->cmd == KM_ADMIN_SHUTDOWN) kv_bool(e, "restart", a->restart);
        kv_str(e, "worker", a->worker);
        if (a->cmd == KM_ADMIN_RECOVER) kv_u64(e, "level", a->level);
        if (a->has_events_since) kv_u64(e, "events_since", a->events_since);
        if (a->events_snapshot) kv_bool(e, "events_snapshot", true);
        break;
    }
    case KM_MSG_ADMIN_REPLY: {
        const km_msg_admin_reply *a = &m->admin_reply;
        kv_u64(e, "id", a->id);
        kv_str(e, "cmd", admin_names[a->cmd]);
        kv_bool(e, "ok", a->ok);
        if (!a->ok) kv_i64(e, "code", a->code);
        kv_str(e, "message", a->message);
        kv_str(e, "state", state_names[a->state]);
        kv_str(e, "kv_format", a->kv_format);
        kv_u64(e, "inflight", a->inflight);
        kv_u64(e, "queued", a->queued);
        kv_u64(e, "kv_pages", a->kv_pages);
        kv_u64(e, "kv_bytes", a->kv_bytes);
        if (a->evicted_pages) kv_u64(e, "evicted_pages", a->evicted_pages);
        if (a->freed_bytes) kv_u64(e, "freed_bytes", a->freed_bytes);
        if (a->converted_pages) kv_u64(e, "converted_pages", a->converted_pages);
        /* events_snapshot is a uint on the wire (0 or 1), as the first workers sent it */
        if (a->has_events_next) kv_u64(e, "events_next", a->events_next);
        if (a->has_events_next || a->events_snapshot)
            kv_u64(e, "events_snapshot", a->events_snapshot);
        break;
    }
    case KM_MSG_HEARTBEAT: {
        const km_msg_heartbeat *h = &m->hb;
        kv_str(e, "worker", h->worker);
        kv_u64(e, "seq", h->seq);
        kv_u64(e, "uptime_ms", h->uptime_ms);
        kv_str(e, "state", state_names[h->state]);
        if (kv_begin(e, "endpoints")) {
            e->rc |= msgpack_pack_map(pk, h->n_endpoints);
            for (uint32_t i = 0; i < h->n_endpoints; i++) {
                e_key(e, h->endpoints[i].name);
                e_strn(e, h->endpoints[i].url, strlen(h->endpoints[i].url));
            }
        }
        kv_str(e, "model", h->model);
        kv_str(e, "fingerprint", h->fingerprint);
        kv_u64(e, "slots", h->slots);
        kv_u64(e, "max_ctx", h->max_ctx);
        kv_u64(e, "page_tokens", h->page_tokens);
        if (kv_begin(e, "kv")) {
            e->rc |= msgpack_pack_array(pk, h->n_kv);
            for (uint32_t i = 0; i < h->n_kv; i++) {
                const km_kv_usage *u = &h->kv[i];
                e->rc |= msgpack_pack_map(pk, 7);
                e_key(e, "shard");
                e->rc |= msgpack_pack_uint32(pk, u->shard);
                e_key(e, "tier");
                e->rc |= msgpack_pack_uint32(pk, (uint32_t)u->tier);
                e_key(e, "format");
                e_strn(e, u->format, strlen(u->format));
                e_key(e, "pages");
                e->rc |= msgpack_pack_uint64(pk, u->pages);
                e_key(e, "bytes");
                e->rc |= msgpack_pack_uint64(pk, u->bytes);
                e_key(e, "capacity_bytes");
                e->rc |= msgpack_pack_uint64(pk, u->capacity_bytes);
                e_key(e, "pinned_bytes");
                e->rc |= msgpack_pack_uint64(pk, u->pinned_bytes);
            }
        }
        kv_u64(e, "rss_bytes", h->rss_bytes);
        kv_u64(e, "gpu_bytes", h->gpu_bytes);
        kv_u64(e, "queue_depth", h->queue_depth);
        kv_u64(e, "running", h->running);
        kv_f64(e, "decode_tps", h->decode_tps);
        kv_f64(e, "prefill_tps", h->prefill_tps);
        kv_u64(e, "tokens_total", h->tokens_total);
        kv_str(e, "kv_format_base", h->kv_format_base);
        if (kv_begin(e, "latency")) {
            e->rc |= msgpack_pack_array(pk, h->n_latency);
            for (uint32_t i = 0; i < h->n_latency; i++) {
                e->rc |= msgpack_pack_map(pk, 3);
                e_key(e, "q");
                e->rc |= msgpack_pack_double(pk, h->latency[i].q);
                e_key(e, "ttft_ms");
                e->rc |= msgpack_pack_double(pk, h->latency[i].ttft_ms);
                e_key(e, "tpot_ms");
                e->rc |= msgpack_pack_double(pk, h->latency[i].tpot_ms);
            }
        }
        if (kv_begin(e, "errors")) {
            e->rc |= msgpack_pack_map(pk, h->n_errors);
            for (uint32_t i = 0; i < h->n_errors; i++) {
                e_key(e, h->errors[i].name);
                e->rc |= msgpack_pack_uint64(pk, h->errors[i].count);
            }
        }
        break;
    }
    case KM_MSG_KV_EVENT: {
        const km_msg_kv_event *k = &m->kv;
        kv_str(e, "worker", k->worker);
        kv_u64(e, "seq", k->seq);
        kv_str(e, "kind", kind_names[k->kind]);
        if (k->kind != KM_KV_REMOVED) kv_u64(e, "tier", (uint64_t)k->tier);
        if (k->kind == KM_KV_TIER) kv_u64(e, "from_tier", (uint64_t)k->from_tier);
        if (kv_begin(e, "hashes")) {
            e->rc |= msgpack_pack_bin(pk, (size_t)k->n_hashes * 16);
            e->rc |= msgpack_pack_bin_body(pk, k->hashes, (size_t)k->n_hashes * 16);
        }
        break;
    }
    case KM_MSG_VIEW:
        enc_view(e, &m->view);
        break;
    default:
        break;
    }
}

int km_msg_encode(const km_msg *m, const km_proto_limits *lim_in, km_buf *out, km_errbuf *err)
{
    km_proto_limits tmp;
    const km_proto_limits *lim = limits_or_default(lim_in, &tmp);
    CK(km_msg_validate(m, lim, err));
    out->len = 0;
    enc e = {.counting = true, .n = 2};
    msgpack_packer_init(&e.pk, out, buf_write);
    enc_body(&e, m);
    e.counting = false;
    e.rc |= msgpack_pack_map(&e.pk, e.n);
    e_key(&e, "v");
    e.rc |= msgpack_pack_uint32(&e.pk, KM_PROTO_VERSION);
    e_key(&e, "t");
    e_strn(&e, type_names[m->type], strlen(type_names[m->type]));
    enc_body(&e, m);
    if (e.rc) {
        out->len = 0;
        return km_errf(err, KM_ENOMEM, "%s: out of memory while encoding", type_names[m->type]);
    }
    if (out->len > lim->max_frame) {
        size_t n = out->len;
        out->len = 0;
        return km_errf(err, KM_ERANGE, "%s: encoded frame is %zu bytes, limit %zu",
                       type_names[m->type], n, lim->max_frame);
    }
    return 0;
}

/* ---------------------------------------------------------------- the raw scan */

#define SCAN_MAX_DEPTH 8
#define SCAN_MAX_MAP   64 /* entries of any map; no kvmesh map has more than ~30 keys */

static uint64_t be_load(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = v << 8 | p[i];
    return v;
}

/* Checks that p[0..len) is exactly one msgpack object whose every length and count fits in the
 * bytes that remain, nested at most SCAN_MAX_DEPTH deep, with arrays of at most max_array
 * elements and maps of at most SCAN_MAX_MAP entries. On the way it notes the value of the root
 * map's first "id" key in *id when that is an unsigned integer (left untouched otherwise), so a
 * frame rejected by the scan or by the decoder can still be attributed to its request. */
static int mp_scan(const uint8_t *p, size_t len, uint64_t max_array, uint64_t *id, km_errbuf *err)
{
    uint64_t left[SCAN_MAX_DEPTH + 1]; /* items still to read in each open container */
    int depth = 0;
    size_t pos = 0;
    left[0] = 1;
    bool root_map = false, id_next = false, id_seen = false;
    uint64_t root_items = 0; /* items of the root map read so far: keys even, values odd */
    while (depth >= 0) {
        if (left[depth] == 0) {
            depth--;
            continue;
        }
        left[depth]--;
        if (pos >= len) return km_errf(err, KM_EFORMAT, "truncated frame at byte %zu", pos);
        /* an item of the root map: is it a key, and the value that follows the key "id"? */
        bool in_root = depth == 1 && root_map;
        bool root_key = in_root && root_items % 2 == 0;
        bool root_id_value = in_root && !root_key && id_next;
        if (in_root) root_items++;
        uint8_t b = p[pos++];
        size_t rest = len - pos;
        uint64_t skip = 0, count = 0; /* payload bytes to skip; container items to read */
        int hdr = 0;                  /* bytes of length/count that follow the type byte */
        bool container = false, is_map = false;
        if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
            /* fixint, nil, bool: nothing more */
        } else if (b >= 0x80 && b <= 0x9f) {
            container = true;
            is_map = b <= 0x8f;
            count = b & 0x0f;
        } else if (b >= 0xa0 && b <= 0xbf) {
            skip = b & 0x1f;
        } else {
            switch (b) {
            case 0xc4:
            case 0xd9:
                hdr = 1;
                break; /* bin8, str8 */
            case 0xc5:
            case 0xda:
                hdr = 2;
                break; /* bin16, str16 */
            case 0xc6:
            case 0xdb:
                hdr = 4;
                break; /* bin32, str32 */
            case 0xc7:
                hdr = 1;
                skip = 1;
                break; /* ext8: len, type */
            case 0xc8:
                hdr = 2;
                skip = 1;
                break;
            case 0xc9:
                hdr = 4;
                skip = 1;
                break;
            case 0xca:
                skip = 4;
                break;
            case 0xcb:
                skip = 8;
                break;
            case 0xcc:
            case 0xd0:
                skip = 1;
                break;
            case 0xcd:
            case 0xd1:
                skip = 2;
                break;
            case 0xce:
            case 0xd2:
                skip = 4;
                break;
            case 0xcf:
            case 0xd3:
                skip = 8;
                break;
            case 0xd4:
                skip = 2;
                break; /* fixext: type + data */
            case 0xd5:
                skip = 3;
                break;
            case 0xd6:
                skip = 5;
                break;
            case 0xd7:
                skip = 9;
                break;
            case 0xd8:
                skip = 17;
                break;
            case 0xdc:
                hdr = 2;
                container = true;
                break;
            case 0xdd:
                hdr = 4;
                container = true;
                break;
            case 0xde:
                hdr = 2;
                container = true;
                is_map = true;
                break;
            case 0xdf:
                hdr = 4;
                container = true;
                is_map = true;
                break;
            default:
                return km_errf(err, KM_EFORMAT, "invalid msgpack type byte 0x%02x at byte %zu", b,
                               pos - 1);
            }
            if (hdr) {
                if (rest < (size_t)hdr)
                    return km_errf(err, KM_EFORMAT, "truncated frame at byte %zu", pos);
                uint64_t n = be_load(p + pos, hdr);
                pos += (size_t)hdr;
                rest -= (size_t)hdr;
                if (container)
                    count = n;
                else
                    skip += n;
            }
        }
        if (depth == 0 && container && is_map) root_map = true;
        if (root_key) id_next = false;
        if (container) {
            if (is_map && count > SCAN_MAX_MAP)
                return km_errf(err, KM_EFORMAT, "map of %llu entries at byte %zu, limit %d",
                               (unsigned long long)count, pos, SCAN_MAX_MAP);
            if (!is_map && count > max_array)
                return km_errf(err, KM_ERANGE, "array of %llu elements at byte %zu, limit %llu",
                               (unsigned long long)count, pos, (unsigned long long)max_array);
            uint64_t items = is_map ? 2 * count : count;
            if (items > rest)
                return km_errf(err, KM_EFORMAT,
                               "truncated frame: container at byte %zu claims %llu items in %zu "
                               "bytes",
                               pos, (unsigned long long)items, rest);
            if (items) {
                if (depth == SCAN_MAX_DEPTH)
                    return km_errf(err, KM_EFORMAT, "nesting deeper than %d at byte %zu",
                                   SCAN_MAX_DEPTH, pos);
                left[++depth] = items;
            }
        } else {
            if (skip > rest)
                return km_errf(err, KM_EFORMAT,
                               "truncated frame: value at byte %zu needs %llu bytes, %zu left", pos,
                               (unsigned long long)skip, rest);
            bool is_str = (b >= 0xa0 && b <= 0xbf) || (b >= 0xd9 && b <= 0xdb);
            if (root_key && is_str && skip == 2 && !memcmp(p + pos, "id", 2)) id_next = !id_seen;
            if (root_id_value && (b <= 0x7f || (b >= 0xcc && b <= 0xcf))) {
                *id = b <= 0x7f ? b : be_load(p + pos, (int)skip);
                id_seen = true;
            }
            pos += (size_t)skip;
        }
    }
    if (pos != len)
        return km_errf(err, KM_EFORMAT, "%zu trailing bytes after the frame", len - pos);
    return 0;
}

/* ---------------------------------------------------------------- decoding */

typedef struct dec {
    km_msg *m;
    km_errbuf *err;
    const km_proto_limits *lim;
    char path[64]; /* "req", "hb.kv[3]", ... for messages */
} dec;

#define DFAIL(d, code, ...) km_errf((d)->err, (code), __VA_ARGS__)

static const char *obj_type_name(msgpack_object_type t)
{
    switch (t) {
    case MSGPACK_OBJECT_NIL:
        return "nil";
    case MSGPACK_OBJECT_BOOLEAN:
        return "bool";
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        return "integer";
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        return "float";
    case MSGPACK_OBJECT_STR:
        return "string";
    case MSGPACK_OBJECT_BIN:
        return "binary";
    case MSGPACK_OBJECT_ARRAY:
        return "array";
    case MSGPACK_OBJECT_MAP:
        return "map";
    case MSGPACK_OBJECT_EXT:
        return "ext";
    }
    return "?";
}

static bool key_is(const msgpack_object *k, const char *s)
{
    size_t n = strlen(s);
    return k->type == MSGPACK_OBJECT_STR && k->via.str.size == n &&
           memcmp(k->via.str.ptr, s, n) == 0;
}

/* Every key a string, none twice. */
static int check_map(dec *d, const msgpack_object_map *mp)
{
    for (uint32_t i = 0; i < mp->size; i++) {
        const msgpack_object *k = &mp->ptr[i].key;
        if (k->type != MSGPACK_OBJECT_STR)
            return DFAIL(d, KM_EFORMAT, "%s: map key %u has type %s; keys must be strings", d->path,
                         i, obj_type_name(k->type));
        for (uint32_t j = 0; j < i; j++) {
            const msgpack_object *o = &mp->ptr[j].key;
            if (o->via.str.size == k->via.str.size &&
                memcmp(o->via.str.ptr, k->via.str.ptr, k->via.str.size) == 0)
                return DFAIL(d, KM_EFORMAT, "%s: key '%.*s' appears twice", d->path,
                             (int)k->via.str.size, k->via.str.ptr);
        }
    }
    return 0;
}

/* The value of key, or NULL when absent or nil (nil means "absent" everywhere). */
static const msgpack_object *find(const msgpack_object_map *mp, const char *key)
{
    for (uint32_t i = 0; i < mp->size; i++)
        if (key_is(&mp->ptr[i].key, key))
            return mp->ptr[i].val.type == MSGPACK_OBJECT_NIL ? NULL : &mp->ptr[i].val;
    return NULL;
}

/* The getters return 0 when the value was read or is optional and absent (out untouched), or an
 * error. */
static int absent(dec *d, const char *key, bool required)
{
    if (required) return DFAIL(d, KM_EFORMAT, "%s.%s: required field missing", d->path, key);
    return 0;
}

static int wrong_type(dec *d, const char *key, const char *want, const msgpack_object *o)
{
    return DFAIL(d, KM_EFORMAT, "%s.%s: expected %s, got %s", d->path, key, want,
                 obj_type_name(o->type));
}

static int get_uint(dec *d, const msgpack_object_map *mp, const char *key, bool required,
                    uint64_t max, uint64_t *out)
{
    const msgpack_object *o = find(mp, key);
    if (!o) return absent(d, key, required);
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
        return DFAIL(d, KM_EFORMAT, "%s.%s: negative value %lld", d->path, key,
                     (long long)o->via.i64);
    if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return wrong_type(d, key, "an unsigned integer", o);
    if (o->via.u64 > max)
        return DFAIL(d, KM_EFORMAT, "%s.%s: %llu exceeds %llu", d->path, key,
                     (unsigned long long)o->via.u64, (unsigned long long)max);
    *out = o->via.u64;
    return 0;
}

static int get_u32(dec *d, const msgpack_object_map *mp, const char *key, bool required,
                   uint32_t *out)
{
    uint64_t v = *out;
    int rc = get_uint(d, mp, key, required, UINT32_MAX, &v);
    if (rc == 0) *out = (uint32_t)v;
    return rc;
}

static int get_i32(dec *d, const msgpack_object_map *mp, const char *key, bool required,
                   int32_t *out)
{
    const msgpack_object *o = find(mp, key);
    if (!o) return absent(d, key, required);
    int64_t v;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        if (o->via.u64 > INT32_MAX)
            return DFAIL(d, KM_EFORMAT, "%s.%s: %llu exceeds %d", d->path, key,
                         (unsigned long long)o->via.u64, INT32_MAX);
        v = (int64_t)o->via.u64;
    } else if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
        if (o->via.i64 < INT32_MIN)
            return DFAIL(d, KM_EFORMAT, "%s.%s: %lld below %d", d->path, key, (long long)o->via.i64,
                         INT32_MIN);
        v = o->via.i64;
    } else {
        return wrong_type(d, key, "an integer", o);
    }
    *out = (int32_t)v;
    return 0;
}

/* Numbers: floats and integers both accepted; NaN and infinities are not. */
static int get_num(dec *d, const msgpack_object_map *mp, const char *key, bool required,
                   double *out)
{
    const msgpack_object *o = find(mp, key);
    if (!o) return absent(d, key, required);
    double v;
    switch (o->type) {
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        v = o->via.f64;
        break;
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        v = (double)o->via.u64;
        break;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        v = (double)o->via.i64;
        break;
    default:
        return wrong_type(d, key, "a number", o);
    }
    if (!isfinite(v)) return DFAIL(d, KM_EFORMAT, "%s.%s: not a finite number", d->path, key);
    *out = v;
    return 0;
}

static int get_f32(dec *d, const msgpack_object_map *mp, const char *key, float *out)
{
    double v = *out;
    int rc = get_num(d, mp, key, false, &v);
    if (rc) return rc;
    if (fabs(v) > 1e30) return DFAIL(d, KM_EFORMAT, "%s.%s: %g is out of range", d->path, key, v);
    *out = (float)v;
    return 0;
}

static int get_bool(dec *d, const msgpack_object_map *mp, const char *key, bool required, bool *out)
{
    const msgpack_object *o = find(mp, key);
    if (!o) return absent(d, key, required);
    if (o->type != MSGPACK_OBJECT_BOOLEAN) return wrong_type(d, key, "a bool", o);
    *out = o->via.boolean;
    return 0;
}

/* A flag sent as a bool or as an unsigned integer (nonzero = true). */
static int get_flag(dec *d, const msgpack_object_map *mp, const char *key, bool *out)
{
    const msgpack_object *o = find(mp, key);
    if (!o) return 0;
    if (o->type == MSGPACK_OBJECT_BOOLEAN)
        *out = o->via.boolean;
    else if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
        *out = o->via.u64 != 0;
    else
        return wrong_type(d, key, "a bool or an unsigned integer", o);
    return 0;
}

/* Copies a string value into the message's memory, NUL-terminated. Text that may hold any byte
 * (prompts, pieces) passes binary_ok; names and messages must not contain NUL. */
static int copy_str(dec *d, const char *what, const msgpack_object *o, size_t max, bool binary_ok,
                    const char **out, size_t *len)
{
    if (o->type != MSGPACK_OBJECT_STR)
        return DFAIL(d, KM_EFORMAT, "%s: expected a string, got %s", what, obj_type_name(o->type));
    size_t n = o->via.str.size;
    if (n > max) return DFAIL(d, KM_EFORMAT, "%s: %zu bytes, limit %zu", what, n, max);
    if (!binary_ok && memchr(o->via.str.ptr, 0, n))
        return DFAIL(d, KM_EFORMAT, "%s: contains a NUL byte", what);
    char *s = msg_alloc(d->m, n + 1);
    if (!s) return DFAIL(d, KM_ENOMEM, "%s: out of memory", what);
    memcpy(s, o->via.str.ptr, n);
    s[n] = '\0';
    *out = s;
    if (len) *len = n;
    return 0;
}

static int get_str(dec *d, const msgpack_object_map *mp, const char *key, bool required, size_t max,
                   bool binary_ok, const char **out, size_t *len)
{
    const msgpack_object *o = find(mp, key);
    if (!o) return absent(d, key, required);
    char what[96];
    snprintf(what, sizeof what, "%s.%s", d->path, key);
    return copy_str(d, what, o, max, binary_ok, out, len);
}

/* A string that must be one of names; *out is its index. */
static int get_enum(dec *d, const msgpack_object_map *mp, const char *key, bool required,
                    const char *const *names, int n, int *out)
{
    const msgpack_object *o = find(mp, key);
    if (!o) return absent(d, key, required);
    if (o->type != MSGPACK_OBJECT_STR) return wrong_type(d, key, "a string", o);
    int i = name_index(names, n, o->via.str.ptr, o->via.str.size);
    if (i < 0) {
        int shown = o->via.str.size > 32 ? 32 : (int)o->via.str.size;
        return DFAIL(d, KM_EFORMAT, "%s.%s: unknown value '%.*s'", d->path, key, shown,
                     o->via.str.ptr);
    }
    *out = i;
    return 0;
}

static int get_tier(dec *d, const msgpack_object_map *mp, const char *key, bool required,
                    km_tier *out)
{
    uint64_t v = (uint64_t)*out;
    int rc = get_uint(d, mp, key, required, KM_TIER_COUNT - 1, &v);
    if (rc == 0) *out = (km_tier)v;
    return rc;
}

/* A nested container under key, typed; NULL (and 0) when absent. */
static int get_obj(dec *d, const msgpack_object_map *mp, const char *key, bool required,
                   msgpack_object_type type, const msgpack_object **out)
{
    const msgpack_object *o = find(mp, key);
    *out = NULL;
    if (!o) return absent(d, key, required);
    if (o->type != type)
        return wrong_type(d, key, type == MSGPACK_OBJECT_MAP ? "a map" : "an array", o);
    *out = o;
    return 0;
}

static void path_push(dec *d, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void path_push(dec *d, const char *fmt, ...)
{
    size_t n = strlen(d->path);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(d->path + n, sizeof d->path - n, fmt, ap);
    va_end(ap);
}

static void path_set(dec *d, size_t n)
{
    d->path[n] = '\0';
}

static int dec_request(dec *d, const msgpack_object_map *mp)
{
    km_msg_request *r = &d->m->req;
    const msgpack_object *o;
    CK(get_uint(d, mp, "id", true, UINT64_MAX, &r->id));
    CK(get_str(d, mp, "model", true, KM_PROTO_MAX_NAME, false, &r->model, NULL));
    CK(get_str(d, mp, "prompt", false, d->lim->max_frame, true, &r->prompt, &r->prompt_len));
    CK(get_obj(d, mp, "tokens", false, MSGPACK_OBJECT_ARRAY, &o));
    if (o) {
        const msgpack_object_array *a = &o->via.array;
        if (a->size > d->lim->max_prompt_tok)
            return DFAIL(d, KM_ERANGE, "req.tokens: %u ids, limit %u", a->size,
                         d->lim->max_prompt_tok);
        int32_t *t = msg_alloc(d->m, (size_t)a->size * sizeof *t);
        if (!t) return DFAIL(d, KM_ENOMEM, "req.tokens: out of memory");
        for (uint32_t i = 0; i < a->size; i++) {
            const msgpack_object *e = &a->ptr[i];
            if (e->type != MSGPACK_OBJECT_POSITIVE_INTEGER || e->via.u64 > INT32_MAX)
                return DFAIL(d, KM_EFORMAT, "req.tokens[%u]: expected a token id in [0, %d]", i,
                             INT32_MAX);
            t[i] = (int32_t)e->via.u64;
        }
        r->tokens = t;
        r->n_tokens = a->size;
        if (a->size == 0 && !r->prompt)
            return DFAIL(d, KM_EFORMAT, "req.tokens: empty (give prompt or at least one id)");
    }
    CK(get_f32(d, mp, "temperature", &r->temperature));
    CK(get_i32(d, mp, "top_k", false, &r->top_k));
    CK(get_f32(d, mp, "top_p", &r->top_p));
    CK(get_f32(d, mp, "min_p", &r->min_p));
    CK(get_f32(d, mp, "repeat_penalty", &r->repeat_penalty));
    CK(get_i32(d, mp, "repeat_last_n", false, &r->repeat_last_n));
    CK(get_f32(d, mp, "presence_penalty", &r->presence_penalty));
    CK(get_f32(d, mp, "frequency_penalty", &r->frequency_penalty));
    r->has_seed = find(mp, "seed") != NULL;
    CK(get_uint(d, mp, "seed", false, UINT64_MAX, &r->seed));
    CK(get_u32(d, mp, "max_tokens", false, &r->max_tokens));
    CK(get_obj(d, mp, "stop", false, MSGPACK_OBJECT_ARRAY, &o));
    if (o) {
        const msgpack_object_array *a = &o->via.array;
        if (a->size > KM_PROTO_MAX_STOP)
            return DFAIL(d, KM_EFORMAT, "req.stop: %u strings, limit %d", a->size,
                         KM_PROTO_MAX_STOP);
        const char **s = msg_alloc(d->m, (size_t)a->size * sizeof *s);
        if (!s) return DFAIL(d, KM_ENOMEM, "req.stop: out of memory");
        for (uint32_t i = 0; i < a->size; i++) {
            char what[32];
            snprintf(what, sizeof what, "req.stop[%u]", i);
            CK(copy_str(d, what, &a->ptr[i], KM_PROTO_MAX_NAME, false, &s[i], NULL));
        }
        r->stop = s;
        r->n_stop = a->size;
    }
    CK(get_str(d, mp, "cache_salt", false, KM_PROTO_MAX_NAME, false, &r->cache_salt, NULL));
    CK(get_i32(d, mp, "priority", false, &r->priority));
    CK(get_u32(d, mp, "deadline_ms", false, &r->deadline_ms));
    return get_bool(d, mp, "stream", false, &r->stream);
}

static int dec_done(dec *d, const msgpack_object_map *mp)
{
    km_msg_done *dn = &d->m->done;
    const msgpack_object *o;
    int f = 0;
    CK(get_uint(d, mp, "id", true, UINT64_MAX, &dn->id));
    CK(get_enum(d, mp, "finish", true, finish_names, KM_FINISH_COUNT, &f));
    dn->finish = (km_finish)f;
    CK(get_str(d, mp, "text", false, d->lim->max_frame, true, &dn->text, &dn->text_len));
    size_t n = strlen(d->path);
    CK(get_obj(d, mp, "usage", true, MSGPACK_OBJECT_MAP, &o));
    path_push(d, ".usage");
    CK(check_map(d, &o->via.map));
    CK(get_u32(d, &o->via.map, "prompt_tokens", true, &dn->prompt_tokens));
    CK(get_u32(d, &o->via.map, "cached_tokens", false, &dn->cached_tokens));
    CK(get_u32(d, &o->via.map, "completion_tokens", true, &dn->completion_tokens));
    path_set(d, n);
    CK(get_obj(d, mp, "timings", false, MSGPACK_OBJECT_MAP, &o));
    if (o) {
        path_push(d, ".timings");
        CK(check_map(d, &o->via.map));
        CK(get_num(d, &o->via.map, "queue_ms", false, &dn->queue_ms));
        CK(get_num(d, &o->via.map, "ttft_ms", false, &dn->ttft_ms));
        CK(get_num(d, &o->via.map, "total_ms", false, &dn->total_ms));
        path_set(d, n);
    }
    CK(get_str(d, mp, "worker", false, KM_PROTO_MAX_NAME, false, &dn->worker, NULL));
    return get_u32(d, mp, "migrations", false, &dn->migrations);
}

static int dec_admin(dec *d, const msgpack_object_map *mp, bool reply)
{
    int cmd = 0;
    if (reply) {
        km_msg_admin_reply *a = &d->m->admin_reply;
        int st = 0;
        CK(get_uint(d, mp, "id", true, UINT64_MAX, &a->id));
        CK(get_enum(d, mp, "cmd", true, admin_names, KM_ADMIN_CMD_COUNT, &cmd));
        a->cmd = (km_admin_cmd)cmd;
        CK(get_bool(d, mp, "ok", true, &a->ok));
        CK(get_i32(d, mp, "code", !a->ok, &a->code));
        CK(get_str(d, mp, "message", false, KM_PROTO_MAX_MESSAGE, false, &a->message, NULL));
        CK(get_enum(d, mp, "state", false, state_names, KM_STATE_COUNT, &st));
        a->state = (km_worker_state)st;
        CK(get_str(d, mp, "kv_format", false, KM_PROTO_MAX_NAME, false, &a->kv_format, NULL));
        CK(get_u32(d, mp, "inflight", false, &a->inflight));
        CK(get_u32(d, mp, "queued", false, &a->queued));
        const char *keys[] = {"kv_pages", "kv_bytes", "evicted_pages", "freed_bytes",
                              "converted_pages"};
        uint64_t *dst[] = {&a->kv_pages, &a->kv_bytes, &a->evicted_pages, &a->freed_bytes,
                           &a->converted_pages};
        for (int i = 0; i < 5; i++) CK(get_uint(d, mp, keys[i], false, UINT64_MAX, dst[i]));
        a->has_events_next = find(mp, "events_next") != NULL;
        CK(get_uint(d, mp, "events_next", false, UINT64_MAX, &a->events_next));
        return get_flag(d, mp, "events_snapshot", &a->events_snapshot);
    }
    km_msg_admin *a = &d->m->admin;
    CK(get_uint(d, mp, "id", true, UINT64_MAX, &a->id));
    CK(get_enum(d, mp, "cmd", true, admin_names, KM_ADMIN_CMD_COUNT, &cmd));
    a->cmd = (km_admin_cmd)cmd;
    CK(get_num(d, mp, "fraction", a->cmd == KM_ADMIN_EVICT || a->cmd == KM_ADMIN_PRESSURE,
               &a->fraction));
    CK(get_str(d, mp, "format", a->cmd == KM_ADMIN_SET_KV_FORMAT, KM_PROTO_MAX_NAME, false,
               &a->format, NULL));
    CK(get_u32(d, mp, "timeout_ms", false, &a->timeout_ms));
    CK(get_str(d, mp, "worker", a->cmd == KM_ADMIN_RECOVER, KM_PROTO_MAX_NAME, false, &a->worker,
               NULL));
    if (a->cmd == KM_ADMIN_RECOVER) CK(get_u32(d, mp, "level", true, &a->level));
    a->has_events_since = find(mp, "events_since") != NULL;
    CK(get_uint(d, mp, "events_since", false, UINT64_MAX, &a->events_since));
    CK(get_flag(d, mp, "events_snapshot", &a->events_snapshot));
    return get_bool(d, mp, "restart", false, &a->restart);
}

static int dec_heartbeat(dec *d, const msgpack_object_map *mp)
{
    km_msg_heartbeat *h = &d->m->hb;
    const msgpack_object *o;
    int st = 0;
    size_t n0 = strlen(d->path);
    CK(get_str(d, mp, "worker", true, KM_PROTO_MAX_NAME, false, &h->worker, NULL));
    CK(get_uint(d, mp, "seq", true, UINT64_MAX, &h->seq));
    CK(get_uint(d, mp, "uptime_ms", false, UINT64_MAX, &h->uptime_ms));
    CK(get_enum(d, mp, "state", true, state_names, KM_STATE_COUNT, &st));
    h->state = (km_worker_state)st;

    CK(get_obj(d, mp, "endpoints", false, MSGPACK_OBJECT_MAP, &o));
    if (o && o->via.map.size) {
        const msgpack_object_map *em = &o->via.map;
        path_push(d, ".endpoints");
        CK(check_map(d, em));
        if (em->size > KM_PROTO_MAX_ENDPOINTS)
            return DFAIL(d, KM_EFORMAT, "hb.endpoints: %u entries, limit %d", em->size,
                         KM_PROTO_MAX_ENDPOINTS);
        km_endpoint *ep = msg_alloc(d->m, em->size * sizeof *ep);
        if (!ep) return DFAIL(d, KM_ENOMEM, "hb.endpoints: out of memory");
        for (uint32_t i = 0; i < em->size; i++) {
            CK(copy_str(d, "hb.endpoints key", &em->ptr[i].key, KM_PROTO_MAX_NAME, false,
                        &ep[i].name, NULL));
            char what[300];
            snprintf(what, sizeof what, "hb.endpoints.%s", ep[i].name);
            CK(copy_str(d, what, &em->ptr[i].val, KM_PROTO_MAX_NAME, false, &ep[i].url, NULL));
        }
        h->endpoints = ep;
        h->n_endpoints = em->size;
        path_set(d, n0);
    }
    CK(get_str(d, mp, "model", false, KM_PROTO_MAX_NAME, false, &h->model, NULL));
    CK(get_str(d, mp, "fingerprint", false, KM_PROTO_MAX_NAME, false, &h->fingerprint, NULL));
    CK(get_u32(d, mp, "slots", false, &h->slots));
    CK(get_u32(d, mp, "max_ctx", false, &h->max_ctx));
    CK(get_u32(d, mp, "page_tokens", false, &h->page_tokens));

    CK(get_obj(d, mp, "kv", false, MSGPACK_OBJECT_ARRAY, &o));
    if (o && o->via.array.size) {
        const msgpack_object_array *a = &o->via.array;
        if (a->size > KM_PROTO_MAX_KV_ENTRIES)
            return DFAIL(d, KM_EFORMAT, "hb.kv: %u entries, limit %d", a->size,
                         KM_PROTO_MAX_KV_ENTRIES);
        km_kv_usage *u = msg_alloc(d->m, a->size * sizeof *u);
        if (!u) return DFAIL(d, KM_ENOMEM, "hb.kv: out of memory");
        memset(u, 0, a->size * sizeof *u);
        for (uint32_t i = 0; i < a->size; i++) {
            path_set(d, n0);
            path_push(d, ".kv[%u]", i);
            if (a->ptr[i].type != MSGPACK_OBJECT_MAP)
                return DFAIL(d, KM_EFORMAT, "%s: expected a map, got %s", d->path,
                             obj_type_name(a->ptr[i].type));
            const msgpack_object_map *em = &a->ptr[i].via.map;
            CK(check_map(d, em));
            CK(get_u32(d, em, "shard", true, &u[i].shard));
            CK(get_tier(d, em, "tier", true, &u[i].tier));
            CK(get_str(d, em, "format", true, KM_PROTO_MAX_NAME, false, &u[i].format, NULL));
            CK(get_uint(d, em, "pages", false, UINT64_MAX, &u[i].pages));
            CK(get_uint(d, em, "bytes", true, UINT64_MAX, &u[i].bytes));
            CK(get_uint(d, em, "capacity_bytes", false, UINT64_MAX, &u[i].capacity_bytes));
            CK(get_uint(d, em, "pinned_bytes", false, UINT64_MAX, &u[i].pinned_bytes));
        }
        path_set(d, n0);
        h->kv = u;
        h->n_kv = a->size;
    }
    CK(get_uint(d, mp, "rss_bytes", false, UINT64_MAX, &h->rss_bytes));
    CK(get_uint(d, mp, "gpu_bytes", false, UINT64_MAX, &h->gpu_bytes));
    CK(get_u32(d, mp, "queue_depth", false, &h->queue_depth));
    CK(get_u32(d, mp, "running", false, &h->running));
    CK(get_num(d, mp, "decode_tps", false, &h->decode_tps));
    CK(get_num(d, mp, "prefill_tps", false, &h->prefill_tps));
    CK(get_uint(d, mp, "tokens_total", false, UINT64_MAX, &h->tokens_total));
    CK(get_str(d, mp, "kv_format_base", false, KM_PROTO_MAX_NAME, false, &h->kv_format_base, NULL));

    CK(get_obj(d, mp, "latency", false, MSGPACK_OBJECT_ARRAY, &o));
    if (o && o->via.array.size) {
        const msgpack_object_array *a = &o->via.array;
        if (a->size > KM_PROTO_MAX_QUANTILES)
            return DFAIL(d, KM_EFORMAT, "hb.latency: %u entries, limit %d", a->size,
                         KM_PROTO_MAX_QUANTILES);
        km_latency_q *q = msg_alloc(d->m, a->size * sizeof *q);
        if (!q) return DFAIL(d, KM_ENOMEM, "hb.latency: out of memory");
        memset(q, 0, a->size * sizeof *q);
        for (uint32_t i = 0; i < a->size; i++) {
            path_set(d, n0);
            path_push(d, ".latency[%u]", i);
            if (a->ptr[i].type != MSGPACK_OBJECT_MAP)
                return DFAIL(d, KM_EFORMAT, "%s: expected a map, got %s", d->path,
                             obj_type_name(a->ptr[i].type));
            const msgpack_object_map *em = &a->ptr[i].via.map;
            CK(check_map(d, em));
            CK(get_num(d, em, "q", true, &q[i].q));
            CK(get_num(d, em, "ttft_ms", false, &q[i].ttft_ms));
            CK(get_num(d, em, "tpot_ms", false, &q[i].tpot_ms));
        }
        path_set(d, n0);
        h->latency = q;
        h->n_latency = a->size;
    }

    CK(get_obj(d, mp, "errors", false, MSGPACK_OBJECT_MAP, &o));
    if (o && o->via.map.size) {
        const msgpack_object_map *em = &o->via.map;
        path_push(d, ".errors");
        CK(check_map(d, em));
        if (em->size > KM_PROTO_MAX_ERROR_KINDS)
            return DFAIL(d, KM_EFORMAT, "hb.errors: %u entries, limit %d", em->size,
                         KM_PROTO_MAX_ERROR_KINDS);
        km_error_count *ec = msg_alloc(d->m, em->size * sizeof *ec);
        if (!ec) return DFAIL(d, KM_ENOMEM, "hb.errors: out of memory");
        for (uint32_t i = 0; i < em->size; i++) {
            CK(copy_str(d, "hb.errors key", &em->ptr[i].key, KM_PROTO_MAX_NAME, false, &ec[i].name,
                        NULL));
            const msgpack_object *v = &em->ptr[i].val;
            if (v->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
                return DFAIL(d, KM_EFORMAT, "hb.errors.%s: expected an unsigned integer, got %s",
                             ec[i].name, obj_type_name(v->type));
            ec[i].count = v->via.u64;
        }
        h->errors = ec;
        h->n_errors = em->size;
        path_set(d, n0);
    }
    return 0;
}

static int dec_kv_event(dec *d, const msgpack_object_map *mp)
{
    km_msg_kv_event *k = &d->m->kv;
    const msgpack_object *o;
    int kind = 0;
    CK(get_str(d, mp, "worker", true, KM_PROTO_MAX_NAME, false, &k->worker, NULL));
    CK(get_uint(d, mp, "seq", true, UINT64_MAX, &k->seq));
    CK(get_enum(d, mp, "kind", true, kind_names, KM_KV_KIND_COUNT, &kind));
    k->kind = (km_kv_event_kind)kind;
    CK(get_tier(d, mp, "tier", k->kind != KM_KV_REMOVED, &k->tier));
    CK(get_tier(d, mp, "from_tier", k->kind == KM_KV_TIER, &k->from_tier));
    o = find(mp, "hashes");
    if (!o) return absent(d, "hashes", true);
    if (o->type != MSGPACK_OBJECT_BIN) return wrong_type(d, "hashes", "binary", o);
    uint32_t n = o->via.bin.size;
    if (n % 16)
        return DFAIL(d, KM_EFORMAT, "kv.hashes: %u bytes is not a whole number of 16-byte hashes",
                     n);
    if (n / 16 > d->lim->max_event_hashes)
        return DFAIL(d, KM_ERANGE, "kv.hashes: %u hashes, limit %u", n / 16,
                     d->lim->max_event_hashes);
    uint8_t *h = msg_alloc(d->m, n);
    if (!h) return DFAIL(d, KM_ENOMEM, "kv.hashes: out of memory");
    if (n) memcpy(h, o->via.bin.ptr, n);
    k->hashes = h;
    k->n_hashes = n / 16;
    return 0;
}

/* The map at a->ptr[i], with the path set to "<path at n0><fmt>" for its messages. */
static int array_map(dec *d, const msgpack_object_array *a, uint32_t i, size_t n0, const char *what,
                     const msgpack_object_map **out)
{
    path_set(d, n0);
    path_push(d, "%s[%u]", what, i);
    if (a->ptr[i].type != MSGPACK_OBJECT_MAP)
        return DFAIL(d, KM_EFORMAT, "%s: expected a map, got %s", d->path,
                     obj_type_name(a->ptr[i].type));
    *out = &a->ptr[i].via.map;
    return check_map(d, *out);
}

static int dec_view_worker(dec *d, const msgpack_object_map *mp, km_view_worker *w)
{
    const msgpack_object *o;
    int st = 0;
    size_t n0 = strlen(d->path);
    CK(get_str(d, mp, "id", true, KM_PROTO_MAX_NAME, false, &w->id, NULL));
    CK(get_enum(d, mp, "state", true, member_names, KM_MEMBER_STATE_COUNT, &st));
    w->state = (km_member_state)st;
    CK(get_u32(d, mp, "level", false, &w->level));
    CK(get_str(d, mp, "requests", false, KM_PROTO_MAX_NAME, false, &w->requests, NULL));
    CK(get_str(d, mp, "events", false, KM_PROTO_MAX_NAME, false, &w->events, NULL));
    CK(get_str(d, mp, "admin", false, KM_PROTO_MAX_NAME, false, &w->admin, NULL));
    CK(get_str(d, mp, "model", false, KM_PROTO_MAX_NAME, false, &w->model, NULL));
    CK(get_str(d, mp, "fingerprint", false, KM_PROTO_MAX_NAME, false, &w->fingerprint, NULL));
    CK(get_str(d, mp, "kv_format", false, KM_PROTO_MAX_NAME, false, &w->kv_format, NULL));
    CK(get_num(d, mp, "pressure", false, &w->pressure));
    CK(get_uint(d, mp, "last_seen_ms", false, UINT64_MAX, &w->last_seen_ms));
    CK(get_u32(d, mp, "running", false, &w->running));
    CK(get_u32(d, mp, "queue_depth", false, &w->queue_depth));
    CK(get_obj(d, mp, "history", false, MSGPACK_OBJECT_ARRAY, &o));
    if (o && o->via.array.size) {
        const msgpack_object_array *a = &o->via.array;
        if (a->size > KM_PROTO_MAX_HISTORY)
            return DFAIL(d, KM_EFORMAT, "%s.history: %u entries, limit %d", d->path, a->size,
                         KM_PROTO_MAX_HISTORY);
        km_recovery_action *h = msg_alloc(d->m, a->size * sizeof *h);
        if (!h) return DFAIL(d, KM_ENOMEM, "%s.history: out of memory", d->path);
        memset(h, 0, a->size * sizeof *h);
        for (uint32_t i = 0; i < a->size; i++) {
            const msgpack_object_map *em;
            CK(array_map(d, a, i, n0, ".history", &em));
            CK(get_uint(d, em, "at_ms", false, UINT64_MAX, &h[i].at_ms));
            CK(get_u32(d, em, "level", true, &h[i].level));
            CK(get_str(d, em, "reason", true, KM_PROTO_MAX_NAME, false, &h[i].reason, NULL));
            CK(get_bool(d, em, "ok", false, &h[i].ok));
        }
        path_set(d, n0);
        w->history = h;
        w->n_history = a->size;
    }
    return 0;
}

static int dec_view(dec *d, const msgpack_object_map *mp)
{
    km_msg_view *v = &d->m->view;
    const msgpack_object *o;
    size_t n0 = strlen(d->path);
    CK(get_str(d, mp, "controller", true, KM_PROTO_MAX_NAME, false, &v->controller, NULL));
    CK(get_uint(d, mp, "epoch", false, UINT64_MAX, &v->epoch));
    CK(get_uint(d, mp, "seq", true, UINT64_MAX, &v->seq));
    CK(get_obj(d, mp, "workers", true, MSGPACK_OBJECT_ARRAY, &o));
    const msgpack_object_array *a = &o->via.array;
    if (a->size == 0) return 0;
    if (a->size > KM_PROTO_MAX_VIEW_WORKERS)
        return DFAIL(d, KM_EFORMAT, "view.workers: %u entries, limit %d", a->size,
                     KM_PROTO_MAX_VIEW_WORKERS);
    km_view_worker *w = msg_alloc(d->m, a->size * sizeof *w);
    if (!w) return DFAIL(d, KM_ENOMEM, "view.workers: out of memory");
    memset(w, 0, a->size * sizeof *w);
    for (uint32_t i = 0; i < a->size; i++) {
        const msgpack_object_map *em;
        CK(array_map(d, a, i, n0, ".workers", &em));
        CK(dec_view_worker(d, em, &w[i]));
    }
    path_set(d, n0);
    v->workers = w;
    v->n_workers = a->size;
    return 0;
}

static int dec_body(dec *d, const msgpack_object_map *mp)
{
    km_msg *m = d->m;
    switch (m->type) {
    case KM_MSG_REQUEST:
        return dec_request(d, mp);
    case KM_MSG_TOKEN:
        CK(get_uint(d, mp, "id", true, UINT64_MAX, &m->tok.id));
        CK(get_u32(d, mp, "index", true, &m->tok.index));
        CK(get_i32(d, mp, "token", true, &m->tok.token));
        return get_str(d, mp, "text", true, KM_PROTO_MAX_PIECE, true, &m->tok.text,
                       &m->tok.text_len);
    case KM_MSG_DONE:
        return dec_done(d, mp);
    case KM_MSG_ERROR:
        CK(get_uint(d, mp, "id", false, UINT64_MAX, &m->error.id));
        CK(get_i32(d, mp, "code", true, &m->error.code));
        CK(get_str(d, mp, "message", true, KM_PROTO_MAX_MESSAGE, false, &m->error.message, NULL));
        return get_u32(d, mp, "retry_after_ms", false, &m->error.retry_after_ms);
    case KM_MSG_CANCEL:
        return get_uint(d, mp, "id", true, UINT64_MAX, &m->cancel.id);
    case KM_MSG_ADMIN:
        return dec_admin(d, mp, false);
    case KM_MSG_ADMIN_REPLY:
        return dec_admin(d, mp, true);
    case KM_MSG_HEARTBEAT:
        return dec_heartbeat(d, mp);
    case KM_MSG_KV_EVENT:
        return dec_kv_event(d, mp);
    case KM_MSG_VIEW:
        return dec_view(d, mp);
    default:
        return DFAIL(d, KM_EUNSUPPORTED, "unknown message type");
    }
}

static int decode_root(dec *d, const msgpack_object *root)
{
    if (root->type != MSGPACK_OBJECT_MAP)
        return DFAIL(d, KM_EFORMAT, "frame is a msgpack %s, expected a map",
                     obj_type_name(root->type));
    const msgpack_object_map *mp = &root->via.map;
    snprintf(d->path, sizeof d->path, "frame");
    CK(check_map(d, mp));
    const msgpack_object *v = find(mp, "v"), *t = find(mp, "t");
    if (!v) return DFAIL(d, KM_EFORMAT, "frame: no protocol version (\"v\")");
    if (v->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return DFAIL(d, KM_EFORMAT, "frame.v: expected an unsigned integer, got %s",
                     obj_type_name(v->type));
    if (v->via.u64 != KM_PROTO_VERSION)
        return DFAIL(d, KM_EUNSUPPORTED,
                     "protocol version %llu not supported (this side speaks %d)",
                     (unsigned long long)v->via.u64, KM_PROTO_VERSION);
    if (!t) return DFAIL(d, KM_EFORMAT, "frame: no message type (\"t\")");
    if (t->type != MSGPACK_OBJECT_STR)
        return DFAIL(d, KM_EFORMAT, "frame.t: expected a string, got %s", obj_type_name(t->type));
    int ti = name_index(type_names + 1, KM_MSG_TYPE_COUNT - 1, t->via.str.ptr, t->via.str.size);
    if (ti < 0) {
        int shown = t->via.str.size > 32 ? 32 : (int)t->via.str.size;
        return DFAIL(d, KM_EUNSUPPORTED, "unknown message type '%.*s'", shown, t->via.str.ptr);
    }
    km_msg_init(d->m, (km_msg_type)(ti + 1));
    snprintf(d->path, sizeof d->path, "%s", type_names[ti + 1]);
    CK(dec_body(d, mp));
    return km_msg_validate(d->m, d->lim, d->err);
}

int km_msg_decode(const void *data, size_t len, const km_proto_limits *lim_in, km_msg *out,
                  km_errbuf *err)
{
    km_proto_limits tmp;
    const km_proto_limits *lim = limits_or_default(lim_in, &tmp);
    memset(out, 0, sizeof *out);
    if (!data && len) return km_errf(err, KM_EINVAL, "NULL frame");
    if (len == 0) return km_errf(err, KM_EFORMAT, "empty frame");
    if (len > lim->max_frame) {
        /* The scan allocates nothing and stops at the frame's end, so it may read the id of a
         * frame too large to decode. */
        uint64_t id = 0;
        mp_scan(data, len, UINT64_MAX, &id, NULL);
        out->rejected_id = id;
        return km_errf(err, KM_ERANGE, "frame of %zu bytes exceeds the limit of %zu", len,
                       lim->max_frame);
    }
    /* Arrays: the largest legitimate one is the prompt's token ids. */
    uint64_t max_array = lim->max_prompt_tok > 1024 ? lim->max_prompt_tok : 1024;
    uint64_t id = 0;
    int rc = mp_scan(data, len, max_array, &id, err);
    if (rc) {
        out->rejected_id = id;
        return rc;
    }

    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    size_t off = 0;
    msgpack_unpack_return ur = msgpack_unpack_next(&up, data, len, &off);
    if (ur != MSGPACK_UNPACK_SUCCESS || off != len) {
        rc = km_errf(err, KM_EFORMAT, "msgpack could not parse the frame (code %d)", (int)ur);
    } else {
        dec d = {.m = out, .err = err, .lim = lim};
        rc = decode_root(&d, &up.data);
    }
    msgpack_unpacked_destroy(&up);
    if (rc) {
        km_msg_clear(out); /* no half-filled message survives a failure */
        out->rejected_id = id;
    }
    return rc;
}
