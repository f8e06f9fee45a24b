/*
 * proto_kv.c — the KV event (docs/protocol.md section 12): a worker's page stored, removed or
 * moved between tiers, published on its PUB socket with a per-worker sequence number so that a
 * router can tell when it missed one. One codec.
 *
 * The page hashes travel as one msgpack bin of 16-byte canonical (big-endian) XXH128 hashes:
 * thousands of them per frame cost no per-element overhead and decode with one copy.
 */
#include <string.h>

#include "common/proto_internal.h"

static int kv_validate(const km_msg *m, const km_proto_limits *lim, km_errbuf *err)
{
    const km_msg_kv_event *k = &m->kv;
    CK(km_val_name("kv.worker", k->worker, true, 1, KM_PROTO_MAX_NAME, err));
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

static void kv_encode(km_enc *e, const km_msg *m)
{
    const km_msg_kv_event *k = &m->kv;
    km_enc_str(e, "worker", k->worker);
    km_enc_u64(e, "seq", k->seq);
    km_enc_str(e, "kind", km_proto_kind_names[k->kind]);
    if (k->kind != KM_KV_REMOVED) km_enc_u64(e, "tier", (uint64_t)k->tier);
    if (k->kind == KM_KV_TIER) km_enc_u64(e, "from_tier", (uint64_t)k->from_tier);
    if (k->position_free) km_enc_bool(e, "position_free", true);
    if (km_enc_begin(e, "hashes")) {
        e->rc |= msgpack_pack_bin(&e->pk, (size_t)k->n_hashes * 16);
        e->rc |= msgpack_pack_bin_body(&e->pk, k->hashes, (size_t)k->n_hashes * 16);
    }
}

static int kv_decode(km_dec *d, const msgpack_object_map *mp)
{
    km_msg_kv_event *k = &d->m->kv;
    const msgpack_object *o;
    int kind = 0;
    CK(km_dec_str(d, mp, "worker", true, KM_PROTO_MAX_NAME, false, &k->worker, NULL));
    CK(km_dec_uint(d, mp, "seq", true, UINT64_MAX, &k->seq));
    CK(km_dec_enum(d, mp, "kind", true, km_proto_kind_names, KM_KV_KIND_COUNT, &kind));
    k->kind = (km_kv_event_kind)kind;
    CK(km_dec_tier(d, mp, "tier", k->kind != KM_KV_REMOVED, &k->tier));
    CK(km_dec_tier(d, mp, "from_tier", k->kind == KM_KV_TIER, &k->from_tier));
    CK(km_dec_bool(d, mp, "position_free", false, &k->position_free));
    o = km_dec_find(mp, "hashes");
    if (!o) return km_dec_absent(d, "hashes", true);
    if (o->type != MSGPACK_OBJECT_BIN) return km_dec_wrong_type(d, "hashes", "binary", o);
    uint32_t n = o->via.bin.size;
    if (n % 16)
        return DFAIL(d, KM_EFORMAT, "kv.hashes: %u bytes is not a whole number of 16-byte hashes",
                     n);
    if (n / 16 > d->lim->max_event_hashes)
        return DFAIL(d, KM_ERANGE, "kv.hashes: %u hashes, limit %u", n / 16,
                     d->lim->max_event_hashes);
    uint8_t *h = km_msg_alloc(d->m, n);
    if (!h) return DFAIL(d, KM_ENOMEM, "kv.hashes: out of memory");
    if (n) memcpy(h, o->via.bin.ptr, n);
    k->hashes = h;
    k->n_hashes = n / 16;
    return 0;
}

const km_proto_codec km_proto_codec_kv = {kv_validate, kv_encode, kv_decode};
