/*
 * service_handoff.c — where a worker's cache goes when the worker does, and where a new worker's
 * comes from (docs/transfer.md, "Drain handoff" and "Warm-up"), over the transfer node of
 * service_peer.c:
 *
 *  - The controller's view (--peer-view) names the peers: ready, the same model (the chain
 *    hashes are seeded by its fingerprint), a transfer node, room.
 *  - Drain handoff: a drain sends each such peer `kv_push` frames naming this worker's cached
 *    chains, most recently used first (kv_store_chains), round robin up to WK_PUSH_PER_PEER
 *    each (a chain starting with the first page of one already pushed goes to the same peer);
 *    a peer queues each chain for a background pull (a held entry with no request, at most
 *    WK_BG_AT_ONCE running; a chain whose prefix a running one is bringing waits for it, then
 *    pulls only what it lacks) and this worker lingers at the end of its drain while they read
 *    (service.c). What peers cannot take goes to the disk tier as before. Half a second into
 *    the linger, the chains of a peer that has pulled none of them (the view still called it
 *    ready, but it died or stopped within the controller's dead-after window) are pushed again
 *    to the peers that did pull (wk_peer_handoff_again), once.
 *  - Warm-up: once ready, a worker asks up to two peers (`kv_warm`) for their most recently used
 *    chains, --peer-warm-pages pages in all; they answer with `kv_push` frames, pulled the same
 *    way, each page once, never more than --peer-warm-pages of them (warm_left).
 *
 * Everything runs on the service's thread, between engine steps.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker/service_peer_internal.h"

/* The controller's views (--peer-view): the peers a drain may hand pages to. */
static void wk_peer_view_apply(wk_service *s, const km_msg_view *v)
{
    wk_peer *p = s->peer;
    p->n_members = 0;
    for (uint32_t i = 0; i < v->n_workers && p->n_members < WK_PEER_VIEW; i++) {
        const km_view_worker *w = &v->workers[i];
        if (!w->id || !strcmp(w->id, s->worker_id) || !w->requests || !w->peer_addr ||
            w->peer_addr_len > KM_PROTO_MAX_PEER_ADDR)
            continue;
        wk_member *m = &p->members[p->n_members++];
        snprintf(m->id, sizeof m->id, "%s", w->id);
        snprintf(m->requests, sizeof m->requests, "%s", w->requests);
        memcpy(m->addr, w->peer_addr, w->peer_addr_len);
        m->addr_len = w->peer_addr_len;
        /* the same model (the chain hashes are seeded by its fingerprint), ready, with room */
        m->takes = w->state == KM_MEMBER_READY && w->fingerprint &&
                   !strcmp(w->fingerprint, s->fp) && w->pressure < 0.9;
    }
    km_gauge_set(p->s_view_peers, p->n_members);
    wk_peer_warm_up(s);
}

void wk_peer_view_read(wk_service *s)
{
    wk_peer *p = s->peer;
    for (int k = 0; p->vsub && k < 16; k++) {
        if (km_zrecv(p->vsub, &p->vin, 0, NULL)) break;
        km_msg m;
        if (p->vin.n == 2 &&
            !km_msg_decode(p->vin.part[1].data, p->vin.part[1].len, NULL, &m, NULL)) {
            if (m.type == KM_MSG_VIEW) wk_peer_view_apply(s, &m.view);
            km_msg_clear(&m);
        }
    }
    km_zmsg_clear(&p->vin);
}

const wk_member *wk_peer_member(wk_service *s, const char *id)
{
    wk_peer *p = s->peer;
    if (!p || !id) return NULL;
    wk_peer_view_read(s); /* the latest view: the router hinted from one at least as new */
    for (int i = 0; i < p->n_members; i++)
        if (!strcmp(p->members[i].id, id)) return &p->members[i];
    return NULL;
}

wk_link *wk_peer_link_member(wk_service *s, const char *id)
{
    const wk_member *m = wk_peer_member(s, id);
    return m ? wk_peer_link(s, m->id, m->requests, m->addr, m->addr_len) : NULL;
}

/* A kv_push of this chain, from this worker, into p->out; 0 or a km_err. */
static int wk_peer_encode_push(wk_service *s, const km_pagehash *hs, const int32_t *toks,
                               int n_pages)
{
    wk_peer *p = s->peer;
    if (n_pages > KM_PROTO_MAX_PULL_PAGES) return KM_ERANGE;
    uint8_t *canon = malloc((size_t)n_pages * 16);
    if (!canon) return KM_ENOMEM;
    for (int i = 0; i < n_pages; i++) km_pagehash_canonical(hs[i], canon + 16 * i);
    km_msg m;
    km_msg_init(&m, KM_MSG_KV_PUSH);
    m.kv_push = (km_msg_kv_push){.chain = {.id = ++p->push_id,
                                           .n_pages = (uint32_t)n_pages,
                                           .page_tokens = (uint32_t)kv_store_page_tokens(s->kv),
                                           .hashes = canon,
                                           .tokens = toks},
                                 .from = s->worker_id,
                                 .endpoint = s->ep_requests,
                                 .addr = p->addr,
                                 .addr_len = (uint32_t)p->addr_len,
                                 .position_free = kv_store_position_free(s->kv, hs[0]) != 0};
    int rc = km_msg_encode(&m, &s->lim, &p->out, NULL);
    free(canon);
    return rc;
}

typedef struct wk_push_ctx {
    wk_service *s;
    wk_link *to[WK_PEER_VIEW];
    int sent[WK_PEER_VIEW], n, next, chains;
    const bool *silent; /* pushing again: only chains pushed to these peers (push_to indices) */
} wk_push_ctx;

/* The record of the pushed chain ending at last (or with root, starting there), or NULL. */
static wk_pushed *wk_pushed_find(wk_peer *p, km_pagehash last, bool root)
{
    for (int i = 0; i < p->n_pushed; i++)
        if (km_pagehash_eq(root ? p->pushed[i].root : p->pushed[i].last, last))
            return &p->pushed[i];
    return NULL;
}

void wk_peer_pushed_pulled(wk_peer *p, km_pagehash last)
{
    wk_pushed *r = p->n_pushed ? wk_pushed_find(p, last, false) : NULL;
    if (r) r->pulled = true;
}

/* One chain (kv_store_chains' callback) to the peer that took a chain with the same first page
 * (so a shared prefix crosses once), else to the next peer in turn that can take more. */
static int wk_push_chain(void *arg, const km_pagehash *hs, const int32_t *toks, int n_pages)
{
    wk_push_ctx *c = arg;
    wk_service *s = c->s;
    wk_peer *p = s->peer;
    if (c->silent) { /* again: a chain pushed to a peer that pulled nothing */
        const wk_pushed *r = wk_pushed_find(p, hs[n_pages - 1], false);
        if (!r || r->pulled || !c->silent[r->to]) return 0;
    }
    int k = -1;
    const wk_pushed *kin = c->silent ? NULL : wk_pushed_find(p, hs[0], true);
    if (kin && c->sent[kin->to] < WK_PUSH_PER_PEER) k = kin->to;
    for (int t = 0; t < c->n && k < 0; t++) {
        int i = (c->next + t) % c->n;
        if (c->sent[i] < WK_PUSH_PER_PEER) k = i;
    }
    if (k < 0) return 1; /* every peer has its share */
    if (!kin) c->next = k + 1;
    if (!wk_peer_encode_push(s, hs, toks, n_pages)) {
        km_zframe f = {p->out.data, p->out.len};
        if (!km_zsend(c->to[k]->sock, &f, 1, KM_ZDONTWAIT, NULL)) {
            c->sent[k]++;
            c->chains++;
            if (!c->silent && p->pushed) /* first push: remembered, to push again if need be */
                p->pushed[p->n_pushed++] = (wk_pushed){hs[0], hs[n_pages - 1], k, false};
        }
    }
    return 0;
}

int wk_peer_handoff(wk_service *s)
{
    wk_peer *p = s->peer;
    if (!p || !p->vsub) return 0;
    wk_peer_view_read(s); /* the latest view */
    wk_push_ctx c = {.s = s};
    for (int i = 0; i < p->n_members && c.n < WK_PEER_VIEW; i++) {
        wk_member *m = &p->members[i];
        if (!m->takes) continue;
        wk_link *l = wk_peer_link(s, m->id, m->requests, m->addr, m->addr_len);
        if (l) c.to[c.n++] = l;
    }
    if (!c.n) {
        KM_INFO("handoff_skipped",
                "worker=%s why=\"no ready peer of this model with room in the "
                "controller's view\"",
                s->worker_id);
        return 0;
    }
    /* each peer takes WK_PUSH_PER_PEER chains at most: room for every record */
    free(p->pushed);
    p->pushed = malloc(sizeof *p->pushed * (size_t)c.n * WK_PUSH_PER_PEER);
    p->n_pushed = 0;
    p->pushed_again = false;
    p->n_push_to = c.n;
    memcpy(p->push_to, c.to, sizeof *c.to * (size_t)c.n);
    int max_pages = kv_store_pages_total(s->kv);
    int rc = kv_store_chains(s->kv, max_pages, wk_push_chain, &c);
    km_counter_add(p->s_handoff[WK_HO_PUSHED], (uint64_t)c.chains);
    KM_INFO("handoff", "worker=%s peers=%d chains=%d%s", s->worker_id, c.n, c.chains,
            rc < 0 ? " error=out_of_memory" : "");
    return c.chains;
}

int wk_peer_handoff_again(wk_service *s)
{
    wk_peer *p = s->peer;
    if (!p || !p->n_pushed || p->pushed_again) return 0;
    p->pushed_again = true;
    bool pulled[WK_PEER_VIEW] = {false}, silent[WK_PEER_VIEW] = {false};
    for (int i = 0; i < p->n_pushed; i++)
        if (p->pushed[i].pulled) pulled[p->pushed[i].to] = true;
    wk_push_ctx c = {.s = s, .silent = silent};
    int n_silent = 0;
    for (int k = 0; k < p->n_push_to; k++) {
        if (pulled[k])
            c.to[c.n++] = p->push_to[k];
        else
            n_silent += silent[k] = true;
    }
    if (!c.n || !n_silent) return 0; /* nobody to hand them to, or nothing to hand */
    int rc = kv_store_chains(s->kv, kv_store_pages_total(s->kv), wk_push_chain, &c);
    km_counter_add(p->s_handoff[WK_HO_PUSHED], (uint64_t)c.chains);
    KM_INFO("handoff_again", "worker=%s silent_peers=%d to_peers=%d chains=%d%s", s->worker_id,
            n_silent, c.n, c.chains, rc < 0 ? " error=out_of_memory" : "");
    return c.chains;
}

/* A peer's chain (its drain's handoff, or its answer to our warm-up): queued for a background
 * pull of what is not here (wk_peer_bg_start). */
void wk_peer_take(wk_service *s, const km_msg_kv_push *q, bool warm)
{
    wk_peer *p = s->peer;
    if (!p) return; /* no transfer node: a push is only a hint */
    const int pt = kv_store_page_tokens(s->kv);
    const uint32_t n = q->chain.n_pages;
    wk_link *l = NULL;
    wk_held *h = NULL;
    if (p->n_wait >= WK_PEER_BG || (int)q->chain.page_tokens != pt ||
        !(l = wk_peer_link_member(s, q->from)) || /* where it is: the view's word, not its own */
        !(h = calloc(1, sizeof *h)) || !(h->hs = malloc(sizeof *h->hs * n)) ||
        !(h->tokens = malloc(sizeof *h->tokens * n * (size_t)pt))) {
        km_counter_inc(p->s_handoff[WK_HO_DROPPED]);
        wk_held_free(h);
        return;
    }
    for (uint32_t i = 0; i < n; i++)
        h->hs[i] = km_pagehash_from_canonical(q->chain.hashes + 16 * i);
    memcpy(h->tokens, q->chain.tokens, sizeof *h->tokens * n * (size_t)pt);
    h->background = true;
    h->chunk_pull = q->position_free; /* a chunk's chain: flagged here too */
    h->warm = warm;
    h->link = l;
    h->n_pages = (int)n;
    h->arrival_ns = km_now_ns();
    l->pulls++; /* the link stays while the chain waits */
    p->bg_wait[p->n_wait++] = h;
    wk_peer_bg_start(s);
}

/* Whether a running background pull is bringing pages of h's chain: the first page it asked
 * for is h's page at that place (a page's hash names its whole prefix). */
static bool wk_bg_in_flight(const wk_peer *p, const wk_held *h)
{
    for (int i = 0; i < p->n_held; i++) {
        const wk_held *r = p->held[i];
        if (r->background && r->hs && r->first < h->n_pages &&
            km_pagehash_eq(r->hs[r->first], h->hs[r->first]))
            return true;
    }
    return false;
}

/* Starts h's background pull of what is not here yet, within the warm-up budget for a warm-up
 * chain (a prefix of it when the budget has less left). 0 when it runs, else the outcome to
 * count (h is not held). */
static int wk_bg_pull(wk_service *s, wk_held *h)
{
    wk_peer *p = s->peer;
    wk_link *l = h->link;
    l->pulls--;
    int k = kv_store_held(s->kv, h->hs, h->tokens, h->n_pages, NULL);
    if (k >= h->n_pages) return WK_HO_PRESENT;
    int n = h->n_pages;
    if (h->warm && n - k > p->warm_left) n = k + p->warm_left;
    if (k < 0 || n <= k || !l->peer || pr_peer_failed(l->peer)) return WK_HO_DROPPED;
    h->deadline_ns = km_now_ns() + wk_ms_ns(WK_BG_PULL_MS);
    int first = wk_peer_start(s, l, h, h->hs, h->tokens, n);
    if (first < 0) return WK_HO_DROPPED; /* its pages were all checked not here */
    if (h->chunk_pull) pr_pull_position_free(p->node, h->pull);
    h->first = first;
    if (h->warm) p->warm_left -= h->reserved = n - first;
    p->n_bg++;
    return 0;
}

/* Starts waiting background pulls while fewer than WK_BG_AT_ONCE run. A chain whose pages a
 * running pull is bringing waits for it, and then pulls only what it lacks: chains sharing a
 * prefix move it once. */
void wk_peer_bg_start(wk_service *s)
{
    wk_peer *p = s->peer;
    for (int i = 0; i < p->n_wait && p->n_bg < WK_BG_AT_ONCE && p->n_held < WK_PEER_HELD;) {
        wk_held *h = p->bg_wait[i];
        if (wk_bg_in_flight(p, h)) {
            i++;
            continue;
        }
        memmove(p->bg_wait + i, p->bg_wait + i + 1, sizeof *p->bg_wait * (size_t)(--p->n_wait - i));
        int rc = wk_bg_pull(s, h);
        km_counter_inc(p->s_handoff[rc ? rc : WK_HO_TAKEN]);
        if (rc) wk_held_free(h);
    }
}

void wk_peer_bg_end(wk_service *s, wk_held *h, const pr_pull_result *res)
{
    wk_peer *p = s->peer;
    p->n_bg--;
    /* the budget counts the pages offered (those moved, or read and failed): the rest back */
    if (h->warm && res->pages_offered < h->reserved)
        p->warm_left += h->reserved - res->pages_offered;
    wk_held_free(h);
}

/* A peer asks for our chains (its warm-up): up to its page budget, answered as kv_push frames on
 * its connection. */
typedef struct wk_warm_ctx {
    wk_service *s;
    const km_zframe *env;
    int n_env, chains;
} wk_warm_ctx;

static int wk_warm_chain(void *arg, const km_pagehash *hs, const int32_t *toks, int n_pages)
{
    wk_warm_ctx *c = arg;
    wk_service *s = c->s;
    if (c->chains >= WK_PUSH_PER_PEER) return 1;
    if (!wk_peer_encode_push(s, hs, toks, n_pages)) {
        wk_svc_send(s, s->router, c->env, c->n_env, &s->peer->out);
        c->chains++;
    }
    return 0;
}

void wk_peer_warm_answer(wk_service *s, const km_zframe *env, int n_env, const km_msg_kv_warm *q)
{
    wk_peer *p = s->peer;
    wk_warm_ctx c = {.s = s, .env = env, .n_env = n_env};
    int max = q->max_pages < (uint32_t)INT32_MAX ? (int)q->max_pages : INT32_MAX;
    kv_store_chains(s->kv, max, wk_warm_chain, &c);
    km_counter_add(p->s_handoff[WK_HO_PUSHED], (uint64_t)c.chains);
    KM_INFO("warm_answer", "worker=%s chains=%d max_pages=%u", s->worker_id, c.chains,
            q->max_pages);
}

/* Once, when this worker is ready and the view names peers of its model: ask up to two of them
 * for their most recently used chains, warm_pages pages in all (the warm-up on scale-out). */
void wk_peer_warm_up(wk_service *s)
{
    wk_peer *p = s->peer;
    if (p->warmed || p->warm_pages <= 0 || wk_svc_state(s) != KM_STATE_READY) return;
    wk_link *to[2];
    int n = 0;
    for (int i = 0; i < p->n_members && n < 2; i++) {
        wk_member *m = &p->members[i];
        if (!m->takes) continue;
        wk_link *l = wk_peer_link(s, m->id, m->requests, m->addr, m->addr_len);
        if (l) to[n++] = l;
    }
    if (!n) return; /* none yet: a later view may name one */
    p->warmed = true;
    km_msg m;
    km_msg_init(&m, KM_MSG_KV_WARM);
    m.kv_warm = (km_msg_kv_warm){.id = ++p->push_id, .max_pages = (uint32_t)(p->warm_pages / n)};
    if (!m.kv_warm.max_pages) m.kv_warm.max_pages = 1;
    for (int i = 0; i < n; i++) {
        km_zframe f;
        if (!km_msg_encode(&m, &s->lim, &p->out, NULL) &&
            (f = (km_zframe){p->out.data, p->out.len},
             !km_zsend(to[i]->sock, &f, 1, KM_ZDONTWAIT, NULL)))
            KM_INFO("warm_up", "worker=%s from=%s max_pages=%u", s->worker_id, to[i]->endpoint,
                    m.kv_warm.max_pages);
    }
}

/* Handoffs taken but not started are given up (a drain or a stop). */
void wk_peer_bg_drop(wk_peer *p)
{
    while (p->n_wait) {
        wk_held *h = p->bg_wait[--p->n_wait];
        h->link->pulls--;
        km_counter_inc(p->s_handoff[WK_HO_DROPPED]);
        wk_held_free(h);
    }
}
