/*
 * index.c — the prefix index: page hash -> page, with every hit verified.
 *
 * A hash only nominates a page. A page is reused only when (1) its stored token ids equal the
 * request's tokens for that page and (2) it was published right after the page the lookup
 * accepted one step earlier (parent_id), so by induction every token of the prefix has been
 * compared and a forged or accidental hash collision can at worst shorten a hit, never serve
 * KV computed for other tokens. Publishing a sequence's pages is seq.c's; attaching a hit to a
 * new sequence (promoting it from host or disk) is tier.c's. This file calls nothing else.
 *
 * The index also links each page to the indexed parent a lookup would reach it through (up,
 * and per-tier child counts), so eviction can take chains from their tails and never leave a
 * page that no lookup can reach (docs/kvshard.md, "Eviction").
 */
#include <assert.h>
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

kv_page *kv_index_parent(const kv_store *s, const kv_page *p)
{
    if (p->index <= 0) return NULL;
    kv_page *par = kv_index_find(s, p->parent);
    return par && par->id == p->parent_id && par->index == p->index - 1 ? par : NULL;
}

/* Hangs the indexed page p under its parent, when that is indexed. */
static void kv_index_link(kv_store *s, kv_page *p)
{
    kv_page *up = kv_index_parent(s, p);
    p->up = up;
    if (!up) return;
    up->kids[p->tier]++;
    p->sib_prev = NULL;
    p->sib_next = up->kid;
    if (up->kid) up->kid->sib_prev = p;
    up->kid = p;
}

int kv_index_insert(kv_store *s, kv_page *p)
{
    assert(!(p->flags & KV_PAGE_INDEXED) && p->tokens); /* indexed once, with its token ids */
    if (s->n_indexed >= s->n_buckets) kv_index_grow(s);
    size_t k = kv_bucket(s, p->hash);
    p->hnext = s->buckets[k];
    s->buckets[k] = p;
    p->flags |= KV_PAGE_INDEXED;
    s->n_indexed++;
    kv_index_link(s, p);
    return 0;
}

void kv_index_retier(kv_store *s, kv_page *p, kv_tier from)
{
    (void)s;
    if (!p->up || from == p->tier) return;
    assert(p->up->kids[from] > 0); /* counted where it was */
    p->up->kids[from]--;
    p->up->kids[p->tier]++;
}

void kv_index_relink(kv_store *s)
{
    for (size_t b = 0; b < s->n_buckets; b++)
        for (kv_page *p = s->buckets[b]; p; p = p->hnext) {
            p->up = p->kid = p->sib_prev = p->sib_next = NULL;
            memset(p->kids, 0, sizeof p->kids);
        }
    for (size_t b = 0; b < s->n_buckets; b++)
        for (kv_page *p = s->buckets[b]; p; p = p->hnext) kv_index_link(s, p);
}

void kv_index_remove(kv_store *s, kv_page *p)
{
    assert(p->flags & KV_PAGE_INDEXED);
    assert(!kv_page_kids(p, KV_TIER_DISK)); /* a parent goes after its children */
    if (p->up) {
        assert(p->up->kids[p->tier] > 0);
        p->up->kids[p->tier]--;
        if (p->sib_prev)
            p->sib_prev->sib_next = p->sib_next;
        else
            p->up->kid = p->sib_next;
        if (p->sib_next) p->sib_next->sib_prev = p->sib_prev;
        p->up = p->sib_prev = p->sib_next = NULL;
    }
    kv_page **pp = &s->buckets[kv_bucket(s, p->hash)];
    while (*pp && *pp != p) pp = &(*pp)->hnext;
    assert(*pp == p && s->n_indexed > 0); /* an indexed page is in its bucket */
    if (*pp) {
        *pp = p->hnext;
        s->n_indexed--;
    }
    p->flags &= ~(KV_PAGE_INDEXED | KV_PAGE_POSFREE);
    p->hnext = NULL;
}

int kv_store_position_free(const kv_store *s, km_pagehash h)
{
    const kv_page *p = kv_index_find(s, h);
    return p && (p->flags & KV_PAGE_POSFREE) ? 1 : 0;
}

/* The page that may serve chain link i, or NULL: hash, tokens and parent all agree. */
kv_page *kv_index_verified(kv_store *s, km_pagehash h, const int32_t *tokens, uint64_t parent_id)
{
    kv_page *p = kv_index_find(s, h);
    if (!p || (p->flags & KV_PAGE_BAD)) return NULL;
    if (memcmp(p->tokens, tokens, sizeof(int32_t) * s->pt) || p->parent_id != parent_id) {
        s->st.collisions++;
        return NULL;
    }
    return p;
}

int kv_store_held(kv_store *s, const km_pagehash *hashes, const int32_t *tokens, int n_pages,
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
    return i;
}

int kv_store_lookup(kv_store *s, const km_pagehash *hashes, const int32_t *tokens, int n_pages,
                    kv_tier *tiers)
{
    int i = kv_store_held(s, hashes, tokens, n_pages, tiers);
    if (i > 0)
        s->st.hits++;
    else if (!i)
        s->st.misses++;
    return i;
}
