/*
 * scheduler_fair.c — the scheduler's running set shared between tenants (en_sched_opts
 * .tenant_share, engine/engine.h; scheduler_internal.h).
 *
 * Why at the worker: a step decodes every running sequence, so its time grows with the batch,
 * and a newcomer's first token waits for the step under way and then its own. A tenant that
 * filled the batch before anyone else asked (the router holds a key only while another is
 * active, docs/router.md "Tenants") keeps every step long until its sequences end, and the
 * router cannot take back what it sent. Here, while another tenant is active, a tenant runs at
 * most its share: its newest sequences go back to the queue (their full pages published, so
 * re-admission attaches them and recomputes at most a page), the steps shrink to the share's
 * decodes and the newcomer's prefill, and admission takes the tenant with the fewest running
 * first. A tenant alone is never held, so a lone tenant's batch is what it was.
 *
 * A newcomer still waits for the step under way, then its own. So, with a share:
 *  - while a tenant runs more than its share (it is alone) a step takes at most tenant_prefill
 *    prompt tokens: the router releases a flood's requests together when the last other tenant
 *    stops lingering, and short prompts each take their page floor, which the step budget cannot
 *    cut, so one step could take every new prompt at once;
 *  - the step that gives a tenant under its share its first token carries nothing of the tenants
 *    at their share (their decodes and drafts wait a step; never two in a row, so newcomers
 *    cannot starve them), so that step is as short as on an idle worker.
 *
 * "Active" is what the router means: requests queued or running here, or one ended within the
 * linger, so a client sending one request after another counts between them and the flood is
 * not re-admitted (and sent back again) in every gap. Tenants are counted afresh each step from
 * the running set and the queue (bounded by queue_cap); only the last two distinct tenants to
 * end a request are remembered, which answers "did another tenant end one lately" for anyone.
 */
#include <assert.h>

#include "engine/scheduler_internal.h"

enum { EN_FAIR_LINGER_MS = 1000 };

en_tenant *en_fair_of(en_sched *s, uint64_t id)
{
    for (int i = 0; i < s->n_tn; i++)
        if (s->tn[i].id == id) return &s->tn[i];
    assert(s->n_tn < s->queue_cap);
    s->tn[s->n_tn] = (en_tenant){.id = id};
    return &s->tn[s->n_tn++];
}

void en_fair_count(en_sched *s)
{
    s->n_tn = 0;
    if (s->o.tenant_share <= 0) return;
    for (int i = 0; i < s->n_run; i++) en_fair_of(s, s->run[i]->tenant)->running++;
    for (int i = 0; i < s->n_queue; i++) en_fair_of(s, s->queue[i]->tenant)->queued++;
}

/* Is a tenant other than id active: another with requests here, or one that ended lately. */
static int en_fair_others(const en_sched *s, uint64_t id, uint64_t now)
{
    if (s->n_tn > 1) return 1; /* every counted tenant has a request here */
    int o = s->ended[0].id == id;
    uint64_t linger =
        (uint64_t)(s->o.tenant_linger_ms > 0 ? s->o.tenant_linger_ms : EN_FAIR_LINGER_MS) * 1000000;
    return s->ended[o].end_ns && s->ended[o].id != id && now - s->ended[o].end_ns < linger;
}

int en_fair_held(const en_sched *s, const en_tenant *t, uint64_t now)
{
    return s->o.tenant_share > 0 && t->running >= s->o.tenant_share &&
           en_fair_others(s, t->id, now);
}

void en_fair_yield(en_sched *s, uint64_t now)
{
    if (s->o.tenant_share <= 0) return;
    for (int i = s->n_run - 1; i >= 0; i--) { /* newest admitted first */
        en_tenant *t = en_fair_of(s, s->run[i]->tenant);
        if (t->running <= s->o.tenant_share || !en_fair_others(s, t->id, now)) continue;
        en_rq_requeue(s, i);
        t->running--;
        t->queued++;
        s->st.tenant_yields++;
    }
}

void en_fair_ended(en_sched *s, uint64_t id, uint64_t now)
{
    if (s->ended[0].id != id || !s->ended[0].end_ns) s->ended[1] = s->ended[0];
    s->ended[0].id = id;
    s->ended[0].end_ns = now;
}

/* Will this step give r its first token: a request that has none yet, whose prompt's rest fits
 * one chunk. */
static int en_fair_first_now(const en_sched *s, const en_rq *r)
{
    int left = r->n_tok - r->n_done;
    return !r->first_ns && left > 0 && left <= s->o.prefill_chunk;
}

void en_fair_step(en_sched *s)
{
    s->fair_cap = 0;
    for (int i = 0; i < s->n_run; i++) s->run[i]->sit_out = 0;
    if (s->o.tenant_share <= 0) return;
    en_fair_count(s);
    for (int i = 0; i < s->n_tn; i++)
        if (s->tn[i].running > s->o.tenant_share) s->fair_cap = s->o.tenant_prefill;
    const en_rq *nc = NULL;
    for (int i = 0; i < s->n_run && !nc; i++)
        if (en_fair_first_now(s, s->run[i]) &&
            en_fair_of(s, s->run[i]->tenant)->running < s->o.tenant_share)
            nc = s->run[i];
    /* never two steps in a row (steps counts those done: this one is steps + 1), so many
     * newcomers cannot starve the tenants at their share */
    if (!nc || s->fair_sat_out == s->st.steps) return;
    /* A newcomer's first token comes in this step: the tenants at their share sit it out (no
     * drafts either), so the step is as short as on an idle worker; they lose one step per
     * request of a tenant with fewer running, which is what the share is for. */
    s->fair_sat_out = s->st.steps + 1;
    for (int i = 0; i < s->n_run; i++) {
        en_rq *r = s->run[i];
        if (r->tenant != nc->tenant && en_fair_of(s, r->tenant)->running >= s->o.tenant_share) {
            r->sit_out = 1;
            s->st.tenant_waits++;
        }
    }
}
