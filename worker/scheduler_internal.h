/*
 * scheduler_internal.h — what the scheduler's two files share: scheduler.c (requests, admission,
 * preemption, the step budget, building and running a step) and scheduler_spec.c (speculative
 * decoding's side of a step: drafts planned under the budget, verified against the step's
 * logits). Private to worker/; scheduler.h is the contract.
 */
#ifndef WK_SCHEDULER_INTERNAL_H
#define WK_SCHEDULER_INTERNAL_H

#include "worker/scheduler.h"
#include "worker/spec.h"

typedef struct wk_rq {
    uint64_t rid;
    void *user;
    int32_t *tokens; /* prompt, then the completion; capacity n_prompt + max_gen */
    int n_tok, n_prompt, n_done, n_gen, max_gen;
    km_pagehash *hashes; /* chain of the full pages among tokens */
    int n_hashed;
    int16_t *route; /* [capacity] each position's dominant expert (wk_batch.route); NULL: none */
    int n_placed;   /* pages before this one are placed (kv_seq_place) or were attached */
    km_pagehash seed;
    kv_seq *seq; /* NULL while queued */
    wk_sampler *smp;
    wk_spec_seq *spec; /* NULL: no speculation */
    int self;          /* drafts by self-speculation (scheduler_self.c) */
    kv_seq *shadow;    /* its 4-bit copy of seq in the draft store; NULL: none yet */
    int n_shadow;      /* positions of seq copied into shadow */
    int priority, ignore_eos, canceled, admitted, preemptions, cached_tokens;
    uint64_t arrival_ns, deadline_ns, admit_ns, first_ns;
} wk_rq;

/* One sequence's part of the current batch. */
typedef struct wk_part {
    wk_rq *rq;
    int n;     /* tokens of this step */
    int want;  /* the last of them produces logits */
    int draft; /* of n, draft tokens after the sequence's token (all n produce logits) */
} wk_part;

/* The real engine behind wk_sched_engine (wk_sched_create). */
typedef struct wk_real_engine {
    wk_engine *e;
    const km_tokenizer *tok;
    wk_engine *draft; /* wk_sched_set_draft */
} wk_real_engine;

struct wk_sched {
    wk_sched_engine eng;
    wk_real_engine real; /* eng.ctx points here when created over a wk_engine */
    kv_store *kv;
    wk_sched_opts o;
    wk_sched_cb cb;
    int n_vocab, pt;
    int n_layers, kv_width, head_dim; /* KV heads per layer, floats per head */
    char fp[33];
    wk_rq **run, **queue;
    int n_run, n_queue, queue_cap;
    int admit_blocked; /* set by a preemption, cleared when a sequence ends */
    uint64_t next_rid;
    /* per-step buffers, max_batch_tokens each */
    int32_t *b_tok, *b_pos;
    kv_seq **b_seq;
    uint8_t *b_want;
    int16_t *b_route; /* NULL unless pages are placed by expert (an MoE model, shard key expert) */
    wk_part *parts;
    wk_spec *spec;
    wk_spec_seq **b_spec; /* [max_running] this step's proposals */
    /* self-speculation's draft steps: [max_running] each (scheduler_self.c) */
    wk_rq **d_rq;
    int32_t *d_tok, *d_pos, *d_out, *d_cap;
    uint8_t *d_want; /* all 1: every draft token's logits */
    float *d_kv;     /* one position's K and V of one layer, read back for the 4-bit copy */
    kv_seq **d_seq;
    int *order; /* [max_running]: the order prefill chunks are taken in this step */
    /* step budget: work units per token, per attended position, per logits row */
    double u_tok, u_att, u_row;
    double step_units; /* the units of the step being built */
    int step_prefill;  /* its prompt tokens */
    wk_sched_stats st;
};

/* scheduler.c */
/* Publishes the full pages whose KV is computed (placing each by expert first, when asked). */
void wk_rq_publish(wk_sched *s, wk_rq *r);
/* One sampled token: recorded and reported; 1 when the request is over (*fin says why). */
int wk_rq_push(wk_sched *s, wk_rq *r, int32_t t, uint64_t now, km_finish *fin);
/* Ends a running request that is over. */
void wk_rq_finish(wk_sched *s, wk_rq *r, km_finish fin);

/* scheduler_spec.c */
/* Proposes drafts for the decoding sequences and lets the budget grant them room. */
void wk_sched_plan(wk_sched *s);
/* A sequence's token and drafts came back with logits at every position: keep what matches. */
void wk_sched_verify(wk_sched *s, const wk_part *p, const float *rows, uint64_t now);

/* scheduler_self.c */
/* Drafts for the n self-speculating decoders s->d_rq, at most s->d_cap[i] tokens each: their
 * 4-bit copies caught up with their KV, then one draft step per token; the drafts are set as
 * their proposals. Returns the draft tokens made. */
int wk_sched_self_draft(wk_sched *s, int n);
/* Frees a request's 4-bit copy (its KV went away, or it ends). */
void wk_rq_drop_shadow(wk_sched *s, wk_rq *r);

#endif
