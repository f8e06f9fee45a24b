/*
 * scheduler.h — the worker's scheduler, private to worker/ (service*.c and its tests use it; the
 * daemon's options for it, wk_sched_opts, are in worker.h).
 *
 * wk_sched_*: iteration-level continuous batching over one engine. Every step mixes the decode
 * token of each running sequence with prefill chunks of the others under a per-step token
 * budget. At admission only the prompt tokens kvshard does not already hold (verified prefix
 * hit) are computed. When the KV store is full the scheduler preempts the lowest-priority,
 * most recently admitted sequence: its full pages are published (so they stay cached, and the
 * store demotes them to a lower tier when it needs room) and it is requeued to be recomputed from
 * what is still cached; a lone sequence that cannot fit fails with an error, nothing crashes.
 * With a step budget, no step is planned to take longer than it: the scheduler measures what each
 * step costs and sizes prefill chunks so the next one fits (a long prompt late in its context
 * costs more per token, since every token attends to all before it). Requests are admitted by
 * priority plus an aging credit for time waited (no starvation), can carry a deadline, and can
 * be canceled. Outputs leave through callbacks called from
 * wk_sched_step on the caller's thread. A step allocates nothing.
 */
#ifndef WK_SCHEDULER_H
#define WK_SCHEDULER_H

#include "worker/worker.h"

typedef struct wk_sched wk_sched;

typedef struct wk_sched_req {
    const int32_t *tokens; /* the prompt (copied) */
    int n_tokens;
    wk_sample_params sample;
    int max_tokens;         /* 0: default_max_tokens; clipped to max_ctx */
    int priority;           /* higher first */
    uint64_t deadline_ns;   /* absolute km_now_ns(); 0: none */
    uint64_t arrival_ns;    /* when the request arrived; 0: now */
    const char *cache_salt; /* NULL: none */
    size_t cache_salt_len;
    int ignore_eos;  /* keep going past end-of-generation tokens */
    int speculate;   /* wk_spec_mode; 0: the worker's */
    int max_draft;   /* draft tokens per step at most; 0: the worker's (never more) */
    int n_generated; /* the last n_generated prompt tokens were sampled by an earlier attempt
                      * (a migration): the sampler's draws continue after them */
    void *user;      /* handed back to every callback */
} wk_sched_req;

typedef struct wk_sched_usage {
    int prompt_tokens, cached_tokens, completion_tokens, preemptions;
    int draft_tokens, accepted_draft_tokens; /* drafted and verified / kept (of completion) */
    double queue_ms, ttft_ms, total_ms;
} wk_sched_usage;

typedef struct wk_sched_cb {
    /* A new token (index counts from 0). Return 1 to end the request with KM_FINISH_STOP (a stop
     * string matched), 0 to go on. */
    int (*on_token)(void *ctx, void *user, int index, int32_t token);
    /* The request ended normally; user is not used again. */
    void (*on_done)(void *ctx, void *user, km_finish finish, const wk_sched_usage *u);
    /* The request failed (code: km_proto_code) or was handed back; user is not used again. */
    void (*on_error)(void *ctx, void *user, int code, const char *message, const wk_sched_usage *u);
    void *ctx;
} wk_sched_cb;

typedef struct wk_sched_stats {
    int running, queued;
    double step_ms_max;  /* the longest step so far */
    double ns_per_unit;  /* the measured cost of one unit of step work (0: none measured yet) */
    uint64_t budget_cut; /* prefill chunks the step budget made shorter */
    uint64_t steps, prefill_tokens, decode_tokens, prompt_tokens, cached_tokens, preemptions,
        recomputed_tokens, completed, canceled, deadline, failed, engine_errors,
        kv_full; /* requests handed back (503) because pinned pages left no room: transient */
    /* Speculative decoding: draft tokens verified, kept and thrown away; verification steps of
     * a request (mean accepted length = spec_accepted / spec_verifies); back-offs. */
    uint64_t spec_drafted, spec_accepted, spec_rejected, spec_verifies, spec_backoffs;
} wk_sched_stats;

/* What the scheduler needs of an engine and its model. wk_sched_create fills it from a wk_engine
 * and its wk_model; tests/unit/test_scheduler_fake.c puts a fake engine behind it, so budgets,
 * chunking and preemption are tested without the model file. */
typedef struct wk_sched_engine {
    kv_store *kv;            /* the store the engine keeps the batch's KV in */
    const wk_hparams *hp;    /* shapes: n_vocab (a logits row's floats) and what a step's work
                              * is counted in (the step budget's units); read at create */
    const char *fingerprint; /* the model's, as wk_model_fingerprint_hex: seeds page hashes */
    /* As wk_engine_step: n_out rows of logits, or a negative km_err (KM_ENOSPC: the KV store is
     * full and nothing of the batch was computed). */
    int (*step)(void *ctx, const wk_batch *b, const float **logits);
    /* Non-zero when `token` ends generation (km_tok_is_eog). */
    int (*is_eog)(void *ctx, int32_t token);
    void *ctx;
    /* Self-speculation (WK_SPEC_SELF, scheduler_self.c): a second engine over the same model
     * whose store (draft_kv, int4) holds a 4-bit copy of each drafting sequence's KV; its steps
     * as `step`. NULL: requests that ask for it draft from suffixes (WK_SPEC_AUTO). */
    kv_store *draft_kv;
    int (*draft_step)(void *ctx, const wk_batch *b, const float **logits);
} wk_sched_engine;

int wk_sched_create(wk_engine *e, const wk_model *m, const wk_sched_opts *o, const wk_sched_cb *cb,
                    wk_sched **out, km_errbuf *err);
/* The same over any engine behind the interface above (copied; its ctx must outlive the
 * scheduler). */
int wk_sched_create_on(const wk_sched_engine *eng, const wk_sched_opts *o, const wk_sched_cb *cb,
                       wk_sched **out, km_errbuf *err);
/* A scheduler made by wk_sched_create drafts WK_SPEC_SELF requests with draft, an engine over
 * the same model with an int4 store (kv_format KN_KV_INT4), which must outlive it. Before the
 * first submit. */
void wk_sched_set_draft(wk_sched *s, wk_engine *draft);
/* Frees everything; requests still held get no callback. */
void wk_sched_destroy(wk_sched *s);
/* Queues a request; *rid (may be NULL) identifies it for wk_sched_cancel. KM_EOVERLOAD when the
 * queue is full, KM_ERANGE when the prompt leaves no room in max_ctx, KM_EINVAL on a token
 * outside the vocabulary. No callback is called for a refused request. */
int wk_sched_submit(wk_sched *s, const wk_sched_req *r, uint64_t *rid);
/* Ends the request with KM_FINISH_CANCELED at the next step; KM_ENOTFOUND if it is not held. */
int wk_sched_cancel(wk_sched *s, uint64_t rid);
/* One iteration: expiries and cancellations, admission, one engine step, sampling, callbacks.
 * Returns the number of tokens computed (0: nothing to do) or a negative km_err. */
int wk_sched_step(wk_sched *s);
/* Requests held (running + queued). */
int wk_sched_pending(const wk_sched *s);
/* Ends every held request with on_error(code, message) after publishing its computed pages, so
 * whoever retries it elsewhere or later finds them cached (drain, shutdown). */
void wk_sched_abort_all(wk_sched *s, int code, const char *message);
void wk_sched_stats_get(const wk_sched *s, wk_sched_stats *out);

#endif
