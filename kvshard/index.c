/*
 * index.c — the prefix index: page hash -> page, with every hit verified.
 *
 * A hash only nominates a page. A page is reused only when (1) its stored token ids equal the
 * request's tokens for that page and (2) it was published right after the page the lookup
 * accepted one step earlier (parent_id), so by induction every token of the prefix has been
 * compared and a forged or accidental hash collision can at worst shorten a hit, never serve
 * KV computed for other tokens. Pages found on the host tier are promoted asynchronously (tier.c),
 * those on disk are read and checksum-verified here before the sequence may see them.
 */
#include <stdlib.h>
#include <string.h>

#include "kvshard/internal.h"

static size_t kv_bucket(const kv_store *s, km_pagehash h)
{
    return (size_t)(h.lo ^ (h.hi * 0x9e3779b97f4a7c15ull)) & (s->n_buckets - 1);
}

kv_page *kv_index_find(const kv_store *s, km_pagehash h)
{
    for (kv_page *p = s->buckets[kv_bucket(s, h)]; p; p = p->hnext)
        if (km_pagehash_eq(p->hash, h)) return p;
    return NULL;
}

static void kv_index_grow(kv_store *s)
{
    size_t nb = s->n_buckets * 2;
    kv_page **b = calloc(nb, sizeof *b);
    if (!b) return; /* keep the longer chains */
    kv_page **old = s->buckets;
    size_t on = s->n_buckets;
    s->buckets = b;
    s->n_buckets = nb;
    for (size_t i = 0; i < on; i++) {
        kv_page *p = old[i];
        while (p) {
            kv_page *n = p->hnext;
            size_t k = kv_bucket(s, p->hash);
            p->hnext = b[k];
            b[k] = p;
            p = n;
        }
    }
    free(old);
}

int kv_index_insert(kv_store *s, kv_page *p)
{
    if (s->n_indexed >= s->n_buckets) kv_index_grow(s);
    size_t k = kv_bucket(s, p->hash);
    p->hnext = s->buckets[k];
    s->buckets[k] = p;
    p->flags |= KV_PAGE_INDEXED;
    s->n_indexed++;
    return 0;
}

void kv_index_remove(kv_store *s, kv_page *p)
{
    kv_page **pp = &s->buckets[kv_bucket(s, p->hash)];
    while (*pp && *pp != p) pp = &(*pp)->hnext;
    if (*pp) {
        *pp = p->hnext;
        s->n_indexed--;
    }
    p->flags &= ~KV_PAGE_INDEXED;
    p->hnext = NULL;
}

/* The page that may serve chain link i, or NULL: hash, tokens and parent all agree. */
static kv_page *kv_index_verified(kv_store *s, km_pagehash h, const int32_t *tokens,
                                  uint64_t parent_id)
{
    kv_page *p = kv_index_find(s, h);
    if (!p) return NULL;
    if (memcmp(p->tokens, tokens, sizeof(int32_t) * s->pt) || p->parent_id != parent_id) {
        s->st.collisions++;
        return NULL;
    }
    return p;
}

int kv_seq_publish(kv_store *s, kv_seq *q, const km_pagehash *hashes, const int32_t *tokens,
                   int n_tokens)
{
    if (n_tokens < 0 || (n_tokens && (!hashes || !tokens))) return KM_EINVAL;
    /* A sequence that dropped pages computed the rest with a partial context: never reusable. */
    if (q->n_dropped) return 0;
    kv_seq_wait_promo(s, q);
    int n = n_tokens / s->pt, added = 0, refresh = 0;
    if (n > q->n_pages) n = q->n_pages;
    uint64_t parent_id = 0;
    for (int i = 0; i < n; i++) {
        kv_page *p = q->pg[i];
        if (p->flags & KV_PAGE_INDEXED) {
            parent_id = p->id;
            continue;
        }
        if (kv_index_find(s, hashes[i])) {
            /* An identical page is already indexed (or a colliding one): keep the older, and
             * stop, since the pages after this one have no indexed parent. */
            break;
        }
        int32_t *tk = malloc(sizeof(int32_t) * s->pt);
        if (!tk) return added ? added : KM_ENOMEM;
        memcpy(tk, tokens + (size_t)i * s->pt, sizeof(int32_t) * s->pt);
        if (s->shards[p->shard].format == KN_KV_INT4 && p->format != KN_KV_INT4) {
            if (kv_page_seal(s, p) == 0) refresh = 1;
        }
        atomic_store_explicit(&p->rows, s->rows_full, memory_order_relaxed);
        p->tokens = tk;
        p->hash = hashes[i];
        p->parent = i ? hashes[i - 1] : (km_pagehash){0, 0};
        p->parent_id = parent_id;
        p->index = i;
        kv_index_insert(s, p);
        kv_event_emit(s, KV_EVENT_STORED, p, KV_TIER_HOT, KV_TIER_HOT);
        parent_id = p->id;
        added++;
    }
    if (refresh) kv_refresh_all(s);
    return added;
}

int kv_store_lookup(kv_store *s, const km_pagehash *hashes, const int32_t *tokens, int n_pages,
                    kv_tier *tiers)
{
    if (n_pages < 0 || (n_pages && (!hashes || !tokens))) return KM_EINVAL;
    uint64_t parent_id = 0;
    int i = 0;
    for (; i < n_pages; i++) {
        kv_page *p = kv_index_verified(s, hashes[i], tokens + (size_t)i * s->pt, parent_id);
        if (!p) break;
        if (tiers) tiers[i] = p->tier;
        parent_id = p->id;
    }
    if (i)
        s->st.hits++;
    else
        s->st.misses++;
    return i;
}

/* Brings a verified page to the hot tier for sequence q; host pages join the async job. */
static int kv_attach_one(kv_store *s, kv_page *p, kv_promo *job)
{
    if (p->tier == KV_TIER_HOT) return 0;
    uint8_t *dst;
    int rc = kv_hot_alloc(s, p->shard, p->format, &dst);
    if (rc) return rc;
    kv_tier from = p->tier;
    if (from == KV_TIER_HOST) {
        kv_acct_sub(s, p->shard, KV_TIER_HOST, p->format);
        job->src[job->n] = p->buf;
        job->dst[job->n] = dst;
        job->bytes[job->n] = s->lay[p->format].page_bytes;
        job->fmt[job->n] = p->format;
        job->pages[job->n] = p;
        job->n++;
        p->promoting = 1;
    } else { /* disk: read and verify now, so nothing unverified ever reaches a view */
        if ((rc = kv_disk_read(s, p, dst))) {
            kv_acct_sub(s, p->shard, KV_TIER_HOT, p->format);
            kv_buf_put(s, dst, p->format);
            return rc;
        }
    }
    p->buf = dst;
    p->tier = KV_TIER_HOT;
    s->shards[p->shard].promotions++;
    kv_event_emit(s, KV_EVENT_TIER, p, from, KV_TIER_HOT);
    return 0;
}

int kv_seq_attach(kv_store *s, kv_seq *q, const km_pagehash *hashes, const int32_t *tokens,
                  int n_pages)
{
    if (n_pages < 0 || (n_pages && (!hashes || !tokens))) return KM_EINVAL;
    if (q->n_pages || q->n_dropped) return KM_EINVAL;
    kv_promo_reap(s);
    int rc = kv_seq_grow(q, n_pages);
    if (rc) return rc;
    kv_promo *job = calloc(1, sizeof *job);
    if (job && n_pages) {
        job->src = malloc(sizeof(uint8_t *) * n_pages);
        job->dst = malloc(sizeof(uint8_t *) * n_pages);
        job->bytes = malloc(sizeof(size_t) * n_pages);
        job->fmt = malloc(sizeof(kv_format) * n_pages);
        job->pages = malloc(sizeof(kv_page *) * n_pages);
    }
    if (!job || (n_pages && (!job->src || !job->dst || !job->bytes || !job->fmt || !job->pages))) {
        if (job) {
            free(job->pages);
            free(job->src);
            free(job->dst);
            free(job->bytes);
            free(job->fmt);
            free(job);
        }
        return KM_ENOMEM;
    }
    uint64_t parent_id = 0;
    int i = 0;
    rc = 0;
    for (; i < n_pages; i++) {
        kv_page *p = kv_index_verified(s, hashes[i], tokens + (size_t)i * s->pt, parent_id);
        if (!p) break;
        kv_page_ref(s, p); /* out of the cached lists: room-making cannot take it now */
        int r = kv_attach_one(s, p, job);
        if (r) {
            if (r == KM_ECORRUPT || r == KM_EIO || r == KM_EFORMAT) {
                p->refs--;
                kv_page_free(s, p); /* a page that fails its checksum is gone for good */
            } else {
                kv_page_unref(s, p);
                if (!i) rc = r;
            }
            break;
        }
        atomic_store_explicit(&p->rows, s->rows_full, memory_order_relaxed);
        s->shards[p->shard].hits++;
        p->hits++;
        parent_id = p->id;
        q->pg[i] = p;
        q->mass[i] = 0.0f;
        q->pidx[i] = i;
        q->n_pages = i + 1;
    }
    q->seal_from = q->n_pages;
    q->reserved = q->n_pages * s->pt;
    kv_seq_refresh(s, q);
    if (q->n_pages)
        s->st.hits++;
    else
        s->st.misses++;
    if (job->n) {
        q->promo_pending = 1;
        atomic_store_explicit(&q->ready_layers, 0, memory_order_release);
        job->q = q;
        kv_promo_submit(s, job);
    } else {
        free(job->pages);
        free(job->src);
        free(job->dst);
        free(job->bytes);
        free(job->fmt);
        free(job);
    }
    if (rc) return rc;
    return q->n_pages;
}
