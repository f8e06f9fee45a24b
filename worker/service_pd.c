/*
 * service_pd.c — prefill/decode disaggregation, the decode worker's side (docs/disaggregation.md;
 * service_peer_internal.h has the calls). A router sends a long prompt to a decode worker with
 * a pull hint marked pd, naming a prefill worker that has not computed it yet. This worker:
 *
 *  - holds the request as for any pull hint (service_peer.c), and asks the prefill worker to
 *    compute the prompt: a `req` of max_tokens 1 on the link to it (its one token is dropped);
 *  - pulls in rounds: each kv_pull is offered the leading pages the prefill worker has sealed so
 *    far (a holder offers what it holds), and when a round ends with pages still missing the
 *    next one starts: at once when it brought pages or the prefill is done, else WK_PD_RETRY_MS
 *    later. So pages arrive while the prefill runs, a chunk at a time, each one verified and
 *    leased exactly as in any pull (peer/peer.h);
 *  - admits the request when every full page is here, when a round after the prefill's `done`
 *    brings nothing, when the prefill worker fails or answers an error, or at the hint's budget:
 *    the scheduler then computes whatever did not arrive (the last partial page always) and the
 *    first token, and streams as for any request. A failed prefill is a slower request, never a
 *    lost one.
 *
 * Why pull and not push: the puller already owns every check (tokens, chain, checksum, lease,
 * deadline) and reads into pages it reserved; a push would need the prefill worker to write
 * into this worker's memory, which the transfer layer never allows (peer/peer.h).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker/service_peer_internal.h"

enum { WK_PD_RETRY_MS = 5 }; /* between rounds that found no new page while the prefill runs */

/* kvmesh_worker_pd_requests_total{outcome} */
enum { WK_PD_COMPLETE, WK_PD_PARTIAL, WK_PD_COMPUTED, WK_PD_OUTCOMES };
static const char *const wk_pd_outcomes[WK_PD_OUTCOMES] = {"complete", "partial", "computed"};
static const char *const wk_pd_when[2] = {"during_prefill", "after_prefill"};

int wk_pd_metrics(wk_service *s, wk_peer *p, km_errbuf *err)
{
    km_metric *m;
    int rc = km_metric_register(
        s->reg, KM_COUNTER, "kvmesh_worker_pd_pages_imported_total",
        "KV pages of disaggregated requests pulled from their prefill worker, by when the pull "
        "round that brought them ended: during_prefill (before the prefill worker's done came "
        "back: transfer overlapped with its compute) or after_prefill.",
        "when", NULL, 0, &m, err);
    if (rc) return rc;
    for (int i = 0; i < 2; i++) p->s_pd_pages[i] = km_metric_series(m, &wk_pd_when[i]);
    rc = km_metric_register(s->reg, KM_COUNTER, "kvmesh_worker_pd_requests_total",
                            "Disaggregated requests by outcome: complete (every full page of the "
                            "prompt came from the prefill worker), partial (some did, the rest "
                            "was computed here), computed (none did: the prefill worker failed, "
                            "was slow or refused).",
                            "outcome", NULL, 0, &m, err);
    if (rc) return rc;
    for (int i = 0; i < WK_PD_OUTCOMES; i++)
        p->s_pd_reqs[i] = km_metric_series(m, &wk_pd_outcomes[i]);
    return 0;
}

/* Sends frame m on l's DEALER; 0 or an error. */
static int wk_pd_send(wk_service *s, wk_link *l, const km_msg *m)
{
    wk_peer *p = s->peer;
    km_proto_limits big = s->lim;
    big.max_frame = (size_t)-1;
    big.max_prompt_tok = UINT32_MAX;
    int rc = km_msg_encode(m, &big, &p->out, NULL);
    if (rc || !l->sock) return rc ? rc : KM_EIO;
    km_zframe f = {p->out.data, p->out.len};
    return km_zsend(l->sock, &f, 1, KM_ZDONTWAIT, NULL);
}

void wk_pd_begin(wk_service *s, wk_link *l, wk_held *h, const km_msg_request *q,
                 const km_pagehash *hs)
{
    wk_peer *p = s->peer;
    struct wk_pd *d = calloc(1, sizeof *d);
    if (!d || !(d->hs = malloc(sizeof *d->hs * (size_t)h->n_pages))) {
        free(d);
        return; /* a plain pull of what is there now */
    }
    memcpy(d->hs, hs, sizeof *d->hs * (size_t)h->n_pages);
    d->begin_ns = h->start_ns;
    d->rounds = 1;
    h->pd = d;
    km_msg m;
    km_msg_init(&m, KM_MSG_REQUEST);
    /* the prompt alone, greedy, one token: what matters is the pages it seals on the way */
    m.req = (km_msg_request){.id = ++p->pd_next_id,
                             .model = q->model,
                             .tokens = h->tokens,
                             .n_tokens = (uint32_t)h->n_tokens,
                             .temperature = 0,
                             .top_p = 1,
                             .repeat_penalty = 1,
                             .max_tokens = 1,
                             .cache_salt = q->cache_salt,
                             .priority = q->priority,
                             .deadline_ms = (uint32_t)((h->deadline_ns - h->start_ns) / 1000000u)};
    if (wk_pd_send(s, l, &m)) {
        d->failed = true; /* the round running brings what the holder already has */
        KM_WARN("pd_prefill_not_sent", "id=%llu prefill=%s", (unsigned long long)h->id, l->holder);
        return;
    }
    d->prefill_id = m.req.id;
    KM_DEBUG("pd_begin", "id=%llu prefill=%s prefill_id=%llu pages=%d", (unsigned long long)h->id,
             l->holder, (unsigned long long)d->prefill_id, h->n_pages);
}

/* The request's rounds are over: counted, the prefill canceled when it still runs. */
static void wk_pd_end(wk_service *s, wk_held *h)
{
    wk_peer *p = s->peer;
    struct wk_pd *d = h->pd;
    int have = d->have;
    int outcome = have >= h->n_pages ? WK_PD_COMPLETE
                  : d->imported      ? WK_PD_PARTIAL
                                     : WK_PD_COMPUTED;
    km_counter_inc(p->s_pd_reqs[outcome]);
    if (d->prefill_id && !d->done && !d->failed && h->link && h->link->sock) {
        km_msg m;
        km_msg_init(&m, KM_MSG_CANCEL);
        m.cancel.id = d->prefill_id;
        wk_pd_send(s, h->link, &m);
    }
    KM_INFO("pd_done",
            "id=%llu prefill=%s pages=%d here=%d imported=%d during_prefill=%d rounds=%d ms=%.1f "
            "prefill=%s outcome=%s",
            (unsigned long long)h->id, h->link ? h->link->holder : "-", h->n_pages, have,
            d->imported, d->during, d->rounds, (double)(km_now_ns() - d->begin_ns) / 1e6,
            d->done     ? "done"
            : d->failed ? "failed"
                        : "running",
            wk_pd_outcomes[outcome]);
    d->prefill_id = 0;
}

bool wk_pd_round_end(wk_service *s, wk_held *h, const pr_pull_result *res)
{
    wk_peer *p = s->peer;
    struct wk_pd *d = h->pd;
    uint64_t now = km_now_ns();
    int got = res->pages_imported;
    d->imported += got;
    if (!d->done) d->during += got;
    if (got) km_counter_add(p->s_pd_pages[d->done ? 1 : 0], (uint64_t)got);
    int have = d->have = res->pages_local + got;
    if (d->done && !got) d->empty_after++;
    wk_link *l = h->link;
    bool gone = !l->peer || pr_peer_failed(l->peer) || !l->sock;
    if (d->stop || d->failed || gone || have >= h->n_pages || now >= h->deadline_ns ||
        d->empty_after > 1 || (res->status && res->status != KM_ENOTFOUND)) {
        wk_pd_end(s, h);
        return false;
    }
    if (p->n_pd_wait == WK_PEER_HELD) {
        wk_pd_end(s, h);
        return false;
    }
    h->pull = NULL;
    h->offer_ns = 0;
    h->end_now = false;
    l->pulls++; /* the link stays ours between rounds */
    d->next_ns = got || d->done ? now : now + (uint64_t)WK_PD_RETRY_MS * 1000000u;
    p->pd_wait[p->n_pd_wait++] = h;
    return true;
}

/* Waiting entry i leaves the list (the last one moves into i). */
static wk_held *wk_pd_take(wk_peer *p, int i)
{
    wk_held *h = p->pd_wait[i];
    p->pd_wait[i] = p->pd_wait[--p->n_pd_wait];
    h->link->pulls--;
    return h;
}

void wk_pd_poll(wk_service *s)
{
    wk_peer *p = s->peer;
    uint64_t now = km_now_ns();
    for (int i = 0; i < p->n_pd_wait;) {
        wk_held *h = p->pd_wait[i];
        struct wk_pd *d = h->pd;
        bool gone = !h->link->peer || pr_peer_failed(h->link->peer);
        if (!d->stop && !d->failed && !gone && now < d->next_ns && now < h->deadline_ns) {
            i++;
            continue;
        }
        wk_pd_take(p, i);
        if (d->stop || d->failed || gone || now >= h->deadline_ns) {
            wk_pd_end(s, h);
            wk_peer_admit_held(s, h);
            continue;
        }
        d->rounds++;
        if (wk_peer_start(s, h->link, h, d->hs, h->tokens, h->n_pages) < 0) {
            wk_pd_end(s, h); /* every page here, or no pull could start */
            wk_peer_admit_held(s, h);
        }
    }
}

/* The held entry (in a round or between rounds) whose prefill has this id on link l. */
static wk_held *wk_pd_find(wk_peer *p, const wk_link *l, uint64_t id)
{
    for (int i = 0; id && i < p->n_held; i++)
        if (p->held[i]->pd && p->held[i]->pd->prefill_id == id && p->held[i]->link == l)
            return p->held[i];
    for (int i = 0; id && i < p->n_pd_wait; i++)
        if (p->pd_wait[i]->pd->prefill_id == id && p->pd_wait[i]->link == l) return p->pd_wait[i];
    return NULL;
}

bool wk_pd_answer(wk_service *s, wk_link *l, const km_msg *m)
{
    uint64_t id = m->type == KM_MSG_DONE    ? m->done.id
                  : m->type == KM_MSG_ERROR ? m->error.id
                  : m->type == KM_MSG_TOKEN ? m->tok.id
                                            : 0;
    wk_held *h = wk_pd_find(s->peer, l, id);
    if (!h) return false;
    struct wk_pd *d = h->pd;
    if (m->type == KM_MSG_DONE) {
        d->done = true;
        d->next_ns = 0; /* the last round at once */
        KM_DEBUG("pd_prefill_done", "id=%llu prefill=%s cached=%u ms=%.1f",
                 (unsigned long long)h->id, l->holder, m->done.cached_tokens,
                 (double)(km_now_ns() - d->begin_ns) / 1e6);
    } else if (m->type == KM_MSG_ERROR) {
        d->failed = true;
        KM_WARN("pd_prefill_failed", "id=%llu prefill=%s code=%d msg=\"%s\"",
                (unsigned long long)h->id, l->holder, m->error.code, m->error.message);
    }
    return true;
}

void wk_pd_stop(wk_held *h)
{
    if (h->pd) h->pd->stop = true;
}

int wk_pd_cancel(wk_service *s, const km_zframe *env, int n_env, uint64_t id)
{
    wk_peer *p = s->peer;
    for (int i = 0; i < p->n_pd_wait; i++) {
        wk_held *h = p->pd_wait[i];
        if (h->id != id || !wk_held_env_is(h, env, n_env)) continue;
        wk_pd_take(p, i);
        wk_pd_end(s, h);
        wk_peer_admit_held(s, h);
        wk_sreq *r = wk_svc_live_find(s, env, n_env, id);
        if (r) en_sched_cancel(s->sched, r->rid);
        return 1;
    }
    return 0;
}

void wk_pd_admit_all(wk_service *s)
{
    wk_peer *p = s->peer;
    while (p->n_pd_wait) {
        wk_held *h = wk_pd_take(p, p->n_pd_wait - 1);
        wk_pd_end(s, h);
        wk_peer_admit_held(s, h);
    }
}
