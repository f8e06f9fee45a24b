/*
 * sampler.c — picks the next token from a row of logits.
 *
 * Order (llama.cpp's default chain, after the logit bias): repetition/presence/frequency penalties
 * over the last repeat_last_n tokens, top-k, top-p and min-p (on probabilities at temperature 1),
 * temperature, then a draw from the sequence's own xoshiro256** stream. Each sequence owns its
 * sampler, so its tokens depend only on its logits, history and seed, never on the rest of the
 * batch.
 *
 * Nothing allocates per token: the candidate arrays are sized for the vocabulary at create.
 * top-p without top-k avoids sorting the whole vocabulary: it selects the best 64, 512, 4096, …
 * candidates until their mass reaches p, then sorts only those.
 */
#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"

typedef struct en_cand {
    float logit;
    int32_t id;
} en_cand;

struct en_sampler {
    en_sample_params p;
    int n_vocab;
    en_cand *cand;
    float *row;
    uint16_t *counts; /* occurrences of each id in the history window */
    int32_t *history; /* ring of the last repeat_last_n tokens */
    int n_hist, hist_head;
    uint64_t rng[4];
    en_token_value *bias; /* params.bias, copied */
    en_logprobs lp;       /* the last sampled token's (params.logprobs) */
};

void en_sample_params_default(en_sample_params *p)
{
    memset(p, 0, sizeof *p);
    p->temperature = 0.8f;
    p->top_k = 40;
    p->top_p = 0.95f;
    p->min_p = 0.05f;
    p->repeat_penalty = 1.0f;
    p->repeat_last_n = 64;
    p->seed = 0x6b766d657368ull;
}

static uint64_t en_splitmix(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline uint64_t en_rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

static uint64_t en_rng_next(uint64_t *s)
{
    uint64_t r = en_rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = en_rotl(s[3], 45);
    return r;
}

int en_sampler_create(const en_sample_params *p, int n_vocab, en_sampler **out)
{
    *out = NULL;
    if (n_vocab <= 0 || !p) return KM_EINVAL;
    en_sampler *s = calloc(1, sizeof *s);
    if (!s) return KM_ENOMEM;
    s->p = *p;
    if (s->p.repeat_last_n <= 0) s->p.repeat_last_n = 64;
    s->n_vocab = n_vocab;
    s->cand = malloc(sizeof(en_cand) * n_vocab);
    s->row = malloc(sizeof(float) * n_vocab);
    s->counts = calloc(n_vocab, sizeof(uint16_t));
    s->history = calloc(s->p.repeat_last_n, sizeof(int32_t));
    if (!s->cand || !s->row || !s->counts || !s->history) {
        en_sampler_destroy(s);
        return KM_ENOMEM;
    }
    s->p.bias = NULL;
    s->p.n_bias = 0;
    if (p->n_bias > 0 && p->bias) {
        if (!(s->bias = malloc(sizeof *s->bias * (size_t)p->n_bias))) {
            en_sampler_destroy(s);
            return KM_ENOMEM;
        }
        memcpy(s->bias, p->bias, sizeof *s->bias * (size_t)p->n_bias);
        s->p.n_bias = p->n_bias;
    }
    if (s->p.top_logprobs > EN_MAX_TOP) s->p.top_logprobs = EN_MAX_TOP;
    uint64_t x = p->seed;
    for (int i = 0; i < 4; i++) s->rng[i] = en_splitmix(&x);
    *out = s;
    return 0;
}

void en_sampler_destroy(en_sampler *s)
{
    if (!s) return;
    free(s->cand);
    free(s->row);
    free(s->counts);
    free(s->history);
    free(s->bias);
    free(s);
}

void en_sampler_accept(en_sampler *s, int32_t token)
{
    if (token < 0 || token >= s->n_vocab) return;
    int cap = s->p.repeat_last_n;
    if (s->n_hist == cap) {
        int32_t old = s->history[s->hist_head];
        s->counts[old]--;
    } else {
        s->n_hist++;
    }
    s->history[s->hist_head] = token;
    s->hist_head = (s->hist_head + 1) % cap;
    if (s->counts[token] < UINT16_MAX) s->counts[token]++;
}

int32_t en_argmax(const float *x, int n)
{
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* log(sum(exp(logits))), in double precision. */
static double en_log_sum_exp(const float *logits, int n_vocab)
{
    float mx = logits[0];
    for (int v = 1; v < n_vocab; v++) mx = logits[v] > mx ? logits[v] : mx;
    double z = 0;
    for (int v = 0; v < n_vocab; v++) z += exp((double)logits[v] - mx);
    /* z >= 1: the largest logit's term is exp(0) */
    // cppcheck-suppress invalidFunctionArg
    return mx + log(z);
}

double en_token_nll(const float *logits, int n_vocab, int32_t target)
{
    assert(n_vocab > 0 && target >= 0 && target < n_vocab);
    return -((double)logits[target] - en_log_sum_exp(logits, n_vocab));
}

static int en_cand_desc(const void *a, const void *b)
{
    const en_cand *x = a, *y = b;
    if (x->logit != y->logit) return x->logit < y->logit ? 1 : -1;
    return x->id - y->id;
}

/* Moves the k largest candidates to the front (unordered), quickselect. */
static void en_select_top(en_cand *c, int n, int k)
{
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        float pivot = c[(lo + hi) / 2].logit;
        int i = lo, j = hi;
        while (i <= j) {
            while (c[i].logit > pivot) i++;
            while (c[j].logit < pivot) j--;
            if (i <= j) {
                en_cand t = c[i];
                c[i++] = c[j];
                c[j--] = t;
            }
        }
        if (k - 1 <= j)
            hi = j;
        else if (k - 1 >= i)
            lo = i;
        else
            break;
    }
}

static void en_apply_penalties(en_sampler *s, float *row)
{
    const en_sample_params *p = &s->p;
    if (p->repeat_penalty == 1.0f && p->presence_penalty == 0.0f && p->frequency_penalty == 0.0f)
        return;
    int cap = p->repeat_last_n;
    for (int j = 0; j < s->n_hist; j++) {
        int32_t id = s->history[(s->hist_head - 1 - j + cap) % cap];
        if (row[id] != row[id]) continue; /* already penalised: marked below */
        float l = s->cand[id].logit;
        if (p->repeat_penalty != 1.0f) l = l > 0 ? l / p->repeat_penalty : l * p->repeat_penalty;
        l -= p->presence_penalty + p->frequency_penalty * (float)s->counts[id];
        s->cand[id].logit = l;
        row[id] = NAN; /* mark as done */
    }
}

void en_sampler_skip(en_sampler *s, int n)
{
    /* one draw per sampled token, and none when greedy (en_sampler_sample) */
    if (s->p.temperature <= 0.0f) return;
    for (int i = 0; i < n; i++) en_rng_next(s->rng);
}

void en_logprobs_compute(const float *logits, int n_vocab, int32_t token, int n_top,
                         en_logprobs *out)
{
    if (n_top > EN_MAX_TOP) n_top = EN_MAX_TOP;
    double lse = en_log_sum_exp(logits, n_vocab);
    out->token = token;
    out->logprob = (float)((double)logits[token] - lse);
    /* the n_top largest, kept sorted by insertion (most ids fail the first comparison) */
    int k = 0;
    for (int v = 0; v < n_vocab && n_top > 0; v++) {
        float x = logits[v];
        if (k == n_top && x <= out->top[k - 1].value) continue;
        int j = k < n_top ? k++ : k - 1;
        while (j > 0 && out->top[j - 1].value < x) {
            out->top[j] = out->top[j - 1];
            j--;
        }
        out->top[j] = (en_token_value){v, x};
    }
    for (int j = 0; j < k; j++) out->top[j].value = (float)((double)out->top[j].value - lse);
    out->n_top = k;
}

const en_logprobs *en_sampler_logprobs(const en_sampler *s)
{
    return s->p.logprobs ? &s->lp : NULL;
}

static int32_t en_sampler_pick(en_sampler *s, const float *logits, const uint32_t *allowed);

int32_t en_sampler_sample(en_sampler *s, const float *logits)
{
    return en_sampler_sample_masked(s, logits, NULL);
}

int32_t en_sampler_sample_masked(en_sampler *s, const float *logits, const uint32_t *allowed)
{
    int32_t t = en_sampler_pick(s, logits, allowed);
    if (s->p.logprobs) en_logprobs_compute(logits, s->n_vocab, t, s->p.top_logprobs, &s->lp);
    return t;
}

static int32_t en_sampler_pick(en_sampler *s, const float *logits, const uint32_t *allowed)
{
    const en_sample_params *p = &s->p;
    int n = s->n_vocab;
    for (int i = 0; i < n; i++) s->cand[i] = (en_cand){logits[i], i};
    for (int i = 0; i < p->n_bias; i++)
        if (s->bias[i].token >= 0 && s->bias[i].token < n)
            s->cand[s->bias[i].token].logit += s->bias[i].value;
    if (s->n_hist) {
        memcpy(s->row, logits, sizeof(float) * n);
        en_apply_penalties(s, s->row);
    }
    if (allowed) /* after the penalties: a token not allowed is never drawn, whatever its logit */
        for (int i = 0; i < n; i++)
            if (!(allowed[i >> 5] >> (i & 31) & 1)) s->cand[i].logit = -INFINITY;
    if (p->temperature <= 0.0f) {
        int32_t best = 0;
        for (int i = 1; i < n; i++)
            if (s->cand[i].logit > s->cand[best].logit) best = i;
        return best;
    }
    /* Softmax normaliser at temperature 1 over everything (for top-p / min-p). */
    float mx = -INFINITY;
    for (int i = 0; i < n; i++)
        if (s->cand[i].logit > mx) mx = s->cand[i].logit;
    double z = 0;
    for (int i = 0; i < n; i++) z += exp((double)(s->cand[i].logit - mx));

    int k = p->top_k > 0 && p->top_k < n ? p->top_k : n;
    int use_p = p->top_p > 0.0f && p->top_p < 1.0f;
    int m = k;
    if (k == n && use_p) {
        /* Grow the selected head until it holds top_p of the mass. */
        for (m = 64; m < n; m *= 8) {
            en_select_top(s->cand, n, m);
            double mass = 0;
            for (int i = 0; i < m; i++) mass += exp((double)(s->cand[i].logit - mx));
            if (mass / z >= p->top_p) break;
        }
        if (m > n) m = n;
    } else if (k < n) {
        en_select_top(s->cand, n, k);
    }
    qsort(s->cand, m, sizeof(en_cand), en_cand_desc);
    while (m > 1 && s->cand[m - 1].logit == -INFINITY) m--; /* masked out */
    if (use_p) {
        double cum = 0;
        int keep = m;
        for (int i = 0; i < m; i++) {
            cum += exp((double)(s->cand[i].logit - mx)) / z;
            if (cum >= p->top_p) {
                keep = i + 1;
                break;
            }
        }
        m = keep;
    }
    if (p->min_p > 0.0f) {
        /* Keep candidates whose probability is at least min_p times the best one's. */
        float cut = s->cand[0].logit + logf(p->min_p);
        int keep = 1;
        while (keep < m && s->cand[keep].logit >= cut) keep++;
        m = keep;
    }
    /* Temperature and the draw. */
    double total = 0;
    float top = s->cand[0].logit;
    for (int i = 0; i < m; i++) {
        double w = exp((double)(s->cand[i].logit - top) / p->temperature);
        s->row[i] = (float)w;
        total += w;
    }
    double u = (double)(en_rng_next(s->rng) >> 11) * (1.0 / 9007199254740992.0) * total;
    double acc = 0;
    for (int i = 0; i < m; i++) {
        acc += s->row[i];
        if (u < acc) return s->cand[i].id;
    }
    return s->cand[m - 1].id;
}
