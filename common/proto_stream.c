/*
 * proto_stream.c — the request path's messages (docs/protocol.md sections 4–8): `req`, the
 * `tok` frames of its stream, the `done` or `err` that ends it, and `cancel`. One codec per
 * type (validate, encode, decode), written with the helpers of proto_wire.c.
 *
 * A request carries its prompt either as text or as token ids (exactly one); a `done` carries
 * the keys routers add (worker, migrations) like any other optional key.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common/proto_internal.h"

/* ---------------------------------------------------------------- token values
 * req.logit_bias and tok.top: arrays of [id, number] pairs. */

static int val_token_values(const char *what, const km_token_value *v, uint32_t n, uint32_t max,
                            float lo, float hi, km_errbuf *err)
{
    if (n > max) VFAIL("%s: %u entries, limit %u", what, n, max);
    if (n && !v) VFAIL("%s: NULL with %u entries", what, n);
    for (uint32_t i = 0; i < n; i++) {
        if (v[i].token < 0) VFAIL("%s[%u]: negative id %d", what, i, v[i].token);
        if (!(v[i].value >= lo && v[i].value <= hi))
            VFAIL("%s[%u]: %g outside [%g, %g]", what, i, v[i].value, lo, hi);
    }
    return 0;
}

static void enc_token_values(km_enc *e, const char *k, const km_token_value *v, uint32_t n)
{
    if (!n || !km_enc_begin(e, k)) return;
    e->rc |= msgpack_pack_array(&e->pk, n);
    for (uint32_t i = 0; i < n; i++) {
        e->rc |= msgpack_pack_array(&e->pk, 2);
        e->rc |= msgpack_pack_uint32(&e->pk, (uint32_t)v[i].token);
        e->rc |= msgpack_pack_float(&e->pk, v[i].value);
    }
}

static int dec_token_values(km_dec *d, const msgpack_object_map *mp, const char *key, uint32_t max,
                            const km_token_value **out, uint32_t *n)
{
    const msgpack_object *o;
    CK(km_dec_obj(d, mp, key, false, MSGPACK_OBJECT_ARRAY, &o));
    if (!o) return 0;
    const msgpack_object_array *a = &o->via.array;
    if (a->size > max)
        return DFAIL(d, KM_EFORMAT, "%s.%s: %u entries, limit %u", d->path, key, a->size, max);
    km_token_value *v = km_msg_alloc(d->m, (size_t)(a->size ? a->size : 1) * sizeof *v);
    if (!v) return DFAIL(d, KM_ENOMEM, "%s.%s: out of memory", d->path, key);
    for (uint32_t i = 0; i < a->size; i++) {
        const msgpack_object *p = &a->ptr[i];
        const msgpack_object *id =
            p->type == MSGPACK_OBJECT_ARRAY && p->via.array.size == 2 ? &p->via.array.ptr[0] : NULL;
        const msgpack_object *x = id ? id + 1 : NULL;
        double val = !x ? NAN
                     : x->type == MSGPACK_OBJECT_FLOAT32 || x->type == MSGPACK_OBJECT_FLOAT64
                         ? x->via.f64
                     : x->type == MSGPACK_OBJECT_POSITIVE_INTEGER ? (double)x->via.u64
                     : x->type == MSGPACK_OBJECT_NEGATIVE_INTEGER ? (double)x->via.i64
                                                                  : NAN;
        if (!id || id->type != MSGPACK_OBJECT_POSITIVE_INTEGER || id->via.u64 > INT32_MAX ||
            isnan(val) || fabs(val) > 1e30)
            return DFAIL(d, KM_EFORMAT, "%s.%s[%u]: expected [token id, number]", d->path, key, i);
        v[i] = (km_token_value){(int32_t)id->via.u64, (float)val};
    }
    *out = v;
    *n = a->size;
    return 0;
}

/* ---------------------------------------------------------------- req */

/* The pull hint: all of it with pull_from, none of it counted without. */
static int req_validate_pull(const km_msg_request *r, km_errbuf *err)
{
    if (!r->pull_from) return 0;
    CK(km_val_name("req.pull_from", r->pull_from, true, 1, KM_PROTO_MAX_NAME, err));
    CK(km_val_name("req.pull_endpoint", r->pull_endpoint, true, 1, KM_PROTO_MAX_NAME, err));
    if (!r->pull_addr || r->pull_addr_len < 1 || r->pull_addr_len > KM_PROTO_MAX_PEER_ADDR)
        VFAIL("req.pull_addr: %u bytes outside [1, %d]", r->pull_addr ? r->pull_addr_len : 0,
              KM_PROTO_MAX_PEER_ADDR);
    const bool chunks = r->pull_chunks || r->n_pull_more;
    if (r->pull_pages < (chunks ? 0u : 1u) || r->pull_pages > KM_PROTO_MAX_PULL_PAGES)
        VFAIL("req.pull_pages: %u outside [%d, %d]", r->pull_pages, chunks ? 0 : 1,
              KM_PROTO_MAX_PULL_PAGES);
    if (r->n_chunks < 64 && r->pull_chunks >> r->n_chunks)
        VFAIL("req.pull_chunks: names a chunk past the request's %u", r->n_chunks);
    if (r->n_pull_more > KM_PROTO_MAX_PULL_MORE || (r->n_pull_more && !r->pull_more))
        VFAIL("req.pull_more: %u holders, limit %d", r->n_pull_more, KM_PROTO_MAX_PULL_MORE);
    uint64_t named = r->pull_chunks;
    for (uint32_t i = 0; i < r->n_pull_more; i++) {
        const km_pull_more *m = &r->pull_more[i];
        CK(km_val_name("req.pull_more.from", m->from, true, 1, KM_PROTO_MAX_NAME, err));
        if (!m->chunks || (r->n_chunks < 64 && m->chunks >> r->n_chunks) || (m->chunks & named))
            VFAIL("req.pull_more[%u]: chunks %#llx: none, past the request's %u or named twice", i,
                  (unsigned long long)m->chunks, r->n_chunks);
        named |= m->chunks;
    }
    return 0;
}

/* req.chunks: in order, disjoint, non-empty, inside the token prompt (generated ids included). */
static int req_check_chunks(const km_chunk_seg *c, uint32_t n, uint32_t n_tokens, km_errbuf *err)
{
    if (n > KM_PROTO_MAX_CHUNKS) VFAIL("req.chunks: %u segments, limit %d", n, KM_PROTO_MAX_CHUNKS);
    if (n && !c) VFAIL("req.chunks: NULL with %u segments", n);
    if (n && !n_tokens) VFAIL("req.chunks: needs tokens (segments are token positions)");
    for (uint32_t i = 0; i < n; i++) {
        if (!c[i].n) VFAIL("req.chunks[%u]: empty", i);
        if ((uint64_t)c[i].start + c[i].n > n_tokens)
            VFAIL("req.chunks[%u]: [%u, %u) past the prompt's %u tokens", i, c[i].start,
                  c[i].start + c[i].n, n_tokens);
        if (i && c[i].start < c[i - 1].start + c[i - 1].n)
            VFAIL("req.chunks[%u]: starts at %u, inside or before the segment before it (ends at "
                  "%u)",
                  i, c[i].start, c[i - 1].start + c[i - 1].n);
    }
    return 0;
}

static int req_validate(const km_msg *m, const km_proto_limits *lim, km_errbuf *err)
{
    const km_msg_request *r = &m->req;
    CK(km_val_name("req.model", r->model, true, 1, KM_PROTO_MAX_NAME, err));
    bool has_text = r->prompt != NULL, has_tok = r->n_tokens > 0;
    if (has_text == has_tok) VFAIL("req: exactly one of prompt and tokens is required");
    if (has_text && km_text_len(r->prompt, r->prompt_len) > lim->max_frame)
        VFAIL("req.prompt: longer than the frame limit %zu", lim->max_frame);
    if (has_tok) {
        if (!r->tokens) VFAIL("req.tokens: NULL with n_tokens %u", r->n_tokens);
        if (r->n_tokens > lim->max_prompt_tok)
            VFAIL("req.tokens: %u ids, limit %u", r->n_tokens, lim->max_prompt_tok);
        for (uint32_t i = 0; i < r->n_tokens; i++)
            if (r->tokens[i] < 0) VFAIL("req.tokens[%u]: negative id %d", i, r->tokens[i]);
    }
    CK(km_val_range("req.temperature", r->temperature, 0, 100, err));
    CK(km_val_range("req.top_k", r->top_k, 0, 1 << 20, err));
    CK(km_val_range("req.top_p", r->top_p, 0, 1, err));
    CK(km_val_range("req.min_p", r->min_p, 0, 1, err));
    if (!(r->repeat_penalty > 0 && r->repeat_penalty <= 100))
        VFAIL("req.repeat_penalty: %g outside (0, 100]", r->repeat_penalty);
    CK(km_val_range("req.repeat_last_n", r->repeat_last_n, 0, 1 << 20, err));
    CK(km_val_range("req.presence_penalty", r->presence_penalty, -2, 2, err));
    CK(km_val_range("req.frequency_penalty", r->frequency_penalty, -2, 2, err));
    CK(km_val_range("req.max_tokens", r->max_tokens, 0, 1 << 20, err));
    if (r->n_stop > KM_PROTO_MAX_STOP)
        VFAIL("req.stop: %u strings, limit %d", r->n_stop, KM_PROTO_MAX_STOP);
    if (r->n_stop && !r->stop) VFAIL("req.stop: NULL with n_stop %u", r->n_stop);
    for (uint32_t i = 0; i < r->n_stop; i++) {
        char what[32];
        snprintf(what, sizeof what, "req.stop[%u]", i);
        CK(km_val_name(what, r->stop[i], true, 1, KM_PROTO_MAX_NAME, err));
    }
    CK(km_val_name("req.cache_salt", r->cache_salt, false, 0, KM_PROTO_MAX_NAME, err));
    CK(km_val_range("req.priority", r->priority, -100, 100, err));
    if ((unsigned)r->speculate >= KM_SPECULATE_COUNT)
        VFAIL("req.speculate: unknown value %d", (int)r->speculate);
    CK(km_val_range("req.max_draft_tokens", r->max_draft_tokens, 0, KM_PROTO_MAX_DRAFT, err));
    CK(km_val_range("req.top_logprobs", r->top_logprobs, 0, KM_PROTO_MAX_TOP, err));
    if (r->top_logprobs && !r->logprobs) VFAIL("req.top_logprobs: needs logprobs");
    if (r->prompt_logprobs && !r->logprobs) VFAIL("req.prompt_logprobs: needs logprobs");
    CK(val_token_values("req.logit_bias", r->logit_bias, r->n_logit_bias, KM_PROTO_MAX_BIAS, -100,
                        100, err));
    CK(km_val_name("req.grammar", r->grammar, false, 1, KM_PROTO_MAX_GRAMMAR, err));
    if (r->generated && r->generated >= r->n_tokens)
        VFAIL("req.generated: %u, needs tokens with at least one more id (%u)", r->generated,
              r->n_tokens);
    CK(req_check_chunks(r->chunks, r->n_chunks, r->n_tokens, err));
    return req_validate_pull(r, err);
}

static void req_encode(km_enc *e, const km_msg *m)
{
    const km_msg_request *r = &m->req;
    km_enc_u64(e, "id", r->id);
    km_enc_str(e, "model", r->model);
    km_enc_strn(e, "prompt", r->prompt, r->prompt_len);
    if (r->n_tokens && km_enc_begin(e, "tokens")) {
        e->rc |= msgpack_pack_array(&e->pk, r->n_tokens);
        for (uint32_t i = 0; i < r->n_tokens; i++)
            e->rc |= msgpack_pack_uint32(&e->pk, (uint32_t)r->tokens[i]);
    }
    km_enc_f32(e, "temperature", r->temperature);
    km_enc_i64(e, "top_k", r->top_k);
    km_enc_f32(e, "top_p", r->top_p);
    km_enc_f32(e, "min_p", r->min_p);
    km_enc_f32(e, "repeat_penalty", r->repeat_penalty);
    km_enc_i64(e, "repeat_last_n", r->repeat_last_n);
    km_enc_f32(e, "presence_penalty", r->presence_penalty);
    km_enc_f32(e, "frequency_penalty", r->frequency_penalty);
    if (r->has_seed) km_enc_u64(e, "seed", r->seed);
    km_enc_u64(e, "max_tokens", r->max_tokens);
    if (r->n_stop && km_enc_begin(e, "stop")) {
        e->rc |= msgpack_pack_array(&e->pk, r->n_stop);
        for (uint32_t i = 0; i < r->n_stop; i++) km_enc_text(e, r->stop[i], strlen(r->stop[i]));
    }
    km_enc_str(e, "cache_salt", r->cache_salt);
    km_enc_i64(e, "priority", r->priority);
    km_enc_u64(e, "deadline_ms", r->deadline_ms);
    if (r->generated) km_enc_u64(e, "generated", r->generated);
    km_enc_bool(e, "stream", r->stream);
    if (r->speculate) km_enc_str(e, "speculate", km_proto_speculate_names[r->speculate]);
    if (r->max_draft_tokens) km_enc_u64(e, "max_draft_tokens", r->max_draft_tokens);
    if (r->logprobs) km_enc_bool(e, "logprobs", true);
    if (r->top_logprobs) km_enc_u64(e, "top_logprobs", r->top_logprobs);
    if (r->prompt_logprobs) km_enc_bool(e, "prompt_logprobs", true);
    enc_token_values(e, "logit_bias", r->logit_bias, r->n_logit_bias);
    if (r->grammar) km_enc_str(e, "grammar", r->grammar);
    if (r->n_chunks && km_enc_begin(e, "chunks")) {
        e->rc |= msgpack_pack_array(&e->pk, r->n_chunks);
        for (uint32_t i = 0; i < r->n_chunks; i++) {
            e->rc |= msgpack_pack_array(&e->pk, 2);
            e->rc |= msgpack_pack_uint32(&e->pk, r->chunks[i].start);
            e->rc |= msgpack_pack_uint32(&e->pk, r->chunks[i].n);
        }
    }
    if (r->pull_from) {
        km_enc_str(e, "pull_from", r->pull_from);
        km_enc_str(e, "pull_endpoint", r->pull_endpoint);
        km_enc_bin(e, "pull_addr", r->pull_addr, r->pull_addr_len);
        km_enc_u64(e, "pull_pages", r->pull_pages);
        km_enc_u64(e, "pull_ms", r->pull_ms);
        if (r->pd) km_enc_bool(e, "pd", true);
        if (r->pull_chunks) km_enc_u64(e, "pull_chunks", r->pull_chunks);
        if (r->n_pull_more && km_enc_begin(e, "pull_more")) {
            e->rc |= msgpack_pack_array(&e->pk, r->n_pull_more);
            for (uint32_t i = 0; i < r->n_pull_more; i++) {
                const size_t n = strlen(r->pull_more[i].from);
                e->rc |= msgpack_pack_array(&e->pk, 2);
                e->rc |= msgpack_pack_str(&e->pk, n);
                e->rc |= msgpack_pack_str_body(&e->pk, r->pull_more[i].from, n);
                e->rc |= msgpack_pack_uint64(&e->pk, r->pull_more[i].chunks);
            }
        }
    }
}

static int req_decode_tokens(km_dec *d, const msgpack_object_array *a)
{
    km_msg_request *r = &d->m->req;
    if (a->size > d->lim->max_prompt_tok)
        return DFAIL(d, KM_ERANGE, "req.tokens: %u ids, limit %u", a->size, d->lim->max_prompt_tok);
    int32_t *t = km_msg_alloc(d->m, (size_t)a->size * sizeof *t);
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
    return 0;
}

static int req_decode_stop(km_dec *d, const msgpack_object_array *a)
{
    km_msg_request *r = &d->m->req;
    if (a->size > KM_PROTO_MAX_STOP)
        return DFAIL(d, KM_EFORMAT, "req.stop: %u strings, limit %d", a->size, KM_PROTO_MAX_STOP);
    const char **s = km_msg_alloc(d->m, (size_t)a->size * sizeof *s);
    if (!s) return DFAIL(d, KM_ENOMEM, "req.stop: out of memory");
    for (uint32_t i = 0; i < a->size; i++) {
        char what[32];
        snprintf(what, sizeof what, "req.stop[%u]", i);
        CK(km_dec_copy_str(d, what, &a->ptr[i], KM_PROTO_MAX_NAME, false, &s[i], NULL));
    }
    r->stop = s;
    r->n_stop = a->size;
    return 0;
}

static int req_decode_chunks(km_dec *d, const msgpack_object_array *a)
{
    km_msg_request *r = &d->m->req;
    if (a->size > KM_PROTO_MAX_CHUNKS)
        return DFAIL(d, KM_EFORMAT, "req.chunks: %u segments, limit %d", a->size,
                     KM_PROTO_MAX_CHUNKS);
    km_chunk_seg *c = km_msg_alloc(d->m, (size_t)(a->size ? a->size : 1) * sizeof *c);
    if (!c) return DFAIL(d, KM_ENOMEM, "req.chunks: out of memory");
    for (uint32_t i = 0; i < a->size; i++) {
        const msgpack_object *p = &a->ptr[i];
        const msgpack_object *x =
            p->type == MSGPACK_OBJECT_ARRAY && p->via.array.size == 2 ? p->via.array.ptr : NULL;
        if (!x || x[0].type != MSGPACK_OBJECT_POSITIVE_INTEGER ||
            x[1].type != MSGPACK_OBJECT_POSITIVE_INTEGER || x[0].via.u64 > UINT32_MAX ||
            x[1].via.u64 > UINT32_MAX)
            return DFAIL(d, KM_EFORMAT, "req.chunks[%u]: expected [start, length]", i);
        c[i] = (km_chunk_seg){(uint32_t)x[0].via.u64, (uint32_t)x[1].via.u64};
    }
    r->chunks = c;
    r->n_chunks = a->size;
    km_errbuf err = {{0}};
    if (req_check_chunks(c, a->size, r->n_tokens, &err)) return DFAIL(d, KM_EFORMAT, "%s", err.msg);
    return 0;
}

/* req.pull_more: [[worker id, chunk bits], ...]; validated with the rest of the request. */
static int req_decode_pull_more(km_dec *d, const msgpack_object_array *a)
{
    km_msg_request *r = &d->m->req;
    if (a->size > KM_PROTO_MAX_PULL_MORE)
        return DFAIL(d, KM_EFORMAT, "req.pull_more: %u holders, limit %d", a->size,
                     KM_PROTO_MAX_PULL_MORE);
    km_pull_more *m = km_msg_alloc(d->m, (size_t)(a->size ? a->size : 1) * sizeof *m);
    if (!m) return DFAIL(d, KM_ENOMEM, "req.pull_more: out of memory");
    for (uint32_t i = 0; i < a->size; i++) {
        const msgpack_object *p = &a->ptr[i];
        const msgpack_object *x =
            p->type == MSGPACK_OBJECT_ARRAY && p->via.array.size == 2 ? p->via.array.ptr : NULL;
        if (!x || x[1].type != MSGPACK_OBJECT_POSITIVE_INTEGER)
            return DFAIL(d, KM_EFORMAT, "req.pull_more[%u]: expected [worker, chunks]", i);
        CK(km_dec_copy_str(d, "req.pull_more.from", &x[0], KM_PROTO_MAX_NAME, false, &m[i].from,
                           NULL));
        m[i].chunks = x[1].via.u64;
    }
    r->pull_more = m;
    r->n_pull_more = a->size;
    return 0;
}

static int req_decode(km_dec *d, const msgpack_object_map *mp)
{
    km_msg_request *r = &d->m->req;
    const msgpack_object *o;
    CK(km_dec_uint(d, mp, "id", true, UINT64_MAX, &r->id));
    CK(km_dec_str(d, mp, "model", true, KM_PROTO_MAX_NAME, false, &r->model, NULL));
    CK(km_dec_str(d, mp, "prompt", false, d->lim->max_frame, true, &r->prompt, &r->prompt_len));
    CK(km_dec_obj(d, mp, "tokens", false, MSGPACK_OBJECT_ARRAY, &o));
    if (o) CK(req_decode_tokens(d, &o->via.array));
    CK(km_dec_f32(d, mp, "temperature", &r->temperature));
    CK(km_dec_i32(d, mp, "top_k", false, &r->top_k));
    CK(km_dec_f32(d, mp, "top_p", &r->top_p));
    CK(km_dec_f32(d, mp, "min_p", &r->min_p));
    CK(km_dec_f32(d, mp, "repeat_penalty", &r->repeat_penalty));
    CK(km_dec_i32(d, mp, "repeat_last_n", false, &r->repeat_last_n));
    CK(km_dec_f32(d, mp, "presence_penalty", &r->presence_penalty));
    CK(km_dec_f32(d, mp, "frequency_penalty", &r->frequency_penalty));
    r->has_seed = km_dec_find(mp, "seed") != NULL;
    CK(km_dec_uint(d, mp, "seed", false, UINT64_MAX, &r->seed));
    CK(km_dec_u32(d, mp, "max_tokens", false, &r->max_tokens));
    CK(km_dec_obj(d, mp, "stop", false, MSGPACK_OBJECT_ARRAY, &o));
    if (o) CK(req_decode_stop(d, &o->via.array));
    CK(km_dec_str(d, mp, "cache_salt", false, KM_PROTO_MAX_NAME, false, &r->cache_salt, NULL));
    CK(km_dec_i32(d, mp, "priority", false, &r->priority));
    CK(km_dec_u32(d, mp, "deadline_ms", false, &r->deadline_ms));
    CK(km_dec_bool(d, mp, "stream", false, &r->stream));
    int sp = 0;
    CK(km_dec_enum(d, mp, "speculate", false, km_proto_speculate_names, KM_SPECULATE_COUNT, &sp));
    r->speculate = (km_speculate)sp;
    CK(km_dec_u32(d, mp, "generated", false, &r->generated));
    if (r->generated && r->generated >= r->n_tokens)
        return DFAIL(d, KM_EFORMAT, "req.generated: %u, needs tokens with at least one more id",
                     r->generated);
    CK(km_dec_u32(d, mp, "max_draft_tokens", false, &r->max_draft_tokens));
    CK(km_dec_bool(d, mp, "logprobs", false, &r->logprobs));
    CK(km_dec_u32(d, mp, "top_logprobs", false, &r->top_logprobs));
    CK(km_dec_bool(d, mp, "prompt_logprobs", false, &r->prompt_logprobs));
    if (r->top_logprobs > KM_PROTO_MAX_TOP || (r->top_logprobs && !r->logprobs))
        return DFAIL(d, KM_EFORMAT, "req.top_logprobs: %u, at most %d and with logprobs",
                     r->top_logprobs, KM_PROTO_MAX_TOP);
    CK(dec_token_values(d, mp, "logit_bias", KM_PROTO_MAX_BIAS, &r->logit_bias, &r->n_logit_bias));
    for (uint32_t i = 0; i < r->n_logit_bias; i++)
        if (fabsf(r->logit_bias[i].value) > 100)
            return DFAIL(d, KM_EFORMAT, "req.logit_bias[%u]: %g outside [-100, 100]", i,
                         r->logit_bias[i].value);
    CK(km_dec_str(d, mp, "grammar", false, KM_PROTO_MAX_GRAMMAR, false, &r->grammar, NULL));
    CK(km_dec_obj(d, mp, "chunks", false, MSGPACK_OBJECT_ARRAY, &o));
    if (o) CK(req_decode_chunks(d, &o->via.array));
    CK(km_dec_str(d, mp, "pull_from", false, KM_PROTO_MAX_NAME, false, &r->pull_from, NULL));
    if (!r->pull_from) return 0; /* the rest of a hint means nothing without it */
    CK(km_dec_str(d, mp, "pull_endpoint", true, KM_PROTO_MAX_NAME, false, &r->pull_endpoint, NULL));
    CK(km_dec_bin(d, mp, "pull_addr", true, KM_PROTO_MAX_PEER_ADDR, &r->pull_addr,
                  &r->pull_addr_len));
    CK(km_dec_u32(d, mp, "pull_pages", true, &r->pull_pages));
    CK(km_dec_bool(d, mp, "pd", false, &r->pd));
    CK(km_dec_uint(d, mp, "pull_chunks", false, UINT64_MAX, &r->pull_chunks));
    CK(km_dec_obj(d, mp, "pull_more", false, MSGPACK_OBJECT_ARRAY, &o));
    if (o) CK(req_decode_pull_more(d, &o->via.array));
    return km_dec_u32(d, mp, "pull_ms", false, &r->pull_ms);
}

const km_proto_codec km_proto_codec_req = {req_validate, req_encode, req_decode};

/* ---------------------------------------------------------------- tok */

static int tok_validate(const km_msg *m, const km_proto_limits *lim, km_errbuf *err)
{
    if (!m->tok.text) VFAIL("tok.text: required");
    if (km_text_len(m->tok.text, m->tok.text_len) > KM_PROTO_MAX_PIECE)
        VFAIL("tok.text: longer than %d bytes", KM_PROTO_MAX_PIECE);
    if (m->tok.token < 0) VFAIL("tok.token: negative id %d", m->tok.token);
    if (m->tok.n_top && !m->tok.has_logprob) VFAIL("tok.top: needs logprob");
    if (m->tok.has_logprob && !(m->tok.logprob <= 0)) VFAIL("tok.logprob: %g > 0", m->tok.logprob);
    return val_token_values("tok.top", m->tok.top, m->tok.n_top, KM_PROTO_MAX_TOP, -INFINITY, 0,
                            err);
}

static void tok_encode(km_enc *e, const km_msg *m)
{
    km_enc_u64(e, "id", m->tok.id);
    km_enc_u64(e, "index", m->tok.index);
    km_enc_u64(e, "token", (uint64_t)m->tok.token);
    km_enc_strn(e, "text", m->tok.text, m->tok.text_len);
    if (m->tok.has_logprob) km_enc_f32(e, "logprob", m->tok.logprob);
    enc_token_values(e, "top", m->tok.top, m->tok.n_top);
    if (m->tok.prompt) km_enc_bool(e, "prompt", true);
}

static int tok_decode(km_dec *d, const msgpack_object_map *mp)
{
    km_msg_token *t = &d->m->tok;
    CK(km_dec_uint(d, mp, "id", true, UINT64_MAX, &t->id));
    CK(km_dec_u32(d, mp, "index", true, &t->index));
    CK(km_dec_i32(d, mp, "token", true, &t->token));
    CK(km_dec_str(d, mp, "text", true, KM_PROTO_MAX_PIECE, true, &t->text, &t->text_len));
    t->has_logprob = km_dec_find(mp, "logprob") != NULL;
    t->logprob = 0;
    CK(km_dec_f32(d, mp, "logprob", &t->logprob));
    CK(km_dec_bool(d, mp, "prompt", false, &t->prompt));
    return dec_token_values(d, mp, "top", KM_PROTO_MAX_TOP, &t->top, &t->n_top);
}

const km_proto_codec km_proto_codec_tok = {tok_validate, tok_encode, tok_decode};

/* ---------------------------------------------------------------- done */

static int done_validate(const km_msg *m, const km_proto_limits *lim, km_errbuf *err)
{
    const km_msg_done *d = &m->done;
    if ((unsigned)d->finish >= KM_FINISH_COUNT)
        VFAIL("done.finish: unknown reason %d", (int)d->finish);
    if (d->text && km_text_len(d->text, d->text_len) > lim->max_frame)
        VFAIL("done.text: longer than the frame limit %zu", lim->max_frame);
    if (d->cached_tokens > d->prompt_tokens)
        VFAIL("done.usage: cached_tokens %u > prompt_tokens %u", d->cached_tokens,
              d->prompt_tokens);
    if ((uint64_t)d->cached_tokens + d->chunk_tokens > d->prompt_tokens)
        VFAIL("done.usage: cached_tokens %u + chunk_tokens %u > prompt_tokens %u", d->cached_tokens,
              d->chunk_tokens, d->prompt_tokens);
    if (d->accepted_draft_tokens > d->draft_tokens)
        VFAIL("done.usage: accepted_draft_tokens %u > draft_tokens %u", d->accepted_draft_tokens,
              d->draft_tokens);
    CK(km_val_nonneg("done.timings.queue_ms", d->queue_ms, err));
    CK(km_val_nonneg("done.timings.ttft_ms", d->ttft_ms, err));
    CK(km_val_nonneg("done.timings.total_ms", d->total_ms, err));
    return km_val_name("done.worker", d->worker, false, 0, KM_PROTO_MAX_NAME, err);
}

static void done_usage(km_enc *e, const void *arg)
{
    const km_msg_done *d = arg;
    km_enc_u64(e, "prompt_tokens", d->prompt_tokens);
    km_enc_u64(e, "cached_tokens", d->cached_tokens);
    km_enc_u64(e, "completion_tokens", d->completion_tokens);
    if (d->draft_tokens) km_enc_u64(e, "draft_tokens", d->draft_tokens);
    if (d->accepted_draft_tokens) km_enc_u64(e, "accepted_draft_tokens", d->accepted_draft_tokens);
    if (d->chunk_tokens) km_enc_u64(e, "chunk_tokens", d->chunk_tokens);
}

static void done_timings(km_enc *e, const void *arg)
{
    const km_msg_done *d = arg;
    km_enc_f64(e, "queue_ms", d->queue_ms);
    km_enc_f64(e, "ttft_ms", d->ttft_ms);
    km_enc_f64(e, "total_ms", d->total_ms);
}

static void done_encode(km_enc *e, const km_msg *m)
{
    const km_msg_done *d = &m->done;
    km_enc_u64(e, "id", d->id);
    km_enc_str(e, "finish", km_proto_finish_names[d->finish]);
    km_enc_strn(e, "text", d->text, d->text_len);
    if (km_enc_begin(e, "usage")) km_enc_map(e, done_usage, d);
    if (km_enc_begin(e, "timings")) km_enc_map(e, done_timings, d);
    km_enc_str(e, "worker", d->worker);
    if (d->migrations) km_enc_u64(e, "migrations", d->migrations);
}

static int done_decode(km_dec *d, const msgpack_object_map *mp)
{
    km_msg_done *dn = &d->m->done;
    const msgpack_object *o;
    int f = 0;
    CK(km_dec_uint(d, mp, "id", true, UINT64_MAX, &dn->id));
    CK(km_dec_enum(d, mp, "finish", true, km_proto_finish_names, KM_FINISH_COUNT, &f));
    dn->finish = (km_finish)f;
    CK(km_dec_str(d, mp, "text", false, d->lim->max_frame, true, &dn->text, &dn->text_len));
    size_t n = strlen(d->path);
    CK(km_dec_obj(d, mp, "usage", true, MSGPACK_OBJECT_MAP, &o));
    km_dec_path_push(d, ".usage");
    CK(km_dec_check_map(d, &o->via.map));
    CK(km_dec_u32(d, &o->via.map, "prompt_tokens", true, &dn->prompt_tokens));
    CK(km_dec_u32(d, &o->via.map, "cached_tokens", false, &dn->cached_tokens));
    CK(km_dec_u32(d, &o->via.map, "completion_tokens", true, &dn->completion_tokens));
    CK(km_dec_u32(d, &o->via.map, "draft_tokens", false, &dn->draft_tokens));
    CK(km_dec_u32(d, &o->via.map, "accepted_draft_tokens", false, &dn->accepted_draft_tokens));
    CK(km_dec_u32(d, &o->via.map, "chunk_tokens", false, &dn->chunk_tokens));
    km_dec_path_set(d, n);
    CK(km_dec_obj(d, mp, "timings", false, MSGPACK_OBJECT_MAP, &o));
    if (o) {
        km_dec_path_push(d, ".timings");
        CK(km_dec_check_map(d, &o->via.map));
        CK(km_dec_num(d, &o->via.map, "queue_ms", false, &dn->queue_ms));
        CK(km_dec_num(d, &o->via.map, "ttft_ms", false, &dn->ttft_ms));
        CK(km_dec_num(d, &o->via.map, "total_ms", false, &dn->total_ms));
        km_dec_path_set(d, n);
    }
    CK(km_dec_str(d, mp, "worker", false, KM_PROTO_MAX_NAME, false, &dn->worker, NULL));
    return km_dec_u32(d, mp, "migrations", false, &dn->migrations);
}

const km_proto_codec km_proto_codec_done = {done_validate, done_encode, done_decode};

/* ---------------------------------------------------------------- err */

static int err_validate(const km_msg *m, const km_proto_limits *lim, km_errbuf *err)
{
    CK(km_val_range("err.code", m->error.code, 1, 999, err));
    return km_val_name("err.message", m->error.message, true, 0, KM_PROTO_MAX_MESSAGE, err);
}

static void err_encode(km_enc *e, const km_msg *m)
{
    km_enc_u64(e, "id", m->error.id);
    km_enc_i64(e, "code", m->error.code);
    km_enc_str(e, "message", m->error.message);
    if (m->error.retry_after_ms) km_enc_u64(e, "retry_after_ms", m->error.retry_after_ms);
}

static int err_decode(km_dec *d, const msgpack_object_map *mp)
{
    km_msg_error *er = &d->m->error;
    CK(km_dec_uint(d, mp, "id", false, UINT64_MAX, &er->id));
    CK(km_dec_i32(d, mp, "code", true, &er->code));
    CK(km_dec_str(d, mp, "message", true, KM_PROTO_MAX_MESSAGE, false, &er->message, NULL));
    return km_dec_u32(d, mp, "retry_after_ms", false, &er->retry_after_ms);
}

const km_proto_codec km_proto_codec_err = {err_validate, err_encode, err_decode};

/* ---------------------------------------------------------------- cancel */

static int cancel_validate(const km_msg *m, const km_proto_limits *lim, km_errbuf *err)
{
    return 0;
}

static void cancel_encode(km_enc *e, const km_msg *m)
{
    km_enc_u64(e, "id", m->cancel.id);
}

static int cancel_decode(km_dec *d, const msgpack_object_map *mp)
{
    return km_dec_uint(d, mp, "id", true, UINT64_MAX, &d->m->cancel.id);
}

const km_proto_codec km_proto_codec_cancel = {cancel_validate, cancel_encode, cancel_decode};
