/*
 * chunks.c — the router's credit for chunk hits (docs/blend.md "Serving", "Routing").
 *
 * A worker caches a request's chunks (req.chunks) under chains of their own: seeded by the
 * tenant's chunk seed (km_pagehash_chunk_seed), a first page of preamble tokens
 * (KM_CHUNK_PREAMBLE), then the chunk's whole pages. Those pages reach the router's index through
 * the worker's KV events like any page. So the router builds the same chains for a request's
 * chunks (rt_chunk_chains, once, when its prompt is tokens) and, for each worker, counts the
 * leading chunk pages it holds, past the preamble, as cached tokens at a discount
 * (policy.chunk_credit): a reused chunk is repaired by recomputing part of it, so it saves less
 * than a prefix page. A chunk inside the prefix the worker holds is not counted twice (the
 * worker would not reuse it either), nor the last chunk (the worker computes it in full): its
 * chain is not even built.
 *
 * With the mesh on, a chunk the chosen worker lacks and another holds is pulled (pull.c,
 * rt_chunk_pull_advise, over the chains built here).
 */
#include <stdlib.h>
#include <string.h>

#include "router/internal.h"

void rt_chunk_setup(rt_router *r)
{
    const int pt = r->c.page_tokens;
    int32_t ids[256];
    int n = md_tok_encode(r->tok, KM_CHUNK_PREAMBLE, strlen(KM_CHUNK_PREAMBLE), 0, 1, ids, 256);
    if (pt <= 0 || n < pt || pt > 256 || !(r->chunk_pre = malloc(sizeof *r->chunk_pre * pt)))
        return; /* no preamble: no credit (workers reuse nothing either) */
    memcpy(r->chunk_pre, ids, sizeof *r->chunk_pre * pt);
}

bool rt_chunk_has_chain(const rt_router *r, const rt_rq *q, const km_chunk_seg *g)
{
    return g->n >= (uint32_t)r->c.page_tokens && g->start + g->n <= (uint32_t)q->n_prompt;
}

int rt_chunk_chains(rt_router *r, rt_rq *q, km_pagehash tenant_seed)
{
    const int pt = r->c.page_tokens;
    free(q->chunk_chain);
    q->chunk_chain = NULL;
    q->n_chunk_chain = 0;
    if (!q->q.n_chunks || !r->chunk_pre || r->c.policy.chunk_credit <= 0) return 0;
    /* the last chunk is computed in full (blend.md): no chain, no credit, no pull */
    const uint32_t reused = q->q.n_chunks - 1;
    int n = 0;
    for (uint32_t c = 0; c < reused; c++)
        if (rt_chunk_has_chain(r, q, &q->chunks[c])) n += 1 + (int)(q->chunks[c].n / pt);
    if (!n) return 0;
    if (!(q->chunk_chain = malloc(sizeof *q->chunk_chain * n))) return KM_ENOMEM;
    const km_pagehash pre = km_pagehash_next(km_pagehash_chunk_seed(tenant_seed), r->chunk_pre, pt);
    for (uint32_t c = 0; c < reused; c++) {
        const km_chunk_seg *g = &q->chunks[c];
        if (!rt_chunk_has_chain(r, q, g)) continue;
        km_pagehash *h = q->chunk_chain + q->n_chunk_chain;
        h[0] = pre;
        for (uint32_t p = 1; p <= g->n / pt; p++)
            h[p] = km_pagehash_next(h[p - 1], q->tokens + g->start + (p - 1) * pt, pt);
        q->n_chunk_chain += 1 + (int)(g->n / pt);
    }
    return 0;
}

void rt_chunk_credit(rt_router *r, const rt_rq *q, uint64_t workers, const rt_match *prefix,
                     uint64_t now_ms, rt_candidate *cand)
{
    const int pt = r->c.page_tokens;
    const double share = r->c.policy.chunk_credit;
    for (uint32_t c = 0, at = 0; c + 1 < q->q.n_chunks; c++) {
        const km_chunk_seg *g = &q->chunks[c];
        if (!rt_chunk_has_chain(r, q, g)) continue;
        const int np = 1 + (int)(g->n / pt);
        rt_match m;
        rt_index_match(r->index, q->chunk_chain + at, np, workers, r->c.policy.tier_credit, pt,
                       now_ms, &m);
        at += (uint32_t)np;
        for (int i = 0; i < r->n_w; i++) {
            if (!cand[i].usable || m.pages[i] < 2) continue; /* the preamble alone is no hit */
            if ((uint64_t)prefix->pages[i] * pt > g->start) continue; /* inside its prefix */
            /* the chunk's pages, past the preamble's (credited like the others) */
            cand[i].cached_tokens += share * m.credit[i] * (m.pages[i] - 1) / m.pages[i];
        }
    }
}
