/*
 * scheduler.c — iteration-level continuous batching over one engine (en_sched_*, engine/engine.h).
 *
 * Each en_sched_step is one engine forward pass. The batch is built fresh every step: first one
 * decode token for every running sequence that is generating, then prefill chunks of the
 * sequences still reading their prompt, oldest admission first, until the step's token budget
 * is spent. So a long prompt never stalls the decodes of the others (chunked prefill), and a new
 * request joins the very next step (continuous batching).
 *
 * Why these choices:
 *  - Admission asks kvshard for the longest verified cached prefix (kv_seq_attach) and only the
 *    rest is prefilled; the last prompt token is always computed, since its logits are needed.
 *  - Out of pages (KM_ENOSPC from the engine, nothing computed) preempts the lowest-priority,
 *    most recently admitted sequence (vLLM's recompute policy): its full pages are published
 *    first, so they stay in the store as cached pages (demoted to a lower tier by the store when
 *    it needs the room) and the requeued sequence usually re-attaches most of them instead of
 *    recomputing. Until a sequence finishes, no new request is admitted after a preemption, so
 *    the scheduler does not thrash. A sequence that cannot fit even alone fails with 413.
 *  - Waiting requests are ordered by priority plus an aging credit per second waited, so a low
 *    priority request is eventually admitted however many high priority ones arrive. With a
 *    tenant share (scheduler_fair.c) the tenant with the fewest running sequences goes first,
 *    and while another tenant is active none runs more than its share, so one tenant's full
 *    batch does not make every step of another's prefill and decode long.
 *  - A step budget (opts.step_budget_ms) bounds each step's time: the work of a step is counted in
 *    units from the model's shapes (per token: the weight matmuls; per token and attended
 *    position: QK and PV; per logits row: the output projection), every step's time over its
 *    units updates a measured cost per unit (quick to rise, slow to fall: a loaded machine is
 *    believed at once), and prefill chunks are cut so the planned work fits the budget (at least
 *    one page's worth of tokens when the step has nothing else, so a prompt always advances).
 *    Under a budget, prefill chunks are taken shortest remaining prompt first, so a short
 *    request's first token does not wait for a long prompt's whole prefill; every prompt still
 *    gets at least a page per step. The engine's output does not depend on how a prompt is
 *    chunked or what shares its step, so none of this changes a token.
 *  - Budgets and capacities are asserted where they must hold (a step's tokens within
 *    max_batch_tokens, a chunk within prefill_chunk, the queue's room for every preempted
 *    request, the running set within max_running); nothing defines NDEBUG, so every build checks.
 *  - The engine is reached only through en_sched_engine (its step, its end-of-generation test,
 *    its KV store and shapes), so tests/unit/test_scheduler_fake.c runs the scheduler on a fake
 *    engine that needs no model file.
 *  - Every per-step buffer is sized at create; requests allocate only at submit and admission.
 *  - Outputs do not depend on batch composition: the engine's forward is batch-invariant and
 *    each sequence has its own sampler.
 *  - Speculative decoding (spec.h): a decoding sequence may carry draft tokens after its token;
 *    every position yields logits, the sampler picks each position's token as it would have one
 *    step at a time, drafts equal to the picks are kept, and the KV past the last kept one is
 *    truncated. Drafts only use room prefill leaves, the step-cost budget decides how many, and a
 *    step that finds the KV store full drops its drafts before anything is preempted.
 */
#include <assert.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/scheduler_internal.h"

double en_units(const en_sched *s, int pos, int n, int want)
{
    double attended = (double)n * (pos + 1) + (double)n * (n - 1) / 2;
    return n * s->u_tok + attended * s->u_att + (want ? s->u_row : 0);
}

void en_sched_learn_cost(en_sched *s, double per)
{
    double *est = &s->st.ns_per_unit;
    *est = *est <= 0 ? per : per > *est ? 0.5 * *est + 0.5 * per : 0.9 * *est + 0.1 * per;
}

double en_budget_room(const en_sched *s)
{
    if (s->o.step_budget_ms <= 0 || s->st.ns_per_unit <= 0) return INFINITY;
    return s->o.step_budget_ms * 1e6 / s->st.ns_per_unit - s->step_units - s->blend_units;
}

/* The most tokens of r's prompt this step can still take within its budget: what the budget
 * leaves after the step's blend pieces and its batch so far, but at least a page (or what is
 * left of the prompt). */
int en_budget_take(en_sched *s, const en_rq *r, int take)
{
    const double cap = en_budget_room(s);
    if (cap == INFINITY) return take;
    int lo = 0, hi = take;
    while (lo < hi) { /* the largest n with en_units(n) <= cap */
        int mid = lo + (hi - lo + 1) / 2;
        if (en_units(s, r->n_done, mid, r->n_done + mid == r->n_tok) <= cap)
            lo = mid;
        else
            hi = mid - 1;
    }
    /* every prompt advances by at least a page (or what is left) per step, however many decodes
     * and shorter prompts share it, so none waits forever behind a budget */
    int floor = s->pt < take ? s->pt : take;
    if (lo < floor) lo = floor;
    if (lo < take) s->st.budget_cut++;
    return lo;
}

static int en_real_step(void *ctx, const en_batch *b, const float **logits)
{
    return en_engine_step(((en_real_engine *)ctx)->e, b, logits);
}

static int en_real_is_eog(void *ctx, int32_t token)
{
    return md_tok_is_eog(((en_real_engine *)ctx)->tok, token);
}

int en_sched_create(en_engine *e, const en_model *m, const en_sched_opts *o, const en_sched_cb *cb,
                    en_sched **out, km_errbuf *err)
{
    *out = NULL;
    if (!e || !m || !cb)
        return km_errf(err, KM_EINVAL, "sched: engine, model and callbacks needed");
    char fp[33];
    en_model_fingerprint_hex(m, fp);
    en_sched_engine eng = {.kv = en_engine_kv(e),
                           .hp = en_model_hparams(m),
                           .fingerprint = fp,
                           .step = en_real_step,
                           .is_eog = en_real_is_eog};
    int rc = en_sched_create_on(&eng, o, cb, out, err);
    if (rc) return rc;
    (*out)->real = (en_real_engine){e, en_model_tokenizer(m), NULL};
    (*out)->eng.ctx = &(*out)->real;
    if (en_blend_setup(*out, en_model_hparams(m))) {
        en_sched_destroy(*out);
        *out = NULL;
        return km_errf(err, KM_ENOMEM, "sched: out of memory");
    }
    return 0;
}

static int en_real_draft_step(void *ctx, const en_batch *b, const float **logits)
{
    return en_engine_step(((en_real_engine *)ctx)->draft, b, logits);
}

void en_sched_set_draft(en_sched *s, en_engine *draft)
{
    s->real.draft = draft;
    s->eng.draft_kv = draft ? en_engine_kv(draft) : NULL;
    s->eng.draft_step = draft ? en_real_draft_step : NULL;
}

int en_sched_create_on(const en_sched_engine *eng, const en_sched_opts *o, const en_sched_cb *cb,
                       en_sched **out, km_errbuf *err)
{
    *out = NULL;
    if (!eng || !eng->kv || !eng->hp || eng->hp->n_vocab < 1 || !eng->step || !eng->is_eog || !cb)
        return km_errf(err, KM_EINVAL, "sched: engine, KV store, shapes and callbacks needed");
    en_sched *s = calloc(1, sizeof *s);
    if (!s) return km_errf(err, KM_ENOMEM, "sched: out of memory");
    s->eng = *eng;
    s->eng.hp = NULL; /* read below; the caller's copy need not outlive this call */
    s->kv = eng->kv;
    s->cb = *cb;
    s->o = o ? *o : (en_sched_opts){0};
    if (s->o.max_running <= 0) s->o.max_running = 64;
    if (s->o.max_queue <= 0) s->o.max_queue = 1024;
    if (s->o.max_batch_tokens <= 0) s->o.max_batch_tokens = 512;
    if (s->o.prefill_chunk <= 0 || s->o.prefill_chunk > s->o.max_batch_tokens)
        s->o.prefill_chunk = s->o.max_batch_tokens;
    if (s->o.max_ctx <= 0) s->o.max_ctx = 4096;
    if (s->o.default_max_tokens <= 0) s->o.default_max_tokens = 256;
    if (s->o.aging_per_s <= 0) s->o.aging_per_s = 20;
    const en_hparams *hp = eng->hp;
    s->n_vocab = hp->n_vocab;
    s->n_layers = hp->n_layers;
    s->kv_width = hp->n_head_kv;
    s->head_dim = hp->head_dim;
    double q_dim = (double)hp->n_head * hp->head_dim, kv_dim = (double)hp->n_head_kv * hp->head_dim;
    /* an MoE layer runs n_expert_used experts of n_ff rows each per token, and its router */
    double ffn = 3.0 * hp->n_embd * hp->n_ff * (hp->n_expert_used > 0 ? hp->n_expert_used : 1) +
                 (double)hp->n_embd * hp->n_expert;
    s->u_tok = 2.0 * hp->n_layers * (hp->n_embd * (2 * q_dim + 2 * kv_dim) + ffn);
    s->u_att = 4.0 * hp->n_layers * q_dim;
    s->u_row = 2.0 * hp->n_embd * hp->n_vocab;
    s->pt = kv_store_page_tokens(s->kv);
    snprintf(s->fp, sizeof s->fp, "%s", eng->fingerprint ? eng->fingerprint : "");
    s->eng.fingerprint = s->fp;
    s->next_rid = 1;
    /* Preempted sequences go back to the queue, so it holds room for every running one too. */
    s->queue_cap = s->o.max_queue + s->o.max_running;
    int T = s->o.max_batch_tokens;
    s->run = calloc(s->o.max_running, sizeof *s->run);
    s->queue = calloc(s->queue_cap, sizeof *s->queue);
    s->b_tok = calloc(T, sizeof *s->b_tok);
    s->b_pos = calloc(T, sizeof *s->b_pos);
    s->b_seq = calloc(T, sizeof *s->b_seq);
    s->b_want = calloc(T, sizeof *s->b_want);
    s->parts = calloc(T, sizeof *s->parts);
    /* Pages placed by the experts their tokens were routed to: an MoE model over a store with
     * the `expert` shard key (kvshard.h, kv_seq_place). */
    int route = hp->n_expert > 0 && kv_store_n_expert_groups(s->kv) > 0;
    if (route && !(s->b_route = calloc(T, sizeof *s->b_route))) {
        en_sched_destroy(s);
        return km_errf(err, KM_ENOMEM, "sched: out of memory");
    }
    s->b_spec = calloc(s->o.max_running, sizeof *s->b_spec);
    s->order = calloc(s->o.max_running, sizeof *s->order);
    s->tn = calloc(s->queue_cap, sizeof *s->tn);
    const size_t R = (size_t)s->o.max_running;
    s->d_rq = calloc(R, sizeof *s->d_rq);
    s->d_tok = calloc(R, sizeof *s->d_tok);
    s->d_pos = calloc(R, sizeof *s->d_pos);
    s->d_out = calloc(R * EN_SELF_MAX_DRAFT, sizeof *s->d_out);
    s->d_kv = malloc(sizeof *s->d_kv * 2 * (size_t)s->kv_width * s->head_dim);
    s->d_seq = calloc(R, sizeof *s->d_seq);
    s->d_cap = calloc(R, sizeof *s->d_cap);
    s->d_want = malloc(R);
    if (s->d_want) memset(s->d_want, 1, R);
    if (!s->order || !s->tn || !s->run || !s->queue || !s->b_tok || !s->b_pos || !s->b_seq ||
        !s->b_want || !s->parts || !s->b_spec || !s->d_rq || !s->d_tok || !s->d_pos || !s->d_out ||
        !s->d_seq || !s->d_cap || !s->d_want || !s->d_kv ||
        en_spec_create(&s->o.spec, s->o.max_running, &s->spec)) {
        en_sched_destroy(s);
        return km_errf(err, KM_ENOMEM, "sched: out of memory");
    }
    s->o.spec = *en_spec_options(s->spec);
    *out = s;
    return 0;
}

static void en_rq_free(en_sched *s, en_rq *r)
{
    if (!r) return;
    en_rq_drop_shadow(s, r);
    if (r->seq) kv_seq_destroy(s->kv, r->seq);
    en_sampler_destroy(r->smp);
    en_grammar_matcher_destroy(r->gm);
    en_spec_seq_destroy(r->spec);
    free(r->tokens);
    free(r->hashes);
    free(r->route);
    free(r->chunks);
    free(r->reused);
    en_blend_run_end(r->bl, NULL);
    free(r);
}

void en_sched_destroy(en_sched *s)
{
    if (!s) return;
    for (int i = 0; i < s->n_run; i++) en_rq_free(s, s->run[i]);
    for (int i = 0; i < s->n_queue; i++) en_rq_free(s, s->queue[i]);
    free(s->run);
    free(s->queue);
    free(s->b_tok);
    free(s->b_pos);
    free(s->b_seq);
    free(s->b_want);
    free(s->b_route);
    free(s->parts);
    en_grammar_vocab_destroy(s->g_vocab);
    free(s->g_mask);
    free(s->b_spec);
    free(s->d_rq);
    free(s->d_tok);
    free(s->d_pos);
    free(s->d_out);
    free(s->d_seq);
    free(s->d_cap);
    free(s->d_want);
    free(s->d_kv);
    en_spec_destroy(s->spec);
    free(s->order);
    free(s->tn);
    en_blend_teardown(s);
    free(s);
}

/* Extends the page-hash chain over every full page of tokens[0, n_tok). */
static void en_rq_hash(en_sched *s, en_rq *r)
{
    while ((r->n_hashed + 1) * s->pt <= r->n_tok) {
        km_pagehash prev = r->n_hashed ? r->hashes[r->n_hashed - 1] : r->seed;
        r->hashes[r->n_hashed] = km_pagehash_next(prev, r->tokens + r->n_hashed * s->pt, s->pt);
        r->n_hashed++;
    }
}

/* Publishes the full pages whose KV is computed, so later requests (and this one after a
 * preemption) can reuse them. */
void en_rq_publish(en_sched *s, en_rq *r)
{
    if (!r->seq || r->n_done < s->pt) return;
    int n = r->n_done;
    if (n / s->pt > r->n_hashed) n = r->n_hashed * s->pt;
    if (n > r->publish_end) n = r->publish_end; /* blended KV is never a prefix */
    if (n < s->pt) return;
    /* Each new full page goes to the shard of its tokens' most frequent dominant expert (the
     * lower id on a tie) before it is indexed. */
    for (; r->route && r->n_placed < n / s->pt; r->n_placed++) {
        int count[EN_MAX_EXPERTS] = {0}, best = -1, top = 0;
        for (int j = r->n_placed * s->pt; j < (r->n_placed + 1) * s->pt; j++)
            if (r->route[j] >= 0 && r->route[j] < EN_MAX_EXPERTS) count[r->route[j]]++;
        for (int x = 0; x < EN_MAX_EXPERTS; x++) /* strictly more: the lower id on a tie */
            if (count[x] > top) top = count[x], best = x;
        if (best >= 0) kv_seq_place(s->kv, r->seq, r->n_placed * s->pt, best);
    }
    kv_seq_publish(s->kv, r->seq, r->hashes, r->tokens, n);
}

/* r's matcher for q's grammar (the vocabulary's trie made at the first), past the tokens an
 * earlier attempt generated. */
static int en_rq_grammar(en_sched *s, en_rq *r, const en_sched_req *q)
{
    if (!s->real.tok) return KM_EINVAL; /* no vocabulary behind a fake engine */
    if (!s->g_vocab) {
        int rc = en_grammar_vocab_create(s->real.tok, &s->g_vocab);
        if (rc) return rc;
        if (!(s->g_mask = calloc((size_t)(s->n_vocab + 31) / 32, sizeof *s->g_mask)))
            return KM_ENOMEM;
    }
    int rc = en_grammar_matcher_create(q->grammar, s->g_vocab, &r->gm);
    for (int i = q->n_tokens - q->n_generated; !rc && q->n_generated > 0 && i < q->n_tokens; i++)
        rc = en_grammar_accept_token(r->gm, q->tokens[i]);
    return rc;
}

int32_t en_rq_sample(en_sched *s, en_rq *r, const float *row)
{
    if (!r->gm) return en_sampler_sample(r->smp, row);
    en_grammar_mask(r->gm, s->g_mask);
    return en_sampler_sample_masked(r->smp, row, s->g_mask);
}

int en_sched_submit(en_sched *s, const en_sched_req *q, uint64_t *rid)
{
    if (!q || !q->tokens || q->n_tokens < 1) return KM_EINVAL;
    if (s->n_queue >= s->o.max_queue) return KM_EOVERLOAD;
    if (q->n_tokens >= s->o.max_ctx) return KM_ERANGE;
    for (int i = 0; i < q->n_tokens; i++)
        if (q->tokens[i] < 0 || q->tokens[i] >= s->n_vocab) return KM_EINVAL;
    int max_gen = q->max_tokens > 0 ? q->max_tokens : s->o.default_max_tokens;
    if (max_gen > s->o.max_ctx - q->n_tokens) max_gen = s->o.max_ctx - q->n_tokens;
    en_rq *r = calloc(1, sizeof *r);
    if (!r) return KM_ENOMEM;
    int cap = q->n_tokens + max_gen;
    r->tokens = malloc(sizeof *r->tokens * cap);
    r->hashes = malloc(sizeof *r->hashes * (cap / s->pt + 1));
    if (s->b_route && (r->route = malloc(sizeof *r->route * cap)))
        for (int i = 0; i < cap; i++) r->route[i] = -1;
    int rc = r->tokens && r->hashes && (r->route || !s->b_route) ? 0 : KM_ENOMEM;
    if (!rc) rc = en_sampler_create(&q->sample, s->n_vocab, &r->smp);
    if (rc) {
        en_rq_free(s, r);
        return rc;
    }
    rc = en_rq_chunks(s, r, q);
    if (!rc && q->grammar) rc = en_rq_grammar(s, r, q);
    if (rc) {
        en_rq_free(s, r);
        return rc;
    }
    memcpy(r->tokens, q->tokens, sizeof *r->tokens * q->n_tokens);
    r->n_tok = r->n_prompt = q->n_tokens;
    r->max_gen = max_gen;
    for (int i = 0; i < q->n_tokens; i++) en_sampler_accept(r->smp, q->tokens[i]);
    if (q->n_generated > 0 && q->n_generated < q->n_tokens) en_sampler_skip(r->smp, q->n_generated);
    r->seed = km_pagehash_seed(s->fp, strlen(s->fp), s->o.cluster_seed, q->cache_salt,
                               q->cache_salt ? q->cache_salt_len : 0);
    int mode = q->speculate ? q->speculate : s->o.spec.mode;
    r->self = mode == EN_SPEC_SELF && s->eng.draft_step;
    if (mode == EN_SPEC_AUTO || mode == EN_SPEC_SELF) {
        /* The request's tenant key is its page-hash seed: model, cluster seed and cache_salt. */
        rc = en_spec_seq_create(s->spec, r->seed, cap, q->max_draft, &r->spec);
        if (rc) {
            en_rq_free(s, r);
            return rc;
        }
        en_spec_seq_append(r->spec, r->tokens, r->n_tok);
    }
    en_rq_hash(s, r);
    r->rid = s->next_rid++;
    r->user = q->user;
    r->priority = q->priority;
    r->tenant = q->tenant;
    r->ignore_eos = q->ignore_eos;
    r->plp_end = q->prompt_logprobs ? q->n_tokens - q->n_generated : 0;
    r->plp_top = q->sample.top_logprobs < EN_MAX_TOP ? q->sample.top_logprobs : EN_MAX_TOP;
    r->deadline_ns = q->deadline_ns;
    r->arrival_ns = q->arrival_ns ? q->arrival_ns : km_now_ns();
    /* held requests never outnumber the queue's room: a preempted one goes back there */
    assert(s->n_queue + s->n_run < s->queue_cap);
    s->queue[s->n_queue++] = r;
    if (rid) *rid = r->rid;
    return 0;
}

int en_sched_cancel(en_sched *s, uint64_t rid)
{
    for (int i = 0; i < s->n_run; i++)
        if (s->run[i]->rid == rid) return s->run[i]->canceled = 1, 0;
    for (int i = 0; i < s->n_queue; i++)
        if (s->queue[i]->rid == rid) return s->queue[i]->canceled = 1, 0;
    return KM_ENOTFOUND;
}

int en_sched_pending(const en_sched *s)
{
    return s->n_run + s->n_queue;
}

void en_sched_stats_get(const en_sched *s, en_sched_stats *out)
{
    *out = s->st;
    en_spec_stats sp;
    en_spec_stats_get(s->spec, &sp);
    out->spec_drafted = sp.drafted;
    out->spec_accepted = sp.accepted;
    out->spec_rejected = sp.rejected;
    out->spec_verifies = sp.verifies;
    out->spec_backoffs = sp.backoffs;
    out->running = s->n_run;
    out->queued = s->n_queue;
}

static double en_ms(uint64_t from, uint64_t to)
{
    return to > from ? (to - from) / 1e6 : 0.0;
}

static void en_rq_usage(const en_rq *r, uint64_t now, en_sched_usage *u)
{
    int drafted = 0, accepted = 0;
    if (r->spec) en_spec_seq_counts(r->spec, &drafted, &accepted);
    *u = (en_sched_usage){
        .draft_tokens = drafted,
        .accepted_draft_tokens = accepted,
        .prompt_tokens = r->n_prompt,
        .cached_tokens = r->cached_tokens,
        .chunk_tokens = r->chunk_tokens,
        .completion_tokens = r->n_gen,
        .preemptions = r->preemptions,
        .queue_ms = r->admitted ? en_ms(r->arrival_ns, r->admit_ns) : en_ms(r->arrival_ns, now),
        .ttft_ms = r->first_ns ? en_ms(r->arrival_ns, r->first_ns) : 0.0,
        .total_ms = en_ms(r->arrival_ns, now),
    };
}

/* Removes element i keeping the order (run order is admission order). */
static void en_remove_at(en_rq **a, int *n, int i)
{
    memmove(a + i, a + i + 1, sizeof *a * (*n - i - 1));
    (*n)--;
}

/* Ends a request: publish its pages, release its KV, report, free. code 0: done with finish. */
static void en_rq_end(en_sched *s, en_rq *r, km_finish finish, int code, const char *msg)
{
    uint64_t now = km_now_ns();
    en_sched_usage u;
    en_rq_usage(r, now, &u);
    en_rq_publish(s, r);
    /* What it wrote becomes draft material for the same tenant's later requests. */
    if (!code && r->n_gen > 0) en_spec_learn(s->spec, r->seed, r->tokens, r->n_prompt, r->n_tok);
    if (!code) en_rq_blend_ended(s, r);
    if (r->seq) {
        en_rq_drop_shadow(s, r);
        kv_seq_destroy(s->kv, r->seq);
        r->seq = NULL;
    }
    s->admit_blocked = 0;
    en_fair_ended(s, r->tenant, now);
    if (code) {
        s->st.failed++;
        if (s->cb.on_error) s->cb.on_error(s->cb.ctx, r->user, code, msg, &u);
    } else {
        if (finish == KM_FINISH_CANCELED)
            s->st.canceled++;
        else if (finish == KM_FINISH_DEADLINE)
            s->st.deadline++;
        else
            s->st.completed++;
        if (s->cb.on_done) s->cb.on_done(s->cb.ctx, r->user, finish, &u);
    }
    en_rq_free(s, r);
}

/* Ends r after a failure rc of admission or of a step. Out of KV pages is two cases: a request
 * larger than the whole hot tier can never run here (413), while one that would fit but finds
 * the pages pinned by others (a memory-pressure episode) is handed back (503) so the router
 * sends it to another worker, and counted as kv_full. */
static void en_rq_end_nospace(en_sched *s, en_rq *r, int rc, const char *what, const char *other)
{
    char msg[96];
    if (rc != KM_ENOSPC) {
        en_rq_end(s, r, KM_FINISH_STOP, km_proto_code_from_err(rc), other);
        return;
    }
    int need = (r->n_tok + 1 + s->pt - 1) / s->pt;
    if (need > kv_store_pages_total(s->kv)) {
        snprintf(msg, sizeof msg, "%s does not fit in the KV cache", what);
        en_rq_end(s, r, KM_FINISH_STOP, KM_CODE_TOO_LARGE, msg);
        return;
    }
    s->st.kv_full++;
    snprintf(msg, sizeof msg, "KV cache full (pages pinned by others): %s handed back", what);
    en_rq_end(s, r, KM_FINISH_STOP, KM_CODE_UNAVAILABLE, msg);
}

void en_sched_abort_all(en_sched *s, int code, const char *message)
{
    while (s->n_run) {
        en_rq *r = s->run[s->n_run - 1];
        s->n_run--;
        en_rq_end(s, r, KM_FINISH_STOP, code, message);
    }
    while (s->n_queue) {
        en_rq *r = s->queue[s->n_queue - 1];
        s->n_queue--;
        en_rq_end(s, r, KM_FINISH_STOP, code, message);
    }
}

/* Gives a queued request a sequence and its longest cached prefix. */
static int en_rq_admit(en_sched *s, en_rq *r, uint64_t now)
{
    int rc = kv_seq_create(s->kv, &r->seq);
    if (rc) return rc;
    /* The last token is always computed: its logits pick the next one. */
    int max_pages = (r->n_tok - 1) / s->pt;
    if (max_pages > r->n_hashed) max_pages = r->n_hashed;
    if (r->plp_end > r->plp_done + 1) max_pages = 0; /* prompt logprobs still to report */
    int got = max_pages ? kv_seq_attach(s->kv, r->seq, r->hashes, r->tokens, max_pages) : 0;
    if (got < 0) {
        en_rq_drop_shadow(s, r);
        kv_seq_destroy(s->kv, r->seq);
        r->seq = NULL;
        return got;
    }
    r->n_done = got * s->pt;
    r->n_placed = got; /* attached pages are where their first owner placed them */
    en_rq_blend_attach(s, r);
    if (!r->admitted) {
        r->admitted = 1;
        r->admit_ns = now;
        r->cached_tokens = r->n_done < r->n_prompt ? r->n_done : r->n_prompt;
        s->st.prompt_tokens += r->n_prompt;
        s->st.cached_tokens += r->cached_tokens;
    } else {
        s->st.recomputed_tokens += r->n_tok - 1 - r->n_done;
    }
    return 0;
}

void en_rq_requeue(en_sched *s, int i)
{
    en_rq *r = s->run[i];
    en_rq_publish(s, r);
    en_rq_drop_shadow(s, r);
    en_blend_run_end(r->bl, NULL); /* a blend prefill under way: re-admitted, it computes */
    r->bl = NULL;
    kv_seq_destroy(s->kv, r->seq);
    r->seq = NULL;
    r->n_done = 0;
    en_remove_at(s->run, &s->n_run, i);
    assert(s->n_queue + s->n_run < s->queue_cap);
    s->queue[s->n_queue++] = r;
}

/* Out of pages: a running sequence goes back to the queue, and nothing is admitted until a
 * sequence ends. */
static void en_rq_preempt(en_sched *s, int i)
{
    en_rq *r = s->run[i];
    r->preemptions++;
    s->st.preemptions++;
    en_rq_requeue(s, i);
    s->admit_blocked = 1;
    KM_INFO("sched_preempt", "rid=%llu tokens=%d priority=%d running=%d",
            (unsigned long long)r->rid, r->n_tok, r->priority, s->n_run);
}

/* Expired and canceled requests end before anything else happens in a step. */
static void en_sched_expire(en_sched *s, uint64_t now)
{
    for (int i = 0; i < s->n_queue;) {
        en_rq *r = s->queue[i];
        if (r->canceled || (r->deadline_ns && now >= r->deadline_ns)) {
            en_remove_at(s->queue, &s->n_queue, i);
            en_rq_end(s, r, r->canceled ? KM_FINISH_CANCELED : KM_FINISH_DEADLINE, 0, NULL);
        } else {
            i++;
        }
    }
    for (int i = 0; i < s->n_run;) {
        en_rq *r = s->run[i];
        if (r->canceled || (r->deadline_ns && now >= r->deadline_ns)) {
            en_remove_at(s->run, &s->n_run, i);
            en_rq_end(s, r, r->canceled ? KM_FINISH_CANCELED : KM_FINISH_DEADLINE, 0, NULL);
        } else {
            i++;
        }
    }
}

/* Pages the running sequences hold or are about to (their tokens so far, plus one). */
static int en_sched_pages_held(const en_sched *s)
{
    int n = 0;
    for (int i = 0; i < s->n_run; i++) n += (s->run[i]->n_tok + 1 + s->pt - 1) / s->pt;
    return n;
}

static void en_sched_admit(en_sched *s, uint64_t now)
{
    int fair = s->o.tenant_share > 0;
    while (s->n_queue && s->n_run < s->o.max_running && (!s->admit_blocked || !s->n_run)) {
        int best = -1, best_mine = 0;
        double best_score = 0;
        en_tenant *bt = NULL;
        for (int i = 0; i < s->n_queue; i++) {
            const en_rq *r = s->queue[i];
            /* with a tenant share: the tenants at it wait, the fewest running go first */
            en_tenant *t = fair ? en_fair_of(s, r->tenant) : NULL;
            if (t && en_fair_held(s, t, now)) continue;
            int mine = t ? t->running : 0;
            double waited = now > r->arrival_ns ? (now - r->arrival_ns) / 1e9 : 0;
            double score = r->priority + s->o.aging_per_s * waited;
            if (best < 0 || mine < best_mine ||
                (mine == best_mine &&
                 (score > best_score ||
                  (score == best_score && r->arrival_ns < s->queue[best]->arrival_ns)))) {
                best = i;
                best_mine = mine;
                best_score = score;
                bt = t;
            }
        }
        if (best < 0) return;
        en_rq *r = s->queue[best];
        /* Admit only what the hot tier can hold next to the running sequences' pages (cached
         * pages nobody uses do not count: the store evicts them on demand). Decode growth can
         * still overflow it; that is what preemption is for. */
        int need = (r->n_tok + 1 + s->pt - 1) / s->pt;
        if (s->n_run && en_sched_pages_held(s) + need > kv_store_pages_total(s->kv)) return;
        int rc = en_rq_admit(s, r, now);
        if (rc == KM_ENOSPC && s->n_run) return; /* room comes back as sequences end */
        en_remove_at(s->queue, &s->n_queue, best);
        if (bt) bt->queued--, bt->running += !rc;
        if (rc) {
            en_rq_end_nospace(s, r, rc, "prompt", "cannot admit the request");
            continue;
        }
        s->admit_blocked = 0;
        assert(s->n_run < s->o.max_running && r->n_done < r->n_tok); /* its last token computed */
        s->run[s->n_run++] = r;
    }
}

/* Fills the batch: decodes (each with its granted drafts) first, then prefill chunks in
 * admission order. When the step decodes and decode_prefill is set, its prompt tokens are capped
 * there: a long prefill in the same step is what makes a running sequence wait for its next
 * token (inter-token latency spikes). */
static int en_sched_build(en_sched *s, int *n_parts)
{
    int n = 0, np = 0, budget = s->o.max_batch_tokens;
    s->step_units = 0;
    s->step_prefill = 0;
    for (int i = 0; i < s->n_run; i++) s->order[i] = i;
    if (s->o.step_budget_ms > 0) {
        /* Under a step budget a long prompt's prefill spans many steps; shortest remaining
         * prompt first keeps short requests from waiting behind it (their first token comes in
         * a step or two), and the long one still advances by at least a page per step. Stable
         * (insertion sort), so equal prompts keep their admission order. */
        for (int i = 1; i < s->n_run; i++) {
            int v = s->order[i], j = i - 1;
            int left = s->run[v]->n_tok - s->run[v]->n_done;
            while (j >= 0 && s->run[s->order[j]]->n_tok - s->run[s->order[j]]->n_done > left) {
                s->order[j + 1] = s->order[j];
                j--;
            }
            s->order[j + 1] = v;
        }
    }
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1 && n > 0 && s->o.decode_prefill > 0 && n + s->o.decode_prefill < budget)
            budget = n + s->o.decode_prefill;
        if (pass == 1 && s->fair_cap > 0 && n + s->fair_cap < budget) budget = n + s->fair_cap;
        for (int i = 0; i < s->n_run && n < budget; i++) {
            en_rq *r = s->run[s->order[i]];
            int left = r->n_tok - r->n_done, nd = 0;
            if (left <= 0 || r->sit_out || r->bl || (pass == 0) != (left == 1)) continue;
            const int32_t *d = r->spec && pass == 0 ? en_spec_seq_draft(r->spec, &nd) : NULL;
            if (nd > budget - n - 1) nd = 0; /* the plan left room; never overflow the batch */
            int take = left;
            if (take > s->o.prefill_chunk) take = s->o.prefill_chunk;
            if (take > budget - n) take = budget - n;
            if (pass == 1) take = en_budget_take(s, r, take);
            if (take <= 0) continue;
            assert(take <= s->o.prefill_chunk && n + take + nd <= s->o.max_batch_tokens);
            s->step_units += en_units(s, r->n_done, take + nd, r->n_done + take == r->n_tok);
            if (pass == 1) s->step_prefill += take;
            int plp = 0; /* positions p whose logits give prompt token p + 1's logprob */
            for (int j = 0; j < take; j++) {
                int p = r->n_done + j, lp = p + 1 < r->plp_end && p + 1 > r->plp_done;
                s->b_tok[n + j] = r->tokens[p];
                s->b_pos[n + j] = p;
                s->b_seq[n + j] = r->seq;
                s->b_want[n + j] = p == r->n_tok - 1 || lp;
                plp += lp;
            }
            for (int j = 0; j < nd; j++) {
                s->b_tok[n + take + j] = d[j];
                s->b_pos[n + take + j] = r->n_done + take + j;
                s->b_seq[n + take + j] = r->seq;
                s->b_want[n + take + j] = 1;
            }
            s->parts[np++] = (en_part){.rq = r,
                                       .n = take + nd,
                                       .want = r->n_done + take == r->n_tok,
                                       .draft = nd,
                                       .plp = plp};
            n += take + nd;
        }
    }
    assert(n <= s->o.max_batch_tokens && np <= s->n_run);
    *n_parts = np;
    return n;
}

/* The prompt logprobs of part p (p->plp rows from logits[row], before the part's sampling row):
 * each position reported once, in order; the row after them. */
static int en_rq_prompt_logprobs(en_sched *s, en_rq *r, const en_part *p, const float *logits,
                                 int row)
{
    en_logprobs lp;
    for (int j = 0; j < p->n - p->draft; j++) {
        int pos = r->n_done + j + 1; /* the plan's test: rows come in the order of positions */
        if (pos >= r->plp_end || pos <= r->plp_done) continue;
        en_logprobs_compute(logits + (size_t)row++ * s->n_vocab, s->n_vocab, r->tokens[pos],
                            r->plp_top, &lp);
        r->plp_done = pos;
        if (s->cb.on_prompt_logprob) s->cb.on_prompt_logprob(s->cb.ctx, r->user, pos, &lp);
    }
    return row;
}

/* The victim of a preemption: lowest priority, then the most recently admitted. */
static int en_sched_victim(const en_sched *s)
{
    int v = s->n_run - 1;
    for (int i = s->n_run - 1; i >= 0; i--)
        if (s->run[i]->priority < s->run[v]->priority) v = i;
    return v;
}

static int en_index_of(en_rq **a, int n, const en_rq *r)
{
    for (int i = 0; i < n; i++)
        if (a[i] == r) return i;
    return -1;
}

/* One sampled token: record it and report it. Returns 1 when the request is over (*fin says
 * why; the caller ends it), 0 to go on. */
int en_rq_push(en_sched *s, en_rq *r, int32_t t, uint64_t now, km_finish *fin)
{
    if (!r->first_ns) r->first_ns = now;
    if (!r->ignore_eos && s->eng.is_eog(s->eng.ctx, t)) {
        *fin = KM_FINISH_STOP;
        return 1;
    }
    r->tokens[r->n_tok++] = t;
    r->n_gen++;
    en_sampler_accept(r->smp, t);
    /* the mask allowed t, so the grammar takes it; ignore_eos may push an end token it
     * refuses while incomplete, which changes nothing */
    if (r->gm) en_grammar_accept_token(r->gm, t);
    if (r->spec) en_spec_seq_append(r->spec, &t, 1);
    en_rq_hash(s, r);
    s->cur_lp = en_sampler_logprobs(r->smp); /* the token just sampled: en_sched_logprobs */
    int stop = s->cb.on_token ? s->cb.on_token(s->cb.ctx, r->user, r->n_gen - 1, t) : 0;
    s->cur_lp = NULL;
    stop |= r->gm && en_grammar_done(r->gm); /* nothing may follow the value */
    if (stop || r->n_gen >= r->max_gen) {
        *fin = stop ? KM_FINISH_STOP : KM_FINISH_LENGTH;
        return 1;
    }
    return 0;
}

const en_logprobs *en_sched_logprobs(const en_sched *s)
{
    return s->cur_lp;
}

void en_rq_finish(en_sched *s, en_rq *r, km_finish fin)
{
    en_remove_at(s->run, &s->n_run, en_index_of(s->run, s->n_run, r));
    en_rq_end(s, r, fin, 0, NULL);
}

void en_sched_prepare(en_sched *s)
{
    uint64_t now = km_now_ns();
    en_sched_expire(s, now);
    en_fair_count(s);
    en_fair_yield(s, now);
    en_sched_admit(s, now);
}

int en_sched_step(en_sched *s)
{
    int stored = en_sched_blend_store(s);
    en_sched_prepare(s);
    en_fair_step(s);
    int blended = en_sched_blend(s) + stored;
    en_sched_plan(s);

    int n, np, drafts;
    const float *logits = NULL;
    uint64_t t0 = 0;
    for (;;) {
        n = en_sched_build(s, &np);
        if (!n) return blended;
        drafts = 0;
        for (int i = 0; i < np; i++) drafts += s->parts[i].draft;
        en_batch b = {.n_tokens = n,
                      .tokens = s->b_tok,
                      .pos = s->b_pos,
                      .seqs = s->b_seq,
                      .logits = s->b_want,
                      .route = s->b_route};
        if (s->b_route) memset(s->b_route, 0xff, sizeof *s->b_route * n); /* -1: not reported */
        t0 = km_now_ns();
        int rc = s->eng.step(s->eng.ctx, &b, &logits);
        if (rc >= 0) {
            /* Drafts ride on decode steps, so the cost model learns from those alone: a
             * prefill chunk's many tokens share each weight read and unpacking, so they cost
             * less each than the tokens of a step of a few, the region drafts live in, and a
             * slope learned from prefill underpriced long verifications (docs/benchmarks.md,
             * "Step cost by tokens in the step"). */
            if (!s->step_prefill) en_spec_observe_step(s->spec, n, (km_now_ns() - t0) / 1e6);
            break;
        }
        if (rc == KM_ENOSPC && drafts) { /* drafts are the first thing to give up */
            for (int i = 0; i < s->n_run; i++)
                if (s->run[i]->spec) en_spec_seq_clear(s->run[i]->spec);
            continue;
        }
        if (rc == KM_ENOSPC && s->n_run > 1) {
            en_rq_preempt(s, en_sched_victim(s));
            continue;
        }
        /* A lone sequence that does not fit, or an engine failure: end what was in the batch. */
        s->st.engine_errors += rc != KM_ENOSPC;
        for (int i = 0; i < np; i++) {
            en_rq *r = s->parts[i].rq;
            en_remove_at(s->run, &s->n_run, en_index_of(s->run, s->n_run, r));
            en_rq_end_nospace(s, r, rc, "sequence", "engine step failed");
        }
        return rc == KM_ENOSPC ? 0 : rc;
    }
    s->st.steps++;
    uint64_t now = km_now_ns();
    double ms = (now - t0) / 1e6;
    if (ms > s->st.step_ms_max) s->st.step_ms_max = ms;
    /* Only steps with a page or more of prompt teach the cost: decode-only steps are slower per
     * unit (one token per weight read), and they are not what the budget cuts. */
    if (s->step_units > 0 && s->step_prefill >= s->pt) {
        en_sched_learn_cost(s, (now - t0) / s->step_units);
    }
    int row = 0;
    for (int i = 0, off = 0; i < np; off += s->parts[i++].n) {
        en_part *p = &s->parts[i];
        en_rq *r = p->rq;
        if (r->route) /* positions r->n_done on are this part's tokens (drafts included) */
            memcpy(r->route + r->n_done, s->b_route + off, sizeof *r->route * p->n);
        if (p->draft) {
            en_sched_verify(s, p, logits + (size_t)row * s->n_vocab, now);
            row += p->n;
            continue;
        }
        if (p->plp) row = en_rq_prompt_logprobs(s, r, p, logits, row);
        int before = r->n_done / s->pt;
        r->n_done += p->n;
        if (p->n == 1 && r->n_gen > 0)
            s->st.decode_tokens++;
        else
            s->st.prefill_tokens += p->n;
        if (r->n_done / s->pt > before) en_rq_publish(s, r);
        if (!p->want) continue;
        const float *row_logits = logits + (size_t)row++ * s->n_vocab;
        km_finish fin;
        if (en_rq_push(s, r, en_rq_sample(s, r, row_logits), now, &fin)) en_rq_finish(s, r, fin);
    }
    return n;
}
