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

typedef struct wk_hparams {
    char arch[32];      /* "llama", "qwen2", ... */
    int n_layers;
    int n_embd;
    int n_ff;
    int n_head;
    int n_head_kv;
    int head_dim;
    int n_rot;
    int n_vocab;
    int n_ctx_train;
    float norm_eps;
    float rope_base;
    int rope_neox;      /* 1: NeoX pairs (i, i+n/2), 0: normal pairs (2i, 2i+1) */
    int tied_output;    /* output projection reuses token_embd */
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
    int n_threads;         /* 0: all cores */
    int max_batch_tokens;  /* tokens one step may carry; 0: 512 */
    size_t kv_bytes;       /* hot-tier KV budget; 0: enough for 4 x n_ctx 4096 */
    kv_format kv_format;   /* KN_KV_F16 by default */
    int page_tokens;       /* 0: 16 */
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
    const int32_t *tokens;     /* [n_tokens] */
    const int32_t *pos;        /* [n_tokens] position of each token in its sequence */
    kv_seq *const *seqs;       /* [n_tokens] the sequence each token belongs to */
    const uint8_t *logits;     /* [n_tokens] 1 where the caller wants logits; NULL: last only */
} wk_batch;

/* Runs the batch. On success *logits points to n_out rows of n_vocab floats (engine-owned,
 * valid until the next step), in the order of the tokens that asked for them, and the return
 * value is n_out. Negative km_err on failure (KM_ENOSPC: the KV store is full; nothing of the
 * batch was computed). */
int wk_engine_step(wk_engine *e, const wk_batch *b, const float **logits);

/* ---------------------------------------------------------------- sampler */

typedef struct wk_sample_params {
    float temperature;     /* <= 0: greedy */
    int top_k;             /* <= 0: off */
    float top_p;           /* >= 1: off */
    float min_p;           /* <= 0: off */
    float repeat_penalty;  /* 1: off; divides positive logits, multiplies negative ones */
    int repeat_last_n;     /* how much history the penalties see; 0: 64 */
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
/* Picks the next token from one row of logits (the row is not modified). */
int32_t wk_sampler_sample(wk_sampler *s, const float *logits);

/* Index of the largest value (the lowest index among equals). */
int32_t wk_argmax(const float *x, int n);

#ifdef __cplusplus
}
#endif
#endif /* WK_WORKER_H */
