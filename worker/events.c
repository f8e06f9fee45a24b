/*
 * events.c — the worker's KV event stream (docs/protocol.md, `kv` frames and their replay).
 *
 * kvshard numbers its own events; routers need per-worker frame numbers with no gaps, so this
 * file drains the store after every step, packs runs of events with the same kind and tiers into
 * one `kv` frame (up to KM_PROTO_MAX_EVENT_HASHES hashes), numbers the frames from 1 and
 * publishes them on the PUB socket under topic `kv.<worker>`.
 *
 * A subscriber that sees a gap asks (admin `status` with `events_since` / `events_snapshot`) and
 * gets the missing frames again from a bounded ring of recent events, or, when they are older
 * than the ring, a snapshot: the whole index as `stored` frames built from a mirror of the
 * store's index (page hash -> tier) that the same events keep up to date. The mirror exists
 * because kvshard's index is not enumerable, and it costs 24 bytes a page. A frame holds pages
 * of one kind: prefix pages, or position-free chunk pages (`position_free`, docs/blend.md).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker/service_internal.h"

typedef struct wk_evrec {
    uint64_t fseq; /* the frame it went out in */
    km_pagehash hash;
    uint8_t kind, tier, from, pf; /* pf: position-free (a chunk's page) */
} wk_evrec;

typedef struct wk_slot {
    km_pagehash hash;
    uint8_t state; /* 0 empty, 1 used, 2 deleted */
    uint8_t tier, pf;
} wk_slot;

struct wk_events {
    kv_store *kv;
    void *pub;
    char worker[KM_PROTO_MAX_NAME + 1];
    char topic[KM_PROTO_MAX_NAME + 8];
    uint64_t next_seq, frames;
    wk_evrec *ring;
    int ring_cap, ring_n, ring_head; /* head: oldest */
    wk_slot *map;
    size_t map_cap, map_used, map_live;
    kv_event *drain;
    int drain_cap;
    uint8_t *hbuf; /* KM_PROTO_MAX_EVENT_HASHES * 16 */
    km_buf out;
};

enum { WK_EV_DRAIN = 4096 };

int wk_events_create(kv_store *kv, void *pub, const char *worker, int replay_cap, wk_events **out)
{
    *out = NULL;
    wk_events *ev = calloc(1, sizeof *ev);
    if (!ev) return KM_ENOMEM;
    ev->kv = kv;
    ev->pub = pub;
    snprintf(ev->worker, sizeof ev->worker, "%s", worker);
    snprintf(ev->topic, sizeof ev->topic, "kv.%s", worker);
    ev->next_seq = 1;
    ev->ring_cap = replay_cap > 0 ? replay_cap : 65536;
    ev->ring = calloc(ev->ring_cap, sizeof *ev->ring);
    ev->map_cap = 1024;
    ev->map = calloc(ev->map_cap, sizeof *ev->map);
    ev->drain_cap = WK_EV_DRAIN;
    ev->drain = calloc(ev->drain_cap, sizeof *ev->drain);
    ev->hbuf = malloc((size_t)KM_PROTO_MAX_EVENT_HASHES * 16);
    if (!ev->ring || !ev->map || !ev->drain || !ev->hbuf) {
        wk_events_destroy(ev);
        return KM_ENOMEM;
    }
    *out = ev;
    return 0;
}

void wk_events_destroy(wk_events *ev)
{
    if (!ev) return;
    free(ev->ring);
    free(ev->map);
    free(ev->drain);
    free(ev->hbuf);
    km_buf_free(&ev->out);
    free(ev);
}

uint64_t wk_events_next_seq(const wk_events *ev)
{
    return ev->next_seq;
}
uint64_t wk_events_frames(const wk_events *ev)
{
    return ev->frames;
}

/* ---------------------------------------------------------------- index mirror */

static size_t wk_slot_of(const wk_events *ev, km_pagehash h)
{
    return (size_t)(h.lo ^ (h.hi * 0x9e3779b97f4a7c15ull)) & (ev->map_cap - 1);
}

static int wk_map_grow(wk_events *ev)
{
    size_t cap = ev->map_live * 4 > ev->map_cap ? ev->map_cap * 2 : ev->map_cap;
    wk_slot *old = ev->map;
    size_t old_cap = ev->map_cap;
    wk_slot *nm = calloc(cap, sizeof *nm);
    if (!nm) return KM_ENOMEM;
    ev->map = nm;
    ev->map_cap = cap;
    ev->map_used = 0;
    for (size_t i = 0; i < old_cap; i++) {
        if (old[i].state != 1) continue;
        size_t j = wk_slot_of(ev, old[i].hash);
        while (nm[j].state) j = (j + 1) & (cap - 1);
        nm[j] = old[i];
        ev->map_used++;
    }
    free(old);
    return 0;
}

static void wk_map_set(wk_events *ev, km_pagehash h, int tier, int pf)
{
    if ((ev->map_used + 1) * 2 > ev->map_cap && wk_map_grow(ev)) return;
    size_t j = wk_slot_of(ev, h), tomb = (size_t)-1;
    while (ev->map[j].state) {
        if (ev->map[j].state == 1 && km_pagehash_eq(ev->map[j].hash, h)) {
            if (tier < 0) {
                ev->map[j].state = 2;
                ev->map_live--;
            } else {
                ev->map[j].tier = (uint8_t)tier;
                ev->map[j].pf = (uint8_t)pf;
            }
            return;
        }
        if (ev->map[j].state == 2 && tomb == (size_t)-1) tomb = j;
        j = (j + 1) & (ev->map_cap - 1);
    }
    if (tier < 0) return;
    if (tomb != (size_t)-1) {
        j = tomb;
    } else {
        ev->map_used++;
    }
    ev->map[j] = (wk_slot){.hash = h, .state = 1, .tier = (uint8_t)tier, .pf = (uint8_t)pf};
    ev->map_live++;
}

/* ---------------------------------------------------------------- frames */

static int wk_send_frame(wk_events *ev, void *sock, const km_zframe *env, int n_env, uint64_t seq,
                         int kind, int tier, int from, int pf, int n_hashes)
{
    km_msg m;
    km_msg_init(&m, KM_MSG_KV_EVENT);
    m.kv.worker = ev->worker;
    m.kv.seq = seq;
    m.kv.kind = (km_kv_event_kind)kind;
    m.kv.tier = (km_tier)(kind == KM_KV_REMOVED ? 0 : tier);
    m.kv.from_tier = (km_tier)(kind == KM_KV_TIER ? from : 0);
    m.kv.hashes = ev->hbuf;
    m.kv.n_hashes = (uint32_t)n_hashes;
    m.kv.position_free = pf != 0;
    int rc = km_msg_encode(&m, NULL, &ev->out, NULL);
    if (rc) return rc;
    km_zframe parts[KM_ZMSG_MAX_PARTS];
    int n = 0;
    if (env) {
        for (int i = 0; i < n_env && n < KM_ZMSG_MAX_PARTS - 1; i++) parts[n++] = env[i];
    } else {
        parts[n++] = (km_zframe){ev->topic, strlen(ev->topic)};
    }
    parts[n++] = (km_zframe){ev->out.data, ev->out.len};
    return km_zsend(sock, parts, n, KM_ZDONTWAIT, NULL);
}

static void wk_ring_push(wk_events *ev, const wk_evrec *r)
{
    if (ev->ring_n < ev->ring_cap) {
        ev->ring[(ev->ring_head + ev->ring_n++) % ev->ring_cap] = *r;
    } else {
        ev->ring[ev->ring_head] = *r;
        ev->ring_head = (ev->ring_head + 1) % ev->ring_cap;
    }
}

int wk_events_pump(wk_events *ev)
{
    int frames = 0;
    for (;;) {
        int n = kv_store_events_drain(ev->kv, ev->drain, ev->drain_cap);
        if (n <= 0) break;
        for (int i = 0; i < n;) {
            const kv_event *e0 = &ev->drain[i];
            int j = i;
            while (j < n && j - i < KM_PROTO_MAX_EVENT_HASHES && ev->drain[j].kind == e0->kind &&
                   ev->drain[j].tier == e0->tier &&
                   ev->drain[j].position_free == e0->position_free &&
                   (e0->kind != KV_EVENT_TIER || ev->drain[j].from_tier == e0->from_tier))
                j++;
            uint64_t seq = ev->next_seq++;
            for (int k = i; k < j; k++) {
                const kv_event *e = &ev->drain[k];
                km_pagehash_canonical(e->hash, ev->hbuf + (size_t)(k - i) * 16);
                wk_evrec r = {.fseq = seq,
                              .hash = e->hash,
                              .kind = (uint8_t)e->kind,
                              .tier = (uint8_t)e->tier,
                              .from = (uint8_t)e->from_tier,
                              .pf = (uint8_t)e->position_free};
                wk_ring_push(ev, &r);
                wk_map_set(ev, e->hash, e->kind == KV_EVENT_REMOVED ? -1 : (int)e->tier,
                           e->position_free);
            }
            if (ev->pub)
                wk_send_frame(ev, ev->pub, NULL, 0, seq, e0->kind, e0->tier, e0->from_tier,
                              e0->position_free, j - i);
            ev->frames++;
            frames++;
            i = j;
        }
        if (n < ev->drain_cap) break;
    }
    return frames;
}

static int wk_events_snapshot(wk_events *ev, void *sock, const km_zframe *env, int n_env)
{
    uint64_t seq = ev->next_seq - 1;
    int frames = 0;
    for (int tp = 0; tp < 2 * KV_TIER_COUNT; tp++) { /* each tier's pages, then its chunks' */
        const int tier = tp / 2, pf = tp % 2;
        int n = 0;
        for (size_t i = 0; i < ev->map_cap; i++) {
            if (ev->map[i].state != 1 || ev->map[i].tier != tier || ev->map[i].pf != pf) continue;
            km_pagehash_canonical(ev->map[i].hash, ev->hbuf + (size_t)n * 16);
            if (++n == KM_PROTO_MAX_EVENT_HASHES) {
                wk_send_frame(ev, sock, env, n_env, seq, KM_KV_STORED, tier, 0, pf, n);
                frames++;
                n = 0;
            }
        }
        if (n) {
            wk_send_frame(ev, sock, env, n_env, seq, KM_KV_STORED, tier, 0, pf, n);
            frames++;
        }
    }
    return frames;
}

int wk_events_replay(wk_events *ev, void *sock, const km_zframe *env, int n_env, uint64_t since,
                     bool snapshot, bool *was_snapshot)
{
    uint64_t oldest = ev->ring_n ? ev->ring[ev->ring_head].fseq : ev->next_seq;
    if (since == 0) since = 1;
    /* The oldest frame may have lost its first events to the ring's wrap: then it is not whole. */
    if (ev->ring_n == ev->ring_cap) oldest++;
    *was_snapshot = snapshot || since < oldest || since > ev->next_seq;
    if (*was_snapshot) return wk_events_snapshot(ev, sock, env, n_env);
    int frames = 0;
    for (int i = 0; i < ev->ring_n;) {
        const wk_evrec *r0 = &ev->ring[(ev->ring_head + i) % ev->ring_cap];
        int j = i, n = 0;
        while (j < ev->ring_n) {
            const wk_evrec *r = &ev->ring[(ev->ring_head + j) % ev->ring_cap];
            if (r->fseq != r0->fseq) break;
            km_pagehash_canonical(r->hash, ev->hbuf + (size_t)n++ * 16);
            j++;
        }
        if (r0->fseq >= since) {
            wk_send_frame(ev, sock, env, n_env, r0->fseq, r0->kind, r0->tier, r0->from, r0->pf, n);
            frames++;
        }
        i = j;
    }
    return frames;
}
