/*
 * engine.h — the inference engine, a library with no sockets: a model replica (weights and
 * tokenizer), the forward pass over batches that mix many sequences (dense and MoE), the sampler,
 * the scheduler (iteration-level continuous batching) and speculative decoding. The worker daemon
 * (worker/) runs it behind its sockets; `kvmesh run`, `perplexity` and `bench` run it directly.
 *
 * Contract:
 *  - en_model_load validates the GGUF (architecture, every tensor's presence, type and shape)
 *    before anything runs; an unsupported or broken model is an error with a message, never a
 *    crash. Weights are used in place from the file's memory map.
 *  - en_engine_step runs one forward pass over a batch whose tokens may belong to many sequences
 *    (prefill chunks and decodes together). Each token attends to its own sequence's positions
 *    [0, pos]; every position below pos must already be in that sequence's KV (from this step or
 *    an earlier one). The KV lives in kvshard pages (kvshard/kvshard.h); the engine only reserves
 *    pages for the positions it writes, and KM_ENOSPC from the store reaches the caller unchanged
 *    so a scheduler can preempt.
 *  - A step allocates nothing: all buffers are sized at en_engine_create for max_batch_tokens.
 *  - The sampler's output for a sequence depends only on that sequence's logits, history, params
 *    and seed, never on what else is in the batch.
 *  - The scheduler (en_sched_*) calls its engine, and its callbacks, only from en_sched_step (its
 *    callbacks also from en_sched_prepare) on the caller's thread; a step allocates nothing.
 *    Speculative decoding never changes the output: drafts are verified token for token.
 *  - Links only model/, kvshard/, kernels/ and common/ (make check-links): no ZeroMQ, no UCX.
 */
#ifndef EN_ENGINE_H
#define EN_ENGINE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/km.h"
#include "common/proto.h"
#include "kernels/kernels.h"
#include "kvshard/kvshard.h"
#include "model/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- model */

/* The most experts a MoE layer may have (llama.cpp's LLAMA_MAX_EXPERTS is larger; no model this
 * engine runs needs more). */
#define EN_MAX_EXPERTS 256

typedef struct en_hparams {
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
                          at most EN_MAX_EXPERTS */
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
} en_hparams;

typedef struct en_model en_model;

int en_model_load(const char *path, en_model **out, km_errbuf *err);
void en_model_free(en_model *m);
const en_hparams *en_model_hparams(const en_model *m);
const md_tokenizer *en_model_tokenizer(const en_model *m);
const md_gguf *en_model_gguf(const en_model *m);
/* 128-bit fingerprint of the weights file (XXH3 over the header and a sample of the data),
 * hex-encoded into out[33]. Seeds the page-hash chain, so KV of one model never serves another. */
void en_model_fingerprint_hex(const en_model *m, char out[33]);
/* "SmolLM2-135M-Instruct.Q4_1" style display name. */
const char *en_model_name(const en_model *m);
/* Chat template family recognised from the model's metadata (md_chat_detect). */
md_chat_kind en_model_chat_kind(const en_model *m);
/* Default model path: $KVMESH_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf. */
const char *en_default_model_path(void);

/* ---------------------------------------------------------------- engine */

typedef struct en_engine_opts {
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
     * only: each full page goes to the shard of its tokens' dominant expert, en_batch.route),
     * with PiKV's token and expert group counts (0: kv_shards). */
    kv_shard_key kv_shard_key;
    int kv_tok_groups, kv_expert_groups;
    int kv_arena; /* page memory in one arena (kv_config.arena): needed by a transfer node */
    /* Sparse decode attention (docs/sparse.md): tokens each (layer, kv head) attends to at most,
     * in whole pages chosen by their key summaries' bound on q·k, the first page and the last
     * two always among them; 0: off (dense). sparse_dense_layers: the first layers attend
     * densely all the same (0: 2; -1: none). With sparse attention on, a cached prefix on host
     * RAM or disk stays there when a request attaches it: a step brings up only the pages it
     * reads (kv_config.promote_selected, kv_seq_fetch). */
    int sparse_attn;
    int sparse_dense_layers;
    int sparse_window; /* recent pages always attended (the partial last one among them); 0: 2 */
    /* Budget of the first sparse_dense_layers layers: they attend sparsely within this many
     * tokens instead of densely (a per-layer schedule: more in the first layers); 0: dense. */
    int sparse_shallow_attn;
    /* Steps a held hot page of a sparse sequence may go unread before it goes back down to host
     * RAM or disk while the hot tier is above its low watermark (kv_seq_demote_idle); 0: 16;
     * -1: never (pages brought up stay hot while their sequence holds them); never either
     * without a host or disk tier (nothing could go down). */
    int sparse_idle;
    /* Layer slices a step may read of a held page on host RAM (in place) or disk (that layer
     * alone, kv_config.fetch_slices) before the page comes up whole: 0: n_layers (a page comes
     * up once its slices have cost a page); -1: whole at its first read. */
    int sparse_slices;
    /* How pages are ranked: q·centre + sparse_radius * |q|·spread of their key summaries
     * (kn_ops.page_scores); 1 is Quest's upper bound of q·k; 0: the measured default. */
    float sparse_radius;
    /* Budget shares per (layer, kv head), [n_layers * n_head_kv] layer-major, >= 0, copied
     * (docs/sparse.md "Per-head budgets"; en_sparse_shares_load reads them from a file). The
     * sparse layers' (layer, kv head) budgets are spread in proportion to their shares, their
     * mean still sparse_attn tokens; a head's budget is at least its sink and window pages.
     * NULL: every (layer, kv head) within sparse_attn. */
    const float *sparse_shares;
    /* > 0: every token at a position >= this attends densely and measures, per (layer, kv head),
     * where its attention mass lies (en_engine_head_probe): for `kvmesh sparse-calibrate`. */
    int head_probe_from;
    /* Thread 0 measures its CPU time in each layer's attention phases (rope, K/V writes,
     * summaries, fetches, attention: en_sparse_stats.attn_ns), for benchmarks. */
    int attn_timer;
} en_engine_opts;

typedef struct en_engine en_engine;

int en_engine_create(const en_model *m, const en_engine_opts *opts, en_engine **out,
                     km_errbuf *err);
void en_engine_destroy(en_engine *e);
kv_store *en_engine_kv(en_engine *e);
int en_engine_threads(const en_engine *e);
/* Sparse attention's counts since create, over every (token, layer, kv head) that attended
 * sparsely: pages attended, pages of their views left out; and the step phases that brought
 * up pages not hot (kv_seq_fetch calls, pages they brought up). */
typedef struct en_sparse_stats {
    uint64_t pages_selected, pages_skipped, fetches, pages_fetched;
    uint64_t
        pages_wanted; /* pages the fetch phases asked for: pages_fetched of them were not hot */
    uint64_t attn_ns; /* en_engine_opts.attn_timer: thread 0's CPU time in attention phases */
} en_sparse_stats;
void en_engine_sparse_stats(const en_engine *e, en_sparse_stats *out);
/* Sets the sparse budget (tokens, as en_engine_opts.sparse_attn) of an engine created with
 * sparse attention on; 0 attends densely while its pages keep their summaries (so a bench can
 * prefill once and decode from the same KV in several modes). Between steps only. KM_EINVAL
 * on an engine created dense. */
int en_engine_set_sparse(en_engine *e, int tokens);
/* The sparse budget in pages of (layer, kv head) now; 0 for a layer that attends densely. */
int en_engine_sparse_budget(const en_engine *e, int layer, int kv_head);

/* What the head probe (en_engine_opts.head_probe_from) measured over its tokens, per (layer, kv
 * head), layer-major: the mean share of the attention (averaged over the head's query heads) on
 * the sink page and the recent window (EN_PROBE_SINK, EN_PROBE_WINDOW pages); in rank[lh *
 * max_pages + k] the mean share on the k-th heaviest of the other pages (k < max_pages); in
 * found[lh * max_pages + k] (may be NULL; zeros unless the engine was created sparse, its
 * summaries kept, and set dense: en_engine_set_sparse(e, 0)) the mean share on the page its
 * summaries rank k-th, as a sparse step would pick. Returns the tokens measured, or KM_EINVAL
 * without a probe. */
#define EN_PROBE_SINK   1
#define EN_PROBE_WINDOW 2
int64_t en_engine_head_probe(const en_engine *e, int max_pages, double *local, double *rank,
                             double *found);
/* Budget shares from a head probe's curves (rank, or found; n_heads x max_pages): the total
 * budget (budget_pages per (layer, kv head) on average) goes page by page to the head whose next
 * page holds the most mass (greedy: local heads keep their sink and window pages only). Writes
 * each (layer, kv head)'s pages into shares. */
void en_sparse_shares_from_probe(const double *local, const double *rank, int n_heads,
                                 int max_pages, int budget_pages, float *shares);
/* Reads a budget-shares file (format: docs/sparse.md "Per-head budgets") for a model of
 * n_layers x n_head_kv: 0, or KM_EINVAL with the line and the reason in err. */
int en_sparse_shares_parse(const char *text, size_t len, int n_layers, int n_head_kv, float *shares,
                           km_errbuf *err);
/* en_sparse_shares_parse of the file at path for model m; *out (malloc'd, the caller frees)
 * holds n_layers * n_head_kv shares. KM_EIO when the file cannot be read. */
int en_sparse_shares_load(const char *path, const en_model *m, float **out, km_errbuf *err);
/* Writes shares for model m in the file format, comment (may be NULL, may hold newlines) as
 * '#' lines at its top. Returns 0 or KM_EIO. */
int en_sparse_shares_write(FILE *f, const en_model *m, const float *shares, const char *comment);
const char *en_engine_isa(const en_engine *e);

typedef struct en_batch {
    int n_tokens;
    const int32_t *tokens; /* [n_tokens] */
    const int32_t *pos;    /* [n_tokens] position of each token in its sequence */
    kv_seq *const *seqs;   /* [n_tokens] the sequence each token belongs to */
    const uint8_t *logits; /* [n_tokens] 1 where the caller wants logits; NULL: last only */
    /* [n_tokens] out, or NULL: each token's dominant routed expert, the one with the largest
     * router weight summed over the MoE layers (its choices' renormalized weights; the lower id
     * on a tie); -1 for a dense model. What kvshard places the token's page by (kv_seq_place). */
    int16_t *route;
    /* [n_tokens] or NULL (all): the layers each token is computed through, in non-increasing
     * order along the batch (chunk reuse, engine/blend.c): in layers past its depth a token's
     * K/V are not written, what its sequence holds there stays. Tokens asking for logits must
     * go through every layer. MoE layers run their experts for the tokens still active. */
    const int16_t *depth;
    /* With depth: 1 if a token of depth d < n_layers also writes its K/V of layer d (that layer's
     * projections only, no attention or feed-forward): what chunk reuse's probe reads. */
    int depth_kv;
} en_batch;

/* Runs the batch. On success *logits points to n_out rows of n_vocab floats (engine-owned,
 * valid until the next step), in the order of the tokens that asked for them, and the return
 * value is n_out. Negative km_err on failure (KM_ENOSPC: the KV store is full; nothing of the
 * batch was computed). */
int en_engine_step(en_engine *e, const en_batch *b, const float **logits);

/* ---------------------------------------------------------------- chunk reuse
 * en_blend_*: KV of a chunk (a retrieved document, a tool output) reused wherever it appears in
 * a prompt, not only as a prefix (engine/blend.c, docs/blend.md). A chunk's pages are cached as
 * if the chunk were a prompt of its own, at positions [0, n), under a chain seeded by
 * en_blend_chunk_seed (the tenant's seed, so never across tenants) and verified by token ids
 * like prefix pages. Reused at position p its keys are rotated by p (RoPE), and en_blend_prefill
 * recomputes the tokens whose KV drifts most from what full recomputation would give. */

/* Keys k[n_head_kv][head_dim] of a token computed at position `from` rotated to position `to`. */
void en_blend_rerotate(const en_engine *e, float *k, int from, int to);
/* Copies positions [src_pos, src_pos + n) of src, every layer, into dst at [dst_pos, ...), keys
 * re-rotated; reserves dst up to dst_pos + n (KM_ENOSPC). */
int en_blend_copy(en_engine *e, const kv_seq *src, int src_pos, kv_seq *dst, int dst_pos, int n);

/* A chunk of a prompt: tokens [start, start + n). */
typedef struct en_blend_seg {
    int start, n;
} en_blend_seg;

/* The recompute fraction to use when the caller has no reason to pick another: chosen from
 * bench-blend's quality/speed curve (docs/blend.md, Quality). */
#define EN_BLEND_FRACTION 0.15f

typedef struct en_blend_opts {
    /* mean share of the reused tokens recomputed per layer past the probe; more in the first
     * layers than the last (twice the mean after the probe, falling linearly to 0); 0: none
     * (pure reuse, no probe) */
    float fraction;
    int probe_layer; /* the layer whose K/V drift picks the tokens; 0: 1 (CacheBlend's) */
    /* 0 (default): the last chunk, the one nearest the question, is computed in full like the
     * rest of the prompt, which at equal work gives a lower perplexity than a larger fraction
     * (docs/blend.md, Quality); 1: it is reused like the others */
    int reuse_last;
} en_blend_opts;

typedef struct en_blend_stats {
    int reused;        /* prompt tokens whose KV came from chunks */
    int recomputed;    /* of those, tokens recomputed past the probe layer */
    int computed;      /* prompt tokens computed through every layer (not in a chunk) */
    long token_layers; /* (token, layer) pairs computed, probe included */
} en_blend_stats;

/* Prefill of tokens [n_done, n_tokens) of q, where [0, n_done) is in q already and the chunks
 * (inside [n_done, n_tokens), ordered, disjoint) hold reused KV (en_blend_copy): every other
 * token, and the last chunk's unless o->reuse_last, is computed through every layer; with a
 * fraction, every chunk token first through the probe layer, then those whose probe-layer K/V moved
 * most from the reused ones further, per the progressive rule. The last token always goes through
 * every layer: *logits is its row. KM_EINVAL on bad segments (empty, overlapping, outside [n_done,
 * n_tokens - 1)). */
int en_blend_prefill(en_engine *e, kv_seq *q, const int32_t *tokens, int n_tokens, int n_done,
                     const en_blend_seg *chunks, int n_chunks, const en_blend_opts *o,
                     en_blend_stats *st, const float **logits);

/* en_blend_prefill in pieces, so that a scheduler can cut it as it cuts an ordinary prefill (a
 * step budget, other sequences decoding in between): the prefill of [n_done, end) only, where
 * end <= n_tokens holds every chunk; the tokens after end are the caller's to compute (an
 * ordinary prefill: the result is the same as one en_blend_prefill, the engine's forward being
 * batch-invariant). Each en_blend_run_step runs the next tokens of the pass under way (the
 * probe, then the recompute, each in position order) as one engine batch of at most
 * max_token_layers (token, layer) pairs (at least one token); it returns the pairs run (0 once
 * done) or a negative km_err, after which the run can only be ended. *logits is set by the step
 * that runs the last token when end == n_tokens. tokens and q must outlive the run. */
typedef struct en_blend_run en_blend_run;
int en_blend_run_begin(en_engine *e, kv_seq *q, const int32_t *tokens, int n_tokens, int n_done,
                       int end, const en_blend_seg *chunks, int n_chunks, const en_blend_opts *o,
                       en_blend_run **out);
long en_blend_run_step(en_blend_run *b, long max_token_layers, const float **logits);
/* What the next en_blend_run_step(b, max_token_layers) would run, priced: the (token, layer)
 * pairs of the longest run of the pass's next tokens (one engine batch at most) whose cost stays
 * within cap, at least one token; *cost is theirs. A token at position p through d layers (the
 * probe's K/V-only layer counted whole) costs d / n_layers * (u_tok + (p + 1) * u_att): a
 * scheduler's per-token and per-attended-position units (docs/blend.md, "Serving"). 0 once
 * done. */
long en_blend_run_price(const en_blend_run *b, long max_token_layers, double u_tok, double u_att,
                        double cap, double *cost);
int en_blend_run_done(const en_blend_run *b);
/* Frees the run; st (may be NULL): its counts (complete once done). */
void en_blend_run_end(en_blend_run *b, en_blend_stats *st);

/* The seed of a tenant's chunk chains from its prefix seed (km_pagehash_seed). */
km_pagehash en_blend_chunk_seed(km_pagehash tenant_seed);
/* Where a chunk's pages are cached: the chain seed, and the tokens every chunk is computed after
 * (a whole number of pages; NULL, 0: none). A chunk computed at position 0 makes an attention
 * sink of its first token, which misleads every token after it once reused mid-prompt; computed
 * after a fixed preamble, the sink is the preamble's (docs/blend.md). */
typedef struct en_blend_key {
    km_pagehash seed;
    const int32_t *pre;
    int n_pre;
} en_blend_key;
/* The chunk's cached pages: a new sequence (*out) with the preamble and the longest verified
 * run of the chunk's full pages attached; returns the chunk tokens held, at positions
 * [n_pre, n_pre + returned) of *out. 0 (and *out NULL) on a miss. */
int en_blend_chunk_attach(en_engine *e, const en_blend_key *k, const int32_t *tokens, int n,
                          kv_seq **out);
/* The chunk tokens whose pages the store holds, as en_blend_chunk_attach would attach them,
 * without attaching (nor counting a hit or a miss). */
int en_blend_chunk_held(en_engine *e, const en_blend_key *k, const int32_t *tokens, int n);
/* Computes the preamble and the chunk and publishes their full pages under the chunk chain. */
int en_blend_chunk_store(en_engine *e, const en_blend_key *k, const int32_t *tokens, int n);

/* ---------------------------------------------------------------- sampler */

typedef struct en_sample_params {
    float temperature;       /* <= 0: greedy */
    int top_k;               /* <= 0: off */
    float top_p;             /* >= 1: off */
    float min_p;             /* <= 0: off */
    float repeat_penalty;    /* 1: off; divides positive logits, multiplies negative ones */
    int repeat_last_n;       /* how much history the penalties see; 0: 64 */
    float presence_penalty;  /* subtracted once from every token seen */
    float frequency_penalty; /* subtracted per occurrence */
    uint64_t seed;
    /* Added to those ids' logits before anything else (copied at create; ids outside the
     * vocabulary are ignored). */
    const struct en_token_value *bias;
    int n_bias;
    /* Each sampled token's log-probability (en_sampler_logprobs), and this many of the most
     * likely alternatives (at most EN_MAX_TOP). */
    int logprobs, top_logprobs;
} en_sample_params;

typedef struct en_token_value {
    int32_t token;
    float value;
} en_token_value;

#define EN_MAX_TOP 20

/* A sampled token's log-probability under the model's own distribution: the log-softmax of the
 * raw logits, before logit bias, penalties, truncation and temperature (what OpenAI reports, and
 * vLLM's default), with the most likely alternatives, most likely first. */
typedef struct en_logprobs {
    int32_t token;
    float logprob;
    int n_top;
    en_token_value top[EN_MAX_TOP];
} en_logprobs;

void en_sample_params_default(en_sample_params *p);

typedef struct en_sampler en_sampler;

int en_sampler_create(const en_sample_params *p, int n_vocab, en_sampler **out);
void en_sampler_destroy(en_sampler *s);
/* Records a token into the penalty history (prompt tokens and every sampled token). */
void en_sampler_accept(en_sampler *s, int32_t token);
/* Advances the random draws as if n tokens had been sampled (a request continued after a
 * migration: its sampled tokens are the same as undisturbed). */
void en_sampler_skip(en_sampler *s, int n);
/* Picks the next token from one row of logits (the row is not modified). */
int32_t en_sampler_sample(en_sampler *s, const float *logits);
/* The last sampled token's log-probabilities; NULL unless the params asked for them. */
const en_logprobs *en_sampler_logprobs(const en_sampler *s);
/* log-softmax(logits)[token] and the n_top most likely ids (most likely first) into out. */
void en_logprobs_compute(const float *logits, int n_vocab, int32_t token, int n_top,
                         en_logprobs *out);
/* The same among the tokens whose bit is set in allowed (n_vocab bits; at least one set), as if
 * the others' logits were -inf (constrained decoding, en_grammar_mask). */
int32_t en_sampler_sample_masked(en_sampler *s, const float *logits, const uint32_t *allowed);

/* Negative log-probability of `target` under softmax(logits), in double precision (perplexity). */
double en_token_nll(const float *logits, int n_vocab, int32_t target);

/* Index of the largest value (the lowest index among equals). */
int32_t en_argmax(const float *x, int n);

/* ---------------------------------------------------------------- constrained decoding
 * en_grammar_*: the output held to a JSON Schema (grammar.c, docs/structured.md). A schema is
 * compiled once into an en_grammar (reference counted; shared by the requests that use the same
 * schema); a matcher runs it over one request's output and, each step, gives the set of tokens
 * that keep the output a valid prefix of a value of the schema (end-of-generation tokens exactly
 * when the value is complete). Supported: type (object, array, string, number, integer, boolean,
 * null, or a list), properties (generated in their order), required, additionalProperties,
 * items, minItems, maxItems, minLength, maxLength, pattern, minimum, maximum, exclusiveMinimum,
 * exclusiveMaximum, enum, const, anyOf/oneOf (branches that start with different characters, or
 * objects told apart by a constant first property), local $ref; other constraining keywords are
 * refused by name. Output is compact JSON, numbers without exponent (docs/structured.md, Limits).
 * One thread uses a grammar and its matchers. */
typedef struct en_grammar en_grammar;
typedef struct en_grammar_vocab en_grammar_vocab; /* the vocabulary's bytes as a trie */
typedef struct en_grammar_matcher en_grammar_matcher;

/* KM_EFORMAT (not JSON), KM_EINVAL (a bad value) or KM_EUNSUPPORTED, with the reason in err.
 * Two extensions (grammar_cfg.c): a text that begins with the line "%gbnf" is a GBNF grammar
 * (its rule root), one that begins with "%regex" a regular expression the whole output matches;
 * a bad one is KM_EINVAL with the line or offset and the reason. */
int en_grammar_compile(const char *schema, size_t len, en_grammar **out, km_errbuf *err);
en_grammar *en_grammar_ref(en_grammar *g);
void en_grammar_free(en_grammar *g); /* drops a reference */
int en_grammar_vocab_create(const md_tokenizer *t, en_grammar_vocab **out);
void en_grammar_vocab_destroy(en_grammar_vocab *v);
/* A matcher at the start of the output. A grammar serves one vocabulary (KM_EINVAL otherwise);
 * v NULL: bytes only (no tokens, no mask). */
int en_grammar_matcher_create(en_grammar *g, const en_grammar_vocab *v, en_grammar_matcher **out);
void en_grammar_matcher_destroy(en_grammar_matcher *m);
/* Advances over output bytes or one token; KM_EINVAL (state unchanged) when they are not valid. */
int en_grammar_accept_bytes(en_grammar_matcher *m, const char *bytes, size_t n);
int en_grammar_accept_token(en_grammar_matcher *m, int32_t id);
/* The output so far is a whole value (it may end); nothing at all may follow it. */
int en_grammar_complete(const en_grammar_matcher *m);
int en_grammar_done(const en_grammar_matcher *m);
/* The tokens allowed next, one bit each: (n_vocab + 31) / 32 words (never all clear). */
void en_grammar_mask(en_grammar_matcher *m, uint32_t *allowed);

/* ---------------------------------------------------------------- speculative decoding options
 */
/* Speculative decoding without a draft model (engine/spec.h, docs/speculative.md): drafts from
 * suffix matches over the request's own text and the tenant's earlier outputs, verified in one
 * step; the output is token for token what decoding without drafts gives. */
typedef enum en_spec_mode {
    EN_SPEC_DEFAULT = 0, /* a request that does not say: the worker's mode */
    EN_SPEC_OFF = 1,
    EN_SPEC_AUTO = 2, /* draft when the step-cost budget says it pays */
    /* self-speculation (QuantSpec): the model drafts over a 4-bit copy of the request's KV and
     * verifies over the full pages; needs a draft engine (en_sched_set_draft), else AUTO */
    EN_SPEC_SELF = 3,
} en_spec_mode;

/* Self drafts stay inside the page being filled (scheduler_self.c): at most a page less one. */
#define EN_SELF_MAX_DRAFT 15

typedef struct en_spec_opts {
    int mode;           /* the worker's default: EN_SPEC_OFF, _AUTO or _SELF (0: auto) */
    int max_draft;      /* draft tokens per request and step; 0: 16 (at most 64) */
    float factor;       /* draft length <= factor x match length; 0: 1.0 */
    float min_share;    /* a proposal stops at a token with a smaller share; 0: 0.1 */
    size_t index_bytes; /* the global suffix index's budget; 0: 32 MiB */
    int fail_limit;     /* verifications in a row with nothing accepted before backing off; 0: 3 */
    float token_cost;   /* per-token / base cost of a step assumed before measuring; 0: 0.25 */
    int lead_in;        /* prompt tokens indexed with an output in the global index; 0: 32 */
    int self_draft;     /* EN_SPEC_SELF: draft steps (tokens) per verification; 0: 3; at most
                         * EN_SELF_MAX_DRAFT */
    bool cost_fixed;    /* the token_cost line only, steps not timed: drafting that does not
                         * depend on the machine's speed or load (tests) */
} en_spec_opts;

/* The scheduler's limits (engine/engine.h), part of the service's options. */
typedef struct en_sched_opts {
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
    /* While another tenant is active (en_sched_req.tenant; has requests here, or had one end
     * within tenant_linger_ms), a tenant runs at most tenant_share sequences: the rest of its
     * requests wait in the queue, its newest running ones going back there first (their pages
     * stay cached). 0: no share; a tenant alone is never held. */
    int tenant_share;
    int tenant_linger_ms; /* 0: 1000 */
    /* With a tenant share: while a tenant runs more than it (it is alone), a step carries at
     * most this many prompt tokens, so a newcomer waits for a short step, not a burst of its
     * prefills; and the step giving a tenant under its share its first token carries nothing
     * of the tenants at their share. 0: no cap (the step still clears for the newcomer). */
    int tenant_prefill;
    uint64_t cluster_seed; /* page-hash chain seed (with the model fingerprint and cache_salt) */
    en_spec_opts spec;     /* speculative decoding */
    /* Chunk reuse (en_sched_req.chunks): the recompute fraction of en_blend_opts, when
     * blend_fraction_set (0 then is pure reuse); unset: EN_BLEND_FRACTION. Negative: chunks are
     * never reused (computed in full, still stored). */
    float blend_fraction;
    int blend_fraction_set;
} en_sched_opts;

/* Most chunks a request may mark (KM_PROTO_MAX_CHUNKS on the wire). */
#define EN_SCHED_MAX_CHUNKS 64
/* The text every chunk is computed after (its first page of tokens is the preamble,
 * en_blend_key.pre): the same on every worker and router of a model, so chunk pages hash alike
 * everywhere (km_pagehash_chunk_seed). */
#define EN_SCHED_BLEND_PREAMBLE KM_CHUNK_PREAMBLE

/* ---------------------------------------------------------------- scheduler
 * en_sched_*: iteration-level continuous batching over one engine. Every step mixes the decode
 * token of each running sequence with prefill chunks of the others under a per-step token
 * budget. At admission only the prompt tokens kvshard does not already hold (verified prefix
 * hit) are computed. When the KV store is full the scheduler preempts the lowest-priority,
 * most recently admitted sequence (its full pages published, so they stay cached) and requeues
 * it; a lone sequence that cannot fit fails with an error. With a step budget, no step is
 * planned to take longer than it (chunks sized from the measured cost of earlier steps).
 * Requests are admitted by priority plus an aging credit for time waited (with a tenant share,
 * the tenant with the fewest running first), can carry a deadline, and can be canceled.
 * engine/scheduler.c's opening comment says why.
 */

typedef struct en_sched en_sched;

typedef struct en_sched_req {
    const int32_t *tokens; /* the prompt (copied) */
    int n_tokens;
    en_sample_params sample;
    int max_tokens;         /* 0: default_max_tokens; clipped to max_ctx */
    int priority;           /* higher first, among the tenants with the fewest running */
    uint64_t tenant;        /* whose request this is (fairness, en_sched_opts.tenant_share);
                             * requests without a tenant share one, 0 */
    uint64_t deadline_ns;   /* absolute km_now_ns(); 0: none */
    uint64_t arrival_ns;    /* when the request arrived; 0: now */
    const char *cache_salt; /* NULL: none */
    size_t cache_salt_len;
    int ignore_eos;  /* keep going past end-of-generation tokens */
    int speculate;   /* en_spec_mode; 0: the worker's */
    int max_draft;   /* draft tokens per step at most; 0: the worker's (never more) */
    int n_generated; /* the last n_generated prompt tokens were sampled by an earlier attempt
                      * (a migration): the sampler's draws continue after them */
    /* The output held to this grammar (referenced, not taken; NULL: free): each step's tokens
     * are drawn among those it allows, a migration's n_generated tokens are fed to it first
     * (KM_EINVAL when they do not fit it), and the request ends (stop) once nothing may follow
     * the value. Needs a scheduler made by en_sched_create (the model's vocabulary). */
    en_grammar *grammar;
    /* Report the log-probability of each prompt token but the first (and of the last
     * n_generated none) to on_prompt_logprob, with sample.top_logprobs alternatives, before the
     * first generated token. The prompt is then computed whole: no cached prefix is attached. */
    int prompt_logprobs;
    /* Segments of the prompt whose KV may be cached and reused by content wherever they appear
     * (en_blend_*; copied; ordered, disjoint, non-empty, inside the prompt, at most
     * EN_SCHED_MAX_CHUNKS, else KM_EINVAL). At admission each chunk past the cached prefix whose
     * pages the store holds is copied in and repaired by selective recompute; the pages from the
     * first reused chunk on are approximate and never published as prefix pages. A chunk not
     * held is computed in full with the prompt, and stored after the request ends. Only over a
     * scheduler made by en_sched_create, a dense model and a first admission: a preempted
     * request is recomputed in full. */
    const en_blend_seg *chunks;
    int n_chunks;
    void *user; /* handed back to every callback */
} en_sched_req;

typedef struct en_sched_usage {
    int prompt_tokens, cached_tokens, completion_tokens, preemptions;
    int chunk_tokens; /* prompt tokens whose KV came from cached chunks (not in cached_tokens) */
    int draft_tokens, accepted_draft_tokens; /* drafted and verified / kept (of completion) */
    double queue_ms, ttft_ms, total_ms;
} en_sched_usage;

typedef struct en_sched_cb {
    /* A new token (index counts from 0). Return 1 to end the request with KM_FINISH_STOP (a stop
     * string matched), 0 to go on. */
    int (*on_token)(void *ctx, void *user, int index, int32_t token);
    /* The request ended normally; user is not used again. */
    void (*on_done)(void *ctx, void *user, km_finish finish, const en_sched_usage *u);
    /* The request failed (code: km_proto_code) or was handed back; user is not used again. */
    void (*on_error)(void *ctx, void *user, int code, const char *message, const en_sched_usage *u);
    void *ctx;
    /* With en_sched_req.prompt_logprobs: prompt token pos (1..) had log-probability lp under
     * the model given the tokens before it (each position once, in order); NULL: not wanted. */
    void (*on_prompt_logprob)(void *ctx, void *user, int pos, const en_logprobs *lp);
} en_sched_cb;

typedef struct en_sched_stats {
    int running, queued;
    double step_ms_max;  /* the longest step so far */
    double ns_per_unit;  /* the measured cost of one unit of step work (0: none measured yet) */
    uint64_t budget_cut; /* prefill chunks the step budget made shorter */
    uint64_t steps, prefill_tokens, decode_tokens, prompt_tokens, cached_tokens, preemptions,
        recomputed_tokens, completed, canceled, deadline, failed, engine_errors,
        kv_full; /* requests handed back (503) because pinned pages left no room: transient */
    uint64_t tenant_yields; /* running sequences sent back to the queue for another tenant */
    uint64_t tenant_waits;  /* a running sequence sat out a step for another tenant's first token */
    /* Chunk reuse: prompt tokens reused from cached chunks, of those recomputed past the probe,
     * chunks stored after their request, chunks that found nothing cached. */
    uint64_t chunk_tokens, chunk_recomputed, chunks_stored, chunk_misses;
    /* Speculative decoding: draft tokens verified, kept and thrown away; verification steps of
     * a request (mean accepted length = spec_accepted / spec_verifies); back-offs. */
    uint64_t spec_drafted, spec_accepted, spec_rejected, spec_verifies, spec_backoffs;
} en_sched_stats;

/* What the scheduler needs of an engine and its model. en_sched_create fills it from a en_engine
 * and its en_model; tests/unit/test_scheduler_fake.c puts a fake engine behind it, so budgets,
 * chunking and preemption are tested without the model file. */
typedef struct en_sched_engine {
    kv_store *kv;            /* the store the engine keeps the batch's KV in */
    const en_hparams *hp;    /* shapes: n_vocab (a logits row's floats) and what a step's work
                              * is counted in (the step budget's units); read at create */
    const char *fingerprint; /* the model's, as en_model_fingerprint_hex: seeds page hashes */
    /* As en_engine_step: n_out rows of logits, or a negative km_err (KM_ENOSPC: the KV store is
     * full and nothing of the batch was computed). */
    int (*step)(void *ctx, const en_batch *b, const float **logits);
    /* Non-zero when `token` ends generation (md_tok_is_eog). */
    int (*is_eog)(void *ctx, int32_t token);
    void *ctx;
    /* Self-speculation (EN_SPEC_SELF, scheduler_self.c): a second engine over the same model
     * whose store (draft_kv, int4) holds a 4-bit copy of each drafting sequence's KV; its steps
     * as `step`. NULL: requests that ask for it draft from suffixes (EN_SPEC_AUTO). */
    kv_store *draft_kv;
    int (*draft_step)(void *ctx, const en_batch *b, const float **logits);
} en_sched_engine;

int en_sched_create(en_engine *e, const en_model *m, const en_sched_opts *o, const en_sched_cb *cb,
                    en_sched **out, km_errbuf *err);
/* The same over any engine behind the interface above (copied; its ctx must outlive the
 * scheduler). */
int en_sched_create_on(const en_sched_engine *eng, const en_sched_opts *o, const en_sched_cb *cb,
                       en_sched **out, km_errbuf *err);
/* A scheduler made by en_sched_create drafts EN_SPEC_SELF requests with draft, an engine over
 * the same model with an int4 store (kv_format KN_KV_INT4), which must outlive it. Before the
 * first submit. */
void en_sched_set_draft(en_sched *s, en_engine *draft);
/* Frees everything; requests still held get no callback. */
void en_sched_destroy(en_sched *s);
/* Queues a request; *rid (may be NULL) identifies it for en_sched_cancel. KM_EOVERLOAD when the
 * queue is full, KM_ERANGE when the prompt leaves no room in max_ctx, KM_EINVAL on a token
 * outside the vocabulary. No callback is called for a refused request. */
int en_sched_submit(en_sched *s, const en_sched_req *r, uint64_t *rid);
/* Ends the request with KM_FINISH_CANCELED at the next step; KM_ENOTFOUND if it is not held. */
int en_sched_cancel(en_sched *s, uint64_t rid);
/* One iteration: expiries and cancellations, admission, one engine step, sampling, callbacks.
 * Returns the number of tokens computed (0: nothing to do) or a negative km_err. */
int en_sched_step(en_sched *s);
/* The start of the next en_sched_step done now (expiries, cancellations, admission; their
 * callbacks): the running set read after it is the one that step computes (what a worker
 * reports while the step runs). */
void en_sched_prepare(en_sched *s);
/* Inside on_token: the token's log-probabilities when its request asked for them, else NULL. */
const en_logprobs *en_sched_logprobs(const en_sched *s);
/* Requests held (running + queued). */
int en_sched_pending(const en_sched *s);
/* Ends every held request with on_error(code, message) after publishing its computed pages, so
 * whoever retries it elsewhere or later finds them cached (drain, shutdown). */
void en_sched_abort_all(en_sched *s, int code, const char *message);
void en_sched_stats_get(const en_sched *s, en_sched_stats *out);
/* Chunks of ended requests waiting to be computed and stored (en_sched_req.chunks): while
 * non-zero, en_sched_step stores one per call when no request is held (or too many wait). */
int en_sched_chunks_waiting(const en_sched *s);

#ifdef __cplusplus
}
#endif
#endif /* EN_ENGINE_H */
