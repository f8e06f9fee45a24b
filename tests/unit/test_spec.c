/*
 * test_spec.c — the pieces of speculative decoding that need no model (engine/spec.h): the
 * suffix index (longest match, voting, periodic continuation, byte budget, oldest-first
 * eviction, tenant isolation), the draft-length rule, the step-cost fit, the compute-aware
 * budget, back-off, and the verification rule's statistics through the real sampler.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/spec.h"

static const km_pagehash TA = {0x1111, 0x2222}, TB = {0x3333, 0x4444};

static en_suffix *index_of(size_t bytes)
{
    en_suffix *x;
    cr_assert_eq(en_suffix_create(&(en_suffix_opts){.bytes = bytes}, &x), 0);
    return x;
}

static int propose(en_suffix *x, km_pagehash t, const int32_t *ctx, int n, int max, int tail,
                   int32_t *tok, float *share, int *match)
{
    en_draft d = {.tok = tok, .share = share};
    int got = en_suffix_propose(x, t, ctx, n, max, 0.1f, tail, &d);
    cr_assert_eq(got, d.n);
    if (match) *match = d.match_len;
    return got;
}

Test(suffix, the_longest_match_proposes_what_followed_it)
{
    en_suffix *x = index_of(1 << 16);
    /* "... 7 8 9 -> 100 101 102" and, with a longer shared context, "5 7 8 9 -> 200 201". */
    int32_t a[] = {1, 2, 7, 8, 9, 100, 101, 102, 3};
    int32_t b[] = {4, 5, 7, 8, 9, 200, 201, 6};
    en_suffix_append(x, TA, a, 9);
    en_suffix_close(x);
    en_suffix_append(x, TA, b, 8);
    en_suffix_close(x);
    int32_t tok[8];
    float share[8];
    int match;
    int32_t ctx1[] = {1, 2, 7, 8, 9};
    cr_assert_eq(propose(x, TA, ctx1, 5, 8, 0, tok, share, &match), 4);
    cr_assert_eq(match, 5);
    cr_assert(tok[0] == 100 && tok[1] == 101 && tok[2] == 102 && tok[3] == 3);
    int32_t ctx2[] = {9, 5, 7, 8, 9};
    cr_assert_eq(propose(x, TA, ctx2, 5, 8, 0, tok, share, &match), 3);
    cr_assert_eq(match, 4);
    cr_assert(tok[0] == 200 && tok[1] == 201 && tok[2] == 6);
    /* A continuation never runs into the next document. */
    int32_t ctx3[] = {101, 102};
    cr_assert_eq(propose(x, TA, ctx3, 2, 8, 0, tok, share, &match), 1);
    cr_assert_eq(tok[0], 3);
    /* Nothing shares two tokens with this. */
    int32_t ctx4[] = {9, 99};
    cr_assert_eq(propose(x, TA, ctx4, 2, 8, 0, tok, share, NULL), 0);
    en_suffix_destroy(x);
}

Test(suffix, equal_matches_vote_and_shares_say_how_many_agree)
{
    en_suffix *x = index_of(1 << 16);
    /* After "10 11": 12 13 three times, 12 14 once. */
    int32_t docs[4][4] = {{10, 11, 12, 13}, {10, 11, 12, 13}, {10, 11, 12, 14}, {10, 11, 12, 13}};
    for (int i = 0; i < 4; i++) {
        en_suffix_append(x, TA, docs[i], 4);
        en_suffix_close(x);
    }
    int32_t ctx[] = {10, 11}, tok[4];
    float share[4];
    cr_assert_eq(propose(x, TA, ctx, 2, 4, 0, tok, share, NULL), 2);
    cr_assert(tok[0] == 12 && tok[1] == 13);
    cr_assert_float_eq(share[0], 1.0f, 1e-6);
    cr_assert_float_eq(share[1], 0.75f, 1e-6);
    en_suffix_destroy(x);
}

Test(suffix, a_requests_own_text_continues_periodically_through_the_proposal)
{
    en_suffix *x = index_of(en_suffix_bytes_for(64));
    int32_t t[] = {5, 6, 7, 5, 6, 7, 5, 6};
    en_suffix_append(x, TA, t, 8);
    int32_t tok[10];
    float share[10];
    int match;
    cr_assert_eq(propose(x, TA, t, 8, 10, 1, tok, share, &match), 10);
    cr_assert_eq(match, 5);
    static const int32_t period[3] = {7, 5, 6};
    for (int j = 0; j < 10; j++) cr_assert_eq(tok[j], period[j % 3], "token %d", j);
    /* Without tail the text simply ends. */
    cr_assert_eq(propose(x, TA, t, 8, 10, 0, tok, share, NULL), 3);
    en_suffix_destroy(x);
}

Test(suffix, memory_stays_within_the_budget_and_the_oldest_documents_go_first)
{
    const size_t budget = 64 << 10;
    en_suffix *x = index_of(budget);
    en_suffix_stats st;
    en_suffix_stats_get(x, &st);
    cr_assert_leq(st.bytes, budget);
    cr_assert_gt(st.capacity, 1000);
    /* Documents of 100 distinct tokens each, far more than fit. */
    int32_t doc[100];
    int n_docs = (int)(st.capacity / 100) * 4;
    for (int d = 0; d < n_docs; d++) {
        for (int i = 0; i < 100; i++) doc[i] = d * 100 + i;
        en_suffix_append(x, TA, doc, 100);
        en_suffix_close(x);
        en_suffix_stats_get(x, &st);
        cr_assert_leq(st.tokens_held, st.capacity);
        cr_assert_leq(st.bytes, budget);
    }
    cr_assert_gt(st.docs_evicted, 0);
    cr_assert_eq(st.docs_added, (uint64_t)n_docs);
    int32_t tok[4];
    float share[4];
    int32_t first[] = {0, 1}, last[] = {(n_docs - 1) * 100, (n_docs - 1) * 100 + 1};
    cr_assert_eq(propose(x, TA, first, 2, 4, 0, tok, share, NULL), 0, "the oldest is gone");
    cr_assert_eq(propose(x, TA, last, 2, 4, 0, tok, share, NULL), 4, "the newest is there");
    cr_assert_eq(tok[0], (n_docs - 1) * 100 + 2);
    /* One document longer than everything keeps its most recent tokens. */
    int32_t *big = malloc(sizeof(int32_t) * st.capacity * 2);
    for (int64_t i = 0; i < st.capacity * 2; i++) big[i] = (int32_t)(1000000 + i);
    en_suffix_append(x, TA, big, (int)(st.capacity * 2));
    en_suffix_stats_get(x, &st);
    cr_assert_leq(st.tokens_held, st.capacity);
    int32_t tailctx[] = {big[st.capacity * 2 - 10], big[st.capacity * 2 - 9]};
    cr_assert_eq(propose(x, TA, tailctx, 2, 4, 0, tok, share, NULL), 4);
    cr_assert_eq(tok[0], big[st.capacity * 2 - 8]);
    free(big);
    en_suffix_destroy(x);
}

Test(suffix, a_tenants_text_never_drafts_another_tenants_tokens)
{
    /* A tiny index: 16 buckets, so the two tenants' keys collide all the time. */
    en_suffix *x = index_of(4096);
    int32_t secret[64];
    for (int i = 0; i < 64; i++) secret[i] = 7000 + i % 8;
    en_suffix_append(x, TA, secret, 64);
    en_suffix_close(x);
    int32_t tok[8];
    float share[8];
    for (int s = 0; s + 3 <= 64; s++) {
        cr_assert_eq(propose(x, TB, secret + s, 3, 8, 0, tok, share, NULL), 0, "offset %d", s);
        cr_assert_gt(propose(x, TA, secret + s, 3, 8, 0, tok, share, NULL), 0, "offset %d", s);
    }
    /* B's own text, interleaved with A's, is B's alone. */
    int32_t mine[] = {7000, 7001, 9, 9, 9};
    en_suffix_append(x, TB, mine, 5);
    en_suffix_close(x);
    int32_t ctx[] = {7000, 7001};
    cr_assert_eq(propose(x, TB, ctx, 2, 8, 0, tok, share, NULL), 3);
    cr_assert(tok[0] == 9 && tok[1] == 9 && tok[2] == 9);
    cr_assert_eq(propose(x, TA, ctx, 2, 8, 0, tok, share, NULL), 8);
    cr_assert_eq(tok[0], 7002);
    en_suffix_destroy(x);
}

Test(spec, draft_length_is_factor_times_match_length_capped)
{
    cr_assert_eq(en_spec_draft_len(0, 1.0f, 16), 0);
    cr_assert_eq(en_spec_draft_len(2, 1.0f, 16), 2);
    cr_assert_eq(en_spec_draft_len(40, 1.0f, 16), 16);
    cr_assert_eq(en_spec_draft_len(3, 2.0f, 16), 6);
    cr_assert_eq(en_spec_draft_len(3, 0.1f, 16), 1);
}

Test(spec, the_step_cost_fit_finds_base_and_per_token_cost)
{
    en_spec_cost c;
    en_spec_cost_init(&c, 0.25);
    cr_assert_float_eq(en_spec_cost_base_tokens(&c), 4.0, 1e-9, "the prior before data");
    for (int i = 0; i < 400; i++) {
        int n = 1 + (i * 37) % 64;
        en_spec_cost_observe(&c, n, 6.0 + 1.5 * n);
    }
    cr_assert_float_eq(c.base, 6.0, 0.3);
    cr_assert_float_eq(c.per_token, 1.5, 0.05);
    /* Steps that all carry one token cannot tell the slope: the prior's ratio holds. */
    en_spec_cost_init(&c, 0.1);
    for (int i = 0; i < 100; i++) en_spec_cost_observe(&c, 1, 8.0);
    cr_assert_float_eq(c.base + c.per_token, 8.0, 0.01);
    cr_assert_float_eq(en_spec_cost_base_tokens(&c), 10.0, 0.01);
}

static double zen3_step_ms(int k);
static double zen3_cost(const void *arg, int k)
{
    (void)arg;
    return zen3_step_ms(k);
}

/* Geometric proposals: token j accepted with probability p^(j+1). */
static void geometric(float *prob, int n, float p)
{
    float x = 1;
    for (int j = 0; j < n; j++) prob[j] = x *= p;
}

Test(spec, drafts_shrink_as_the_batch_fills_and_vanish_when_the_step_is_compute_bound)
{
    enum { R = 32, N = 16 };
    static float probs[R][N];
    const float *prob[R];
    int n[R], take[R];
    for (int i = 0; i < R; i++) {
        geometric(probs[i], N, 0.85f);
        prob[i] = probs[i];
        n[i] = N;
    }
    /* A step whose base costs 4 tokens' worth (batch-1 decode dominated by the weights). */
    int last = 1 << 30, at1 = 0, at32 = 0;
    for (int b = 1; b <= R; b *= 2) {
        int total = en_spec_budget(4.0, b, 512, prob, n, b, take), most = 0;
        for (int i = 0; i < b; i++) {
            cr_assert_leq(take[i], N);
            if (take[i] > most) most = take[i];
            /* Every token taken was worth its cost at the time. */
            if (take[i]) cr_assert_gt(prob[i][take[i] - 1] * (4.0 + b + total), b);
        }
        cr_assert_leq(most, last, "batch %d drafts %d per request, more than a smaller batch (%d)",
                      b, most, last);
        if (b == 1) at1 = total;
        if (b == R) at32 = total;
        last = most;
    }
    cr_assert_geq(at1, 5, "batch 1 drafts long (got %d)", at1);
    cr_assert_eq(at32, 0, "batch 32 at 0.85 acceptance drafts nothing (got %d)", at32);
    /* Near-certain drafts still pay at 32. */
    for (int i = 0; i < R; i++) geometric(probs[i], N, 0.999f);
    cr_assert_gt(en_spec_budget(4.0, R, 512, prob, n, R, take), 0);
    /* The step's room is a hard limit. */
    cr_assert_eq(en_spec_budget(1e9, 1, 5, prob, n, R, take), 5);
    /* A step with a long prefill in it leaves drafts out. */
    for (int i = 0; i < R; i++) geometric(probs[i], N, 0.8f);
    cr_assert_eq(en_spec_budget(4.0, 1 + 256, 256, prob, n, 1, take), 0);
}

/* The step times bench_kernels -e ... 1 v measured on the AVX2 Zen 3 (ms of CPU per step of k
 * tokens, one engine thread; docs/speculative.md): flat to 4 tokens, then linear in k. */
static double zen3_step_ms(int k)
{
    static const double ms[] = {0, 9.84, 10.90, 11.7, 12.43, 21.06, 23.2, 25.4, 27.62};
    return k <= 8 ? ms[k] : 27.62 + 2.7 * (k - 8);
}

Test(spec, the_cost_table_learns_a_curve_the_line_misprices_and_the_budget_takes_its_flat_part)
{
    en_spec_cost c;
    en_spec_cost_init(&c, 0.25);
    for (int i = 0; i < 600; i++) {
        int k = 1 + (i * 7) % 12; /* verification steps of 1..12 tokens */
        en_spec_cost_observe(&c, k, zen3_step_ms(k));
    }
    for (int k = 1; k <= 12; k++)
        cr_assert_float_eq(en_spec_cost_at(&c, k), zen3_step_ms(k), 1e-6, "size %d", k);
    /* Sizes never seen fall back to the fitted line. */
    cr_assert_float_eq(en_spec_cost_at(&c, 20), c.base + 20 * c.per_token, 1e-9);
    /* One request at batch 1, drafts accepted at 0.9 each: the line (fitted over the same steps)
     * grants a length that straddles the jump at 5; the measured curve stops where it is flat
     * (base token + 3 drafts = 4 tokens), which yields more per millisecond. */
    float probs[16];
    const float *prob[1] = {probs};
    int n[1] = {16}, take[1];
    geometric(probs, 16, 0.9f);
    int by_curve = en_spec_budget_curve(zen3_cost, NULL, 1, 64, prob, n, 1, take);
    cr_assert_eq(by_curve, 3, "took %d drafts against the measured curve", by_curve);
    int by_line = en_spec_budget(en_spec_cost_base_tokens(&c), 1, 64, prob, n, 1, take);
    double y_curve = 1, y_line = 1;
    for (int j = 0; j < by_curve; j++) y_curve += probs[j];
    for (int j = 0; j < by_line; j++) y_line += probs[j];
    cr_assert_gt(y_curve / zen3_step_ms(1 + by_curve), y_line / zen3_step_ms(1 + by_line),
                 "the line's %d drafts yield more per ms than the curve's %d", by_line, by_curve);
    /* A stale size (no step of it for a long while) is forgotten. */
    for (int i = 0; i < 2100; i++) en_spec_cost_observe(&c, 1, 9.84);
    cr_assert_float_eq(en_spec_cost_at(&c, 6), c.base + 6 * c.per_token, 1e-9);
}

Test(spec, a_request_whose_drafts_keep_failing_backs_off_until_its_match_improves)
{
    en_spec *sp;
    en_spec_opts o;
    en_spec_opts_default(&o);
    o.fail_limit = 2;
    cr_assert_eq(en_spec_create(&o, 4, &sp), 0);
    en_spec_seq *q;
    cr_assert_eq(en_spec_seq_create(sp, TA, 256, 0, &q), 0);
    /* Text where "1 2" was followed by "3 4"; the context ends in "1 2". */
    int32_t text[] = {1, 2, 3, 4, 5, 6, 1, 2};
    en_spec_seq_append(q, text, 8);
    for (int round = 0; round < 2; round++) {
        cr_assert_eq(en_spec_propose(sp, q, text, 8, 8), 2);
        en_spec_verified(sp, q, 2, 0);
    }
    en_spec_stats st;
    en_spec_stats_get(sp, &st);
    cr_assert_eq(st.backoffs, 1);
    cr_assert_eq(en_spec_propose(sp, q, text, 8, 8), 0, "backing off at match length 2");
    /* A longer match (3 tokens) is worth trying again. */
    int32_t more[] = {9, 1, 2, 3, 4, 5, 9, 1, 2};
    en_spec_seq_append(q, more, 9);
    int32_t ctx[] = {1, 2, 3, 4, 5, 6, 1, 2, 9, 1, 2, 3, 4, 5, 9, 1, 2};
    cr_assert_gt(en_spec_propose(sp, q, ctx, 17, 8), 0);
    en_spec_verified(sp, q, 2, 1);
    int drafted, accepted;
    en_spec_seq_counts(q, &drafted, &accepted);
    cr_assert_eq(drafted, 6);
    cr_assert_eq(accepted, 1);
    en_spec_seq_destroy(q);
    en_spec_destroy(sp);
}

Test(spec, the_global_index_learns_finished_outputs_per_tenant)
{
    en_spec *sp;
    cr_assert_eq(en_spec_create(NULL, 4, &sp), 0);
    /* Tenant A's earlier request answered "40 41 42 ... 59" after a prompt ending in "7 8". */
    int32_t done[40];
    for (int i = 0; i < 20; i++) done[i] = i < 18 ? 500 + i : 7 + (i - 18);
    for (int i = 20; i < 40; i++) done[i] = 40 + (i - 20);
    en_spec_learn(sp, TA, done, 20, 40);
    int32_t ctx[] = {600, 601, 7, 8, 40, 41};
    en_spec_seq *a, *b;
    cr_assert_eq(en_spec_seq_create(sp, TA, 64, 0, &a), 0);
    cr_assert_eq(en_spec_seq_create(sp, TB, 64, 0, &b), 0);
    en_spec_seq_append(a, ctx, 6);
    en_spec_seq_append(b, ctx, 6);
    int n;
    cr_assert_eq(en_spec_propose(sp, a, ctx, 6, 16), 4, "factor 1 x match 4 (7 8 40 41)");
    const int32_t *d = en_spec_seq_draft(a, &n);
    cr_assert_eq(n, 4);
    for (int j = 0; j < n; j++) cr_assert_eq(d[j], 42 + j);
    cr_assert_eq(en_spec_propose(sp, b, ctx, 6, 16), 0, "tenant B sees none of A's output");
    en_spec_seq_destroy(a);
    en_spec_seq_destroy(b);
    en_spec_destroy(sp);
}

/* ---------------------------------------------------------------- verification statistics */

/* Critical value of chi-square with df degrees of freedom at p = 0.001 (Wilson-Hilferty). */
static double chi2_crit(int df)
{
    double z = 3.090, h = 2.0 / (9.0 * df);
    return df * pow(1 - h + z * sqrt(h), 3);
}

/* Chi-square of counts against expected probabilities (bins with expectation < 5 pooled). */
static double chi2(const int *count, const double *p, int n, int total, int *df)
{
    double stat = 0, pool_e = 0, pool_o = 0;
    int bins = 0;
    for (int i = 0; i < n; i++) {
        double e = p[i] * total;
        if (e < 5) {
            pool_e += e;
            pool_o += count[i];
            continue;
        }
        stat += (count[i] - e) * (count[i] - e) / e;
        bins++;
    }
    if (pool_e > 0) {
        stat += (pool_o - pool_e) * (pool_o - pool_e) / (pool_e > 1e-9 ? pool_e : 1e-9);
        bins++;
    }
    *df = bins - 1;
    return stat;
}

enum { V = 64, DRAWS = 20000 };

/* The verification step exactly as the scheduler makes it: one draw from the request's sampler
 * per position, the draft kept iff it equals the draw. */
static int verify(en_sampler *s, const float *rows, const int32_t *draft, int k, int32_t *out)
{
    for (int j = 0; j <= k; j++) {
        int32_t y = en_sampler_sample(s, rows + (size_t)j * V);
        out[j] = y;
        en_sampler_accept(s, y);
        if (j == k || y != draft[j]) return j;
    }
    return k;
}

Test(spec_verify, accepted_tokens_follow_the_target_distribution)
{
    float logits[V];
    double p[V], z = 0;
    const float temp = 0.7f;
    for (int i = 0; i < V; i++) {
        logits[i] = 3.0f * sinf(i * 1.7f) + (i % 5 == 0 ? 2.0f : 0.0f);
        z += exp(logits[i] / temp);
    }
    for (int i = 0; i < V; i++) p[i] = exp(logits[i] / temp) / z;
    int32_t likely = 0;
    for (int i = 1; i < V; i++)
        if (p[i] > p[likely]) likely = i;
    int32_t drafts[] = {likely, 17, 33}; /* the mode, a middling token, another */
    for (size_t di = 0; di < sizeof drafts / sizeof drafts[0]; di++) {
        int32_t x = drafts[di];
        int emitted[V] = {0}, residual[V] = {0}, accepted = 0, rejected = 0;
        for (int s = 0; s < DRAWS; s++) {
            en_sample_params sp = {.temperature = temp,
                                   .top_p = 1.0f,
                                   .repeat_penalty = 1.0f,
                                   .seed = 1000003ull * s + di};
            en_sampler *a, *b;
            cr_assert_eq(en_sampler_create(&sp, V, &a), 0);
            cr_assert_eq(en_sampler_create(&sp, V, &b), 0);
            int32_t out[2];
            float rows[2 * V]; /* the draft's position, then the one after it */
            memcpy(rows, logits, sizeof logits);
            memcpy(rows + V, logits, sizeof logits);
            int acc = verify(a, rows, &x, 1, out);
            int32_t plain = en_sampler_sample(b, logits);
            cr_assert_eq(out[0], plain, "seed %d: the draft changed the token", s);
            emitted[out[0]]++;
            if (acc) {
                accepted++;
            } else {
                rejected++;
                residual[out[0]]++;
            }
            en_sampler_destroy(a);
            en_sampler_destroy(b);
        }
        int df;
        double c = chi2(emitted, p, V, DRAWS, &df);
        cr_assert_lt(c, chi2_crit(df), "draft %d: emitted tokens chi2 %.1f df %d", x, c, df);
        /* Acceptance probability min(1, p(x)/q(x)) with q the point mass on x: p(x). */
        double rate = (double)accepted / DRAWS, sd = sqrt(p[x] * (1 - p[x]) / DRAWS);
        cr_assert_lt(fabs(rate - p[x]), 4 * sd + 1e-9, "draft %d: accepted %.4f, p(x) %.4f", x,
                     rate, p[x]);
        /* After a rejection: norm(max(0, p - q)), i.e. p without x, renormalised. */
        double res[V];
        for (int i = 0; i < V; i++) res[i] = i == x ? 0 : p[i] / (1 - p[x]);
        cr_assert_eq(residual[x], 0);
        c = chi2(residual, res, V, rejected, &df);
        cr_assert_lt(c, chi2_crit(df), "draft %d: residual chi2 %.1f df %d", x, c, df);
    }
}

Test(spec_verify, a_seed_gives_the_same_tokens_with_and_without_drafts)
{
    /* Three positions of logits, a three-token draft, every sampler stage and penalties on: the
     * tokens emitted while verifying are, seed by seed, the tokens plain sampling gives. */
    float rows[4 * V];
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < V; i++) rows[j * V + i] = 2.0f * cosf(i * (0.9f + j * 0.3f));
    int32_t draft[3] = {en_argmax(rows, V), en_argmax(rows + V, V), 5};
    int agree = 0;
    for (int s = 0; s < 2000; s++) {
        en_sample_params sp;
        en_sample_params_default(&sp);
        sp.seed = 77 + s;
        sp.repeat_penalty = 1.1f;
        sp.presence_penalty = 0.2f;
        sp.temperature = s % 4 == 0 ? 0.0f : 0.9f;
        en_sampler *a, *b;
        cr_assert_eq(en_sampler_create(&sp, V, &a), 0);
        cr_assert_eq(en_sampler_create(&sp, V, &b), 0);
        int32_t hist[] = {3, 9, draft[0]};
        for (int i = 0; i < 3; i++) {
            en_sampler_accept(a, hist[i]);
            en_sampler_accept(b, hist[i]);
        }
        int32_t out[4];
        int acc = verify(a, rows, draft, 3, out);
        for (int j = 0; j <= acc; j++) {
            int32_t y = en_sampler_sample(b, rows + (size_t)j * V);
            en_sampler_accept(b, y);
            cr_assert_eq(out[j], y, "seed %d position %d", s, j);
        }
        agree += acc;
        en_sampler_destroy(a);
        en_sampler_destroy(b);
    }
    cr_assert_gt(agree, 0, "some drafts were accepted");
}
