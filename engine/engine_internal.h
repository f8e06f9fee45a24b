/*
 * engine_internal.h — the inside of en_engine, shared by engine.c (the forward pass) and
 * engine_moe.c (the FFN of MoE layers). Private to worker/.
 */
#ifndef EN_ENGINE_INTERNAL_H
#define EN_ENGINE_INTERNAL_H

#include <stdatomic.h>

#include "engine/model_internal.h"

/* Batches of at most this many tokens (at most one per thread, one per sequence) run in lanes. */
#define EN_LANE_TOKENS 4
/* Attention takes consecutive tokens of one sequence (a prefill chunk, a verification) in runs of
 * at most this many: kn_ops.attention_multi walks the sequence's pages once per run. */
#define EN_ATT_RUN 8

/* One thread's copies of the token-wise buffers, for lane mode. */
typedef struct en_lane_bufs {
    float *x, *xn, *act;
    uint8_t *xq;
    int32_t *sel; /* MoE: the routing of every token and the gathered rows, this thread's copy */
    float *rw;
    uint8_t *xqg;
    float *shw;                      /* MoE: each token's shared-expert gate */
    kn_sparse_scratch sparse;        /* sparse attention's room (opts.sparse_attn) */
    uint64_t sparse_sel, sparse_all; /* pages attended, and in the views, by sparse attention */
    int *defer; /* P4 items this thread put off while their pages come up (en_step_job) */
} en_lane_bufs;

struct en_moe_scr;

struct en_engine {
    const en_model *m;
    const kn_ops *ops;
    int packed; /* the model's matrices are packed for ops: multiply by the packed copies */
    kn_pool *pool;
    kv_store *kv;
    int max_tokens;
    size_t xq_row_bytes; /* stride of xq rows: the largest dot-type row any weight needs */
    float attn_scale;    /* attention score scale: 1/sqrt(head_dim), or granite's attention.scale */
    float *x, *xn, *q, *k, *v, *att, *tmp, *gate, *up, *rope_cs, *logits;
    uint8_t *xq;
    int32_t *out_idx;
    int32_t *run0, *run_n; /* this step's attention runs: first token, tokens (not lanes) */
    en_lane_bufs *lanes;   /* [threads] */
    /* MoE (NULL for a dense model): each token's experts and weights [T][k], the quantized rows
     * gathered per slot [T*k], the experts' outputs per slot [T*k][embd], per-thread scratch */
    int32_t *sel;
    float *rw, *moe_out;
    uint8_t *xqg;
    struct en_moe_scr *moe; /* [threads] */
    float *route_w; /* [T][n_expert]: router weight summed over the layers (en_batch.route) */
    /* the shared expert (hp.n_ff_shexp > 0): each token's gate [T], gate and up [T][n_ff_shexp] */
    float *shw, *sh_gate, *sh_up;
    /* sparse attention (en_engine_opts.sparse_attn): the page choice, from layer sparse_from */
    kn_sparse_cfg sparse;
    int sparse_on, sparse_from, page_tokens;
    kn_sparse_cfg shallow; /* layers below sparse_from (opts.sparse_shallow_attn) */
    int shallow_on, shallow_tokens;
    /* per-(layer, kv head) budgets (opts.sparse_shares, engine/sparse_budget.c): the shares and
     * the page choice of each head of the sparse layers, [n_layers * n_head_kv]; NULL: uniform */
    float *shares;
    kn_sparse_cfg *head_cfg;
    /* the head probe (opts.head_probe_from): each thread's room and sums */
    int probe_from, probe_cap;
    struct en_probe_lane *probe;
    int sparse_dense; /* en_engine_set_sparse(e, 0): summaries kept, attention dense */
    int attn_timer;   /* opts.attn_timer: thread 0 adds its attention phases' CPU time here */
    uint64_t attn_ns;
    /* en_batch.depth: [n_layers] the tokens computed in each layer (a prefix of the batch) and
     * the attention runs they make up (a prefix of run0/run_n); n_at[n_layers + l]: the tokens
     * that write layer l's K/V (more than n_at[l] with en_batch.depth_kv) */
    int *n_at, *runs_at;
    /* [runs][sparse scratch cap]: the pages each run reads in a layer, marked by every thread
     * (en_fetch_picks), listed and cleared by thread 0 (en_fetch_layer); grown by the step */
    _Atomic uint8_t *pick_mark;
    size_t pick_cap;
    /* [max_tokens * n_kv_heads]: the pages a fetch's pick chose for (token, kv head), kept for
     * that layer's attention (pick_sel, pick_stride ints each; pick_n of them), valid while
     * pick_at equals the step's and layer's stamp (steps * n_layers + layer + 1) */
    int *pick_sel, *pick_n, pick_stride;
    uint64_t *pick_at, steps;
    int *fetch_list;
    uint64_t fetches, pages_fetched, pages_wanted;
    int sparse_idle;    /* en_engine_opts.sparse_idle resolved: 0 never */
    kv_seq **idle_seqs; /* [max_tokens] a step's distinct sequences (en_demote_idle) */
};

/* engine/sparse_budget.c: the heads' budgets from e->shares around the mean e->sparse (0 or
 * KM_ENOMEM); the head probe's room (cap pages a view) and its measure of one dense attention. */
int en_sparse_head_budgets(en_engine *e);
int en_probe_alloc(en_engine *e, int threads, int cap);
void en_probe_free(en_engine *e, int threads);
void en_probe_attention(const en_engine *e, const kn_kv_view *view, const kv_seq *seq, int l, int h,
                        const float *q, int ith);

/* What one step's job needs; lives on the caller's stack for the duration of kn_pool_run. */
typedef struct en_step {
    en_engine *e;
    const en_batch *b;
    int n_out;
    int lanes;  /* small batch: token phases on every thread, no barrier after them */
    int n_runs; /* attention runs in e->run0/run_n (not lanes) */
    int route;  /* sum the routing into route_w (the batch asks for en_batch.route) */
    int depth;  /* the batch has en_batch.depth: e->n_at/runs_at hold each layer's share */
    int fetch;  /* a sequence of the batch has pages not hot: each layer fetches what it reads */
} en_step;

/* Output rows of several matrices sharing one input are split as one range across threads, in
 * chunks of KN_PACK_ALIGN rows of each matrix, so that every range starts where a kernel panel
 * does (matmul_packed requires it) and a thread's rows of one matrix are contiguous. */
typedef struct en_mm {
    const en_weight *w;
    float *y;
    size_t y_stride;
    const en_weight *bias;
    const uint8_t *xq; /* this matrix's own input rows and their count (MoE experts); NULL, 0: */
    int m;             /* the group's */
} en_mm;

/* 64-byte aligned buffer (free with free()); NULL when out of memory. */
void *en_alloc(size_t n);
/* Quantizes rows [lo, hi) of src (row length w->k) into xq for the weight's dot type. */
void en_quantize_rows(const en_engine *e, const en_weight *w, const float *src, uint8_t *xq,
                      int64_t lo, int64_t hi);
/* This thread's share of the output rows of n_mm matrices over m input rows of xq. */
void en_matmul_group(const en_engine *e, const uint8_t *xq, const en_mm *mm, int n_mm, int m,
                     int ith, int nth);
/* x += y over n_embd, y scaled first by granite's residual_scale when the model has one. */
void en_residual_add(const en_engine *e, float *x, const float *y);

/* engine_moe.c: the MoE buffers of an engine (per-thread scratch for nth threads), and the
 * FFN of MoE layer L for this thread over the layer's first n tokens (fewer than the batch's
 * past a token's en_batch.depth; see engine_moe.c). */
int en_moe_alloc(en_engine *e, int nth);
void en_moe_free(en_engine *e);
void en_moe_ffn(const en_step *st, const en_layer *L, int n, int ith, int nth, int64_t t0,
                int64_t t1, float *x, float *xn, float *act, uint8_t *xq);

#endif
