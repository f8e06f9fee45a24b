/*
 * spec.h — speculative decoding without a draft model: the parts the scheduler (scheduler.c)
 * drives. Private to worker/; docs/speculative.md tells the whole story with figures.
 *
 * A decoding request proposes a few draft tokens; the engine runs its last token and the drafts
 * in one step with logits at every position (the step costs little more than a one-token step
 * while the weights dominate it); the sampler picks each position's token as it always would,
 * and the drafts that equal those picks are kept, plus the first pick that differs.
 *
 * Contract:
 *  - Exact: drafts are single proposals (a point-mass draft distribution), for which standard
 *    speculative sampling (Leviathan et al., Chen et al.: accept x with probability
 *    min(1, p(x)/q(x)), else draw from norm(max(0, p - q))) reduces to: draw y from the target
 *    distribution p with the request's own sampler and RNG, keep the draft iff y == x, else emit
 *    y. One draw per emitted token, in order, exactly the draws decoding without drafts makes:
 *    at temperature 0 and with sampling alike the output is token for token the output without
 *    speculation, and a seed fixes it whatever else is in the batch.
 *  - Bounded: the global suffix index never allocates past its byte budget (oldest documents go
 *    first) and a request's own index is sized at admission; nothing here allocates per step.
 *  - Isolated: text is indexed under its tenant key (the request's page-hash seed: model, cluster
 *    seed and cache_salt); a lookup sees only its own tenant's text, checked on every candidate.
 *  - Compute-aware: a draft token goes into a step only when its expected yield beats what the
 *    step's other tokens earn per unit of cost under the measured step-cost model, so drafts
 *    shrink as the batch fills and vanish when the step is compute-bound.
 */
#ifndef EN_SPEC_H
#define EN_SPEC_H

#include "engine/engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- suffix index (spec_suffix.c)
 *
 * Token text in documents, each under a tenant key, with an index that finds the longest match
 * of a context's end among earlier text and proposes what followed it (SuffixDecoding's lookup,
 * built like an LZ77 match finder: a hash of the last min_match tokens chains every earlier
 * occurrence, most recent first). */
typedef struct en_suffix en_suffix;

typedef struct en_suffix_opts {
    size_t bytes;  /* everything the index allocates stays within this; at least 1 KiB */
    int min_match; /* tokens a match needs at least (the hashed key); 0: 2 */
    int max_match; /* a match is measured up to this many tokens; 0: 64 */
    int max_chain; /* earlier occurrences examined per lookup, most recent first; 0: 32 */
} en_suffix_opts;

typedef struct en_suffix_stats {
    uint64_t tokens_added, docs_added, docs_evicted;
    int64_t tokens_held, capacity; /* tokens (separators included) now held / room for */
    size_t bytes;                  /* allocated, within opts.bytes */
} en_suffix_stats;

/* Bytes an index needs to hold n tokens in at most a few documents (a request's own index). */
size_t en_suffix_bytes_for(int n_tokens);
int en_suffix_create(const en_suffix_opts *o, en_suffix **out);
void en_suffix_destroy(en_suffix *x);
/* Appends tokens to the open document, opening one for tenant when none is open or the open one
 * is another tenant's. To make room the oldest documents are evicted; a document longer than the
 * whole index keeps its most recent tokens. */
void en_suffix_append(en_suffix *x, km_pagehash tenant, const int32_t *tokens, int n);
/* Ends the open document (the next append starts a new one). */
void en_suffix_close(en_suffix *x);
void en_suffix_stats_get(const en_suffix *x, en_suffix_stats *out);

typedef struct en_draft {
    int n;           /* proposed tokens */
    int match_len;   /* tokens at the end of the context that the proposal follows */
    int occurrences; /* earlier occurrences of that match the proposal was voted from */
    int32_t *tok;    /* [max] caller's buffer */
    float *share;    /* [max] caller's: tok[j]'s share among the occurrences still agreeing */
} en_draft;

/* Finds the longest match (min_match..max_match tokens) of the end of ctx in tenant's text and
 * proposes up to max tokens of what followed it: at each position the token most of the
 * agreeing occurrences continue with (the most recent among equals), stopping when its share
 * falls below min_share. tail: ctx is the end of the index's own text (a request's index over
 * its tokens), so a continuation that reaches the end goes on through the proposal itself
 * (periodic text). Returns d->n (0: nothing matched). */
int en_suffix_propose(const en_suffix *x, km_pagehash tenant, const int32_t *ctx, int n_ctx,
                      int max, float min_share, int tail, en_draft *d);

/* ---------------------------------------------------------------- step cost (spec.c)
 *
 * Step time modelled as base + per_token * n, fitted online (exponentially forgotten least
 * squares) from the engine's own steps, pulled towards an assumed per_token/base ratio while the
 * observed token counts do not spread enough to tell. A line is the wrong shape on a CPU where a
 * step's matmul keeps a few activation rows in registers (docs/speculative.md: on the AVX2 build
 * 1 to 4 tokens cost nearly the same, each one past that ~0.3 of a one-token step), so the model
 * also keeps the mean time of each step size up to EN_COST_SIZES seen recently, and
 * en_spec_cost_at prefers it to the line. */
#define EN_COST_SIZES 32
typedef struct en_spec_cost {
    double w, sn, st, snn, snt;            /* decayed sums over observed steps */
    double prior_ratio;                    /* per_token / base assumed before data */
    double base, per_token;                /* the current fit (units of the observations) */
    double size_t_mean[EN_COST_SIZES + 1]; /* per step size: mean time (EWMA) */
    uint32_t size_seen[EN_COST_SIZES + 1]; /* steps of that size observed */
    uint64_t size_at[EN_COST_SIZES + 1];   /* observation number of the last one */
    uint64_t steps;                        /* observations so far */
} en_spec_cost;

void en_spec_cost_init(en_spec_cost *c, double prior_ratio);
void en_spec_cost_observe(en_spec_cost *c, int n_tokens, double t);
/* base / per_token of the current fit (the prior's when there is no data). */
double en_spec_cost_base_tokens(const en_spec_cost *c);
/* The expected time of a step of n_tokens: the recent mean of that size where enough steps of it
 * were seen lately, else the line (in the units of the observations; the line's when neither). */
double en_spec_cost_at(const en_spec_cost *c, int n_tokens);

/* ---------------------------------------------------------------- budget (spec.c)
 *
 * Chooses how many of each request's proposed tokens go into a step. prob[i][j] is the estimated
 * probability that request i's tokens 0..j are all accepted (non-increasing in j). Tokens are
 * taken in order of probability while each one's probability exceeds the step's yield per unit
 * of cost: pi > (base_tokens + E) / (B/b + n), E the expected accepted tokens taken so far, n the
 * step's tokens so far, B/b from the cost model; and while room lasts. Writes take[i]; returns
 * the total taken. */
int en_spec_budget(double base_over_token, int base_tokens, int room, const float *const *prob,
                   const int *n, int n_req, int *take);
/* The same choice against any step-cost curve: cost(arg, t) is the cost of a step of t tokens.
 * Tokens are ordered by probability as above, and the number taken is the one that maximizes the
 * step's expected yield per unit of cost (the first of equals), so a curve that is flat for a few
 * tokens and then steep gets exactly the flat part's worth. */
int en_spec_budget_curve(double (*cost)(const void *arg, int n_tokens), const void *arg,
                         int base_tokens, int room, const float *const *prob, const int *n,
                         int n_req, int *take);

/* SuffixDecoding's draft length: factor x match length, capped (at least 1 for any match). */
int en_spec_draft_len(int match_len, float factor, int cap);

/* ---------------------------------------------------------------- drafting (spec.c) */

void en_spec_opts_default(en_spec_opts *o);

typedef struct en_spec_stats {
    uint64_t proposed, drafted, accepted, rejected, verifies, backoffs;
    en_suffix_stats index;
} en_spec_stats;

/* The worker's part: the global index, the step-cost model, acceptance learned per match length. */
typedef struct en_spec en_spec;
/* A request's part: its own index over its prompt and output, its acceptance record and back-off,
 * and the current proposal. */
typedef struct en_spec_seq en_spec_seq;

int en_spec_create(const en_spec_opts *o, int max_requests, en_spec **out);
void en_spec_destroy(en_spec *sp);
const en_spec_opts *en_spec_options(const en_spec *sp);
void en_spec_stats_get(const en_spec *sp, en_spec_stats *out);
void en_spec_observe_step(en_spec *sp, int n_tokens, double ms);

/* capacity: tokens the request can ever hold (prompt + completion); max_draft: the request's
 * cap (0: the worker's). */
int en_spec_seq_create(en_spec *sp, km_pagehash tenant, int capacity, int max_draft,
                       en_spec_seq **out);
void en_spec_seq_destroy(en_spec_seq *q);
/* The request's tokens as they become final (the prompt at admission, then each new token). */
void en_spec_seq_append(en_spec_seq *q, const int32_t *tokens, int n);
/* At the end of a request: the output (with up to lead_in prompt tokens before it) goes into the
 * global index under the request's tenant. tokens = prompt + output. */
void en_spec_learn(en_spec *sp, km_pagehash tenant, const int32_t *tokens, int n_prompt, int n);

/* Proposes up to max tokens continuing ctx (the request's tokens so far) from the request's own
 * index and the global one, whichever promises more; the probabilities are calibrated by the
 * acceptance seen so far. Returns the number proposed (0: none, or backing off). */
int en_spec_propose(en_spec *sp, en_spec_seq *q, const int32_t *ctx, int n_ctx, int max);
/* Sets the proposal to the n tokens of tok (at most the request's max_draft), drafted elsewhere
 * (self-speculation, scheduler_self.c); not put through en_spec_plan. Returns the length set. */
int en_spec_seq_set(en_spec *sp, en_spec_seq *q, const int32_t *tok, int n);
/* The budget over this step's proposals (en_spec_budget with the measured cost model):
 * base_tokens are the step's other tokens, room what its token budget leaves. Sets each
 * proposal's length to what was granted; returns the total. */
int en_spec_plan(en_spec *sp, en_spec_seq *const *qs, int n, int base_tokens, int room);
/* The current (granted) proposal. */
const int32_t *en_spec_seq_draft(const en_spec_seq *q, int *n);
void en_spec_seq_clear(en_spec_seq *q);
/* Records a verification: of the n drafted tokens, the first `accepted` were kept. */
void en_spec_verified(en_spec *sp, en_spec_seq *q, int n, int accepted);
/* Draft tokens of this request verified and accepted so far. */
void en_spec_seq_counts(const en_spec_seq *q, int *drafted, int *accepted);

#ifdef __cplusplus
}
#endif
#endif /* EN_SPEC_H */
