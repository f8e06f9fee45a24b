/*
 * sparse_budget.c — sparse attention budgets per (layer, kv head) (docs/sparse.md "Per-head
 * budgets"). Some heads attend to their sink and recent window and little else; others retrieve
 * from the whole context (DuoAttention's and RazorAttention's streaming and retrieval heads). A
 * uniform budget gives both the same pages; here a mean budget is spread over the heads in
 * proportion to shares measured once per model:
 *   - the head probe: a dense prefill of a calibration text in which every token past a position
 *     measures where each (layer, kv head)'s softmax mass lies (the sink and window pages, and
 *     the other pages by weight);
 *   - from its curves, shares that give the pages one by one where the most mass is uncovered;
 *   - a small text file of those shares (`kvmesh sparse-calibrate` writes it, --sparse-budgets
 *     reads it: engine/sparse_shares.c), so that serving starts without a calibration run.
 * The selection kernels are unchanged: each head's budget is its own kn_sparse_cfg.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"

/* ------------------------------------------------------------------ budgets */

int en_sparse_head_budgets(en_engine *e)
{
    const int nl = e->m->hp.n_layers, kvh = e->m->hp.n_head_kv;
    const int from = e->sparse_from, n = (nl - from) * kvh;
    const int minp = e->sparse.sink_pages + e->sparse.window_pages;
    if (!e->shares || n <= 0) return 0;
    if (!e->head_cfg && !(e->head_cfg = malloc(sizeof(kn_sparse_cfg) * (size_t)nl * kvh)))
        return KM_ENOMEM;
    kn_sparse_cfg *cfg = e->head_cfg + (size_t)from * kvh;
    const float *sh = e->shares + (size_t)from * kvh;
    /* heads whose proportional part falls under minp get minp; the rest share what is left
     * (every sparse layer's share 0: the uniform budget) */
    double total = (double)e->sparse.budget_pages * n, all = 0;
    for (int i = 0; i < n; i++) cfg[i] = e->sparse, cfg[i].budget_pages = 0, all += sh[i];
    if (!(all > 0)) {
        for (int i = 0; i < n; i++) cfg[i] = e->sparse;
        return 0;
    }
    for (int changed = 1; changed;) {
        double sum = 0, left = total;
        for (int i = 0; i < n; i++)
            if (cfg[i].budget_pages)
                left -= minp;
            else
                sum += sh[i];
        changed = 0;
        for (int i = 0; i < n && sum > 0; i++)
            if (!cfg[i].budget_pages && sh[i] * left / sum < minp)
                cfg[i].budget_pages = minp, changed = 1;
        if (!changed)
            for (int i = 0; i < n; i++)
                if (!cfg[i].budget_pages)
                    cfg[i].budget_pages = sum > 0 ? (int)lround(sh[i] * left / sum) : minp;
    }
    for (int i = 0; i < n; i++)
        if (cfg[i].budget_pages < minp) cfg[i].budget_pages = minp;
    return 0;
}

void en_sparse_shares_from_probe(const double *local, const double *rank, int n_heads,
                                 int max_pages, int budget_pages, float *shares)
{
    const int minp = EN_PROBE_SINK + EN_PROBE_WINDOW;
    long left = (long)n_heads * (budget_pages > minp ? budget_pages - minp : 0);
    int *got = calloc((size_t)n_heads, sizeof(int));
    (void)local; /* what the sink and window hold is every head's anyway */
    /* the rank curves are non-increasing: the next page of a head is worth rank[got] */
    while (got && left-- > 0) {
        int best = -1;
        double bv = 0;
        for (int i = 0; i < n_heads; i++)
            if (got[i] < max_pages && rank[(size_t)i * max_pages + got[i]] > bv)
                bv = rank[(size_t)i * max_pages + got[i]], best = i;
        if (best < 0) break;
        got[best]++;
    }
    for (int i = 0; i < n_heads; i++) shares[i] = (float)(minp + (got ? got[i] : 0));
    free(got);
}

/* ------------------------------------------------------------------ the head probe */

typedef struct en_page_rank {
    float score, mass;
} en_page_rank;

typedef struct en_probe_lane {
    float *mass, *rest, *out; /* [cap] page masses, the other pages', the attention's output */
    float *score;             /* [cap] the pages' scores from their summaries */
    en_page_rank *by;         /* [cap] the other pages' (score, mass), ordered by score */
    double *local, *rank;     /* [L * kvh], [L * kvh][cap] sums over the tokens */
    double *found;            /* [L * kvh][cap] mass of the k-th page by score (sparse engine) */
    int64_t *n;               /* [L * kvh] tokens measured */
} en_probe_lane;

int en_probe_alloc(en_engine *e, int threads, int cap)
{
    const size_t heads = (size_t)e->m->hp.n_layers * e->m->hp.n_head_kv;
    e->probe = calloc((size_t)threads, sizeof(en_probe_lane));
    if (!e->probe) return KM_ENOMEM;
    e->probe_cap = cap;
    for (int i = 0; i < threads; i++) {
        en_probe_lane *p = &e->probe[i];
        p->mass = malloc(sizeof(float) * (size_t)cap);
        p->rest = malloc(sizeof(float) * (size_t)cap);
        p->out = malloc(sizeof(float) * (size_t)e->m->hp.n_head * e->m->hp.head_dim);
        p->score = malloc(sizeof(float) * (size_t)cap);
        p->by = malloc(sizeof(en_page_rank) * (size_t)cap);
        p->local = calloc(heads, sizeof(double));
        p->rank = calloc(heads * (size_t)cap, sizeof(double));
        p->found = calloc(heads * (size_t)cap, sizeof(double));
        p->n = calloc(heads, sizeof(int64_t));
        if (!p->mass || !p->rest || !p->out || !p->score || !p->by || !p->local || !p->rank ||
            !p->found || !p->n)
            return KM_ENOMEM;
    }
    return 0;
}

void en_probe_free(en_engine *e, int threads)
{
    for (int i = 0; e->probe && i < threads; i++) {
        en_probe_lane *p = &e->probe[i];
        free(p->mass), free(p->rest), free(p->out), free(p->score), free(p->by);
        free(p->local), free(p->rank), free(p->found), free(p->n);
    }
    free(e->probe);
    e->probe = NULL;
}

static int en_desc(const void *a, const void *b)
{
    const float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

static int en_by_score(const void *a, const void *b)
{
    const float x = ((const en_page_rank *)a)->score, y = ((const en_page_rank *)b)->score;
    return (x < y) - (x > y);
}

void en_probe_attention(const en_engine *e, const kn_kv_view *view, const kv_seq *seq, int l, int h,
                        const float *q, int ith)
{
    const en_hparams *hp = &e->m->hp;
    const int group = hp->n_head / hp->n_head_kv;
    const int np = (view->n_ctx + view->page_tokens - 1) / view->page_tokens;
    en_probe_lane *p = &e->probe[ith];
    if (np > e->probe_cap) return;
    kn_kv_view v = *view;
    memset(p->mass, 0, sizeof(float) * (size_t)np);
    v.attn_mass = p->mass;
    e->ops->attention(&v, hp->head_dim, q, group, e->attn_scale, p->out);
    const int w0 = np - EN_PROBE_WINDOW > EN_PROBE_SINK ? np - EN_PROBE_WINDOW : EN_PROBE_SINK;
    /* the pages as a sparse step would rank them, when the engine keeps summaries */
    const int scored = e->sparse_on && np <= e->lanes[ith].sparse.cap;
    if (scored) {
        const kn_f16 **sums = e->lanes[ith].sparse.sums;
        kv_seq_summaries(e->kv, seq, l, h, np, sums);
        e->ops->page_scores(sums, np, hp->head_dim, q, group, e->sparse.radius, p->score);
    }
    double local = 0;
    int nr = 0;
    for (int k = 0; k < np; k++)
        if (k < EN_PROBE_SINK || k >= w0) {
            local += p->mass[k];
        } else {
            p->by[nr] = (en_page_rank){scored ? p->score[k] : 0, p->mass[k]};
            p->rest[nr++] = p->mass[k];
        }
    qsort(p->rest, (size_t)nr, sizeof(float), en_desc);
    if (scored) qsort(p->by, (size_t)nr, sizeof(en_page_rank), en_by_score);
    const size_t lh = (size_t)l * hp->n_head_kv + h;
    p->local[lh] += local / group;
    for (int k = 0; k < nr; k++) {
        p->rank[lh * e->probe_cap + k] += p->rest[k] / group;
        p->found[lh * e->probe_cap + k] += scored ? p->by[k].mass / group : 0;
    }
    p->n[lh]++;
}

int64_t en_engine_head_probe(const en_engine *e, int max_pages, double *local, double *rank,
                             double *found)
{
    if (!e->probe) return KM_EINVAL;
    const size_t heads = (size_t)e->m->hp.n_layers * e->m->hp.n_head_kv;
    const int nth = kn_pool_size(e->pool), kk = max_pages < e->probe_cap ? max_pages : e->probe_cap;
    int64_t most = 0;
    for (size_t lh = 0; lh < heads; lh++) {
        int64_t n = 0;
        double s = 0;
        for (int t = 0; t < nth; t++) n += e->probe[t].n[lh], s += e->probe[t].local[lh];
        local[lh] = n ? s / (double)n : 0;
        for (int k = 0; k < max_pages; k++) {
            double r = 0, f = 0;
            for (int t = 0; k < kk && t < nth; t++) {
                r += e->probe[t].rank[lh * e->probe_cap + k];
                f += e->probe[t].found[lh * e->probe_cap + k];
            }
            rank[lh * max_pages + k] = n ? r / (double)n : 0;
            if (found) found[lh * max_pages + k] = n ? f / (double)n : 0;
        }
        most = n > most ? n : most;
    }
    return most;
}

/* ------------------------------------------------------------------ the shares file
 * (read by en_sparse_shares_parse, engine/sparse_shares.c) */

#define EN_SHARES_MAGIC "kvmesh-sparse-shares" /* en_sparse_shares_parse's first line */

int en_sparse_shares_load(const char *path, const en_model *m, float **out, km_errbuf *err)
{
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return km_errf(err, KM_EIO, "sparse budgets %s: %s", path, strerror(errno));
    char *buf = malloc(1 << 20);
    const size_t n = buf ? fread(buf, 1, 1 << 20, f) : 0;
    const int big = buf && n == 1 << 20;
    fclose(f);
    if (!buf) return km_errf(err, KM_ENOMEM, "out of memory");
    const int nl = m->hp.n_layers, kvh = m->hp.n_head_kv;
    float *s = malloc(sizeof(float) * (size_t)nl * kvh);
    km_errbuf e2 = {{0}};
    int rc = !s    ? km_errf(&e2, KM_ENOMEM, "out of memory")
             : big ? km_errf(&e2, KM_EINVAL, "larger than 1 MiB")
                   : en_sparse_shares_parse(buf, n, nl, kvh, s, &e2);
    free(buf);
    if (rc) {
        free(s);
        return km_errf(err, rc, "sparse budgets %s: %s", path, e2.msg);
    }
    *out = s;
    return 0;
}

int en_sparse_shares_write(FILE *f, const en_model *m, const float *shares, const char *comment)
{
    const int nl = m->hp.n_layers, kvh = m->hp.n_head_kv;
    fprintf(f, "# kvmesh sparse attention budget shares per (layer, kv head) of %s\n",
            en_model_name(m));
    fprintf(f, "# (docs/sparse.md \"Per-head budgets\"; --sparse-budgets FILE)\n");
    for (const char *c = comment; c && *c;) {
        const char *nl_at = strchr(c, '\n');
        const int n = nl_at ? (int)(nl_at - c) : (int)strlen(c);
        fprintf(f, "# %.*s\n", n, c);
        c += n + (nl_at != NULL);
    }
    fprintf(f, EN_SHARES_MAGIC " 1\nshape %d %d\n", nl, kvh);
    for (int l = 0; l < nl; l++) {
        fprintf(f, "layer %d", l);
        for (int h = 0; h < kvh; h++) fprintf(f, " %g", shares[l * kvh + h]);
        fprintf(f, "\n");
    }
    return ferror(f) ? KM_EIO : 0;
}
