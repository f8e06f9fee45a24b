/*
 * evict.c — what the store does under memory pressure: pick victims among the pages no sequence
 * holds (lru, lru-priority), demote them a tier down (hot -> host -> disk) or drop them when no
 * lower tier has room, allocate hot buffers making room that way (kv_hot_alloc), keep each tier
 * under its high watermark, and recovery level 1 (evict_oldest_fraction).
 *
 * Pages in use are never victims: they are not in the cached lists at all. lru-priority scores a
 * page by recency plus frequency (each reuse counts as a quarter of the cached population of
 * recency), and pages that served more than one sequence come last, so a shared system prompt
 * outlives one-off prompts. A tier is kept under its watermark only when a lower tier exists:
 * without one, demotion is a loss, so cached pages stay until room is actually needed.
 *
 * Layer: eviction only ever touches pages no sequence holds, so it needs nothing of sequences:
 * it sits on the disk tier's files, the index, the promoter and page memory, and sequences sit on
 * it (a reserve that needs room calls kv_hot_alloc).
 */
#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvshard/internal.h"

typedef struct kv_cand {
    double score;
    kv_page *p;
} kv_cand;

static int kv_cand_cmp(const void *a, const void *b)
{
    double x = ((const kv_cand *)a)->score, y = ((const kv_cand *)b)->score;
    return x < y ? -1 : x > y;
}

static double kv_score(const kv_store *s, const kv_shard *sh, const kv_page *p, uint64_t n)
{
    if (sh->evict == KV_EVICT_LRU) return (double)p->last_use;
    double w = n / 4.0 > 1.0 ? n / 4.0 : 1.0;
    double sc = (double)p->last_use + w * (double)(p->hits < 64 ? p->hits : 64);
    if ((p->flags & KV_PAGE_SHARED) || p->hits) sc += 1e15;
    return sc;
}

static int kv_tier_enabled(const kv_store *s, int shard, kv_tier t)
{
    if (t == KV_TIER_DISK) return kv_disk_enabled(s) && s->shards[shard].t[t].budget > 0;
    return s->shards[shard].t[t].budget > 0;
}

void kv_page_drop(kv_store *s, kv_page *p)
{
    assert(p->refs == 0);
    if (p->flags & KV_PAGE_INDEXED) {
        kv_event_emit(s, KV_EVENT_REMOVED, p, p->tier, p->tier);
        kv_index_remove(s, p);
    }
    if (p->flags & KV_PAGE_ON_DISK) kv_disk_unlink(s, p);
    kv_page_release(s, p);
}

/* Moves a cached page one tier down (or further), or drops it. 1 when dropped. */
int kv_demote(kv_store *s, kv_page *p)
{
    assert(p->in_list && p->refs == 0);
    const kv_tier from = p->tier;
    const int sh = p->shard;
    const size_t pb = s->lay[p->format].page_bytes;
    kv_group *g = kv_group_of(s, p);
    if (from == KV_TIER_HOT && kv_tier_enabled(s, sh, KV_TIER_HOST)) {
        kv_tier_acct *h = &s->shards[sh].t[KV_TIER_HOST];
        kv_make_room(s, sh, KV_TIER_HOST, pb, h->budget);
        uint8_t *nb = h->used + pb <= h->budget ? kv_buf_get(s, p->format) : NULL;
        if (nb) {
            memcpy(nb, p->buf, pb);
            kv_list_remove(s, p);
            kv_acct_sub(s, sh, KV_TIER_HOT, p->format);
            kv_buf_put(s, p->buf, p->format);
            p->buf = nb;
            p->tier = KV_TIER_HOST;
            kv_group_move(s, p, from, KV_TIER_HOST);
            kv_acct_add(s, sh, KV_TIER_HOST, p->format, 1);
            kv_list_push(s, p);
            assert(from == KV_TIER_HOT && h->used <= h->budget);
            s->shards[sh].demotions++;
            if (g) g->demotions++;
            kv_event_emit(s, KV_EVENT_TIER, p, from, KV_TIER_HOST);
            return 0;
        }
    }
    if (from != KV_TIER_DISK && kv_tier_enabled(s, sh, KV_TIER_DISK)) {
        if (!(p->flags & KV_PAGE_ON_DISK)) {
            kv_tier_acct *d = &s->shards[sh].t[KV_TIER_DISK];
            size_t fb = kv_disk_page_size(pb, s->pt);
            int in = p->in_list;
            if (in) kv_list_remove(s, p); /* not a victim of its own room-making */
            kv_make_room(s, sh, KV_TIER_DISK, fb, d->budget);
            if (in) kv_list_push(s, p);
            if (d->used + fb <= d->budget) kv_disk_write(s, p);
        }
        if (p->flags & KV_PAGE_ON_DISK) {
            kv_list_remove(s, p);
            kv_acct_sub(s, sh, from, p->format);
            kv_buf_put(s, p->buf, p->format);
            p->buf = NULL;
            p->tier = KV_TIER_DISK;
            kv_group_move(s, p, from, KV_TIER_DISK);
            kv_list_push(s, p);
            s->shards[sh].demotions++;
            if (g) g->demotions++;
            kv_event_emit(s, KV_EVENT_TIER, p, from, KV_TIER_DISK);
            return 0;
        }
    }
    s->shards[sh].evictions++;
    if (g) g->evictions++;
    kv_page_drop(s, p);
    return 1;
}

int kv_make_room(kv_store *s, int shard, kv_tier t, size_t need, size_t limit)
{
    kv_shard *sh = &s->shards[shard];
    kv_tier_acct *a = &sh->t[t];
    int moved = 0;
    if (a->used + need <= limit) return 0;
    if (sh->evict == KV_EVICT_LRU) {
        while (a->used + need > limit && a->head) {
            kv_demote(s, a->head);
            moved++;
        }
        return moved;
    }
    size_t n = a->n_cached, k = 0;
    if (!n) return 0;
    kv_cand *c = malloc(sizeof *c * n);
    if (!c) { /* fall back to plain lru rather than fail */
        while (a->used + need > limit && a->head) {
            kv_demote(s, a->head);
            moved++;
        }
        return moved;
    }
    for (kv_page *p = a->head; p && k < n; p = p->lnext)
        c[k++] = (kv_cand){kv_score(s, sh, p, n), p};
    qsort(c, k, sizeof *c, kv_cand_cmp);
    /* Victims leave this tier's list only through kv_demote, and nothing else frees pages of
     * this (shard, tier) meanwhile, so every candidate is still valid when its turn comes. */
    for (size_t i = 0; i < k && a->used + need > limit; i++) {
        if (!c[i].p->in_list || c[i].p->tier != t) continue;
        kv_demote(s, c[i].p);
        moved++;
    }
    free(c);
    return moved;
}

int kv_hot_alloc(kv_store *s, int shard, kv_format f, uint8_t **out)
{
    const kv_tier_acct *a = &s->shards[shard].t[KV_TIER_HOT];
    size_t b = s->lay[f].page_bytes;
    if (a->used + b > a->budget) kv_make_room(s, shard, KV_TIER_HOT, b, a->budget);
    return kv_hot_take(s, shard, f, out);
}

void kv_disk_trim(kv_store *s)
{
    for (int i = 0; i < s->n_shards; i++) {
        kv_tier_acct *a = &s->shards[i].t[KV_TIER_DISK];
        while (a->used > a->budget && a->head) kv_demote(s, a->head);
    }
}

void kv_enforce_watermarks(kv_store *s, int shard)
{
    kv_shard *sh = &s->shards[shard];
    for (int t = KV_TIER_HOT; t <= KV_TIER_HOST; t++) {
        kv_tier_acct *a = &sh->t[t];
        if (!a->budget || a->used <= (size_t)(s->high_wm * a->budget)) continue;
        int lower = 0;
        for (int u = t + 1; u < KV_TIER_COUNT; u++) lower |= kv_tier_enabled(s, shard, u);
        if (!lower) continue;
        kv_make_room(s, shard, (kv_tier)t, 0, (size_t)(s->low_wm * a->budget));
    }
}

int kv_store_maintain(kv_store *s)
{
    kv_promo_reap(s);
    for (int i = 0; i < s->n_shards; i++) kv_enforce_watermarks(s, i);
    return 0;
}

int kv_store_evict_oldest_fraction(kv_store *s, double fraction)
{
    if (!(fraction >= 0.0) || fraction > 1.0) return KM_EINVAL;
    kv_promo_reap(s);
    int total = 0;
    for (int i = 0; i < s->n_shards; i++) {
        kv_tier_acct *a = &s->shards[i].t[KV_TIER_HOT];
        size_t k = (size_t)ceil(fraction * (double)a->n_cached);
        /* The cached list is ordered by last use, oldest first, whatever the policy. */
        while (k-- && a->head) {
            kv_demote(s, a->head);
            total++;
        }
    }
    return total;
}
