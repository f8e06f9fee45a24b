/*
 * xfer.c — what a transfer layer between stores (peer/) needs from the store, and nothing about
 * networks: exports (the longest verified prefix of a chain pinned for a remote reader under a
 * lease), imports (destination buffers for pages about to arrive, then indexing of the pages the
 * caller verified).
 *
 * Both ends hold their pages in private sequences, so the pages are pinned by the ordinary
 * reference counts and every invariant of the store holds unchanged (kv_store_check included):
 * an export is a sequence attached to the chain (verified by tokens and parent links, host and
 * disk pages promoted); an import is a sequence attached to the part of the chain already held,
 * then reserved past it for the pages that will arrive, then truncated to those that passed and
 * published as if computed here. Both are marked lent (a NIC may be reading or writing their
 * buffers), so recovery level 2 leaves their pages alone. The page checksum is xsum.c's.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kvshard/internal.h"

typedef struct kv_export_rec {
    struct kv_export_rec *next;
    uint64_t id, deadline_ns;
    kv_seq *q;
} kv_export_rec;

typedef struct kv_import_rec {
    struct kv_import_rec *next;
    uint64_t id;
    kv_seq *q;           /* the held prefix (attached), then the reserved pages after it */
    int n_chain, k;      /* chain length asked for; pages held locally at begin */
    km_pagehash *hashes; /* [n_chain] */
    int32_t *tokens;     /* [n_chain * page_tokens] */
    int reserved, n_new, n_usable;
    uint8_t **wire;      /* [n_new] a buffer in the arriving format when it differs, or NULL */
    kv_format *wire_fmt; /* [n_new] */
} kv_import_rec;

typedef struct kv_xfer {
    kv_export_rec *exports;
    kv_import_rec *imports;
    uint64_t next_id;
    int n_exports, n_imports;
} kv_xfer;

static kv_xfer *kv_xfer_get(kv_store *s)
{
    if (!s->xfer) s->xfer = calloc(1, sizeof(kv_xfer));
    return s->xfer;
}

/* ---------------------------------------------------------------- exports */

static kv_export_rec **kv_export_find(kv_store *s, uint64_t id)
{
    if (!s->xfer) return NULL;
    for (kv_export_rec **e = &s->xfer->exports; *e; e = &(*e)->next)
        if ((*e)->id == id) return e;
    return NULL;
}

int kv_export_begin(kv_store *s, const km_pagehash *hashes, const int32_t *tokens, int n_pages,
                    uint64_t lease_deadline_ns, uint64_t *id)
{
    if (!id || n_pages < 0 || (n_pages && (!hashes || !tokens))) return KM_EINVAL;
    *id = 0;
    kv_xfer *x = kv_xfer_get(s);
    kv_export_rec *e = calloc(1, sizeof *e);
    if (!x || !e) {
        free(e);
        return KM_ENOMEM;
    }
    int rc = kv_seq_create(s, &e->q);
    if (!rc) rc = kv_seq_attach_mode(s, e->q, hashes, tokens, n_pages, 0);
    if (rc <= 0) {
        kv_seq_destroy(s, e->q);
        free(e);
        return rc;
    }
    e->q->lent = 1;
    e->id = ++x->next_id;
    e->deadline_ns = lease_deadline_ns;
    e->next = x->exports;
    x->exports = e;
    x->n_exports++;
    *id = e->id;
    return rc;
}

int kv_export_pages(kv_store *s, uint64_t id, int first, int n, kv_xfer_page *out)
{
    kv_export_rec **ep = kv_export_find(s, id);
    if (!ep) return KM_ENOTFOUND;
    kv_seq *q = (*ep)->q;
    if (first < 0 || n < 0 || first > q->n_pages - n) return KM_ERANGE;
    if (q->promo_pending) {
        if (atomic_load_explicit(&q->ready_layers, memory_order_acquire) < s->n_layers)
            return KM_EAGAIN;
        kv_seq_wait_promo(s, q); /* copied already: only reaps the job */
    }
    for (int i = 0; i < n; i++) kv_page_xfer_describe(s, q->pg[first + i], &out[i]);
    return 0;
}

static void kv_export_drop(kv_store *s, kv_export_rec **ep)
{
    kv_export_rec *e = *ep;
    *ep = e->next;
    s->xfer->n_exports--;
    kv_seq_destroy(s, e->q);
    free(e);
}

int kv_export_end(kv_store *s, uint64_t id)
{
    kv_export_rec **ep = kv_export_find(s, id);
    if (!ep) return KM_ENOTFOUND;
    kv_export_drop(s, ep);
    return 0;
}

int kv_export_expire(kv_store *s, uint64_t now_ns)
{
    if (!s->xfer) return 0;
    int n = 0;
    kv_export_rec **ep = &s->xfer->exports;
    while (*ep) {
        if ((*ep)->deadline_ns && (*ep)->deadline_ns <= now_ns) {
            kv_export_drop(s, ep);
            n++;
        } else {
            ep = &(*ep)->next;
        }
    }
    return n;
}

void kv_xfer_counts(const kv_store *s, int *exports, int *imports)
{
    if (exports) *exports = s->xfer ? s->xfer->n_exports : 0;
    if (imports) *imports = s->xfer ? s->xfer->n_imports : 0;
}

/* ---------------------------------------------------------------- imports */

static kv_import_rec **kv_import_find(kv_store *s, uint64_t id)
{
    if (!s->xfer) return NULL;
    for (kv_import_rec **r = &s->xfer->imports; *r; r = &(*r)->next)
        if ((*r)->id == id) return r;
    return NULL;
}

/* Unlinks the import and gives back its buffers, its sequence (pages indexed by then become
 * cached, the rest are freed) and its copies. */
static void kv_import_release(kv_store *s, kv_import_rec **rp)
{
    kv_import_rec *r = *rp;
    *rp = r->next;
    for (int i = 0; i < r->n_new; i++)
        if (r->wire[i]) kv_buf_put(s, r->wire[i], r->wire_fmt[i]);
    kv_seq_destroy(s, r->q);
    s->xfer->n_imports--;
    free(r->wire);
    free(r->wire_fmt);
    free(r->hashes);
    free(r->tokens);
    free(r);
}

int kv_import_begin(kv_store *s, const km_pagehash *hashes, const int32_t *tokens, int n_pages,
                    uint64_t *id)
{
    if (!id || n_pages < 0 || (n_pages && (!hashes || !tokens))) return KM_EINVAL;
    *id = 0;
    kv_xfer *x = kv_xfer_get(s);
    const size_t nt = (size_t)n_pages * s->pt;
    kv_import_rec *r = calloc(1, sizeof *r);
    if (r) {
        r->hashes = malloc(sizeof(km_pagehash) * (n_pages ? n_pages : 1));
        r->tokens = malloc(sizeof(int32_t) * (nt ? nt : 1));
    }
    int rc = !x || !r || !r->hashes || !r->tokens ? KM_ENOMEM : kv_seq_create(s, &r->q);
    /* The held prefix is attached like a request's (pinned, promoted): the pulled pages hang
     * from it. It is not a request's hit or miss, so those counters are left as they were. */
    if (!rc) {
        uint64_t hits = s->st.hits, misses = s->st.misses;
        rc = kv_seq_attach_mode(s, r->q, hashes, tokens, n_pages, 0);
        s->st.hits = hits;
        s->st.misses = misses;
    }
    if (rc < 0 || rc == n_pages) {
        if (r) {
            if (r->q) kv_seq_destroy(s, r->q);
            free(r->hashes);
            free(r->tokens);
        }
        free(r);
        return rc;
    }
    memcpy(r->hashes, hashes, sizeof(km_pagehash) * n_pages);
    memcpy(r->tokens, tokens, sizeof(int32_t) * nt);
    r->n_chain = n_pages;
    r->k = rc;
    r->q->lent = 1;
    r->id = ++x->next_id;
    r->next = x->imports;
    x->imports = r;
    x->n_imports++;
    *id = r->id;
    return rc;
}

int kv_import_reserve(kv_store *s, uint64_t id, int n, const kv_format *wire, kv_xfer_page *out)
{
    kv_import_rec **rp = kv_import_find(s, id);
    if (!rp) return KM_ENOTFOUND;
    kv_import_rec *r = *rp;
    if (r->reserved || n < 0 || n > r->n_chain - r->k || (n && (!wire || !out))) return KM_EINVAL;
    for (int i = 0; i < n; i++)
        if (!kv_format_valid(wire[i]) || !s->lay[wire[i]].unit) return KM_EUNSUPPORTED;
    r->reserved = 1;
    r->wire = calloc((size_t)(n ? n : 1), sizeof(uint8_t *));
    r->wire_fmt = calloc((size_t)(n ? n : 1), sizeof(kv_format));
    if (!r->wire || !r->wire_fmt) return KM_ENOMEM;
    /* As many pages as the hot tier can make room for: all, else halves. */
    int m = n, rc = 0;
    /* Every buffer taken here is overwritten whole (a page's by the transfer or, when it
     * arrives in another format, by the conversion at commit; a demoted page's by its copy)
     * before it is read, and one that is not is never indexed: no zeroing first. */
    s->buf_whole = 1;
    while (m > 0 && (rc = kv_seq_reserve(s, r->q, (r->k + m) * s->pt))) m /= 2;
    if (!m) {
        s->buf_whole = 0;
        return rc ? rc : 0;
    }
    kv_seq *q = r->q;
    int sealed = 0;
    for (int i = 0; i < m; i++) {
        kv_page *p = q->pg[r->k + i];
        /* The page arrives whole: an int4 shard takes it as int4 at once, no sealing later
         * (nothing to convert: the reserved page holds nothing yet). */
        if (s->shards[p->shard].format == KN_KV_INT4 && p->format != KN_KV_INT4 &&
            !kv_page_seal_as(s, p, 0))
            sealed = 1;
        atomic_store_explicit(&p->rows, s->rows_full, memory_order_relaxed);
    }
    if (sealed) kv_seq_refresh(s, q);
    q->seal_from = q->n_pages;
    for (int i = 0; i < m; i++) {
        kv_page *p = q->pg[r->k + i];
        const int idx = r->k + i;
        uint8_t *dst = p->buf;
        r->wire_fmt[i] = wire[i];
        r->n_new = i + 1;
        if (wire[i] != p->format) { /* arrives in another format: converted at commit */
            if (!(r->wire[i] = kv_buf_get(s, wire[i]))) {
                m = i;
                break;
            }
            dst = r->wire[i];
        }
        out[i] = (kv_xfer_page){
            .format = wire[i],
            .index = idx,
            .hash = r->hashes[idx],
            .parent = idx ? r->hashes[idx - 1] : (km_pagehash){0, 0},
            .tokens = r->tokens + (size_t)idx * s->pt,
            .buf = dst,
            .bytes = s->lay[wire[i]].page_bytes,
            .region = kv_arena_region_of(s, dst),
        };
    }
    s->buf_whole = 0;
    r->n_usable = m;
    return m ? m : KM_ENOMEM;
}

int kv_import_commit(kv_store *s, uint64_t id, int n_ok)
{
    kv_import_rec **rp = kv_import_find(s, id);
    if (!rp) return KM_ENOTFOUND;
    kv_import_rec *r = *rp;
    if (n_ok > r->n_usable) n_ok = r->n_usable;
    if (n_ok < 0) n_ok = 0;
    for (int i = 0; i < n_ok; i++)
        if (r->wire[i]) {
            kv_page *p = r->q->pg[r->k + i];
            kv_page_convert(s, r->wire[i], r->wire_fmt[i], p->buf, p->format);
        }
    for (int i = 0; i < n_ok; i++) kv_page_sum_clear(s, r->q->pg[r->k + i]); /* recomputed */
    if (r->q->sum_from > r->k) r->q->sum_from = r->k;
    kv_seq_truncate(s, r->q, (r->k + n_ok) * s->pt);
    int added = kv_seq_publish_sum(s, r->q, r->hashes, r->tokens, (r->k + n_ok) * s->pt, 0);
    kv_import_release(s, rp);
    return added < 0 ? 0 : added;
}

int kv_import_set_position_free(kv_store *s, uint64_t id)
{
    kv_import_rec **pp = kv_import_find(s, id);
    if (!pp) return KM_ENOTFOUND;
    kv_seq_set_position_free((*pp)->q, 1);
    return 0;
}

void kv_import_abort(kv_store *s, uint64_t id)
{
    kv_import_rec **rp = kv_import_find(s, id);
    if (rp) kv_import_release(s, rp);
}

void kv_xfer_free(kv_store *s)
{
    if (!s->xfer) return;
    while (s->xfer->imports) kv_import_release(s, &s->xfer->imports);
    while (s->xfer->exports) kv_export_drop(s, &s->xfer->exports);
    free(s->xfer);
    s->xfer = NULL;
}

/* ---------------------------------------------------------------- handoff */

static int kv_cmp_recent(const void *a, const void *b)
{
    const kv_page *x = *(kv_page *const *)a, *y = *(kv_page *const *)b;
    if (x->last_use != y->last_use) return x->last_use > y->last_use ? -1 : 1;
    return (x->index < y->index) - (x->index > y->index); /* longer first */
}

int kv_store_chains(kv_store *s, int max_pages, kv_chain_fn fn, void *arg)
{
    size_t n = 0;
    kv_page **leaves = malloc(sizeof *leaves * (s->n_indexed ? s->n_indexed : 1));
    km_pagehash *hs = NULL;
    int32_t *toks = NULL;
    kv_page **up = NULL;
    int given = 0, pages = 0, cap = 0;
    if (!leaves) return KM_ENOMEM;
    /* a page some other page follows is not a leaf: mark parents, then take the rest */
    for (size_t b = 0; b < s->n_buckets; b++)
        for (kv_page *p = s->buckets[b]; p; p = p->hnext) {
            kv_page *par = p->index > 0 ? kv_index_find(s, p->parent) : NULL;
            if (par) par->flags |= KV_PAGE_MARK;
        }
    for (size_t b = 0; b < s->n_buckets; b++)
        for (kv_page *p = s->buckets[b]; p; p = p->hnext) {
            if (!(p->flags & KV_PAGE_MARK) && p->buf && p->tier != KV_TIER_DISK) leaves[n++] = p;
            p->flags &= ~KV_PAGE_MARK;
        }
    qsort(leaves, n, sizeof *leaves, kv_cmp_recent);
    for (size_t i = 0; i < n && pages < max_pages; i++) {
        int len = leaves[i]->index + 1;
        if (len > cap) {
            cap = len;
            free(hs), free(toks), free(up);
            hs = malloc(sizeof *hs * (size_t)cap);
            toks = malloc(sizeof *toks * (size_t)cap * (size_t)s->pt);
            up = malloc(sizeof *up * (size_t)cap);
            if (!hs || !toks || !up) {
                given = KM_ENOMEM;
                break;
            }
        }
        /* leaf to root by parent hashes, each link as the index would verify it */
        kv_page *p = leaves[i];
        int k = len - 1;
        for (; k >= 0 && p && p->index == k; k--) {
            up[k] = p;
            p = k > 0 ? kv_index_find(s, p->parent) : NULL;
        }
        if (k >= 0) continue; /* broken: a page of it was evicted */
        int fresh = 0;
        for (int j = 0; j < len; j++) {
            hs[j] = up[j]->hash;
            memcpy(toks + (size_t)j * s->pt, up[j]->tokens, sizeof *toks * (size_t)s->pt);
            fresh += !(up[j]->flags & KV_PAGE_MARK); /* shared prefixes count once */
            up[j]->flags |= KV_PAGE_MARK;
        }
        pages += fresh;
        given++;
        if (fn(arg, hs, toks, len)) break;
    }
    for (size_t b = 0; b < s->n_buckets; b++)
        for (kv_page *p = s->buckets[b]; p; p = p->hnext) p->flags &= ~KV_PAGE_MARK;
    free(leaves), free(hs), free(toks), free(up);
    return given;
}
