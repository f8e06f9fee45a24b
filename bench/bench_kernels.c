/*
 * bench_kernels.c — single-thread micro-benchmarks of the kernels of kernels.h, plus the two
 * machine figures the engine benchmark needs. Prints figures and asserts nothing about time.
 *
 *   bench_kernels [-i scalar|avx2|avx512|ggml] [-t Q4_1|Q4_0|Q8_0|Q4_K|Q6_K|F16|BF16|F32]
 *                 [-m 1,8,32] [-s rows,k] [-q] [-u]
 *       the quantized matmul of every instruction set this CPU has, on the shapes of the default
 *       model (SmolLM2-135M: k = 576 / 1536, Q4_1 linear layers, Q8_0 tied output of 49152
 *       rows): GFLOP/s = 2 * m * rows * k / time, the best of 15 timed runs, each at least 10 ms
 *       of this thread's CPU time (which is what holds up on a shared machine). Weights are
 *       random block bytes with sane scales: speed does not depend on the values. The SIMD
 *       builds run on the weights packed once (kn_ops.pack, what the engine does at load); -u
 *       also times them on the GGUF rows ("avx2-rows": matmul packs each panel on the fly). -q
 *       also times quantize_row of the activations.
 *   bench_kernels -a [-c]
 *       attention throughput, GB/s of K+V read per CPU-second, SmolLM2's shape (n_q 3, head_dim
 *       64, f16, 16-token pages scattered in memory). Hot: the same context again and again;
 *       -c (cold): rotating over contexts that together exceed the last-level cache, as the 30
 *       layers x 3 kv heads of a real step do.
 *   bench_kernels -p
 *       the thread pool: ns per kn_pool_barrier and per empty kn_pool_run with 2 threads, best and
 *       median batch (the median includes batches where a thread was preempted).
 *   bench_kernels -x
 *       the page checksum's hash (kn_ops.xxh3_update of every table this CPU has, beside
 *       libxxhash's XXH3 as Debian builds it, SSE2): GB/s per CPU-second hashing 16 KiB pieces
 *       that stay in L1 (what a transfer's receiver does as fragments land) and streaming 256 MiB
 *       from memory.
 *   bench_kernels -b THREADS
 *       memory read bandwidth: THREADS threads stream a 512 MiB buffer (best of 5; read_gb_s by
 *       wall time, cpu_gb_s by the slowest thread's CPU time).
 *   bench_kernels -w MODEL.gguf
 *       bytes of weights one decode step reads per token (every tensor but the embedding table,
 *       which is read one row per token, unless the output projection is tied to it).
 *   bench_kernels -e MODEL.gguf THREADS [p183DvL]
 *       engine steps with wall time and CPU time (all threads) per token or step: a 512-token
 *       prefill (p), 128 decode steps at batch 1 (1), 64 at batch 8 and 32 at batch 32 after
 *       128-token prompts (8, 3); D: 512 steps at batch 8, for a profile of batched decode; v:
 *       one sequence's verify steps of k = 1, 2, 4, 5, 8, 12, 16 consecutive tokens, logits for
 *       all k (what speculative decoding pays to check k - 1 drafts), after a 256-token prompt.
 *       L: the prefill of a 4,096-token prompt (512 per step), then at that context batch-1
 *       decode and k = 4 verification over f16 KV, then batch-1 decode over the same pages
 *       converted to int4 (a self-speculation draft's step); L<n> (L8192): at n tokens (the
 *       digits right after L are n; phase letters may follow them: L8192v).
 *       On a shared machine the CPU time of a 1-thread engine is the figure that holds up;
 *       `make bench-engine` gives the comparable ones.
 *
 * Build: make bench-kernels (build/bench/bench_kernels).
 *
 * With -DKN_BENCH_GGML, and llama.cpp's static libraries linked in (L=third_party/llama.cpp/build/
 * ggml/src; add $L/libggml-cpu.a $L/libggml-base.a -lstdc++ -fopenmp), it also times ggml's
 * ggml_vec_dot_* in the loop order of ggml's mul_mat (one output at a time, 16 x 16 blocks), and
 * checks that our activation quantization is byte-identical to ggml's quantize_row_q8_* and that
 * our matmul agrees with ggml's dot products.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t */
#include <xxhash.h>

#include "bench/bench_util.h"
#include "kernels/cpu/internal.h"
#include "worker/worker.h"

static double bk_wall(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double bk_now(void)
{
    /* CPU time of this thread: the figures hold up on a machine shared with other work */
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t bk_rng = 88172645463325252ull;
static uint32_t bk_u32(void)
{
    bk_rng ^= bk_rng << 13;
    bk_rng ^= bk_rng >> 7;
    bk_rng ^= bk_rng << 17;
    return (uint32_t)(bk_rng >> 16);
}
static float bk_unif(void)
{
    return (float)(bk_u32() >> 8) / 16777216.f * 2.f - 1.f;
}

static const struct {
    const char *name;
    md_type t;
    int blk, bytes;
} bk_types[] = {
    {"F32", MD_TYPE_F32, 1, 4},
    {"F16", MD_TYPE_F16, 1, 2},
    {"BF16", MD_TYPE_BF16, 1, 2},
    {"Q4_0", MD_TYPE_Q4_0, 32, sizeof(kn_block_q4_0)},
    {"Q4_1", MD_TYPE_Q4_1, 32, sizeof(kn_block_q4_1)},
    {"Q8_0", MD_TYPE_Q8_0, 32, sizeof(kn_block_q8_0)},
    {"Q8_1", MD_TYPE_Q8_1, 32, sizeof(kn_block_q8_1)},
    {"Q4_K", MD_TYPE_Q4_K, 256, sizeof(kn_block_q4_K)},
    {"Q6_K", MD_TYPE_Q6_K, 256, sizeof(kn_block_q6_K)},
    {"Q8_K", MD_TYPE_Q8_K, 256, sizeof(kn_block_q8_K)},
};
#define BK_NTYPES (int)(sizeof bk_types / sizeof bk_types[0])

static int bk_type_index(md_type t)
{
    for (int i = 0; i < BK_NTYPES; i++)
        if (bk_types[i].t == t) return i;
    return -1;
}

static size_t bk_row_bytes(md_type t, int64_t k)
{
    const int i = bk_type_index(t);
    return (size_t)(k / bk_types[i].blk) * (size_t)bk_types[i].bytes;
}

/* Random weight bytes; every fp16 in the row is then overwritten with a small normal value. */
static void bk_fill_weights(md_type t, uint8_t *w, size_t n_bytes, int64_t rows, size_t stride)
{
    for (size_t i = 0; i < n_bytes; i++) w[i] = (uint8_t)bk_u32();
    const kn_ops *ref = kn_ops_get(KN_ISA_SCALAR);
    float f[2];
    kn_f16 h[2];
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *row = w + (size_t)r * stride;
        const size_t nb = stride;
        switch (t) {
        case MD_TYPE_F32:
            for (size_t j = 0; j < nb / 4; j++) {
                f[0] = bk_unif();
                memcpy(row + 4 * j, &f[0], sizeof f[0]);
            }
            break;
        case MD_TYPE_F16:
        case MD_TYPE_BF16:
            for (size_t j = 0; j < nb / 2; j++) {
                f[0] = bk_unif();
                ref->quantize_row(t, f, &h[0], 1);
                memcpy(row + 2 * j, &h[0], 2);
            }
            break;
        case MD_TYPE_Q4_0:
        case MD_TYPE_Q4_1:
        case MD_TYPE_Q8_0:
        case MD_TYPE_Q4_K: { /* d (and m / dmin) lead the block */
            const size_t bb = (size_t)bk_types[bk_type_index(t)].bytes;
            for (size_t b = 0; b + bb <= nb; b += bb) {
                f[0] = 0.01f * (1 + bk_unif());
                f[1] = 0.01f * bk_unif();
                ref->quantize_row(MD_TYPE_F16, f, h, 2);
                memcpy(row + b, h, t == MD_TYPE_Q4_1 || t == MD_TYPE_Q4_K ? 4 : 2);
            }
            break;
        }
        case MD_TYPE_Q6_K:
            for (size_t b = 0; b + sizeof(kn_block_q6_K) <= nb; b += sizeof(kn_block_q6_K)) {
                f[0] = 0.001f;
                ref->quantize_row(MD_TYPE_F16, f, h, 1);
                memcpy(row + b + offsetof(kn_block_q6_K, d), h, 2);
            }
            break;
        default:
            break;
        }
    }
}

/* Best time of one call, over repeated batches of calls lasting at least min_s each. */
/* One matmul call: over the packed matrix when there is one, else over the rows. */
static void bk_call(const kn_ops *ops, md_type wt, const void *w, size_t ws, const void *packed,
                    int64_t rows, const void *x, size_t xs, int64_t k, int m, float *y, int64_t r0,
                    int64_t r1)
{
    if (packed)
        ops->matmul_packed(wt, packed, rows, x, xs, k, m, y, (size_t)r1, r0, r1);
    else
        ops->matmul(wt, w, ws, x, xs, k, m, y, (size_t)r1, r0, r1);
}

static double bk_time(const kn_ops *ops, md_type wt, const void *w, size_t ws, const void *packed,
                      int64_t rows, const void *x, size_t xs, int64_t k, int m, float *y,
                      int64_t r0, int64_t r1, double min_s)
{
    bk_call(ops, wt, w, ws, packed, rows, x, xs, k, m, y, r0, r1); /* warm up */
    double best = 1e30;
    for (int rep = 0; rep < 15; rep++) {
        int n = 0;
        const double t0 = bk_now();
        double t1;
        do {
            bk_call(ops, wt, w, ws, packed, rows, x, xs, k, m, y, r0, r1);
            n++;
            t1 = bk_now();
        } while (t1 - t0 < min_s);
        if ((t1 - t0) / n < best) best = (t1 - t0) / n;
    }
    return best;
}

#ifdef KN_BENCH_GGML
void ggml_cpu_init(void);
void quantize_row_q8_0(const float *x, void *y, int64_t k);
void quantize_row_q8_1(const float *x, void *y, int64_t k);
void quantize_row_q8_K(const float *x, void *y, int64_t k);
typedef void (*bk_vec_dot_fn)(int n, float *s, size_t bs, const void *x, size_t bx, const void *y,
                              size_t by, int nrc);
void ggml_vec_dot_q4_0_q8_0(int, float *, size_t, const void *, size_t, const void *, size_t, int);
void ggml_vec_dot_q4_1_q8_1(int, float *, size_t, const void *, size_t, const void *, size_t, int);
void ggml_vec_dot_q8_0_q8_0(int, float *, size_t, const void *, size_t, const void *, size_t, int);
void ggml_vec_dot_q4_K_q8_K(int, float *, size_t, const void *, size_t, const void *, size_t, int);
void ggml_vec_dot_q6_K_q8_K(int, float *, size_t, const void *, size_t, const void *, size_t, int);

static bk_vec_dot_fn bk_ggml_dot(md_type wt)
{
    switch (wt) {
    case MD_TYPE_Q4_0:
        return ggml_vec_dot_q4_0_q8_0;
    case MD_TYPE_Q4_1:
        return ggml_vec_dot_q4_1_q8_1;
    case MD_TYPE_Q8_0:
        return ggml_vec_dot_q8_0_q8_0;
    case MD_TYPE_Q4_K:
        return ggml_vec_dot_q4_K_q8_K;
    case MD_TYPE_Q6_K:
        return ggml_vec_dot_q6_K_q8_K;
    default:
        return NULL;
    }
}

/* ggml's mul_mat loop for a vec_dot type: 16 x 16 blocks of (activation row, weight row). */
static void bk_ggml_matmul(bk_vec_dot_fn dot, const uint8_t *w, size_t ws, const uint8_t *x,
                           size_t xs, int64_t k, int m, float *y, int64_t rows)
{
    for (int c0 = 0; c0 < m; c0 += 16)
        for (int64_t r0 = 0; r0 < rows; r0 += 16)
            for (int c = c0; c < c0 + 16 && c < m; c++)
                for (int64_t r = r0; r < r0 + 16 && r < rows; r++)
                    dot((int)k, &y[(size_t)c * (size_t)rows + (size_t)r], 0, w + (size_t)r * ws, 0,
                        x + (size_t)c * xs, 0, 1);
}

/* Our quantization against ggml's, our best matmul against ggml's dots; then ggml's speed. */
static void bk_ggml_compare(md_type wt, const uint8_t *w, size_t ws, uint8_t *x, size_t xs,
                            const float *xf, int64_t k, int max_m, int64_t rows, const int *ms,
                            int n_ms)
{
    bk_vec_dot_fn dot = bk_ggml_dot(wt);
    if (!dot) return;
    const md_type dt = kn_dot_type(wt);
    void (*gq)(const float *, void *, int64_t) = dt == MD_TYPE_Q8_0   ? quantize_row_q8_0
                                                 : dt == MD_TYPE_Q8_1 ? quantize_row_q8_1
                                                                      : quantize_row_q8_K;
    uint8_t *gx = malloc(xs * (size_t)max_m);
    int diff_rows = 0;
    for (int i = 0; i < max_m; i++) {
        gq(xf + (int64_t)i * k, gx + (size_t)i * xs, k);
        diff_rows += memcmp(gx + (size_t)i * xs, x + (size_t)i * xs, xs) != 0;
    }
    printf("ggml    quantize_row %s: %d of %d rows differ from ours\n",
           bk_types[bk_type_index(dt)].name, diff_rows, max_m);
    const int mc = max_m < 8 ? max_m : 8;
    float *yg = malloc(sizeof(float) * (size_t)(rows * mc));
    float *yo = malloc(sizeof(float) * (size_t)(rows * mc));
    bk_ggml_matmul(dot, w, ws, x, xs, k, mc, yg, rows);
    kn_ops_best()->matmul(wt, w, ws, x, xs, k, mc, yo, (size_t)rows, 0, rows);
    double worst = 0, scale = 0;
    for (int64_t i = 0; i < rows * mc; i++) {
        const double e = yg[i] > yo[i] ? yg[i] - yo[i] : yo[i] - yg[i];
        const double a = yg[i] > 0 ? yg[i] : -yg[i];
        worst = e > worst ? e : worst;
        scale = a > scale ? a : scale;
    }
    printf("ggml    dot vs %s matmul: max |diff| %.3g (max |y| %.3g)\n", kn_ops_best()->name, worst,
           scale);
    float *y = malloc(sizeof(float) * (size_t)(rows * max_m));
    for (int mi = 0; mi < n_ms; mi++) {
        const int m = ms[mi];
        double best = 1e30;
        for (int rep = 0; rep < 15; rep++) {
            int n = 0;
            const double t0 = bk_now();
            double t1;
            do {
                bk_ggml_matmul(dot, w, ws, x, xs, k, m, y, rows);
                n++;
                t1 = bk_now();
            } while (t1 - t0 < 0.01);
            if ((t1 - t0) / n < best) best = (t1 - t0) / n;
        }
        printf("%-7s %-5s %6lld %5lld %4d %10.1f %10.2f\n", "ggml",
               bk_types[bk_type_index(wt)].name, (long long)rows, (long long)k, m, best * 1e6,
               2.0 * m * (double)rows * (double)k / best * 1e-9);
        fflush(stdout);
    }
    free(gx);
    free(yg);
    free(yo);
    free(y);
}
#endif

/* ------------------------------------------------------------------ attention (-a) */

/* One f16 context of n_ctx tokens in pages allocated in shuffled order (addresses not monotonic,
 * as kvshard's are), K and V blocks of one kv head in each page. */
typedef struct bk_att {
    uint8_t **pages;
    int n_pages;
    kn_kv_view view;
} bk_att;

static void bk_att_build(bk_att *c, int n_ctx, int hd, int pt)
{
    const size_t blk = (size_t)pt * (size_t)hd * 2;
    c->n_pages = (n_ctx + pt - 1) / pt;
    c->pages = calloc((size_t)c->n_pages, sizeof *c->pages);
    for (int i = 0; i < c->n_pages; i++) {
        const int j = (int)(bk_u32() % (uint32_t)(i + 1)); /* insert at a random place */
        c->pages[i] = c->pages[j];
        c->pages[j] = malloc(2 * blk);
        for (size_t e = 0; e < 2 * blk / 2; e++) {
            const kn_f16 h = kn_f32_to_f16(bk_unif());
            memcpy(c->pages[j] + 2 * e, &h, 2);
        }
    }
    memset(&c->view, 0, sizeof c->view);
    c->view.pages = (const uint8_t *const *)c->pages;
    c->view.k_off = 0;
    c->view.v_off = blk;
    c->view.page_tokens = pt;
    c->view.n_ctx = n_ctx;
    c->view.format = KN_KV_F16;
}

static void bk_att_free(bk_att *c)
{
    for (int i = 0; i < c->n_pages; i++) free(c->pages[i]);
    free(c->pages);
}

static int bk_attention(int cold)
{
    const int ctxs[] = {1024, 4096, 16384};
    float q[3 * 64], out[3 * 64];
    for (int i = 0; i < 3 * 64; i++) q[i] = bk_unif();
    for (int a = 0; a < 3; a++) {
        const int n_ctx = ctxs[a];
        /* cold: enough contexts for ~256 MB of K+V */
        const int n_views = cold ? (int)((256u << 20) / ((size_t)n_ctx * 64 * 2 * 2)) : 1;
        bk_att *cs = malloc(sizeof(bk_att) * (size_t)n_views);
        for (int i = 0; i < n_views; i++) bk_att_build(&cs[i], n_ctx, 64, 16);
        const double bytes = (double)n_ctx * 64 * 2 * 2;
        printf("attention %s n_ctx=%5d n_q=3 hd=64 f16:", cold ? "cold" : "hot ", n_ctx);
        for (int isa = 0; isa < KN_ISA_COUNT; isa++) {
            const kn_ops *o = kn_ops_get((kn_isa)isa);
            if (!o) continue;
            o->attention(&cs[0].view, 64, q, 3, 0.125f, out); /* warm up */
            int iters = 0;
            const double t0 = bk_now();
            double t;
            do {
                o->attention(&cs[iters % n_views].view, 64, q, 3, 0.125f, out);
                iters++;
            } while ((t = bk_now() - t0) < (isa ? 0.3 : 0.1));
            printf("  %s %.1f GB/s (%.1f us)", o->name, bytes * iters / t / 1e9, t / iters * 1e6);
        }
        printf("\n");
        fflush(stdout);
        for (int i = 0; i < n_views; i++) bk_att_free(&cs[i]);
        free(cs);
    }
    return 0;
}

/* ------------------------------------------------------------------ thread pool (-p) */

typedef struct bk_bar {
    kn_pool *p;
    int n;
} bk_bar;

static void bk_bar_job(void *ctx, int ith, int nth)
{
    bk_bar *b = ctx;
    (void)ith, (void)nth;
    for (int i = 0; i < b->n; i++) kn_pool_barrier(b->p);
}

static void bk_nop_job(void *ctx, int ith, int nth)
{
    (void)ctx, (void)ith, (void)nth;
}

static int bk_pool(void)
{
    kn_pool *p;
    if (kn_pool_create(2, &p)) return 1;
    bk_bar b = {p, 1000};
    kn_pool_run(p, bk_bar_job, &b); /* warm up: both threads awake */
    enum { BATCHES = 1000 };
    static double bar[BATCHES], run[BATCHES];
    b.n = 100;
    for (int i = 0; i < BATCHES; i++) {
        const double t0 = bk_wall();
        kn_pool_run(p, bk_bar_job, &b);
        bar[i] = (bk_wall() - t0) / b.n;
    }
    for (int i = 0; i < BATCHES; i++) {
        const double t0 = bk_wall();
        for (int j = 0; j < 100; j++) kn_pool_run(p, bk_nop_job, NULL);
        run[i] = (bk_wall() - t0) / 100;
    }
    qsort(bar, BATCHES, sizeof(double), bench_cmp_double);
    qsort(run, BATCHES, sizeof(double), bench_cmp_double);
    printf("pool 2 threads: barrier %.0f ns best, %.0f ns median; empty run %.0f ns best, %.0f ns "
           "median\n",
           bar[0] * 1e9, bar[BATCHES / 2] * 1e9, run[0] * 1e9, run[BATCHES / 2] * 1e9);
    kn_pool_destroy(p);
    return 0;
}

/* ------------------------------------------------------------------ memory bandwidth (-b) */

typedef struct bk_bw {
    const uint64_t *buf;
    size_t n; /* uint64 words */
    uint64_t sink[64];
    double cpu[64]; /* each thread's CPU time for its share */
} bk_bw;

static void bk_bw_job(void *ctx, int ith, int nth)
{
    bk_bw *b = ctx;
    int64_t lo, hi;
    kn_split((int64_t)b->n / 8, ith, nth, &lo, &hi);
    const double t0 = bk_now();
    uint64_t a[8] = {0};
    for (int64_t i = lo * 8; i < hi * 8; i += 8)
        for (int j = 0; j < 8; j++) a[j] += b->buf[i + j];
    b->sink[ith % 64] = a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
    b->cpu[ith % 64] = bk_now() - t0;
}

static int bk_bandwidth(int threads)
{
    const size_t bytes = (size_t)512 << 20;
    bk_bw b = {.n = bytes / 8};
    uint64_t *buf = malloc(bytes);
    kn_pool *p;
    if (!buf || threads < 1 || kn_pool_create(threads, &p)) return 1;
    for (size_t i = 0; i < b.n; i++) buf[i] = i * 0x9E3779B97F4A7C15ull;
    b.buf = buf;
    kn_pool_run(p, bk_bw_job, &b); /* warm up: pages touched, threads awake */
    double best = 1e30, best_cpu = 1e30;
    for (int rep = 0; rep < 5; rep++) {
        const double t0 = bk_wall();
        kn_pool_run(p, bk_bw_job, &b);
        const double t = bk_wall() - t0;
        best = t < best ? t : best;
        double c = 0; /* the slowest thread's CPU time */
        for (int i = 0; i < threads && i < 64; i++) c = b.cpu[i] > c ? b.cpu[i] : c;
        best_cpu = c < best_cpu ? c : best_cpu;
    }
    /* On a busy machine the wall figure measures the neighbours too; cpu_gb_s is the rate while
     * the threads ran (the two agree on a quiet machine). */
    printf("membw threads=%d read_gb_s=%.2f cpu_gb_s=%.2f\n", threads, (double)bytes / best / 1e9,
           (double)bytes / best_cpu / 1e9);
    kn_pool_destroy(p);
    free(buf);
    return 0;
}

/* ------------------------------------------------------------------ page checksum (-x) */

/* GB/s per CPU-second of update(state, piece) over `bytes` bytes of buf, in pieces of `piece`
 * bytes cycling through the first `span` bytes; best of 5. */
static double bk_hash_rate(void (*update)(void *, const void *, size_t), const uint8_t *buf,
                           size_t span, size_t piece, size_t bytes)
{
    double best = 1e30;
    for (int rep = 0; rep < 5; rep++) {
        XXH3_state_t st;
        XXH3_64bits_reset(&st);
        const double t0 = bk_now();
        for (size_t done = 0, at = 0; done < bytes; done += piece, at = (at + piece) % span)
            update(&st, buf + at, piece);
        const double t = bk_now() - t0;
        volatile uint64_t sink = XXH3_64bits_digest(&st);
        (void)sink;
        best = t < best ? t : best;
    }
    return (double)bytes / best / 1e9;
}

static void bk_xxh3_lib(void *st, const void *p, size_t n)
{
    XXH3_64bits_update((XXH3_state_t *)st, p, n);
}

static int bk_hash(void)
{
    const size_t big = (size_t)256 << 20, piece = 16384, hot = 4 * piece;
    uint8_t *buf = malloc(big);
    if (!buf) return 1;
    for (size_t i = 0; i < big; i++) buf[i] = (uint8_t)(i * 131 + (i >> 12));
    const char *names[KN_ISA_COUNT + 1] = {"libxxhash (SSE2)"};
    void (*fns[KN_ISA_COUNT + 1])(void *, const void *, size_t) = {bk_xxh3_lib};
    int n = 1;
    for (int i = 0; i < KN_ISA_COUNT; i++) {
        const kn_ops *o = kn_ops_get((kn_isa)i);
        if (!o) continue;
        names[n] = o->name;
        fns[n++] = o->xxh3_update;
    }
    for (int i = 0; i < n; i++)
        printf("xxh3 %-17s in L1 (16 KiB pieces) %6.1f GB/s   from memory (256 MiB) %6.1f GB/s\n",
               names[i], bk_hash_rate(fns[i], buf, hot, piece, (size_t)1 << 30),
               bk_hash_rate(fns[i], buf, big, piece, big));
    free(buf);
    return 0;
}

/* ------------------------------------------------------------------ weight bytes (-w) */

static int bk_weight_bytes(const char *path)
{
    md_gguf *g;
    km_errbuf err;
    if (md_gguf_open(path, &g, &err)) {
        fprintf(stderr, "bench_kernels: %s\n", err.msg);
        return 1;
    }
    const int tied = md_gguf_find_tensor(g, "output.weight") == NULL;
    uint64_t bytes = 0;
    for (int64_t i = 0; i < md_gguf_n_tensors(g); i++) {
        const md_gguf_tensor *t = md_gguf_tensor_at(g, i);
        const int embd = t->name.len == 17 && !memcmp(t->name.ptr, "token_embd.weight", 17);
        if (!embd || tied) bytes += t->size;
    }
    printf("model weight_bytes_per_token=%llu tied_output=%d\n", (unsigned long long)bytes, tied);
    md_gguf_close(g);
    return 0;
}

/* ------------------------------------------------------------------ engine steps (-e) */

static double bk_proc_cpu(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Runs B sequences through a prompt of npp tokens each, then gen decode steps of B tokens, and
 * prints wall and CPU time (all threads) per step: on a machine shared with other work the CPU
 * time of a one-thread engine is the figure that holds up. */
static int bk_engine_phase(en_engine *e, int n_vocab, int B, int npp, int gen)
{
    kv_store *kv = en_engine_kv(e);
    kv_seq *ss[64];
    int32_t tok[512], pos[512];
    kv_seq *seqs[512];
    uint8_t want[512];
    memset(want, 1, sizeof want);
    for (int i = 0; i < 512; i++) tok[i] = (int32_t)(bk_u32() % (uint32_t)n_vocab);
    for (int j = 0; j < B; j++)
        if (kv_seq_create(kv, &ss[j])) return 1;
    const float *lg;
    const double w0 = bk_wall(), c0 = bk_proc_cpu();
    for (int j = 0; j < B && npp; j++) {
        for (int i = 0; i < npp; i++) pos[i] = i, seqs[i] = ss[j];
        en_batch b = {.n_tokens = npp, .tokens = tok, .pos = pos, .seqs = seqs};
        if (en_engine_step(e, &b, &lg) < 0) return 1;
    }
    const double w1 = bk_wall(), c1 = bk_proc_cpu();
    for (int g = 0; g < gen; g++) {
        for (int j = 0; j < B; j++) pos[j] = npp + g, seqs[j] = ss[j];
        en_batch b = {.n_tokens = B, .tokens = tok, .pos = pos, .seqs = seqs, .logits = want};
        if (en_engine_step(e, &b, &lg) < 0) return 1;
    }
    const double w2 = bk_wall(), c2 = bk_proc_cpu();
    if (npp)
        printf("engine prefill %d x %d tokens: %.1f tok/s wall, %.3f ms cpu per token\n", B, npp,
               B * npp / (w1 - w0), (c1 - c0) * 1e3 / (B * npp));
    if (gen)
        printf("engine decode batch=%d (%d steps from position %d): %.1f tok/s wall, %.3f ms cpu "
               "per step\n",
               B, gen, npp, B * gen / (w2 - w1), (c2 - c1) * 1e3 / gen);
    fflush(stdout);
    for (int j = 0; j < B; j++) kv_seq_destroy(kv, ss[j]);
    return 0;
}

/* Speculative verification's step: one sequence, k consecutive tokens, logits for every one
 * of them; wall and CPU ms per step and per token, for each k. */
static int bk_engine_verify(en_engine *e, int n_vocab)
{
    kv_store *kv = en_engine_kv(e);
    static const int ks[] = {1, 2, 4, 5, 8, 12, 16};
    int32_t tok[256], pos[256];
    kv_seq *seqs[256];
    uint8_t want[256];
    memset(want, 1, sizeof want);
    for (int i = 0; i < 256; i++) tok[i] = (int32_t)(bk_u32() % (uint32_t)n_vocab);
    const float *lg;
    for (size_t q = 0; q < sizeof ks / sizeof *ks; q++) {
        const int k = ks[q], steps = 24;
        kv_seq *s;
        if (kv_seq_create(kv, &s)) return 1;
        for (int i = 0; i < 256; i++) pos[i] = i, seqs[i] = s;
        en_batch pb = {.n_tokens = 256, .tokens = tok, .pos = pos, .seqs = seqs};
        if (en_engine_step(e, &pb, &lg) < 0) return 1;
        const double w0 = bk_wall(), c0 = bk_proc_cpu();
        for (int g = 0; g < steps; g++) {
            for (int i = 0; i < k; i++) pos[i] = 256 + g * k + i;
            en_batch b = {.n_tokens = k, .tokens = tok, .pos = pos, .seqs = seqs, .logits = want};
            if (en_engine_step(e, &b, &lg) < 0) return 1;
        }
        const double w = (bk_wall() - w0) * 1e3 / steps, c = (bk_proc_cpu() - c0) * 1e3 / steps;
        printf(
            "engine verify k=%2d: %.2f ms wall per step (%.2f per token), %.2f ms cpu per step\n",
            k, w, w / k, c);
        fflush(stdout);
        kv_seq_destroy(kv, s);
    }
    return 0;
}

/* Decode and verify steps at a long context (L): one sequence through a prompt of n_ctx tokens
 * (512 per step), then ms per step (wall, CPU) of batch-1 decode and of k = 4 verification
 * (three drafts) over f16 KV, then of batch-1 decode once every page is converted to int4 (what
 * a self-speculation draft reads): where attention over a long context weighs on a step, the
 * int4 decode is cheaper than the f16 one by what its KV saves. Each phase steps from n_ctx
 * again (the sequence truncated back), so all read the same context. */
static int bk_engine_long(en_engine *e, int n_vocab, int n_ctx)
{
    kv_store *kv = en_engine_kv(e);
    enum { STEPS = 16, CHUNK = 512 };
    int32_t tok[CHUNK], pos[CHUNK];
    kv_seq *seqs[CHUNK];
    uint8_t want[CHUNK];
    memset(want, 1, sizeof want);
    for (int i = 0; i < CHUNK; i++) tok[i] = (int32_t)(bk_u32() % (uint32_t)n_vocab);
    kv_seq *s;
    if (kv_seq_create(kv, &s)) return 1;
    const float *lg;
    for (int i = 0; i < CHUNK; i++) seqs[i] = s;
    const double pw0 = bk_wall(), pc0 = bk_proc_cpu();
    for (int at = 0; at < n_ctx; at += CHUNK) {
        const int n = n_ctx - at < CHUNK ? n_ctx - at : CHUNK;
        for (int i = 0; i < n; i++) pos[i] = at + i;
        en_batch b = {.n_tokens = n, .tokens = tok, .pos = pos, .seqs = seqs};
        if (en_engine_step(e, &b, &lg) < 0) return 1;
    }
    printf("engine prefill of %d tokens (%d per step): %.2f s wall, %.2f s cpu\n", n_ctx, CHUNK,
           bk_wall() - pw0, bk_proc_cpu() - pc0);
    static const struct {
        const char *what;
        int k, int4;
    } ph[] = {{"decode f16 KV ", 1, 0}, {"verify f16 k=4", 4, 0}, {"decode int4 KV", 1, 1}};
    for (size_t q = 0; q < sizeof ph / sizeof *ph; q++) {
        if (ph[q].int4 && kv_store_convert(kv, KN_KV_INT4) < 0) return 1;
        const int k = ph[q].k;
        const double w0 = bk_wall(), c0 = bk_proc_cpu();
        for (int g = 0; g < STEPS; g++) {
            for (int i = 0; i < k; i++) pos[i] = n_ctx + g * k + i;
            en_batch b = {.n_tokens = k, .tokens = tok, .pos = pos, .seqs = seqs, .logits = want};
            if (en_engine_step(e, &b, &lg) < 0) return 1;
        }
        const double w = (bk_wall() - w0) * 1e3 / STEPS, c = (bk_proc_cpu() - c0) * 1e3 / STEPS;
        printf("engine at context %d, %s: %.2f ms wall per step, %.2f ms cpu per step\n", n_ctx,
               ph[q].what, w, c);
        fflush(stdout);
        kv_seq_truncate(kv, s, n_ctx);
    }
    kv_seq_destroy(kv, s);
    return 0;
}

static int bk_engine(const char *path, int threads, const char *what)
{
    en_model *m;
    en_engine *e;
    km_errbuf err;
    const double t0 = bk_wall();
    if (en_model_load(path, &m, &err)) {
        fprintf(stderr, "bench_kernels: %s\n", err.msg);
        return 1;
    }
    en_engine_opts o = {.n_threads = threads};
    if (en_engine_create(m, &o, &e, &err)) {
        fprintf(stderr, "bench_kernels: %s\n", err.msg);
        return 1;
    }
    printf("engine %s threads=%d isa=%s: load and pack %.0f ms\n", en_model_name(m), threads,
           en_engine_isa(e), (bk_wall() - t0) * 1e3);
    const int n_vocab = en_model_hparams(m)->n_vocab;
    int rc = 0;
    const char *L = strchr(what, 'L'); /* L, or L<context>: L8192 */
    const int n_long = L && atoi(L + 1) > 0 ? atoi(L + 1) : 4096;
    char phases[32]; /* the letters, without L's number (the digits right after L) */
    size_t k = 0;
    for (const char *c = what; *c && k + 1 < sizeof phases; c++)
        if (!(L && c > L && c <= L + strspn(L + 1, "0123456789"))) phases[k++] = *c;
    phases[k] = 0;
    what = phases;
    if (strchr(what, '1')) rc |= bk_engine_phase(e, n_vocab, 1, 0, 128);
    if (strchr(what, '8')) rc |= bk_engine_phase(e, n_vocab, 8, 128, 64);
    if (strchr(what, '3')) rc |= bk_engine_phase(e, n_vocab, 32, 128, 32);
    if (strchr(what, 'D')) rc |= bk_engine_phase(e, n_vocab, 8, 128, 512); /* for profiles */
    if (strchr(what, 'v')) rc |= bk_engine_verify(e, n_vocab);
    if (L) rc |= bk_engine_long(e, n_vocab, n_long);
    en_engine_destroy(e);
    en_model_free(m);
    return rc;
}

static int bk_parse_list(const char *s, int *out, int max)
{
    int n = 0;
    while (*s && n < max) {
        out[n++] = atoi(s);
        while (*s && *s != ',') s++;
        if (*s == ',') s++;
    }
    return n;
}

int main(int argc, char **argv)
{
    int isa_only = -1, type_only = -1, quant = 0, unpacked = 0;
    int ms[16] = {1, 8, 32, 128, 512}, n_ms = 5;
    struct {
        md_type t;
        int64_t rows, k;
    } shapes[16] = {{MD_TYPE_Q4_1, 576, 576},
                    {MD_TYPE_Q4_1, 1536, 576},
                    {MD_TYPE_Q4_1, 576, 1536},
                    {MD_TYPE_Q8_0, 49152, 576}};
    int n_shapes = 4, custom_shape = 0;
    int64_t cs_rows = 0, cs_k = 0;
    for (int a = 1; a < argc; a++) {
        if (!strcmp(argv[a], "-i") && a + 1 < argc) {
            const char *v = argv[++a];
            isa_only = !strcmp(v, "scalar") ? 0
                       : !strcmp(v, "avx2") ? 1
                       : !strcmp(v, "ggml") ? KN_ISA_COUNT
                                            : 2;
        } else if (!strcmp(argv[a], "-t") && a + 1 < argc) {
            const char *v = argv[++a];
            for (int i = 0; i < BK_NTYPES; i++)
                if (!strcmp(v, bk_types[i].name)) type_only = (int)bk_types[i].t;
        } else if (!strcmp(argv[a], "-m") && a + 1 < argc) {
            n_ms = bk_parse_list(argv[++a], ms, 16);
        } else if (!strcmp(argv[a], "-s") && a + 1 < argc) {
            int v[2] = {0, 0};
            bk_parse_list(argv[++a], v, 2);
            cs_rows = v[0];
            cs_k = v[1];
            custom_shape = 1;
        } else if (!strcmp(argv[a], "-q")) {
            quant = 1;
        } else if (!strcmp(argv[a], "-u")) {
            unpacked = 1;
        } else if (!strcmp(argv[a], "-a")) {
            return bk_attention(a + 1 < argc && !strcmp(argv[a + 1], "-c"));
        } else if (!strcmp(argv[a], "-p")) {
            return bk_pool();
        } else if (!strcmp(argv[a], "-x")) {
            return bk_hash();
        } else if (!strcmp(argv[a], "-b") && a + 1 < argc) {
            return bk_bandwidth(atoi(argv[a + 1]));
        } else if (!strcmp(argv[a], "-w") && a + 1 < argc) {
            return bk_weight_bytes(argv[a + 1]);
        } else if (!strcmp(argv[a], "-e") && a + 2 < argc) {
            return bk_engine(argv[a + 1], atoi(argv[a + 2]), a + 3 < argc ? argv[a + 3] : "p183");
        } else {
            fprintf(
                stderr,
                "usage: %s [-i isa] [-t type] [-m 1,8,..] [-s rows,k] [-q] [-u] | -a [-c] | -p | "
                "-x | -b THREADS | -w MODEL | -e MODEL THREADS [p183DvL]\n",
                argv[0]);
            return 2;
        }
    }
    if (type_only >= 0) {
        if (custom_shape) {
            shapes[0].t = (md_type)type_only;
            shapes[0].rows = cs_rows;
            shapes[0].k = cs_k;
            n_shapes = 1;
        } else {
            for (int s = 0; s < n_shapes; s++) shapes[s].t = (md_type)type_only;
        }
    } else if (custom_shape) {
        shapes[0].rows = cs_rows;
        shapes[0].k = cs_k;
        n_shapes = 1;
    }

#ifdef KN_BENCH_GGML
    ggml_cpu_init();
#endif
    printf("%-11s %-5s %6s %5s %4s %10s %10s\n", "isa", "type", "rows", "k", "m", "us/call",
           "GFLOP/s");
    for (int s = 0; s < n_shapes; s++) {
        const md_type wt = shapes[s].t, dt = kn_dot_type(wt);
        const int64_t rows = shapes[s].rows, k = shapes[s].k;
        int max_m = 1;
        for (int i = 0; i < n_ms; i++) max_m = ms[i] > max_m ? ms[i] : max_m;
        const size_t ws = bk_row_bytes(wt, k), xs = bk_row_bytes(dt, k);
        uint8_t *w = malloc(ws * (size_t)rows), *x = malloc(xs * (size_t)max_m);
        float *xf = malloc(sizeof(float) * (size_t)(k * max_m));
        float *y = malloc(sizeof(float) * (size_t)(rows * max_m));
        bk_fill_weights(wt, w, ws * (size_t)rows, rows, ws);
        for (int64_t j = 0; j < k * max_m; j++) xf[j] = bk_unif();
        for (int i = 0; i < max_m; i++)
            kn_ops_get(KN_ISA_SCALAR)->quantize_row(dt, xf + (int64_t)i * k, x + (size_t)i * xs, k);
        for (int isa = 0; isa < KN_ISA_COUNT; isa++) {
            const kn_ops *ops = kn_ops_get((kn_isa)isa);
            if (!ops || (isa_only >= 0 && isa != isa_only)) continue;
            /* the packed matrix is what the engine runs; -u also times matmul on the rows */
            const size_t psize = ops->pack_size(wt, rows, k);
            void *packed = NULL;
            if (psize) {
                packed = aligned_alloc(64, (psize + 63) & ~(size_t)63);
                ops->pack(wt, w, ws, rows, k, packed);
            }
            for (int pass = 0; pass < 2; pass++) {
                const void *pk = pass == 0 ? packed : NULL;
                if (pass == 0 && !packed) continue;
                if (pass == 1 && packed && !unpacked) continue;
                char label[32];
                snprintf(label, sizeof label, "%s%s", ops->name, pk || !psize ? "" : "-rows");
                for (int mi = 0; mi < n_ms; mi++) {
                    const int m = ms[mi];
                    /* the scalar reference is slow: time it on a slice of the rows */
                    int64_t r1 = rows;
                    if (isa == KN_ISA_SCALAR) {
                        const double est = 2.0 * (double)m * (double)rows * (double)k / 1.5e9;
                        if (est > 0.05) r1 = (int64_t)((double)rows * 0.05 / est) / 16 * 16 + 16;
                        if (r1 > rows) r1 = rows;
                    }
                    const double t = bk_time(ops, wt, w, ws, pk, rows, x, xs, k, m, y, 0, r1, 0.01);
                    printf("%-11s %-5s %6lld %5lld %4d %10.1f %10.2f%s\n", label,
                           bk_types[bk_type_index(wt)].name, (long long)rows, (long long)k, m,
                           t * 1e6, 2.0 * m * (double)r1 * (double)k / t * 1e-9,
                           r1 < rows ? " (row slice)" : "");
                    fflush(stdout);
                }
            }
            free(packed);
            if (quant) {
                const int m = max_m;
                ops->quantize_row(dt, xf, x, k);
                double best = 1e30;
                for (int rep = 0; rep < 5; rep++) {
                    const double t0 = bk_now();
                    for (int i = 0; i < m; i++)
                        ops->quantize_row(dt, xf + (int64_t)i * k, x + (size_t)i * xs, k);
                    const double t1 = bk_now() - t0;
                    best = t1 < best ? t1 : best;
                }
                printf("%-7s quantize %s: %d rows of %lld in %.1f us (%.2f Gelem/s)\n", ops->name,
                       bk_types[bk_type_index(dt)].name, m, (long long)k, best * 1e6,
                       (double)m * (double)k / best * 1e-9);
            }
        }
#ifdef KN_BENCH_GGML
        if (isa_only < 0 || isa_only == KN_ISA_COUNT) /* -i ggml */
            bk_ggml_compare(wt, w, ws, x, xs, xf, k, max_m, rows, ms, n_ms);
#endif
        free(w);
        free(x);
        free(xf);
        free(y);
    }
    return 0;
}
