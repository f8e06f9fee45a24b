/*
 * tier.c — pages moving between tiers because a caller asked: a prefix hit brought up to the hot
 * tier (kv_seq_attach: host pages handed to the promoter thread, disk pages read and verified
 * before the sequence can see them) and RAM pages copied down to disk on a drain
 * (kv_store_persist), and the pages a sparse step reads brought up from host RAM or disk
 * (kv_seq_fetch; with kv_config.promote_selected an attach leaves them where they are, held by
 * the sequence), and sent back down when its steps stop reading them (kv_seq_demote_idle).
 * Moving cached pages down under pressure is eviction's (evict.c). This is the top layer
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

/* p, now hot in buffer dst, leaves tier `from`: index, groups, counters and the event. */
static void kv_page_came_up(kv_store *s, kv_page *p, uint8_t *dst, kv_tier from,
                            kv_promote_reason why)
{
    p->buf = dst;
    kv_group_move(s, p, (int)p->tier, KV_TIER_HOT);
    p->tier = KV_TIER_HOT;
    kv_index_retier(s, p, from);
    s->shards[p->shard].promotions++;
    s->st.promoted_pages[why]++;
    s->st.promoted_bytes[why] += s->lay[p->format].page_bytes;
    kv_event_emit(s, KV_EVENT_TIER, p, from, KV_TIER_HOT);
}

/* Host page p joins job, to be copied into dst. */
static void kv_promo_add(kv_store *s, kv_promo *job, kv_page *p, uint8_t *src, uint8_t *dst)
{
    job->src[job->n] = src;
    job->dst[job->n] = dst;
    job->bytes[job->n] = s->lay[p->format].page_bytes;
    job->fmt[job->n] = p->format;
    job->pages[job->n] = p;
    job->rc[job->n] = 0;
    job->layer[job->n] = -1;
    job->n++;
    p->promoting = 1;
}

/* Brings a verified page to the hot tier for sequence q; host pages join the async job. With
 * lazy (kv_config.promote_selected) a page stays where it is. */
static int kv_attach_one(kv_store *s, kv_page *p, kv_promo *job, int lazy)
{
    assert(p->refs > 0 && !p->in_list); /* held: room-making cannot take it */
    if (p->tier == KV_TIER_HOT) {
        if (p->promoting) kv_wait_promotion_of(s, p);
        return 0;
    }
    if (lazy) return 0;
    uint8_t *dst;
    int rc = kv_hot_alloc(s, p->shard, p->format, &dst);
    if (rc) return rc;
    kv_tier from = p->tier;
    if (from == KV_TIER_HOST) {
        kv_acct_sub(s, p->shard, KV_TIER_HOST, p->format);
        kv_promo_add(s, job, p, p->buf, dst);
    } else { /* disk: read and verify now, so nothing unverified ever reaches a view */
        if ((rc = kv_disk_read(s, p, dst))) {
            kv_acct_sub(s, p->shard, KV_TIER_HOT, p->format);
            kv_buf_put(s, dst, p->format);
            return rc;
        }
    }
    kv_page_came_up(s, p, dst, from, KV_PROMOTE_PREFIX);
    return 0;
}

/* The job's promoted pages are held by other sequences too (a lazy holder reads host pages in
 * place): it is waited for, and every table then points at the new buffers. */
static int kv_promo_shared(const kv_promo *job)
{
    for (int j = 0; j < job->n; j++) /* a layer slice is read into the sequence's own buffer */
        if (job->layer[j] < 0 && job->pages[j]->refs > 1) return 1;
    return 0;
}

/* Submits q's job (layers from `first` on), or frees an empty one; then points the tables at
 * the pages' buffers. */
static void kv_promo_run(kv_store *s, kv_seq *q, kv_promo *job, int first)
{
    if (!job->n) {
        kv_promo_free(job);
        kv_seq_refresh(s, q);
        return;
    }
    const int shared = kv_promo_shared(job);
    q->promo_pending = 1;
    q->ready_first = job->first = first;
    atomic_store_explicit(&q->ready_layers, 0, memory_order_release);
    job->q = q;
    if (!job->read) job->read = kv_disk_fetch;
    kv_promo_submit(s, job);
    if (!shared) {
        kv_seq_refresh(s, q);
        return;
    }
    kv_seq_wait_promo(s, q);
    kv_refresh_all(s);
}

int kv_seq_attach_mode(kv_store *s, kv_seq *q, const km_pagehash *hashes, const int32_t *tokens,
                       int n_pages, int lazy)
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
        int r = kv_attach_one(s, p, job, lazy);
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
        assert((lazy || p->tier == KV_TIER_HOT) && p->refs > 0);
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
    if (q->n_pages)
        s->st.hits++;
    else
        s->st.misses++;
    kv_promo_run(s, q, job, 0);
    if (rc) return rc;
    return q->n_pages;
}

int kv_seq_attach(kv_store *s, kv_seq *q, const km_pagehash *hashes, const int32_t *tokens,
                  int n_pages)
{
    return kv_seq_attach_mode(s, q, hashes, tokens, n_pages, s->cfg.promote_selected);
}

/* Room in q's slice buffer for a slice of each page of its table (the most one layer reads);
 * asked with no slice live. 0 or KM_ENOMEM. */
static int kv_slices_room(kv_store *s, kv_seq *q)
{
    if (q->slice_buf && q->slice_cap >= q->n_pages) return 0;
    void *b = NULL;
    int *pg = malloc(sizeof(int) * (size_t)q->n_pages);
    if (!pg || posix_memalign(&b, 64, kv_slice_slot(s) * (size_t)q->n_pages)) {
        free(pg);
        return KM_ENOMEM;
    }
    free(q->slice_buf);
    free(q->slice_page);
    q->slice_buf = b, q->slice_page = pg, q->slice_cap = q->n_pages;
    return 0;
}

/* Whether page i of q is read as a layer slice at `layer` (kv_config.fetch_slices) rather than
 * brought up: a host page in place, a disk page's layer into q's slice buffer (joins job). A
 * page read often comes up whole, unless (no_room) the hot tier has no room for it. */
static int kv_fetch_slice(kv_store *s, kv_seq *q, kv_promo *job, int i, int layer, int no_room)
{
    kv_page *p = q->pg[i];
    if (!s->cfg.fetch_slices || (p->slice_reads >= s->cfg.fetch_slices && !no_room)) return 0;
    if (p->tier == KV_TIER_HOST) {
        p->slice_reads++;
        s->st.slice_host_reads++;
        return 1;
    }
    if (!(p->flags & KV_PAGE_SLICES) || (p->flags & KV_PAGE_BAD)) return 0;
    if (q->n_slices && q->ptrs[i]) return 1; /* another run of q read it for this layer */
    if (!q->n_slices && kv_slices_room(s, q)) return 0;
    const size_t per = kv_layer_bytes(s, p->format);
    job->src[job->n] = NULL;
    job->dst[job->n] = q->slice_buf + kv_slice_slot(s) * (size_t)q->n_slices;
    job->bytes[job->n] = per;
    job->fmt[job->n] = p->format;
    job->pages[job->n] = p;
    job->rc[job->n] = 0;
    job->layer[job->n] = layer;
    job->n++;
    q->slice_page[q->n_slices++] = i;
    q->slice_layer = layer;
    p->slice_reads++;
    s->st.slice_disk_reads++;
    s->st.slice_disk_bytes += per;
    return 1;
}

void kv_seq_fetch_end(kv_store *s, kv_seq *q)
{
    if (!q->n_slices) return;
    kv_seq_wait_promo(s, q); /* the promoter may still be reading into the slots */
    for (int j = 0; j < q->n_slices; j++) {
        const int i = q->slice_page[j];
        if (i < q->n_pages) q->ptrs[i] = q->pg[i]->buf;
    }
    q->n_slices = 0;
}

int kv_seq_fetch(kv_store *s, kv_seq *q, int layer, const int *pages, int n)
{
    if (layer < 0 || layer >= s->n_layers || n < 0) return KM_EINVAL;
    if (q->slice_layer != layer) kv_seq_fetch_end(s, q); /* the last layer's slices are done */
    if (!q->n_cold || !n) return 0;
    kv_seq_wait_promo(s, q); /* one job per sequence; usually done by the time of the next */
    kv_promo *job = kv_promo_new(n);
    if (!job) return KM_ENOMEM;
    job->read = kv_disk_fetch;
    int got = 0;
    for (int k = 0; k < n; k++) {
        if (pages[k] < 0 || pages[k] >= q->n_pages) continue;
        kv_page *p = q->pg[pages[k]];
        if (p->tier == KV_TIER_HOT) continue; /* a page listed twice is hot by its second time */
        if (kv_fetch_slice(s, q, job, pages[k], layer, 0)) continue;
        uint8_t *dst;
        kv_tier from = p->tier;
        if (kv_hot_alloc(s, p->shard, p->format, &dst)) {
            if (kv_fetch_slice(s, q, job, pages[k], layer, 1)) continue; /* no room: a slice */
            if (from == KV_TIER_HOST) {                                  /* read where it is */
                s->st.fetch_in_place++;
                continue;
            }
            if (!(dst = kv_buf_get(s, p->format))) continue; /* stays unread: NULL in the view */
            kv_acct_add(s, p->shard, KV_TIER_HOT, p->format, 1);
        }
        if (from == KV_TIER_HOST) kv_acct_sub(s, p->shard, KV_TIER_HOST, p->format);
        kv_promo_add(s, job, p, from == KV_TIER_HOST ? p->buf : NULL, dst);
        kv_page_came_up(s, p, dst, from, KV_PROMOTE_READ);
        p->slice_reads = 0;
        got++;
    }
    kv_promo_run(s, q, job, layer);
    return got;
}

void kv_seq_touch(const kv_store *s, const kv_seq *q, const int *pages, int n)
{
    (void)s;
    for (int k = 0; k < n; k++) {
        const int i = pages ? pages[k] : k;
        if (i >= 0 && i < q->n_pages)
            atomic_store_explicit(&q->pg[i]->sel_at, q->sel_clock + 1, memory_order_relaxed);
    }
}

/* Held hot page p (q's alone) down to host RAM, or to disk where it has or can get a verified
 * copy: 1 when moved. Like kv_demote for a cached page, but p stays in q's table. */
static int kv_held_down(kv_store *s, kv_page *p)
{
    const int sh = p->shard;
    const size_t pb = s->lay[p->format].page_bytes;
    kv_tier_acct *h = &s->shards[sh].t[KV_TIER_HOST], *d = &s->shards[sh].t[KV_TIER_DISK];
    uint8_t *nb = NULL;
    if (h->budget) {
        kv_make_room(s, sh, KV_TIER_HOST, pb, h->budget);
        if (h->used + pb <= h->budget) nb = kv_buf_get(s, p->format);
    }
    if (!nb && !(p->flags & KV_PAGE_ON_DISK) && kv_disk_enabled(s) && d->budget) {
        const size_t fb = kv_disk_page_size(pb, s->pt);
        kv_make_room(s, sh, KV_TIER_DISK, fb, d->budget);
        if (d->used + fb <= d->budget) kv_disk_write(s, p);
    }
    if (!nb && !(p->flags & KV_PAGE_ON_DISK)) return 0;
    const kv_tier to = nb ? KV_TIER_HOST : KV_TIER_DISK;
    if (nb) {
        memcpy(nb, p->buf, pb);
        kv_acct_add(s, sh, KV_TIER_HOST, p->format, 1);
    }
    kv_acct_sub(s, sh, KV_TIER_HOT, p->format);
    kv_buf_put(s, p->buf, p->format);
    p->buf = nb;
    p->tier = to;
    kv_group_move(s, p, KV_TIER_HOT, (int)to);
    kv_index_retier(s, p, KV_TIER_HOT);
    s->shards[sh].demotions++;
    s->st.held_demoted_pages++;
    s->st.held_demoted_bytes += pb;
    kv_event_emit(s, KV_EVENT_TIER, p, KV_TIER_HOT, to);
    return 1;
}

/* Whether shard sh's hot tier is above `wm` of its budget. */
static int kv_hot_above(const kv_store *s, int sh, float wm)
{
    const kv_tier_acct *t = &s->shards[sh].t[KV_TIER_HOT];
    return (double)t->used > (double)wm * (double)t->budget;
}

int kv_seq_demote_idle(kv_store *s, kv_seq *q, int idle, int keep_tail)
{
    if (!s->cfg.promote_selected || idle < 1 || q->lent) return 0;
    const uint64_t now = ++q->sel_clock;
    kv_seq_fetch_end(s, q);
    if (q->promo_pending) kv_seq_wait_promo(s, q);
    int moved = 0;
    /* Pages idle for `idle` steps first (above the low watermark); then, only above the high
     * one, the least recently read first, down to this step's own reads (the sink last). */
    for (int age = idle; age >= 0; age--)
        for (int i = 0; i < q->n_pages - keep_tail; i++) {
            kv_page *p = q->pg[i];
            uint64_t at = atomic_load_explicit(&p->sel_at, memory_order_relaxed);
            if (!at || at > now) atomic_store_explicit(&p->sel_at, at = now, memory_order_relaxed);
            if (p->tier != KV_TIER_HOT || p->refs != 1 || !(p->flags & KV_PAGE_INDEXED) ||
                now - at < (uint64_t)age ||
                !kv_hot_above(s, p->shard, age == idle ? s->low_wm : s->high_wm))
                continue;
            if (!kv_held_down(s, p)) continue;
            q->ptrs[i] = p->buf;
            q->n_cold++;
            moved++;
        }
    return moved;
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
