/*
 * service_peer.c — KV pages between workers, the worker's side (service_internal.h; the design
 * is docs/transfer.md, the frames docs/protocol.md section 17). With --peer-listen the worker
 * runs one transfer node (peer/peer.h) over its store, created with the page arena:
 *
 *  - As a holder (service_serve.c): a `kv_pull` on the requests ROUTER pins the pages it holds;
 *    the `kv_offer` goes back when the node yields it; `kv_pull_done` ends the lease.
 *  - As a puller: a `req` with a pull hint is held, not scheduled. Its prompt's page chain is
 *    computed exactly as the scheduler will (same seed: model fingerprint, cluster seed,
 *    cache_salt), the pull starts against the hinted holder (a DEALER to its requests endpoint,
 *    a node peer to its address, both kept per holder), and `kv_pull` goes out. When the pull
 *    ends (every page read, a refusal, a failure, or its deadline: the hint's pull_ms, within the
 *    request's own deadline) it is finished, the pages that passed every check are in the store
 *    as if computed here, and the request is admitted: the scheduler's prefix lookup finds them.
 *    A failed pull is a slower request, never a failed one.
 *
 *  - Drain handoff and warm-up (service_handoff.c) use the same node: a chain a peer pushes is
 *    pulled in the background as a held entry with no request behind it.
 *
 * Everything runs on the service's thread, between engine steps; nothing here waits for the
 * network (the node's own thread moves the bytes). The loop's poll includes the node's wait fd
 * and the links to holders (wk_peer_poll_items), so a finished pull or an offer wakes it at
 * once, and it also looks at most 1 ms apart while a request is held (deadlines).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker/service_peer_internal.h"

static const char *const wk_handoff_outcomes[WK_HO_OUTCOMES] = {"pushed", "taken", "dropped",
                                                                "present"};

static const char *const wk_pull_outcomes[WK_PULL_OUTCOMES] = {"ok", "partial", "failed",
                                                               "present"};

static const char *const wk_hint_refusals[2] = {"sender", "holder"};

/* ---------------------------------------------------------------- create / destroy */

static int wk_peer_metrics(wk_service *s, wk_peer *p, km_errbuf *err)
{
    km_metric *m;
    int rc;
#define PREG(kind, name, help, labels, bounds, nb)                                                 \
    do {                                                                                           \
        rc = km_metric_register(s->reg, kind, name, help, labels, bounds, nb, &m, err);            \
        if (rc) return rc;                                                                         \
    } while (0)
    static const double sec_b[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                   0.1,    0.25,  0.5,    1,     2.5,  5,     10};
    PREG(KM_COUNTER, "kvmesh_kv_transfer_bytes_total",
         "KV page payload moved between workers, by direction (in: pulled here, out: read from "
         "here).",
         "direction", NULL, 0);
    const char *dir[2] = {"in", "out"};
    p->s_bytes_in = km_metric_series(m, &dir[0]);
    p->s_bytes_out = km_metric_series(m, &dir[1]);
    PREG(KM_HISTOGRAM, "kvmesh_kv_transfer_seconds",
         "Time a pull held its request: from the pull's start to its end.", NULL, sec_b,
         (int)(sizeof sec_b / sizeof sec_b[0]));
    p->s_seconds = km_metric_series(m, NULL);
    PREG(KM_COUNTER, "kvmesh_kv_transfer_pulls_total",
         "Pulls this worker made, by outcome (ok: every wanted page, partial: some, failed: "
         "none, present: every offered page arrived but another pull or a computation had "
         "brought it here first).",
         "outcome", NULL, 0);
    for (int i = 0; i < WK_PULL_OUTCOMES; i++)
        p->s_pulls[i] = km_metric_series(m, &wk_pull_outcomes[i]);
    PREG(KM_COUNTER, "kvmesh_kv_transfer_failures_total",
         "Pages dropped by a pull, by reason (tokens, chain, format, checksum, transfer, timeout, "
         "nonfinite: a value or scale that is an infinity or a NaN, auth: an answer that failed "
         "its tag), "
         "and pulls refused by the holder (refused) or never answered (no_offer).",
         "reason", NULL, 0);
    for (int i = 0; i < PR_DROP_COUNT; i++) {
        const char *r = pr_drop_name((pr_drop)i);
        p->s_fail[i] = km_metric_series(m, &r);
    }
    const char *refused = "refused", *no_offer = "no_offer";
    p->s_fail[PR_DROP_COUNT] = km_metric_series(m, &refused);
    p->s_fail[PR_DROP_COUNT + 1] = km_metric_series(m, &no_offer);
    PREG(KM_COUNTER, "kvmesh_kv_transfer_reads_refused_total",
         "Reads of this worker's pages it refused as a holder: the page was not offered by a live "
         "lease of that pull (a peer probing the KV memory, or a read after its lease ran out).",
         NULL, NULL, 0);
    p->s_refused = km_metric_series(m, NULL);
    PREG(KM_COUNTER, "kvmesh_kv_transfer_dones_ignored_total",
         "kv_pull_done frames that ended no lease here: late (the lease had run out) or sent by "
         "another connection than the one that asked for the pull (only the requester can end "
         "it).",
         NULL, NULL, 0);
    p->s_dones_ignored = km_metric_series(m, NULL);
    PREG(KM_COUNTER, "kvmesh_kv_page_plane_rejected_total",
         "What the page plane (the UCX port) dropped unanswered, by reason: unkeyed (a read whose "
         "token matched no lease), over_bound (a read past the answers a connection may have "
         "queued), forged (an answer to our read with a wrong token or tag), unknown_am (a "
         "message of an id the plane does not use).",
         "reason", NULL, 0);
    static const char *plane[4] = {"unkeyed", "over_bound", "forged", "unknown_am"};
    for (int i = 0; i < 4; i++) p->s_plane[i] = km_metric_series(m, &plane[i]);
    PREG(KM_COUNTER, "kvmesh_kv_pull_hints_refused_total",
         "Pull hints this worker did not follow, by reason: sender (the request did not come from "
         "a router's member key) or holder (the hint named no worker of the controller's view); "
         "the request is computed here instead.",
         "reason", NULL, 0);
    for (int i = 0; i < 2; i++) p->s_hints_refused[i] = km_metric_series(m, &wk_hint_refusals[i]);
    PREG(KM_GAUGE, "kvmesh_kv_peer_view_workers",
         "Other workers with a transfer node in the controller's last view (--peer-view): the "
         "holders a pull hint may name and the peers a drain may hand pages to.",
         NULL, NULL, 0);
    p->s_view_peers = km_metric_series(m, NULL);
    PREG(KM_COUNTER, "kvmesh_kv_handoff_chains_total",
         "Drain handoff and warm-up, in chains: pushed (sent to peers: this worker's drain "
         "handoff, or its answer to a peer's warm-up), taken (pushed here, a background pull "
         "started), dropped (pushed here but not taken: too many waiting, no room, the warm-up "
         "budget spent, or a failure) and present (pushed here, every page already here: "
         "pulled by an earlier chain, or by a pull that brought it meanwhile).",
         "outcome", NULL, 0);
    for (int i = 0; i < WK_HO_OUTCOMES; i++)
        p->s_handoff[i] = km_metric_series(m, &wk_handoff_outcomes[i]);
    PREG(KM_COUNTER, "kvmesh_kv_transfer_chunk_pages_total",
         "Pages of chunks (position-free KV of documents, docs/blend.md) pulled here from other "
         "workers, each chunk's preamble page included; also counted in the pull totals.",
         NULL, NULL, 0);
    p->s_chunk_pages = km_metric_series(m, NULL);
    PREG(KM_COUNTER, "kvmesh_kv_transfer_chunk_bytes_total",
         "Payload bytes of the chunk pages pulled here (part of "
         "kvmesh_kv_transfer_bytes_total{direction=\"in\"}).",
         NULL, NULL, 0);
    p->s_chunk_bytes = km_metric_series(m, NULL);
#undef PREG
    return 0;
}

/* The chunk preamble's first page, as the scheduler and the routers make it (KM_CHUNK_PREAMBLE):
 * a chunk's chain starts with it. Without a tokenizer or a whole page, no chunk is pulled. */
static void wk_peer_chunk_setup(wk_service *s, wk_peer *p)
{
    const int pt = kv_store_page_tokens(s->kv);
    int32_t ids[256];
    int n =
        s->tok ? md_tok_encode(s->tok, KM_CHUNK_PREAMBLE, strlen(KM_CHUNK_PREAMBLE), 0, 1, ids, 256)
               : 0;
    if (pt < 1 || pt > 256 || n < pt || !(p->chunk_pre = malloc(sizeof *p->chunk_pre * pt))) return;
    memcpy(p->chunk_pre, ids, sizeof *p->chunk_pre * pt);
}

/* "HOST:PORT", "HOST" or ":PORT" into the node's listening host and port. */
static int wk_peer_listen_parse(const char *spec, char *host, size_t cap, int *port)
{
    const char *colon = strrchr(spec, ':');
    size_t hl = colon ? (size_t)(colon - spec) : strlen(spec);
    if (hl >= cap) return KM_EINVAL;
    memcpy(host, spec, hl);
    host[hl] = 0;
    if (!hl) snprintf(host, cap, "0.0.0.0");
    *port = 0;
    if (colon) {
        char *end;
        long v = strtol(colon + 1, &end, 10);
        if (*end || v < 0 || v > 65535) return KM_EINVAL;
        *port = (int)v;
    }
    return 0;
}

int wk_peer_create(wk_service *s, km_errbuf *err)
{
    const wk_service_opts *o = &s->o;
    if (!o->peer_listen || !o->peer_listen[0]) return 0;
    wk_peer *p = calloc(1, sizeof *p);
    if (!p) return km_errf(err, KM_ENOMEM, "peer: out of memory");
    s->peer = p;
    int port = 0, rc;
    if (wk_peer_listen_parse(o->peer_listen, p->listen_host, sizeof p->listen_host, &port))
        return km_errf(err, KM_EINVAL, "--peer-listen %s: expected HOST:PORT", o->peer_listen);
    snprintf(p->advertise_host, sizeof p->advertise_host, "%s",
             o->peer_advertise && o->peer_advertise[0] ? o->peer_advertise : "127.0.0.1");
    pr_mode mode = PR_MODE_AM;
    if (o->peer_mode && !strcmp(o->peer_mode, "get"))
        mode = PR_MODE_GET;
    else if (o->peer_mode && o->peer_mode[0] && strcmp(o->peer_mode, "am"))
        return km_errf(err, KM_EINVAL, "--peer-mode %s: expected am or get", o->peer_mode);
    pr_encrypt enc = PR_ENCRYPT_AUTO;
    if (o->peer_encrypt && !strcmp(o->peer_encrypt, "on"))
        enc = PR_ENCRYPT_ON;
    else if (o->peer_encrypt && !strcmp(o->peer_encrypt, "off"))
        enc = PR_ENCRYPT_OFF;
    else if (o->peer_encrypt && o->peer_encrypt[0] && strcmp(o->peer_encrypt, "auto"))
        return km_errf(err, KM_EINVAL, "--peer-encrypt %s: expected on, off or auto",
                       o->peer_encrypt);
    pr_config pc = {.store = s->kv,
                    .mode = mode,
                    .listen_host = p->listen_host,
                    .listen_port = port,
                    .advertise_host = p->advertise_host,
                    .lease_ms = o->peer_lease_ms,
                    .encrypt = enc,
                    .prefault_bytes = o->peer_no_prefault ? -1 : 0};
    if ((rc = pr_node_create(&pc, &p->node, err))) return rc;
    if ((rc = pr_node_address(p->node, &p->addr, &p->addr_len))) {
        km_errf(err, rc, "peer: no node address");
        return rc;
    }
    if ((rc = wk_peer_metrics(s, p, err)) || (rc = wk_pd_metrics(s, p, err))) return rc;
    wk_peer_chunk_setup(s, p);
    p->warm_pages = o->peer_warm_pages < 0 ? kv_store_pages_total(s->kv) / 4 : o->peer_warm_pages;
    p->warm_left = p->warm_pages;
    if (o->peer_view && o->peer_view[0]) {
        km_zsock_opts zo;
        km_zsock_opts_default(&zo);
        /* the view's members are the controller's: only its key may publish it */
        if ((rc = km_zsock_open(s->zctx, KM_ZSUB, &zo, &p->vsub, err)) ||
            (rc = km_zsock_subscribe(p->vsub, "view", 4, err)) ||
            (rc = km_zsec_client(o->sec, p->vsub, "controller", err)) ||
            (rc = km_zsock_connect(p->vsub, o->peer_view, err)))
            return rc;
    }
    KM_INFO("peer_ready", "worker=%s listen=%s:%d advertise=%s mode=%s addr_bytes=%zu",
            s->worker_id, p->listen_host, port, p->advertise_host,
            mode == PR_MODE_GET ? "get" : "am", p->addr_len);
    return 0;
}

void wk_peer_destroy(wk_service *s)
{
    wk_peer *p = s->peer;
    if (!p) return;
    for (int i = 0; i < p->n_held; i++) {
        if (p->held[i]->pull) pr_pull_finish(p->node, p->held[i]->pull, NULL, NULL);
        wk_held_free(p->held[i]);
    }
    wk_peer_bg_drop(p);
    for (int i = 0; i < p->n_links; i++) wk_link_close(p, &p->links[i]);
    pr_node_destroy(p->node);
    km_zsock_close(p->vsub);
    km_zmsg_clear(&p->vin);
    km_zmsg_clear(&p->in);
    km_buf_free(&p->out);
    free(p->pushed);
    free(p->chunk_pre);
    free(p);
    s->peer = NULL;
}

/* ---------------------------------------------------------------- puller side */

/* The request q again, without its hint, in h->frame (decoded again when admitted). */
static int wk_held_keep(wk_service *s, wk_held *h, const km_msg_request *q, const int32_t *toks,
                        int n_tok)
{
    km_msg m;
    km_msg_init(&m, KM_MSG_REQUEST);
    m.req = *q;
    m.req.pull_from = NULL;
    m.req.prompt = NULL; /* its token ids are kept instead: no second tokenization */
    m.req.prompt_len = 0;
    m.req.tokens = toks;
    m.req.n_tokens = (uint32_t)n_tok;
    h->tokens = malloc(sizeof *h->tokens * (size_t)n_tok);
    if (!h->tokens) return KM_ENOMEM;
    memcpy(h->tokens, toks, sizeof *h->tokens * (size_t)n_tok);
    h->n_tokens = n_tok;
    km_proto_limits big = s->lim;
    big.max_frame = (size_t)-1;
    big.max_prompt_tok = UINT32_MAX;
    return km_msg_encode(&m, &big, &h->frame, NULL);
}

/* May this sender give pull hints: a router's member key (a member bound to no worker id). A
 * client's hint is stripped by its router; a worker's or an operator's key never sends one. */
static bool wk_hint_sender_ok(const wk_service *s, const km_zpeer *peer)
{
    if (km_zsec_insecure(s->o.sec)) return true;
    return peer && peer->role == KM_ROLE_MEMBER && !peer->worker[0];
}

/* Starts the pull of h's next chunk still to pull through l (its chain: the preamble page, then
 * the chunk's whole pages, as the scheduler caches it); 1 when one runs, 0 when none is left
 * (every other one already here, or not startable). */
static int wk_peer_next_chunk(wk_service *s, wk_link *l, wk_held *h)
{
    const wk_peer *p = s->peer;
    const int pt = kv_store_page_tokens(s->kv);
    if (!l->peer || pr_peer_failed(l->peer)) h->chunks_left = 0; /* the holder is gone */
    /* this holder's chunks done: the next holder's (pull_more), through its own link */
    while (!h->chunks_left && h->n_more) {
        l = h->more_link[0];
        h->chunks_left = l->peer && !pr_peer_failed(l->peer) ? h->more_chunks[0] : 0;
        h->n_more--;
        memmove(h->more_link, h->more_link + 1, sizeof *h->more_link * (size_t)h->n_more);
        memmove(h->more_chunks, h->more_chunks + 1, sizeof *h->more_chunks * (size_t)h->n_more);
    }
    while (h->chunks_left) {
        const km_chunk_seg *g = &h->chunks[__builtin_ctzll(h->chunks_left)];
        h->chunks_left &= h->chunks_left - 1;
        const int n_pages = 1 + (int)(g->n / (uint32_t)pt);
        if (g->n < (uint32_t)pt || n_pages > PR_MAX_PAGES ||
            (uint64_t)g->start + g->n > (uint64_t)h->n_tokens)
            continue;
        int32_t *tk = malloc(sizeof *tk * (size_t)n_pages * pt);
        km_pagehash *hs = malloc(sizeof *hs * (size_t)n_pages);
        int held = -1;
        if (tk && hs) {
            memcpy(tk, p->chunk_pre, sizeof *tk * pt);
            memcpy(tk + pt, h->tokens + g->start, sizeof *tk * (size_t)(n_pages - 1) * pt);
            km_pagehash_chain(h->chunk_seed, tk, n_pages * pt, pt, hs, n_pages);
            h->pull = NULL, h->offer_ns = 0, h->end_now = false, h->chunk_pull = true;
            held = wk_peer_start(s, l, h, hs, tk, n_pages);
            if (held >= 0) pr_pull_position_free(p->node, h->pull); /* kvshard's chunk flag */
        }
        free(tk);
        free(hs);
        if (held >= 0) return 1;
        if (!h->chunks_left && h->n_more) return wk_peer_next_chunk(s, l, h);
    }
    return 0;
}

int wk_peer_park(wk_service *s, const km_zframe *env, int n_env, const km_msg_request *q,
                 const km_zpeer *peer, const int32_t *toks, int n_tok, uint64_t now)
{
    wk_peer *p = s->peer;
    if (!p) return 0;
    if (!wk_hint_sender_ok(s, peer)) {
        km_counter_inc(p->s_hints_refused[0]);
        KM_WARN("pull_hint_refused", "id=%llu reason=sender role=%s key=%s",
                (unsigned long long)q->id, km_role_name(peer ? peer->role : 0),
                peer && peer->name[0] ? peer->name : "-");
        return 0;
    }
    if (p->n_held == WK_PEER_HELD) return 0;
    const int pt = kv_store_page_tokens(s->kv);
    int n_pages = (int)q->pull_pages;
    if (n_pages > n_tok / pt) n_pages = n_tok / pt;
    if (n_pages > PR_MAX_PAGES) n_pages = PR_MAX_PAGES;
    /* the chunks to pull: never the last one (computed in full, docs/blend.md) */
    const uint64_t reusable =
        p->chunk_pre && q->n_chunks > 1 && !q->pd ? (1ull << (q->n_chunks - 1)) - 1 : 0;
    const uint64_t chunks = q->pull_chunks & reusable;
    uint64_t more = 0;
    for (uint32_t k = 0; k < q->n_pull_more; k++) more |= q->pull_more[k].chunks & reusable;
    if (n_pages < 1 && !chunks && !more) return 0;
    if (!wk_peer_member(s, q->pull_from)) {
        km_counter_inc(p->s_hints_refused[1]);
        KM_WARN("pull_hint_refused", "id=%llu reason=holder holder=%.64s",
                (unsigned long long)q->id, q->pull_from);
        return 0;
    }
    wk_link *l = wk_peer_link_member(s, q->pull_from);
    if (!l) {
        wk_peer_not_started(p, NULL); /* and the request is computed */
        return 0;
    }
    wk_held *h = calloc(1, sizeof *h);
    km_pagehash *hs = malloc(sizeof *hs * (size_t)(n_pages > 0 ? n_pages : 1));
    if (!h || !hs || wk_env_copy(h->env, h->env_len, env, n_env) ||
        wk_held_keep(s, h, q, toks, n_tok))
        goto admit_now;
    h->n_env = n_env;
    km_pagehash seed = km_pagehash_seed(s->fp, strlen(s->fp), s->o.sched.cluster_seed,
                                        q->cache_salt, q->cache_salt ? strlen(q->cache_salt) : 0);
    if (n_pages > 0) km_pagehash_chain(seed, toks, n_pages * pt, pt, hs, n_pages);
    if ((chunks || more) && (h->chunks = malloc(sizeof *h->chunks * q->n_chunks))) {
        memcpy(h->chunks, q->chunks, sizeof *h->chunks * q->n_chunks);
        h->n_chunks = (int)q->n_chunks;
        h->chunks_left = chunks;
        h->chunk_seed = km_pagehash_chunk_seed(seed);
        /* the other holders: each in the view, with a link, or its chunks computed */
        for (uint32_t k = 0; k < q->n_pull_more; k++) {
            const km_pull_more *m = &q->pull_more[k];
            wk_link *ml = m->chunks & reusable && wk_peer_member(s, m->from)
                              ? wk_peer_link_member(s, m->from)
                              : NULL;
            if (!ml) continue;
            h->more_link[h->n_more] = ml;
            h->more_chunks[h->n_more++] = m->chunks & reusable;
        }
    }
    /* the budget: the hint's, else the worker's default, and never more than half of what is
     * left of the request's own deadline (the rest is for computing what the pull missed) */
    uint64_t budget_ms = q->pull_ms ? q->pull_ms : (uint64_t)s->o.peer_pull_ms;
    if (!budget_ms) budget_ms = 2000;
    if (q->deadline_ms && budget_ms > q->deadline_ms / 2) budget_ms = q->deadline_ms / 2;
    h->deadline_ns = now + wk_ms_ns((int64_t)budget_ms);
    h->id = q->id;
    h->arrival_ns = now;
    int held = n_pages > 0 ? wk_peer_start(s, l, h, hs, toks, n_pages) : -1;
    if (held >= 0 && q->pd) wk_pd_begin(s, l, h, q, hs);
    /* a failure, or every page already here: the chunks, if any, else the request runs now */
    if (held < 0 && !wk_peer_next_chunk(s, l, h)) goto admit_now;
    KM_DEBUG("pull_start",
             "id=%llu from=%s pages=%d held_here=%d chunks=%#llx more=%#llx budget_ms=%llu",
             (unsigned long long)q->id, q->pull_from, n_pages, held, (unsigned long long)chunks,
             (unsigned long long)more, (unsigned long long)budget_ms);
    free(hs);
    return 1;
admit_now:
    wk_held_free(h);
    free(hs);
    return 0;
}

int wk_peer_held(const wk_service *s)
{
    return s->peer ? s->peer->n_held : 0;
}

bool wk_peer_serving(const wk_service *s, uint64_t now, uint64_t quiet_ns)
{
    const wk_peer *p = s->peer;
    if (!p) return false;
    if (p->n_serves || (p->last_pull_ns && now - p->last_pull_ns < quiet_ns)) return true;
    pr_stats st;
    pr_node_stats(p->node, &st);
    return st.leases_active > 0;
}

/* An exponentially weighted mean over recent pulls that brought pages. */
static void wk_rate_mix(double *rate_bps, double *lat_ms, double rate, double lat)
{
    const double a = 0.3;
    *rate_bps = *rate_bps > 0 ? (1 - a) * *rate_bps + a * rate : rate;
    *lat_ms = *lat_ms > 0 ? (1 - a) * *lat_ms + a * lat : lat;
}

/* The measured rates: the worker's over every holder, and the pair's (this holder's link). */
static void wk_peer_measure(wk_peer *p, const wk_held *h, const pr_pull_result *res, uint64_t now)
{
    if (!h->offer_ns || !res->pages_imported || !res->bytes) return;
    double lat = (double)(h->offer_ns - h->start_ns) / 1e6;
    double t = (double)(now > h->offer_ns ? now - h->offer_ns : 1) / 1e9;
    double rate = (double)res->bytes / t;
    wk_rate_mix(&p->rate_bps, &p->lat_ms, rate, lat);
    if (h->link) wk_rate_mix(&h->link->rate_bps, &h->link->lat_ms, rate, lat);
}

/* The pull of held request i has ended (or is given up): finished, the holder told, the request
 * admitted. */
static void wk_peer_release(wk_service *s, int i)
{
    wk_peer *p = s->peer;
    wk_held *h = p->held[i];
    p->held[i] = p->held[--p->n_held];
    uint64_t now = km_now_ns();
    pr_pull_result res = {0};
    pr_pull_done done = {0};
    if (h->pull) pr_pull_finish(p->node, h->pull, &res, &done);
    wk_link *l = h->link;
    l->pulls--;
    if (done.lease_id && l->sock) {
        km_msg m;
        km_msg_init(&m, KM_MSG_KV_PULL_DONE);
        m.kv_pull_done =
            (km_msg_kv_pull_done){.lease_id = done.lease_id, .pages_ok = (uint32_t)done.pages_ok};
        if (!km_msg_encode(&m, &s->lim, &p->out, NULL)) {
            km_zframe f = {p->out.data, p->out.len};
            km_zsend(l->sock, &f, 1, KM_ZDONTWAIT, NULL);
        }
    }
    int wanted = res.pages_wanted;
    int outcome = res.pages_imported && res.pages_imported >= wanted ? WK_PULL_OK
                  : res.pages_imported                               ? WK_PULL_PARTIAL
                  : !res.status && res.pages_offered                 ? WK_PULL_PRESENT
                                                                     : WK_PULL_FAILED;
    /* a disaggregated request's round that found no page sealed yet is no failed pull */
    bool counted = !h->pd || res.pages_offered;
    if (counted) {
        if (outcome != WK_PULL_FAILED)
            p->pulls_ok++;
        else
            p->pulls_failed++;
        km_counter_inc(p->s_pulls[outcome]);
    }
    km_counter_add(p->s_bytes_in, res.bytes);
    if (h->chunk_pull) {
        km_counter_add(p->s_chunk_pages, (uint64_t)res.pages_imported);
        km_counter_add(p->s_chunk_bytes, res.bytes);
    }
    km_hist_observe(p->s_seconds, (double)(now - h->start_ns) / 1e9);
    for (int d = 0; d < PR_DROP_COUNT; d++)
        if (res.dropped[d]) km_counter_add(p->s_fail[d], (uint64_t)res.dropped[d]);
    if (counted && !h->offer_ns)
        km_counter_inc(p->s_fail[h->end_now ? PR_DROP_COUNT : PR_DROP_COUNT + 1]);
    else if (counted && !res.pages_offered)
        km_counter_inc(p->s_fail[PR_DROP_COUNT]);
    wk_peer_measure(p, h, &res, now);
    KM_INFO("pull_done",
            "id=%llu pull=%llu pages=%d local=%d wanted=%d offered=%d imported=%d bytes=%llu "
            "ms=%.1f offer_ms=%.1f status=%s outcome=%s handoff=%d chunk=%d",
            (unsigned long long)h->id, (unsigned long long)h->pull_id, h->n_pages, res.pages_local,
            wanted, res.pages_offered, res.pages_imported, (unsigned long long)res.bytes,
            (double)(now - h->start_ns) / 1e6,
            h->offer_ns ? (double)(h->offer_ns - h->start_ns) / 1e6 : -1.0,
            res.status ? km_strerror(res.status) : "ok", wk_pull_outcomes[outcome], h->background,
            h->chunk_pull);
    if (l->peer && pr_peer_failed(l->peer) && !l->pulls) {
        pr_peer_release(p->node, l->peer); /* the next pull connects again */
        l->peer = NULL;
    }
    if (h->background) { /* a handoff taken: no request to admit */
        wk_peer_bg_end(s, h, &res);
        return;
    }
    if (h->pd && wk_pd_round_end(s, h, &res)) return; /* the prefill goes on: another round */
    /* the next chunk, while the budget lasts (a request canceled or handed back runs now) */
    if ((h->chunks_left || h->n_more) && now < h->deadline_ns && wk_peer_next_chunk(s, l, h))
        return;
    wk_peer_admit_held(s, h);
}

static wk_held *wk_peer_find(wk_peer *p, const wk_link *l, uint64_t pull_id)
{
    for (int i = 0; i < p->n_held; i++)
        if (p->held[i]->pull_id == pull_id && p->held[i]->link == l) return p->held[i];
    return NULL;
}

/* A holder's answer on link l. */
static void wk_peer_answer(wk_service *s, wk_link *l, const km_zmsg *zm)
{
    wk_peer *p = s->peer;
    const km_zframe *body = km_zmsg_body(zm);
    if (!body) return;
    km_msg m;
    km_errbuf err = {{0}};
    if (km_msg_decode(body->data, body->len, &s->lim, &m, &err)) {
        wk_held *h = wk_peer_find(p, l, m.rejected_id);
        if (h) h->end_now = true;
        KM_WARN("peer_bad_answer", "endpoint=%s msg=\"%s\"", l->endpoint, err.msg);
        return;
    }
    if (wk_pd_answer(s, l, &m)) { /* the prefill this worker asked for (service_pd.c) */
        km_msg_clear(&m);
        return;
    }
    if (m.type == KM_MSG_KV_OFFER) {
        const km_msg_kv_offer *o = &m.kv_offer;
        wk_held *h = wk_peer_find(p, l, o->id);
        if (h && !h->offer_ns) {
            h->offer_ns = km_now_ns();
            pr_page_desc *pd = o->n_pages ? calloc(o->n_pages, sizeof *pd) : NULL;
            for (uint32_t i = 0; pd && i < o->n_pages; i++) {
                const km_kv_page_desc *d = &o->pages[i];
                pd[i] = (pr_page_desc){.index = (int32_t)d->index,
                                       .format = (int32_t)d->format,
                                       .hash = km_pagehash_from_canonical(d->hash),
                                       .parent = km_pagehash_from_canonical(d->parent),
                                       .region = d->region,
                                       .addr = d->addr,
                                       .bytes = d->bytes,
                                       .checksum = d->checksum};
            }
            pr_offer po = {.pull_id = o->id,
                           .lease_id = o->lease_id,
                           .status = o->status,
                           .lease_ms = (int)o->lease_ms,
                           .n = pd ? (int)o->n_pages : 0,
                           .page_tokens = (int)o->page_tokens,
                           .pages = pd,
                           .tokens = o->tokens};
            memcpy(po.key, o->key, PR_KEY_BYTES);
            if (!po.n && !po.status) po.status = KM_ENOTFOUND;
            pr_pull_offer(p->node, h->pull, &po);
            if (po.status || !po.n) h->end_now = true;
            free(pd);
        }
    } else if (m.type == KM_MSG_ERROR) { /* a worker without page transfer */
        wk_held *h = wk_peer_find(p, l, m.error.id);
        if (h) h->end_now = true;
        for (int i = 0; !h && m.error.id == 0 && i < p->n_held; i++)
            if (p->held[i]->link == l && !p->held[i]->offer_ns) p->held[i]->end_now = true;
    } else if (m.type == KM_MSG_KV_PUSH) { /* the answer to our warm-up */
        wk_peer_take(s, &m.kv_push, true);
    }
    km_msg_clear(&m);
}

_Static_assert(WK_PEER_POLL_MAX == 1 + WK_PEER_LINKS, "the loop's poll items: wait fd + links");

int wk_peer_poll_items(const wk_service *s, km_zpollitem *items, int max)
{
    const wk_peer *p = s->peer;
    int n = 0;
    if (!p || max < 1) return 0;
    items[n++] = (km_zpollitem){.fd = pr_node_wait_fd(p->node), .events = KM_ZPOLLIN};
    for (int i = 0; i < p->n_links && n < max; i++)
        if (p->links[i].sock)
            items[n++] = (km_zpollitem){.sock = p->links[i].sock, .events = KM_ZPOLLIN};
    return n;
}

void wk_peer_poll(wk_service *s)
{
    wk_peer *p = s->peer;
    if (!p) return;
    for (int i = 0; i < p->n_links; i++) {
        wk_link *l = &p->links[i];
        for (int k = 0; l->sock && k < 64; k++) {
            int rc = km_zrecv(l->sock, &p->in, 0, NULL);
            if (rc == KM_EAGAIN) break;
            if (rc) continue;
            wk_peer_answer(s, l, &p->in);
        }
    }
    km_zmsg_clear(&p->in);
    wk_peer_view_read(s);
    wk_peer_offers_out(s);
    pr_stats st;
    pr_node_stats(p->node, &st);
    if (st.bytes_out > p->seen_out) {
        km_counter_add(p->s_bytes_out, st.bytes_out - p->seen_out);
        p->seen_out = st.bytes_out;
    }
    if (st.fetches_refused > p->seen_refused) {
        km_counter_add(p->s_refused, st.fetches_refused - p->seen_refused);
        p->seen_refused = st.fetches_refused;
    }
    const uint64_t plane[4] = {st.fetches_unkeyed, st.fetches_dropped, st.answers_forged,
                               st.am_unknown};
    for (int i = 0; i < 4; i++)
        if (plane[i] > p->seen_plane[i]) {
            km_counter_add(p->s_plane[i], plane[i] - p->seen_plane[i]);
            p->seen_plane[i] = plane[i];
        }
    uint64_t now = km_now_ns();
    for (int i = 0; i < p->n_held;) {
        wk_held *h = p->held[i];
        /* a holder whose endpoint failed before it offered anything will not offer */
        bool dead = !h->offer_ns && h->link->peer && pr_peer_failed(h->link->peer);
        if (h->end_now || dead || now >= h->deadline_ns || pr_pull_done_yet(p->node, h->pull))
            wk_peer_release(s, i); /* moves the last one into i */
        else
            i++;
    }
    wk_pd_poll(s);
    wk_peer_bg_start(s);
}

int wk_peer_cancel(wk_service *s, const km_zframe *env, int n_env, uint64_t id)
{
    wk_peer *p = s->peer;
    for (int i = 0; p && i < p->n_held; i++) {
        wk_held *h = p->held[i];
        if (h->id != id || !wk_held_env_is(h, env, n_env)) continue;
        wk_pd_stop(h);
        h->chunks_left = 0, h->n_more = 0;
        wk_peer_release(s, i);
        wk_sreq *r = wk_svc_live_find(s, env, n_env, id);
        if (r) en_sched_cancel(s->sched, r->rid);
        return 1;
    }
    return p ? wk_pd_cancel(s, env, n_env, id) : 0;
}

void wk_peer_admit_all(wk_service *s)
{
    if (s->peer) wk_peer_bg_drop(s->peer);
    for (int i = 0; s->peer && i < s->peer->n_held; i++) {
        wk_pd_stop(s->peer->held[i]);
        s->peer->held[i]->chunks_left = 0, s->peer->held[i]->n_more = 0;
    }
    while (s->peer && s->peer->n_held) wk_peer_release(s, s->peer->n_held - 1);
    if (s->peer) wk_pd_admit_all(s);
}

void wk_peer_heartbeat(wk_service *s, km_msg_heartbeat *hb)
{
    wk_peer *p = s->peer;
    if (!p) return;
    pr_stats st;
    pr_node_stats(p->node, &st);
    hb->peer_addr = p->addr;
    hb->peer_addr_len = (uint32_t)p->addr_len;
    hb->has_xfer = true;
    hb->xfer = (km_xfer_stats){.bytes_in = st.bytes_in,
                               .bytes_out = st.bytes_out,
                               .pages_in = st.pages_in,
                               .pages_out = st.pages_out,
                               .pulls_ok = p->pulls_ok,
                               .pulls_failed = p->pulls_failed,
                               .offers = st.offers,
                               .rate_bps = p->rate_bps,
                               .latency_ms = p->lat_ms,
                               .page_bytes = kv_store_page_bytes(s->kv),
                               .pairs = p->hb_pairs};
    for (int i = 0; i < p->n_links && hb->xfer.n_pairs < KM_PROTO_MAX_XFER_PAIRS; i++) {
        const wk_link *l = &p->links[i];
        if (l->holder[0] && l->rate_bps > 0)
            p->hb_pairs[hb->xfer.n_pairs++] =
                (km_xfer_pair){.from = l->holder, .rate_bps = l->rate_bps, .latency_ms = l->lat_ms};
    }
}
