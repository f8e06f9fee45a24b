/*
 * kernels.h — every compute kernel kvmesh runs, behind one table of function pointers per
 * instruction set, plus the thread pool that drives them.
 *
 * Contract:
 *  - Each kernel exists as a plain scalar reference (kn_ops_get(KN_ISA_SCALAR)) and, where it
 *    pays, as AVX2 and AVX-512 versions. tests/unit/test_kernels_quant.c and _ops.c hold every
 *    fast path to the reference. The best table the CPU supports is picked at run time
 *    (kn_ops_best); the build never assumes the machine it runs on.
 *  - Numerics follow llama.cpp's CPU back end where it matters for agreement: activations are
 *    quantized to the weight type's "dot type" (Q8_0 for Q4_0/Q8_0, Q8_1 for Q4_1, Q8_K for the
 *    K-quants) and dotted with integer arithmetic, exactly as ggml does.
 *  - Kernels never allocate and never fail: shapes are the caller's responsibility (asserted).
 *  - Matrices are row-major; a weight matrix W has `rows` rows of `k` elements (ggml's ne[1] and
 *    ne[0]); activations X have m rows of k elements; Y[i][r] = dot(W[r], X[i]).
 */
#ifndef KN_KERNELS_H
#define KN_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "common/km.h"
#include "model/model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kn_isa { KN_ISA_SCALAR = 0, KN_ISA_AVX2 = 1, KN_ISA_AVX512 = 2, KN_ISA_COUNT } kn_isa;

/* Block layouts (identical to ggml's). QK_K = 256. */
#define KN_QK4_0 32
#define KN_QK4_1 32
#define KN_QK8_0 32
#define KN_QK8_1 32
#define KN_QK_K  256

/* Row ranges handed to matmul_packed start at a multiple of this (every table's panel height
 * divides it). */
#define KN_PACK_ALIGN 16

typedef uint16_t kn_f16;  /* IEEE half, bit pattern */
typedef uint16_t kn_bf16; /* bfloat16, bit pattern */

/* The KV-page formats the attention kernel reads (see kvshard/kvshard.h). */
typedef enum kn_kv_format {
    KN_KV_F16 = 0,
    KN_KV_BF16 = 1,
    KN_KV_FP8 = 2,  /* E4M3, f16 scale per 16 channels of a token row */
    KN_KV_INT8 = 3, /* symmetric, f16 scale per 16 channels of a token row */
    KN_KV_INT4 = 4, /* asymmetric; keys grouped per channel, values per token (KIVI) */
} kn_kv_format;

/* What attention needs to read one (sequence, layer, kv head): the sequence's pages in order and
 * where, inside every page, this layer's and head's K and V blocks start. In f16/bf16 a block is
 * [page_tokens][head_dim] elements. */
typedef struct kn_kv_view {
    const uint8_t *const *pages;
    size_t k_off, v_off;
    size_t k_scale_off, v_scale_off; /* quantized formats: where the block's scales live */
    int page_tokens;
    int n_ctx; /* attend to positions [0, n_ctx) */
    kn_kv_format format;
    /* Quantized and mixed-format views (kvshard; read by kernels/cpu/attn_kv_*.c, layouts in
     * kernels/cpu/attn_kv.h). When page_formats is not NULL, page i is in page_formats[i] and its
     * blocks start at fmt_offs[4*f + {0,1,2,3}] = k, v, k_scale, v_scale offsets for format f;
     * format is then any non-f16/bf16 value. attn_mass, when not NULL, gets += each page's share
     * of the softmax summed over the n_q heads (the h2o eviction policy's statistic). */
    const uint8_t *page_formats;
    const size_t *fmt_offs;
    float *attn_mass;
} kn_kv_view;

typedef struct kn_ops {
    kn_isa isa;
    const char *name;

    /* Activation (dot-type) quantization of one row: t is Q8_0, Q8_1, Q8_K, F16, BF16 or F32. */
    void (*quantize_row)(md_type t, const float *x, void *y, int64_t n);
    /* Any weight type to f32 (embedding lookup). */
    void (*dequantize_row)(md_type t, const void *x, float *y, int64_t n);
    /* Y[i*y_stride + r] = dot(W row r, X row i) for i in [0,m), r in [r0,r1). X is already in
     * kn_dot_type(wt); strides are in bytes for W and X, in floats for Y. */
    void (*matmul)(md_type wt, const void *w, size_t w_stride, const void *x, size_t x_stride,
                   int64_t k, int m, float *y, size_t y_stride, int64_t r0, int64_t r1);
    /* Weight repacking, done once at model load: the rows rearranged into the panel layout this
     * table's matmul streams without transposing anything per call (kernels/cpu/packed.h; the
     * layout differs between tables). pack_size is the bytes `pack` writes, or 0 when this table
     * does not repack the type (the scalar table never does; float types are never repacked):
     * then use matmul on the rows. `out` must be 64-byte aligned. */
    size_t (*pack_size)(md_type wt, int64_t rows, int64_t k);
    void (*pack)(md_type wt, const void *w, size_t w_stride, int64_t rows, int64_t k, void *out);
    /* matmul over a packed matrix of `rows` rows: the same Y, bit for bit, as matmul on the rows
     * it was packed from. r0 must be a multiple of KN_PACK_ALIGN. */
    void (*matmul_packed)(md_type wt, const void *packed, int64_t rows, const void *x,
                          size_t x_stride, int64_t k, int m, float *y, size_t y_stride, int64_t r0,
                          int64_t r1);

    /* y = x / rms(x) * w (llama.cpp's ggml_rms_norm then mul). y may alias x. */
    void (*rmsnorm)(float *y, const float *x, const float *w, int n, float eps);
    /* Rotates n_heads heads of head_dim in place with the cos/sin cache of kn_rope_cache;
     * neox pairs (i, i+n_rot/2), normal pairs (2i, 2i+1). */
    void (*rope)(float *x, int n_heads, int head_dim, int n_rot, const float *cs, int neox);
    /* y[i] = silu(g[i]) * u[i] */
    void (*silu_mul)(float *y, const float *g, const float *u, int n);
    /* y[i] += x[i] */
    void (*add)(float *y, const float *x, int n);
    void (*f32_to_f16)(const float *x, kn_f16 *y, int64_t n);
    void (*f16_to_f32)(const kn_f16 *x, float *y, int64_t n);

    /* Attention of n_q query heads (that share one kv head) of one token over kv->n_ctx
     * positions: out[h] = softmax(scale * q[h]·K^T) · V, online softmax over pages. q and out
     * are [n_q][head_dim]. */
    void (*attention)(const kn_kv_view *kv, int head_dim, const float *q, int n_q, float scale,
                      float *out);
    /* The same for n_tok consecutive query tokens of one sequence (a prefill chunk, a
     * verification): token t's heads are at q + t * q_stride, its output at out + t * out_stride,
     * and it attends to the first kv->n_ctx - (n_tok - 1 - t) positions (kv->n_ctx >= n_tok:
     * the last token's). Equal, bit for bit, to n_tok calls of attention; the SIMD tables walk
     * the pages once for up to 8 tokens at a time instead of once per token. */
    void (*attention_multi)(const kn_kv_view *kv, int head_dim, const float *q, size_t q_stride,
                            int n_tok, int n_q, float scale, float *out, size_t out_stride);

    /* XXH3_64bits_update(state, p, n): state is an XXH3_state_t (<xxhash.h>), reset and digested
     * by the caller. Every table gives the same state, bit for bit (XXH3 is defined so); the AVX2
     * build hashes faster than the SSE2 one a plain compile gets (docs/benchmarks.md), and the
     * AVX-512 table forwards to it (hash_avx512.c says why). What a transfer's receiver verifies
     * on every page that lands (docs/transfer.md). */
    void (*xxh3_update)(void *state, const void *p, size_t n);

    /* Sparse attention's page scores: sums[i] is page i's key summary for one (layer, kv head),
     * min[head_dim] then max[head_dim] of every channel over the page's tokens, as f16 rounded
     * outward (min down, max up: still a bound). For each of the n_q query heads, with m = (min +
     * max) / 2 and r = (max - min) / 2 per channel, the page scores q·m + radius * |q|·r;
     * score[i] is the largest over the heads. radius 1 is Quest's upper bound of q·k over the
     * page (sum_c max(q[c] * min[c], q[c] * max[c])); smaller ones rank pages by their centre
     * more than by their spread (docs/sparse.md). A NULL summary scores +inf (always selected). */
    void (*page_scores)(const kn_f16 *const *sums, int n_pages, int head_dim, const float *q,
                        int n_q, float radius, float *score);
} kn_ops;

/* The table for an instruction set, or NULL when this CPU (or build) lacks it. */
const kn_ops *kn_ops_get(kn_isa isa);
/* The fastest supported table; KVMESH_ISA=scalar|avx2|avx512 in the environment caps it. */
const kn_ops *kn_ops_best(void);
/* How many times slower than the SIMD tables an engine on table o runs: 30 for scalar (its
 * prefill against AVX2's, docs/benchmarks.md), else 1. For bounds that wait on
 * engine work (tools' and tests' time-outs, since daemons inherit KVMESH_ISA), never for results.
 */
int kn_ops_slowdown(const kn_ops *o);

/* Activation type a weight type is dotted against. */
md_type kn_dot_type(md_type weight_type);
/* 1 when matmul supports the weight type. */
int kn_weight_type_supported(md_type t);

/* RoPE cache for one position, llama.cpp-exact: theta_i = pos * base^(-2i/n_rot), computed
 * iteratively in float; cs[2i] = cos, cs[2i+1] = sin, for i < n_rot/2. */
void kn_rope_cache(float *cs, int n_rot, int pos, float freq_base);

/* Scalar conversions. */
float kn_f16_to_f32(kn_f16 h);
kn_f16 kn_f32_to_f16(float f);
float kn_bf16_to_f32(kn_bf16 h);
kn_bf16 kn_f32_to_bf16(float f);

/* ---------------------------------------------------------------- sparse attention */

/* How a decode step picks the pages it attends to (docs/sparse.md): at most budget_pages pages,
 * always the first sink_pages and the last window_pages, the rest by score (page_scores with
 * this radius; 0 is taken as 1, the upper bound). */
typedef struct kn_sparse_cfg {
    int budget_pages, sink_pages, window_pages;
    float radius;
} kn_sparse_cfg;

/* One thread's room for kn_sparse_attention over views of at most cap pages. */
typedef struct kn_sparse_scratch {
    int cap;
    const kn_f16 **sums;
    float *score, *tmp;
    int *sel;
    const uint8_t **pages;
    uint8_t *fmts;
} kn_sparse_scratch;

int kn_sparse_scratch_init(kn_sparse_scratch *s, int cap);
void kn_sparse_scratch_free(kn_sparse_scratch *s);

/* The pages to attend to among n_pages scored ones, ascending into sel: all of them when they fit
 * the budget, else the sink and window pages and the highest scores of the others (ties to the
 * lower index) up to budget_pages. tmp has room for n_pages floats. Returns how many. */
int kn_sparse_select(const float *score, int n_pages, const kn_sparse_cfg *c, float *tmp, int *sel);

/* The pages kn_sparse_attention would attend to, ascending into scr->sel: every page of a view
 * that fits the budget or has more pages than the scratch, else the chosen ones. Returns how
 * many (what a step must have readable before it attends: kvshard's kv_seq_fetch). */
int kn_sparse_pick(const kn_ops *o, const kn_kv_view *kv, const kn_f16 *const *sums,
                   const kn_sparse_cfg *c, kn_sparse_scratch *scr, int head_dim, const float *q,
                   int n_q);

/* Attention (kn_ops.attention, table o) of n_q heads over the selected pages of kv: the pages
 * are scored from sums (one per page of the view, NULL where a page has none), chosen by
 * kn_sparse_select, and attended exactly, as a view of those pages alone (attn_mass is not
 * kept). A view that fits the budget, or has more pages than the scratch, is attended whole.
 * Returns the pages attended. */
int kn_sparse_attention(const kn_ops *o, const kn_kv_view *kv, const kn_f16 *const *sums,
                        const kn_sparse_cfg *c, kn_sparse_scratch *scr, int head_dim,
                        const float *q, int n_q, float scale, float *out);

/* Attention over the pages sel[0..n) of kv (ascending, the view's last page among them, as
 * kn_sparse_pick returns them: a pick kept from earlier, e.g. the one a fetch was made for),
 * exactly as kn_sparse_attention attends its own pick; n <= scr->cap. Returns n. */
int kn_sparse_attend(const kn_ops *o, const kn_kv_view *kv, const int *sel, int n,
                     kn_sparse_scratch *scr, int head_dim, const float *q, int n_q, float scale,
                     float *out);

/* ---------------------------------------------------------------- thread pool */

/* A fixed set of threads that spin briefly, then sleep, between jobs. The calling thread is
 * worker 0 of every job. */
typedef struct kn_pool kn_pool;
typedef void (*kn_pool_fn)(void *ctx, int ith, int nth);

int kn_pool_create(int n_threads, kn_pool **out);
void kn_pool_destroy(kn_pool *p);
int kn_pool_size(const kn_pool *p);
/* Runs fn(ctx, ith, nth) on every thread and returns when all have finished. */
void kn_pool_run(kn_pool *p, kn_pool_fn fn, void *ctx);
/* Inside a job: waits until every thread of the job has reached it. */
void kn_pool_barrier(kn_pool *p);

/* Splits [0, n) evenly: thread ith gets [*lo, *hi). */
static inline void kn_split(int64_t n, int ith, int nth, int64_t *lo, int64_t *hi)
{
    int64_t per = (n + nth - 1) / nth;
    int64_t a = per * ith, b = a + per;
    *lo = a < n ? a : n;
    *hi = b < n ? b : n;
}

#ifdef __cplusplus
}
#endif
#endif /* KN_KERNELS_H */
