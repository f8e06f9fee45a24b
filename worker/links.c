/*
 * links.c — the puller's links to holders (service_peer_internal.h): a DEALER to a holder's
 * requests endpoint and a transfer-node peer to its address, kept per holder, and a pull started
 * over one (kv_pull out, the entry held until the pull ends). Used by the requests held for a
 * pull (service_peer.c) and by drain handoff and warm-up (service_handoff.c), below both.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker/service_peer_internal.h"

void wk_held_free(wk_held *h)
{
    if (!h) return;
    km_buf_free(&h->frame);
    free(h->hs);
    free(h->tokens);
    free(h->chunks);
    if (h->pd) free(h->pd->hs);
    free(h->pd);
    free(h);
}

void wk_peer_admit_held(wk_service *s, wk_held *h)
{
    km_msg q;
    km_zframe env[WK_ENV_MAX];
    int ne = wk_env_view(h->env, h->env_len, h->n_env, env);
    km_proto_limits big = s->lim;
    big.max_frame = (size_t)-1;
    big.max_prompt_tok = UINT32_MAX;
    if (km_msg_decode(h->frame.data, h->frame.len, &big, &q, NULL) == 0) {
        wk_svc_admit(s, env, ne, &q.req, h->tokens, h->n_tokens, h->arrival_ns);
        km_msg_clear(&q);
    } else {
        wk_svc_send_error(s, s->router, env, ne, h->id, KM_CODE_INTERNAL, 0, "held request lost");
    }
    wk_held_free(h);
}

bool wk_held_env_is(const wk_held *h, const km_zframe *env, int n_env)
{
    if (h->n_env != n_env) return false;
    size_t off = 0;
    for (int j = 0; j < n_env; j++) {
        if (h->env_len[j] != env[j].len || memcmp(h->env + off, env[j].data, env[j].len))
            return false;
        off += h->env_len[j];
    }
    return true;
}

void wk_link_close(wk_peer *p, wk_link *l)
{
    if (l->peer) pr_peer_release(p->node, l->peer);
    l->peer = NULL;
    km_zsock_close(l->sock);
    l->sock = NULL;
}

/* The link to the holder at endpoint/addr: reused, its peer reconnected when it failed or its
 * address changed (a restarted holder), or a new one (the least recently used idle one goes
 * when all are taken). NULL when none can be had. */
wk_link *wk_peer_link(wk_service *s, const char *holder, const char *endpoint, const uint8_t *addr,
                      uint32_t addr_len)
{
    wk_peer *p = s->peer;
    km_errbuf err = {{0}};
    wk_link *l = NULL;
    for (int i = 0; i < p->n_links && !l; i++)
        if (!strcmp(p->links[i].endpoint, endpoint)) l = &p->links[i];
    if (!l) {
        if (p->n_links < WK_PEER_LINKS) {
            l = &p->links[p->n_links++];
        } else {
            for (int i = 0; i < p->n_links; i++)
                if (!p->links[i].pulls && (!l || p->links[i].used_ns < l->used_ns))
                    l = &p->links[i];
            if (!l) return NULL;
            wk_link_close(p, l);
        }
        memset(l, 0, sizeof *l);
        snprintf(l->endpoint, sizeof l->endpoint, "%s", endpoint);
        snprintf(l->holder, sizeof l->holder, "%s", holder ? holder : "");
        km_zsock_opts zo;
        km_zsock_opts_default(&zo);
        zo.max_msg_size = (int64_t)s->lim.max_frame + 4096;
        /* CURVE (docs/security.md): the holder is a member whose key is bound to its worker id,
         * looked up by that id only (never a key or a file a frame named) */
        if (km_zsock_open(s->zctx, KM_ZDEALER, &zo, &l->sock, &err) ||
            km_zsec_client_worker(s->o.sec, l->sock, holder, &err) ||
            km_zsock_connect(l->sock, endpoint, &err)) {
            KM_WARN("peer_link", "endpoint=%s msg=\"%s\"", endpoint, err.msg);
            km_zsock_close(l->sock);
            l->sock = NULL;
            l->endpoint[0] = 0;
            return NULL;
        }
    }
    bool moved = l->addr_len != addr_len || memcmp(l->addr, addr, addr_len);
    if (l->peer && (moved || pr_peer_failed(l->peer)) && !l->pulls) {
        pr_peer_release(p->node, l->peer);
        l->peer = NULL;
    }
    if (!l->peer) {
        if (pr_peer_connect(p->node, addr, addr_len, &l->peer, &err)) {
            KM_WARN("peer_connect", "endpoint=%s msg=\"%s\"", endpoint, err.msg);
            l->peer = NULL;
            return NULL;
        }
        memcpy(l->addr, addr, addr_len);
        l->addr_len = addr_len;
    } else if (moved || pr_peer_failed(l->peer)) {
        return NULL; /* its old peer is still in use by another pull */
    }
    if (holder && strcmp(l->holder, holder)) { /* another worker at that endpoint now */
        snprintf(l->holder, sizeof l->holder, "%s", holder);
        l->rate_bps = l->lat_ms = 0;
    }
    l->used_ns = km_now_ns();
    return l;
}

int wk_peer_not_started(wk_peer *p, const wk_link *l)
{
    p->pulls_failed++;
    km_counter_inc(p->s_pulls[WK_PULL_FAILED]);
    KM_DEBUG("pull_not_started", "holder=%s", l && l->holder[0] ? l->holder : "-");
    return -1;
}

/* Starts h's pull of chain [0, n_pages) (hashes hs, token ids toks) from the holder at l, by its
 * deadline: sends kv_pull, and h is held until the pull ends. Returns the pages already held
 * here, or -1 when nothing was started (every page is here, or a failure): h is not held. */
int wk_peer_start(wk_service *s, wk_link *l, wk_held *h, const km_pagehash *hs, const int32_t *toks,
                  int n_pages)
{
    wk_peer *p = s->peer;
    pr_pull_req req;
    int held = pr_pull_start(p->node, l->peer, hs, toks, n_pages, h->deadline_ns, &h->pull, &req);
    if (held >= 0 && !h->pull) return -1; /* every page is here: no pull */
    if (held < 0) return wk_peer_not_started(p, l);
    uint8_t *canon = malloc((size_t)req.n_pages * 16);
    km_msg m;
    km_msg_init(&m, KM_MSG_KV_PULL);
    for (int i = 0; canon && i < req.n_pages; i++)
        km_pagehash_canonical(req.hashes[i], canon + 16 * i);
    m.kv_pull = (km_msg_kv_pull){.id = req.pull_id,
                                 .first = (uint32_t)req.first,
                                 .n_pages = (uint32_t)req.n_pages,
                                 .page_tokens = (uint32_t)req.page_tokens,
                                 .hashes = canon,
                                 .tokens = req.tokens};
    km_zframe f;
    if (!canon || km_msg_encode(&m, &s->lim, &p->out, NULL) ||
        (f = (km_zframe){p->out.data, p->out.len}, km_zsend(l->sock, &f, 1, KM_ZDONTWAIT, NULL))) {
        pr_pull_finish(p->node, h->pull, NULL, NULL);
        h->pull = NULL;
        free(canon);
        return wk_peer_not_started(p, l);
    }
    free(canon);
    h->pull_id = req.pull_id;
    h->link = l;
    h->n_pages = n_pages;
    h->start_ns = km_now_ns();
    l->pulls++;
    p->held[p->n_held++] = h;
    return held;
}
