/*
 * service_serve.c — KV pages between workers, the holder's side (service_peer.c has the node and
 * the puller's side; docs/transfer.md, docs/protocol.md section 17): a `kv_pull` on the
 * requests ROUTER pins the pages this worker holds (pr_serve) and its `kv_offer` leaves behind
 * the puller's envelope when the node yields it (pr_node_poll, after any host-tier promotion);
 * `kv_pull_done` ends the lease, from the requester only. Also the envelope copies both sides
 * keep of a frame they answer later. Runs on the service's thread, between engine steps.
 */
#include <stdlib.h>
#include <string.h>

#include "worker/service_peer_internal.h"

/* ---------------------------------------------------------------- envelopes */

/* ---------------------------------------------------------------- holder side */

static void wk_peer_send_offer(wk_service *s, const km_zframe *env, int n_env, const pr_offer *o)
{
    wk_peer *p = s->peer;
    km_kv_page_desc *pages = o->n ? calloc((size_t)o->n, sizeof *pages) : NULL;
    if (o->n && !pages) return; /* the puller's deadline covers it */
    for (int i = 0; i < o->n; i++) {
        const pr_page_desc *d = &o->pages[i];
        pages[i] = (km_kv_page_desc){.index = (uint32_t)d->index,
                                     .format = (uint32_t)d->format,
                                     .region = d->region,
                                     .addr = d->addr,
                                     .bytes = d->bytes,
                                     .checksum = d->checksum};
        km_pagehash_canonical(d->hash, pages[i].hash);
        km_pagehash_canonical(d->parent, pages[i].parent);
    }
    km_msg m;
    km_msg_init(&m, KM_MSG_KV_OFFER);
    m.kv_offer = (km_msg_kv_offer){.id = o->pull_id,
                                   .lease_id = o->n ? o->lease_id : 0,
                                   .status = o->n ? 0 : (o->status < 0 ? o->status : KM_ENOTFOUND),
                                   .lease_ms = (uint32_t)(o->lease_ms > 0 ? o->lease_ms : 0),
                                   .page_tokens = (uint32_t)o->page_tokens,
                                   .pages = pages,
                                   .n_pages = (uint32_t)o->n,
                                   .tokens = o->tokens};
    _Static_assert(KM_PROTO_LEASE_KEY == PR_KEY_BYTES, "one lease key size");
    memcpy(m.kv_offer.key, o->key, PR_KEY_BYTES);
    km_errbuf err = {{0}};
    if (km_msg_encode(&m, &s->lim, &p->out, &err))
        KM_WARN("peer_offer_encode", "pull=%llu msg=\"%s\"", (unsigned long long)o->pull_id,
                err.msg);
    else
        wk_svc_send(s, s->router, env, n_env, &p->out);
    free(pages);
}

/* The connection a frame came on, as a tag (FNV-1a over its routing envelope): the holder's
 * ROUTER assigns the routing id, so a peer cannot take another's. */
static uint64_t wk_peer_requester(const km_zframe *env, int n_env)
{
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n_env; i++) {
        const uint8_t *b = env[i].data;
        for (size_t k = 0; k < env[i].len; k++) h = (h ^ b[k]) * 1099511628211ull;
        h = (h ^ 0xff) * 1099511628211ull; /* frame boundary */
    }
    return h ? h : 1; /* 0 would mean "anyone's" */
}

static void wk_peer_serve(wk_service *s, const km_zframe *env, int n_env, const km_msg_kv_pull *q)
{
    wk_peer *p = s->peer;
    pr_offer refuse = {.pull_id = q->id, .status = KM_EOVERLOAD};
    if (p->n_serves == WK_PEER_SERVES) {
        wk_peer_send_offer(s, env, n_env, &refuse);
        return;
    }
    p->last_pull_ns = km_now_ns();
    wk_serve *sv = &p->serves[p->n_serves];
    if (wk_env_copy(sv->env, sv->env_len, env, n_env)) return;
    km_pagehash *hs = malloc(sizeof *hs * q->n_pages);
    if (!hs) {
        refuse.status = KM_ENOMEM;
        wk_peer_send_offer(s, env, n_env, &refuse);
        return;
    }
    for (uint32_t i = 0; i < q->n_pages; i++)
        hs[i] = km_pagehash_from_canonical(q->hashes + 16 * i);
    if (q->n_pages) wk_peer_pushed_pulled(p, hs[q->n_pages - 1]);
    sv->pull_id = q->id;
    sv->n_env = n_env;
    sv->at_ns = km_now_ns();
    p->n_serves++;
    pr_pull_req req = {.pull_id = q->id,
                       .requester = wk_peer_requester(env, n_env),
                       .first = (int)q->first,
                       .n_pages = (int)q->n_pages,
                       .page_tokens = (int)q->page_tokens,
                       .hashes = hs,
                       .tokens = q->tokens};
    pr_serve(p->node, &req); /* a refusal comes out of pr_node_poll like an offer */
    free(hs);
}

void wk_peer_handle(wk_service *s, void *sock, const km_zframe *env, int n_env, const km_msg *m)
{
    (void)sock;
    wk_peer *p = s->peer;
    if (m->type == KM_MSG_KV_PULL) {
        if (!p) { /* no node here: a refusal the puller understands */
            km_msg r;
            km_msg_init(&r, KM_MSG_KV_OFFER);
            r.kv_offer.id = m->kv_pull.id;
            r.kv_offer.status = KM_EUNSUPPORTED;
            if (!km_msg_encode(&r, &s->lim, &s->out, NULL))
                wk_svc_send(s, s->router, env, n_env, &s->out);
            return;
        }
        wk_peer_serve(s, env, n_env, &m->kv_pull);
    } else if (m->type == KM_MSG_KV_PUSH) {
        wk_peer_take(s, &m->kv_push, false); /* a drain's handoff */
    } else if (m->type == KM_MSG_KV_WARM && p) {
        wk_peer_warm_answer(s, env, n_env, &m->kv_warm);
    } else if (m->type == KM_MSG_KV_PULL_DONE && p) {
        pr_pull_done d = {.lease_id = m->kv_pull_done.lease_id,
                          .requester = wk_peer_requester(env, n_env),
                          .pages_ok = (int)m->kv_pull_done.pages_ok};
        if (!pr_serve_done(p->node, &d)) km_counter_add(p->s_dones_ignored, 1);
    }
}

/* Offers the node has ready go back to their pullers. */
void wk_peer_offers_out(wk_service *s)
{
    wk_peer *p = s->peer;
    int n;
    do {
        n = pr_node_poll(p->node, p->offers, WK_PEER_OFFERS);
        for (int i = 0; i < n; i++) {
            const pr_offer *o = &p->offers[i];
            for (int k = 0; k < p->n_serves; k++) {
                wk_serve *sv = &p->serves[k];
                if (sv->pull_id != o->pull_id) continue;
                km_zframe env[WK_ENV_MAX];
                int ne = wk_env_view(sv->env, sv->env_len, sv->n_env, env);
                wk_peer_send_offer(s, env, ne, o);
                p->serves[k] = p->serves[--p->n_serves];
                break;
            }
        }
    } while (n == WK_PEER_OFFERS);
    /* a serve whose offer never came (cannot happen with a node that answers every pr_serve;
     * kept bounded anyway) */
    uint64_t now = km_now_ns();
    for (int k = 0; k < p->n_serves;)
        if (now - p->serves[k].at_ns > wk_ms_ns(120000))
            p->serves[k] = p->serves[--p->n_serves];
        else
            k++;
}
