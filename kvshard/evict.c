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
 * Chains leave from their tails: a page leaves a tier only when no page of its chain hangs from
 * it on that tier or a hotter one, and is dropped only when none hangs from it anywhere, so a
 * lookup reaches every indexed page and a recomputed prompt's pages are all indexed again.
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

/* A held page leaves the index (and its file) but stays its sequences' private page. */
static void kv_page_unindex(kv_store *s, kv_page *p)
{
    kv_event_emit(s, KV_EVENT_REMOVED, p, p->tier, p->tier);
    kv_index_remove(s, p);
    if (p->flags & KV_PAGE_ON_DISK) kv_disk_unlink(s, p);
}

/* Takes q out of the index: dropped when no sequence holds it, else only unindexed. */
static void kv_page_forget(kv_store *s, kv_page *q)
{
    if (q->refs)
        kv_page_unindex(s, q);
    else
        kv_page_drop(s, q);
}

int kv_page_drop_tree(kv_store *s, kv_page *p)
{
    assert(p->refs == 0);
    int n = 1;
    for (kv_page *cur = p;;) { /* leaves first, in a loop: a chain can be long */
        while (cur->kid) cur = cur->kid;
        if (cur == p) break;
        kv_page *up = cur->up;
        kv_page_forget(s, cur);
        n++;
        cur = up;
    }
    kv_page_drop(s, p);
    return n;
}

#define KV_KEPT (-1) /* kv_demote: the page could not leave its tier */

/* Moves a cached page one tier down (or further), or drops it: 1 when dropped, 0 when moved,
 * KV_KEPT when it stays. A chain leaves a tier from its tail: a page moves only when no page
 * hangs from it on its tier or a hotter one, and is dropped only when none hangs from it at
 * all (its descendants would be unreachable, yet indexed). */
int kv_demote(kv_store *s, kv_page *p)
{
    assert(p->in_list && p->refs == 0);
    const kv_tier from = p->tier;
    const int sh = p->shard;
    const size_t pb = s->lay[p->format].page_bytes;
    kv_group *g = kv_group_of(s, p);
    if (kv_page_kids(p, from)) return KV_KEPT;
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
            kv_index_retier(s, p, from);
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
            kv_index_retier(s, p, from);
            kv_list_push(s, p);
            s->shards[sh].demotions++;
            if (g) g->demotions++;
            kv_event_emit(s, KV_EVENT_TIER, p, from, KV_TIER_DISK);
            return 0;
        }
    }
    if (kv_page_kids(p, KV_TIER_DISK)) return KV_KEPT;
    s->shards[sh].evictions++;
    if (g) g->evictions++;
    kv_page_drop(s, p);
    return 1;
}

/* What an eviction walk is after: a->used + need <= limit, or max pages moved. */
typedef struct kv_goal {
    const kv_tier_acct *a;
    size_t need, limit, max, moved;
    int shard;     /* the walk's */
    size_t others; /* pages of the walk's own list taken for another's chain */
} kv_goal;

static int kv_goal_more(const kv_goal *g)
{
    return g->a->used + g->need > g->limit && g->moved < g->max;
}

/* Takes p out of its tier t, the pages hanging from it there first, tails first (a loop, not a
 * recursion: a chain can be long), whichever shard they are in, while g wants more. KV_KEPT
 * when p stays: a page of it is held by a sequence or sits on a tier hotter than t (walks of
 * colder tiers never touch t's lists), one needs room no lower tier has, or g was met first. */
static int kv_evict_chain(kv_store *s, kv_page *p, kv_goal *g)
{
    const kv_tier t = p->tier;
    kv_page *cur = p;
    while (kv_goal_more(g)) {
        if (kv_page_kids(cur, t) > cur->kids[t]) return KV_KEPT;
        kv_page *k = NULL;
        if (cur->kids[t])
            for (k = cur->kid; k && k->tier != t; k = k->sib_next) continue;
        if (k) {
            if (!k->in_list) return KV_KEPT; /* held */
            cur = k;
            continue;
        }
        kv_page *up = cur->up;
        const int other = cur != p && cur->shard == g->shard;
        int r = kv_demote(s, cur);
        if (r == KV_KEPT) return KV_KEPT;
        g->moved++;
        g->others += (size_t)other;
        if (cur == p) return r;
        cur = up;
    }
    return KV_KEPT;
}

static int kv_cands(kv_store *s, int shard, kv_tier t, uint64_t walk, kv_cand **out, size_t *k)
{
    const kv_tier_acct *a = &s->shards[shard].t[t];
    size_t n = a->n_cached;
    kv_cand *c = malloc(sizeof *c * (n ? n : 1));
    *out = c;
    *k = 0;
    if (!c) return KM_ENOMEM;
    for (kv_page *p = a->head; p && *k < n; p = p->lnext)
        if (p->walk != walk) c[(*k)++] = (kv_cand){kv_score(s, &s->shards[shard], p, n), p};
    qsort(c, *k, sizeof *c, kv_cand_cmp);
    return 0;
}

/* Victims of (shard, tier t), oldest first (by last use, or by lru-priority's score when
 * by_score), each with what hangs from it on t, until the goal is met. The candidates of a
 * score are sorted once and again only when a chain took other pages of this list (it may have
 * freed later candidates); a page that must stay is passed over for the rest of the walk. */
static int kv_evict_walk(kv_store *s, int shard, kv_tier t, size_t need, size_t limit,
                         size_t max_pages, int by_score)
{
    kv_tier_acct *a = &s->shards[shard].t[t];
    kv_goal g = {a, need, limit, max_pages, 0, shard, 0};
    const uint64_t walk = ++s->walks;
    kv_cand *c = NULL;
    size_t k = 0, i = 0;
    while (kv_goal_more(&g)) {
        kv_page *p;
        if (by_score && !c) {
            if (kv_cands(s, shard, t, walk, &c, &k)) by_score = 0; /* no memory: plain lru */
            i = 0;
        }
        if (c) {
            if (i >= k) break;
            p = c[i++].p;
        } else {
            for (p = a->head; p && p->walk == walk; p = p->lnext) continue;
            if (!p) break;
        }
        size_t before = g.others;
        if (kv_evict_chain(s, p, &g) == KV_KEPT) p->walk = walk;
        if (c && g.others != before) {
            free(c);
            c = NULL;
        }
    }
    free(c);
    return (int)g.moved;
}

int kv_make_room(kv_store *s, int shard, kv_tier t, size_t need, size_t limit)
{
    if (s->shards[shard].t[t].used + need <= limit) return 0;
    return kv_evict_walk(s, shard, t, need, limit, SIZE_MAX,
                         s->shards[shard].evict != KV_EVICT_LRU);
}

int kv_hot_alloc(kv_store *s, int shard, kv_format f, uint8_t **out)
{
    const kv_tier_acct *a = &s->shards[shard].t[KV_TIER_HOT];
    size_t b = s->lay[f].page_bytes;
    if (a->used + b > a->budget) kv_make_room(s, shard, KV_TIER_HOT, b, a->budget);
    return kv_hot_take(s, shard, f, out);
}

static int kv_by_depth(const void *a, const void *b)
{
    const kv_page *x = *(kv_page *const *)a, *y = *(kv_page *const *)b;
    if (x->index != y->index) return (x->index < y->index) - (x->index > y->index);
    return (x->last_use > y->last_use) - (x->last_use < y->last_use);
}

/* Re-indexed pages are stamped parents first; they are stamped again deepest first, so that, as
 * for every other cached page, a chain's tail is older than its head and goes first. */
static void kv_disk_restamp(kv_store *s, int shard)
{
    kv_tier_acct *a = &s->shards[shard].t[KV_TIER_DISK];
    size_t n = 0;
    kv_page **v = a->n_cached ? malloc(sizeof *v * a->n_cached) : NULL;
    if (!v) return; /* the walk still takes tails first, only with longer searches */
    for (kv_page *p = a->head; p && n < a->n_cached; p = p->lnext) v[n++] = p;
    qsort(v, n, sizeof *v, kv_by_depth);
    for (size_t i = 0; i < n; i++) {
        kv_list_remove(s, v[i]);
        v[i]->last_use = ++s->clock;
        kv_list_push(s, v[i]);
    }
    free(v);
}

void kv_disk_trim(kv_store *s)
{
    for (int i = 0; i < s->n_shards; i++) {
        kv_disk_restamp(s, i);
        kv_make_room(s, i, KV_TIER_DISK, 0, s->shards[i].t[KV_TIER_DISK].budget);
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
    size_t cached = 0, total = 0, before = SIZE_MAX;
    for (int i = 0; i < s->n_shards; i++) cached += s->shards[i].t[KV_TIER_HOT].n_cached;
    const size_t want = (size_t)ceil(fraction * (double)cached);
    /* By last use whatever the policy, each chain from its tail: a chain that spans shards
     * leaves them all, so the share is counted over the store's hot pages, not shard by
     * shard, and another pass takes what the first left to reach it. */
    while (total < want && total != before) {
        before = total;
        for (int i = 0; i < s->n_shards && total < want; i++)
            total += (size_t)kv_evict_walk(s, i, KV_TIER_HOT, 1, 0, want - total, 0);
    }
    return (int)total;
}
