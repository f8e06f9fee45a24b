/*
 * scheduler_internal.h — what the scheduler's two files share: scheduler.c (requests, admission,
 * preemption, the step budget, building and running a step) and scheduler_spec.c (speculative
 * decoding's side of a step: drafts planned under the budget, verified against the step's
 * logits), scheduler_self.c (self-speculation's draft steps), scheduler_fair.c (the running
 * set shared between tenants) and scheduler_blend.c (chunks reused and stored). Private to worker/;
 * scheduler.h is the contract.
 */
#ifndef EN_SCHEDULER_INTERNAL_H
#define EN_SCHEDULER_INTERNAL_H

#include "engine/engine.h"
#include "engine/spec.h"

typedef struct en_rq {
    uint64_t rid;
    void *user;
    int32_t *tokens; /* prompt, then the completion; capacity n_prompt + max_gen */
    int n_tok, n_prompt, n_done, n_gen, max_gen;
    int plp_end, plp_done; /* prompt logprobs: of positions [1, plp_end), those up to plp_done
                            * reported; plp_end 0: none asked */
    int plp_top;           /* with this many alternatives */
    km_pagehash *hashes;   /* chain of the full pages among tokens */
    int n_hashed;
    int16_t *route; /* [capacity] each position's dominant expert (en_batch.route); NULL: none */
    int n_placed;   /* pages before this one are placed (kv_seq_place) or were attached */
    km_pagehash seed;
    kv_seq *seq; /* NULL while queued */
    en_sampler *smp;
    en_spec_seq *spec;      /* NULL: no speculation */
    en_grammar_matcher *gm; /* the output's grammar; NULL: free */
    int self;               /* drafts by self-speculation (scheduler_self.c) */
    kv_seq *shadow;         /* its 4-bit copy of seq in the draft store; NULL: none yet */
    int n_shadow;           /* positions of seq copied into shadow */
    int priority, ignore_eos, canceled, admitted, preemptions, cached_tokens;
    int sit_out; /* not in this step: another tenant's first token (scheduler_fair.c) */
    /* chunk reuse (scheduler_blend.c): the request's chunks; of them, those reused in this
     * attempt, and their prefill while it runs (bl: in pieces, en_sched_blend; NULL once done,
     * the rest of the prompt then prefilled by the batch); pages from publish_end on are never
     * published (approximate KV); chunks to store once the request ends */
    en_blend_seg *chunks, *reused;
    en_blend_run *bl;
    int n_chunks, n_reused, publish_end, chunk_tokens;
    uint64_t chunk_missed; /* bit c: chunk c was not held whole */
    uint64_t tenant;
    uint64_t arrival_ns, deadline_ns, admit_ns, first_ns;
} en_rq;

/* One sequence's part of the current batch. */
typedef struct en_part {
    en_rq *rq;
    int n;     /* tokens of this step */
    int want;  /* the last of them produces logits */
    int draft; /* of n, draft tokens after the sequence's token (all n produce logits) */
    int plp;   /* of n, the first tokens whose logits give prompt logprobs (rows before want's) */
} en_part;

/* One tenant's requests here (scheduler_fair.c): counted afresh at each step's admission. */
typedef struct en_tenant {
    uint64_t id;
    int running, queued;
} en_tenant;

/* The real engine behind en_sched_engine (en_sched_create). */
typedef struct en_real_engine {
    en_engine *e;
    const md_tokenizer *tok;
    en_engine *draft; /* en_sched_set_draft */
} en_real_engine;

struct en_sched {
    en_sched_engine eng;
    en_real_engine real; /* eng.ctx points here when created over a en_engine */
    kv_store *kv;
    en_sched_opts o;
    en_sched_cb cb;
    const en_logprobs *cur_lp; /* inside on_token: the token's (en_sched_logprobs) */
    int n_vocab, pt;
    int n_layers, kv_width, head_dim; /* KV heads per layer, floats per head */
    char fp[33];
    en_rq **run, **queue;
    int n_run, n_queue, queue_cap;
    int admit_blocked; /* set by a preemption, cleared when a sequence ends */
    uint64_t next_rid;
    /* per-step buffers, max_batch_tokens each */
    int32_t *b_tok, *b_pos;
    kv_seq **b_seq;
    uint8_t *b_want;
    int16_t *b_route; /* NULL unless pages are placed by expert (an MoE model, shard key expert) */
    en_part *parts;
    en_grammar_vocab *g_vocab; /* the model's vocabulary as a trie, made at the first grammar */
    uint32_t *g_mask;          /* the allowed tokens of the row being sampled */
    en_spec *spec;
    en_spec_seq **b_spec; /* [max_running] this step's proposals */
    /* self-speculation's draft steps: [max_running] each (scheduler_self.c) */
    en_rq **d_rq;
    int32_t *d_tok, *d_pos, *d_out, *d_cap;
    uint8_t *d_want; /* all 1: every draft token's logits */
    float *d_kv;     /* one position's K and V of one layer, read back for the 4-bit copy */
    kv_seq **d_seq;
    int *order; /* [max_running]: the order prefill chunks are taken in this step */
    /* step budget: work units per token, per attended position, per logits row */
    double u_tok, u_att, u_row;
    double step_units;  /* the units of the step being built */
    double blend_units; /* the units of this step's blend pieces, run before the batch */
    int step_prefill;   /* its prompt tokens */
    en_sched_stats st;
    /* tenants (scheduler_fair.c): those with requests here, [queue_cap]; and the last two
     * distinct tenants whose requests ended, newest first (end_ns 0: none) */
    en_tenant *tn;
    int n_tn;
    uint64_t fair_sat_out; /* the last step (1-based) the tenants at their share sat out */
    int fair_cap;          /* this step's most prompt tokens (0: no cap) */
    struct {
        uint64_t id, end_ns;
    } ended[2];
    /* chunk reuse (scheduler_blend.c): the preamble (one page; n_pre 0: no reuse), and the
     * chunks of ended requests still to compute and store, oldest first */
    int32_t *pre;
    int n_pre;
    struct en_chunk_job *jobs;
    int n_jobs, cap_jobs;
};

/* scheduler.c */
/* Publishes the full pages whose KV is computed (placing each by expert first, when asked). */
void en_rq_publish(en_sched *s, en_rq *r);
/* One sampled token: recorded and reported; 1 when the request is over (*fin says why). */
int en_rq_push(en_sched *s, en_rq *r, int32_t t, uint64_t now, km_finish *fin);
/* Ends a running request that is over. */
void en_rq_finish(en_sched *s, en_rq *r, km_finish fin);
/* r's next token from a row of logits, among those its grammar allows. */
int32_t en_rq_sample(en_sched *s, en_rq *r, const float *row);

/* The most prompt tokens of r this step may still take within the step budget (at least a
 * page, or what is left), take at most. */
int en_budget_take(en_sched *s, const en_rq *r, int take);
/* Work units of n prompt tokens at positions [pos, pos + n), with one logits row when want. */
double en_units(const en_sched *s, int pos, int n, int want);
/* The units the step budget leaves after the step's blend pieces and its batch so far; INFINITY
 * without a budget or before the cost per unit is learned. */
double en_budget_room(const en_sched *s);
/* Folds one measured cost per unit (ns) into the estimate the budget uses: up fast, down slowly. */
void en_sched_learn_cost(en_sched *s, double per);

/* Sends running sequence i back to the queue; its published pages stay cached. */
void en_rq_requeue(en_sched *s, int i);

/* scheduler_fair.c */
/* Counts each tenant's running and queued requests (s->tn) for this step's admission. */
void en_fair_count(en_sched *s);
/* The entry of tenant id in s->tn (counted by en_fair_count: present for every request here). */
en_tenant *en_fair_of(en_sched *s, uint64_t id);
/* Is t at its share while another tenant is active: admit none of its requests. */
int en_fair_held(const en_sched *s, const en_tenant *t, uint64_t now);
/* Sends the newest running sequences of each tenant over its share back to the queue. */
void en_fair_yield(en_sched *s, uint64_t now);
/* Before a step is planned: marks the running sequences that sit it out for a newcomer's first
 * token (en_rq.sit_out) and sets the cap on its prompt tokens (fair_cap). */
void en_fair_step(en_sched *s);
/* A request of tenant id ended at now: its tenant stays active for the linger. */
void en_fair_ended(en_sched *s, uint64_t id, uint64_t now);

/* scheduler_spec.c */
/* Proposes drafts for the decoding sequences and lets the budget grant them room. */
void en_sched_plan(en_sched *s);
/* A sequence's token and drafts came back with logits at every position: keep what matches. */
void en_sched_verify(en_sched *s, const en_part *p, const float *rows, uint64_t now);

/* scheduler_blend.c */
/* The preamble from the model's tokenizer (en_sched_create): 0, or KM_ENOMEM. */
int en_blend_setup(en_sched *s, const en_hparams *hp);
/* Frees the preamble and the store jobs. */
void en_blend_teardown(en_sched *s);
/* A submitted request's chunks, checked and copied: 0 or KM_EINVAL / KM_ENOMEM. */
int en_rq_chunks(en_sched *s, en_rq *r, const en_sched_req *q);
/* At a first admission, after the prefix attach: the chunks the store holds, copied into r's
 * sequence (r->blend set when any was). */
void en_rq_blend_attach(en_sched *s, en_rq *r);
/* Runs the next piece of each running sequence's blend prefill, each as much as a prefill
 * chunk of its own could take in this step; returns the work run in tokens through every
 * layer (token-layers over layers, rounded up). */
int en_sched_blend(en_sched *s);
/* A request ended: its missing chunks are queued to be stored. */
void en_rq_blend_ended(en_sched *s, const en_rq *r);
/* Stores one queued chunk (between steps): 1 when one was, else 0. */
int en_sched_blend_store(en_sched *s);

/* scheduler_self.c */
/* Drafts for the n self-speculating decoders s->d_rq, at most s->d_cap[i] tokens each: their
 * 4-bit copies caught up with their KV, then one draft step per token; the drafts are set as
 * their proposals. Returns the draft tokens made. */
int en_sched_self_draft(en_sched *s, int n);
/* Frees a request's 4-bit copy (its KV went away, or it ends). */
void en_rq_drop_shadow(en_sched *s, en_rq *r);

#endif
