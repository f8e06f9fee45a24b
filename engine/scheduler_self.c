/*
 * scheduler_self.c — self-speculation (QuantSpec, arXiv 2502.10424; docs/speculative.md): a
 * request in EN_SPEC_SELF mode drafts with the model itself, reading a 4-bit copy of its KV, and
 * the step verifies the drafts over the full pages exactly as it verifies suffix drafts
 * (scheduler_spec.c), so the output is token for token the output without speculation.
 *
 * The copy (en_rq.shadow) is a sequence of the draft engine's store, whose pages are int4: before
 * drafting, the positions the request's own sequence has computed since the last time are read
 * back (kv_seq_read) and written into the copy, where each page is quantized to int4 as it fills
 * (kv_seq_reserve seals it); the page being filled stays in f16, as QuantSpec keeps the most
 * recent tokens in full precision. Then one draft step per draft token, all drafting requests in
 * one batch: the request's token at its position, then each draft at the next, the argmax of
 * each step's logits being the next draft (a single proposal, which the verification keeps or
 * replaces by its own pick). The drafts' KV lands in the copy's last page past the copied
 * positions and is truncated away after the draft steps; drafts never leave that page (the
 * planner caps them there), so no int4 page ever holds a draft's KV.
 *
 * Cost (the figures in docs/speculative.md, "Self-speculation over int4 KV"): a copy reads each
 * position's K and V once; a draft step costs what a decode step over int4 KV costs, and the
 * steps run on the caller's thread like any other.
 */
#include <stdlib.h>
#include <string.h>

#include "engine/scheduler_internal.h"

void en_rq_drop_shadow(en_sched *s, en_rq *r)
{
    if (r->shadow) kv_seq_destroy(s->eng.draft_kv, r->shadow);
    r->shadow = NULL;
    r->n_shadow = 0;
}

/* Copies positions [r->n_shadow, r->n_done) of r's KV into its 4-bit copy, with room for the
 * draft steps up to position r->n_done + d - 1. 0, or a negative km_err (no copy then). */
static int en_self_catch_up(en_sched *s, en_rq *r, int d)
{
    kv_store *dk = s->eng.draft_kv;
    if (!r->shadow && kv_seq_create(dk, &r->shadow)) return KM_ENOMEM;
    int rc = kv_seq_reserve(dk, r->shadow, r->n_done + d);
    if (rc) {
        en_rq_drop_shadow(s, r);
        return rc;
    }
    const int hd = s->head_dim;
    float *k = s->d_kv, *v = s->d_kv + s->kv_width * hd;
    for (int pos = r->n_shadow; pos < r->n_done && !rc; pos++)
        for (int l = 0; l < s->n_layers && !rc; l++) {
            for (int h = 0; h < s->kv_width && !rc; h++)
                rc = kv_seq_read(s->kv, r->seq, l, h, pos, k + h * hd, v + h * hd);
            if (!rc) kv_seq_write(dk, r->shadow, l, pos, k, v);
        }
    if (rc) {
        en_rq_drop_shadow(s, r);
        return rc;
    }
    r->n_shadow = r->n_done;
    return kv_seq_reserve(dk, r->shadow, r->n_done + d); /* seals the pages now full */
}

int en_sched_self_draft(en_sched *s, int n)
{
    int m = 0, steps = 0;
    for (int i = 0; i < n; i++) { /* keeps those whose copy is ready */
        en_rq *r = s->d_rq[i];
        if (en_self_catch_up(s, r, s->d_cap[i])) continue;
        s->d_rq[m] = r, s->d_cap[m] = s->d_cap[i];
        if (s->d_cap[m] > steps) steps = s->d_cap[m];
        m++;
    }
    int made = 0;
    for (int j = 0; j < steps; j++) {
        int b = 0;
        for (int i = 0; i < m; i++) {
            if (s->d_cap[i] <= j) continue;
            s->d_seq[b] = s->d_rq[i]->shadow;
            s->d_pos[b] = s->d_rq[i]->n_done + j;
            s->d_tok[b] = j ? s->d_out[i * EN_SELF_MAX_DRAFT + j - 1]
                            : s->d_rq[i]->tokens[s->d_rq[i]->n_done];
            b++;
        }
        /* one logits row per token, in batch order */
        en_batch bt = {.n_tokens = b,
                       .tokens = s->d_tok,
                       .pos = s->d_pos,
                       .seqs = s->d_seq,
                       .logits = s->d_want};
        const float *lg = NULL;
        if (s->eng.draft_step(s->eng.ctx, &bt, &lg) < b) { /* the drafts so far, no more */
            for (int i = 0; i < m; i++)
                if (s->d_cap[i] > j) s->d_cap[i] = j;
            break;
        }
        for (int i = 0, row = 0; i < m; i++)
            if (s->d_cap[i] > j)
                s->d_out[i * EN_SELF_MAX_DRAFT + j] =
                    en_argmax(lg + (size_t)row++ * s->n_vocab, s->n_vocab);
    }
    for (int i = 0; i < m; i++) {
        en_rq *r = s->d_rq[i];
        /* the drafts' KV goes: the copy ends at the copied positions again (and its page's
         * count of written rows with it, so that the page seals once the copy fills it) */
        kv_seq_truncate(s->eng.draft_kv, r->shadow, r->n_shadow);
        made += en_spec_seq_set(s->spec, r->spec, s->d_out + i * EN_SELF_MAX_DRAFT, s->d_cap[i]);
    }
    return made;
}
