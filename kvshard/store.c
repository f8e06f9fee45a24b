/*
 * store.c — the store itself: configuration, shards and their byte accounting per tier, page
 * objects and their reference counts, the shard-key functions, and statistics.
 *
 * Memory: the hot tier is a byte budget per shard over page buffers that are recycled through a
 * free list per format (so a store that mixes f16 and fp8 pages after a live conversion really
 * holds half the bytes for the fp8 ones). Host-tier buffers come from the same lists and count in
 * the shard's host budget. A page with references is always hot; only pages no sequence holds
 * sit in a shard's cached list of their tier, oldest first, from where evict.c takes victims.
 */
#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "kvshard/internal.h"

#define KV_FREE_BUFS_MAX 64 /* recycled buffers kept per format */

const char *kv_format_name(kv_format f)
{
    switch (f) {
    case KN_KV_F16:
        return "f16";
    case KN_KV_BF16:
        return "bf16";
    case KN_KV_FP8:
        return "fp8";
    case KN_KV_INT8:
        return "int8";
    case KN_KV_INT4:
        return "int4";
    }
    return "unknown";
}

int kv_format_parse(const char *s, kv_format *out)
{
    static const char *names[] = {"f16", "bf16", "fp8", "int8", "int4"};
    for (int i = 0; i < KV_FORMAT_COUNT; i++)
        if (s && !strcmp(s, names[i])) {
            *out = (kv_format)i;
            return 0;
        }
    return KM_EINVAL;
}

const char *kv_tier_name(kv_tier t)
{
    static const char *n[] = {"hot", "host", "disk"};
    return (unsigned)t < KV_TIER_COUNT ? n[t] : "unknown";
}

const char *kv_evict_policy_name(kv_evict_policy p)
{
    return p == KV_EVICT_LRU ? "lru" : p == KV_EVICT_LRU_PRIORITY ? "lru-priority" : "unknown";
}

static int kv_format_valid(kv_format f)
{
    return (unsigned)f < KV_FORMAT_COUNT;
}

int kv_store_create(const kv_config *cfg, kv_store **out, km_errbuf *err)
{
    *out = NULL;
    kv_config c = *cfg;
    if (c.page_tokens == 0) c.page_tokens = 16;
    if (c.page_tokens < 1 || (c.page_tokens & (c.page_tokens - 1)) || c.page_tokens > 4096)
        return km_errf(err, KM_EINVAL, "page_tokens=%d must be a power of two <= 4096",
                       c.page_tokens);
    if (c.n_layers <= 0 || c.n_kv_heads <= 0 || c.head_dim <= 0 || c.head_dim > 1024 ||
        c.n_layers > 4096 || c.n_kv_heads > 4096)
        return km_errf(err, KM_EINVAL, "bad model shape layers=%d kv_heads=%d head_dim=%d",
                       c.n_layers, c.n_kv_heads, c.head_dim);
    if (!kv_format_valid(c.format))
        return km_errf(err, KM_EINVAL, "kv format %d is unknown", (int)c.format);
    if (c.n_shards == 0) c.n_shards = 1;
    if (c.n_shards < 1 || c.n_shards > 1024)
        return km_errf(err, KM_EINVAL, "n_shards=%d must be in [1, 1024]", c.n_shards);
    if (c.n_tok_groups <= 0) c.n_tok_groups = c.n_shards;
    if (c.n_expert_groups <= 0) c.n_expert_groups = c.n_shards;
    if (c.high_watermark <= 0.0f || c.high_watermark > 1.0f) c.high_watermark = 0.8f;
    if (c.event_capacity <= 0) c.event_capacity = 65536;
    if (c.disk_dir && !c.disk_bytes) c.disk_bytes = (size_t)1 << 30;

    kv_store *s = calloc(1, sizeof *s);
    if (!s) return km_errf(err, KM_ENOMEM, "kv store: out of memory");
    s->cfg = c;
    s->cfg.shards = NULL;
    s->cfg.disk_dir = NULL;
    s->pt = c.page_tokens;
    s->n_layers = c.n_layers;
    s->n_heads = c.n_kv_heads;
    s->hd = c.head_dim;
    s->rows_full = (uint32_t)c.n_layers * (uint32_t)c.page_tokens;
    s->n_shards = c.n_shards;
    s->high_wm = c.high_watermark;
    s->low_wm = c.high_watermark > 0.1f ? c.high_watermark - 0.05f : c.high_watermark / 2;
    s->ops = kn_ops_best();
    s->next_uid = 1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv_job, NULL);
    pthread_cond_init(&s->cv_done, NULL);
    for (int f = 0; f < KV_FORMAT_COUNT; f++)
        kv_layout_init(&s->lay[f], (kv_format)f, s->pt, s->hd, s->n_layers, s->n_heads);

    int rc = 0;
    s->shards = calloc((size_t)s->n_shards, sizeof(kv_shard));
    s->ev = calloc((size_t)c.event_capacity, sizeof(kv_event));
    s->ev_cap = c.event_capacity;
    s->n_buckets = 1024;
    s->buckets = calloc(s->n_buckets, sizeof(kv_page *));
    s->fscratch = malloc(sizeof(float) * 2 * (size_t)s->pt * s->hd);
    size_t nv = (size_t)s->n_layers * s->n_heads;
    s->view_offs = malloc(sizeof(size_t) * nv * KV_FORMAT_COUNT * 4);
    if (!s->shards || !s->ev || !s->buckets || !s->fscratch || !s->view_offs) {
        rc = km_errf(err, KM_ENOMEM, "kv store: out of memory");
        goto fail;
    }
    for (size_t lh = 0; lh < nv; lh++)
        for (int f = 0; f < KV_FORMAT_COUNT; f++) {
            const kv_layout *L = &s->lay[f];
            size_t *o = s->view_offs + (lh * KV_FORMAT_COUNT + f) * 4, base = lh * L->unit;
            o[0] = base;
            o[1] = base + L->kd;
            o[2] = base + L->kd + L->vd;
            o[3] = base + L->kd + L->vd + L->ks;
        }
    for (int i = 0; i < s->n_shards; i++) {
        kv_shard *sh = &s->shards[i];
        const kv_shard_config *sc = cfg->shards ? &cfg->shards[i] : NULL;
        sh->format = sc ? sc->format : c.format;
        sh->evict = sc ? sc->evict : c.evict;
        sh->t[KV_TIER_HOT].budget = sc && sc->hot_bytes ? sc->hot_bytes : c.hot_bytes / s->n_shards;
        sh->t[KV_TIER_HOST].budget =
            sc && sc->host_bytes ? sc->host_bytes : c.host_bytes / s->n_shards;
        sh->t[KV_TIER_DISK].budget =
            c.disk_dir ? (sc && sc->disk_bytes ? sc->disk_bytes : c.disk_bytes / s->n_shards) : 0;
        if (!kv_format_valid(sh->format) || !s->lay[sh->format].unit) {
            rc = km_errf(err, KM_EUNSUPPORTED, "kv format %s needs an even head_dim (got %d)",
                         kv_format_name(sh->format), s->hd);
            goto fail;
        }
        if (sh->t[KV_TIER_HOT].budget < kv_format_bytes(s, KN_KV_F16)) {
            rc = km_errf(err, KM_EINVAL,
                         "hot_bytes=%zu gives shard %d less than one page of %zu "
                         "bytes",
                         sh->t[KV_TIER_HOT].budget, i, kv_format_bytes(s, KN_KV_F16));
            goto fail;
        }
    }
    if (c.disk_dir) {
        s->disk_dir = strdup(c.disk_dir);
        if (!s->disk_dir) {
            rc = km_errf(err, KM_ENOMEM, "kv store: out of memory");
            goto fail;
        }
        if ((rc = kv_disk_open(s, err))) goto fail;
    }
    if (!c.sync_promote && (rc = kv_promoter_start(s))) {
        km_errf(err, rc, "kv store: cannot start the promoter thread");
        goto fail;
    }
    *out = s;
    return 0;
fail:
    kv_store_destroy(s);
    return rc;
}

void kv_store_destroy(kv_store *s)
{
    if (!s) return;
    kv_promoter_stop(s);
    kv_promo_reap(s);
    while (s->seqs) kv_seq_destroy(s, s->seqs);
    for (size_t b = 0; b < s->n_buckets && s->buckets; b++) {
        kv_page *p = s->buckets[b];
        while (p) {
            kv_page *n = p->hnext;
            if (p->buf) kv_buf_put(s, p->buf, p->format);
            free(p->tokens);
            free(p);
            p = n;
        }
    }
    for (int f = 0; f < KV_FORMAT_COUNT; f++) {
        for (int i = 0; i < s->n_free_bufs[f]; i++) free(s->free_bufs[f][i]);
        free(s->free_bufs[f]);
    }
    free(s->buckets);
    free(s->cand);
    free(s->fscratch);
    free(s->view_offs);
    free(s->shards);
    free(s->disk_dir);
    kv_events_free(s);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv_job);
    pthread_cond_destroy(&s->cv_done);
    free(s);
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
    if (s->n_free_bufs[f]) return s->free_bufs[f][--s->n_free_bufs[f]];
    size_t n = (s->lay[f].page_bytes + 63) & ~(size_t)63;
    uint8_t *b = aligned_alloc(64, n);
    if (b) memset(b, 0, n);
    return b;
}

void kv_buf_put(kv_store *s, uint8_t *buf, kv_format f)
{
    if (!buf) return;
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
    a->used = a->used >= b ? a->used - b : 0;
    if (a->pages) a->pages--;
}

int kv_hot_alloc(kv_store *s, int shard, kv_format f, uint8_t **out)
{
    kv_shard *sh = &s->shards[shard];
    kv_tier_acct *a = &sh->t[KV_TIER_HOT];
    size_t b = s->lay[f].page_bytes;
    *out = NULL;
    if (a->used + b > a->budget) kv_make_room(s, shard, KV_TIER_HOT, b, a->budget);
    if (a->used + b > a->budget) {
        sh->alloc_failures++;
        return KM_ENOSPC;
    }
    uint8_t *buf = kv_buf_get(s, f);
    if (!buf) return KM_ENOMEM;
    kv_acct_add(s, shard, KV_TIER_HOT, f, 1);
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
    }
    return p;
}

void kv_page_free(kv_store *s, kv_page *p)
{
    if (p->in_list) kv_list_remove(s, p);
    if (p->flags & KV_PAGE_INDEXED) {
        kv_event_emit(s, KV_EVENT_REMOVED, p, p->tier, p->tier);
        kv_index_remove(s, p);
    }
    if (p->buf) {
        kv_acct_sub(s, p->shard, p->tier, p->format);
        kv_buf_put(s, p->buf, p->format);
    }
    if (p->flags & KV_PAGE_ON_DISK) kv_disk_unlink(s, p);
    free(p->tokens);
    free(p);
}

void kv_list_push(kv_store *s, kv_page *p)
{
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
    if (p->in_list) kv_list_remove(s, p);
    if (++p->refs > 1) p->flags |= KV_PAGE_SHARED;
    p->last_use = ++s->clock;
}

void kv_page_unref(kv_store *s, kv_page *p)
{
    if (--p->refs > 0) return;
    if (!(p->flags & KV_PAGE_INDEXED)) {
        kv_page_free(s, p);
        return;
    }
    p->last_use = ++s->clock;
    kv_list_push(s, p);
}

void kv_seq_refresh(kv_store *s, kv_seq *q)
{
    memset(q->fmt_count, 0, sizeof q->fmt_count);
    for (int i = 0; i < q->n_pages; i++) {
        q->ptrs[i] = q->pg[i]->buf;
        q->fmts[i] = (uint8_t)q->pg[i]->format;
        q->fmt_count[q->pg[i]->format]++;
    }
}

void kv_refresh_all(kv_store *s)
{
    for (kv_seq *q = s->seqs; q; q = q->next) kv_seq_refresh(s, q);
}

/* ---------------------------------------------------------------- stats */

/* Pinned = accounted but not in the cached list: held by a sequence (only hot pages can be).
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
