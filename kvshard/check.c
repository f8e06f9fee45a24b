/*
 * check.c — kv_store_check: every invariant the store's structure relies on, checked at once
 * over the whole store (the cheap ones are also assert'ed where they must hold: references,
 * cached lists and budgets in page.c, index membership in index.c, files in disk.c, tiers in
 * evict.c, tier.c and promote.c, page tables in seq.c). Tests call it after every operation
 * (tests/unit/test_kvshard_model.c), so a change that breaks the bookkeeping fails there, at the
 * operation that broke it, even when the values read back are still right. It reads everything and
 * calls nothing, so it sits at the top.
 *
 * What must hold between two structural calls:
 *  - a page's refs equals the number of sequence table slots that hold it; a held page is hot,
 *    has a buffer and is in no cached list; a page no one holds is indexed and in the cached
 *    list of its (shard, tier) (a private page is freed with its last reference);
 *  - a page has a RAM buffer exactly when its tier is hot or host; a disk-tier page has a file;
 *    only indexed pages have files;
 *  - each (shard, tier) accounts exactly the bytes and pages of the buffers and files it holds;
 *  - each cached list is ordered by last use, its count and bytes are its members';
 *  - the index holds n_indexed pages, all flagged indexed, and on each tier as many
 *    position-free ones as the events counted;
 *  - every indexed page is reachable: a chain's first page has no parent, any other hangs
 *    (up) from the indexed page a lookup reaches it through (parent hash, parent_id, index),
 *    and each page's per-tier counts of the pages hanging from it are exact;
 *  - a sequence's pointer and format tables mirror its pages, and its page indices increase;
 *  - each expert group counts exactly the tagged pages of its experts on each tier.
 */
#include <stdlib.h>
#include <string.h>

#include "kvshard/internal.h"

static int kv_ptr_cmp(const void *a, const void *b)
{
    const kv_page *x = *(kv_page *const *)a, *y = *(kv_page *const *)b;
    return (x > y) - (x < y);
}

static int kv_check_seq(const kv_store *s, const kv_seq *q, km_errbuf *err)
{
    int fc[KV_FORMAT_COUNT] = {0};
    if (q->n_pages > q->cap)
        return km_errf(err, KM_ECORRUPT, "seq %llu: %d pages > cap %d", (unsigned long long)q->uid,
                       q->n_pages, q->cap);
    for (int i = 0; i < q->n_pages; i++) {
        const kv_page *p = q->pg[i];
        if (q->ptrs[i] != p->buf || q->fmts[i] != (uint8_t)p->format)
            return km_errf(err, KM_ECORRUPT, "seq %llu page %d: stale pointer or format",
                           (unsigned long long)q->uid, i);
        if (i && q->pidx[i] <= q->pidx[i - 1])
            return km_errf(err, KM_ECORRUPT, "seq %llu: page indices not increasing at %d",
                           (unsigned long long)q->uid, i);
        fc[p->format]++;
    }
    if (memcmp(fc, q->fmt_count, sizeof fc))
        return km_errf(err, KM_ECORRUPT, "seq %llu: format counts disagree with its pages",
                       (unsigned long long)q->uid);
    return 0;
}

static int kv_check_page(const kv_store *s, const kv_page *p, int refs, km_errbuf *err)
{
    const unsigned long long id = (unsigned long long)p->id;
    if (p->refs != refs)
        return km_errf(err, KM_ECORRUPT, "page %llu: refs %d but %d table slots hold it", id,
                       p->refs, refs);
    if (p->shard < 0 || p->shard >= s->n_shards)
        return km_errf(err, KM_ECORRUPT, "page %llu: shard %d", id, p->shard);
    if ((p->buf != NULL) != (p->tier != KV_TIER_DISK))
        return km_errf(err, KM_ECORRUPT, "page %llu: tier %s but buffer %p", id,
                       kv_tier_name(p->tier), (void *)p->buf);
    if (p->tier == KV_TIER_DISK && !(p->flags & KV_PAGE_ON_DISK))
        return km_errf(err, KM_ECORRUPT, "page %llu: on the disk tier without a file", id);
    if ((p->flags & KV_PAGE_ON_DISK) && !(p->flags & KV_PAGE_INDEXED))
        return km_errf(err, KM_ECORRUPT, "page %llu: a file but not indexed", id);
    if (refs && ((p->tier != KV_TIER_HOT && !s->cfg.promote_selected) || p->in_list))
        return km_errf(err, KM_ECORRUPT, "page %llu: held but on tier %s%s", id,
                       kv_tier_name(p->tier), p->in_list ? ", in a cached list" : "");
    if (!refs && (!(p->flags & KV_PAGE_INDEXED) || !p->in_list))
        return km_errf(err, KM_ECORRUPT, "page %llu: held by no one but %s", id,
                       p->in_list ? "not indexed" : "in no cached list");
    return 0;
}

/* Walks one cached list; adds its pages to the accounting sums. */
static int kv_check_list(const kv_store *s, int sh, int t, km_errbuf *err)
{
    const kv_tier_acct *a = &s->shards[sh].t[t];
    uint64_t n = 0;
    size_t bytes = 0;
    const kv_page *prev = NULL;
    for (const kv_page *p = a->head; p; prev = p, p = p->lnext) {
        if (!p->in_list || p->shard != sh || (int)p->tier != t || p->lprev != prev || p->refs ||
            !(p->flags & KV_PAGE_INDEXED))
            return km_errf(err, KM_ECORRUPT, "cached list of shard %d tier %s: page %llu misplaced",
                           sh, kv_tier_name((kv_tier)t), (unsigned long long)p->id);
        if (prev && prev->last_use > p->last_use)
            return km_errf(err, KM_ECORRUPT, "cached list of shard %d tier %s: not oldest first",
                           sh, kv_tier_name((kv_tier)t));
        n++;
        bytes += kv_list_bytes(s, (kv_tier)t, p->format);
    }
    if (a->tail != prev || n != a->n_cached || bytes != a->cached_bytes)
        return km_errf(
            err, KM_ECORRUPT,
            "cached list of shard %d tier %s: %llu pages of %zu bytes, counted %llu of %zu", sh,
            kv_tier_name((kv_tier)t), (unsigned long long)n, bytes, (unsigned long long)a->n_cached,
            a->cached_bytes);
    return 0;
}

/* Every page once (index buckets, then the sequences' private pages), sorted by address. */
static int kv_check_collect(const kv_store *s, kv_page ***out, size_t *n_out)
{
    size_t n = s->n_indexed, slots = 0;
    for (const kv_seq *q = s->seqs; q; q = q->next) slots += (size_t)q->n_pages;
    kv_page **all = malloc(sizeof *all * (n + slots + 1));
    if (!all) return KM_ENOMEM;
    size_t k = 0;
    for (size_t b = 0; b < s->n_buckets; b++)
        for (kv_page *p = s->buckets[b]; p && k < n + slots; p = p->hnext) all[k++] = p;
    for (const kv_seq *q = s->seqs; q; q = q->next)
        for (int i = 0; i < q->n_pages && k < n + slots; i++) all[k++] = q->pg[i];
    qsort(all, k, sizeof *all, kv_ptr_cmp);
    *out = all;
    *n_out = k;
    return 0;
}

/* The first slot of page p in all (sorted by address; p is in it). */
static size_t kv_check_slot(kv_page *const *all, size_t n, const kv_page *p)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (all[mid] < p)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Reachability and the links that record it, over every page once (all: kv_check_collect). */
static int kv_check_links(const kv_store *s, kv_page *const *all, size_t n, km_errbuf *err)
{
    uint32_t *kids = calloc(n * KV_TIER_COUNT + 1, sizeof *kids);
    if (!kids) return km_errf(err, KM_ENOMEM, "kv_store_check: out of memory");
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        const kv_page *p = all[i];
        const unsigned long long id = (unsigned long long)p->id;
        if (i && all[i - 1] == p) continue;
        if (!(p->flags & KV_PAGE_INDEXED)) {
            if (p->up || kv_page_kids(p, KV_TIER_DISK))
                rc = km_errf(err, KM_ECORRUPT, "page %llu: not indexed but linked", id);
            continue;
        }
        const kv_page *par = kv_index_parent(s, p);
        if (p->index < 0 || (p->index > 0 && !par) || (p->index == 0 && p->parent_id))
            rc = km_errf(err, KM_ECORRUPT,
                         "page %llu (chain index %d) is unreachable: its parent is not indexed", id,
                         p->index);
        else if (p->up != par)
            rc = km_errf(err, KM_ECORRUPT, "page %llu: linked under page %llu, not its parent %llu",
                         id, p->up ? (unsigned long long)p->up->id : 0ull,
                         par ? (unsigned long long)par->id : 0ull);
        else if (par)
            kids[kv_check_slot(all, n, par) * KV_TIER_COUNT + p->tier]++;
    }
    for (size_t i = 0; i < n && !rc; i++) {
        if (i && all[i - 1] == all[i]) continue;
        size_t listed = 0;
        for (const kv_page *k = all[i]->kid; k && listed <= n; k = k->sib_next, listed++)
            if (k->up != all[i] || (k->sib_next && k->sib_next->sib_prev != k))
                rc = km_errf(err, KM_ECORRUPT, "page %llu: its list of children is broken",
                             (unsigned long long)all[i]->id);
        if (!rc && listed != kv_page_kids(all[i], KV_TIER_DISK))
            rc =
                km_errf(err, KM_ECORRUPT, "page %llu: %zu children listed, %u counted",
                        (unsigned long long)all[i]->id, listed, kv_page_kids(all[i], KV_TIER_DISK));
        if (!rc && memcmp(all[i]->kids, kids + i * KV_TIER_COUNT, sizeof all[i]->kids))
            rc = km_errf(
                err, KM_ECORRUPT, "page %llu: counts %u/%u/%u pages hanging from it, %u/%u/%u do",
                (unsigned long long)all[i]->id, all[i]->kids[0], all[i]->kids[1], all[i]->kids[2],
                kids[i * KV_TIER_COUNT], kids[i * KV_TIER_COUNT + 1], kids[i * KV_TIER_COUNT + 2]);
    }
    free(kids);
    return rc;
}

int kv_store_check(const kv_store *s, km_errbuf *err)
{
    size_t n_idx = 0;
    uint64_t posfree[KV_TIER_COUNT] = {0};
    for (size_t b = 0; b < s->n_buckets; b++)
        for (const kv_page *p = s->buckets[b]; p; p = p->hnext) {
            if (!(p->flags & KV_PAGE_INDEXED))
                return km_errf(err, KM_ECORRUPT, "page %llu in the index is not flagged indexed",
                               (unsigned long long)p->id);
            n_idx++;
            if (p->flags & KV_PAGE_POSFREE) posfree[p->tier]++;
        }
    if (n_idx != s->n_indexed)
        return km_errf(err, KM_ECORRUPT, "index holds %zu pages, counted %zu", n_idx, s->n_indexed);
    for (int t = 0; t < KV_TIER_COUNT; t++)
        if (posfree[t] != s->posfree[t])
            return km_errf(err, KM_ECORRUPT, "tier %s: %llu position-free pages, counted %llu",
                           kv_tier_name((kv_tier)t), (unsigned long long)posfree[t],
                           (unsigned long long)s->posfree[t]);
    int rc;
    for (const kv_seq *q = s->seqs; q; q = q->next)
        if ((rc = kv_check_seq(s, q, err))) return rc;
    for (int sh = 0; sh < s->n_shards; sh++)
        for (int t = 0; t < KV_TIER_COUNT; t++)
            if ((rc = kv_check_list(s, sh, t, err))) return rc;

    kv_page **all;
    size_t n;
    if ((rc = kv_check_collect(s, &all, &n)))
        return km_errf(err, rc, "kv_store_check: out of memory");
    size_t *used = calloc((size_t)s->n_shards * KV_TIER_COUNT, sizeof *used);
    uint64_t *pages = calloc((size_t)s->n_shards * KV_TIER_COUNT, sizeof *pages);
    const int n_grp = s->groups ? s->cfg.n_expert_groups : 0;
    uint64_t *gpages = calloc((size_t)n_grp * KV_TIER_COUNT + 1, sizeof *gpages);
    if (!used || !pages || !gpages) rc = km_errf(err, KM_ENOMEM, "kv_store_check: out of memory");
    /* An indexed page held by sequences appears once from the index and once per slot; a
     * private page once per slot: refs is the number of slot entries. */
    for (size_t i = 0; i < n && !rc;) {
        const kv_page *p = all[i];
        size_t j = i;
        while (j < n && all[j] == p) j++;
        int refs = (int)(j - i) - ((p->flags & KV_PAGE_INDEXED) ? 1 : 0);
        if ((rc = kv_check_page(s, p, refs, err))) break;
        size_t at = (size_t)p->shard * KV_TIER_COUNT;
        if (p->buf) {
            used[at + p->tier] += s->lay[p->format].page_bytes;
            pages[at + p->tier]++;
        }
        if (p->flags & KV_PAGE_ON_DISK) {
            used[at + KV_TIER_DISK] += kv_disk_page_size(s->lay[p->format].page_bytes, s->pt);
            pages[at + KV_TIER_DISK]++;
        }
        if (n_grp && p->expert >= 0)
            gpages[(size_t)(p->expert % n_grp) * KV_TIER_COUNT + p->tier]++;
        i = j;
    }
    if (!rc) rc = kv_check_links(s, all, n, err);
    for (int sh = 0; sh < s->n_shards && !rc; sh++)
        for (int t = 0; t < KV_TIER_COUNT && !rc; t++) {
            const kv_tier_acct *a = &s->shards[sh].t[t];
            size_t at = (size_t)sh * KV_TIER_COUNT + t;
            if (a->used != used[at] || a->pages != pages[at])
                rc = km_errf(err, KM_ECORRUPT,
                             "shard %d tier %s accounts %zu bytes in %llu pages, holds %zu in %llu",
                             sh, kv_tier_name((kv_tier)t), a->used, (unsigned long long)a->pages,
                             used[at], (unsigned long long)pages[at]);
        }
    for (int g = 0; g < n_grp && !rc; g++)
        for (int t = 0; t < KV_TIER_COUNT && !rc; t++)
            if (s->groups[g].pages[t] != gpages[(size_t)g * KV_TIER_COUNT + t])
                rc = km_errf(err, KM_ECORRUPT,
                             "expert group %d counts %llu pages on tier %s, holds %llu", g,
                             (unsigned long long)s->groups[g].pages[t], kv_tier_name((kv_tier)t),
                             (unsigned long long)gpages[(size_t)g * KV_TIER_COUNT + t]);
    free(gpages);
    free(used);
    free(pages);
    free(all);
    return rc;
}
