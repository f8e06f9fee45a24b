/*
 * serve.c — the holder side: a puller's request becomes a lease, a kvshard export that pins
 * the verified prefix of its chain, and an offer describing each pinned page (where it lies in
 * the registered memory, its format, identity and checksum). The lease ends when the puller
 * says so or when it runs out, whichever comes first; after that the pages may be evicted or
 * reused, and a late reader gets bytes that fail their checksum, never a page that passes.
 *
 * Offers leave through pr_node_poll rather than from pr_serve itself because a page on the
 * host tier is first promoted by the store's promoter thread: the owner never waits for it.
 *
 * A holder answering fetches (AM mode) serves only what a live lease offered, to whoever proves
 * the lease's secret (pr_lease_allows): the registered memory holds every tenant's pages, and
 * neither the pull id nor UCX's connection says who asks, so the secret, drawn per lease and
 * sent only with the offer, is the grant (seal.c). The owner thread changes the
 * list and a lease's description under lease_mu; the back end's progress thread reads them
 * under it.
 */
#include <stdlib.h>
#include <string.h>

#include "peer/internal.h"

static pr_lease *pr_lease_refuse(pr_node *n, const pr_pull_req *req, int status)
{
    pr_lease *l = calloc(1, sizeof *l);
    if (!l) return NULL;
    l->pull_id = req->pull_id;
    l->requester = req->requester;
    l->status = status;
    pthread_mutex_lock(&n->lease_mu);
    l->next = n->leases;
    n->leases = l;
    pthread_mutex_unlock(&n->lease_mu);
    return l;
}

int pr_serve(pr_node *n, const pr_pull_req *req)
{
    const int pt = kv_store_page_tokens(n->store);
    if (req->page_tokens != pt || req->n_pages < 1 || req->n_pages > PR_MAX_PAGES ||
        req->first < 0 || req->first >= req->n_pages || !req->hashes || !req->tokens) {
        pr_lease_refuse(n, req, KM_EPROTO);
        return KM_EPROTO;
    }
    pr_lease *l = pr_lease_refuse(n, req, 0);
    if (!l) return KM_ENOMEM;
    pr_lease_secret(l->key); /* before it has an id: fetches look only at leases with one */
    pr_key_derive(l->key, l->token, l->page_key);
    uint64_t deadline = km_now_ns() + (uint64_t)n->cfg.lease_ms * 1000000ull, id = 0;
    int held = kv_export_begin(n->store, req->hashes, req->tokens, req->n_pages, deadline, &id);
    if (held <= req->first) {
        if (id) kv_export_end(n->store, id);
        l->status = held < 0 ? held : KM_ENOTFOUND;
        return 0;
    }
    pthread_mutex_lock(&n->lease_mu);
    l->deadline_ns = deadline;
    l->id = id;
    l->first = req->first;
    l->n = held - req->first;
    pthread_mutex_unlock(&n->lease_mu);
    return 0;
}

static void pr_lease_free(pr_node *n, pr_lease **lp)
{
    pr_lease *l = *lp;
    pthread_mutex_lock(&n->lease_mu);
    *lp = l->next;
    pthread_mutex_unlock(&n->lease_mu);
    if (l->id) kv_export_end(n->store, l->id);
    free(l->descs);
    free(l->tokens);
    free(l);
}

int pr_serve_done(pr_node *n, const pr_pull_done *done)
{
    for (pr_lease **lp = &n->leases; *lp; lp = &(*lp)->next)
        if ((*lp)->id && (*lp)->id == done->lease_id && (*lp)->requester == done->requester) {
            pr_lease_free(n, lp);
            return 1;
        }
    n->st.dones_ignored++;
    return 0;
}

void pr_leases_expire(pr_node *n, uint64_t now_ns)
{
    for (pr_lease **lp = &n->leases; *lp;) {
        pr_lease *l = *lp;
        if (l->emitted && !l->id) { /* a refusal, sent */
            pr_lease_free(n, lp);
        } else if (l->id && l->deadline_ns <= now_ns) {
            n->st.leases_expired++;
            pr_lease_free(n, lp);
        } else {
            lp = &l->next;
        }
    }
}

/* Describes the lease's pages; KM_EAGAIN while some are still being promoted. */
static int pr_lease_describe(pr_node *n, pr_lease *l)
{
    const int pt = kv_store_page_tokens(n->store);
    kv_xfer_page *xp = malloc(sizeof *xp * l->n);
    if (!xp) return KM_ENOMEM;
    int rc = kv_export_pages(n->store, l->id, l->first, l->n, xp);
    if (rc) {
        free(xp);
        return rc;
    }
    pr_page_desc *descs = calloc((size_t)l->n, sizeof *descs);
    int32_t *tokens = malloc(sizeof(int32_t) * (size_t)l->n * pt);
    if (!descs || !tokens) {
        free(descs);
        free(tokens);
        free(xp);
        return KM_ENOMEM;
    }
    int m = 0;
    for (; m < l->n && xp[m].region >= 0; m++) { /* a page outside the arena cannot be read */
        pr_page_desc *d = &descs[m];
        d->index = xp[m].index;
        d->format = (int32_t)xp[m].format;
        d->hash = xp[m].hash;
        d->parent = xp[m].parent;
        d->region = (uint32_t)xp[m].region;
        d->addr = (uint64_t)(uintptr_t)xp[m].buf;
        d->bytes = xp[m].bytes;
        d->checksum = xp[m].checksum;
        memcpy(tokens + (size_t)m * pt, xp[m].tokens, sizeof(int32_t) * pt);
        n->st.bytes_out += xp[m].bytes;
    }
    free(xp);
    pthread_mutex_lock(&n->lease_mu); /* published whole: a fetch sees all of it or none */
    l->descs = descs;
    l->tokens = tokens;
    l->n = m;
    pthread_mutex_unlock(&n->lease_mu);
    return m ? 0 : KM_ENOTFOUND;
}

int pr_leases_emit(pr_node *n, pr_offer *out, int max)
{
    int k = 0;
    for (pr_lease *l = n->leases; l && k < max; l = l->next) {
        if (l->emitted) continue;
        if (l->id && !l->descs) {
            int rc = pr_lease_describe(n, l);
            if (rc == KM_EAGAIN) continue;
            if (rc) {
                kv_export_end(n->store, l->id);
                pthread_mutex_lock(&n->lease_mu);
                l->id = 0;
                l->status = rc;
                pthread_mutex_unlock(&n->lease_mu);
            }
        }
        l->emitted = 1;
        out[k++] = (pr_offer){
            .pull_id = l->pull_id,
            .lease_id = l->id,
            .status = l->id ? 0 : l->status,
            .lease_ms = n->cfg.lease_ms,
            .n = l->id ? l->n : 0,
            .page_tokens = kv_store_page_tokens(n->store),
            .pages = l->descs,
            .tokens = l->tokens,
        };
        if (l->id) memcpy(out[k - 1].key, l->key, PR_KEY_BYTES);
        n->st.offers++;
        if (l->id) n->st.pages_out += (uint64_t)l->n;
    }
    return k;
}

int pr_lease_allows(pr_node *n, uint64_t pull_id, const uint8_t *token, uint32_t index,
                    uint32_t region, uint64_t addr, uint64_t bytes, uint8_t *page_key,
                    pr_page_desc *desc, int32_t *tokens)
{
    const int pt = kv_store_page_tokens(n->store);
    uint64_t now = km_now_ns();
    int ok = -1;
    pthread_mutex_lock(&n->lease_mu);
    for (const pr_lease *l = n->leases; l; l = l->next) {
        if (!l->id || l->pull_id != pull_id || !pr_token_eq(l->token, token)) continue;
        ok = 0; /* the asker holds the lease's secret: it may hear a refusal */
        if (!l->descs || l->deadline_ns <= now) break;
        /* the fetch names its page by its place in the offer: one comparison, not a scan */
        const pr_page_desc *d = index < (uint32_t)l->n ? &l->descs[index] : NULL;
        if ((ok = d && d->region == region && d->addr == addr && d->bytes == bytes)) {
            memcpy(page_key, l->page_key, PR_KEY_BYTES);
            *desc = *d;
            memcpy(tokens, l->tokens + (size_t)index * pt, sizeof(int32_t) * pt);
        }
        break;
    }
    pthread_mutex_unlock(&n->lease_mu);
    return ok;
}

void pr_leases_free(pr_node *n)
{
    while (n->leases) pr_lease_free(n, &n->leases);
}
