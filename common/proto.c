/*
 * proto.c — the entry points of the wire protocol (proto.h): km_msg_init/clear, validate,
 * encode and decode, the wire names of the enumerations and error codes, and the limits. What
 * each message type carries is in its family's file (proto_internal.h lists them); this file
 * only dispatches through the codec table below. docs/protocol.md is the specification.
 *
 * Why it is built this way:
 *  - Decoding is two passes. The bounds scan (proto_scan.c) walks the raw bytes first and only
 *    then does msgpack-c build its object tree, so a frame can never make it allocate more than
 *    a small multiple of the frame's size. The scan also finds the id of a frame it or the
 *    decoder rejects (km_msg.rejected_id).
 *  - Wire types are checked while reading the tree; value ranges by the type's validate, which
 *    the encoder also runs, so a sender can never emit a frame the receiver rejects.
 *  - Everything a decoded message points to lives in its own allocations (mem_), freed at once by
 *    km_msg_clear, so no string outlives or aliases the receive buffer.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/proto_internal.h"

/* ---------------------------------------------------------------- names */

const char *const km_proto_type_names[KM_MSG_TYPE_COUNT] = {
    [KM_MSG_NONE] = "?",
    [KM_MSG_REQUEST] = "req",
    [KM_MSG_TOKEN] = "tok",
    [KM_MSG_DONE] = "done",
    [KM_MSG_ERROR] = "err",
    [KM_MSG_CANCEL] = "cancel",
    [KM_MSG_ADMIN] = "admin",
    [KM_MSG_ADMIN_REPLY] = "admin_reply",
    [KM_MSG_HEARTBEAT] = "hb",
    [KM_MSG_KV_EVENT] = "kv",
    [KM_MSG_VIEW] = "view",
    [KM_MSG_KV_PULL] = "kv_pull",
    [KM_MSG_KV_OFFER] = "kv_offer",
    [KM_MSG_KV_PULL_DONE] = "kv_pull_done",
    [KM_MSG_KV_PUSH] = "kv_push",
    [KM_MSG_KV_WARM] = "kv_warm",
};

const char *const km_proto_finish_names[KM_FINISH_COUNT] = {"stop", "length", "canceled",
                                                            "deadline"};

const char *const km_proto_speculate_names[KM_SPECULATE_COUNT] = {"default", "off", "auto", "self"};

const char *const km_proto_admin_names[KM_ADMIN_CMD_COUNT] = {
    "status", "evict", "set_kv_format", "drain", "shutdown", "recover", "pressure", "set_role"};
const char *const km_proto_state_names[KM_STATE_COUNT] = {"starting", "ready", "draining",
                                                          "stopping"};
const char *const km_proto_member_names[KM_MEMBER_STATE_COUNT] = {"starting",   "ready", "draining",
                                                                  "restarting", "dead",  "left"};
const char *const km_proto_kind_names[KM_KV_KIND_COUNT] = {"stored", "removed", "tier"};
const char *const km_proto_format_names[KM_PROTO_N_FORMATS] = {"f16", "bf16", "fp8", "int8",
                                                               "int4"};

const char *km_msg_type_name(km_msg_type t)
{
    return (unsigned)t < KM_MSG_TYPE_COUNT ? km_proto_type_names[t] : "?";
}

uint64_t km_msg_id(const km_msg *m)
{
    switch (m->type) {
    case KM_MSG_REQUEST:
        return m->req.id;
    case KM_MSG_TOKEN:
        return m->tok.id;
    case KM_MSG_DONE:
        return m->done.id;
    case KM_MSG_ERROR:
        return m->error.id;
    case KM_MSG_CANCEL:
        return m->cancel.id;
    case KM_MSG_ADMIN:
        return m->admin.id;
    case KM_MSG_ADMIN_REPLY:
        return m->admin_reply.id;
    case KM_MSG_KV_PULL:
        return m->kv_pull.id;
    case KM_MSG_KV_OFFER:
        return m->kv_offer.id;
    case KM_MSG_KV_WARM:
        return m->kv_warm.id;
    default:
        return 0;
    }
}

const char *km_finish_name(km_finish f)
{
    return (unsigned)f < KM_FINISH_COUNT ? km_proto_finish_names[f] : "?";
}

const char *km_speculate_name(km_speculate s)
{
    return (unsigned)s < KM_SPECULATE_COUNT ? km_proto_speculate_names[s] : "?";
}

const char *km_admin_cmd_name(km_admin_cmd c)
{
    return (unsigned)c < KM_ADMIN_CMD_COUNT ? km_proto_admin_names[c] : "?";
}

const char *km_worker_state_name(km_worker_state s)
{
    return (unsigned)s < KM_STATE_COUNT ? km_proto_state_names[s] : "?";
}

const char *const km_proto_role_names[KM_WROLE_COUNT] = {"both", "prefill", "decode"};

const char *km_worker_role_name(km_worker_role r)
{
    return (unsigned)r < KM_WROLE_COUNT ? km_proto_role_names[r] : "?";
}

int km_worker_role_parse(const char *s, km_worker_role *out)
{
    for (int i = 0; s && i < KM_WROLE_COUNT; i++)
        if (!strcmp(s, km_proto_role_names[i])) {
            *out = (km_worker_role)i;
            return 0;
        }
    return KM_EINVAL;
}

const char *km_member_state_name(km_member_state s)
{
    return (unsigned)s < KM_MEMBER_STATE_COUNT ? km_proto_member_names[s] : "?";
}

const char *km_proto_code_name(int code)
{
    switch (code) {
    case KM_CODE_BAD_REQUEST:
        return "bad_request";
    case KM_CODE_FORBIDDEN:
        return "forbidden";
    case KM_CODE_NOT_FOUND:
        return "not_found";
    case KM_CODE_TOO_LARGE:
        return "too_large";
    case KM_CODE_VERSION:
        return "unsupported_version";
    case KM_CODE_RATE_LIMIT:
        return "rate_limited";
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
    case KM_EACCES:
        return KM_CODE_FORBIDDEN;
    }
    return KM_CODE_INTERNAL;
}

int km_proto_name_index(const char *const *names, int n, const char *s, size_t len)
{
    for (int i = 0; i < n; i++)
        if (names[i] && strlen(names[i]) == len && memcmp(names[i], s, len) == 0) return i;
    return -1;
}

bool km_proto_is_format(const char *s)
{
    return s && km_proto_name_index(km_proto_format_names, KM_PROTO_N_FORMATS, s, strlen(s)) >= 0;
}

/* ---------------------------------------------------------------- codecs */

static const km_proto_codec *const codecs[KM_MSG_TYPE_COUNT] = {
    [KM_MSG_REQUEST] = &km_proto_codec_req,
    [KM_MSG_TOKEN] = &km_proto_codec_tok,
    [KM_MSG_DONE] = &km_proto_codec_done,
    [KM_MSG_ERROR] = &km_proto_codec_err,
    [KM_MSG_CANCEL] = &km_proto_codec_cancel,
    [KM_MSG_ADMIN] = &km_proto_codec_admin,
    [KM_MSG_ADMIN_REPLY] = &km_proto_codec_admin_reply,
    [KM_MSG_HEARTBEAT] = &km_proto_codec_hb,
    [KM_MSG_KV_EVENT] = &km_proto_codec_kv,
    [KM_MSG_VIEW] = &km_proto_codec_view,
    [KM_MSG_KV_PULL] = &km_proto_codec_kv_pull,
    [KM_MSG_KV_OFFER] = &km_proto_codec_kv_offer,
    [KM_MSG_KV_PULL_DONE] = &km_proto_codec_kv_pull_done,
    [KM_MSG_KV_PUSH] = &km_proto_codec_kv_push,
    [KM_MSG_KV_WARM] = &km_proto_codec_kv_warm,
};

static const km_proto_codec *codec_of(km_msg_type t)
{
    return (unsigned)t < KM_MSG_TYPE_COUNT ? codecs[t] : NULL;
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

void *km_msg_alloc(km_msg *m, size_t n)
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

/* ---------------------------------------------------------------- validate, encode */

int km_msg_validate(const km_msg *m, const km_proto_limits *lim_in, km_errbuf *err)
{
    km_proto_limits tmp;
    const km_proto_limits *lim = limits_or_default(lim_in, &tmp);
    const km_proto_codec *c = codec_of(m->type);
    if (!c) return km_errf(err, KM_EUNSUPPORTED, "unknown message type %d", (int)m->type);
    return c->validate(m, lim, err);
}

static int buf_write(void *data, const char *p, size_t len)
{
    return km_buf_append(data, p, len) ? -1 : 0;
}

int km_msg_encode(const km_msg *m, const km_proto_limits *lim_in, km_buf *out, km_errbuf *err)
{
    km_proto_limits tmp;
    const km_proto_limits *lim = limits_or_default(lim_in, &tmp);
    CK(km_msg_validate(m, lim, err));
    out->len = 0;
    km_enc e = {.counting = true, .n = 2};
    msgpack_packer_init(&e.pk, out, buf_write);
    const km_proto_codec *c = codec_of(m->type); /* validated: known */
    c->encode(&e, m);
    e.counting = false;
    e.rc |= msgpack_pack_map(&e.pk, e.n);
    km_enc_key(&e, "v");
    e.rc |= msgpack_pack_uint32(&e.pk, KM_PROTO_VERSION);
    km_enc_key(&e, "t");
    km_enc_text(&e, km_proto_type_names[m->type], strlen(km_proto_type_names[m->type]));
    c->encode(&e, m);
    if (e.rc) {
        out->len = 0;
        return km_errf(err, KM_ENOMEM, "%s: out of memory while encoding",
                       km_proto_type_names[m->type]);
    }
    if (out->len > lim->max_frame) {
        size_t n = out->len;
        out->len = 0;
        return km_errf(err, KM_ERANGE, "%s: encoded frame is %zu bytes, limit %zu",
                       km_proto_type_names[m->type], n, lim->max_frame);
    }
    return 0;
}

/* ---------------------------------------------------------------- decode */

static int decode_root(km_dec *d, const msgpack_object *root)
{
    if (root->type != MSGPACK_OBJECT_MAP)
        return DFAIL(d, KM_EFORMAT, "frame is a msgpack %s, expected a map",
                     km_dec_type_name(root->type));
    const msgpack_object_map *mp = &root->via.map;
    snprintf(d->path, sizeof d->path, "frame");
    CK(km_dec_check_map(d, mp));
    const msgpack_object *v = km_dec_find(mp, "v"), *t = km_dec_find(mp, "t");
    if (!v) return DFAIL(d, KM_EFORMAT, "frame: no protocol version (\"v\")");
    if (v->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return DFAIL(d, KM_EFORMAT, "frame.v: expected an unsigned integer, got %s",
                     km_dec_type_name(v->type));
    if (v->via.u64 != KM_PROTO_VERSION)
        return DFAIL(d, KM_EUNSUPPORTED,
                     "protocol version %llu not supported (this side speaks %d)",
                     (unsigned long long)v->via.u64, KM_PROTO_VERSION);
    if (!t) return DFAIL(d, KM_EFORMAT, "frame: no message type (\"t\")");
    if (t->type != MSGPACK_OBJECT_STR)
        return DFAIL(d, KM_EFORMAT, "frame.t: expected a string, got %s",
                     km_dec_type_name(t->type));
    int ti = km_proto_name_index(km_proto_type_names + 1, KM_MSG_TYPE_COUNT - 1, t->via.str.ptr,
                                 t->via.str.size);
    if (ti < 0) {
        int shown = t->via.str.size > 32 ? 32 : (int)t->via.str.size;
        return DFAIL(d, KM_EUNSUPPORTED, "unknown message type '%.*s'", shown, t->via.str.ptr);
    }
    km_msg_init(d->m, (km_msg_type)(ti + 1));
    snprintf(d->path, sizeof d->path, "%s", km_proto_type_names[ti + 1]);
    CK(codecs[ti + 1]->decode(d, mp));
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
        km_proto_scan(data, len, UINT64_MAX, &id, NULL);
        out->rejected_id = id;
        return km_errf(err, KM_ERANGE, "frame of %zu bytes exceeds the limit of %zu", len,
                       lim->max_frame);
    }
    /* Arrays: the largest legitimate one is the prompt's token ids. */
    uint64_t max_array = lim->max_prompt_tok > 1024 ? lim->max_prompt_tok : 1024;
    uint64_t id = 0;
    int rc = km_proto_scan(data, len, max_array, &id, err);
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
        km_dec d = {.m = out, .err = err, .lim = lim};
        rc = decode_root(&d, &up.data);
    }
    msgpack_unpacked_destroy(&up);
    if (rc) {
        km_msg_clear(out); /* no half-filled message survives a failure */
        out->rejected_id = id;
    }
    return rc;
}
