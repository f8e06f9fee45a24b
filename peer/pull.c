/*
 * pull.c — the puller side of a transfer: what the store already holds, the request, the
 * checks every offered page must pass before a byte is read (its index, format and size, an
 * address inside the holder's registered region, its token ids, its chain link), destination
 * pages in the store, the checksum of what arrived (on the back end's progress thread, as each
 * page lands), and the import of the leading pages that passed.
 *
 * The chain ends at the first page that fails: pages after it could only hang from a page we
 * do not have. A pull given up before its reads completed becomes a zombie: its destination
 * pages stay reserved until the back end says no operation on them remains (pr_node_poll
 * reclaims it then, indexing what arrived intact), so a late read can never land in a page
 * that the store has reused.
 */
#include <stdlib.h>
#include <string.h>

#include "peer/internal.h"

const char *pr_drop_name(pr_drop d)
{
    static const char *names[] = {"tokens",   "chain",   "format",    "checksum",
                                  "transfer", "timeout", "nonfinite", "auth"};
    return (unsigned)d < PR_DROP_COUNT ? names[d] : "unknown";
}

int pr_pull_start(pr_node *n, pr_peer *from, const km_pagehash *hashes, const int32_t *tokens,
                  int n_pages, uint64_t deadline_ns, pr_pull **out, pr_pull_req *req)
{
    *out = NULL;
    if (!from || !hashes || !tokens || n_pages < 1 || n_pages > PR_MAX_PAGES) return KM_EINVAL;
    if (pr_peer_failed(from) || from->released) return KM_EIO;
    const int pt = kv_store_page_tokens(n->store);
    uint64_t imp;
    int k = kv_import_begin(n->store, hashes, tokens, n_pages, &imp);
    if (k < 0 || k == n_pages) return k;
    pr_pull *p = calloc(1, sizeof *p);
    if (p) {
        p->hashes = malloc(sizeof(km_pagehash) * n_pages);
        p->tokens = malloc(sizeof(int32_t) * (size_t)n_pages * pt);
    }
    if (!p || !p->hashes || !p->tokens) {
        if (p) {
            free(p->hashes);
            free(p->tokens);
        }
        free(p);
        kv_import_abort(n->store, imp);
        return KM_ENOMEM;
    }
    memcpy(p->hashes, hashes, sizeof(km_pagehash) * n_pages);
    memcpy(p->tokens, tokens, sizeof(int32_t) * (size_t)n_pages * pt);
    p->id = n->next_pull_id++;
    p->node = n;
    p->peer = from;
    from->refs++;
    p->page_tokens = pt;
    p->start_ns = km_now_ns();
    p->deadline_ns = deadline_ns;
    p->import_id = imp;
    p->k = k;
    p->n_chain = n_pages;
    atomic_init(&p->fetch_done, 0);
    atomic_init(&p->settled, 0);
    atomic_init(&p->timed_out, 0);
    atomic_init(&p->stop, 0);
    p->next = n->pulls;
    n->pulls = p;
    n->st.pulls++;
    *req = (pr_pull_req){.pull_id = p->id,
                         .first = k,
                         .n_pages = n_pages,
                         .page_tokens = pt,
                         .hashes = p->hashes,
                         .tokens = p->tokens};
    *out = p;
    return k;
}

int pr_pull_position_free(pr_node *n, pr_pull *p)
{
    return p ? kv_import_set_position_free(n->store, p->import_id) : KM_EINVAL;
}

/* -1 when offered page `d` (tokens tk) may be chain page idx of ours, else why not. */
static int pr_check_page(const pr_node *n, const pr_pull *p, const pr_page_desc *d,
                         const int32_t *tk, int idx)
{
    const pr_addr *a = &p->peer->addr;
    const km_pagehash zero = {0, 0};
    if (d->index != idx) return PR_DROP_CHAIN;
    if (d->format < 0 || d->format >= KV_FORMAT_COUNT ||
        d->bytes != kv_store_format_page_bytes(n->store, (kv_format)d->format) || !d->bytes)
        return PR_DROP_FORMAT;
    if (d->region >= (uint32_t)a->n_regions || d->addr < a->region[d->region].base ||
        d->bytes > a->region[d->region].bytes ||
        d->addr - a->region[d->region].base > a->region[d->region].bytes - d->bytes)
        return PR_DROP_FORMAT;
    if (memcmp(tk, p->tokens + (size_t)idx * p->page_tokens, sizeof(int32_t) * p->page_tokens))
        return PR_DROP_TOKENS;
    if (!km_pagehash_eq(d->hash, p->hashes[idx]) ||
        !km_pagehash_eq(d->parent, idx ? p->hashes[idx - 1] : zero))
        return PR_DROP_CHAIN;
    if (idx && !km_pagehash_eq(km_pagehash_next(d->parent, tk, p->page_tokens), d->hash))
        return PR_DROP_CHAIN;
    return -1;
}

int pr_pull_offer(pr_node *n, pr_pull *p, const pr_offer *o)
{
    if (p->offered || p->submitted || atomic_load(&p->fetch_done)) return KM_EPROTO;
    if (!o || o->pull_id != p->id) return KM_EPROTO;
    p->lease_id = o->lease_id;
    if (o->status < 0 || o->n <= 0 || !o->lease_id) {
        p->status = o->status < 0 ? o->status : KM_ENOTFOUND;
        atomic_store(&p->fetch_done, 1);
        return 0;
    }
    if (o->n > p->n_chain - p->k || o->page_tokens != p->page_tokens || !o->pages || !o->tokens) {
        p->status = KM_EPROTO;
        atomic_store(&p->fetch_done, 1);
        return KM_EPROTO;
    }
    p->offered = o->n;
    pr_key_derive(o->key, p->token, p->page_key);
    p->encrypt = p->peer->encrypt && !n->cfg.no_auth;
    p->no_auth = n->cfg.no_auth;
    kv_format *wire = malloc(sizeof *wire * o->n);
    kv_xfer_page *dst = malloc(sizeof *dst * o->n);
    int m = 0, rc = 0;
    if (!wire || !dst) rc = KM_ENOMEM;
    for (; !rc && m < o->n; m++) {
        int why =
            pr_check_page(n, p, &o->pages[m], o->tokens + (size_t)m * p->page_tokens, p->k + m);
        if (why >= 0) {
            p->drop[why]++;
            p->status = KM_ECORRUPT;
            KM_WARN("peer_page_rejected", "pull=%llu index=%d reason=%s", (unsigned long long)p->id,
                    p->k + m, pr_drop_name((pr_drop)why));
            break;
        }
        wire[m] = (kv_format)o->pages[m].format;
    }
    if (!rc && m > 0) rc = kv_import_reserve(n->store, p->import_id, m, wire, dst);
    if (rc > 0) {
        m = rc;
        rc = 0;
        p->pages = calloc((size_t)m, sizeof *p->pages);
        if (!p->pages) rc = KM_ENOMEM;
    }
    if (!rc && m > 0) {
        for (int i = 0; i < m; i++) {
            p->pages[i].src = o->pages[i];
            p->pages[i].dst = dst[i];
            atomic_init(&p->pages[i].state, PR_PAGE_PENDING);
        }
        p->n = m;
        rc = n->ops->fetch(n, p);
        if (!rc) p->submitted = 1;
    }
    free(wire);
    free(dst);
    if (rc || !p->submitted) {
        if (!p->status) p->status = rc ? rc : KM_ECORRUPT;
        p->n = 0;
        atomic_store(&p->fetch_done, 1);
    }
    return rc;
}

void pr_page_arrived(pr_pull *p, int i, int ok, const uint64_t *sum)
{
    pr_xpage *x = &p->pages[i];
    int st = ok < 0 ? PR_PAGE_BAD_AUTH : PR_PAGE_FAILED;
    if (ok > 0)
        st = (sum ? *sum : kv_xfer_checksum(&x->dst, p->page_tokens, x->dst.buf)) == x->src.checksum
                 ? PR_PAGE_OK
                 : PR_PAGE_BAD_SUM;
    /* an unkeyed checksum only says the bytes are the holder's: a page of NaNs would poison
     * every request that hits it, so its values are checked too, here on the progress thread
     * while the page it just landed is likely still in the cache */
    if (st == PR_PAGE_OK && !kv_page_finite(p->node->store, x->dst.buf, x->dst.format))
        st = PR_PAGE_NONFINITE;
    atomic_store_explicit(&x->state, st, memory_order_release);
    atomic_fetch_add_explicit(&p->settled, 1, memory_order_release);
}

int pr_pull_done_yet(pr_node *n, pr_pull *p)
{
    return atomic_load_explicit(&p->fetch_done, memory_order_acquire);
}

int pr_pull_pages_settled(const pr_pull *p, int *of)
{
    if (of) *of = p->n;
    return atomic_load_explicit(&((pr_pull *)p)->settled, memory_order_acquire);
}

/* Counts the leading pages that passed, records why the next one did not, imports them. */
static int pr_pull_commit(pr_node *n, pr_pull *p, pr_pull_result *res)
{
    int ok = 0;
    uint64_t bytes = 0;
    for (; ok < p->n; ok++) {
        int st = atomic_load_explicit(&p->pages[ok].state, memory_order_acquire);
        if (st == PR_PAGE_NONFINITE) { /* pr_page_arrived */
            p->drop[PR_DROP_NONFINITE]++;
            if (!p->status) p->status = KM_ECORRUPT;
            break;
        }
        if (st == PR_PAGE_OK) {
            bytes += p->pages[ok].dst.bytes;
            continue;
        }
        if (st == PR_PAGE_BAD_AUTH) { /* pr_page_arrived: never imported */
            p->drop[PR_DROP_AUTH]++;
            if (!p->status) p->status = KM_ECORRUPT;
            break;
        }
        int why = st == PR_PAGE_BAD_SUM                                 ? PR_DROP_CHECKSUM
                  : atomic_load(&p->timed_out) || st == PR_PAGE_PENDING ? PR_DROP_TIMEOUT
                                                                        : PR_DROP_TRANSFER;
        p->drop[why]++;
        if (!p->status)
            p->status = why == PR_DROP_CHECKSUM  ? KM_ECORRUPT
                        : why == PR_DROP_TIMEOUT ? KM_ETIMEDOUT
                                                 : KM_EIO;
        break;
    }
    int imported = kv_import_commit(n->store, p->import_id, ok);
    if (imported < 0) imported = 0;
    n->st.pages_in += (uint64_t)imported;
    n->st.bytes_in += bytes;
    for (int r = 0; r < PR_DROP_COUNT; r++) n->st.dropped[r] += (uint64_t)p->drop[r];
    if (res) {
        res->pages_imported = imported;
        res->bytes = bytes;
        res->status = p->status;
        memcpy(res->dropped, p->drop, sizeof res->dropped);
    }
    return imported;
}

int pr_pull_finish(pr_node *n, pr_pull *p, pr_pull_result *res, pr_pull_done *done)
{
    for (pr_pull **pp = &n->pulls; *pp; pp = &(*pp)->next)
        if (*pp == p) {
            *pp = p->next;
            break;
        }
    if (res) {
        memset(res, 0, sizeof *res);
        res->pages_local = p->k;
        res->pages_wanted = p->n_chain - p->k;
        res->pages_offered = p->offered;
    }
    if (done) *done = (pr_pull_done){.lease_id = p->lease_id};
    int finished = atomic_load_explicit(&p->fetch_done, memory_order_acquire);
    int imported = 0;
    if (finished) {
        imported = pr_pull_commit(n, p, res);
    } else { /* reads still in flight: reclaimed by pr_node_poll once they have completed */
        atomic_store_explicit(&p->stop, 1, memory_order_release);
        n->ops->cancel(n, p);
        p->status = km_now_ns() >= p->deadline_ns ? KM_ETIMEDOUT : KM_ECANCELED;
        if (res) res->status = p->status;
        p->next = n->zombies;
        n->zombies = p;
    }
    if (done) done->pages_ok = imported;
    if (res) res->ns = km_now_ns() - p->start_ns;
    if (imported == p->n_chain - p->k)
        n->st.pulls_ok++;
    else
        n->st.pulls_failed++;
    if (finished) pr_pull_free(n, p);
    return imported;
}

void pr_pull_reap(pr_node *n, pr_pull *p)
{
    pr_pull_commit(n, p, NULL);
    pr_pull_free(n, p);
}

void pr_pull_free(pr_node *n, pr_pull *p)
{
    pr_peer_unref(n, p->peer);
    free(p->pages);
    free(p->hashes);
    free(p->tokens);
    free(p);
}
