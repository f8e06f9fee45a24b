/*
 * scheduler_spec.c — speculative decoding's side of a scheduler step (spec.h has the drafting,
 * docs/speculative.md the whole story): before a step, the decoding sequences propose drafts and
 * the compute-aware budget grants them the room prefill leaves; after it, each sequence's drafts
 * are checked against the logits at every position, the matching ones kept and the KV past them
 * dropped.
 */
#include <assert.h>

#include "engine/scheduler_internal.h"

/* Whether a shard keeps int4 pages: those are sealed when they fill, so a verification must stay
 * inside one page there (a later token of the step would read the filled page unsealed, where
 * one token at a time reads it sealed). */
static int en_sched_int4(const en_sched *s)
{
    kv_shard_stats st;
    for (int i = 0; i < kv_store_n_shards(s->kv); i++)
        if (!kv_store_shard_stats(s->kv, i, &st) && st.format == KN_KV_INT4) return 1;
    return 0;
}

/* Proposes drafts for the decoding sequences and lets the budget grant them room, out of what
 * this step's decodes and prefill leave (drafts never displace a prompt token). */
void en_sched_plan(en_sched *s)
{
    int budget = s->o.max_batch_tokens, n_dec = 0, n_pre = 0, nq = 0;
    for (int i = 0; i < s->n_run; i++) {
        if (s->run[i]->spec) en_spec_seq_clear(s->run[i]->spec);
        n_dec += s->run[i]->n_tok - s->run[i]->n_done == 1;
    }
    if (!n_dec) return;
    /* The prompt tokens en_sched_build will take. */
    int pre_budget = budget - n_dec;
    if (s->o.decode_prefill > 0 && s->o.decode_prefill < pre_budget)
        pre_budget = s->o.decode_prefill;
    for (int i = 0; i < s->n_run && n_pre < pre_budget; i++) {
        int left = s->run[i]->n_tok - s->run[i]->n_done;
        if (left <= 1) continue;
        int take = left < s->o.prefill_chunk ? left : s->o.prefill_chunk;
        n_pre += take < pre_budget - n_pre ? take : pre_budget - n_pre;
    }
    int room = budget - n_dec - n_pre, int4 = -1, n_self = 0;
    if (room <= 0) return;
    for (int i = 0; i < s->n_run; i++) {
        en_rq *r = s->run[i];
        if (!r->spec || r->sit_out || r->n_tok - r->n_done != 1) continue;
        int cap = r->max_gen - r->n_gen - 1; /* the token after the drafts counts too */
        if (cap > 0 && int4 < 0) int4 = en_sched_int4(s);
        /* self drafts stay in one page too: the 4-bit copy's pages are int4 */
        if ((int4 > 0 || r->self) && cap > s->pt - 1 - r->n_done % s->pt)
            cap = s->pt - 1 - r->n_done % s->pt;
        if (r->self) { /* drafted below, each draft token one draft step */
            if (cap > s->o.spec.self_draft) cap = s->o.spec.self_draft;
            if (cap > room) cap = room;
            if (cap > 0) s->d_rq[n_self] = r, s->d_cap[n_self++] = cap, room -= cap;
        } else if (cap > 0 && en_spec_propose(s->spec, r->spec, r->tokens, r->n_tok, cap) > 0) {
            s->b_spec[nq++] = r->spec;
        }
    }
    if (n_self) en_sched_self_draft(s, n_self);
    if (nq && room > 0)
        en_spec_plan(s->spec, s->b_spec, nq, n_dec + n_pre, room);
    else
        for (int i = 0; i < nq; i++) en_spec_seq_clear(s->b_spec[i]);
}

/* A sequence's token and its drafts came back with logits at every position: the sampler picks
 * each position's token exactly as one step at a time would (same logits, same history, same
 * RNG draws), drafts equal to the picks are kept, and the KV past the last kept one is dropped.
 * For a single-proposal draft this is standard speculative sampling (spec.h). */
void en_sched_verify(en_sched *s, const en_part *p, const float *rows, uint64_t now)
{
    en_rq *r = p->rq;
    int k = p->draft, acc = 0, nd, ended = 0, before = r->n_done / s->pt;
    const int32_t *d = en_spec_seq_draft(r->spec, &nd);
    assert(nd == k && p->n == k + 1 && r->n_tok - r->n_done == 1);
    km_finish fin = KM_FINISH_STOP;
    r->n_done++;
    for (int j = 0; j <= k; j++) {
        int32_t t = en_rq_sample(s, r, rows + (size_t)j * s->n_vocab);
        int match = j < k && t == d[j];
        ended = en_rq_push(s, r, t, now, &fin);
        acc += match;
        if (ended || !match) break;
        r->n_done++; /* the draft's KV, written by this step, is the token's */
    }
    KM_DEBUG("spec_verify", "rid=%llu pos=%d drafted=%d accepted=%d", (unsigned long long)r->rid,
             r->n_done - 1 - acc, k, acc);
    en_spec_verified(s->spec, r->spec, k, acc);
    s->st.decode_tokens += 1 + acc;
    if (ended) {
        en_rq_finish(s, r, fin);
        return;
    }
    assert(r->n_done == r->n_tok - 1);
    if (acc < k) kv_seq_truncate(s->kv, r->seq, r->n_done);
    if (r->n_done / s->pt > before) en_rq_publish(s, r);
}
