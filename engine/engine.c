/*
 * engine.c — the forward pass of a Llama-family model over a batch that mixes sequences.
 *
 * One step is one thread-pool job: every thread walks the same list of phases, separated by
 * barriers, and takes its share of each phase. Per layer (shapes for T batch tokens):
 *
 *   P1 tokens  x[T][embd] -> rmsnorm -> xn -> quantize to the dot type of Wq -> xq
 *   P2 rows    q[T][n_head*hd], k[T][n_kv*hd], v[T][n_kv*hd] = xq · {Wq,Wk,Wv}^T (+ bias)
 *   P3 tokens  rope(q), rope(k); K and V of each token into its sequence's kvshard page
 *   P4 pairs   (token, kv head): attention of the head group over the sequence's pages -> att
 *   P5 tokens  quantize att -> xq
 *   P6 rows    tmp = xq · Wo^T
 *   P7 tokens  x += tmp; rmsnorm -> xn; quantize -> xq
 *   P8 rows    gate, up = xq · {Wgate,Wup}^T
 *   P9 tokens  gate = silu(gate) * up; quantize -> xq
 *   P10 rows   tmp = xq · Wdown^T
 *   P11 tokens x += tmp   (fused with the next layer's P1: same token split, no barrier)
 *
 * "rows" phases split the output rows of the weight matrices (so each thread streams its own
 * part of the weights once for the whole batch); "tokens" phases split batch rows. Activations
 * are quantized exactly as ggml does before each matrix product (kernels.h), which is what makes
 * our logits track llama.cpp's. Buffers are sized at create for max_batch_tokens; a step
 * allocates nothing.
 *
 * Small batches (at most EN_LANE_TOKENS tokens, no more than threads, each of another sequence:
 * decode steps) run in "lanes": every
 * thread does the token phases for all tokens itself, on its own copies of x, xn, the SwiGLU
 * activation and xq, so that no barrier separates a token phase from the rows phase after it;
 * P3 and P4 of a token are done by the one thread that owns it (no barrier between its K/V write
 * and its attention). A layer then crosses 5 barriers instead of 10 (after P2, P4, P6, P8, P10):
 * ~150 per token at batch 1 instead of ~300. The arithmetic is the same either way, so a token's
 * logits do not depend on the mode (engine tests).
 *
 * MoE layers (hp.n_expert > 0) replace P8-P11 with engine_moe.c's en_moe_ffn (see there).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/engine_internal.h"

void *en_alloc(size_t n)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, n ? n : 64)) return NULL;
    return p;
}

static size_t en_dot_row_bytes(const en_weight *w)
{
    return md_type_row_bytes(kn_dot_type(w->type), w->k);
}

/* en_engine_opts.sparse_radius by default (docs/sparse.md "Measurements"). */
#define EN_SPARSE_RADIUS 0.5f

/* The budgets in pages of sparse attention within this many tokens (the shallow layers' at
 * least as large), at least the sink and window pages and two more. */
static int en_sparse_budgets(en_engine *e, int tokens)
{
    const int pt = e->page_tokens;
    e->sparse.budget_pages = (tokens + pt - 1) / pt;
    if (e->sparse.budget_pages < e->sparse.window_pages + 2)
        e->sparse.budget_pages = e->sparse.window_pages + 2;
    e->shallow = e->sparse;
    if (e->shallow_on && (e->shallow_tokens + pt - 1) / pt > e->shallow.budget_pages)
        e->shallow.budget_pages = (e->shallow_tokens + pt - 1) / pt;
    return en_sparse_head_budgets(e);
}

int en_engine_create(const en_model *m, const en_engine_opts *opts, en_engine **out, km_errbuf *err)
{
    *out = NULL;
    const en_hparams *hp = &m->hp;
    en_engine_opts o = opts ? *opts : (en_engine_opts){0};
    if (o.max_batch_tokens <= 0) o.max_batch_tokens = 512;
    if (o.kv_shard_key == KV_SHARD_KEY_EXPERT && !hp->n_expert)
        return km_errf(err, KM_EINVAL,
                       "engine: the `expert` KV shard key needs an MoE model (%s has no experts)",
                       m->name[0] ? m->name : "this model");
    if (o.n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        o.n_threads = n > 0 ? (int)n : 1;
    }
    en_engine *e = calloc(1, sizeof *e);
    if (!e) return km_errf(err, KM_ENOMEM, "engine: out of memory");
    e->m = m;
    e->ops = kn_ops_best();
    e->max_tokens = o.max_batch_tokens;

    kv_config kc = {
        .n_layers = hp->n_layers,
        .n_kv_heads = hp->n_head_kv,
        .head_dim = hp->head_dim,
        .page_tokens = o.page_tokens,
        .format = o.kv_format,
        .hot_bytes = o.kv_bytes,
        .n_shards = o.kv_shards,
        .shard_key = o.kv_shard_key,
        .n_tok_groups = o.kv_tok_groups,
        .n_expert_groups = o.kv_expert_groups,
        .host_bytes = o.kv_host_bytes,
        .disk_dir = o.kv_disk_dir,
        .disk_secret = o.kv_disk_secret,
        .disk_bytes = o.kv_disk_bytes,
        .arena = o.kv_arena,
        .summaries = o.sparse_attn > 0,
        .promote_selected = o.sparse_attn > 0,
        .fetch_slices = o.sparse_attn <= 0    ? 0
                        : !o.sparse_slices    ? hp->n_layers
                        : o.sparse_slices < 0 ? 0
                                              : o.sparse_slices,
    };
    if (!kc.hot_bytes)
        kc.hot_bytes = (size_t)4 * 4096 * hp->n_layers * hp->n_head_kv * hp->head_dim * 2 * 2;
    int rc = kv_store_create(&kc, &e->kv, err);
    if (rc) goto fail;
    if ((rc = kn_pool_create(o.n_threads, &e->pool))) {
        km_errf(err, rc, "engine: cannot start %d threads", o.n_threads);
        goto fail;
    }
    /* The packed weights are a cache of the model built once, by its first engine. */
    if ((rc = en_model_pack((en_model *)m, e->ops, e->pool, err))) goto fail;
    e->packed = m->packed_isa == (int)e->ops->isa;

    size_t T = (size_t)e->max_tokens;
    size_t embd = hp->n_embd, qd = (size_t)hp->n_head * hp->head_dim;
    size_t kvd = (size_t)hp->n_head_kv * hp->head_dim, ff = hp->n_ff;
    size_t xq = en_dot_row_bytes(&m->output);
    for (int l = 0; l < hp->n_layers; l++) {
        const en_layer *L = &m->layers[l];
        const en_weight *ws[] = {&L->wq,   &L->wk,     &L->wv,     &L->wo,   &L->w_gate,
                                 &L->w_up, &L->w_down, &L->w_gate, &L->w_up, &L->w_down};
        size_t nw = 7;
        if (hp->n_expert) { /* the experts of a layer share their tensor's type */
            ws[4] = &L->exp_gate[0], ws[5] = &L->exp_up[0], ws[6] = &L->exp_down[0];
            /* the shared expert's gate/up read the experts' quantized input */
            if (L->w_gate.data) nw = 10;
            if (kn_dot_type(ws[4]->type) != kn_dot_type(ws[5]->type) ||
                (nw > 7 && (kn_dot_type(ws[7]->type) != kn_dot_type(ws[4]->type) ||
                            kn_dot_type(ws[8]->type) != kn_dot_type(ws[4]->type)))) {
                rc = km_errf(err, KM_EUNSUPPORTED,
                             "engine: layer %d: expert gate and up tensors of different dot types",
                             l);
                goto fail;
            }
        }
        for (size_t i = 0; i < nw; i++) {
            size_t b = en_dot_row_bytes(ws[i]);
            if (!b) {
                rc = km_errf(err, KM_EUNSUPPORTED, "engine: layer %d: no dot type for %s", l,
                             md_type_name(ws[i]->type));
                goto fail;
            }
            if (b > xq) xq = b;
        }
    }
    e->xq_row_bytes = (xq + 63) & ~(size_t)63;
    e->attn_scale =
        hp->f_attention_scale != 0.0f ? hp->f_attention_scale : 1.0f / sqrtf((float)hp->head_dim);
    e->x = en_alloc(T * embd * 4);
    e->xn = en_alloc(T * embd * 4);
    e->q = en_alloc(T * qd * 4);
    e->k = en_alloc(T * kvd * 4);
    e->v = en_alloc(T * kvd * 4);
    e->att = en_alloc(T * qd * 4);
    e->tmp = en_alloc(T * embd * 4);
    /* MoE: gate and up hold every slot (token, choice) of the batch, k per token */
    const size_t kx = hp->n_expert ? (size_t)hp->n_expert_used : 1;
    e->gate = en_alloc(T * kx * ff * 4);
    e->up = en_alloc(T * kx * ff * 4);
    e->rope_cs = en_alloc(T * hp->n_rot * 4);
    e->logits = en_alloc(T * (size_t)hp->n_vocab * 4);
    e->xq = en_alloc(T * e->xq_row_bytes);
    e->out_idx = en_alloc(T * sizeof(int32_t));
    e->run0 = en_alloc(T * sizeof(int32_t));
    e->run_n = en_alloc(T * sizeof(int32_t));
    e->n_at = en_alloc((size_t)hp->n_layers * 2 * sizeof(int));
    e->runs_at = en_alloc((size_t)hp->n_layers * sizeof(int));
    const size_t sh = (size_t)hp->n_ff_shexp; /* MoE: the shared expert's width */
    const int nth = kn_pool_size(e->pool);
    e->lanes = calloc((size_t)nth, sizeof *e->lanes);
    int lanes_ok = e->lanes != NULL;
    for (int i = 0; lanes_ok && i < nth; i++) {
        const size_t L = EN_LANE_TOKENS;
        e->lanes[i].x = en_alloc(L * embd * 4);
        e->lanes[i].xn = en_alloc(L * embd * 4);
        e->lanes[i].act = en_alloc(L * (kx * ff > sh ? kx * ff : sh) * 4);
        e->lanes[i].xq = en_alloc(L * e->xq_row_bytes);
        lanes_ok = e->lanes[i].x && e->lanes[i].xn && e->lanes[i].act && e->lanes[i].xq;
        if (lanes_ok && hp->n_expert) {
            e->lanes[i].sel = en_alloc(L * kx * sizeof(int32_t));
            e->lanes[i].rw = en_alloc(L * kx * 4);
            e->lanes[i].xqg = en_alloc(L * kx * e->xq_row_bytes);
            e->lanes[i].shw = en_alloc(L * 4);
            lanes_ok = e->lanes[i].sel && e->lanes[i].rw && e->lanes[i].xqg && e->lanes[i].shw;
        }
    }
    if (lanes_ok && hp->n_expert) lanes_ok = en_moe_alloc(e, nth) == 0;
    e->page_tokens = kv_store_page_tokens(e->kv);
    e->attn_timer = o.attn_timer;
    if (o.sparse_attn > 0) {
        const int pt = e->page_tokens;
        e->sparse_on = 1;
        e->sparse_from = o.sparse_dense_layers == 0  ? 2
                         : o.sparse_dense_layers < 0 ? 0
                                                     : o.sparse_dense_layers;
        e->sparse =
            (kn_sparse_cfg){.sink_pages = 1,
                            .window_pages = o.sparse_window > 0 ? o.sparse_window : 2,
                            .radius = o.sparse_radius > 0 ? o.sparse_radius : EN_SPARSE_RADIUS};
        e->shallow_on = o.sparse_shallow_attn > 0 && e->sparse_from > 0;
        e->shallow_tokens = o.sparse_shallow_attn;
        const size_t heads = (size_t)hp->n_layers * hp->n_head_kv;
        if (o.sparse_shares && (e->shares = malloc(sizeof(float) * heads)))
            memcpy(e->shares, o.sparse_shares, sizeof(float) * heads);
        lanes_ok =
            lanes_ok && (!o.sparse_shares || e->shares) && en_sparse_budgets(e, o.sparse_attn) == 0;
        /* views with more pages than this are attended densely (kn_sparse_attention) */
        int cap = kv_store_pages_total(e->kv), tr = (hp->n_ctx_train + pt - 1) / pt;
        cap = (cap > tr ? cap : tr) + 1;
        for (int i = 0; lanes_ok && i < nth; i++) {
            lanes_ok = kn_sparse_scratch_init(&e->lanes[i].sparse, cap) == 0;
            e->lanes[i].defer = malloc(sizeof(int) * (size_t)e->max_tokens * hp->n_head_kv);
            lanes_ok = lanes_ok && e->lanes[i].defer;
        }
        e->fetch_list = malloc(sizeof(int) * (size_t)cap);
        const size_t items = (size_t)e->max_tokens * hp->n_head_kv;
        e->pick_stride = e->shallow.budget_pages > e->sparse.budget_pages ? e->shallow.budget_pages
                                                                          : e->sparse.budget_pages;
        for (size_t i = 0; e->head_cfg && i < heads; i++)
            if ((int)i >= e->sparse_from * hp->n_head_kv &&
                e->head_cfg[i].budget_pages > e->pick_stride)
                e->pick_stride = e->head_cfg[i].budget_pages;
        e->pick_sel = malloc(sizeof(int) * items * (size_t)e->pick_stride);
        e->pick_n = malloc(sizeof(int) * items);
        e->pick_at = calloc(items, sizeof(uint64_t));
        lanes_ok = lanes_ok && e->pick_sel && e->pick_n && e->pick_at;
        e->sparse_idle = o.sparse_idle == 0 ? 16 : o.sparse_idle < 0 ? 0 : o.sparse_idle;
        /* no tier below hot: nothing can go down, so reads need not be recorded either */
        if (!o.kv_host_bytes && !o.kv_disk_dir) e->sparse_idle = 0;
        e->idle_seqs = malloc(sizeof(kv_seq *) * (size_t)e->max_tokens);
        lanes_ok = lanes_ok && e->fetch_list && e->idle_seqs;
    }
    if (o.head_probe_from > 0 && lanes_ok) {
        const int pt = e->page_tokens;
        e->probe_from = o.head_probe_from;
        lanes_ok = en_probe_alloc(e, nth, (hp->n_ctx_train + pt - 1) / pt + 1) == 0;
    }
    if (!e->x || !e->xn || !e->q || !e->k || !e->v || !e->att || !e->tmp || !e->gate || !e->up ||
        !e->rope_cs || !e->logits || !e->xq || !e->out_idx || !e->run0 || !e->run_n || !e->n_at ||
        !e->runs_at || !lanes_ok) {
        rc =
            km_errf(err, KM_ENOMEM, "engine: cannot allocate buffers for %d tokens", e->max_tokens);
        goto fail;
    }
    *out = e;
    return 0;
fail:
    en_engine_destroy(e);
    return rc;
}

void en_engine_destroy(en_engine *e)
{
    if (!e) return;
    for (int i = 0; e->lanes && e->pool && i < kn_pool_size(e->pool); i++) {
        free(e->lanes[i].x);
        free(e->lanes[i].xn);
        free(e->lanes[i].act);
        free(e->lanes[i].xq);
        free(e->lanes[i].sel);
        free(e->lanes[i].rw);
        free(e->lanes[i].xqg);
        free(e->lanes[i].shw);
        kn_sparse_scratch_free(&e->lanes[i].sparse);
        free(e->lanes[i].defer);
    }
    if (e->pool) en_probe_free(e, kn_pool_size(e->pool));
    free(e->lanes);
    free(e->shares);
    free(e->head_cfg);
    free((void *)e->pick_mark);
    free(e->fetch_list);
    free(e->pick_sel);
    free(e->pick_n);
    free(e->pick_at);
    free(e->idle_seqs);
    en_moe_free(e);
    kn_pool_destroy(e->pool);
    kv_store_destroy(e->kv);
    float *bufs[] = {e->x,   e->xn,   e->q,  e->k,       e->v,     e->att,
                     e->tmp, e->gate, e->up, e->rope_cs, e->logits};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
    free(e->xq);
    free(e->out_idx);
    free(e->run0);
    free(e->run_n);
    free(e->n_at);
    free(e->runs_at);
    free(e);
}

kv_store *en_engine_kv(en_engine *e)
{
    return e->kv;
}
void en_engine_sparse_stats(const en_engine *e, en_sparse_stats *out)
{
    *out = (en_sparse_stats){.fetches = e->fetches,
                             .pages_fetched = e->pages_fetched,
                             .pages_wanted = e->pages_wanted,
                             .attn_ns = e->attn_ns};
    for (int i = 0; e->lanes && i < kn_pool_size(e->pool); i++) {
        out->pages_selected += e->lanes[i].sparse_sel;
        out->pages_skipped += e->lanes[i].sparse_all - e->lanes[i].sparse_sel;
    }
}

int en_engine_set_sparse(en_engine *e, int tokens)
{
    if (!e->sparse_on || tokens < 0) return KM_EINVAL;
    e->sparse_dense = tokens == 0;
    return tokens ? en_sparse_budgets(e, tokens) : 0;
}

int en_engine_sparse_budget(const en_engine *e, int layer, int kv_head)
{
    const int kvh = e->m->hp.n_head_kv;
    if (!e->sparse_on || e->sparse_dense || layer < 0 || layer >= e->m->hp.n_layers ||
        kv_head < 0 || kv_head >= kvh || (layer < e->sparse_from && !e->shallow_on))
        return 0;
    if (layer < e->sparse_from) return e->shallow.budget_pages;
    return e->head_cfg ? e->head_cfg[layer * kvh + kv_head].budget_pages : e->sparse.budget_pages;
}

int en_engine_threads(const en_engine *e)
{
    return kn_pool_size(e->pool);
}
const char *en_engine_isa(const en_engine *e)
{
    return e->ops->name;
}

/* ------------------------------------------------------------------ phases */

/* Quantizes rows [lo, hi) of src (row length k) into xq for the given weight's dot type. */
void en_quantize_rows(const en_engine *e, const en_weight *w, const float *src, uint8_t *xq,
                      int64_t lo, int64_t hi)
{
    md_type dt = kn_dot_type(w->type);
    for (int64_t i = lo; i < hi; i++)
        e->ops->quantize_row(dt, src + i * w->k, xq + i * e->xq_row_bytes, w->k);
}

void en_matmul_group(const en_engine *e, const uint8_t *xq, const en_mm *mm, int n_mm, int m,
                     int ith, int nth)
{
    const int64_t A = KN_PACK_ALIGN;
    int64_t total = 0;
    for (int i = 0; i < n_mm; i++) total += (mm[i].w->rows + A - 1) / A;
    int64_t c0, c1;
    kn_split(total, ith, nth, &c0, &c1);
    int64_t base = 0; /* chunks of the matrices before this one */
    for (int i = 0; i < n_mm && c0 < c1; i++) {
        const en_weight *w = mm[i].w;
        const int64_t chunks = (w->rows + A - 1) / A;
        const int64_t lo = c0 > base ? c0 - base : 0, hi = c1 - base < chunks ? c1 - base : chunks;
        base += chunks;
        if (lo >= hi) continue;
        const int64_t a = lo * A, b = hi * A < w->rows ? hi * A : w->rows;
        const uint8_t *xi = mm[i].xq ? mm[i].xq : xq;
        const int mi = mm[i].m ? mm[i].m : m;
        if (e->packed && w->packed)
            e->ops->matmul_packed(w->type, w->packed, w->rows, xi, e->xq_row_bytes, w->k, mi,
                                  mm[i].y, mm[i].y_stride, a, b);
        else
            e->ops->matmul(w->type, w->data, w->row_bytes, xi, e->xq_row_bytes, w->k, mi, mm[i].y,
                           mm[i].y_stride, a, b);
        if (mm[i].bias && mm[i].bias->data) {
            const float *bv = mm[i].bias->data;
            for (int t = 0; t < mi; t++)
                for (int64_t r = a; r < b; r++) mm[i].y[t * mm[i].y_stride + r] += bv[r];
        }
    }
}

/* x += y, or granite's x += residual_scale * y (ggml_scale, then ggml_add: two roundings; y is
 * read only, lanes share it). */
void en_residual_add(const en_engine *e, float *x, const float *y)
{
    const int n = e->m->hp.n_embd;
    const float s = e->m->hp.f_residual_scale;
    if (s == 0.0f) {
        e->ops->add(x, y, n);
        return;
    }
    for (int d = 0; d < n; d++) {
        const float v = s * y[d];
        x[d] += v;
    }
}

/* Token i's q and k: olmoe's RMS norms over the whole vectors (in place), then rope; and its K/V
 * into its sequence's page. */
static void en_token_qk(const en_engine *e, const en_layer *L, const en_batch *b, int l, int64_t i)
{
    const en_hparams *hp = &e->m->hp;
    const int hd = hp->head_dim, qd = hp->n_head * hd, kvd = hp->n_head_kv * hd;
    float *q = e->q + i * qd, *k = e->k + i * kvd;
    if (L->q_norm.data) {
        e->ops->rmsnorm(q, q, L->q_norm.data, qd, hp->norm_eps);
        e->ops->rmsnorm(k, k, L->k_norm.data, kvd, hp->norm_eps);
    }
    const float *cs = e->rope_cs + i * hp->n_rot;
    e->ops->rope(q, hp->n_head, hd, hp->n_rot, cs, hp->rope_neox);
    e->ops->rope(k, hp->n_head_kv, hd, hp->n_rot, cs, hp->rope_neox);
    kv_seq_write(e->kv, b->seqs[i], l, b->pos[i], k, e->v + i * kvd);
}

/* The page choice of layer l's kv head h: the shallow layers' budget below sparse_from, the
 * head's own with per-head budgets (en_engine_opts.sparse_shares). */
static const kn_sparse_cfg *en_sparse_cfg(const en_engine *e, int l, int h)
{
    if (l < e->sparse_from) return &e->shallow;
    return e->head_cfg ? &e->head_cfg[l * e->m->hp.n_head_kv + h] : &e->sparse;
}

/* Whether token i's attention in layer l over kv head h is sparse (its context past the
 * budget). */
static int en_sparse_token(const en_engine *e, const en_batch *b, int l, int64_t i, int h)
{
    return e->sparse_on && !e->sparse_dense && (l >= e->sparse_from || e->shallow_on) &&
           b->pos[i] + 1 > en_sparse_cfg(e, l, h)->budget_pages * e->page_tokens;
}

/* The stamp of layer l of the current step in pick_at (never 0). */
static uint64_t en_pick_stamp(const en_engine *e, int l)
{
    return e->steps * (uint64_t)e->m->hp.n_layers + (uint64_t)l + 1;
}

/* Token i's attention in layer l over kv head h (the head group's queries), dense or sparse:
 * over the pages the layer's fetch picked for it when there was one (the same pick). */
static void en_attend(const en_engine *e, const en_batch *b, int l, int64_t i, int h, int ith)
{
    const en_hparams *hp = &e->m->hp;
    const int hd = hp->head_dim, qd = hp->n_head * hd;
    const int group = hp->n_head / hp->n_head_kv;
    const size_t off = (size_t)i * qd + (size_t)h * group * hd;
    kn_kv_view view;
    kv_seq_view(e->kv, b->seqs[i], l, h, b->pos[i] + 1, &view);
    if (!en_sparse_token(e, b, l, i, h)) {
        if (e->probe && b->pos[i] >= e->probe_from)
            en_probe_attention(e, &view, b->seqs[i], l, h, e->q + off, ith);
        e->ops->attention(&view, hd, e->q + off, group, e->attn_scale, e->att + off);
        if (e->sparse_idle) kv_seq_touch(e->kv, b->seqs[i], NULL, b->pos[i] / e->page_tokens + 1);
        return;
    }
    kn_sparse_scratch *scr = &e->lanes[ith].sparse;
    const int np = (view.n_ctx + view.page_tokens - 1) / view.page_tokens;
    const size_t it = (size_t)i * hp->n_head_kv + h;
    const int *sel = scr->sel;
    int n;
    if (e->pick_at && e->pick_at[it] == en_pick_stamp(e, l)) { /* the fetch's pick, kept */
        sel = e->pick_sel + it * e->pick_stride;
        n = kn_sparse_attend(e->ops, &view, sel, e->pick_n[it], scr, hd, e->q + off, group,
                             e->attn_scale, e->att + off);
    } else {
        if (np <= scr->cap) kv_seq_summaries(e->kv, b->seqs[i], l, h, np, scr->sums);
        n = kn_sparse_attention(e->ops, &view, scr->sums, en_sparse_cfg(e, l, h), scr, hd,
                                e->q + off, group, e->attn_scale, e->att + off);
    }
    e->lanes[ith].sparse_sel += (uint64_t)n;
    e->lanes[ith].sparse_all += (uint64_t)np;
    if (e->sparse_idle) kv_seq_touch(e->kv, b->seqs[i], n == np ? NULL : sel, n);
}

/* Marks in run r's row the pages token i reads in layer l over kv head h, chosen as en_attend
 * will choose them (all of them when it attends densely: kv head 0 marks those). */
static void en_fetch_pick(en_engine *e, const en_batch *b, int l, int r, int64_t i, int h, int ith)
{
    const en_hparams *hp = &e->m->hp;
    const int hd = hp->head_dim, qd = hp->n_head * hd, group = hp->n_head / hp->n_head_kv;
    kn_sparse_scratch *scr = &e->lanes[ith].sparse;
    _Atomic uint8_t *mark = e->pick_mark + (size_t)r * scr->cap;
    const int np = (b->pos[i] + e->page_tokens) / e->page_tokens;
    if (!en_sparse_token(e, b, l, i, h) || np > scr->cap) {
        for (int k = 0; !h && k < np && k < scr->cap; k++)
            atomic_store_explicit(&mark[k], 1, memory_order_relaxed);
        return;
    }
    kn_kv_view view;
    kv_seq_view(e->kv, b->seqs[i], l, h, b->pos[i] + 1, &view);
    kv_seq_summaries(e->kv, b->seqs[i], l, h, np, scr->sums);
    const int n = kn_sparse_pick(e->ops, &view, scr->sums, en_sparse_cfg(e, l, h), scr, hd,
                                 e->q + (size_t)i * qd + (size_t)h * group * hd, group);
    for (int k = 0; k < n; k++) atomic_store_explicit(&mark[scr->sel[k]], 1, memory_order_relaxed);
    const size_t it = (size_t)i * hp->n_head_kv + h;
    if (n > e->pick_stride) return; /* not a sparse pick: attention picks again (never here) */
    memcpy(e->pick_sel + it * e->pick_stride, scr->sel, sizeof(int) * (size_t)n);
    e->pick_n[it] = n;
    e->pick_at[it] = en_pick_stamp(e, l); /* read by its attention, after the layer's barrier */
}

/* Every thread's share of a layer's picks: the (token, kv head) items of the runs whose
 * sequence has pages not hot. */
static void en_fetch_picks(en_engine *e, const en_step *st, int l, int ith, int nth)
{
    const int kvh = e->m->hp.n_head_kv;
    int64_t k = 0;
    for (int r = 0; r < st->n_runs; r++) {
        const int i0 = e->run0[r], nr = e->run_n[r];
        if (!kv_seq_cold_pages(st->b->seqs[i0])) continue;
        for (int i = i0; i < i0 + nr; i++)
            for (int h = 0; h < kvh; h++, k++)
                if (k % nth == ith) en_fetch_pick(e, st->b, l, r, i, h, ith);
    }
}

/* After the picks (thread 0, the others at a barrier, so structural calls are safe): each run's
 * sequence brings up the marked pages that are not hot; the marks are cleared. */
static void en_fetch_layer(en_engine *e, const en_step *st, int l)
{
    const en_batch *b = st->b;
    const int cap = e->lanes[0].sparse.cap;
    for (int r = 0; r < st->n_runs; r++) {
        const int i0 = e->run0[r], nr = e->run_n[r];
        kv_seq *q = b->seqs[i0];
        _Atomic uint8_t *mark = e->pick_mark + (size_t)r * cap;
        const int np = (b->pos[i0 + nr - 1] + e->page_tokens) / e->page_tokens;
        for (int k = cap; k < np && kv_seq_cold_pages(q);) { /* past the scratch: every page */
            int m = 0;
            for (; k < np && m < cap; k++) e->fetch_list[m++] = k;
            const int got = kv_seq_fetch(e->kv, q, l, e->fetch_list, m);
            e->pages_fetched += got > 0 ? (uint64_t)got : 0;
            e->pages_wanted += (uint64_t)m;
        }
        int n = 0;
        for (int k = 0; k < np && k < cap; k++)
            if (atomic_exchange_explicit(&mark[k], 0, memory_order_relaxed)) e->fetch_list[n++] = k;
        if (!kv_seq_cold_pages(q)) continue; /* an earlier run of its sequence brought them up */
        e->pages_wanted += (uint64_t)n;
        const int got = kv_seq_fetch(e->kv, q, l, e->fetch_list, n);
        e->fetches++;
        e->pages_fetched += got > 0 ? (uint64_t)got : 0;
    }
}

/* Attention of run r's tokens over kv head h in layer l (P4 outside lane mode). */
static void en_att_item(const en_engine *e, const en_batch *b, int l, int r, int h, int ith)
{
    const en_hparams *hp = &e->m->hp;
    const int hd = hp->head_dim, qd = hp->n_head * hd, group = hp->n_head / hp->n_head_kv;
    const int i0 = e->run0[r], nr = e->run_n[r];
    if (en_sparse_token(e, b, l, i0 + nr - 1, h) || /* each token picks its pages */
        (e->probe && b->pos[i0 + nr - 1] >= e->probe_from)) {
        for (int i = i0; i < i0 + nr; i++) en_attend(e, b, l, i, h, ith);
        return;
    }
    kn_kv_view view;
    kv_seq_view(e->kv, b->seqs[i0], l, h, b->pos[i0 + nr - 1] + 1, &view);
    const size_t off = (size_t)i0 * qd + (size_t)h * group * hd;
    e->ops->attention_multi(&view, hd, e->q + off, (size_t)qd, nr, group, e->attn_scale,
                            e->att + off, (size_t)qd);
    if (e->sparse_idle)
        kv_seq_touch(e->kv, b->seqs[i0], NULL, b->pos[i0 + nr - 1] / e->page_tokens + 1);
}

/* Token i completed its page's rows of layer l: the page's key summary for that layer. */
static void en_token_summarize(const en_engine *e, const en_batch *b, int l, int64_t i)
{
    if (e->sparse_on && (b->pos[i] + 1) % e->page_tokens == 0)
        kv_seq_summarize(e->kv, b->seqs[i], l, b->pos[i]);
}

/* Rope, the K/V write and attention of one token over all kv heads (lane mode: its owner). */
static void en_token_attention(const en_engine *e, const en_layer *L, const en_batch *b, int l,
                               int64_t i, int ith)
{
    en_token_qk(e, L, b, l, i);
    en_token_summarize(e, b, l, i);
    for (int h = 0; h < e->m->hp.n_head_kv; h++) en_attend(e, b, l, i, h, ith);
}

/* The calling thread's CPU time. */
static uint64_t en_thread_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void en_step_job(void *ctx, int ith, int nth)
{
    en_step *st = ctx;
    en_engine *e = st->e;
    const en_model *m = e->m;
    const en_hparams *hp = &m->hp;
    const kn_ops *ops = e->ops;
    const en_batch *b = st->b;
    int n = b->n_tokens, n_runs = st->n_runs;
    int embd = hp->n_embd, hd = hp->head_dim, ff = hp->n_ff;
    int qd = hp->n_head * hd, kvd = hp->n_head_kv * hd;
    /* Token-wise work: this thread's share of the shared buffers, or (lanes) every token in its
     * own buffers, where nothing needs a barrier after it. */
    const int lanes = st->lanes;
    int64_t t0, t1;
    float *x = e->x, *xn = e->xn, *act = e->gate;
    uint8_t *xq = e->xq;
    if (lanes) {
        t0 = 0, t1 = n;
        x = e->lanes[ith].x, xn = e->lanes[ith].xn, act = e->lanes[ith].act;
        xq = e->lanes[ith].xq;
    } else {
        kn_split(n, ith, nth, &t0, &t1);
    }
#define EN_AFTER_TOKENS()                                                                          \
    do {                                                                                           \
        if (!lanes) kn_pool_barrier(e->pool);                                                      \
    } while (0)

    /* Embeddings and rope caches (lanes: the cache by each token's owner, who ropes it). */
    for (int64_t i = t0; i < t1; i++) {
        const uint8_t *row =
            (const uint8_t *)m->tok_embd.data + (size_t)b->tokens[i] * m->tok_embd.row_bytes;
        ops->dequantize_row(m->tok_embd.type, row, x + i * embd, embd);
        if (hp->f_embedding_scale != 0.0f) /* granite */
            for (int d = 0; d < embd; d++) x[i * embd + d] *= hp->f_embedding_scale;
        if (!lanes || i % nth == ith)
            kn_rope_cache(e->rope_cs + i * hp->n_rot, hp->n_rot, b->pos[i], hp->rope_base);
    }

    for (int l = 0; l < hp->n_layers; l++) {
        const en_layer *L = &m->layers[l];
        if (st->depth && e->n_at[hp->n_layers + l] != n) { /* fewer tokens (en_batch.depth) */
            n = e->n_at[hp->n_layers + l], n_runs = e->runs_at[l];
            kn_split(n, ith, nth, &t0, &t1);
            kn_pool_barrier(e->pool); /* P11 of the layer before ran on the old split */
            if (!n) break;
        }
        /* P1 */
        for (int64_t i = t0; i < t1; i++)
            ops->rmsnorm(xn + i * embd, x + i * embd, L->attn_norm.data, embd, hp->norm_eps);
        en_quantize_rows(e, &L->wq, xn, xq, t0, t1);
        EN_AFTER_TOKENS();
        /* P2 */
        en_mm qkv[3] = {{&L->wq, e->q, qd, &L->bq, NULL, 0},
                        {&L->wk, e->k, kvd, &L->bk, NULL, 0},
                        {&L->wv, e->v, kvd, &L->bv, NULL, 0}};
        int same = kn_dot_type(L->wk.type) == kn_dot_type(L->wq.type) &&
                   kn_dot_type(L->wv.type) == kn_dot_type(L->wq.type);
        if (same) {
            en_matmul_group(e, xq, qkv, 3, n, ith, nth);
        } else {
            /* Mixed dot types (some K-quant mixes): one matrix at a time. */
            for (int j = 0; j < 3; j++) {
                if (j) {
                    EN_AFTER_TOKENS(); /* everyone is done with xq */
                    en_quantize_rows(e, qkv[j].w, xn, xq, t0, t1);
                    EN_AFTER_TOKENS();
                }
                en_matmul_group(e, xq, &qkv[j], 1, n, ith, nth);
            }
        }
        kn_pool_barrier(e->pool);
        const uint64_t a0 = e->attn_timer && !ith ? en_thread_ns() : 0;
        if (lanes) {
            /* P3 + P4 of each token by its owner */
            for (int64_t i = ith; i < n; i += nth) en_token_attention(e, L, b, l, i, ith);
        } else {
            /* P3 */
            for (int64_t i = t0; i < t1; i++) en_token_qk(e, L, b, l, i);
            kn_pool_barrier(e->pool);
            if (e->sparse_on) { /* pages this step filled are summarized before anyone reads */
                for (int64_t i = t0; i < t1; i++) en_token_summarize(e, b, l, i);
                kn_pool_barrier(e->pool);
            }
            if (st->fetch) { /* and the pages it reads that are not hot come up */
                en_fetch_picks(e, st, l, ith, nth);
                kn_pool_barrier(e->pool);
                if (!ith) en_fetch_layer(e, st, l);
                kn_pool_barrier(e->pool);
            }
            if (st->depth && e->n_at[l] != n) { /* those past depth wrote K/V only */
                n = e->n_at[l], n_runs = e->runs_at[l];
                kn_split(n, ith, nth, &t0, &t1);
                if (!n) break; /* every thread alike, after the barriers above */
            }
            /* P4: (run, kv head) items interleaved so that early (cheap) and late (expensive)
             * prompt positions spread over the threads; a run's tokens share one walk of the
             * pages (en_att_runs). After a fetch, items whose pages are still on their way
             * wait until the thread's other items are done: I/O under compute. */
            int n_defer = 0;
            int *defer = e->sparse_on ? e->lanes[ith].defer : NULL;
            for (int64_t p = ith; p < (int64_t)n_runs * hp->n_head_kv; p += nth) {
                const int r = (int)(p / hp->n_head_kv);
                if (st->fetch && defer && !kv_seq_layer_ready(e->kv, b->seqs[e->run0[r]], l))
                    defer[n_defer++] = (int)p;
                else
                    en_att_item(e, b, l, r, (int)(p % hp->n_head_kv), ith);
            }
            for (int k = 0; k < n_defer; k++)
                en_att_item(e, b, l, defer[k] / hp->n_head_kv, defer[k] % hp->n_head_kv, ith);
        }
        kn_pool_barrier(e->pool);
        if (e->attn_timer && !ith) e->attn_ns += en_thread_ns() - a0;
        /* P5 */
        en_quantize_rows(e, &L->wo, e->att, xq, t0, t1);
        EN_AFTER_TOKENS();
        /* P6 */
        en_mm o = {&L->wo, e->tmp, embd, NULL, NULL, 0};
        en_matmul_group(e, xq, &o, 1, n, ith, nth);
        kn_pool_barrier(e->pool);
        /* P7 */
        for (int64_t i = t0; i < t1; i++) {
            en_residual_add(e, x + i * embd, e->tmp + i * embd);
            ops->rmsnorm(xn + i * embd, x + i * embd, L->ffn_norm.data, embd, hp->norm_eps);
        }
        const en_weight *ffn_in = hp->n_expert ? &L->exp_gate[0] : &L->w_gate;
        en_quantize_rows(e, ffn_in, xn, xq, t0, t1);
        if (hp->n_expert) {
            en_moe_ffn(st, L, n, ith, nth, t0, t1, x, xn, act, xq);
            continue;
        }
        EN_AFTER_TOKENS();
        /* P8 */
        if (kn_dot_type(L->w_up.type) == kn_dot_type(L->w_gate.type)) {
            en_mm gu[2] = {{&L->w_gate, e->gate, ff, NULL, NULL, 0},
                           {&L->w_up, e->up, ff, NULL, NULL, 0}};
            en_matmul_group(e, xq, gu, 2, n, ith, nth);
        } else {
            en_mm g1 = {&L->w_gate, e->gate, ff, NULL, NULL, 0},
                  u1 = {&L->w_up, e->up, ff, NULL, NULL, 0};
            en_matmul_group(e, xq, &g1, 1, n, ith, nth);
            EN_AFTER_TOKENS();
            en_quantize_rows(e, &L->w_up, xn, xq, t0, t1);
            EN_AFTER_TOKENS();
            en_matmul_group(e, xq, &u1, 1, n, ith, nth);
        }
        kn_pool_barrier(e->pool);
        /* P9 (lanes: into the thread's own activation buffer; gate is shared) */
        for (int64_t i = t0; i < t1; i++)
            ops->silu_mul(act + i * ff, e->gate + i * ff, e->up + i * ff, ff);
        en_quantize_rows(e, &L->w_down, act, xq, t0, t1);
        EN_AFTER_TOKENS();
        /* P10 */
        en_mm d = {&L->w_down, e->tmp, embd, NULL, NULL, 0};
        en_matmul_group(e, xq, &d, 1, n, ith, nth);
        kn_pool_barrier(e->pool);
        /* P11 */
        for (int64_t i = t0; i < t1; i++) ops->add(x + i * embd, e->tmp + i * embd, embd);
    }

    /* Output: only the rows that asked for logits, gathered to the front of xn. */
    int64_t o0 = 0, o1 = st->n_out;
    if (!lanes) kn_split(st->n_out, ith, nth, &o0, &o1);
    EN_AFTER_TOKENS();
    for (int64_t j = o0; j < o1; j++)
        ops->rmsnorm(xn + j * embd, x + (size_t)e->out_idx[j] * embd, m->output_norm.data, embd,
                     hp->norm_eps);
    en_quantize_rows(e, &m->output, xn, xq, o0, o1);
    EN_AFTER_TOKENS();
    en_mm out = {&m->output, e->logits, hp->n_vocab, NULL, NULL, 0};
    en_matmul_group(e, xq, &out, 1, st->n_out, ith, nth);
#undef EN_AFTER_TOKENS
}

/* Splits the batch into attention runs: tokens of one sequence at consecutive positions, cut
 * into pieces of a power of two up to EN_ATT_RUN tokens. With one thread a run is as long as it
 * can be; with more, short enough that a sequence's (run, kv head) items still give every
 * thread four, so that the phase stays balanced (a verification of 4 tokens with 3 kv heads on
 * 2 threads: runs of 1, as before runs existed; a 512-token prefill chunk: runs of 8). Returns
 * the number of runs. */
static int en_att_runs(en_engine *e, const en_batch *b, int nth)
{
    const int n = b->n_tokens, kvh = e->m->hp.n_head_kv;
    int n_runs = 0;
    for (int i = 0; i < n;) {
        int j = i + 1;
        while (j < n && b->seqs[j] == b->seqs[i] && b->pos[j] == b->pos[j - 1] + 1 &&
               (!b->depth || b->depth[j] == b->depth[i]))
            j++;
        int R = 1;
        while (R * 2 <= EN_ATT_RUN && (nth == 1 || R * 2 * 4 * nth <= (j - i) * kvh)) R *= 2;
        for (int k = i; k < j; k += R) {
            e->run0[n_runs] = k;
            e->run_n[n_runs++] = j - k < R ? j - k : R;
        }
        i = j;
    }
    return n_runs;
}

/* After a sparse step: each of the batch's sequences drops the layer slices it read
 * (kv_seq_fetch_end) and sends down the held pages its steps stopped reading
 * (kv_seq_demote_idle), the recent window kept. */
static void en_demote_idle(en_engine *e, const en_batch *b, int fetched)
{
    int n = 0;
    for (int i = 0; i < b->n_tokens; i++) {
        int seen = 0;
        for (int j = n - 1; j >= 0 && !seen; j--) seen = e->idle_seqs[j] == b->seqs[i];
        if (!seen) e->idle_seqs[n++] = b->seqs[i];
    }
    for (int j = 0; j < n; j++) {
        if (fetched) kv_seq_fetch_end(e->kv, e->idle_seqs[j]);
        if (e->sparse_idle)
            kv_seq_demote_idle(e->kv, e->idle_seqs[j], e->sparse_idle, e->sparse.window_pages);
    }
}

int en_engine_step(en_engine *e, const en_batch *b, const float **logits)
{
    const en_hparams *hp = &e->m->hp;
    if (b->n_tokens < 1 || b->n_tokens > e->max_tokens) return KM_EINVAL;
    int n_out = 0;
    for (int i = 0; i < b->n_tokens; i++) {
        if (b->tokens[i] < 0 || b->tokens[i] >= hp->n_vocab || b->pos[i] < 0 || !b->seqs[i])
            return KM_EINVAL;
        const int want = b->logits ? b->logits[i] : i == b->n_tokens - 1;
        if (want) e->out_idx[n_out++] = i;
        if (b->depth &&
            (b->depth[i] < 0 || b->depth[i] > hp->n_layers ||
             (i && b->depth[i] > b->depth[i - 1]) || (want && b->depth[i] != hp->n_layers)))
            return KM_EINVAL;
    }
    for (int i = 0; i < b->n_tokens; i++) {
        int rc = kv_seq_reserve(e->kv, b->seqs[i], b->pos[i] + 1);
        if (rc) return rc;
    }
    /* Lanes need one token per sequence: a token's owner writes its K/V and attends at once, so
     * another token of its sequence in the same step could not see it. */
    const int nth = kn_pool_size(e->pool);
    int lanes = nth > 1 && b->n_tokens <= nth && b->n_tokens <= EN_LANE_TOKENS && !b->depth;
    int fetch = 0; /* pages not hot are fetched at a barrier of every layer: no lanes */
    for (int i = 0; e->sparse_on && i < b->n_tokens; i++) fetch |= kv_seq_cold_pages(b->seqs[i]);
    if (fetch) lanes = 0;
    if (fetch) { /* a row of marks per run (en_fetch_picks) */
        const size_t need = (size_t)b->n_tokens * (size_t)e->lanes[0].sparse.cap;
        if (need > e->pick_cap) {
            _Atomic uint8_t *m = calloc(need, 1);
            if (!m) return KM_ENOMEM;
            free((void *)e->pick_mark);
            e->pick_mark = m, e->pick_cap = need;
        }
    }
    for (int i = 0; lanes && i < b->n_tokens; i++)
        for (int j = 0; j < i; j++)
            if (b->seqs[j] == b->seqs[i]) lanes = 0;
    const int n_exp = hp->n_expert;
    en_step st = {.e = e,
                  .b = b,
                  .n_out = n_out,
                  .lanes = lanes,
                  .n_runs = lanes ? 0 : en_att_runs(e, b, nth),
                  .route = b->route && n_exp,
                  .depth = b->depth != NULL,
                  .fetch = fetch != 0};
    for (int l = 0; b->depth && l < hp->n_layers; l++) {
        int nt = 0, nr = 0, nk = 0;
        while (nt < b->n_tokens && b->depth[nt] > l) nt++;
        while (nk < b->n_tokens && b->depth[nk] + (b->depth_kv != 0) > l) nk++;
        while (nr < st.n_runs && e->run0[nr] < nt) nr++;
        e->n_at[l] = nt, e->runs_at[l] = nr, e->n_at[hp->n_layers + l] = nk;
    }
    if (st.route) memset(e->route_w, 0, (size_t)b->n_tokens * n_exp * sizeof(float));
    kn_pool_run(e->pool, en_step_job, &st);
    e->steps++;
    if (e->sparse_idle || st.fetch) en_demote_idle(e, b, st.fetch);
    if (hp->f_logit_scale != 0.0f) { /* granite: ggml_scale by the inverse */
        const float s = 1.0f / hp->f_logit_scale;
        for (size_t j = 0; j < (size_t)n_out * hp->n_vocab; j++) e->logits[j] *= s;
    }
    for (int i = 0; b->route && i < b->n_tokens; i++) {
        int best = -1;
        for (int x = 0; x < n_exp; x++)
            if (best < 0 ||
                e->route_w[(size_t)i * n_exp + x] > e->route_w[(size_t)i * n_exp + best])
                best = x;
        b->route[i] = (int16_t)best;
    }
    if (logits) *logits = e->logits;
    return n_out;
}
