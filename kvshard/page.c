/*
 * page.c — the bottom layer of kvshard: page memory and its accounting. Page buffers and their
 * free lists, the bytes and pages each (shard, tier) holds against its budget, page objects and
 * their reference counts, the cached lists of the pages no sequence holds, the shard-key
 * functions, and the statistics read from all of these. It calls nothing else in kvshard but the
 * pure layout sizes of diskfmt.c; every other file builds on it (docs/kvshard.md, "Layers").
 *
 * Memory: the hot tier is a byte budget per shard over page buffers that are recycled through a
 * free list per format (so a store that mixes f16 and fp8 pages after a live conversion really
 * holds half the bytes for the fp8 ones). Host-tier buffers come from the same lists and count in
 * the shard's host budget. A page with references is hot (attach holds one on a lower-tier page
 * only for as long as it takes to promote it); only pages no sequence holds sit in a shard's
 * cached list of their tier, oldest first, from where evict.c takes victims. Nothing here makes
 * room: an allocation that does not fit fails, and evict.c's kv_hot_alloc evicts first.
 */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "kvshard/internal.h"

#define KV_FREE_BUFS_MAX 64 /* recycled buffers kept per format */

const char *kv_tier_name(kv_tier t)
{
    static const char *n[] = {"hot", "host", "disk"};
    return (unsigned)t < KV_TIER_COUNT ? n[t] : "unknown";
}

const char *kv_evict_policy_name(kv_evict_policy p)
{
    return p == KV_EVICT_LRU ? "lru" : p == KV_EVICT_LRU_PRIORITY ? "lru-priority" : "unknown";
}

size_t kv_format_bytes(const kv_store *s, kv_format f)
{
    return s->lay[f].page_bytes;
}
size_t kv_store_page_bytes(const kv_store *s)
{
    return s->lay[s->cfg.format].page_bytes;
}
size_t kv_store_format_page_bytes(const kv_store *s, kv_format f)
{
    return kv_format_valid(f) ? s->lay[f].page_bytes : 0;
}
int kv_store_page_tokens(const kv_store *s)
{
    return s->pt;
}
int kv_store_n_shards(const kv_store *s)
{
    return s->n_shards;
}

int kv_store_pages_total(const kv_store *s)
{
    size_t pb = kv_store_page_bytes(s), n = 0;
    for (int i = 0; i < s->n_shards; i++) n += s->shards[i].t[KV_TIER_HOT].budget / pb;
    return n > INT32_MAX ? INT32_MAX : (int)n;
}

int kv_store_pages_free(const kv_store *s)
{
    size_t pb = kv_store_page_bytes(s), n = 0;
    for (int i = 0; i < s->n_shards; i++) {
        const kv_tier_acct *t = &s->shards[i].t[KV_TIER_HOT];
        if (t->budget > t->used) n += (t->budget - t->used) / pb;
    }
    return n > INT32_MAX ? INT32_MAX : (int)n;
}

/* ---------------------------------------------------------------- shard keys */

int kv_store_shard_of(const kv_store *s, uint64_t seq_uid, int page_index, int expert)
{
    if (s->n_shards == 1) return 0;
    if (s->cfg.shard_key == KV_SHARD_KEY_EXPERT && expert >= 0) {
        /* PiKV: tokens of one expert spread over N_tok groups, experts over N_exp. */
        unsigned a = (unsigned)page_index % (unsigned)s->cfg.n_tok_groups;
        unsigned b = (unsigned)expert % (unsigned)s->cfg.n_expert_groups;
        return (int)((a ^ b) % (unsigned)s->n_shards);
    }
    uint64_t key[2] = {seq_uid, (uint64_t)page_index};
    return (int)(XXH3_64bits(key, sizeof key) % (uint64_t)s->n_shards);
}

/* ---------------------------------------------------------------- buffers and accounting */

uint8_t *kv_buf_get(kv_store *s, kv_format f)
{
    if (s->arena) {
        uint8_t *a = kv_arena_get(s, f);
        if (a) return a;
        s->st.arena_fallbacks++;
    }
    if (s->n_free_bufs[f]) return s->free_bufs[f][--s->n_free_bufs[f]];
    size_t n = (s->lay[f].page_bytes + 63) & ~(size_t)63;
    uint8_t *b = aligned_alloc(64, n);
    if (b && !s->buf_whole) memset(b, 0, n);
    return b;
}

void kv_buf_put(kv_store *s, uint8_t *buf, kv_format f)
{
    if (!buf || (s->arena && kv_arena_put(s, buf, f))) return;
    if (s->n_free_bufs[f] < KV_FREE_BUFS_MAX) {
        if (!s->free_bufs[f]) s->free_bufs[f] = malloc(sizeof(uint8_t *) * KV_FREE_BUFS_MAX);
        if (s->free_bufs[f]) {
            s->free_bufs[f][s->n_free_bufs[f]++] = buf;
            return;
        }
    }
    free(buf);
}

int kv_acct_add(kv_store *s, int shard, kv_tier t, kv_format f, int force)
{
    kv_tier_acct *a = &s->shards[shard].t[t];
    size_t b =
        t == KV_TIER_DISK ? kv_disk_page_size(s->lay[f].page_bytes, s->pt) : s->lay[f].page_bytes;
    if (!force && a->used + b > a->budget) return KM_ENOSPC;
    a->used += b;
    a->pages++;
    return 0;
}

void kv_acct_sub(kv_store *s, int shard, kv_tier t, kv_format f)
{
    kv_tier_acct *a = &s->shards[shard].t[t];
    size_t b =
        t == KV_TIER_DISK ? kv_disk_page_size(s->lay[f].page_bytes, s->pt) : s->lay[f].page_bytes;
    assert(a->used >= b && a->pages > 0); /* every page is added once and taken away once */
    a->used = a->used >= b ? a->used - b : 0;
    if (a->pages) a->pages--;
}

int kv_hot_take(kv_store *s, int shard, kv_format f, uint8_t **out)
{
    kv_shard *sh = &s->shards[shard];
    kv_tier_acct *a = &sh->t[KV_TIER_HOT];
    *out = NULL;
    if (a->used + s->lay[f].page_bytes > a->budget) {
        sh->alloc_failures++;
        return KM_ENOSPC;
    }
    uint8_t *buf = kv_buf_get(s, f);
    if (!buf) return KM_ENOMEM;
    kv_acct_add(s, shard, KV_TIER_HOT, f, 1);
    assert(a->used <= a->budget); /* a hot buffer is taken only within the shard's budget */
    sh->allocs++;
    *out = buf;
    return 0;
}

/* ---------------------------------------------------------------- pages */

kv_page *kv_page_new(kv_store *s)
{
    kv_page *p = calloc(1, sizeof *p);
    if (p) {
        p->last_use = ++s->clock;
        p->id = ++s->next_page_id;
        p->expert = -1;
    }
    return p;
}

kv_group *kv_group_of(kv_store *s, const kv_page *p)
{
    return s->groups && p->expert >= 0 ? &s->groups[p->expert % s->cfg.n_expert_groups] : NULL;
}

void kv_group_move(kv_store *s, const kv_page *p, int from, int to)
{
    kv_group *g = kv_group_of(s, p);
    if (!g) return;
    if (from >= 0) {
        assert(g->pages[from] > 0); /* every tagged page is counted where it is */
        g->pages[from]--;
    }
    if (to >= 0) g->pages[to]++;
}

void kv_page_release(kv_store *s, kv_page *p)
{
    assert(p->refs == 0 && !(p->flags & (KV_PAGE_INDEXED | KV_PAGE_ON_DISK)));
    if (p->in_list) kv_list_remove(s, p);
    kv_group_move(s, p, (int)p->tier, -1);
    if (p->buf) {
        kv_acct_sub(s, p->shard, p->tier, p->format);
        kv_buf_put(s, p->buf, p->format);
    }
    free(p->tokens);
    kv_page_sum_free(s, p);
    free(p->slice_sum);
    free(p);
}

/* A new slab at the end of the store's list, its first slot handed out; KM_ENOMEM. */
static int kv_sum_slab_add(kv_store *s, int32_t *slot)
{
    if (s->n_sum_slabs == s->cap_sum_slabs) {
        const int cap = s->cap_sum_slabs ? 2 * s->cap_sum_slabs : 4;
        kv_sum_slab *a = realloc(s->sum_slabs, sizeof(*a) * (size_t)cap);
        if (!a) return KM_ENOMEM;
        s->sum_slabs = a;
        int32_t *f = realloc(s->sum_free, sizeof(*f) * (size_t)cap * KV_SUM_SLAB);
        if (!f) return KM_ENOMEM;
        s->sum_free = f;
        s->cap_sum_slabs = cap;
    }
    const size_t bytes = (size_t)s->n_layers * s->n_heads * KV_SUM_SLAB * 2 * s->hd * 2;
    kv_sum_slab b = {.base = aligned_alloc(64, (bytes + 63) & ~(size_t)63),
                     .ok = malloc((size_t)KV_SUM_SLAB * s->n_layers),
                     .used = 1};
    if (!b.base || !b.ok) {
        free(b.base);
        free(b.ok);
        return KM_ENOMEM;
    }
    s->sum_slabs[s->n_sum_slabs] = b;
    *slot = s->n_sum_slabs++ * KV_SUM_SLAB;
    return 0;
}

int kv_page_sum_alloc(kv_store *s, kv_page *p)
{
    if (p->sum) return 0;
    /* the last slab's next slot, so that pages reserved in turn sit side by side */
    kv_sum_slab *last = s->n_sum_slabs ? &s->sum_slabs[s->n_sum_slabs - 1] : NULL;
    int32_t g;
    if (last && last->used < KV_SUM_SLAB)
        g = (s->n_sum_slabs - 1) * KV_SUM_SLAB + last->used++;
    else if (s->n_sum_free)
        g = s->sum_free[--s->n_sum_free];
    else if (kv_sum_slab_add(s, &g))
        return KM_ENOMEM;
    const kv_sum_slab *b = &s->sum_slabs[g / KV_SUM_SLAB];
    p->sum_slot = g;
    p->sum = b->base + (size_t)(g % KV_SUM_SLAB) * 2 * s->hd;
    p->sum_ok = b->ok + (size_t)(g % KV_SUM_SLAB) * s->n_layers;
    memset(p->sum_ok, 0, (size_t)s->n_layers);
    return 0;
}

void kv_page_sum_free(kv_store *s, kv_page *p)
{
    if (!p->sum) return;
    assert(s->n_sum_free < s->n_sum_slabs * KV_SUM_SLAB);
    s->sum_free[s->n_sum_free++] = p->sum_slot;
    p->sum = NULL;
    p->sum_ok = NULL;
}

void kv_page_sum_clear(const kv_store *s, kv_page *p)
{
    if (p->sum) memset(p->sum_ok, 0, (size_t)s->n_layers);
}

void kv_list_push(kv_store *s, kv_page *p)
{
    assert(!p->in_list && p->refs == 0 && (p->buf != NULL) == (p->tier != KV_TIER_DISK));
    assert(!p->promoting); /* its promotion is reaped before its sequence lets go of it */
    kv_tier_acct *a = &s->shards[p->shard].t[p->tier];
    kv_page *at = a->tail; /* insert after the last page not newer than p */
    while (at && at->last_use > p->last_use) at = at->lprev;
    p->lprev = at;
    p->lnext = at ? at->lnext : a->head;
    if (p->lnext)
        p->lnext->lprev = p;
    else
        a->tail = p;
    if (at)
        at->lnext = p;
    else
        a->head = p;
    p->in_list = 1;
    a->n_cached++;
    a->cached_bytes += kv_list_bytes(s, p->tier, p->format);
}

size_t kv_list_bytes(const kv_store *s, kv_tier t, kv_format f)
{
    return t == KV_TIER_DISK ? 0 : s->lay[f].page_bytes;
}

void kv_list_remove(kv_store *s, kv_page *p)
{
    kv_tier_acct *a = &s->shards[p->shard].t[p->tier];
    assert(p->in_list && a->n_cached > 0);
    if (p->lprev)
        p->lprev->lnext = p->lnext;
    else
        a->head = p->lnext;
    if (p->lnext)
        p->lnext->lprev = p->lprev;
    else
        a->tail = p->lprev;
    p->lprev = p->lnext = NULL;
    p->in_list = 0;
    a->n_cached--;
    size_t b = kv_list_bytes(s, p->tier, p->format);
    a->cached_bytes = a->cached_bytes >= b ? a->cached_bytes - b : 0;
}

void kv_page_ref(kv_store *s, kv_page *p)
{
    assert(p->refs >= 0);
    if (p->in_list) kv_list_remove(s, p);
    if (++p->refs > 1) p->flags |= KV_PAGE_SHARED;
    p->last_use = ++s->clock;
}

void kv_page_unref(kv_store *s, kv_page *p)
{
    assert(p->refs > 0 && !p->in_list);
    if (--p->refs > 0) return;
    if (!(p->flags & KV_PAGE_INDEXED)) { /* a private page: only its sequence could see it */
        assert(p->tier == KV_TIER_HOT);
        kv_page_release(s, p);
        return;
    }
    p->last_use = ++s->clock;
    kv_list_push(s, p);
}

/* ---------------------------------------------------------------- stats */

/* Pinned = accounted but not in the cached list: held by a sequence (hot pages, and host
 * ones under kv_config.promote_selected).
 * Files on disk are never pinned: any of them can be dropped. */
static void kv_tier_stats_of(const kv_tier_acct *a, kv_tier t, kv_tier_stats *out)
{
    *out = (kv_tier_stats){.pages = a->pages, .bytes = a->used, .budget = a->budget};
    if (t == KV_TIER_DISK) return;
    out->pinned_pages = a->pages > a->n_cached ? a->pages - a->n_cached : 0;
    out->pinned_bytes = a->used > a->cached_bytes ? a->used - a->cached_bytes : 0;
}

void kv_store_stats_get(const kv_store *s, kv_store_stats *out)
{
    *out = s->st;
    out->n_shards = s->n_shards;
    out->pages_indexed = s->n_indexed;
    memcpy(out->position_free_pages, s->posfree, sizeof out->position_free_pages);
    for (int t = 0; t < KV_TIER_COUNT; t++) {
        out->tier[t] = (kv_tier_stats){0};
        for (int i = 0; i < s->n_shards; i++) {
            kv_tier_stats ts;
            kv_tier_stats_of(&s->shards[i].t[t], (kv_tier)t, &ts);
            out->tier[t].pages += ts.pages;
            out->tier[t].bytes += ts.bytes;
            out->tier[t].budget += ts.budget;
            out->tier[t].pinned_pages += ts.pinned_pages;
            out->tier[t].pinned_bytes += ts.pinned_bytes;
        }
    }
}

int kv_store_n_expert_groups(const kv_store *s)
{
    return s->groups ? s->cfg.n_expert_groups : 0;
}

int kv_store_group_stats(const kv_store *s, int group, kv_group_stats *out)
{
    if (!s->groups || group < 0 || group >= s->cfg.n_expert_groups) return KM_EINVAL;
    const kv_group *g = &s->groups[group];
    *out = (kv_group_stats){
        .placed = g->placed, .hits = g->hits, .demotions = g->demotions, .evictions = g->evictions};
    memcpy(out->pages, g->pages, sizeof out->pages);
    return 0;
}

int kv_store_shard_stats(const kv_store *s, int shard, kv_shard_stats *out)
{
    if (shard < 0 || shard >= s->n_shards) return KM_EINVAL;
    const kv_shard *sh = &s->shards[shard];
    memset(out, 0, sizeof *out);
    out->format = sh->format;
    out->evict = sh->evict;
    for (int t = 0; t < KV_TIER_COUNT; t++) kv_tier_stats_of(&sh->t[t], (kv_tier)t, &out->tier[t]);
    out->allocs = sh->allocs;
    out->alloc_failures = sh->alloc_failures;
    out->evictions = sh->evictions;
    out->demotions = sh->demotions;
    out->promotions = sh->promotions;
    out->hits = sh->hits;
    out->misses = sh->misses;
    return 0;
}
