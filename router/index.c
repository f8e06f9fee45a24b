/*
 * index.c — the router's global prefix index: page hash -> the workers holding that page, per
 * tier (router.h, "prefix index").
 *
 * Why it is built this way:
 *  - Page hashes are already uniform 128-bit values, so the table is open addressing with linear
 *    probing on the low bits, no second hash. Deletion shifts the following entries back
 *    (no tombstones), so lookups stay short however long the router runs.
 *  - A page's holders are bit masks, one per tier (plus one for pending marks): with at most
 *    RT_MAX_WORKERS workers, matching a prompt's chain against every worker at once is a few
 *    AND operations per page, and the walk stops as soon as no worker still matches.
 *  - Memory is fixed at creation (max_pages): a router must not grow without bound because a
 *    worker publishes a lot; stores into a full table are dropped and counted (a dropped page
 *    costs a routing opportunity, never correctness).
 *  - Forgetting a worker or sweeping expired pending marks is a full scan followed by a rebuild
 *    of the table; both are rare (a failed catch-up, a timer every few seconds when the table is
 *    filling up).
 */
#include <stdlib.h>
#include <string.h>

#include "router/route.h"

typedef struct rt_entry {
    km_pagehash key;
    uint64_t tier[KM_TIER_COUNT]; /* holders per tier */
    uint64_t pending;             /* routed there, not yet confirmed by an event */
    uint64_t pending_ms;          /* time of the last pending mark */
} rt_entry;

struct rt_index {
    rt_entry *tab;
    size_t cap, mask, n, max;
    uint32_t ttl_ms;
    uint64_t dropped;
    uint64_t count[RT_MAX_WORKERS][KM_TIER_COUNT];
};

static bool used(const rt_entry *e)
{
    return (e->tier[0] | e->tier[1] | e->tier[2] | e->pending) != 0;
}

int rt_index_create(size_t max_pages, uint32_t pending_ttl_ms, rt_index **out)
{
    *out = NULL;
    if (max_pages < 16 || max_pages > ((size_t)1 << 28)) return KM_EINVAL;
    rt_index *x = calloc(1, sizeof *x);
    if (!x) return KM_ENOMEM;
    size_t cap = 16;
    while (cap < max_pages + max_pages / 3) cap *= 2;
    x->tab = calloc(cap, sizeof *x->tab);
    if (!x->tab) {
        free(x);
        return KM_ENOMEM;
    }
    x->cap = cap;
    x->mask = cap - 1;
    x->max = max_pages;
    x->ttl_ms = pending_ttl_ms;
    *out = x;
    return 0;
}

void rt_index_destroy(rt_index *x)
{
    if (!x) return;
    free(x->tab);
    free(x);
}

static rt_entry *find(const rt_index *x, km_pagehash h)
{
    for (size_t i = h.lo & x->mask;; i = (i + 1) & x->mask) {
        rt_entry *e = &x->tab[i];
        if (!used(e)) return NULL;
        if (km_pagehash_eq(e->key, h)) return e;
    }
}

/* The slot of h, or an empty slot for it; NULL when the table is at max. */
static rt_entry *find_or_add(rt_index *x, km_pagehash h)
{
    size_t i = h.lo & x->mask;
    for (;; i = (i + 1) & x->mask) {
        rt_entry *e = &x->tab[i];
        if (!used(e)) break;
        if (km_pagehash_eq(e->key, h)) return e;
    }
    if (x->n >= x->max) return NULL;
    rt_entry *e = &x->tab[i];
    memset(e, 0, sizeof *e);
    e->key = h;
    x->n++;
    return e;
}

/* Backward-shift deletion of the (now unused) entry at e. */
static void remove_entry(rt_index *x, rt_entry *e)
{
    size_t i = (size_t)(e - x->tab), j = i;
    for (;;) {
        j = (j + 1) & x->mask;
        rt_entry *ej = &x->tab[j];
        if (!used(ej)) break;
        size_t k = ej->key.lo & x->mask; /* home slot of ej */
        /* ej may move to i when its home is not in the cyclic range (i, j]. */
        bool stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (stays) continue;
        x->tab[i] = *ej;
        i = j;
    }
    memset(&x->tab[i], 0, sizeof x->tab[i]);
    x->n--;
}

/* Clears worker bits w_mask from e (counting), deleting e when nothing is left. */
static void clear_bits(rt_index *x, rt_entry *e, int w)
{
    uint64_t bit = 1ull << w;
    for (int t = 0; t < KM_TIER_COUNT; t++)
        if (e->tier[t] & bit) {
            e->tier[t] &= ~bit;
            x->count[w][t]--;
        }
    e->pending &= ~bit;
    if (!used(e)) remove_entry(x, e);
}

int rt_index_apply(rt_index *x, int w, km_kv_event_kind kind, km_tier tier, km_tier from_tier,
                   const km_pagehash *hashes, int n)
{
    if (!x || w < 0 || w >= RT_MAX_WORKERS || n < 0 || (n && !hashes)) return KM_EINVAL;
    if ((unsigned)tier >= KM_TIER_COUNT || (unsigned)from_tier >= KM_TIER_COUNT) return KM_EINVAL;
    uint64_t bit = 1ull << w;
    int lost = 0;
    (void)from_tier; /* a move is a store in `tier` wherever the page was before */
    for (int i = 0; i < n; i++) {
        if (kind == KM_KV_REMOVED) {
            rt_entry *e = find(x, hashes[i]);
            if (e) clear_bits(x, e, w);
            continue;
        }
        if (kind != KM_KV_STORED && kind != KM_KV_TIER) return KM_EINVAL;
        rt_entry *e = find_or_add(x, hashes[i]);
        if (!e) {
            lost++;
            continue;
        }
        for (int t = 0; t < KM_TIER_COUNT; t++)
            if ((e->tier[t] & bit) && t != (int)tier) {
                e->tier[t] &= ~bit;
                x->count[w][t]--;
            }
        if (!(e->tier[tier] & bit)) {
            e->tier[tier] |= bit;
            x->count[w][tier]++;
        }
        e->pending &= ~bit;
    }
    x->dropped += (uint64_t)lost;
    return lost;
}

void rt_index_mark_pending(rt_index *x, int w, const km_pagehash *chain, int n, uint64_t now_ms)
{
    if (!x || w < 0 || w >= RT_MAX_WORKERS) return;
    uint64_t bit = 1ull << w;
    for (int i = 0; i < n; i++) {
        rt_entry *e = find_or_add(x, chain[i]);
        if (!e) {
            x->dropped++;
            return;
        }
        bool held = (e->tier[0] | e->tier[1] | e->tier[2]) & bit;
        if (held) continue;
        e->pending |= bit;
        e->pending_ms = now_ms;
    }
}

/* Re-inserts every used entry into a fresh table (after bits were cleared in place). */
static void rebuild(rt_index *x)
{
    rt_entry *old = x->tab;
    rt_entry *fresh = calloc(x->cap, sizeof *fresh);
    if (!fresh) {
        /* Out of memory: forget everything (costs cache misses, never a wrong answer). */
        memset(x->tab, 0, x->cap * sizeof *x->tab);
        memset(x->count, 0, sizeof x->count);
        x->n = 0;
        return;
    }
    size_t n = 0;
    for (size_t i = 0; i < x->cap; i++) {
        if (!used(&old[i])) continue;
        size_t j = old[i].key.lo & x->mask;
        while (used(&fresh[j])) j = (j + 1) & x->mask;
        fresh[j] = old[i];
        n++;
    }
    x->tab = fresh;
    x->n = n;
    free(old);
}

void rt_index_forget_worker(rt_index *x, int w)
{
    if (!x || w < 0 || w >= RT_MAX_WORKERS) return;
    uint64_t keep = ~(1ull << w);
    for (size_t i = 0; i < x->cap; i++) {
        rt_entry *e = &x->tab[i];
        for (int t = 0; t < KM_TIER_COUNT; t++) e->tier[t] &= keep;
        e->pending &= keep;
    }
    for (int t = 0; t < KM_TIER_COUNT; t++) x->count[w][t] = 0;
    rebuild(x);
}

void rt_index_sweep(rt_index *x, uint64_t now_ms)
{
    if (!x) return;
    bool emptied = false;
    for (size_t i = 0; i < x->cap; i++) {
        rt_entry *e = &x->tab[i];
        if (e->pending && now_ms - e->pending_ms > x->ttl_ms) {
            e->pending = 0;
            if (!used(e)) emptied = true;
        }
    }
    if (emptied) rebuild(x);
}

void rt_index_match(const rt_index *x, const km_pagehash *chain, int n, uint64_t workers,
                    const double tier_credit[KM_TIER_COUNT], int page_tokens, uint64_t now_ms,
                    rt_match *out)
{
    memset(out, 0, sizeof *out);
    if (!x || n <= 0) return;
    uint64_t alive = workers, stored = workers;
    for (int i = 0; i < n && alive; i++) {
        const rt_entry *e = find(x, chain[i]);
        if (!e) break;
        uint64_t fresh = (now_ms - e->pending_ms <= x->ttl_ms) ? e->pending : 0;
        uint64_t any = e->tier[0] | e->tier[1] | e->tier[2] | fresh;
        alive &= any;
        stored &= e->tier[0] | e->tier[1] | e->tier[2];
        for (uint64_t m = stored; m; m &= m - 1) out->stored[__builtin_ctzll(m)]++;
        for (uint64_t m = alive; m; m &= m - 1) {
            int w = __builtin_ctzll(m);
            uint64_t bit = 1ull << w;
            double c = 1.0;
            if (e->tier[0] & bit)
                c = tier_credit[0];
            else if (e->tier[1] & bit)
                c = tier_credit[1];
            else if (e->tier[2] & bit)
                c = tier_credit[2];
            out->pages[w]++;
            out->credit[w] += c * page_tokens;
        }
    }
}

uint64_t rt_index_pages(const rt_index *x, int w, km_tier tier)
{
    if (!x || w < 0 || w >= RT_MAX_WORKERS || (unsigned)tier >= KM_TIER_COUNT) return 0;
    return x->count[w][tier];
}

size_t rt_index_size(const rt_index *x)
{
    return x ? x->n : 0;
}

uint64_t rt_index_dropped(const rt_index *x)
{
    return x ? x->dropped : 0;
}
