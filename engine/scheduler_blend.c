/*
 * scheduler_blend.c — the scheduler's side of chunk reuse (en_sched_req.chunks, engine/blend.c,
 * docs/blend.md "Serving").
 *
 * A request may mark segments of its prompt as chunks (retrieved documents). At its first
 * admission, after the longest cached prefix is attached, every chunk past that prefix whose
 * pages the store holds (chain seeded by the tenant's chunk seed, computed after the preamble)
 * is copied into the request's sequence at its position, keys re-rotated (en_blend_copy). The
 * prompt up to the end of the last reused chunk (the blend part: the probe, then every other
 * token through every layer and the chunk tokens that drift most recomputed, progressively) is
 * run in pieces before each step's batch (en_blend_run_*), the rest of the prompt then
 * prefilled by the batch like any prompt; from there it decodes like any other.
 *
 * Why these choices:
 *  - Blended KV is not what full recomputation gives, and every token after a reused chunk
 *    attended to it: the request's pages from the page of its first reused chunk on are never
 *    published (r->publish_end), so no later prefix lookup finds approximate KV. The pages before
 *    it are exact and are published as usual.
 *  - The blend part runs outside the batch because its tokens go through different numbers of
 *    layers (en_batch.depth) and its probe must finish before the recompute is chosen. A piece
 *    per step is what a prefill chunk of the request could be there (prefill_chunk, and
 *    decode_prefill while others decode, the tenants' fair_cap), in (token, layer) pairs, cut
 *    by the step budget at its own tokens' price (en_blend_run_price): so the running sequences'
 *    next token waits for a piece, never for the whole part. The engine is batch-invariant:
 *    pieces change no logit.
 *  - A chunk the store does not hold is computed with the rest of the prompt (exact), and its own
 *    copy, computed alone after the preamble, is stored after the request ends, between steps
 *    when nothing else waits (or one per step when many are queued): the request that brings a
 *    document first never waits for its caching.
 *  - A preempted request is re-admitted without reuse (its pages past publish_end were never
 *    published, so it recomputes them in full): correct, only slower. A migrated request is a
 *    new submission on another worker and may reuse chunks there.
 *  - Only over en_sched_create (the real engine and the tokenizer that makes the preamble),
 *    dense or MoE; otherwise chunks are computed in full and nothing is stored.
 */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/scheduler_internal.h"

/* A chunk to compute and store: its tokens and its tenant's chunk seed. */
typedef struct en_chunk_job {
    int32_t *tokens;
    int n;
    km_pagehash seed;
} en_chunk_job;

/* Store jobs beyond this many are dropped (the next request with the chunk queues it again). */
enum { EN_CHUNK_JOBS_MAX = 64, EN_CHUNK_JOBS_BUSY = 16 };

int en_blend_setup(en_sched *s, const en_hparams *hp)
{
    if (!s->real.e || !s->real.tok || s->o.blend_fraction < 0) return 0;
    const char *text = EN_SCHED_BLEND_PREAMBLE;
    int32_t ids[256];
    int n = md_tok_encode(s->real.tok, text, strlen(text), 0, 1, ids, 256);
    if (n < s->pt) return 0; /* a page of preamble, or no reuse */
    if (!(s->pre = malloc(sizeof *s->pre * (size_t)s->pt))) return KM_ENOMEM;
    memcpy(s->pre, ids, sizeof *s->pre * (size_t)s->pt);
    s->n_pre = s->pt;
    return 0;
}

void en_blend_teardown(en_sched *s)
{
    for (int i = 0; i < s->n_jobs; i++) free(s->jobs[i].tokens);
    free(s->jobs);
    free(s->pre);
}

int en_rq_chunks(en_sched *s, en_rq *r, const en_sched_req *q)
{
    (void)s;
    r->publish_end = INT_MAX;
    if (q->n_chunks <= 0) return q->n_chunks < 0 ? KM_EINVAL : 0;
    if (q->n_chunks > EN_SCHED_MAX_CHUNKS || !q->chunks) return KM_EINVAL;
    for (int c = 0, end = 0; c < q->n_chunks; c++) {
        const en_blend_seg *g = &q->chunks[c];
        if (g->n <= 0 || g->start < end || g->start > q->n_tokens - g->n) return KM_EINVAL;
        end = g->start + g->n;
    }
    r->chunks = malloc(sizeof *r->chunks * (size_t)q->n_chunks);
    r->reused = malloc(sizeof *r->reused * (size_t)q->n_chunks);
    if (!r->chunks || !r->reused) return KM_ENOMEM;
    memcpy(r->chunks, q->chunks, sizeof *r->chunks * (size_t)q->n_chunks);
    r->n_chunks = q->n_chunks;
    _Static_assert(EN_SCHED_MAX_CHUNKS <= 64, "chunk_missed has a bit per chunk");
    r->chunk_missed = q->n_chunks < 64 ? (1ull << q->n_chunks) - 1 : ~0ull;
    return 0;
}

static en_blend_key en_chunk_key(const en_sched *s, km_pagehash tenant_seed)
{
    return (en_blend_key){en_blend_chunk_seed(tenant_seed), s->pre, s->n_pre};
}

static en_blend_opts en_blend_sched_opts(const en_sched *s)
{
    const float f = s->o.blend_fraction_set ? s->o.blend_fraction : EN_BLEND_FRACTION;
    return (en_blend_opts){.fraction = f, .reuse_last = 1}; /* the last chunk is not in reused */
}

/* A blend prefill that failed: the batch computes the prompt in full from n_done instead. */
static void en_rq_blend_fail(en_rq *r, int rc)
{
    KM_WARN("sched_blend", "rid=%llu err=%s: computed in full", (unsigned long long)r->rid,
            km_strerror(rc));
    en_blend_run_end(r->bl, NULL);
    r->bl = NULL;
    r->n_reused = 0;
    r->publish_end = INT_MAX;
}

void en_rq_blend_attach(en_sched *s, en_rq *r)
{
    r->n_reused = 0, r->publish_end = INT_MAX; /* a re-admission computes in full */
    if (!s->n_pre || !r->n_chunks || r->admitted || r->plp_end) return;
    en_engine *e = s->real.e;
    const en_blend_key key = en_chunk_key(s, r->seed);
    for (int c = 0; c < r->n_chunks; c++) {
        const en_blend_seg *g = &r->chunks[c];
        /* inside the cached prefix, or reaching the last token (always computed: its logits) */
        if (g->start < r->n_done || g->start >= r->n_tok - 1) continue;
        /* the last chunk, nearest the question, is computed in full (en_blend_opts.reuse_last:
         * docs/blend.md, Quality): only whether it is stored is asked, nothing attached */
        if (c == r->n_chunks - 1) {
            if (en_blend_chunk_held(e, &key, r->tokens + g->start, g->n) >= g->n / s->pt * s->pt)
                r->chunk_missed &= ~(1ull << c);
            continue;
        }
        kv_seq *cq = NULL;
        int held = en_blend_chunk_attach(e, &key, r->tokens + g->start, g->n, &cq);
        if (held < 0) continue;
        if (held >= g->n / s->pt * s->pt) r->chunk_missed &= ~(1ull << c);
        if (held > r->n_tok - 1 - g->start) held = r->n_tok - 1 - g->start;
        int rc = held > 0 && cq ? en_blend_copy(e, cq, s->n_pre, r->seq, g->start, held) : 0;
        if (cq) kv_seq_destroy(s->kv, cq);
        if (rc) { /* what was copied is overwritten by a full prefill */
            r->n_reused = 0;
            break;
        }
        if (held > 0) r->reused[r->n_reused++] = (en_blend_seg){g->start, held};
    }
    if (r->n_reused) {
        /* the blend part ends with the last reused chunk; the batch prefills the rest */
        const en_blend_seg *g = &r->reused[r->n_reused - 1];
        const en_blend_opts o = en_blend_sched_opts(s);
        int rc = en_blend_run_begin(e, r->seq, r->tokens, r->n_tok, r->n_done, g->start + g->n,
                                    r->reused, r->n_reused, &o, &r->bl);
        if (rc)
            en_rq_blend_fail(r, rc);
        else
            r->publish_end = r->reused[0].start / s->pt * s->pt;
    }
    s->st.chunk_misses += (uint64_t)__builtin_popcountll(r->chunk_missed);
}

int en_sched_blend(en_sched *s)
{
    s->blend_units = 0, s->step_units = 0;
    int decoding = 0, ran = 0;
    for (int i = 0; i < s->n_run; i++)
        decoding += !s->run[i]->bl && s->run[i]->n_tok - s->run[i]->n_done == 1;
    /* a piece is what a prefill chunk of the request could be in this step (en_sched_build's
     * caps, in (token, layer) pairs), priced at its tokens' own positions and depths against
     * what the step budget leaves (its units counted before the batch's), a page's worth at
     * least; a piece of a page's worth or more teaches the cost per unit as a batch does */
    int cap = s->o.prefill_chunk;
    if (decoding && s->o.decode_prefill > 0 && cap > s->o.decode_prefill) cap = s->o.decode_prefill;
    if (s->fair_cap > 0 && cap > s->fair_cap) cap = s->fair_cap; /* scheduler_fair.c */
    const long floor = (long)s->pt * s->n_layers;
    for (int i = 0; i < s->n_run; i++) {
        en_rq *r = s->run[i];
        if (!r->bl || r->sit_out) continue;
        const double room = en_budget_room(s);
        const uint64_t t0 = km_now_ns();
        long left = (long)cap * s->n_layers, tl = 0, done = 0;
        double units = 0;
        while (left > 0 && tl >= 0 && !en_blend_run_done(r->bl)) {
            double cost;
            long want = en_blend_run_price(r->bl, left, s->u_tok, s->u_att, room - units, &cost);
            if (done < floor && want < floor - done)
                want = en_blend_run_price(r->bl, floor - done < left ? floor - done : left,
                                          s->u_tok, s->u_att, INFINITY, &cost);
            else if (cost > room - units) {
                s->st.budget_cut++;
                break;
            }
            tl = en_blend_run_step(r->bl, want, NULL);
            if (tl > 0)
                left -= tl, done += tl, units += cost,
                    ran += (int)((tl + s->n_layers - 1) / s->n_layers);
        }
        s->blend_units += units;
        if (tl >= 0 && done >= floor && units > 0)
            en_sched_learn_cost(s, (double)(km_now_ns() - t0) / units);
        if (tl < 0) {
            en_rq_blend_fail(r, (int)tl);
            continue;
        }
        if (!en_blend_run_done(r->bl)) continue;
        en_blend_stats st;
        en_blend_run_end(r->bl, &st);
        r->bl = NULL;
        const en_blend_seg *g = &r->reused[r->n_reused - 1];
        r->chunk_tokens = st.reused;
        s->st.chunk_tokens += (uint64_t)st.reused;
        s->st.chunk_recomputed += (uint64_t)st.recomputed;
        s->st.prefill_tokens += (uint64_t)(g->start + g->n - r->n_done - st.reused);
        r->n_done = g->start + g->n; /* the rest is an ordinary prefill, in the batch */
        en_rq_publish(s, r);
    }
    return ran;
}

void en_rq_blend_ended(en_sched *s, const en_rq *r)
{
    if (!s->n_pre) return;
    for (int c = 0; c < r->n_chunks && s->n_jobs < EN_CHUNK_JOBS_MAX; c++) {
        const en_blend_seg *g = &r->chunks[c];
        if (!(r->chunk_missed >> c & 1) || g->n < s->pt) continue;
        if (s->n_jobs == s->cap_jobs) {
            int cap = s->cap_jobs ? 2 * s->cap_jobs : 8;
            en_chunk_job *j = realloc(s->jobs, sizeof *j * (size_t)cap);
            if (!j) return;
            s->jobs = j, s->cap_jobs = cap;
        }
        int32_t *t = malloc(sizeof *t * (size_t)g->n);
        if (!t) return;
        memcpy(t, r->tokens + g->start, sizeof *t * (size_t)g->n);
        s->jobs[s->n_jobs++] = (en_chunk_job){t, g->n, r->seed};
    }
}

int en_sched_blend_store(en_sched *s)
{
    if (!s->n_jobs || (s->n_run + s->n_queue && s->n_jobs < EN_CHUNK_JOBS_BUSY)) return 0;
    en_chunk_job j = s->jobs[0];
    memmove(s->jobs, s->jobs + 1, sizeof *s->jobs * (size_t)--s->n_jobs);
    const en_blend_key key = en_chunk_key(s, j.seed);
    int rc = en_blend_chunk_store(s->real.e, &key, j.tokens, j.n);
    if (rc)
        KM_WARN("sched_chunk_store", "tokens=%d err=%s", j.n, km_strerror(rc));
    else
        s->st.chunks_stored++;
    free(j.tokens);
    return 1;
}

int en_sched_chunks_waiting(const en_sched *s)
{
    return s->n_jobs;
}
