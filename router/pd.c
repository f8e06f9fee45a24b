/*
 * pd.c — prefill/decode disaggregation, the router's side (docs/disaggregation.md). Workers
 * have a role (--role, carried by heartbeats into the controller's view): both, prefill or
 * decode. When the view has a prefill and a decode worker:
 *
 *  - a prefill worker takes no whole request (it computes prompts for decode workers), unless no
 *    decode or both worker could take it;
 *  - the cost model picks among the others as always (load and cached prefix); when its pick is
 *    a decode worker and at least --pd-min-tokens of the prompt are uncached there, the request
 *    is disaggregated: the prefill worker holding the longest prefix of it (then the least
 *    loaded) is named in the request's pull hint, marked pd, and the decode worker asks it to
 *    compute the prompt and pulls the pages as they are sealed (worker/service_pd.c).
 *
 * Short prompts, prompts mostly cached on the decode worker and clusters without both roles are
 * served as before. The hint's outcome is judged like a pull's (pull.c, rt_pull_outcome): a
 * prefill worker whose pages did not arrive is passed over for that decode worker for a while.
 * rt_pd_cluster and rt_pd_decide are plain data in, decision out (tests/unit/test_router_pd.c).
 */
#include <stdio.h>
#include <string.h>

#include "router/internal.h"

bool rt_pd_cluster(const rt_pd_in *c, int n)
{
    bool pre = false, dec = false;
    for (int i = 0; i < n; i++) {
        pre |= c[i].usable && c[i].role == KM_WROLE_PREFILL;
        dec |= c[i].usable && c[i].role == KM_WROLE_DECODE;
    }
    return pre && dec;
}

int rt_pd_decide(const rt_pd_in *c, int n, int pick, int n_prompt, int page_tokens, int min_tokens)
{
    if (min_tokens <= 0 || pick < 0 || pick >= n || page_tokens < 1) return -1;
    if (c[pick].role != KM_WROLE_DECODE || n_prompt / page_tokens <= c[pick].pages) return -1;
    if (n_prompt - c[pick].pages * page_tokens < min_tokens) return -1;
    int best = -1;
    for (int i = 0; i < n; i++) {
        if (i == pick || !c[i].usable || c[i].role != KM_WROLE_PREFILL) continue;
        if (best < 0 || c[i].pages > c[best].pages ||
            (c[i].pages == c[best].pages && c[i].inflight < c[best].inflight))
            best = i;
    }
    return best;
}

/* Every worker's part (routable: bit i when worker i may take requests); the prefill side as
 * seen from decode worker `to` (-1: none yet). */
static void rt_pd_inputs(rt_router *r, const rt_match *m, int to, uint64_t routable_mask,
                         rt_pd_in *in)
{
    uint64_t now = rt_now_ms();
    for (int i = 0; i < r->n_w; i++) {
        rt_wk *w = &r->w[i];
        bool routable = routable_mask >> i & 1;
        bool computes =
            routable && w->xfer.addr_len > 0 && (to < 0 || now >= r->w[to].pull_cool_until_ms[i]);
        in[i] = (rt_pd_in){.role = w->role,
                           .usable = w->role == KM_WROLE_PREFILL ? computes : routable,
                           .pages = m ? m->pages[i] : 0,
                           .inflight = w->inflight};
    }
}

void rt_pd_mask(rt_router *r, rt_candidate *cand, uint64_t routable)
{
    rt_pd_in in[RT_MAX_WORKERS];
    rt_pd_inputs(r, NULL, -1, routable, in);
    if (!rt_pd_cluster(in, r->n_w)) return;
    bool other = false;
    for (int i = 0; i < r->n_w; i++) other |= cand[i].usable && in[i].role != KM_WROLE_PREFILL;
    for (int i = 0; other && i < r->n_w; i++)
        if (in[i].role == KM_WROLE_PREFILL) cand[i].usable = false;
}

/* The pd hint's budget: twice the prefill worker's measured time for what it lacks, plus 2 s
 * (the request's deadline bounds it too, at the worker); 30 s while unmeasured. */
static uint32_t rt_pd_budget_ms(const rt_wk *pre, int tokens)
{
    double tps = pre->xfer.prefill_tps;
    double ms = tps > 0 ? 2000.0 * tokens / tps + 2000 : 30000;
    return (uint32_t)(ms > 60000 ? 60000 : ms);
}

void rt_pd_advise(rt_router *r, rt_rq *q, int pick, const rt_match *m, int n_ctx, uint64_t routable)
{
    q->pd = false;
    if (r->c.policy.mode != RT_MODE_KV || pick < 0 || n_ctx != q->n_prompt) return;
    rt_pd_in in[RT_MAX_WORKERS];
    rt_pd_inputs(r, m, pick, routable, in);
    if (!rt_pd_cluster(in, r->n_w) || in[pick].role != KM_WROLE_DECODE) return;
    int pt = r->c.page_tokens;
    int pre = rt_pd_decide(in, r->n_w, pick, q->n_prompt, pt, r->c.policy.pd_min_tokens);
    km_counter_inc(r->s_pd[pre >= 0 ? 0 : 1]);
    if (pre < 0) return;
    int pages = q->n_prompt / pt;
    q->pd = true;
    q->pull_w = pre + 1;
    q->pull_pages = (uint32_t)pages;
    q->pull_ms = rt_pd_budget_ms(&r->w[pre], q->n_prompt - m->pages[pre] * pt);
    KM_DEBUG("pd_choice",
             "rid=%llu decode=%s prefill=%s prompt=%d cached_decode=%d "
             "cached_prefill=%d budget_ms=%u",
             (unsigned long long)q->rid, r->w[pick].id, r->w[pre].id, q->n_prompt,
             m->pages[pick] * pt, m->pages[pre] * pt, q->pull_ms);
}

int rt_pd_metrics(rt_router *r, km_errbuf *err)
{
    static const char *const decisions[2] = {"disaggregated", "local"};
    km_metric *mt;
    int rc = km_metric_register(
        r->metrics, KM_COUNTER, "kvmesh_router_pd_total",
        "Requests sent to a decode worker while the cluster had prefill and decode workers, by "
        "decision: disaggregated (a prefill worker computed the prompt, its pages pulled as "
        "sealed) or local (short, or mostly cached there: --pd-min-tokens).",
        "decision", NULL, 0, &mt, err);
    for (int i = 0; !rc && i < 2; i++) r->s_pd[i] = km_metric_series(mt, &decisions[i]);
    return rc;
}
