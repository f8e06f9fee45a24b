/*
 * sparse.c — query-aware sparse attention over KV pages (Quest; docs/sparse.md): which pages a
 * decode step reads, and the attention over them. The scores come from the table's page_scores
 * (scalar, AVX2 or AVX-512); selection and the view of the selected pages are plain C shared by
 * every table, so a table's selection differs from the reference's only where its scores do.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"

int kn_sparse_scratch_init(kn_sparse_scratch *s, int cap)
{
    memset(s, 0, sizeof *s);
    if (cap < 1) cap = 1;
    s->cap = cap;
    s->sums = malloc(sizeof(*s->sums) * cap);
    s->score = malloc(sizeof(float) * cap);
    s->tmp = malloc(sizeof(float) * cap);
    s->sel = malloc(sizeof(int) * cap);
    s->pages = malloc(sizeof(*s->pages) * cap);
    s->fmts = malloc((size_t)cap);
    if (s->sums && s->score && s->tmp && s->sel && s->pages && s->fmts) return 0;
    kn_sparse_scratch_free(s);
    return KM_ENOMEM;
}

void kn_sparse_scratch_free(kn_sparse_scratch *s)
{
    free(s->sums);
    free(s->score);
    free(s->tmp);
    free(s->sel);
    free(s->pages);
    free(s->fmts);
    memset(s, 0, sizeof *s);
}

/* The k-th largest of a[0..n) (1 <= k <= n), a reordered: quickselect. */
static float kn_kth_largest(float *a, int n, int k)
{
    int lo = 0, hi = n - 1;
    const int want = k - 1;
    while (lo < hi) {
        const float pv = a[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (a[i] > pv) i++;
            while (a[j] < pv) j--;
            if (i <= j) {
                const float t = a[i];
                a[i++] = a[j];
                a[j--] = t;
            }
        }
        if (want <= j)
            hi = j;
        else if (want >= i)
            lo = i;
        else
            return a[want];
    }
    return a[want];
}

int kn_sparse_select(const float *score, int n_pages, const kn_sparse_cfg *c, float *tmp, int *sel)
{
    const int sink = c->sink_pages < 0 ? 0 : c->sink_pages;
    const int win = c->window_pages < 0 ? 0 : c->window_pages;
    const int mid0 = sink < n_pages ? sink : n_pages;
    const int mid1 = n_pages - win > mid0 ? n_pages - win : mid0;
    int k = c->budget_pages - mid0 - (n_pages - mid1); /* pages chosen by score */
    if (k >= mid1 - mid0) k = mid1 - mid0;
    if (k < 0) k = 0;
    float thr = 0.0f;
    int n_above = 0;
    if (k > 0 && k < mid1 - mid0) {
        int m = 0;
        for (int i = mid0; i < mid1; i++) tmp[m++] = score[i] == score[i] ? score[i] : -INFINITY;
        thr = kn_kth_largest(tmp, m, k);
        for (int i = mid0; i < mid1; i++) n_above += score[i] > thr;
    }
    int n = 0, ties = k - n_above; /* pages scoring exactly thr that still fit, lowest first */
    for (int i = 0; i < n_pages; i++) {
        int keep = i < mid0 || i >= mid1 || k == mid1 - mid0;
        if (!keep && k > 0) {
            if (score[i] > thr)
                keep = 1;
            else if (score[i] == thr && ties > 0)
                keep = 1, ties--;
        }
        if (keep) sel[n++] = i;
    }
    return n;
}

int kn_sparse_pick(const kn_ops *o, const kn_kv_view *kv, const kn_f16 *const *sums,
                   const kn_sparse_cfg *c, kn_sparse_scratch *scr, int head_dim, const float *q,
                   int n_q)
{
    const int pt = kv->page_tokens, n_ctx = kv->n_ctx;
    const int np = n_ctx > 0 ? (n_ctx + pt - 1) / pt : 0;
    if (np <= c->budget_pages || np > scr->cap) {
        for (int i = 0; i < np && i < scr->cap; i++) scr->sel[i] = i;
        return np;
    }
    o->page_scores(sums, np, head_dim, q, n_q, c->radius > 0 ? c->radius : 1.0f, scr->score);
    return kn_sparse_select(scr->score, np, c, scr->tmp, scr->sel);
}

int kn_sparse_attend(const kn_ops *o, const kn_kv_view *kv, const int *sel, int n,
                     kn_sparse_scratch *scr, int head_dim, const float *q, int n_q, float scale,
                     float *out)
{
    const int pt = kv->page_tokens, n_ctx = kv->n_ctx;
    const int np = n_ctx > 0 ? (n_ctx + pt - 1) / pt : 0;
    kn_kv_view v = *kv;
    for (int i = 0; i < n; i++) {
        scr->pages[i] = kv->pages[sel[i]];
        if (kv->page_formats) scr->fmts[i] = kv->page_formats[sel[i]];
    }
    v.pages = scr->pages;
    v.page_formats = kv->page_formats ? scr->fmts : NULL;
    v.attn_mass = NULL;
    /* the last page is always selected (window_pages >= 1) or the context is cut short */
    const int last = sel[n - 1];
    v.n_ctx = (n - 1) * pt + (last == np - 1 ? n_ctx - (np - 1) * pt : pt);
    o->attention(&v, head_dim, q, n_q, scale, out);
    return n;
}

int kn_sparse_attention(const kn_ops *o, const kn_kv_view *kv, const kn_f16 *const *sums,
                        const kn_sparse_cfg *c, kn_sparse_scratch *scr, int head_dim,
                        const float *q, int n_q, float scale, float *out)
{
    const int pt = kv->page_tokens, n_ctx = kv->n_ctx;
    const int np = n_ctx > 0 ? (n_ctx + pt - 1) / pt : 0;
    if (np <= c->budget_pages || np > scr->cap) {
        o->attention(kv, head_dim, q, n_q, scale, out);
        return np;
    }
    const int n = kn_sparse_pick(o, kv, sums, c, scr, head_dim, q, n_q);
    return kn_sparse_attend(o, kv, scr->sel, n, scr, head_dim, q, n_q, scale, out);
}
