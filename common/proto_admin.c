/*
 * proto_admin.c — commands and their answers (docs/protocol.md sections 9–10): `admin` from an
 * operator or the controller, and the `admin_reply` every command gets. One codec per type.
 *
 * A command's arguments are keyed by its `cmd`: each is required (and encoded) only for the
 * commands that use it. The KV event replay of section 9 rides on `status`: events_since and
 * events_snapshot ask for it, events_next and events_snapshot in the reply answer it, and a
 * reply without events_next is how a requester recognises a worker that does not replay.
 */
#include "common/proto_internal.h"

/* ---------------------------------------------------------------- admin */

static int admin_validate(const km_msg *m, const km_proto_limits *lim, km_errbuf *err)
{
    const km_msg_admin *a = &m->admin;
    if ((unsigned)a->cmd >= KM_ADMIN_CMD_COUNT) VFAIL("admin.cmd: unknown command %d", (int)a->cmd);
    if (a->cmd == KM_ADMIN_EVICT && !(a->fraction > 0 && a->fraction <= 1))
        VFAIL("admin.fraction: %g outside (0, 1]", a->fraction);
    if (a->cmd == KM_ADMIN_SET_KV_FORMAT && !km_proto_is_format(a->format))
        VFAIL("admin.format: '%s' is not one of f16, bf16, fp8, int8, int4",
              a->format ? a->format : "");
    if (a->cmd == KM_ADMIN_PRESSURE) CK(km_val_range("admin.fraction", a->fraction, 0, 1, err));
    km_worker_role role;
    if (a->cmd == KM_ADMIN_SET_ROLE && km_worker_role_parse(a->role, &role))
        VFAIL("admin.role: '%s' is not one of both, prefill, decode", a->role ? a->role : "");
    CK(km_val_name("admin.worker", a->worker, a->cmd == KM_ADMIN_RECOVER, 1, KM_PROTO_MAX_NAME,
                   err));
    /* recover.level's range (1-3) is the controller's to check: it answers a bad one with
     * admin_reply 400 naming the frame's id, which a decode failure could not. */
    return 0;
}

static void admin_encode(km_enc *e, const km_msg *m)
{
    const km_msg_admin *a = &m->admin;
    km_enc_u64(e, "id", a->id);
    km_enc_str(e, "cmd", km_proto_admin_names[a->cmd]);
    if (a->cmd == KM_ADMIN_EVICT || a->cmd == KM_ADMIN_PRESSURE)
        km_enc_f64(e, "fraction", a->fraction);
    if (a->cmd == KM_ADMIN_SET_KV_FORMAT) km_enc_str(e, "format", a->format);
    if (a->cmd == KM_ADMIN_DRAIN && a->timeout_ms) km_enc_u64(e, "timeout_ms", a->timeout_ms);
    if (a->cmd == KM_ADMIN_SHUTDOWN) km_enc_bool(e, "restart", a->restart);
    km_enc_str(e, "worker", a->worker);
    if (a->cmd == KM_ADMIN_RECOVER) km_enc_u64(e, "level", a->level);
    if (a->cmd == KM_ADMIN_SET_ROLE) km_enc_str(e, "role", a->role);
    if (a->has_events_since) km_enc_u64(e, "events_since", a->events_since);
    if (a->events_snapshot) km_enc_bool(e, "events_snapshot", true);
}

static int admin_decode(km_dec *d, const msgpack_object_map *mp)
{
    km_msg_admin *a = &d->m->admin;
    int cmd = 0;
    CK(km_dec_uint(d, mp, "id", true, UINT64_MAX, &a->id));
    CK(km_dec_enum(d, mp, "cmd", true, km_proto_admin_names, KM_ADMIN_CMD_COUNT, &cmd));
    a->cmd = (km_admin_cmd)cmd;
    CK(km_dec_num(d, mp, "fraction", a->cmd == KM_ADMIN_EVICT || a->cmd == KM_ADMIN_PRESSURE,
                  &a->fraction));
    CK(km_dec_str(d, mp, "format", a->cmd == KM_ADMIN_SET_KV_FORMAT, KM_PROTO_MAX_NAME, false,
                  &a->format, NULL));
    CK(km_dec_u32(d, mp, "timeout_ms", false, &a->timeout_ms));
    CK(km_dec_str(d, mp, "worker", a->cmd == KM_ADMIN_RECOVER, KM_PROTO_MAX_NAME, false, &a->worker,
                  NULL));
    if (a->cmd == KM_ADMIN_RECOVER) CK(km_dec_u32(d, mp, "level", true, &a->level));
    CK(km_dec_str(d, mp, "role", a->cmd == KM_ADMIN_SET_ROLE, KM_PROTO_MAX_NAME, false, &a->role,
                  NULL));
    a->has_events_since = km_dec_find(mp, "events_since") != NULL;
    CK(km_dec_uint(d, mp, "events_since", false, UINT64_MAX, &a->events_since));
    CK(km_dec_flag(d, mp, "events_snapshot", &a->events_snapshot));
    return km_dec_bool(d, mp, "restart", false, &a->restart);
}

const km_proto_codec km_proto_codec_admin = {admin_validate, admin_encode, admin_decode};

/* ---------------------------------------------------------------- admin_reply */

static int reply_validate(const km_msg *m, const km_proto_limits *lim, km_errbuf *err)
{
    const km_msg_admin_reply *a = &m->admin_reply;
    if ((unsigned)a->cmd >= KM_ADMIN_CMD_COUNT)
        VFAIL("admin_reply.cmd: unknown command %d", (int)a->cmd);
    if (!a->ok) CK(km_val_range("admin_reply.code", a->code, 1, 999, err));
    CK(km_val_name("admin_reply.message", a->message, false, 0, KM_PROTO_MAX_MESSAGE, err));
    if ((unsigned)a->state >= KM_STATE_COUNT)
        VFAIL("admin_reply.state: unknown state %d", (int)a->state);
    if ((unsigned)a->role >= KM_WROLE_COUNT)
        VFAIL("admin_reply.role: unknown role %d", (int)a->role);
    if (a->kv_format && !km_proto_is_format(a->kv_format))
        VFAIL("admin_reply.kv_format: unknown KV format '%s'", a->kv_format);
    return 0;
}

static void reply_encode(km_enc *e, const km_msg *m)
{
    const km_msg_admin_reply *a = &m->admin_reply;
    km_enc_u64(e, "id", a->id);
    km_enc_str(e, "cmd", km_proto_admin_names[a->cmd]);
    km_enc_bool(e, "ok", a->ok);
    if (!a->ok) km_enc_i64(e, "code", a->code);
    km_enc_str(e, "message", a->message);
    km_enc_str(e, "state", km_proto_state_names[a->state]);
    km_enc_str(e, "kv_format", a->kv_format);
    if (a->role != KM_WROLE_BOTH) km_enc_str(e, "role", km_proto_role_names[a->role]);
    km_enc_u64(e, "inflight", a->inflight);
    km_enc_u64(e, "queued", a->queued);
    km_enc_u64(e, "kv_pages", a->kv_pages);
    km_enc_u64(e, "kv_bytes", a->kv_bytes);
    if (a->evicted_pages) km_enc_u64(e, "evicted_pages", a->evicted_pages);
    if (a->freed_bytes) km_enc_u64(e, "freed_bytes", a->freed_bytes);
    if (a->converted_pages) km_enc_u64(e, "converted_pages", a->converted_pages);
    /* events_snapshot is a uint on the wire (0 or 1), as the first workers sent it */
    if (a->has_events_next) km_enc_u64(e, "events_next", a->events_next);
    if (a->has_events_next || a->events_snapshot)
        km_enc_u64(e, "events_snapshot", a->events_snapshot);
}

static int reply_decode(km_dec *d, const msgpack_object_map *mp)
{
    km_msg_admin_reply *a = &d->m->admin_reply;
    int cmd = 0, st = 0;
    CK(km_dec_uint(d, mp, "id", true, UINT64_MAX, &a->id));
    CK(km_dec_enum(d, mp, "cmd", true, km_proto_admin_names, KM_ADMIN_CMD_COUNT, &cmd));
    a->cmd = (km_admin_cmd)cmd;
    CK(km_dec_bool(d, mp, "ok", true, &a->ok));
    CK(km_dec_i32(d, mp, "code", !a->ok, &a->code));
    CK(km_dec_str(d, mp, "message", false, KM_PROTO_MAX_MESSAGE, false, &a->message, NULL));
    CK(km_dec_enum(d, mp, "state", false, km_proto_state_names, KM_STATE_COUNT, &st));
    a->state = (km_worker_state)st;
    CK(km_dec_str(d, mp, "kv_format", false, KM_PROTO_MAX_NAME, false, &a->kv_format, NULL));
    int role = KM_WROLE_BOTH;
    CK(km_dec_enum(d, mp, "role", false, km_proto_role_names, KM_WROLE_COUNT, &role));
    a->role = (km_worker_role)role;
    CK(km_dec_u32(d, mp, "inflight", false, &a->inflight));
    CK(km_dec_u32(d, mp, "queued", false, &a->queued));
    CK(km_dec_uint(d, mp, "kv_pages", false, UINT64_MAX, &a->kv_pages));
    CK(km_dec_uint(d, mp, "kv_bytes", false, UINT64_MAX, &a->kv_bytes));
    CK(km_dec_uint(d, mp, "evicted_pages", false, UINT64_MAX, &a->evicted_pages));
    CK(km_dec_uint(d, mp, "freed_bytes", false, UINT64_MAX, &a->freed_bytes));
    CK(km_dec_uint(d, mp, "converted_pages", false, UINT64_MAX, &a->converted_pages));
    a->has_events_next = km_dec_find(mp, "events_next") != NULL;
    CK(km_dec_uint(d, mp, "events_next", false, UINT64_MAX, &a->events_next));
    return km_dec_flag(d, mp, "events_snapshot", &a->events_snapshot);
}

const km_proto_codec km_proto_codec_admin_reply = {reply_validate, reply_encode, reply_decode};
