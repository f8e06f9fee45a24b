/*
 * worker.h — the kvmesh worker: a model replica (weights, tokenizer), the engine that runs its
 * forward pass over batches that mix many sequences, and the sampler.
 *
 * Contract:
 *  - wk_model_load validates the GGUF (architecture, every tensor's presence, type and shape)
 *    before anything runs; an unsupported or broken model is an error with a message, never a
 *    crash. Weights are used in place from the file's memory map.
 *  - wk_engine_step runs one forward pass over a batch whose tokens may belong to many sequences
 *    (prefill chunks and decodes together). Each token attends to its own sequence's positions
 *    [0, pos]; every position below pos must already be in that sequence's KV (from this step or
 *    an earlier one). The KV lives in kvshard pages (kvshard/kvshard.h); the engine only reserves
 *    pages for the positions it writes, and KM_ENOSPC from the store reaches the caller unchanged
 *    so a scheduler can preempt.
 *  - A step allocates nothing: all buffers are sized at wk_engine_create for max_batch_tokens.
 *  - The sampler's output for a sequence depends only on that sequence's logits, history, params
 *    and seed, never on what else is in the batch.
 */
#ifndef WK_WORKER_H
#define WK_WORKER_H

#include <stddef.h>
#include <stdint.h>

#include "common/km.h"
#include "kernels/kernels.h"
#include "kvshard/kvshard.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- model */

/* The most experts a MoE layer may have (llama.cpp's LLAMA_MAX_EXPERTS is larger; no model this
 * engine runs needs more). */
#define WK_MAX_EXPERTS 256

typedef struct wk_hparams {
    char arch[32]; /* "llama", "qwen2", ... */
    int n_layers;
    int n_embd;
    int n_ff; /* MoE: the width of one expert (llama.cpp's feed_forward_length) */
    int n_head;
    int n_head_kv;
    int head_dim;
    int n_rot;
    int n_vocab;
    int n_ctx_train;
    float norm_eps;
    float rope_base;
    int rope_neox;     /* 1: NeoX pairs (i, i+n/2), 0: normal pairs (2i, 2i+1) */
    int tied_output;   /* output projection reuses token_embd */
    int n_expert;      /* MoE FFN layers (Mixtral layout, docs/moe.md): experts; 0 = dense,
                          at most WK_MAX_EXPERTS */
    int n_expert_used; /* experts each token is routed to (top-k) */
    int moe_norm_w;    /* 1: the chosen experts' weights are divided by their sum (llama, mistral,
                          granitemoe); 0: the softmax probabilities as they are (qwen2moe, olmoe) */
    int n_ff_shexp;    /* width of the shared expert every token also runs (qwen2moe; granitemoe
                          when the GGUF has one); 0: none */
    int qk_norm;       /* olmoe: RMS norms over each token's whole q and k before rope */
    /* granitemoe's multipliers (llama.cpp's names; 0 = not applied): the token embeddings are
     * multiplied by embedding_scale, each attention and FFN output by residual_scale before its
     * residual add, attention scores by attention_scale instead of 1/sqrt(head_dim), and the
     * logits by 1/logit_scale. */
    float f_embedding_scale, f_residual_scale, f_attention_scale, f_logit_scale;
} wk_hparams;

typedef struct wk_model wk_model;

int wk_model_load(const char *path, wk_model **out, km_errbuf *err);
void wk_model_free(wk_model *m);
const wk_hparams *wk_model_hparams(const wk_model *m);
const km_tokenizer *wk_model_tokenizer(const wk_model *m);
const km_gguf *wk_model_gguf(const wk_model *m);
/* 128-bit fingerprint of the weights file (XXH3 over the header and a sample of the data),
 * hex-encoded into out[33]. Seeds the page-hash chain, so KV of one model never serves another. */
void wk_model_fingerprint_hex(const wk_model *m, char out[33]);
/* "SmolLM2-135M-Instruct.Q4_1" style display name. */
const char *wk_model_name(const wk_model *m);
/* Chat template family recognised from the model's metadata (km_chat_detect). */
km_chat_kind wk_model_chat_kind(const wk_model *m);
/* Default model path: $KVMESH_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf. */
const char *wk_default_model_path(void);

/* ---------------------------------------------------------------- engine */

typedef struct wk_engine_opts {
    int n_threads;        /* 0: all cores */
    int max_batch_tokens; /* tokens one step may carry; 0: 512 */
    size_t kv_bytes;      /* hot-tier KV budget; 0: enough for 4 x n_ctx 4096 */
    kv_format kv_format;  /* KN_KV_F16 by default */
    int page_tokens;      /* 0: 16 */
    /* Lower KV tiers and shards (kvshard/kvshard.h); zero/NULL: none, one shard. */
    size_t kv_host_bytes;    /* host-RAM tier budget */
    const char *kv_disk_dir; /* disk tier directory: pages survive restarts there */
    size_t kv_disk_bytes;    /* disk tier budget; 0 with a dir: 1 GiB */
    /* The cluster secret (KM_SECRET_BYTES, common/sec.h): disk pages carry a keyed MAC and one
     * without a valid MAC is dropped, never served (kv_config.disk_secret). NULL: checksum only. */
    const uint8_t *kv_disk_secret;
    int kv_shards;
    /* How pages are spread over the shards (kvshard.h): hash (default), or expert (MoE models
     * only: each full page goes to the shard of its tokens' dominant expert, wk_batch.route),
     * with PiKV's token and expert group counts (0: kv_shards). */
    kv_shard_key kv_shard_key;
    int kv_tok_groups, kv_expert_groups;
    int kv_arena; /* page memory in one arena (kv_config.arena): needed by a transfer node */
} wk_engine_opts;

typedef struct wk_engine wk_engine;

int wk_engine_create(const wk_model *m, const wk_engine_opts *opts, wk_engine **out,
                     km_errbuf *err);
void wk_engine_destroy(wk_engine *e);
kv_store *wk_engine_kv(wk_engine *e);
int wk_engine_threads(const wk_engine *e);
const char *wk_engine_isa(const wk_engine *e);

typedef struct wk_batch {
    int n_tokens;
    const int32_t *tokens; /* [n_tokens] */
    const int32_t *pos;    /* [n_tokens] position of each token in its sequence */
    kv_seq *const *seqs;   /* [n_tokens] the sequence each token belongs to */
    const uint8_t *logits; /* [n_tokens] 1 where the caller wants logits; NULL: last only */
    /* [n_tokens] out, or NULL: each token's dominant routed expert, the one with the largest
     * router weight summed over the MoE layers (its choices' renormalized weights; the lower id
     * on a tie); -1 for a dense model. What kvshard places the token's page by (kv_seq_place). */
    int16_t *route;
} wk_batch;

/* Runs the batch. On success *logits points to n_out rows of n_vocab floats (engine-owned,
 * valid until the next step), in the order of the tokens that asked for them, and the return
 * value is n_out. Negative km_err on failure (KM_ENOSPC: the KV store is full; nothing of the
 * batch was computed). */
int wk_engine_step(wk_engine *e, const wk_batch *b, const float **logits);

/* ---------------------------------------------------------------- sampler */

typedef struct wk_sample_params {
    float temperature;       /* <= 0: greedy */
    int top_k;               /* <= 0: off */
    float top_p;             /* >= 1: off */
    float min_p;             /* <= 0: off */
    float repeat_penalty;    /* 1: off; divides positive logits, multiplies negative ones */
    int repeat_last_n;       /* how much history the penalties see; 0: 64 */
    float presence_penalty;  /* subtracted once from every token seen */
    float frequency_penalty; /* subtracted per occurrence */
    uint64_t seed;
} wk_sample_params;

void wk_sample_params_default(wk_sample_params *p);

typedef struct wk_sampler wk_sampler;

int wk_sampler_create(const wk_sample_params *p, int n_vocab, wk_sampler **out);
void wk_sampler_destroy(wk_sampler *s);
/* Records a token into the penalty history (prompt tokens and every sampled token). */
void wk_sampler_accept(wk_sampler *s, int32_t token);
/* Advances the random draws as if n tokens had been sampled (a request continued after a
 * migration: its sampled tokens are the same as undisturbed). */
void wk_sampler_skip(wk_sampler *s, int n);
/* Picks the next token from one row of logits (the row is not modified). */
int32_t wk_sampler_sample(wk_sampler *s, const float *logits);

/* Negative log-probability of `target` under softmax(logits), in double precision (perplexity). */
double wk_token_nll(const float *logits, int n_vocab, int32_t target);

/* Index of the largest value (the lowest index among equals). */
int32_t wk_argmax(const float *x, int n);

#ifdef __cplusplus
}
#endif
#endif /* WK_WORKER_H */

/* ---------------------------------------------------------------- service
 * (its own guarded section: worker/service*.c, worker/main.c)
 *
 * wk_service_*: the daemon around the engine (ZeroMQ requests, KV events, admin commands,
 * heartbeats, metrics, /healthz, /readyz). It runs the scheduler (worker/scheduler.h, private to
 * worker/: iteration-level continuous batching with chunked prefill, prefix reuse, preemption and
 * speculative decoding), configured by wk_sched_opts below. docs/protocol.md is the wire
 * contract, docs/operations.md the operator's page.
 */
#ifndef WK_SERVICE_H
#define WK_SERVICE_H

#include "common/svc.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Exit status that asks the supervisor for a restart (drain, shutdown with restart). */
#define WK_EXIT_RESTART 75

/* Speculative decoding without a draft model (worker/spec.h, docs/speculative.md): drafts from
 * suffix matches over the request's own text and the tenant's earlier outputs, verified in one
 * step; the output is token for token what decoding without drafts gives. */
typedef enum wk_spec_mode {
    WK_SPEC_DEFAULT = 0, /* a request that does not say: the worker's mode */
    WK_SPEC_OFF = 1,
    WK_SPEC_AUTO = 2, /* draft when the step-cost budget says it pays */
    /* self-speculation (QuantSpec): the model drafts over a 4-bit copy of the request's KV and
     * verifies over the full pages; needs a draft engine (wk_sched_set_draft), else AUTO */
    WK_SPEC_SELF = 3,
} wk_spec_mode;

/* Self drafts stay inside the page being filled (scheduler_self.c): at most a page less one. */
#define WK_SELF_MAX_DRAFT 15

typedef struct wk_spec_opts {
    int mode;           /* the worker's default: WK_SPEC_OFF, _AUTO or _SELF (0: auto) */
    int max_draft;      /* draft tokens per request and step; 0: 16 (at most 64) */
    float factor;       /* draft length <= factor x match length; 0: 1.0 */
    float min_share;    /* a proposal stops at a token with a smaller share; 0: 0.1 */
    size_t index_bytes; /* the global suffix index's budget; 0: 32 MiB */
    int fail_limit;     /* verifications in a row with nothing accepted before backing off; 0: 3 */
    float token_cost;   /* per-token / base cost of a step assumed before measuring; 0: 0.25 */
    int lead_in;        /* prompt tokens indexed with an output in the global index; 0: 32 */
    int self_draft;     /* WK_SPEC_SELF: draft steps (tokens) per verification; 0: 3; at most
                         * WK_SELF_MAX_DRAFT */
} wk_spec_opts;

/* The scheduler's limits (worker/scheduler.h), part of the service's options. */
typedef struct wk_sched_opts {
    int max_running;        /* sequences in flight at once; 0: 64 */
    int max_queue;          /* requests waiting for a slot; 0: 1024 */
    int max_batch_tokens;   /* tokens per step; must not exceed the engine's; 0: 512 */
    int prefill_chunk;      /* most prompt tokens of one sequence per step; 0: max_batch_tokens */
    int decode_prefill;     /* most prompt tokens in a step that also decodes (bounds the
                             * inter-token latency of running sequences); 0: no extra cap */
    int step_budget_ms;     /* time one step should take at most: prefill chunks are sized to it
                             * from the measured cost of earlier steps (below); 0: no bound */
    int max_ctx;            /* prompt + completion per sequence; 0: 4096 */
    int default_max_tokens; /* when a request says 0; 0: 256 */
    double aging_per_s;     /* priority points a waiting request gains per second; 0: 20 */
    uint64_t cluster_seed;  /* page-hash chain seed (with the model fingerprint and cache_salt) */
    wk_spec_opts spec;      /* speculative decoding */
} wk_sched_opts;

typedef struct wk_service wk_service;

typedef struct wk_service_opts {
    const char *worker_id;   /* NULL: "worker-<pid>" */
    const char *listen;      /* requests/admin ROUTER endpoint; e.g. tcp://127.0.0.1:7100 */
    const char *events;      /* KV events PUB endpoint; NULL: none */
    const char *controller;  /* controller ROUTER to send heartbeats to; NULL: none */
    const char *admin_host;  /* admin HTTP host; NULL: 127.0.0.1 */
    int admin_port;          /* 0: ephemeral; -1: no admin HTTP */
    const char *model_alias; /* extra model name requests may use; NULL: none */
    const char *ports_file;  /* write the bound endpoints here once ready; NULL: none */
    int heartbeat_ms;        /* 0: 1000 */
    int drain_timeout_ms;    /* grace before in-flight requests are handed back; 0: 30000 */
    int event_replay;        /* KV events kept for replay; 0: 65536 */
    int max_frame;           /* bytes; 0: KM_PROTO_MAX_FRAME */
    bool chaos;              /* take the `pressure` admin command (fault injection; tests only) */
    /* CURVE (docs/security.md): the requests ROUTER admits members and operators, the events PUB
     * members, the controller DEALER pins the key "controller"; NULL or insecure: none. Owned by
     * the caller, outlives the service. */
    const km_zsec *sec;
    /* KV page transfer (docs/transfer.md); the engine's store needs kv_arena */
    const char *peer_listen;    /* "HOST:PORT" (port 0: ephemeral); NULL/empty: no transfer node */
    const char *peer_advertise; /* host peers connect to; NULL: 127.0.0.1 */
    const char *peer_mode;      /* "am" (default) or "get" */
    int peer_lease_ms;          /* how long offered pages stay pinned; 0: 10000 */
    int peer_pull_ms;           /* a pull's budget when the hint names none; 0: 2000 */
    /* the controller's view PUB (its --view): the peers a drain hands pages to; NULL: none */
    const char *peer_view;
    /* warm-up: pages a newly ready worker asks its peers for (0: none; < 0: a quarter of its
     * store) */
    int peer_warm_pages;
    /* leave the arena's pages to be faulted in as they are first written instead of making the
     * hot tier's share resident in the background (pr_config.prefault_bytes) */
    bool peer_no_prefault;
    /* self-speculation (sched.spec.mode WK_SPEC_SELF, worker/scheduler_self.c): the draft engine,
     * over the same model with an int4 store; owned by the caller, outlives the service. NULL:
     * requests asking for it draft from suffixes. */
    wk_engine *draft;
    wk_sched_opts sched;
} wk_service_opts;

int wk_service_create(wk_model *m, wk_engine *e, const wk_service_opts *o, wk_service **out,
                      km_errbuf *err);
void wk_service_destroy(wk_service *s);
/* Serves until shutdown or the end of a drain; returns the process exit status (0, or
 * WK_EXIT_RESTART). */
int wk_service_run(wk_service *s);
/* Async-signal-safe: SIGTERM/SIGINT begin a drain, a second one stops at once. */
void wk_service_signal(wk_service *s, int signo);

#ifdef __cplusplus
}
#endif
#endif /* WK_SERVICE_H */
