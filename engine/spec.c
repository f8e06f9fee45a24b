/*
 * spec.c — the drafting policy around the suffix index (spec.h): where proposals come from, how
 * long they may be, which of them a step can afford, and what a request learns from its
 * verifications.
 *
 *  - Proposals: the request's own index (its prompt and output: summaries that quote the input,
 *    code rewritten with one change, loops) and the worker's global index (earlier outputs of the
 *    same tenant: repeated JSON and tool calls); the one with the larger expected accepted length
 *    wins, as in SuffixDecoding.
 *  - Length: factor x match length, capped (SuffixDecoding's max_spec_factor): a two-token match
 *    proposes two tokens, a long quotation up to the cap.
 *  - Probabilities: token j of a proposal is accepted with the product over i <= j of
 *    min(share_i, c), share_i its share among the earlier occurrences and c the conditional
 *    acceptance learned so far — the request's own record blended with the worker's record for
 *    that match length (a new request starts from the worker's).
 *  - Budget: en_spec_budget with the step-cost model measured on the engine's own steps. At batch
 *    1 a step is dominated by reading the weights and a likely token is nearly free; at 32 the
 *    step is compute-bound and only near-certain tokens pay, so drafts shrink as the batch fills.
 *  - Back-off: fail_limit verifications in a row with nothing accepted stop a request's drafting
 *    until it finds a longer match than the one that failed; then its own record starts over.
 *
 * Nothing allocates per step: proposals live in buffers sized when the request is created.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/spec.h"

/* ---------------------------------------------------------------- step cost */

#define EN_COST_DECAY 0.98 /* per observed step: the fit follows load and context growth */
#define EN_COST_PRIOR 2.0  /* weight of each of the prior's two pseudo-steps */

void en_spec_cost_init(en_spec_cost *c, double prior_ratio)
{
    *c = (en_spec_cost){.prior_ratio = prior_ratio > 0 ? prior_ratio : 0.25};
}

/* A size's mean counts once this many steps of it were seen, the last one within EN_COST_RECENT
 * observations (load and context change what a step costs). */
#define EN_COST_SEEN   4
#define EN_COST_RECENT 2000
#define EN_COST_EWMA   0.1 /* the step of a size's mean once it has EN_COST_SEEN */

void en_spec_cost_observe(en_spec_cost *c, int n_tokens, double t)
{
    if (n_tokens < 1 || !(t >= 0)) return;
    c->steps++;
    if (n_tokens <= EN_COST_SIZES) {
        uint32_t k = c->size_seen[n_tokens];
        if (c->steps - c->size_at[n_tokens] > EN_COST_RECENT) k = 0; /* stale: start over */
        double a = k < EN_COST_SEEN ? 1.0 / (k + 1) : EN_COST_EWMA;
        c->size_t_mean[n_tokens] =
            k ? c->size_t_mean[n_tokens] + a * (t - c->size_t_mean[n_tokens]) : t;
        c->size_seen[n_tokens] = k + 1;
        c->size_at[n_tokens] = c->steps;
    }
    double n = n_tokens, d = EN_COST_DECAY;
    c->w = c->w * d + 1;
    c->sn = c->sn * d + n;
    c->st = c->st * d + t;
    c->snn = c->snn * d + n * n;
    c->snt = c->snt * d + n * t;
    /* Least squares over the data plus two pseudo-steps (n = 1 and n = 32) on the prior's line
     * through the data's mean: with spread-out data they hardly matter, without it they give the
     * slope. */
    double mn = c->sn / c->w, mt = c->st / c->w, r = c->prior_ratio;
    double ap = mt / (1 + r * mn), bp = r * ap, k = EN_COST_PRIOR;
    double t1 = ap + bp, t32 = ap + 32 * bp;
    double s0 = c->w + 2 * k, s1 = c->sn + k * 33, s11 = c->snn + k * 1025;
    double sy = c->st + k * (t1 + t32), s1y = c->snt + k * (t1 + 32 * t32);
    double det = s0 * s11 - s1 * s1;
    double b = det > 0 ? (s0 * s1y - s1 * sy) / det : bp;
    double a = (sy - b * s1) / s0;
    if (a < 0) a = 0;
    if (b < 0.01 * a) b = 0.01 * a;
    c->base = a;
    c->per_token = b;
}

double en_spec_cost_base_tokens(const en_spec_cost *c)
{
    if (c->per_token > 1e-12 && c->base > 0) return c->base / c->per_token;
    return 1.0 / c->prior_ratio;
}

double en_spec_cost_at(const en_spec_cost *c, int n_tokens)
{
    if (n_tokens >= 1 && n_tokens <= EN_COST_SIZES && c->size_seen[n_tokens] >= EN_COST_SEEN &&
        c->steps - c->size_at[n_tokens] <= EN_COST_RECENT)
        return c->size_t_mean[n_tokens];
    if (c->w > 0) return c->base + c->per_token * n_tokens;
    return 1.0 / c->prior_ratio + n_tokens; /* the prior's line, in per-token units */
}

/* ---------------------------------------------------------------- budget */

static double en_cost_line(const void *arg, int n_tokens)
{
    return *(const double *)arg + n_tokens;
}

int en_spec_budget(double base_over_token, int base_tokens, int room, const float *const *prob,
                   const int *n, int n_req, int *take)
{
    if (base_over_token < 0) base_over_token = 0;
    return en_spec_budget_curve(en_cost_line, &base_over_token, base_tokens, room, prob, n, n_req,
                                take);
}

int en_spec_budget_curve(double (*cost)(const void *arg, int n_tokens), const void *arg,
                         int base_tokens, int room, const float *const *prob, const int *n,
                         int n_req, int *take)
{
    for (int i = 0; i < n_req; i++) take[i] = 0;
    /* Walk the tokens in order of probability, remembering the best prefix. The costs are kept
     * non-decreasing (a measured size cheaper than a smaller one is noise). Two passes over the
     * same order: the first finds how many, the second takes them. */
    double yield = base_tokens, c = cost(arg, base_tokens > 0 ? base_tokens : 1);
    double best_ratio = c > 0 ? yield / c : 0;
    int best_n = 0, taken = 0;
    for (int pass = 0; pass < 2; pass++) {
        if (pass) {
            for (int i = 0; i < n_req; i++) take[i] = 0;
            if (!best_n) return 0;
        }
        while (taken < (pass ? best_n : room)) {
            /* The most likely next token over all requests (each request's are non-increasing). */
            int best = -1;
            float bp = 0;
            for (int i = 0; i < n_req; i++)
                if (take[i] < n[i] && (best < 0 || prob[i][take[i]] > bp)) {
                    best = i;
                    bp = prob[i][take[i]];
                }
            if (best < 0 || !(bp > 0)) break;
            take[best]++;
            taken++;
            if (pass) continue;
            yield += bp;
            double ct = cost(arg, base_tokens + taken);
            if (ct > c) c = ct;
            if (c > 0 && yield / c > best_ratio * (1 + 1e-12)) {
                best_ratio = yield / c;
                best_n = taken;
            }
        }
        taken = 0;
    }
    int total = 0;
    for (int i = 0; i < n_req; i++) total += take[i];
    return total;
}

int en_spec_draft_len(int match_len, float factor, int cap)
{
    if (match_len <= 0 || cap <= 0) return 0;
    int n = (int)(factor * (float)match_len + 1e-4f);
    if (n < 1) n = 1;
    return n < cap ? n : cap;
}

/* ---------------------------------------------------------------- drafting */

#define EN_ACC_BUCKETS 7    /* match length 1, 2-3, 4-7, 8-15, 16-31, 32-63, 64+ */
#define EN_ACC_OWN     0.3f /* EWMA step of a request's own record */
#define EN_ACC_GLOBAL  0.1f /* EWMA step of the worker's record per match length */
#define EN_ACC_BLEND   2.0f /* the worker's record weighs as this many of the request's */

struct en_spec {
    en_spec_opts o;
    en_suffix *global;
    en_spec_cost cost;
    float acc[EN_ACC_BUCKETS];
    int32_t *tok2;           /* [max_draft] a second proposal */
    float *share2;           /* [max_draft] */
    const float **plan_prob; /* [max_requests] */
    int *plan_n, *plan_take, max_requests;
    en_spec_stats st;
};

struct en_spec_seq {
    en_spec *sp;
    km_pagehash tenant;
    en_suffix *own;
    int max_draft;
    int32_t *tok; /* [max_draft] the proposal */
    float *share, *prob;
    int n, match_len;
    float acc; /* the request's conditional acceptance (EWMA) */
    int obs;   /* verifications in its record (capped) */
    int fails, backoff_match, drafted, accepted;
};

void en_spec_opts_default(en_spec_opts *o)
{
    *o = (en_spec_opts){.mode = EN_SPEC_AUTO,
                        .max_draft = 16,
                        .factor = 1.0f,
                        .min_share = 0.1f,
                        .index_bytes = (size_t)32 << 20,
                        .fail_limit = 3,
                        .token_cost = 0.25f,
                        .lead_in = 32,
                        .self_draft = 3};
}

static void en_spec_fill_defaults(en_spec_opts *o)
{
    en_spec_opts d;
    en_spec_opts_default(&d);
    if (o->mode != EN_SPEC_OFF && o->mode != EN_SPEC_AUTO && o->mode != EN_SPEC_SELF)
        o->mode = d.mode;
    if (o->max_draft <= 0) o->max_draft = d.max_draft;
    if (o->max_draft > 64) o->max_draft = 64;
    if (!(o->factor > 0)) o->factor = d.factor;
    if (!(o->min_share > 0)) o->min_share = d.min_share;
    if (o->index_bytes < 4096) o->index_bytes = d.index_bytes;
    if (o->fail_limit <= 0) o->fail_limit = d.fail_limit;
    if (!(o->token_cost > 0)) o->token_cost = d.token_cost;
    if (o->lead_in <= 0) o->lead_in = d.lead_in;
    if (o->self_draft <= 0) o->self_draft = d.self_draft;
    if (o->self_draft > EN_SELF_MAX_DRAFT) o->self_draft = EN_SELF_MAX_DRAFT;
}

int en_spec_create(const en_spec_opts *opts, int max_requests, en_spec **out)
{
    *out = NULL;
    if (max_requests < 1) return KM_EINVAL;
    en_spec *sp = calloc(1, sizeof *sp);
    if (!sp) return KM_ENOMEM;
    if (opts) sp->o = *opts;
    en_spec_fill_defaults(&sp->o);
    en_spec_cost_init(&sp->cost, sp->o.token_cost);
    /* Before any verification a longer match is trusted more: 0.5 for one token, 0.75 for 2-3,
     * ... 0.93 for 64 and more. Long matches are rare in open text and right when they happen
     * (copies, loops); without some trust a busy worker would never try them and never learn. */
    for (int i = 0; i < EN_ACC_BUCKETS; i++) sp->acc[i] = 1.0f - 0.5f / (float)(1 + i);
    sp->max_requests = max_requests;
    int md = sp->o.max_draft;
    sp->tok2 = malloc(sizeof *sp->tok2 * md);
    sp->share2 = malloc(sizeof *sp->share2 * md);
    sp->plan_prob = malloc(sizeof *sp->plan_prob * max_requests);
    sp->plan_n = malloc(sizeof *sp->plan_n * max_requests);
    sp->plan_take = malloc(sizeof *sp->plan_take * max_requests);
    int rc = sp->tok2 && sp->share2 && sp->plan_prob && sp->plan_n && sp->plan_take ? 0 : KM_ENOMEM;
    if (!rc) rc = en_suffix_create(&(en_suffix_opts){.bytes = sp->o.index_bytes}, &sp->global);
    if (rc) {
        en_spec_destroy(sp);
        return rc;
    }
    *out = sp;
    return 0;
}

void en_spec_destroy(en_spec *sp)
{
    if (!sp) return;
    en_suffix_destroy(sp->global);
    free(sp->tok2);
    free(sp->share2);
    free(sp->plan_prob);
    free(sp->plan_n);
    free(sp->plan_take);
    free(sp);
}

const en_spec_opts *en_spec_options(const en_spec *sp)
{
    return &sp->o;
}

void en_spec_stats_get(const en_spec *sp, en_spec_stats *out)
{
    *out = sp->st;
    en_suffix_stats_get(sp->global, &out->index);
}

void en_spec_observe_step(en_spec *sp, int n_tokens, double ms)
{
    if (sp->o.cost_fixed) return;
    en_spec_cost_observe(&sp->cost, n_tokens, ms);
}

int en_spec_seq_create(en_spec *sp, km_pagehash tenant, int capacity, int max_draft,
                       en_spec_seq **out)
{
    *out = NULL;
    en_spec_seq *q = calloc(1, sizeof *q);
    if (!q) return KM_ENOMEM;
    q->sp = sp;
    q->tenant = tenant;
    q->max_draft = max_draft > 0 && max_draft < sp->o.max_draft ? max_draft : sp->o.max_draft;
    q->tok = malloc(sizeof *q->tok * sp->o.max_draft);
    q->share = malloc(sizeof *q->share * sp->o.max_draft);
    q->prob = malloc(sizeof *q->prob * sp->o.max_draft);
    int rc = q->tok && q->share && q->prob ? 0 : KM_ENOMEM;
    if (!rc)
        rc = en_suffix_create(&(en_suffix_opts){.bytes = en_suffix_bytes_for(capacity + 2)},
                              &q->own);
    if (rc) {
        en_spec_seq_destroy(q);
        return rc;
    }
    *out = q;
    return 0;
}

void en_spec_seq_destroy(en_spec_seq *q)
{
    if (!q) return;
    en_suffix_destroy(q->own);
    free(q->tok);
    free(q->share);
    free(q->prob);
    free(q);
}

void en_spec_seq_append(en_spec_seq *q, const int32_t *tokens, int n)
{
    en_suffix_append(q->own, q->tenant, tokens, n);
}

void en_spec_learn(en_spec *sp, km_pagehash tenant, const int32_t *tokens, int n_prompt, int n)
{
    if (n <= n_prompt) return;
    int from = n_prompt > sp->o.lead_in ? n_prompt - sp->o.lead_in : 0;
    en_suffix_append(sp->global, tenant, tokens + from, n - from);
    en_suffix_close(sp->global);
}

static int en_acc_bucket(int match_len)
{
    int b = 0;
    while (match_len > 1 && b < EN_ACC_BUCKETS - 1) {
        match_len >>= 1;
        b++;
    }
    return b;
}

/* The conditional acceptance expected of a proposal with this match length. */
static float en_spec_expect(const en_spec_seq *q, int match_len)
{
    float g = q->sp->acc[en_acc_bucket(match_len)];
    return ((float)q->obs * q->acc + EN_ACC_BLEND * g) / ((float)q->obs + EN_ACC_BLEND);
}

/* Trims a proposal to its allowed length and fills prob; returns its expected accepted length. */
static float en_spec_score(const en_spec_seq *q, const en_draft *d, float *prob, int max)
{
    if (!d->n || d->match_len < q->backoff_match) return 0;
    int n = en_spec_draft_len(d->match_len, q->sp->o.factor, max);
    if (n > d->n) n = d->n;
    float c = en_spec_expect(q, d->match_len), p = 1, score = 0;
    for (int j = 0; j < n; j++) {
        p *= d->share[j] < c ? d->share[j] : c;
        prob[j] = p;
        score += p;
    }
    return score;
}

int en_spec_seq_set(en_spec *sp, en_spec_seq *q, const int32_t *tok, int n)
{
    if (n > q->max_draft) n = q->max_draft;
    if (n < 0) n = 0;
    memcpy(q->tok, tok, sizeof *q->tok * n);
    q->n = n;
    q->match_len = 0;
    if (n) sp->st.proposed++;
    return n;
}

int en_spec_propose(en_spec *sp, en_spec_seq *q, const int32_t *ctx, int n_ctx, int max)
{
    q->n = 0;
    q->match_len = 0;
    if (max > q->max_draft) max = q->max_draft;
    if (max <= 0) return 0;
    float min_share = sp->o.min_share;
    en_draft own = {.tok = q->tok, .share = q->share};
    en_draft glob = {.tok = sp->tok2, .share = sp->share2};
    en_suffix_propose(q->own, q->tenant, ctx, n_ctx, max, min_share, 1, &own);
    en_suffix_propose(sp->global, q->tenant, ctx, n_ctx, max, min_share, 0, &glob);
    /* prob of the global proposal goes to the end of q->prob's room only after it wins. */
    float s_own = en_spec_score(q, &own, q->prob, max);
    float s_glob = 0;
    if (glob.n) {
        float tmp[64];
        s_glob = en_spec_score(q, &glob, tmp, max);
        if (s_glob > s_own) {
            int n = en_spec_draft_len(glob.match_len, sp->o.factor, max);
            if (n > glob.n) n = glob.n;
            memcpy(q->tok, glob.tok, sizeof *q->tok * n);
            memcpy(q->share, glob.share, sizeof *q->share * n);
            memcpy(q->prob, tmp, sizeof *q->prob * n);
            q->n = n;
            q->match_len = glob.match_len;
        }
    }
    if (!q->n && s_own > 0) {
        int n = en_spec_draft_len(own.match_len, sp->o.factor, max);
        q->n = n < own.n ? n : own.n;
        q->match_len = own.match_len;
    }
    if (q->n) sp->st.proposed++;
    return q->n;
}

static double en_spec_cost_of(const void *arg, int n_tokens)
{
    return en_spec_cost_at(arg, n_tokens);
}

int en_spec_plan(en_spec *sp, en_spec_seq *const *qs, int n, int base_tokens, int room)
{
    if (n > sp->max_requests) n = sp->max_requests;
    for (int i = 0; i < n; i++) {
        sp->plan_prob[i] = qs[i]->prob;
        sp->plan_n[i] = qs[i]->n;
    }
    int total = en_spec_budget_curve(en_spec_cost_of, &sp->cost, base_tokens, room, sp->plan_prob,
                                     sp->plan_n, n, sp->plan_take);
    for (int i = 0; i < n; i++) qs[i]->n = sp->plan_take[i];
    return total;
}

const int32_t *en_spec_seq_draft(const en_spec_seq *q, int *n)
{
    *n = q->n;
    return q->tok;
}

void en_spec_seq_clear(en_spec_seq *q)
{
    q->n = 0;
}

void en_spec_seq_counts(const en_spec_seq *q, int *drafted, int *accepted)
{
    *drafted = q->drafted;
    *accepted = q->accepted;
}

void en_spec_verified(en_spec *sp, en_spec_seq *q, int n, int accepted)
{
    if (n <= 0) return;
    sp->st.verifies++;
    sp->st.drafted += n;
    sp->st.accepted += accepted;
    sp->st.rejected += n - accepted;
    q->drafted += n;
    q->accepted += accepted;
    /* Each position up to the first rejection is one outcome of the conditional acceptance. */
    float *g = &sp->acc[en_acc_bucket(q->match_len)];
    if (!q->obs) q->acc = *g; /* a fresh record starts from the worker's */
    for (int j = 0; j <= accepted && j < n; j++) {
        float x = j < accepted ? 1.0f : 0.0f;
        q->acc += EN_ACC_OWN * (x - q->acc);
        *g += EN_ACC_GLOBAL * (x - *g);
    }
    if (q->obs < 16) q->obs++;
    if (accepted) {
        q->fails = 0;
        q->backoff_match = 0;
    } else if (++q->fails >= sp->o.fail_limit) {
        /* Drafting stops until a match longer than this one turns up; then a fresh record. */
        q->backoff_match = q->match_len + 1;
        q->fails = 0;
        q->obs = 0;
        sp->st.backoffs++;
    }
    q->n = 0;
}
