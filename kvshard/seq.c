/*
 * seq.c — sequences: a page table (page objects, and the parallel arrays of buffer pointers and
 * formats that kn_kv_view hands to the attention kernel, so a view costs nothing to build),
 * reserve with copy-on-write and int4 sealing, the hot-path write and view, and fork/truncate.
 *
 * A page is written in place only while it is private, unpublished and in a row-writable format;
 * reserve(n) makes the page holding position n-1 so (copying it when it is shared, published, or
 * sealed int4), which is all the engine needs because it reserves every position it writes.
 * Completion of a page is counted by its writers (one atomic add per (layer, row)), so an int4
 * shard can seal full pages at the next reserve without being told.
 *
 * Layer: sequences sit on eviction (a reserve that needs room gets it from kv_hot_alloc, and a
 * destroyed sequence's pages bring tiers back under their watermarks), the index (publish), the
 * promoter (waits) and page memory; only the top files (tier.c, convert.c, store.c) call here.
 */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "kvshard/internal.h"

int kv_seq_create(kv_store *s, kv_seq **out)
{
    kv_seq *q = calloc(1, sizeof *q);
    *out = q;
    if (!q) return KM_ENOMEM;
    q->uid = s->next_uid++;
    atomic_init(&q->ready_layers, 0);
    q->next = s->seqs;
    if (s->seqs) s->seqs->prev = q;
    s->seqs = q;
    return 0;
}

void kv_seq_destroy(kv_store *s, kv_seq *q)
{
    if (!q) return;
    kv_seq_wait_promo(s, q);
    /* tail first: a page's parent is cached as used later than it, and goes after it */
    for (int i = q->n_pages - 1; i >= 0; i--) kv_page_unref(s, q->pg[i]);
    if (q->prev)
        q->prev->next = q->next;
    else
        s->seqs = q->next;
    if (q->next) q->next->prev = q->prev;
    free(q->pg);
    free(q->ptrs);
    free(q->fmts);
    free(q->mass);
    free(q->pidx);
    free(q->sum_at);
    free(q->slice_buf);
    free(q->slice_page);
    free(q);
    kv_promo_reap(s);
    for (int i = 0; i < s->n_shards; i++) kv_enforce_watermarks(s, i);
}

int kv_seq_capacity(const kv_seq *q)
{
    return q->n_pages;
}
int kv_seq_dropped_pages(const kv_seq *q)
{
    return q->n_dropped;
}
void kv_seq_set_position_free(kv_seq *q, int on)
{
    q->position_free = on != 0;
}
uint64_t kv_seq_uid(const kv_seq *q)
{
    return q->uid;
}

/* ---------------------------------------------------------------- page tables */

int kv_seq_grow(kv_seq *q, int need)
{
    if (need <= q->cap) return 0;
    int cap = q->cap ? q->cap : 8;
    while (cap < need) cap *= 2;
    kv_page **pg = realloc(q->pg, sizeof(kv_page *) * cap);
    if (!pg) return KM_ENOMEM;
    q->pg = pg;
    const uint8_t **ptrs = realloc(q->ptrs, sizeof(uint8_t *) * cap);
    if (!ptrs) return KM_ENOMEM;
    q->ptrs = ptrs;
    uint8_t *fmts = realloc(q->fmts, (size_t)cap);
    if (!fmts) return KM_ENOMEM;
    q->fmts = fmts;
    float *mass = realloc(q->mass, sizeof(float) * cap);
    if (!mass) return KM_ENOMEM;
    q->mass = mass;
    int32_t *pidx = realloc(q->pidx, sizeof(int32_t) * cap);
    if (!pidx) return KM_ENOMEM;
    q->pidx = pidx;
    const kn_f16 **sum_at = realloc(q->sum_at, sizeof(*q->sum_at) * cap);
    if (!sum_at) return KM_ENOMEM;
    q->sum_at = sum_at;
    q->cap = cap;
    return 0;
}

/* Puts page p at index i of the table (the slot's previous page, if any, is the caller's). */
static void kv_seq_set(kv_seq *q, int i, kv_page *p, int was_set)
{
    assert(p->refs > 0 && p->tier == KV_TIER_HOT && p->buf);
    if (was_set) q->fmt_count[q->fmts[i]]--;
    q->pg[i] = p;
    q->ptrs[i] = p->buf;
    q->fmts[i] = (uint8_t)p->format;
    q->fmt_count[p->format]++;
    if (q->sum_from > i) q->sum_from = i; /* a new or re-encoded page: summarized again */
}

/* Counts the table's pages not hot (kv_config.promote_selected leaves them where they are). */
static void kv_seq_count_cold(kv_seq *q)
{
    q->n_cold = 0;
    for (int i = 0; i < q->n_pages; i++) q->n_cold += q->pg[i]->tier != KV_TIER_HOT;
}

void kv_seq_refresh(kv_store *s, kv_seq *q)
{
    memset(q->fmt_count, 0, sizeof q->fmt_count);
    q->sum_from = 0; /* a page may have been re-encoded: its summary is checked again */
    kv_seq_count_cold(q);
    for (int i = 0; i < q->n_pages; i++) {
        q->ptrs[i] = q->pg[i]->buf;
        q->fmts[i] = (uint8_t)q->pg[i]->format;
        q->fmt_count[q->pg[i]->format]++;
    }
    kv_seq_slices_point(s, q);
}

void kv_seq_slices_point(const kv_store *s, kv_seq *q)
{
    const size_t slot = kv_slice_slot(s);
    for (int j = 0; j < q->n_slices; j++) {
        const kv_page *p = q->pg[q->slice_page[j]];
        if (p->tier != KV_TIER_DISK) continue;
        /* the address layer slice_layer would have in a whole page (never read below the slot) */
        const uintptr_t at = (uintptr_t)(q->slice_buf + slot * (size_t)j) -
                             kv_layer_bytes(s, p->format) * (size_t)q->slice_layer;
        q->ptrs[q->slice_page[j]] = (const uint8_t *)at;
    }
}

void kv_refresh_all(kv_store *s)
{
    for (kv_seq *q = s->seqs; q; q = q->next) kv_seq_refresh(s, q);
}

/* Index in the table of the page holding position pos, or -1. */
static int kv_seq_find(const kv_seq *q, int page_index)
{
    if (!q->n_dropped) return page_index < q->n_pages ? page_index : -1;
    int lo = 0, hi = q->n_pages - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (q->pidx[mid] == page_index) return mid;
        if (q->pidx[mid] < page_index)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return -1;
}

int kv_seq_fork(kv_store *s, const kv_seq *src, kv_seq **out)
{
    kv_seq_wait_promo(s, (kv_seq *)src);
    int rc = kv_seq_create(s, out);
    if (rc) return rc;
    kv_seq *q = *out;
    if ((rc = kv_seq_grow(q, src->n_pages))) {
        kv_seq_destroy(s, q);
        *out = NULL;
        return rc;
    }
    for (int i = 0; i < src->n_pages; i++) {
        kv_page_ref(s, src->pg[i]);
        q->pg[i] = src->pg[i]; /* on any tier: the source may hold pages not hot */
        q->mass[i] = src->mass[i];
        q->pidx[i] = src->pidx[i];
    }
    q->n_pages = src->n_pages;
    kv_seq_refresh(s, q);
    q->n_dropped = src->n_dropped;
    q->seal_from = src->seal_from;
    q->policy = src->policy;
    q->reserved = src->reserved;
    return 0;
}

/* ---------------------------------------------------------------- lossy policies */

static void kv_seq_drop_page(kv_store *s, kv_seq *q, int i)
{
    kv_page *p = q->pg[i];
    q->fmt_count[q->fmts[i]]--;
    int n = q->n_pages - i - 1;
    memmove(q->pg + i, q->pg + i + 1, sizeof(*q->pg) * n);
    memmove(q->ptrs + i, q->ptrs + i + 1, sizeof(*q->ptrs) * n);
    memmove(q->fmts + i, q->fmts + i + 1, sizeof(*q->fmts) * n);
    memmove(q->mass + i, q->mass + i + 1, sizeof(*q->mass) * n);
    memmove(q->pidx + i, q->pidx + i + 1, sizeof(*q->pidx) * n);
    memmove(q->sum_at + i, q->sum_at + i + 1, sizeof(*q->sum_at) * n);
    q->n_pages--;
    q->n_dropped++;
    if (q->seal_from > i) q->seal_from--;
    if (q->sum_from > i) q->sum_from--;
    q->n_cold -= p->tier != KV_TIER_HOT;
    s->st.dropped_seq_pages++;
    kv_page_unref(s, p);
}

int kv_seq_set_policy(kv_store *s, kv_seq *q, const kv_seq_policy *p)
{
    if (!p || (unsigned)p->kind > KV_SEQ_H2O || p->sink_pages < 0 || p->window_pages < 0 ||
        p->budget_pages < 0)
        return KM_EINVAL;
    if (p->kind == KV_SEQ_STREAMING && p->sink_pages + p->window_pages < 1) return KM_EINVAL;
    if (p->kind == KV_SEQ_H2O && p->budget_pages < p->window_pages + 1) return KM_EINVAL;
    q->policy = *p;
    for (int i = 0; i < q->n_pages; i++) q->mass[i] = 0.0f;
    return 0;
}

static int kv_seq_apply_policy(kv_store *s, kv_seq *q)
{
    const kv_seq_policy *po = &q->policy;
    int complete = 0;
    while (complete < q->n_pages && !q->pg[complete]->promoting &&
           atomic_load_explicit(&q->pg[complete]->rows, memory_order_relaxed) >= s->rows_full)
        complete++;
    int dropped = 0;
    if (po->kind == KV_SEQ_STREAMING) {
        int n_drop = complete - po->sink_pages - po->window_pages;
        for (int j = 0; j < n_drop; j++) {
            kv_seq_drop_page(s, q, po->sink_pages);
            dropped++;
        }
    } else if (po->kind == KV_SEQ_H2O) {
        while (complete > po->budget_pages) {
            int lim = complete - po->window_pages, best = -1;
            for (int i = 0; i < lim; i++)
                if (best < 0 || q->mass[i] < q->mass[best]) best = i;
            if (best < 0) break;
            kv_seq_drop_page(s, q, best);
            complete--;
            dropped++;
        }
    }
    return dropped;
}

/* ---------------------------------------------------------------- reserve */

/* The format new pages of a shard are written in (int4 pages are written in f16, then sealed). */
static kv_format kv_write_format(const kv_store *s, int shard)
{
    kv_format f = s->shards[shard].format;
    return f == KN_KV_INT4 ? KN_KV_F16 : f;
}

/* Seals the sequence's complete pages of int4 shards (all but index `keep`). */
static void kv_seq_seal(kv_store *s, kv_seq *q, int keep)
{
    while (q->seal_from < q->n_pages) {
        int i = q->seal_from;
        kv_page *p = q->pg[i];
        if (p->format == KN_KV_INT4 || s->shards[p->shard].format != KN_KV_INT4) {
            q->seal_from++;
            continue;
        }
        if (i == keep || atomic_load_explicit(&p->rows, memory_order_relaxed) < s->rows_full ||
            p->promoting)
            return;
        if (kv_page_seal(s, p)) return;
        if (p->refs > 1)
            kv_refresh_all(s);
        else
            kv_seq_set(q, i, p, 1);
        q->seal_from++;
    }
}

/* Key summaries (kv_config.summaries): every page from sum_from on gets its buffer, and full
 * pages the layers they miss; sum_from moves past the pages that have them all. */
static void kv_seq_sum_catchup(kv_store *s, kv_seq *q)
{
    for (int i = q->sum_from; i < q->n_pages; i++) {
        kv_page *p = q->pg[i];
        if (kv_page_sum_alloc(s, p)) return;
        const int full = (p->flags & KV_PAGE_INDEXED) ||
                         atomic_load_explicit(&p->rows, memory_order_relaxed) >= s->rows_full;
        int all = full && !p->promoting;
        for (int l = 0; all && l < s->n_layers; l++)
            if (!p->sum_ok[l]) kv_page_summarize(s, p, l);
        if (all && i == q->sum_from) q->sum_at[q->sum_from++] = p->sum;
    }
}

void kv_seq_summarize(const kv_store *s, kv_seq *q, int layer, int pos)
{
    const int i = pos / s->pt - q->n_dropped;
    if (i < 0 || i >= q->n_pages || layer < 0 || layer >= s->n_layers) return;
    kv_page_summarize(s, q->pg[i], layer);
}

void kv_seq_summaries(const kv_store *s, const kv_seq *q, int layer, int kv_head, int n_pages,
                      const kn_f16 **out)
{
    const size_t off = kv_sum_off(s->n_heads, s->hd, layer, kv_head);
    const int done = q->sum_from < n_pages ? q->sum_from : n_pages;
    for (int i = 0; i < done; i++) out[i] = q->sum_at[i] + off;
    for (int i = done; i < n_pages; i++) {
        const kv_page *p = i < q->n_pages ? q->pg[i] : NULL;
        out[i] = p && p->sum && p->sum_ok[layer] ? p->sum + off : NULL;
    }
}

/* A private, writable copy of page i (rows before `row` are taken as written). */
static int kv_seq_cow(kv_store *s, kv_seq *q, int i, int row)
{
    kv_page *p = q->pg[i];
    if (!p->buf) return KM_EAGAIN; /* on disk (promote_selected): kv_seq_fetch it first */
    kv_format f = kv_format_row_writable(p->format) ? p->format : KN_KV_F16;
    kv_page *np = kv_page_new(s);
    if (!np) return KM_ENOMEM;
    np->shard = p->shard;
    np->format = f;
    np->tier = KV_TIER_HOT;
    np->refs = 1;
    int rc = kv_hot_alloc(s, np->shard, f, &np->buf);
    if (rc) {
        free(np);
        return rc;
    }
    if (f == p->format)
        memcpy(np->buf, p->buf, s->lay[f].page_bytes);
    else
        kv_page_convert(s, p->buf, p->format, np->buf, f);
    atomic_store_explicit(&np->rows, (uint32_t)row * (uint32_t)s->n_layers, memory_order_relaxed);
    kv_page_unref(s, p);
    kv_seq_set(q, i, np, 1);
    if (q->seal_from > i) q->seal_from = i;
    s->st.cow_copies++;
    return 0;
}

static inline int kv_page_writable(const kv_page *p)
{
    return p->refs == 1 && !(p->flags & KV_PAGE_INDEXED) && kv_format_row_writable(p->format);
}

/* Under the `expert` key a page's expert is known only once its tokens are computed
 * (kv_seq_place moves it then), so a new page waits in the shard with the most hot room that
 * no sequence pins: a hash could send it to a shard the placed pages of running sequences
 * have filled while others are empty. */
static int kv_roomiest_shard(const kv_store *s)
{
    int best = 0;
    size_t best_room = 0;
    for (int i = 0; i < s->n_shards; i++) {
        const kv_tier_acct *a = &s->shards[i].t[KV_TIER_HOT];
        size_t pinned = a->used - a->cached_bytes;
        size_t room = a->budget > pinned ? a->budget - pinned : 0;
        if (!i || room > best_room) best = i, best_room = room;
    }
    return best;
}

int kv_seq_reserve_expert(kv_store *s, kv_seq *q, int n_tokens, int expert)
{
    const int pt = s->pt;
    if (n_tokens <= 0) return n_tokens < 0 ? KM_EINVAL : 0;
    /* Positions [first, n_tokens) may be written after this call: every page holding one of
     * them must be private and writable. */
    const int first = q->reserved < n_tokens - 1 ? q->reserved : n_tokens - 1;
    const int need = (n_tokens + pt - 1) / pt - q->n_dropped;
    const int lo = first / pt - q->n_dropped, last = (n_tokens - 1) / pt - q->n_dropped;
    if (lo < 0) return KM_ERANGE; /* inside a part the lossy policy dropped */
    if (q->seal_from < q->n_pages) kv_seq_seal(s, q, lo);
    if (need <= q->n_pages) {
        int ok = 1;
        for (int i = lo; i <= last && ok; i++) ok = kv_page_writable(q->pg[i]);
        if (ok) { /* the hot path of a running sequence */
            if (s->cfg.summaries) kv_seq_sum_catchup(s, q);
            if (n_tokens > q->reserved) q->reserved = n_tokens;
            return 0;
        }
    }
    kv_promo_reap(s);
    int rc = kv_seq_grow(q, need);
    if (rc) return rc;
    const int old = q->n_pages;
    for (int i = old; i < need; i++) {
        kv_page *p = kv_page_new(s);
        if (!p) {
            rc = KM_ENOMEM;
            break;
        }
        p->shard = expert < 0 && s->groups ? kv_roomiest_shard(s)
                                           : kv_store_shard_of(s, q->uid, i + q->n_dropped, expert);
        p->format = kv_write_format(s, p->shard);
        p->tier = KV_TIER_HOT;
        p->refs = 1;
        if ((rc = kv_hot_alloc(s, p->shard, p->format, &p->buf))) {
            free(p);
            break;
        }
        kv_seq_set(q, i, p, 0);
        q->mass[i] = 0.0f;
        q->pidx[i] = i + q->n_dropped;
        q->n_pages = i + 1;
    }
    for (int i = lo; !rc && i <= last && i < old; i++) {
        if (kv_page_writable(q->pg[i])) continue;
        kv_seq_wait_promo(s, q);
        const int start = q->pidx[i] * pt;
        rc = kv_seq_cow(s, q, i, first > start ? first - start : 0);
    }
    kv_seq_count_cold(q); /* a copy of a host page is hot */
    if (rc) { /* leave the sequence as it was (pages copied so far stay copied: same content) */
        while (q->n_pages > old) {
            q->n_pages--;
            q->fmt_count[q->fmts[q->n_pages]]--;
            kv_page_unref(s, q->pg[q->n_pages]);
        }
        kv_seq_count_cold(q);
        return rc;
    }
    if (n_tokens > q->reserved) q->reserved = n_tokens;
    if (q->policy.kind != KV_SEQ_KEEP_ALL) kv_seq_apply_policy(s, q);
    if (s->cfg.summaries) kv_seq_sum_catchup(s, q);
    for (int i = old; i < q->n_pages; i++) kv_enforce_watermarks(s, q->pg[i]->shard);
    return 0;
}

int kv_seq_place(kv_store *s, kv_seq *q, int pos, int expert)
{
    if (pos < 0 || expert < 0) return KM_EINVAL;
    const int i = pos / s->pt - q->n_dropped;
    if (i < 0 || i >= q->n_pages) return KM_ERANGE;
    kv_page *p = q->pg[i];
    if (!s->groups || p->expert >= 0) return p->shard;
    p->expert = expert;
    s->st.placed_pages++;
    kv_group *g = kv_group_of(s, p);
    g->placed++;
    const int to = kv_store_shard_of(s, q->uid, q->pidx[i], expert), from = p->shard;
    int moved = 0;
    if (to == from) {
        moved = 1;
    } else if (p->refs == 1 && !(p->flags & KV_PAGE_INDEXED) && p->tier == KV_TIER_HOT &&
               !p->promoting && kv_write_format(s, to) == p->format) {
        /* Only accounting moves: page memory belongs to no shard. */
        const kv_tier_acct *a = &s->shards[to].t[KV_TIER_HOT];
        kv_make_room(s, to, KV_TIER_HOT, s->lay[p->format].page_bytes, a->budget);
        if (!kv_acct_add(s, to, KV_TIER_HOT, p->format, 0)) {
            kv_acct_sub(s, from, KV_TIER_HOT, p->format);
            p->shard = to;
            s->shards[to].allocs++;
            moved = 1;
            kv_enforce_watermarks(s, to);
        }
    }
    if (!moved) s->st.place_fallbacks++;
    kv_group_move(s, p, -1, (int)p->tier);
    return p->shard;
}

int kv_seq_reserve(kv_store *s, kv_seq *q, int n_tokens)
{
    return kv_seq_reserve_expert(s, q, n_tokens, -1);
}

void kv_seq_truncate(kv_store *s, kv_seq *q, int n_tokens)
{
    const int pt = s->pt;
    if (n_tokens < 0) n_tokens = 0;
    kv_seq_wait_promo(s, q);
    const int keep_index = (n_tokens + pt - 1) / pt; /* pages with a smaller index stay */
    while (q->n_pages && q->pidx[q->n_pages - 1] >= keep_index) {
        q->n_pages--;
        q->fmt_count[q->fmts[q->n_pages]]--;
        kv_page_unref(s, q->pg[q->n_pages]);
    }
    if (q->seal_from > q->n_pages) q->seal_from = q->n_pages;
    if (q->sum_from > q->n_pages) q->sum_from = q->n_pages;
    if (q->reserved > n_tokens) q->reserved = n_tokens;
    kv_seq_count_cold(q);
    if (q->n_pages && n_tokens % pt && q->pidx[q->n_pages - 1] == keep_index - 1) {
        kv_page *p = q->pg[q->n_pages - 1];
        if (p->refs == 1 && !(p->flags & KV_PAGE_INDEXED) && kv_format_row_writable(p->format))
            atomic_store_explicit(&p->rows, (uint32_t)(n_tokens % pt) * (uint32_t)s->n_layers,
                                  memory_order_relaxed);
    }
    /* Dropped pages past the cut are forgotten: positions map one to one again if none stay. */
    if (q->n_dropped && (!q->n_pages || q->pidx[q->n_pages - 1] == q->n_pages - 1))
        q->n_dropped = 0;
}

/* ---------------------------------------------------------------- publishing */

int kv_seq_publish(kv_store *s, kv_seq *q, const km_pagehash *hashes, const int32_t *tokens,
                   int n_tokens)
{
    return kv_seq_publish_sum(s, q, hashes, tokens, n_tokens, 1);
}

int kv_seq_publish_sum(kv_store *s, kv_seq *q, const km_pagehash *hashes, const int32_t *tokens,
                       int n_tokens, int checksum)
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
            /* under another hash, the pages after it would hang from nothing a lookup finds */
            if (!km_pagehash_eq(p->hash, hashes[i]) || p->index != i) break;
            parent_id = p->id;
            continue;
        }
        kv_page *old = kv_index_find(s, hashes[i]);
        /* An identical page already indexed (or a colliding one) is kept, and publishing stops
         * there: the pages after this one would have no indexed parent. An orphan, whose own
         * parent is gone, is replaced: no lookup could reach it, or what hangs from it. */
        if (old && (!kv_page_orphan(old) || old->index != i || old->refs)) break;
        int32_t *tk = malloc(sizeof(int32_t) * s->pt);
        if (!tk) return added ? added : KM_ENOMEM;
        if (old) kv_page_drop_tree(s, old);
        memcpy(tk, tokens + (size_t)i * s->pt, sizeof(int32_t) * s->pt);
        if (s->shards[p->shard].format == KN_KV_INT4 && p->format != KN_KV_INT4) {
            if (kv_page_seal(s, p) == 0) refresh = 1;
        }
        atomic_store_explicit(&p->rows, s->rows_full, memory_order_relaxed);
        free(p->tokens); /* one unindexed while a sequence held it (kv_page_drop_tree) */
        p->tokens = tk;
        p->hash = hashes[i];
        p->parent = i ? hashes[i - 1] : (km_pagehash){0, 0};
        p->parent_id = parent_id;
        p->index = i;
        if (q->position_free) p->flags |= KV_PAGE_POSFREE;
        kv_index_insert(s, p);
        /* a store a transfer node serves from: the page's checksum now, while it is fresh, not
         * on the owner thread when a peer first asks */
        if (s->arena && checksum) {
            kv_xfer_page d;
            kv_page_xfer_describe(s, p, &d);
        }
        kv_event_emit(s, KV_EVENT_STORED, p, KV_TIER_HOT, KV_TIER_HOT);
        parent_id = p->id;
        added++;
    }
    if (refresh) kv_refresh_all(s);
    return added;
}

/* ---------------------------------------------------------------- hot path */

void kv_seq_write(kv_store *s, kv_seq *q, int layer, int pos, const float *k, const float *v)
{
    const int pt = s->pt, hd = s->hd;
    const int i = pos / pt - q->n_dropped;
    if (i < 0 || i >= q->n_pages || layer < 0 || layer >= s->n_layers) return;
    kv_page *p = q->pg[i];
    assert(pos < q->reserved && p->refs == 1 && !(p->flags & KV_PAGE_INDEXED)); /* reserved */
    for (int h = 0; h < s->n_heads; h++)
        kv_page_write_row(s, p->buf, p->format, layer, h, pos % pt, k + (size_t)h * hd,
                          v + (size_t)h * hd);
    atomic_fetch_add_explicit(&p->rows, 1, memory_order_relaxed);
}

void kv_seq_view(const kv_store *s, const kv_seq *q, int layer, int kv_head, int n_ctx,
                 kn_kv_view *out)
{
    memset(out, 0, sizeof *out);
    /* the promotion copies from layer ready_first up, wrapping round */
    const int want = (layer - q->ready_first + s->n_layers) % s->n_layers;
    if (q->promo_pending &&
        atomic_load_explicit(&((kv_seq *)q)->ready_layers, memory_order_acquire) <= want) {
        kv_store *ms = (kv_store *)s;
        pthread_mutex_lock(&ms->mu);
        while (atomic_load_explicit(&((kv_seq *)q)->ready_layers, memory_order_acquire) <= want)
            pthread_cond_wait(&ms->cv_done, &ms->mu);
        pthread_mutex_unlock(&ms->mu);
    }
    const size_t lh = (size_t)layer * s->n_heads + kv_head;
    const size_t *offs = s->view_offs + lh * KV_FORMAT_COUNT * 4;
    kv_format f = s->cfg.format;
    int single = 1;
    if (q->n_pages) {
        f = (kv_format)q->fmts[0];
        if (q->fmt_count[f] != q->n_pages) {
            single = 0;
            for (int g = KN_KV_FP8; g < KV_FORMAT_COUNT; g++)
                if (q->fmt_count[g]) f = (kv_format)g;
            if (f < KN_KV_FP8) f = KN_KV_FP8; /* f16 + bf16 mixes go to attn_kv too */
        }
    }
    out->pages = q->ptrs;
    out->k_off = offs[4 * f + 0];
    out->v_off = offs[4 * f + 1];
    out->k_scale_off = offs[4 * f + 2];
    out->v_scale_off = offs[4 * f + 3];
    out->page_tokens = s->pt;
    n_ctx -= q->n_dropped * s->pt;
    out->n_ctx = n_ctx < 0 ? 0 : n_ctx;
    out->format = f;
    if (!single) {
        out->page_formats = q->fmts;
        out->fmt_offs = offs;
    }
    if (q->policy.kind == KV_SEQ_H2O) out->attn_mass = q->mass;
}

int kv_seq_read(const kv_store *s, const kv_seq *q, int layer, int kv_head, int pos, float *k,
                float *v)
{
    const int i = pos < 0 ? -1 : kv_seq_find(q, pos / s->pt);
    if (i < 0 || layer < 0 || layer >= s->n_layers || kv_head < 0 || kv_head >= s->n_heads)
        return KM_ERANGE;
    kv_seq_wait_ready(s, q);
    const kv_page *p = q->pg[i];
    if (!p->buf) return KM_EAGAIN; /* on disk (kv_config.promote_selected): kv_seq_fetch it */
    kv_page_read_row(s, p->buf, p->format, layer, kv_head, pos % s->pt, k, v);
    return 0;
}

int kv_seq_layer_ready(const kv_store *s, const kv_seq *q, int layer)
{
    const int want = (layer - q->ready_first + s->n_layers) % s->n_layers;
    return !q->promo_pending ||
           atomic_load_explicit(&((kv_seq *)q)->ready_layers, memory_order_acquire) > want;
}

int kv_seq_cold_pages(const kv_seq *q)
{
    return q->n_cold;
}
