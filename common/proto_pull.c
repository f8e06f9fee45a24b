/*
 * proto_pull.c — the page transfer's control frames (docs/protocol.md section 17; the design is
 * docs/transfer.md): `kv_pull` (puller -> holder: pin these pages of a chain), `kv_offer`
 * (holder -> puller: the pages pinned and where they lie in the holder's registered memory) and
 * `kv_pull_done` (puller -> holder: the lease can end). They travel on the holder's requests
 * endpoint like requests; the page bytes themselves move over UCX (peer/), never here. One codec
 * per type.
 *
 * Hashes travel as 16-byte canonical bins (like kv events); token ids as arrays of uints (like
 * req.tokens). The frame's `id` is the puller's pull id, so a rejected pull is answered with an
 * `err` naming it. What a frame claims is checked here for shape only (counts agree, indexes
 * consecutive, sizes bounded): whether a page is what it claims is the puller's check in peer/
 * before a byte moves.
 */
#include <stdio.h>
#include <string.h>

#include "common/proto_internal.h"

/* ---------------------------------------------------------------- shared */

static int tokens_validate(const char *what, const int32_t *t, uint64_t n,
                           const km_proto_limits *lim, km_errbuf *err)
{
    if (n > lim->max_prompt_tok)
        VFAIL("%s: %llu ids, limit %u", what, (unsigned long long)n, lim->max_prompt_tok);
    if (n && !t) VFAIL("%s: NULL", what);
    for (uint64_t i = 0; i < n; i++)
        if (t[i] < 0) VFAIL("%s[%llu]: negative id %d", what, (unsigned long long)i, t[i]);
    return 0;
}

static void tokens_encode(km_enc *e, const char *key, const int32_t *t, uint64_t n)
{
    if (km_enc_begin(e, key)) {
        e->rc |= msgpack_pack_array(&e->pk, (size_t)n);
        for (uint64_t i = 0; i < n; i++) e->rc |= msgpack_pack_uint32(&e->pk, (uint32_t)t[i]);
    }
}

/* The array under key, exactly n token ids (n already bounded by the caller). */
static int tokens_decode(km_dec *d, const msgpack_object_map *mp, const char *key, uint64_t n,
                         const int32_t **out)
{
    const msgpack_object *o;
    CK(km_dec_obj(d, mp, key, true, MSGPACK_OBJECT_ARRAY, &o));
    const msgpack_object_array *a = &o->via.array;
    if (n > d->lim->max_prompt_tok)
        return DFAIL(d, KM_ERANGE, "%s.%s: %llu ids, limit %u", d->path, key, (unsigned long long)n,
                     d->lim->max_prompt_tok);
    if (a->size != n)
        return DFAIL(d, KM_EFORMAT, "%s.%s: %u ids, expected pages x page_tokens = %llu", d->path,
                     key, a->size, (unsigned long long)n);
    int32_t *t = km_msg_alloc(d->m, (size_t)n * sizeof *t);
    if (!t) return DFAIL(d, KM_ENOMEM, "%s.%s: out of memory", d->path, key);
    for (uint32_t i = 0; i < a->size; i++) {
        const msgpack_object *e = &a->ptr[i];
        if (e->type != MSGPACK_OBJECT_POSITIVE_INTEGER || e->via.u64 > INT32_MAX)
            return DFAIL(d, KM_EFORMAT, "%s.%s[%u]: expected a token id in [0, %d]", d->path, key,
                         i, INT32_MAX);
        t[i] = (int32_t)e->via.u64;
    }
    *out = t;
    return 0;
}

/* A 16-byte hash under key into out. */
static int hash_decode(km_dec *d, const msgpack_object_map *mp, const char *key, uint8_t out[16])
{
    const msgpack_object *o = km_dec_find(mp, key);
    if (!o) return km_dec_absent(d, key, true);
    if (o->type != MSGPACK_OBJECT_BIN) return km_dec_wrong_type(d, key, "binary", o);
    if (o->via.bin.size != 16)
        return DFAIL(d, KM_EFORMAT, "%s.%s: %u bytes, a hash is 16", d->path, key, o->via.bin.size);
    memcpy(out, o->via.bin.ptr, 16);
    return 0;
}

/* A lease secret: exactly KM_PROTO_LEASE_KEY bytes. */
static int key_decode(km_dec *d, const msgpack_object_map *mp, const char *key, uint8_t *out)
{
    const msgpack_object *o = km_dec_find(mp, key);
    if (o->type != MSGPACK_OBJECT_BIN) return km_dec_wrong_type(d, key, "binary", o);
    if (o->via.bin.size != KM_PROTO_LEASE_KEY)
        return DFAIL(d, KM_EFORMAT, "%s.%s: %u bytes, a lease key is %d", d->path, key,
                     o->via.bin.size, KM_PROTO_LEASE_KEY);
    memcpy(out, o->via.bin.ptr, KM_PROTO_LEASE_KEY);
    return 0;
}

/* ---------------------------------------------------------------- kv_pull */

/* A chain (kv_pull, and kv_push's), named `what` in messages. */
static int chain_validate(const char *what, const km_msg_kv_pull *p, const km_proto_limits *lim,
                          km_errbuf *err)
{
    if (p->n_pages < 1 || p->n_pages > KM_PROTO_MAX_PULL_PAGES)
        VFAIL("%s.n_pages: %u outside [1, %d]", what, p->n_pages, KM_PROTO_MAX_PULL_PAGES);
    if (p->first >= p->n_pages)
        VFAIL("%s.first: %u, not below n_pages %u", what, p->first, p->n_pages);
    if (p->page_tokens < 1 || p->page_tokens > KM_PROTO_MAX_PAGE_TOKENS)
        VFAIL("%s.page_tokens: %u outside [1, %d]", what, p->page_tokens, KM_PROTO_MAX_PAGE_TOKENS);
    if (!p->hashes) VFAIL("%s.hashes: NULL", what);
    char tw[32];
    snprintf(tw, sizeof tw, "%s.tokens", what);
    return tokens_validate(tw, p->tokens, (uint64_t)p->n_pages * p->page_tokens, lim, err);
}

static int pull_validate(const km_msg *m, const km_proto_limits *lim, km_errbuf *err)
{
    return chain_validate("kv_pull", &m->kv_pull, lim, err);
}

static void chain_encode(km_enc *e, const km_msg_kv_pull *p)
{
    km_enc_u64(e, "id", p->id);
    km_enc_u64(e, "first", p->first);
    km_enc_u64(e, "n_pages", p->n_pages);
    km_enc_u64(e, "page_tokens", p->page_tokens);
    km_enc_bin(e, "hashes", p->hashes, (size_t)p->n_pages * 16);
    tokens_encode(e, "tokens", p->tokens, (uint64_t)p->n_pages * p->page_tokens);
}

static void pull_encode(km_enc *e, const km_msg *m)
{
    chain_encode(e, &m->kv_pull);
}

static int chain_decode(km_dec *d, const msgpack_object_map *mp, const char *what,
                        km_msg_kv_pull *p)
{
    CK(km_dec_uint(d, mp, "id", true, UINT64_MAX, &p->id));
    CK(km_dec_u32(d, mp, "first", true, &p->first));
    CK(km_dec_u32(d, mp, "n_pages", true, &p->n_pages));
    CK(km_dec_u32(d, mp, "page_tokens", true, &p->page_tokens));
    if (p->n_pages < 1 || p->n_pages > KM_PROTO_MAX_PULL_PAGES)
        return DFAIL(d, KM_EFORMAT, "%s.n_pages: %u outside [1, %d]", what, p->n_pages,
                     KM_PROTO_MAX_PULL_PAGES);
    if (p->page_tokens < 1 || p->page_tokens > KM_PROTO_MAX_PAGE_TOKENS)
        return DFAIL(d, KM_EFORMAT, "%s.page_tokens: %u outside [1, %d]", what, p->page_tokens,
                     KM_PROTO_MAX_PAGE_TOKENS);
    uint32_t len = 0;
    CK(km_dec_bin(d, mp, "hashes", true, KM_PROTO_MAX_PULL_PAGES * 16, &p->hashes, &len));
    if (len != p->n_pages * 16)
        return DFAIL(d, KM_EFORMAT, "%s.hashes: %u bytes, expected 16 x n_pages = %u", what, len,
                     p->n_pages * 16);
    return tokens_decode(d, mp, "tokens", (uint64_t)p->n_pages * p->page_tokens, &p->tokens);
}

static int pull_decode(km_dec *d, const msgpack_object_map *mp)
{
    return chain_decode(d, mp, "kv_pull", &d->m->kv_pull);
}

/* ---------------------------------------------------------------- kv_offer */

static int offer_validate(const km_msg *m, const km_proto_limits *lim, km_errbuf *err)
{
    const km_msg_kv_offer *o = &m->kv_offer;
    if (o->status > 0) VFAIL("kv_offer.status: %d, expected 0 or a negative error", o->status);
    if (o->n_pages > KM_PROTO_MAX_PULL_PAGES)
        VFAIL("kv_offer.pages: %u entries, limit %d", o->n_pages, KM_PROTO_MAX_PULL_PAGES);
    if (o->n_pages && (o->status != 0 || o->lease_id == 0))
        VFAIL("kv_offer: %u pages offered without a lease (status %d)", o->n_pages, o->status);
    if (o->n_pages && !o->pages) VFAIL("kv_offer.pages: NULL with n_pages %u", o->n_pages);
    if (o->page_tokens > KM_PROTO_MAX_PAGE_TOKENS)
        VFAIL("kv_offer.page_tokens: %u, limit %d", o->page_tokens, KM_PROTO_MAX_PAGE_TOKENS);
    if (o->n_pages && o->page_tokens == 0) VFAIL("kv_offer.page_tokens: 0 with pages offered");
    for (uint32_t i = 0; i < o->n_pages; i++) {
        const km_kv_page_desc *p = &o->pages[i];
        if (p->format >= KM_PROTO_N_FORMATS)
            VFAIL("kv_offer.pages[%u].format: unknown format %u", i, p->format);
        if (i && p->index != o->pages[i - 1].index + 1)
            VFAIL("kv_offer.pages[%u].index: %u does not follow %u", i, p->index,
                  o->pages[i - 1].index);
        if (p->index >= KM_PROTO_MAX_PULL_PAGES)
            VFAIL("kv_offer.pages[%u].index: %u, limit %d", i, p->index,
                  KM_PROTO_MAX_PULL_PAGES - 1);
    }
    return tokens_validate("kv_offer.tokens", o->tokens, (uint64_t)o->n_pages * o->page_tokens, lim,
                           err);
}

static void offer_page(km_enc *e, const void *arg)
{
    const km_kv_page_desc *p = arg;
    km_enc_u64(e, "index", p->index);
    km_enc_str(e, "format", km_proto_format_names[p->format]);
    km_enc_bin(e, "hash", p->hash, 16);
    km_enc_bin(e, "parent", p->parent, 16);
    km_enc_u64(e, "region", p->region);
    km_enc_u64(e, "addr", p->addr);
    km_enc_u64(e, "bytes", p->bytes);
    km_enc_u64(e, "checksum", p->checksum);
}

static void offer_encode(km_enc *e, const km_msg *m)
{
    const km_msg_kv_offer *o = &m->kv_offer;
    km_enc_u64(e, "id", o->id);
    km_enc_u64(e, "lease_id", o->lease_id);
    km_enc_i64(e, "status", o->status);
    km_enc_u64(e, "lease_ms", o->lease_ms);
    km_enc_u64(e, "page_tokens", o->page_tokens);
    if (km_enc_begin(e, "pages")) {
        e->rc |= msgpack_pack_array(&e->pk, o->n_pages);
        for (uint32_t i = 0; i < o->n_pages; i++) km_enc_map(e, offer_page, &o->pages[i]);
    }
    tokens_encode(e, "tokens", o->tokens, (uint64_t)o->n_pages * o->page_tokens);
    if (o->lease_id) km_enc_bin(e, "key", o->key, KM_PROTO_LEASE_KEY);
}

static int offer_decode(km_dec *d, const msgpack_object_map *mp)
{
    km_msg_kv_offer *o = &d->m->kv_offer;
    size_t n0 = strlen(d->path);
    CK(km_dec_uint(d, mp, "id", true, UINT64_MAX, &o->id));
    CK(km_dec_uint(d, mp, "lease_id", false, UINT64_MAX, &o->lease_id));
    CK(km_dec_i32(d, mp, "status", false, &o->status));
    CK(km_dec_u32(d, mp, "lease_ms", false, &o->lease_ms));
    CK(km_dec_u32(d, mp, "page_tokens", false, &o->page_tokens));
    if (km_dec_find(mp, "key")) CK(key_decode(d, mp, "key", o->key));
    if (o->page_tokens > KM_PROTO_MAX_PAGE_TOKENS)
        return DFAIL(d, KM_EFORMAT, "kv_offer.page_tokens: %u, limit %d", o->page_tokens,
                     KM_PROTO_MAX_PAGE_TOKENS);
    const msgpack_object_array *a;
    void *mem;
    CK(km_dec_array(d, mp, "pages", false, KM_PROTO_MAX_PULL_PAGES, sizeof(km_kv_page_desc), &a,
                    &mem));
    km_kv_page_desc *pg = mem;
    for (uint32_t i = 0; a && i < a->size; i++) {
        const msgpack_object_map *em;
        int fmt = 0;
        CK(km_dec_array_map(d, a, i, n0, ".pages", &em));
        CK(km_dec_u32(d, em, "index", true, &pg[i].index));
        CK(km_dec_enum(d, em, "format", true, km_proto_format_names, KM_PROTO_N_FORMATS, &fmt));
        pg[i].format = (uint32_t)fmt;
        CK(hash_decode(d, em, "hash", pg[i].hash));
        CK(hash_decode(d, em, "parent", pg[i].parent));
        CK(km_dec_u32(d, em, "region", false, &pg[i].region));
        CK(km_dec_uint(d, em, "addr", true, UINT64_MAX, &pg[i].addr));
        CK(km_dec_uint(d, em, "bytes", true, UINT64_MAX, &pg[i].bytes));
        CK(km_dec_uint(d, em, "checksum", true, UINT64_MAX, &pg[i].checksum));
    }
    km_dec_path_set(d, n0);
    o->pages = pg;
    o->n_pages = a ? a->size : 0;
    if (!o->n_pages) return 0;
    return tokens_decode(d, mp, "tokens", (uint64_t)o->n_pages * o->page_tokens, &o->tokens);
}

/* ---------------------------------------------------------------- kv_pull_done */

static int done_validate(const km_msg *m, const km_proto_limits *lim, km_errbuf *err)
{
    (void)lim;
    if (m->kv_pull_done.lease_id == 0) VFAIL("kv_pull_done.lease_id: 0 (no lease)");
    return 0;
}

static void done_encode(km_enc *e, const km_msg *m)
{
    km_enc_u64(e, "lease_id", m->kv_pull_done.lease_id);
    km_enc_u64(e, "pages_ok", m->kv_pull_done.pages_ok);
}

static int done_decode(km_dec *d, const msgpack_object_map *mp)
{
    km_msg_kv_pull_done *p = &d->m->kv_pull_done;
    CK(km_dec_uint(d, mp, "lease_id", true, UINT64_MAX, &p->lease_id));
    return km_dec_u32(d, mp, "pages_ok", false, &p->pages_ok);
}

/* ---------------------------------------------------------------- kv_push */

static int push_validate(const km_msg *m, const km_proto_limits *lim, km_errbuf *err)
{
    const km_msg_kv_push *p = &m->kv_push;
    CK(km_val_name("kv_push.from", p->from, true, 1, KM_PROTO_MAX_NAME, err));
    CK(km_val_name("kv_push.endpoint", p->endpoint, true, 1, KM_PROTO_MAX_NAME, err));
    if (!p->addr || p->addr_len < 1 || p->addr_len > KM_PROTO_MAX_PEER_ADDR)
        VFAIL("kv_push.addr: %u bytes outside [1, %d]", p->addr_len, KM_PROTO_MAX_PEER_ADDR);
    if (p->chain.first) VFAIL("kv_push.first: %u, a pushed chain starts at 0", p->chain.first);
    return chain_validate("kv_push", &p->chain, lim, err);
}

static void push_encode(km_enc *e, const km_msg *m)
{
    const km_msg_kv_push *p = &m->kv_push;
    chain_encode(e, &p->chain);
    km_enc_str(e, "from", p->from);
    km_enc_str(e, "endpoint", p->endpoint);
    km_enc_bin(e, "addr", p->addr, p->addr_len);
    if (p->position_free) km_enc_bool(e, "position_free", true);
}

static int push_decode(km_dec *d, const msgpack_object_map *mp)
{
    km_msg_kv_push *p = &d->m->kv_push;
    CK(km_dec_str(d, mp, "from", true, KM_PROTO_MAX_NAME, false, &p->from, NULL));
    CK(km_dec_str(d, mp, "endpoint", true, KM_PROTO_MAX_NAME, false, &p->endpoint, NULL));
    CK(km_dec_bin(d, mp, "addr", true, KM_PROTO_MAX_PEER_ADDR, &p->addr, &p->addr_len));
    if (!p->addr_len) return DFAIL(d, KM_EFORMAT, "kv_push.addr: empty");
    CK(km_dec_bool(d, mp, "position_free", false, &p->position_free));
    CK(chain_decode(d, mp, "kv_push", &p->chain));
    if (p->chain.first)
        return DFAIL(d, KM_EFORMAT, "kv_push.first: %u, a pushed chain starts at 0",
                     p->chain.first);
    return 0;
}

/* ---------------------------------------------------------------- kv_warm */

static int warm_validate(const km_msg *m, const km_proto_limits *lim, km_errbuf *err)
{
    (void)lim;
    uint32_t n = m->kv_warm.max_pages;
    if (n < 1 || n > KM_PROTO_MAX_WARM_PAGES)
        VFAIL("kv_warm.max_pages: %u outside [1, %d]", n, KM_PROTO_MAX_WARM_PAGES);
    return 0;
}

static void warm_encode(km_enc *e, const km_msg *m)
{
    km_enc_u64(e, "id", m->kv_warm.id);
    km_enc_u64(e, "max_pages", m->kv_warm.max_pages);
}

static int warm_decode(km_dec *d, const msgpack_object_map *mp)
{
    km_msg_kv_warm *w = &d->m->kv_warm;
    CK(km_dec_uint(d, mp, "id", true, UINT64_MAX, &w->id));
    CK(km_dec_u32(d, mp, "max_pages", true, &w->max_pages));
    if (w->max_pages < 1 || w->max_pages > KM_PROTO_MAX_WARM_PAGES)
        return DFAIL(d, KM_EFORMAT, "kv_warm.max_pages: %u outside [1, %d]", w->max_pages,
                     KM_PROTO_MAX_WARM_PAGES);
    return 0;
}

const km_proto_codec km_proto_codec_kv_pull = {pull_validate, pull_encode, pull_decode};
const km_proto_codec km_proto_codec_kv_warm = {warm_validate, warm_encode, warm_decode};
const km_proto_codec km_proto_codec_kv_push = {push_validate, push_encode, push_decode};
const km_proto_codec km_proto_codec_kv_offer = {offer_validate, offer_encode, offer_decode};
const km_proto_codec km_proto_codec_kv_pull_done = {done_validate, done_encode, done_decode};
