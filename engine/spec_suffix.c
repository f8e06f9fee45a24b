/*
 * spec_suffix.c — the suffix index that proposes draft tokens (en_suffix_*, spec.h).
 *
 * SuffixDecoding (arXiv 2411.04975) keeps suffix trees over earlier outputs and over each
 * request's own text, finds the longest suffix of the recent tokens in them and proposes the
 * most frequent continuation. This file gives the same answers with a structure whose memory is
 * a fixed 13 bytes or so per token and whose eviction is a ring's:
 *
 *   tok[cap]    the text, a ring of token ids; a document ends with a separator (-1), which no
 *               context token equals, so matches never cross documents
 *   link[cap]   for each position, the distance back to the previous position whose last
 *               min_match tokens hash to the same bucket (0: none) — zlib's hash chains
 *   head[nb]    per bucket, the most recent such position + 1
 *   doc[dcap]   the documents, oldest first: where each starts and its tenant key
 *
 * A lookup hashes the context's last min_match tokens, walks the chain most recent first (at
 * most max_chain positions; positions older than the ring's tail end the chain, which is what
 * makes eviction free), keeps the candidates that match and belong to the caller's tenant,
 * measures each match backwards up to max_match tokens, and votes the continuation among the
 * longest ones — the tree walk of SuffixDecoding, with counts taken from the occurrences.
 *
 * Positions are absolute (64-bit, never reused); a position p lives at p % cap while
 * tail <= p < end. Oldest-first eviction advances tail by whole documents. The tenant key is in
 * the hash (other tenants' text lands in other buckets) and is checked against the document of
 * every candidate (a bucket collision can never leak another tenant's tokens).
 */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "engine/spec.h"

#define EN_SEP (-1)

typedef struct en_sdoc {
    uint64_t start; /* absolute position of its first token */
    km_pagehash tenant;
} en_sdoc;

struct en_suffix {
    en_suffix_opts o;
    int64_t cap;            /* tokens the ring holds */
    uint64_t nb;            /* buckets, a power of two */
    int dcap;               /* document records */
    uint64_t tail, end;     /* valid positions [tail, end) */
    uint64_t d_tail, d_end; /* documents [d_tail, d_end), d_end - 1 open when `open` */
    int open;
    int32_t *tok;
    uint32_t *link;
    uint64_t *head;
    en_sdoc *doc;
    size_t bytes;
    uint64_t tokens_added, docs_added, docs_evicted;
};

/* Bytes per token of ring capacity: token, link, half a bucket head, 1/16 of a document. */
#define EN_SFX_PER_TOKEN (4 + 4 + 4 + 2)

size_t en_suffix_bytes_for(int n_tokens)
{
    if (n_tokens < 64) n_tokens = 64;
    return sizeof(en_suffix) + (size_t)(n_tokens + 8) * EN_SFX_PER_TOKEN + 4 * sizeof(en_sdoc) + 64;
}

int en_suffix_create(const en_suffix_opts *opts, en_suffix **out)
{
    *out = NULL;
    if (!opts || opts->bytes < 1024) return KM_EINVAL;
    en_suffix_opts o = *opts;
    if (o.min_match <= 0) o.min_match = 2;
    if (o.min_match > 64) o.min_match = 64;
    if (o.max_match <= 0) o.max_match = 64;
    if (o.max_match < o.min_match) o.max_match = o.min_match;
    if (o.max_chain <= 0) o.max_chain = 32;
    if (o.max_chain > 256) o.max_chain = 256;
    en_suffix *x = calloc(1, sizeof *x);
    if (!x) return KM_ENOMEM;
    x->o = o;
    size_t room = o.bytes - sizeof *x;
    int64_t cap = (int64_t)(room / EN_SFX_PER_TOKEN);
    if (cap > INT32_MAX / 2) cap = INT32_MAX / 2;
    /* Buckets: a power of two no more than half the capacity; documents: 1/16 of it. */
    uint64_t nb = 16;
    while (nb * 2 <= (uint64_t)cap / 2) nb *= 2;
    int dcap = (int)(cap / 16) < 4 ? 4 : (int)(cap / 16);
    for (;;) {
        size_t need = (size_t)cap * 8 + nb * 8 + (size_t)dcap * sizeof(en_sdoc);
        if (need <= room) break;
        cap -= cap / 16 + 1;
        if (nb > 16 && nb * 2 > (uint64_t)cap) nb /= 2;
        if (dcap > 4 && dcap > cap / 16) dcap = (int)(cap / 16) < 4 ? 4 : (int)(cap / 16);
    }
    x->cap = cap;
    x->nb = nb;
    x->dcap = dcap;
    x->tok = malloc(sizeof *x->tok * cap);
    x->link = calloc(cap, sizeof *x->link);
    x->head = calloc(nb, sizeof *x->head);
    x->doc = calloc(dcap, sizeof *x->doc);
    if (!x->tok || !x->link || !x->head || !x->doc) {
        en_suffix_destroy(x);
        return KM_ENOMEM;
    }
    x->bytes = sizeof *x + (size_t)cap * 8 + nb * 8 + (size_t)dcap * sizeof(en_sdoc);
    assert(x->bytes <= o.bytes);
    *out = x;
    return 0;
}

void en_suffix_destroy(en_suffix *x)
{
    if (!x) return;
    free(x->tok);
    free(x->link);
    free(x->head);
    free(x->doc);
    free(x);
}

void en_suffix_stats_get(const en_suffix *x, en_suffix_stats *out)
{
    *out = (en_suffix_stats){.tokens_added = x->tokens_added,
                             .docs_added = x->docs_added,
                             .docs_evicted = x->docs_evicted,
                             .tokens_held = (int64_t)(x->end - x->tail),
                             .capacity = x->cap,
                             .bytes = x->bytes};
}

static inline int32_t en_sfx_at(const en_suffix *x, uint64_t p)
{
    return x->tok[p % (uint64_t)x->cap];
}

static uint64_t en_sfx_hash(km_pagehash tenant, const int32_t *t, int n)
{
    uint64_t h = tenant.lo ^ (tenant.hi * 0x9e3779b97f4a7c15ull);
    for (int i = 0; i < n; i++) {
        h = (h ^ (uint32_t)t[i]) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
    }
    h *= 0xc4ceb9fe1a85ec53ull;
    return h ^ (h >> 29);
}

static inline en_sdoc *en_sfx_doc(const en_suffix *x, uint64_t d)
{
    return &x->doc[d % (uint64_t)x->dcap];
}

/* Drops the oldest document (all of it, separator included). */
static void en_sfx_evict_doc(en_suffix *x)
{
    assert(x->d_tail < x->d_end);
    x->d_tail++;
    x->docs_evicted++;
    x->tail = x->d_tail < x->d_end ? en_sfx_doc(x, x->d_tail)->start : x->end;
    if (x->d_tail == x->d_end) x->open = 0;
}

/* Room for one more token: evicts oldest documents, or the open document's oldest tokens when it
 * is the only one left. */
static void en_sfx_make_room(en_suffix *x)
{
    while ((int64_t)(x->end - x->tail) >= x->cap) {
        if (x->d_end - x->d_tail > 1 || !x->open) {
            en_sfx_evict_doc(x);
        } else {
            x->tail++;
            en_sfx_doc(x, x->d_tail)->start = x->tail;
        }
    }
}

static void en_sfx_put(en_suffix *x, int32_t t)
{
    en_sfx_make_room(x);
    x->tok[x->end % (uint64_t)x->cap] = t;
    x->link[x->end % (uint64_t)x->cap] = 0;
    x->end++;
}

void en_suffix_close(en_suffix *x)
{
    if (!x->open) return;
    en_sfx_put(x, EN_SEP);
    x->open = 0;
}

static void en_sfx_open(en_suffix *x, km_pagehash tenant)
{
    if (x->open && km_pagehash_eq(en_sfx_doc(x, x->d_end - 1)->tenant, tenant)) return;
    en_suffix_close(x);
    if (x->d_end - x->d_tail >= (uint64_t)x->dcap) en_sfx_evict_doc(x);
    /* A separator written by close may have evicted documents: the new one starts at end. */
    *en_sfx_doc(x, x->d_end) = (en_sdoc){.start = x->end, .tenant = tenant};
    x->d_end++;
    if (x->d_end - x->d_tail == 1) x->tail = x->end;
    x->open = 1;
    x->docs_added++;
}

void en_suffix_append(en_suffix *x, km_pagehash tenant, const int32_t *tokens, int n)
{
    if (n <= 0) return;
    en_sfx_open(x, tenant);
    const int m = x->o.min_match;
    int32_t key[64];
    for (int i = 0; i < n; i++) {
        if (tokens[i] < 0) continue; /* never a token; would read as a separator */
        en_sfx_put(x, tokens[i]);
        x->tokens_added++;
        assert(x->open); /* eviction never takes the open document whole */
        uint64_t p = x->end - 1, start = en_sfx_doc(x, x->d_end - 1)->start;
        if (p < start + (uint64_t)m - 1) continue; /* the key would reach before the document */
        for (int j = 0; j < m; j++) key[j] = en_sfx_at(x, p - (uint64_t)(m - 1 - j));
        uint64_t b = en_sfx_hash(tenant, key, m) & (x->nb - 1);
        uint64_t prev = x->head[b];
        if (prev && prev - 1 >= x->tail && prev - 1 < p)
            x->link[p % (uint64_t)x->cap] = (uint32_t)(p - (prev - 1));
        x->head[b] = p + 1;
    }
}

/* The document holding position p (binary search over the document ring), or NULL. */
static const en_sdoc *en_sfx_doc_of(const en_suffix *x, uint64_t p)
{
    uint64_t lo = x->d_tail, hi = x->d_end; /* the answer is in [lo, hi) */
    if (lo == hi) return NULL;
    while (hi - lo > 1) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (en_sfx_doc(x, mid)->start <= p)
            lo = mid;
        else
            hi = mid;
    }
    const en_sdoc *d = en_sfx_doc(x, lo);
    return d->start <= p ? d : NULL;
}

typedef struct en_cand {
    uint64_t p; /* position of the last matched token */
    int len;
} en_cand;

/* The token at position q of the text, extended through the proposal when tail is set. */
static int32_t en_sfx_next(const en_suffix *x, uint64_t q, int tail, const en_draft *d, int j)
{
    if (q < x->end) return en_sfx_at(x, q);
    if (!tail) return EN_SEP;
    uint64_t k = q - x->end;
    return k < (uint64_t)j ? d->tok[k] : EN_SEP;
}

int en_suffix_propose(const en_suffix *x, km_pagehash tenant, const int32_t *ctx, int n_ctx,
                      int max, float min_share, int tail, en_draft *d)
{
    d->n = d->match_len = d->occurrences = 0;
    const int m = x->o.min_match;
    if (n_ctx < m || max <= 0 || x->end == x->tail) return 0;
    const int32_t *key = ctx + n_ctx - m;
    uint64_t b = en_sfx_hash(tenant, key, m) & (x->nb - 1);
    en_cand cand[256];
    int nc = 0, best = 0;
    uint64_t p = x->head[b];
    if (!p) return 0;
    p--;
    for (int walked = 0; walked < x->o.max_chain && p >= x->tail && p < x->end; walked++) {
        /* A continuation must exist (the context's own end has none). */
        int has_next = p + 1 < x->end ? en_sfx_at(x, p + 1) != EN_SEP : 0;
        if (has_next) {
            int len = 0, lim = n_ctx < x->o.max_match ? n_ctx : x->o.max_match;
            while (len < lim && p >= x->tail + (uint64_t)len &&
                   en_sfx_at(x, p - (uint64_t)len) == ctx[n_ctx - 1 - len])
                len++;
            if (len >= m) {
                const en_sdoc *doc = en_sfx_doc_of(x, p);
                if (doc && km_pagehash_eq(doc->tenant, tenant) &&
                    p - (uint64_t)(len - 1) >= doc->start) {
                    cand[nc++] = (en_cand){p, len};
                    if (len > best) best = len;
                }
            }
        }
        uint32_t l = x->link[p % (uint64_t)x->cap];
        if (!l || l > p) break;
        p -= l;
    }
    if (!nc) return 0;
    /* The longest matches vote; candidates are in recency order. */
    int na = 0;
    for (int i = 0; i < nc; i++)
        if (cand[i].len == best) cand[na++] = cand[i];
    d->match_len = best;
    d->occurrences = na;
    int32_t vote[256];
    for (int j = 0; j < max && na > 0; j++) {
        for (int i = 0; i < na; i++)
            vote[i] = en_sfx_next(x, cand[i].p + 1 + (uint64_t)j, tail, d, j);
        int win = -1, win_count = 0;
        for (int i = 0; i < na; i++) {
            if (vote[i] == EN_SEP) continue;
            int c = 0;
            for (int k = 0; k < na; k++) c += vote[k] == vote[i];
            if (c > win_count) { /* strictly more: the most recent wins ties */
                win = i;
                win_count = c;
            }
        }
        if (win < 0) break;
        float share = (float)win_count / (float)na;
        if (share < min_share) break;
        int32_t t = vote[win];
        d->tok[j] = t;
        d->share[j] = share;
        d->n = j + 1;
        int keep = 0;
        for (int i = 0; i < na; i++)
            if (vote[i] == t) cand[keep++] = cand[i];
        na = keep;
    }
    return d->n;
}
