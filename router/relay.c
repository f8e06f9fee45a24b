/*
 * relay.c — the way back from the workers and the way around a lost one (internal.h): each
 * worker's `tok`, `done` and `err` frames relayed to the request's client, and migration, which
 * re-sends a request whose worker died, drained or refused to another worker so that the client
 * sees one uninterrupted stream.
 *
 * A greedy or seeded request is *replayed* on the next worker: the prompt alone, with the tokens
 * the client already has regenerated, checked against what was streamed, and dropped, because
 * only the same computation path gives the same tokens bit for bit (a prefill of prompt +
 * generated tokens may round differently from the token-by-token decode that produced them).
 * Other requests *continue*: prompt + generated tokens go to the next worker, and the text of
 * the continuation is detokenized here so a character split across two workers comes out whole.
 * Either way indexes continue. A replay that diverges continues from what the client has.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/internal.h"

/* ---------------------------------------------------------------- migration */

/* The worker is gone (or refused): send q elsewhere. A greedy or seeded request is replayed:
 * the next worker gets the prompt alone and regenerates the tokens already streamed, which the
 * router checks and drops, so the output is the undisturbed one bit for bit (an engine's prefill
 * of prompt + generated tokens is not bound to reproduce its token-by-token decode exactly, and
 * greedy decoding amplifies the last bit). An unseeded sampled request, or a replay that
 * diverged, continues instead: prompt + streamed tokens, generation goes on from there. */
static void migrate_as(rt_router *r, rt_rq *q, const char *why, bool allow_replay)
{
    rt_wk *w = q->worker >= 0 ? &r->w[q->worker] : NULL;
    if (w) w->migrated_away++;
    rt_rq_release_worker(r, q);
    rt_rq_release_waiters(r, q);
    if (q->canceled || (q->fops->origin == RQ_HTTP && !q->http)) {
        /* nobody wants it any more: it ends here, never on another worker */
        KM_INFO("migrate_skipped", "rid=%llu from=%s generated=%d why=\"%s\"",
                (unsigned long long)q->rid, w ? w->id : "-", q->n_gen,
                q->canceled ? "canceled by its client" : "its client is gone");
        if (q->canceled && q->fops->origin == RQ_ZMQ)
            rt_rq_finish(r, q, KM_FINISH_CANCELED, 0, NULL);
        else
            rt_rq_end(r, q);
        return;
    }
    /* The limit counts workers that failed the request, not attempts: a request that keeps
     * making progress while workers come and go is continued (each attempt starts where the last
     * one stopped), but one that different workers keep failing, or that gets nowhere, ends. */
    if (w) q->failed_on |= 1ull << w->idx;
    q->fruitless = q->n_gen > q->gen_at_send ? 0 : q->fruitless + 1;
    int failed = __builtin_popcountll(q->failed_on);
    if (failed >= r->c.max_attempts || q->fruitless >= r->c.max_attempts) {
        char msg[KM_PROTO_MAX_MESSAGE];
        snprintf(msg, sizeof msg,
                 "%s; gave up after %d attempts: %d workers failed it, the last %d without a "
                 "token (%d tokens generated)",
                 why, q->attempts, failed, q->fruitless, q->n_gen);
        rt_rq_fail(r, q, KM_CODE_UNAVAILABLE, 0, msg);
        return;
    }
    bool deterministic = q->q.temperature <= 0 || q->q.has_seed;
    q->replay =
        allow_replay && r->c.migrate_replay && deterministic && q->n_gen > 0 && !q->router_detok;
    if (q->n_gen > 0 && !q->replay && !q->router_detok) {
        /* From here on the text is detokenized by the router: prime its detokenizer with the
         * tokens already delivered (their text went out; only the held-back bytes matter). */
        md_detok_init(&q->dt);
        char tmp[512];
        for (int i = 0; i < q->n_gen; i++)
            md_detok_push(r->tok, &q->dt, q->tokens[q->n_prompt + i], tmp, sizeof tmp);
        q->router_detok = true;
    }
    q->migrations++;
    r->n_migrations++;
    km_counter_inc(r->s_migr);
    KM_INFO("migrate", "rid=%llu from=%s generated=%d attempt=%d how=%s why=\"%s\"",
            (unsigned long long)q->rid, w ? w->id : "-", q->n_gen, q->attempts,
            q->replay ? "replay" : "continue", why);
    rt_dispatch(r, q, false);
}

void rt_migrate(rt_router *r, rt_rq *q, const char *why)
{
    migrate_as(r, q, why, true);
}

/* A replay produced another token than the one streamed (or ended early): stop it and continue
 * from what the client has. */
static void replay_diverged(rt_router *r, rt_rq *q, const char *why)
{
    if (q->worker >= 0) rt_send_cancel(r, &r->w[q->worker], q->rid);
    KM_WARN("replay_diverged", "rid=%llu at=%d why=\"%s\"", (unsigned long long)q->rid, q->att_next,
            why);
    q->replay = false;
    q->migrations--; /* the same migration, carried on differently */
    r->n_migrations--;
    migrate_as(r, q, why, false);
}

/* Every request at w goes elsewhere (w is already unusable, so none comes back to it). cancel:
 * tell w to stop them, for a worker that is still connected (the view says dead, but a hung
 * process may wake up and should not spend its slots on abandoned requests). */
void rt_migrate_all(rt_router *r, rt_wk *w, const char *why, bool cancel)
{
    for (int b = 0; b < RT_RQ_BUCKETS; b++) {
        rt_rq *q = r->buckets[b];
        while (q) {
            rt_rq *next = q->hnext;
            if (q->worker == w->idx) {
                if (cancel) rt_send_cancel(r, w, q->rid);
                rt_migrate(r, q, why);
            }
            q = next;
        }
    }
}

/* ---------------------------------------------------------------- worker frames */

/* A prompt token's logprob from its worker (req.prompt_logprobs: echo with logprobs), kept in
 * q->plp for the front's echo (front.c); repeats (a migrated request's prompt reported again)
 * are dropped. */
static void prompt_logprob(rt_rq *q, const km_msg_token *t)
{
    if (!t->has_logprob || t->index != q->plp.len / sizeof(rt_oai_lp) + 1) return;
    rt_oai_lp lp = {.token = t->token, .logprob = t->logprob};
    lp.n_top = t->n_top < q->q.top_logprobs ? t->n_top : q->q.top_logprobs;
    if (lp.n_top > RT_OAI_MAX_TOP) lp.n_top = RT_OAI_MAX_TOP;
    memcpy(lp.top, t->top, sizeof *lp.top * lp.n_top);
    km_buf_append(&q->plp, &lp, sizeof lp);
}

void rt_relay_token(rt_router *r, rt_wk *w, const km_msg_token *t)
{
    rt_rq *q = rt_rq_find(r, t->id);
    if (!q || q->worker != w->idx) return; /* canceled, or a frame from an earlier attempt */
    if (t->prompt) {                       /* a prompt token's logprob: echo (front.c) */
        if (q->q.prompt_logprobs) prompt_logprob(q, t);
        return;
    }
    if ((int)t->index != q->att_next) return; /* a repeat (never out of order from a worker) */
    q->att_next++;
    int index = q->base + (int)t->index;
    if (index < q->n_gen) { /* replaying what the client already has */
        if (q->tokens[q->n_prompt + index] != t->token)
            replay_diverged(r, q, "the replay produced another token");
        return;
    }
    q->replay = false;
    if (q->n_prompt + q->n_gen >= q->cap) {
        int cap = q->cap * 2;
        int32_t *nt = realloc(q->tokens, sizeof *nt * (size_t)cap);
        if (!nt) return;
        q->tokens = nt;
        q->cap = cap;
    }
    q->tokens[q->n_prompt + q->n_gen++] = t->token;
    if (!q->t_first) {
        q->t_first = km_now_ns();
        km_hist_observe(r->s_ttft, (q->t_first - q->t_arrive) / 1e9);
    }
    if (q->waiters) rt_rq_release_waiters(r, q);
    q->cur_tok = t;
    if (q->router_detok) {
        char piece[KM_PROTO_MAX_PIECE + 64];
        int n = md_detok_push(r->tok, &q->dt, t->token, piece, sizeof piece);
        rt_rq_deliver(r, q, t->token, piece, n > 0 ? (size_t)n : 0);
    } else {
        rt_rq_deliver(r, q, t->token, t->text ? t->text : "", t->text ? t->text_len : 0);
    }
    q->cur_tok = NULL;
}

void rt_relay_done(rt_router *r, rt_wk *w, const km_msg_done *d)
{
    rt_rq *q = rt_rq_find(r, d->id);
    if (!q || q->worker != w->idx) return;
    if (q->replay && q->base + q->att_next < q->n_gen && d->finish != KM_FINISH_CANCELED) {
        replay_diverged(r, q, "the replay ended before the streamed tokens");
        return;
    }
    w->served++;
    w->prompt_tokens += (uint64_t)q->n_prompt;
    uint32_t cached = d->cached_tokens;
    if (!q->first_cached_set) {
        q->first_cached = cached;
        q->first_cached_set = true;
    }
    w->cached_tokens += cached < (uint32_t)q->n_prompt ? cached : (uint32_t)q->n_prompt;
    rt_pull_outcome(r, q, w, cached, d->chunk_tokens); /* pull.c: did its hint work */
    q->worker_queue_ms += d->queue_ms;
    q->draft_tokens = d->draft_tokens;
    q->accepted_draft_tokens = d->accepted_draft_tokens;
    q->chunk_tokens = d->chunk_tokens;
    /* The worker streams every token; its done.text is the tail no token frame carried. When
     * the router detokenizes itself (a continuation after migration) its own flush has it. */
    if (d->text && d->text_len && !q->router_detok) km_buf_append(&q->text, d->text, d->text_len);
    if (d->finish == KM_FINISH_CANCELED && q->fops->origin == RQ_HTTP && !q->http) {
        rt_rq_end(r, q);
        return;
    }
    rt_rq_finish(r, q, d->finish, cached, w->id);
}

void rt_relay_error(rt_router *r, rt_wk *w, const km_msg_error *e)
{
    rt_rq *q = rt_rq_find(r, e->id);
    if (!q || q->worker != w->idx) {
        if (e->id == 0)
            KM_WARN("worker_error", "worker=%s code=%d msg=\"%s\"", w->id, e->code, e->message);
        return;
    }
    if (e->code == KM_CODE_UNAVAILABLE || e->code == KM_CODE_OVERLOADED) {
        /* draining / not ready / full: this worker is out for a moment, try another */
        w->draining = true;
        w->draining_until_ms =
            rt_now_ms() + (e->retry_after_ms ? e->retry_after_ms : (e->code == 503 ? 2000 : 250));
        rt_migrate(r, q, e->message);
        return;
    }
    w->failed++;
    rt_rq_fail(r, q, e->code, e->retry_after_ms, e->message);
}
