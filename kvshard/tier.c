/*
 * tier.c — pages moving between tiers because a caller asked: a prefix hit brought up to the hot
 * tier (kv_seq_attach: host pages handed to the promoter thread, disk pages read and verified
 * before the sequence can see them) and RAM pages copied down to disk on a drain
 * (kv_store_persist). Moving down under pressure is eviction's (evict.c). This is the top layer
 * with convert.c and store.c: it calls sequences, eviction, the disk tier, the index, the
 * promoter and page memory, and none of them calls it (docs/kvshard.md, "Layers").
 *
 * kv_store_persist (a drain's last step) writes a disk copy of every indexed page still in RAM,
 * parents before children (the re-index keeps a page only with its parent), and leaves each
 * page where it is: the copy is what the next process finds; this one is about to exit.
 */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "kvshard/internal.h"

/* A hot page whose bytes another sequence's promotion is still copying in: waits for that
 * promotion. The attaching sequence has no promotion of its own to wait for, so without this its
 * views would read the page before its bytes arrive (two requests with one prefix admitted in
 * the same scheduler step). */
static void kv_wait_promotion_of(kv_store *s, const kv_page *p)
{
    for (kv_seq *o = s->seqs; o && p->promoting; o = o->next) {
        if (!o->promo_pending) continue;
        for (int i = 0; i < o->n_pages; i++)
            if (o->pg[i] == p) {
                kv_seq_wait_promo(s, o); /* reaps it: p->promoting is 0 after */
                break;
            }
    }
    assert(!p->promoting); /* a page being promoted is held by the sequence promoting it */
}

/* Brings a verified page to the hot tier for sequence q; host pages join the async job. */
static int kv_attach_one(kv_store *s, kv_page *p, kv_promo *job)
{
    assert(p->refs > 0 && !p->in_list); /* held: room-making cannot take it */
    if (p->tier == KV_TIER_HOT) {
        if (p->promoting) kv_wait_promotion_of(s, p);
        return 0;
    }
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
    kv_group_move(s, p, (int)p->tier, KV_TIER_HOT);
    p->tier = KV_TIER_HOT;
    kv_index_retier(s, p, from);
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
    kv_promo *job = kv_promo_new(n_pages);
    if (!job) return KM_ENOMEM;
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
                p->refs--; /* ours alone: the page was cached, so no sequence held it */
                /* a page that fails its checksum is gone for good, with the rest of its chain */
                kv_page_drop_tree(s, p);
            } else {
                kv_page_unref(s, p);
                if (!i) rc = r;
            }
            break;
        }
        assert(p->tier == KV_TIER_HOT && p->refs > 0);
        atomic_store_explicit(&p->rows, s->rows_full, memory_order_relaxed);
        s->shards[p->shard].hits++;
        if (kv_group_of(s, p)) kv_group_of(s, p)->hits++;
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
        kv_promo_free(job);
    }
    if (rc) return rc;
    return q->n_pages;
}

/* ---------------------------------------------------------------- persist */

/* Chain position first (parents before children), then the most recently used first. */
static int kv_by_index_recent(const void *a, const void *b)
{
    const kv_page *x = *(kv_page *const *)a, *y = *(kv_page *const *)b;
    if (x->index != y->index) return (x->index > y->index) - (x->index < y->index);
    return (x->last_use < y->last_use) - (x->last_use > y->last_use);
}

int kv_store_persist(kv_store *s, uint64_t deadline_ns)
{
    if (!kv_disk_enabled(s)) return 0;
    for (kv_seq *q = s->seqs; q; q = q->next) kv_seq_wait_promo(s, q);
    kv_promo_reap(s);
    size_t n = 0, cap = 0;
    kv_page **c = NULL;
    for (size_t b = 0; b < s->n_buckets; b++)
        for (kv_page *p = s->buckets[b]; p; p = p->hnext) {
            if (!p->buf || (p->flags & KV_PAGE_ON_DISK) ||
                !s->shards[p->shard].t[KV_TIER_DISK].budget)
                continue;
            if (n == cap) {
                size_t nc = cap ? cap * 2 : 256;
                kv_page **nb = realloc(c, sizeof *nb * nc);
                if (!nb) {
                    free(c);
                    return KM_ENOMEM;
                }
                c = nb;
                cap = nc;
            }
            c[n++] = p;
        }
    if (n) qsort(c, n, sizeof *c, kv_by_index_recent);
    int written = 0, skipped = 0;
    for (size_t i = 0; i < n; i++) {
        kv_page *p = c[i];
        if (deadline_ns && km_now_ns() >= deadline_ns) {
            skipped += (int)(n - i);
            break;
        }
        if (p->index) { /* a child whose parent is not on disk could never be re-indexed */
            const kv_page *par = kv_index_find(s, p->parent);
            if (!par || par->index != p->index - 1 || !(par->flags & KV_PAGE_ON_DISK)) {
                skipped++;
                continue;
            }
        }
        kv_tier_acct *d = &s->shards[p->shard].t[KV_TIER_DISK];
        size_t fb = kv_disk_page_size(s->lay[p->format].page_bytes, s->pt);
        if (d->used + fb > d->budget) kv_make_room(s, p->shard, KV_TIER_DISK, fb, d->budget);
        if (d->used + fb > d->budget || kv_disk_write(s, p)) {
            skipped++;
            continue;
        }
        written++;
    }
    free(c);
    KM_INFO("kv_persisted", "dir=%s pages=%d skipped=%d", s->disk_dir, written, skipped);
    return written;
}
