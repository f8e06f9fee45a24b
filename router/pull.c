/*
 * pull.c — pull or recompute (docs/transfer.md, "Router"): when a worker other than the chosen
 * one holds a longer prefix of the request's chain, the chosen worker may pull those pages over
 * UCX instead of computing them. The rule compares two measured costs:
 *
 *   pull_ms      = lat_xfer + p · B / r_xfer            (p pages, B bytes each in the holder's
 *   recompute_ms = p · page_tokens / r_prefill(chosen)   format)
 *
 * and pulls when pull_ms < recompute_ms · margin (0.8: room for the control round trip and
 * contention). Every figure is measured by the workers and reaches the router in the
 * controller's view: r_xfer and lat_xfer are the chosen worker's own rate and latency of pulls
 * from that holder when it has pulled from it lately (the view's xfer_pairs: links differ, a
 * holder across a slow hop is not priced like one next door), else its rate over all holders
 * (or, before it has pulled, the mean over the workers that have), r_prefill its prefill rate
 * while busy, B the holder's page size. Before any worker has measured r_xfer, --pull-default-rate
 * (RT_PULL_DEFAULT_BPS) stands in for it; with that at 0, or without a measured prefill rate, the
 * router recomputes (`unmeasured`). The hint
 * carries recompute_ms as the pull's budget, so a pull slower than computing is abandoned.
 *
 * The same rule prices pulls for the pick (rt_pull_price, before rt_pick): a worker that would
 * pull a prefix is credited with the prefill the pull saves, so its cost carries the pull's time
 * instead of the whole recompute. Without it a hot tenant's holder wins until it runs ~30 more
 * requests than an idle worker (recomputing the prefix elsewhere costs that much); with it a
 * holder one or two requests busier than another worker loses to it, which pulls the prefix:
 * a hot prefix is replicated to a second (third...) worker exactly when its holder's queue costs
 * more than a pull (docs/router.md, "Hot prefixes").
 *
 * Chunks (docs/blend.md) are pulled by the same rule (rt_chunk_pull_advise, after the pick):
 * a chunk the chosen worker lacks and another holds, its saving discounted by chunk_credit (a
 * reused chunk is still partly recomputed), each from the holder the rule picks, at most
 * RT_PULL_HOLDERS holders a request (the prefix pull's first; the hint's pull_from, then its
 * pull_more). They are priced before the pick as prefix pulls are (rt_chunk_pull_price: the same
 * walk for every candidate, rt_chunk_pull_credit each).
 *
 * rt_pull_decide and rt_pull_credit are plain data in, decision out
 * (tests/unit/test_router_pull.c); the rest reads the router's workers and writes the hint.
 */
#include <stdio.h>
#include <string.h>

#include "router/internal.h"

bool rt_member_serves_pages(bool connected, bool view_fresh, bool in_view, km_member_state state)
{
    if (!connected) return false;
    if (!view_fresh) return true;
    /* a draining worker (or one level 3 drained, "restarting", or one that left, while its old
     * process lingers) takes no request but still answers pulls of its pages: its migrated
     * requests move with their KV (docs/transfer.md). A pull from a process that has none is
     * only a slower request: the puller computes what was not offered. */
    return in_view && (state == KM_MEMBER_READY || state == KM_MEMBER_DRAINING ||
                       state == KM_MEMBER_RESTARTING || state == KM_MEMBER_LEFT);
}

/* May w be the source of a pull: it need not take requests; a draining worker still
 * serves the pages of the requests migrated off it. */
bool rt_wk_serves_pages(const rt_router *r, const rt_wk *w)
{
    return w->xfer.addr_len > 0 &&
           rt_member_serves_pages(w->connected, r->view_fresh, w->in_view, w->member);
}

const char *const rt_pull_decision_names[RT_PULL_DECISIONS] = {"pull", "recompute", "unmeasured"};

bool rt_pull_hint_ok(uint32_t cached_tokens, uint32_t pull_pages, int page_tokens)
{
    return (uint64_t)cached_tokens + (uint64_t)page_tokens >= (uint64_t)pull_pages * page_tokens;
}

uint64_t rt_pull_backoff_ms(uint32_t fails)
{
    if (!fails) return 0;
    uint64_t ms = 1000ull << (fails > 7 ? 6 : fails - 1);
    return ms > 60000 ? 60000 : ms;
}

int rt_pull_decide(const rt_policy *pol, const rt_pull_in *c, int n, int pick, int page_tokens,
                   rt_pull_choice *out)
{
    memset(out, 0, sizeof *out);
    out->holder = -1;
    if (pick < 0 || pick >= n || page_tokens < 1) return RT_PULL_NONE;
    int h = -1;
    for (int i = 0; i < n; i++)
        if (i != pick && c[i].serves && c[i].pages > c[pick].pages &&
            (h < 0 || c[i].pages > c[h].pages))
            h = i;
    if (h < 0) return RT_PULL_NONE;
    out->holder = h;
    out->pages = c[h].pages;
    int p = c[h].pages - c[pick].pages;
    double rate = c[pick].rate_bps, lat = c[pick].lat_ms;
    if (c[h].pair_rate_bps > 0) { /* measured on this very pair */
        rate = c[h].pair_rate_bps;
        lat = c[h].pair_lat_ms;
    } else if (rate <= 0) { /* not measured here yet: the cluster's mean */
        double sum = 0, lsum = 0;
        int k = 0;
        for (int i = 0; i < n; i++)
            if (c[i].rate_bps > 0) {
                sum += c[i].rate_bps;
                lsum += c[i].lat_ms;
                k++;
            }
        if (k) {
            rate = sum / k;
            lat = lsum / k;
        } else {
            rate = pol->pull_default_bps;
            lat = 0;
        }
    }
    double prefill = c[pick].prefill_tps, bytes = c[h].page_bytes;
    if (rate <= 0 || prefill <= 0 || bytes <= 0) return out->decision = RT_PULL_UNMEASURED;
    out->pull_ms = lat + p * bytes / rate * 1000.0;
    out->recompute_ms = p * (double)page_tokens / prefill * 1000.0;
    double margin = pol->pull_margin > 0 ? pol->pull_margin : 0.8;
    return out->decision =
               out->pull_ms < out->recompute_ms * margin ? RT_PULL_PULL : RT_PULL_RECOMPUTE;
}

int rt_chunk_pull_decide(const rt_policy *pol, const rt_pull_in *c, int n, int pick,
                         int page_tokens, rt_pull_choice *out)
{
    int d = rt_pull_decide(pol, c, n, pick, page_tokens, out);
    if (d != RT_PULL_PULL && d != RT_PULL_RECOMPUTE) return d;
    out->recompute_ms *= pol->chunk_credit; /* what reusing the chunk saves of computing it */
    double margin = pol->pull_margin > 0 ? pol->pull_margin : 0.8;
    return out->decision =
               out->pull_ms < out->recompute_ms * margin ? RT_PULL_PULL : RT_PULL_RECOMPUTE;
}

/* ---------------------------------------------------------------- the daemon's side */

void rt_pull_view(rt_wk *w, const km_view_worker *vw)
{
    rt_wk_xfer *x = &w->xfer;
    x->addr_len = vw->peer_addr && vw->peer_addr_len <= sizeof x->addr ? vw->peer_addr_len : 0;
    if (x->addr_len) memcpy(x->addr, vw->peer_addr, x->addr_len);
    x->rate_bps = vw->xfer_rate_bps;
    x->lat_ms = vw->xfer_lat_ms;
    x->page_bytes = (double)vw->page_bytes;
    x->n_pairs = 0;
    for (uint32_t k = 0; k < vw->n_xfer_pairs && k < KM_PROTO_MAX_XFER_PAIRS; k++) {
        snprintf(x->pairs[k].from, sizeof x->pairs[k].from, "%s", vw->xfer_pairs[k].from);
        x->pairs[k].rate_bps = vw->xfer_pairs[k].rate_bps;
        x->pairs[k].lat_ms = vw->xfer_pairs[k].latency_ms;
        x->n_pairs = k + 1;
    }
    /* prefill_tps is what the worker computed over its last interval (0 when idle): keep a mean
     * of the busy intervals, which is what a request landing there will get */
    if (vw->prefill_tps > 0)
        x->prefill_tps =
            x->prefill_tps > 0 ? 0.7 * x->prefill_tps + 0.3 * vw->prefill_tps : vw->prefill_tps;
}

/* The figures of every worker as seen by `to`, the would-be puller: a holder's pages must be
 * stored, not pending (still being computed: nothing to hand over yet), while the puller's own
 * pending pages count, they will be there; a holder whose last hints to `to` failed is passed
 * over for a while; a puller that has not measured its prefill rate yet (it computed nothing
 * while busy) is taken at the cluster's mean, every worker running the same model. */
static void pull_inputs(const rt_router *r, int to, const rt_match *m, uint64_t now, rt_pull_in *in)
{
    const rt_wk *tw = &r->w[to];
    double sum = 0;
    int k = 0;
    for (int i = 0; i < r->n_w; i++) {
        const rt_wk *w = &r->w[i];
        in[i] = (rt_pull_in){.pages = i == to ? m->pages[i] : m->stored[i],
                             .serves = rt_wk_serves_pages(r, w) && now >= tw->pull_cool_until_ms[i],
                             .rate_bps = w->xfer.rate_bps,
                             .lat_ms = w->xfer.lat_ms,
                             .prefill_tps = w->xfer.prefill_tps,
                             .page_bytes = w->xfer.page_bytes};
        for (uint32_t j = 0; j < tw->xfer.n_pairs; j++)
            if (!strcmp(tw->xfer.pairs[j].from, w->id)) {
                in[i].pair_rate_bps = tw->xfer.pairs[j].rate_bps;
                in[i].pair_lat_ms = tw->xfer.pairs[j].lat_ms;
            }
        if (w->xfer.prefill_tps > 0) {
            sum += w->xfer.prefill_tps;
            k++;
        }
    }
    if (in[to].prefill_tps <= 0 && k) in[to].prefill_tps = sum / k;
}

double rt_pull_credit(const rt_policy *pol, const rt_pull_in *c, int n, int i, int page_tokens)
{
    rt_pull_choice ch;
    if (rt_pull_decide(pol, c, n, i, page_tokens, &ch) != RT_PULL_PULL) return 0;
    /* a pull is never priced below the tie band: a holder and a puller equally loaded are no
     * tie (a rendezvous draw would move pages for nothing), the holder wins */
    double saved =
        (ch.pages - c[i].pages) * (double)page_tokens * (1.0 - ch.pull_ms / ch.recompute_ms);
    return saved > pol->tie_band ? saved - pol->tie_band : 0;
}

void rt_pull_price(const rt_router *r, const rt_match *m, rt_candidate *cand)
{
    if (r->c.policy.mode != RT_MODE_KV) return;
    int most = 0; /* the longest stored prefix: nobody holding less than it, nothing to pull */
    for (int i = 0; i < r->n_w; i++)
        if (m->stored[i] > most && rt_wk_serves_pages(r, &r->w[i])) most = m->stored[i];
    rt_pull_in in[RT_MAX_WORKERS];
    uint64_t now = rt_now_ms();
    for (int i = 0; i < r->n_w; i++) {
        if (!cand[i].usable || m->pages[i] >= most || !r->w[i].xfer.addr_len) continue;
        pull_inputs(r, i, m, now, in);
        cand[i].cached_tokens += rt_pull_credit(&r->c.policy, in, r->n_w, i, r->c.page_tokens);
    }
}

int rt_pull_choose(const rt_router *r, int pick, const rt_match *m, rt_pull_choice *ch)
{
    rt_pull_in in[RT_MAX_WORKERS];
    pull_inputs(r, pick, m, rt_now_ms(), in);
    return rt_pull_decide(&r->c.policy, in, r->n_w, pick, r->c.page_tokens, ch);
}

void rt_pull_advise(rt_router *r, rt_rq *q, int pick, const rt_match *m)
{
    q->pull_w = 0;
    q->pull_pages = 0;
    q->pull_chunks = 0;
    q->n_pull_more = 0;
    if (r->c.policy.mode != RT_MODE_KV || pick < 0 || !r->w[pick].xfer.addr_len) return;
    rt_pull_choice ch;
    int d = rt_pull_choose(r, pick, m, &ch);
    if (d == RT_PULL_NONE) return;
    km_counter_inc(r->s_pulls[d]);
    KM_DEBUG("pull_choice",
             "rid=%llu worker=%s holder=%s pages=%d/%d decision=%s pull_ms=%.1f "
             "recompute_ms=%.1f",
             (unsigned long long)q->rid, r->w[pick].id, r->w[ch.holder].id, m->pages[pick],
             ch.pages, rt_pull_decision_names[d], ch.pull_ms, ch.recompute_ms);
    if (d != RT_PULL_PULL) return;
    q->pull_w = ch.holder + 1;
    q->pull_pages = (uint32_t)ch.pages;
    double budget = ch.recompute_ms < 1 ? 1 : ch.recompute_ms > 60000 ? 60000 : ch.recompute_ms;
    q->pull_ms = (uint32_t)budget;
}

double rt_chunk_pull_credit(const rt_policy *pol, const rt_pull_in *c, int n, int i,
                            int page_tokens)
{
    rt_pull_choice ch;
    if (rt_chunk_pull_decide(pol, c, n, i, page_tokens, &ch) != RT_PULL_PULL) return 0;
    /* the chunk's pages i lacks past the preamble (shared by every chunk: no saving of this
     * one), at the credit's share, less the pull's time (recompute_ms is that share already) */
    const int mine = c[i].pages > 1 ? c[i].pages : 1;
    double saved = pol->chunk_credit * (ch.pages - mine) * (double)page_tokens *
                   (1.0 - ch.pull_ms / ch.recompute_ms);
    return saved > pol->tie_band ? saved - pol->tie_band : 0;
}

/* The chunks of q worth pulling to worker i: past the prefix it will hold (covered tokens), each
 * from the holder the rule picks, at most RT_PULL_HOLDERS of them: the first is the hint's
 * pull_from (the prefix pull's holder when there is one), the others its pull_more. */
typedef struct chunk_plan {
    int holder[RT_PULL_HOLDERS];
    uint64_t bits[RT_PULL_HOLDERS];
    int n;            /* holders named */
    double budget_ms; /* what their reuse saves of computing them: the pull's budget */
    double saved;     /* their credit for the cost model (rt_chunk_pull_credit) */
} chunk_plan;

/* The plan's slot for holder h (a new one while there is room); -1 when there is none. */
static int chunk_plan_slot(chunk_plan *p, int h)
{
    for (int k = 0; k < p->n; k++)
        if (p->holder[k] == h) return k;
    if (p->n == RT_PULL_HOLDERS) return -1;
    p->holder[p->n] = h, p->bits[p->n] = 0;
    return p->n++;
}

/* count: the decisions are counted and logged (the advice after the pick, not the pricing). */
static void chunk_pull_plan(const rt_router *r, const rt_rq *q, int i, uint64_t covered, int holder,
                            uint64_t workers, bool count, chunk_plan *out)
{
    const int pt = r->c.page_tokens;
    const uint64_t now = rt_now_ms();
    rt_pull_in in[RT_MAX_WORKERS];
    *out = (chunk_plan){.n = 0};
    if (holder >= 0) chunk_plan_slot(out, holder);
    for (uint32_t c = 0, at = 0; c + 1 < q->q.n_chunks; c++) {
        const km_chunk_seg *g = &q->chunks[c];
        if (!rt_chunk_has_chain(r, q, g)) continue;
        const int np = 1 + (int)(g->n / pt);
        const km_pagehash *chain = q->chunk_chain + at;
        at += (uint32_t)np;
        if (g->start < covered) continue; /* inside the prefix: not reused */
        rt_match m;
        rt_index_match(r->index, chain, np, workers, r->c.policy.tier_credit, pt, now, &m);
        pull_inputs(r, i, &m, now, in);
        rt_pull_choice ch;
        int d = rt_chunk_pull_decide(&r->c.policy, in, r->n_w, i, pt, &ch);
        if (d == RT_PULL_NONE || ch.pages < 2) continue; /* nobody has more than a preamble */
        if (count) {
            km_counter_inc(r->s_chunk_pulls[d]);
            KM_DEBUG("chunk_pull_choice",
                     "rid=%llu chunk=%u worker=%s holder=%s pages=%d/%d decision=%s "
                     "pull_ms=%.1f saved_ms=%.1f",
                     (unsigned long long)q->rid, c, r->w[i].id, r->w[ch.holder].id, m.pages[i],
                     ch.pages, rt_pull_decision_names[d], ch.pull_ms, ch.recompute_ms);
        }
        const int k = d == RT_PULL_PULL ? chunk_plan_slot(out, ch.holder) : -1;
        if (k < 0) continue;
        out->bits[k] |= 1ull << c;
        out->budget_ms += ch.recompute_ms;
        out->saved += rt_chunk_pull_credit(&r->c.policy, in, r->n_w, i, pt);
    }
}

/* May q's chunks be pulled at all (a request with prompt_logprobs reuses no chunk: every prompt
 * position's logits are wanted). */
static bool chunk_pulls_apply(const rt_router *r, const rt_rq *q)
{
    return r->c.policy.mode == RT_MODE_KV && q->n_chunk_chain && !q->q.prompt_logprobs;
}

void rt_chunk_pull_price(const rt_router *r, const rt_rq *q, const rt_match *prefix,
                         uint64_t workers, rt_candidate *cand)
{
    if (!chunk_pulls_apply(r, q)) return;
    const int pt = r->c.page_tokens;
    const uint64_t now = rt_now_ms();
    rt_pull_in in[RT_MAX_WORKERS];
    for (int i = 0; i < r->n_w; i++) {
        if (!cand[i].usable || !r->w[i].xfer.addr_len) continue;
        /* the prefix it will hold, as the advice would see it: its own, or the one it pulls */
        pull_inputs(r, i, prefix, now, in);
        rt_pull_choice ch;
        int holder = -1;
        uint64_t covered = (uint64_t)prefix->pages[i] * (uint64_t)pt;
        if (rt_pull_decide(&r->c.policy, in, r->n_w, i, pt, &ch) == RT_PULL_PULL)
            holder = ch.holder, covered = (uint64_t)ch.pages * (uint64_t)pt;
        chunk_plan p;
        chunk_pull_plan(r, q, i, covered, holder, workers, false, &p);
        cand[i].cached_tokens += p.saved;
    }
}

void rt_chunk_pull_advise(rt_router *r, rt_rq *q, int pick, const rt_match *prefix,
                          uint64_t workers)
{
    const int pt = r->c.page_tokens;
    if (!chunk_pulls_apply(r, q) || pick < 0 || q->pd || !r->w[pick].xfer.addr_len) return;
    /* the prompt's pages the chosen worker will have before reuse: its own and the pulled ones */
    const uint64_t covered =
        (uint64_t)(q->pull_w ? (int)q->pull_pages : prefix->pages[pick]) * (uint64_t)pt;
    chunk_plan p;
    chunk_pull_plan(r, q, pick, covered, q->pull_w - 1, workers, true, &p);
    if (p.budget_ms <= 0) return; /* no chunk worth pulling */
    const double budget = (q->pull_w ? q->pull_ms : 0) + p.budget_ms;
    q->pull_w = p.holder[0] + 1;
    q->pull_chunks = p.bits[0];
    for (int k = 1; k < p.n; k++) {
        q->pull_more_w[k - 1] = p.holder[k] + 1;
        q->pull_more_chunks[k - 1] = p.bits[k];
    }
    q->n_pull_more = p.n - 1;
    q->pull_ms = (uint32_t)(budget < 1 ? 1 : budget > 60000 ? 60000 : budget);
}

void rt_pull_outcome(rt_router *r, rt_rq *q, rt_wk *w, uint32_t cached, uint32_t chunk_tokens)
{
    if (q->pull_w < 1 || q->pull_w > r->n_w) return;
    int h = q->pull_w - 1;
    q->pull_w = 0; /* counted once */
    /* a hint with chunks worked when the worker reused chunk tokens too (chunks.c) */
    bool ok = rt_pull_hint_ok(cached, q->pull_pages, r->c.page_tokens) &&
              (!(q->pull_chunks || q->n_pull_more) || chunk_tokens > 0);
    km_counter_inc(r->s_hints[ok ? 0 : 1]);
    if (ok) {
        w->pull_fails[h] = 0;
        return;
    }
    w->pull_fails[h]++;
    uint64_t back = rt_pull_backoff_ms(w->pull_fails[h]);
    w->pull_cool_until_ms[h] = rt_now_ms() + back;
    KM_INFO("pull_hint_failed",
            "rid=%llu worker=%s holder=%s pages=%u cached_tokens=%u fails=%u backoff_ms=%llu",
            (unsigned long long)q->rid, w->id, r->w[h].id, q->pull_pages, cached, w->pull_fails[h],
            (unsigned long long)back);
}

void rt_pull_hint(rt_router *r, rt_rq *q, km_msg_request *out)
{
    if (q->pull_w < 1 || q->pull_w > r->n_w) return;
    const rt_wk *h = &r->w[q->pull_w - 1];
    if (!h->xfer.addr_len) return;
    out->pull_from = h->view_id[0] ? h->view_id : h->id;
    out->pull_endpoint = h->req_url;
    out->pull_addr = h->xfer.addr;
    out->pull_addr_len = h->xfer.addr_len;
    out->pull_pages = q->pull_pages;
    out->pull_chunks = q->pull_chunks;
    out->pull_ms = q->pull_ms;
    uint32_t n = 0;
    for (int k = 0; k < q->n_pull_more; k++) {
        const int w = q->pull_more_w[k] - 1;
        if (w < 0 || w >= r->n_w || !r->w[w].xfer.addr_len) continue; /* its chunks computed */
        q->pull_more[n++] = (km_pull_more){r->w[w].view_id[0] ? r->w[w].view_id : r->w[w].id,
                                           q->pull_more_chunks[k]};
    }
    out->pull_more = n ? q->pull_more : NULL;
    out->n_pull_more = n;
}

/* A counter with one label and a series per value. */
static int rt_pull_counter(rt_router *r, const char *name, const char *help, const char *label,
                           const char *const *values, int n, km_series **out, km_errbuf *err)
{
    km_metric *m;
    int rc = km_metric_register(r->metrics, KM_COUNTER, name, help, label, NULL, 0, &m, err);
    for (int i = 0; !rc && i < n; i++) out[i] = km_metric_series(m, &values[i]);
    return rc;
}

int rt_pull_metrics(rt_router *r, km_errbuf *err)
{
    static const char *const outcomes[2] = {"ok", "failed"};
    int rc =
        rt_pull_counter(r, "kvmesh_router_pulls_total",
                        "Requests for which another worker held a longer prefix than the "
                        "chosen one, by decision: pull (the chosen worker was told to pull "
                        "it), recompute (pulling measured slower), unmeasured (no measured "
                        "rates yet: recompute).",
                        "decision", rt_pull_decision_names, RT_PULL_DECISIONS, r->s_pulls, err);
    if (!rc)
        rc = rt_pull_counter(r, "kvmesh_router_chunk_pulls_total",
                             "Chunks of requests (docs/blend.md) that another worker held more "
                             "pages of than the chosen one, by decision: pull (the hint names the "
                             "chunk), recompute (pulling measured slower than the share of its "
                             "computation reuse saves), unmeasured (no measured rates yet).",
                             "decision", rt_pull_decision_names, RT_PULL_DECISIONS,
                             r->s_chunk_pulls, err);
    if (rc) return rc;
    return rt_pull_counter(r, "kvmesh_router_pull_hints_total",
                           "Pull hints by outcome, judged by the request's cached tokens: ok (the "
                           "pages arrived) or failed (they did not: that worker gets no hint "
                           "naming that holder for 1 s, doubling per failure in a row, at most "
                           "60 s).",
                           "outcome", outcomes, 2, r->s_hints, err);
}
