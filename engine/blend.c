/*
 * blend.c — reuse of a chunk's KV away from the position it was computed at (docs/blend.md).
 *
 * Keys carry their position as a rotation (RoPE: pair i of a head turned by pos * theta_i), so
 * moving a key from position a to b is one more rotation by (b - a) * theta_i, exact up to
 * rounding. Values carry no position. What re-rotation cannot fix is the context: a chunk
 * computed alone never attended to what now precedes it. As CacheBlend, en_blend_prefill
 * recomputes every chunk token through the first layers (the probe), measures how far its
 * probe-layer K and V moved from the reused ones, and recomputes the tokens that moved most
 * further up; as UCM's progressive rule, more of them in the layers near the input than in deep
 * ones. A token recomputed through layer d writes fresh K/V in layers [0, d) and leaves the
 * reused ones above (en_batch.depth); every other prompt token goes through every layer.
 */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"

void en_blend_rerotate(const en_engine *e, float *k, int from, int to)
{
    const en_hparams *hp = &e->m->hp;
    float cs[512];
    if (from == to || hp->n_rot > (int)(sizeof cs / sizeof cs[0])) return;
    kn_rope_cache(cs, hp->n_rot, to - from, hp->rope_base);
    e->ops->rope(k, hp->n_head_kv, hp->head_dim, hp->n_rot, cs, hp->rope_neox);
}

/* en_blend_copy's job: each thread moves its share of the positions, every layer. Every key
 * moves by the same distance, so the rotation's cos/sin table is built once (cs). */
typedef struct bl_copy {
    en_engine *e;
    const kv_seq *src;
    kv_seq *dst;
    int src_pos, dst_pos, n;
    float *scratch;  /* [threads][2][kvd] */
    const float *cs; /* kn_rope_cache of dst_pos - src_pos; NULL: no rotation */
    int rc;          /* the first failure (a position the source does not hold) */
} bl_copy;

static void bl_copy_job(void *ctx, int ith, int nth)
{
    bl_copy *c = ctx;
    const en_hparams *hp = &c->e->m->hp;
    const int hd = hp->head_dim, kvd = hp->n_head_kv * hd;
    float *k = c->scratch + (size_t)ith * 2 * kvd, *v = k + kvd;
    int64_t i0, i1;
    kn_split(c->n, ith, nth, &i0, &i1);
    for (int64_t i = i0; i < i1; i++)
        for (int l = 0; l < hp->n_layers; l++) {
            int rc = 0;
            for (int h = 0; h < hp->n_head_kv && !rc; h++)
                rc = kv_seq_read(c->e->kv, c->src, l, h, c->src_pos + (int)i, k + h * hd,
                                 v + h * hd);
            if (rc) {
                c->rc = rc; /* any thread's failure fails the copy */
                return;
            }
            if (c->cs) c->e->ops->rope(k, hp->n_head_kv, hd, hp->n_rot, c->cs, hp->rope_neox);
            kv_seq_write(c->e->kv, c->dst, l, c->dst_pos + (int)i, k, v);
        }
}

int en_blend_copy(en_engine *e, const kv_seq *src, int src_pos, kv_seq *dst, int dst_pos, int n)
{
    const en_hparams *hp = &e->m->hp;
    if (n <= 0 || src_pos < 0 || dst_pos < 0 || src_pos + n > kv_seq_capacity(src) * e->page_tokens)
        return KM_EINVAL;
    int rc = kv_seq_reserve(e->kv, dst, dst_pos + n);
    if (rc) return rc;
    kv_seq_wait_ready(e->kv, src);
    const size_t kvd = (size_t)hp->n_head_kv * hp->head_dim;
    float cs[512];
    const int rotate = src_pos != dst_pos && hp->n_rot <= (int)(sizeof cs / sizeof cs[0]);
    if (rotate) kn_rope_cache(cs, hp->n_rot, dst_pos - src_pos, hp->rope_base);
    bl_copy c = {e, src, dst, src_pos, dst_pos, n, NULL, rotate ? cs : NULL, 0};
    c.scratch = malloc(sizeof(float) * 2 * kvd * (size_t)kn_pool_size(e->pool));
    if (!c.scratch) return KM_ENOMEM;
    kn_pool_run(e->pool, bl_copy_job, &c);
    free(c.scratch);
    return c.rc;
}

/* The tokens one prefill pass computes, in position order, and the layers each goes through. */
typedef struct bl_tok {
    int32_t pos;
    int16_t depth;
} bl_tok;

static int bl_by_depth(const void *a, const void *b)
{
    const bl_tok *x = a, *y = b;
    if (x->depth != y->depth) return y->depth - x->depth;
    return x->pos - y->pos;
}

static int bl_by_pos(const void *a, const void *b)
{
    return ((const bl_tok *)a)->pos - ((const bl_tok *)b)->pos;
}

/* One engine batch's buffers, e->max_tokens each. */
typedef struct bl_bufs {
    int32_t *ids, *pos;
    int16_t *depth;
    uint8_t *want;
    kv_seq **seqs;
} bl_bufs;

static int bl_bufs_init(bl_bufs *b, int T)
{
    b->ids = malloc(sizeof(int32_t) * T * 2), b->pos = b->ids ? b->ids + T : NULL;
    b->depth = malloc(sizeof(int16_t) * T);
    b->want = malloc(T);
    b->seqs = malloc(sizeof(kv_seq *) * T);
    return b->ids && b->depth && b->want && b->seqs ? 0 : KM_ENOMEM;
}

static void bl_bufs_free(bl_bufs *b)
{
    free(b->ids);
    free(b->depth);
    free(b->want);
    free(b->seqs);
}

/* Runs m <= max_tokens tokens (the next of a pass in position order) as one batch ordered
 * deepest first; with logits, the prompt's last token asks for them; kv: en_batch.depth_kv. */
static int bl_batch(en_engine *e, bl_bufs *bb, kv_seq *q, const int32_t *tokens, int n_tokens,
                    bl_tok *t, int m, int kv, const float **logits)
{
    qsort(t, (size_t)m, sizeof *t, bl_by_depth);
    for (int i = 0; i < m; i++) {
        bb->pos[i] = t[i].pos, bb->ids[i] = tokens[t[i].pos], bb->depth[i] = t[i].depth;
        bb->want[i] = logits && t[i].pos == n_tokens - 1, bb->seqs[i] = q;
    }
    en_batch b = {.n_tokens = m,
                  .tokens = bb->ids,
                  .pos = bb->pos,
                  .seqs = bb->seqs,
                  .logits = bb->want,
                  .depth = bb->depth,
                  .depth_kv = kv};
    const float *lg = NULL;
    int rc = en_engine_step(e, &b, &lg);
    if (logits && lg && rc > 0) *logits = lg;
    return rc > 0 ? 0 : rc;
}

/* Runs the tokens (in position order) in batches of at most max_tokens. */
static int bl_run(en_engine *e, kv_seq *q, const int32_t *tokens, int n_tokens, bl_tok *t, int n,
                  int kv, const float **logits)
{
    const int T = e->max_tokens;
    bl_bufs bb;
    int rc = bl_bufs_init(&bb, T);
    for (int s = 0; s < n && !rc; s += T)
        rc = bl_batch(e, &bb, q, tokens, n_tokens, t + s, n - s < T ? n - s : T, kv, logits);
    bl_bufs_free(&bb);
    return rc;
}

/* Squared distance of (k, v) at the probe layer from what was there before the probe. */
static int bl_drift(en_engine *e, kv_seq *q, int layer, int pos, const float *k0, float *kv,
                    float *d)
{
    const en_hparams *hp = &e->m->hp;
    const int hd = hp->head_dim, kvd = hp->n_head_kv * hd;
    double s = 0;
    for (int h = 0; h < hp->n_head_kv; h++) {
        int rc = kv_seq_read(e->kv, q, layer, h, pos, kv + h * hd, kv + kvd + h * hd);
        if (rc) return rc;
    }
    for (int j = 0; j < 2 * kvd; j++) s += (double)(kv[j] - k0[j]) * (kv[j] - k0[j]);
    *d = (float)s;
    return 0;
}

typedef struct bl_rank {
    int32_t pos;
    float drift;
} bl_rank;

static int bl_by_drift(const void *a, const void *b)
{
    const bl_rank *x = a, *y = b;
    if (x->drift != y->drift) return x->drift < y->drift ? 1 : -1;
    return x->pos - y->pos;
}

/* The layers the token of drift rank r (0: moved most) of nc goes through: the probe's P, and
 * one more for each layer l >= P where r < f_l * nc, f_l = min(1, 2 f (L - l) / (L - P)). */
static int bl_depth(int r, int nc, float f, int P, int L)
{
    int d = P;
    for (int l = P; l < L; l++) {
        double fl = 2.0 * f * (L - l) / (L - P);
        if (fl > 1) fl = 1;
        if (r < fl * nc) d = l + 1;
    }
    return d;
}

/* A blend prefill under way: the pass being run (the probe, then the recompute), its tokens in
 * position order, and how many of them have run. */
struct en_blend_run {
    en_engine *e;
    kv_seq *q;
    const int32_t *tokens;
    int n_tokens, n_done, end, probe, nc;
    float f;
    bl_tok *t;
    int n_t, at, probing;
    bl_rank *rk;
    float *old; /* [nc + 1][2][kvd]: the chunks' probe-layer K/V before the probe; a row to read */
    uint8_t *in_chunk;
    bl_bufs bb;
    en_blend_stats st;
};

/* After the probe: the chunk tokens ranked by drift, and the recompute pass planned. */
static int bl_plan(en_blend_run *b)
{
    const en_hparams *hp = &b->e->m->hp;
    const int L = hp->n_layers, P = b->probe + 1, kvd = hp->n_head_kv * hp->head_dim;
    int rc = 0;
    if (b->probing) {
        for (int i = 0, j = 0; i < b->n_t && !rc; i++) {
            if (!b->in_chunk[i]) continue;
            b->rk[j].pos = b->n_done + i;
            rc = bl_drift(b->e, b->q, b->probe, b->n_done + i, b->old + (size_t)2 * kvd * j,
                          b->old + (size_t)2 * kvd * b->nc, &b->rk[j].drift);
            j++;
        }
        if (rc) return rc;
        qsort(b->rk, (size_t)b->nc, sizeof *b->rk, bl_by_drift);
    }
    /* the rest of [n_done, end) through every layer, the drifting chunk tokens through theirs */
    int m = 0;
    for (int i = 0; i < b->end - b->n_done; i++)
        if (!b->in_chunk[i]) b->t[m++] = (bl_tok){.pos = b->n_done + i, .depth = (int16_t)L};
    b->st.computed = m, b->st.reused = b->nc;
    for (int r = 0; b->probing && r < b->nc; r++) {
        const int d = bl_depth(r, b->nc, b->f, P, L);
        if (d == P) break;
        b->t[m++] = (bl_tok){.pos = b->rk[r].pos, .depth = (int16_t)d};
        b->st.recomputed++;
    }
    for (int i = 0; i < m; i++) b->st.token_layers += b->t[i].depth;
    qsort(b->t, (size_t)m, sizeof *b->t, bl_by_pos);
    b->n_t = m, b->at = 0, b->probing = 0;
    return 0;
}

void en_blend_run_end(en_blend_run *b, en_blend_stats *st)
{
    if (!b) return;
    if (st) *st = b->st;
    free(b->t);
    free(b->rk);
    free(b->old);
    free(b->in_chunk);
    bl_bufs_free(&b->bb);
    free(b);
}

int en_blend_run_begin(en_engine *e, kv_seq *q, const int32_t *tokens, int n_tokens, int n_done,
                       int end, const en_blend_seg *chunks, int n_chunks, const en_blend_opts *o,
                       en_blend_run **out)
{
    const en_hparams *hp = &e->m->hp;
    const int L = hp->n_layers, kvd = hp->n_head_kv * hp->head_dim;
    const int probe = o && o->probe_layer > 0 ? o->probe_layer : 1;
    *out = NULL;
    if (n_done < 0 || n_done >= end || end > n_tokens || probe >= L) return KM_EINVAL;
    /* the last chunk is computed in full unless asked (en_blend_opts.reuse_last), after the
     * checks of every segment below */
    const int n_reused = n_chunks && !(o && o->reuse_last) ? n_chunks - 1 : n_chunks;
    int nc = 0;
    for (int c = 0; c < n_chunks; c++) {
        const en_blend_seg *g = &chunks[c];
        if (g->n <= 0 || g->start < (c ? chunks[c - 1].start + chunks[c - 1].n : n_done) ||
            g->start + g->n > n_tokens - 1 || g->start + g->n > end)
            return KM_EINVAL;
        if (c < n_reused) nc += g->n;
    }
    n_chunks = n_reused;
    en_blend_run *b = calloc(1, sizeof *b);
    if (!b) return KM_ENOMEM;
    const int n = end - n_done;
    *b = (en_blend_run){.e = e,
                        .q = q,
                        .tokens = tokens,
                        .n_tokens = n_tokens,
                        .n_done = n_done,
                        .end = end,
                        .probe = probe,
                        .nc = nc};
    b->f = o && o->fraction > 0 ? (o->fraction < 1 ? o->fraction : 1) : 0;
    b->t = malloc(sizeof *b->t * (size_t)n);
    b->rk = malloc(sizeof *b->rk * (size_t)(nc ? nc : 1));
    b->old = malloc(sizeof(float) * 2 * kvd * (size_t)(nc + 1));
    b->in_chunk = calloc((size_t)n, 1);
    int rc =
        b->t && b->rk && b->old && b->in_chunk ? bl_bufs_init(&b->bb, e->max_tokens) : KM_ENOMEM;
    for (int c = 0; c < n_chunks && !rc; c++)
        memset(b->in_chunk + chunks[c].start - n_done, 1, (size_t)chunks[c].n);
    /* The probe: every token up to the last chunk's end (none after it is read there) through
     * layers [0, probe) and the K/V of the probe layer (no more is read of it), the chunks'
     * probe-layer K/V kept first. */
    const int n_probe = n_chunks ? chunks[n_chunks - 1].start + chunks[n_chunks - 1].n - n_done : 0;
    if (!rc && b->f > 0 && nc) {
        for (int i = 0, j = 0; i < n_probe && !rc; i++) {
            b->t[i] = (bl_tok){.pos = n_done + i, .depth = (int16_t)probe};
            if (!b->in_chunk[i]) continue;
            float *k0 = b->old + (size_t)2 * kvd * j++;
            for (int h = 0; h < hp->n_head_kv && !rc; h++)
                rc = kv_seq_read(e->kv, q, probe, h, n_done + i, k0 + h * hp->head_dim,
                                 k0 + kvd + h * hp->head_dim);
        }
        b->n_t = n_probe, b->probing = 1;
        b->st.token_layers += (long)n_probe * (probe + 1);
    } else if (!rc) {
        rc = bl_plan(b);
    }
    if (rc) {
        en_blend_run_end(b, NULL);
        return rc;
    }
    *out = b;
    return 0;
}

/* The next tokens of the pass in position order that one step may run: what max_token_layers
 * and cap (in units, see en_blend_run_price) allow, at least one token (a probe token counts the
 * probe layer's K/V as a layer, as en_blend_stats.token_layers does). Returns the count; *tl and
 * *cost: their (token, layer) pairs and units. */
static int bl_next(const en_blend_run *b, long max_token_layers, double u_tok, double u_att,
                   double cap, long *tl, double *cost)
{
    const double L = b->e->m->hp.n_layers;
    int m = 0;
    *tl = 0, *cost = 0;
    for (; b->at + m < b->n_t && m < b->e->max_tokens; m++) {
        const bl_tok *t = &b->t[b->at + m];
        const long d = t->depth + b->probing;
        const double c = d / L * (u_tok + (t->pos + 1.0) * u_att);
        if (m && (*tl + d > max_token_layers || *cost + c > cap)) break;
        *tl += d, *cost += c;
    }
    return m;
}

long en_blend_run_price(const en_blend_run *b, long max_token_layers, double u_tok, double u_att,
                        double cap, double *cost)
{
    long tl = 0;
    *cost = 0;
    if (!en_blend_run_done(b)) bl_next(b, max_token_layers, u_tok, u_att, cap, &tl, cost);
    return tl;
}

long en_blend_run_step(en_blend_run *b, long max_token_layers, const float **logits)
{
    if (en_blend_run_done(b)) return 0;
    long tl;
    double cost;
    const int m = bl_next(b, max_token_layers, 0, 0, 0, &tl, &cost);
    int rc = bl_batch(b->e, &b->bb, b->q, b->tokens, b->n_tokens, b->t + b->at, m, b->probing,
                      b->probing || b->end < b->n_tokens ? NULL : logits);
    if (rc) return rc;
    b->at += m;
    if (b->probing && b->at == b->n_t) rc = bl_plan(b);
    return rc ? rc : tl;
}

int en_blend_run_done(const en_blend_run *b)
{
    return !b->probing && b->at == b->n_t;
}

int en_blend_prefill(en_engine *e, kv_seq *q, const int32_t *tokens, int n_tokens, int n_done,
                     const en_blend_seg *chunks, int n_chunks, const en_blend_opts *o,
                     en_blend_stats *st, const float **logits)
{
    en_blend_stats z = {0};
    if (!st) st = &z;
    *st = z;
    en_blend_run *b;
    int rc = en_blend_run_begin(e, q, tokens, n_tokens, n_done, n_tokens, chunks, n_chunks, o, &b);
    while (rc >= 0 && !en_blend_run_done(b)) rc = en_blend_run_step(b, LONG_MAX, logits);
    if (b) en_blend_run_end(b, rc < 0 ? NULL : st);
    return rc < 0 ? rc : 0;
}

km_pagehash en_blend_chunk_seed(km_pagehash tenant_seed)
{
    /* One id that no page holds: no prefix chain's page (always page_tokens ids) hashes alike. */
    const int32_t mark = -1;
    return km_pagehash_next(tenant_seed, &mark, 1);
}

/* The preamble and the chunk's whole pages in one buffer, and their chain: page count. */
static int bl_chain(const en_engine *e, const en_blend_key *k, const int32_t *tokens, int n,
                    int32_t **ids, km_pagehash **h)
{
    const int pt = e->page_tokens, n_pre = k->pre ? k->n_pre : 0;
    const int np = (n_pre + n / pt * pt) / pt;
    *ids = NULL, *h = NULL;
    if (n_pre % pt || n < pt) return n_pre % pt ? KM_EINVAL : 0;
    *ids = malloc(sizeof(int32_t) * (size_t)np * pt);
    *h = malloc(sizeof(km_pagehash) * (size_t)np);
    if (!*ids || !*h) return KM_ENOMEM;
    if (n_pre) memcpy(*ids, k->pre, sizeof(int32_t) * n_pre);
    memcpy(*ids + n_pre, tokens, sizeof(int32_t) * (size_t)(np * pt - n_pre));
    km_pagehash_chain(k->seed, *ids, np * pt, pt, *h, np);
    return np;
}

int en_blend_chunk_attach(en_engine *e, const en_blend_key *k, const int32_t *tokens, int n,
                          kv_seq **out)
{
    const int pt = e->page_tokens, n_pre = k->pre ? k->n_pre : 0;
    int32_t *ids;
    km_pagehash *h;
    kv_seq *q = NULL;
    *out = NULL;
    int np = bl_chain(e, k, tokens, n, &ids, &h), rc = np;
    if (np > 0) rc = kv_seq_create(e->kv, &q);
    if (np > 0 && !rc) rc = kv_seq_attach(e->kv, q, h, ids, np);
    free(ids);
    free(h);
    if (rc * pt <= n_pre) { /* a miss, or the preamble alone */
        if (q) kv_seq_destroy(e->kv, q);
        return rc < 0 ? rc : 0;
    }
    kv_seq_wait_ready(e->kv, q);
    *out = q;
    return rc * pt - n_pre;
}

int en_blend_chunk_held(en_engine *e, const en_blend_key *k, const int32_t *tokens, int n)
{
    const int pt = e->page_tokens, n_pre = k->pre ? k->n_pre : 0;
    int32_t *ids;
    km_pagehash *h;
    int np = bl_chain(e, k, tokens, n, &ids, &h), rc = np;
    if (np > 0) rc = kv_store_held(e->kv, h, ids, np, NULL);
    free(ids);
    free(h);
    return rc < 0 ? rc : rc * pt > n_pre ? rc * pt - n_pre : 0;
}

int en_blend_chunk_store(en_engine *e, const en_blend_key *k, const int32_t *tokens, int n)
{
    const int pt = e->page_tokens;
    int32_t *ids;
    km_pagehash *h;
    kv_seq *q = NULL;
    bl_tok *t = NULL;
    const int np = bl_chain(e, k, tokens, n, &ids, &h), nt = np * pt;
    int rc = np > 0 ? 0 : np, held = 0;
    if (np > 0) {
        t = malloc(sizeof *t * (size_t)nt);
        rc = t ? kv_seq_create(e->kv, &q) : KM_ENOMEM;
    }
    /* what the store holds of the chain already (the preamble, shared by every chunk: a page
     * published twice under one hash would end the second chain there) */
    if (np > 0 && !rc) held = kv_seq_attach(e->kv, q, h, ids, np);
    if (held < 0) rc = held;
    for (int i = held * pt; i < nt && !rc; i++)
        t[i - held * pt] = (bl_tok){.pos = i, .depth = (int16_t)e->m->hp.n_layers};
    if (np > 0 && !rc && held < np) {
        kv_seq_wait_ready(e->kv, q);
        rc = bl_run(e, q, ids, nt, t, nt - held * pt, 0, NULL);
    }
    if (np > 0 && !rc) kv_seq_set_position_free(q, 1); /* kvshard's chunk flag */
    if (np > 0 && !rc) rc = kv_seq_publish(e->kv, q, h, ids, nt);
    if (q) kv_seq_destroy(e->kv, q);
    free(ids);
    free(h);
    free(t);
    return rc < 0 ? rc : 0;
}
